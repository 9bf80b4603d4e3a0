//! The `sluice` command line: the service and its tools.
//!
//! `sluice logic --rule '<json>' --data '<json>'` compiles a JSONLogic rule,
//! evaluates it against the data and prints the result as JSON. The service
//! subcommands (`serve`, `migrate`, `lint`, `dry-run`) arrive with the service.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cli;
mod storage;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Runs business logic declared as JSON"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a JSONLogic rule, evaluate it against data, print the result as JSON.
    Logic {
        /// The rule, as JSON text.
        #[arg(long)]
        rule: String,
        /// The data the rule reads, as JSON text.
        #[arg(long, default_value = "{}")]
        data: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Logic { rule, data } => cli::logic(&rule, &data),
    };
    match result {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
