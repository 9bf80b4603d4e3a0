//! The `sluice` command line: the service and its tools.
//!
//! - `sluice serve` (the default): run the service.
//! - `sluice migrate`: apply the storage migrations and exit.
//! - `sluice lint <file>...`: check definitions; prints the error envelope for each bad file.
//! - `sluice dry-run --workflow <file> --payload <file> [--metadata <file>]`: run a workflow offline.
//! - `sluice logic --rule '<json>' --data '<json>'`: evaluate a JSONLogic rule.
//! - `sluice schema <workflow|channel|connector>`: print a definition's JSON Schema.
//! - `sluice test <file-or-dir>...`: run workflow test files offline.
//! - `sluice apply --server <url> [--api-key <key>] [--prune] [--dry-run] [--rollout <pct>] <dir>`:
//!   make a running Sluice match a directory of definitions.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

use sluice::{app, cli, config, server, telemetry};

/// mimalloc for the whole process: each request still allocates a few
/// buffers (hyper's, the response body, header maps, the handler's box),
/// and glibc's malloc/free cost about 2.3k instructions per reference
/// request of the 76k (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// mimalloc's `GlobalAlloc`, like the `mimalloc` crate's except that a
/// request whose alignment every block has anyway (at most 16 bytes, and no
/// more than its size: mimalloc's blocks of 16 bytes and up are 16-aligned,
/// smaller ones are aligned to their size class) goes to plain `mi_malloc`.
/// The crate sends everything through `mi_malloc_aligned`, which in
/// mimalloc 3 over-allocates every block above 1 KiB whose size class is
/// not a power of two (the response body, hyper's read buffer, the
/// handler's box): about 1k instructions per reference request, and frees
/// through the slow path too. mimalloc 2 does not, but its reloads were
/// 2.8 times slower and its RSS grew under load (docs/benchmarks.md).
struct MiMalloc;

const MI_MAX_ALIGN_SIZE: usize = 16;

#[inline(always)]
fn plain(align: usize, size: usize) -> bool {
    align <= MI_MAX_ALIGN_SIZE && align <= size
}

// SAFETY: every pointer handed out comes from mimalloc with at least the
// layout's size and alignment (see `plain`), and is freed or reallocated
// by mimalloc, which accepts blocks from any of its allocation functions.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for MiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys::{mi_malloc, mi_malloc_aligned};
        // SAFETY: plain C allocation calls; mimalloc handles any size.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi_malloc(layout.size()).cast()
            } else {
                mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        use libmimalloc_sys::{mi_zalloc, mi_zalloc_aligned};
        // SAFETY: as in `alloc`.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi_zalloc(layout.size()).cast()
            } else {
                mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from this allocator (the caller's contract).
        unsafe { libmimalloc_sys::mi_free(ptr.cast()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        use libmimalloc_sys::{mi_realloc, mi_realloc_aligned};
        // SAFETY: `ptr` came from this allocator with `layout` (the
        // caller's contract); the new block keeps the alignment.
        unsafe {
            if plain(layout.align(), new_size) {
                mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Runs business logic declared as JSON"
)]
struct Cli {
    /// Configuration file for serve and migrate (default: ./sluice.toml if present).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the service (the default).
    Serve {
        /// Configuration file (default: ./sluice.toml if present).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Apply the storage migrations and exit.
    Migrate {
        /// Configuration file (default: ./sluice.toml if present).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check workflow, channel or connector definition files.
    Lint {
        /// Definition files (JSON or YAML).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Run a workflow definition on a payload, offline, and print the dry-run answer (exit status 1 when the run failed).
    DryRun {
        /// The workflow definition (JSON or YAML).
        #[arg(long)]
        workflow: PathBuf,
        /// The payload itself (JSON): what `parse_json` reads as `payload`, not an API body `{"data": …}`.
        #[arg(long)]
        payload: PathBuf,
        /// The request's metadata, `{headers?, query?, path?}` (JSON).
        #[arg(long)]
        metadata: Option<PathBuf>,
    },
    /// Print the JSON Schema (draft 2020-12) of a definition kind.
    Schema {
        /// workflow, channel or connector
        kind: String,
    },
    /// Run workflow test files (*.test.json, *.test.yaml, *.test.yml) offline, with connector stubs.
    Test {
        /// Test files, or directories searched for them.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Make a running Sluice match a directory of definitions (connectors/, workflows/, channels/).
    Apply {
        /// Base URL of the server, e.g. http://localhost:8080
        #[arg(long)]
        server: String,
        /// Admin API key (default: the SLUICE_API_KEY environment variable).
        #[arg(long)]
        api_key: Option<String>,
        /// Archive active workflows and channels the directory does not have.
        #[arg(long)]
        prune: bool,
        /// Print the plan without changing anything.
        #[arg(long)]
        dry_run: bool,
        /// Activate new versions of existing workflows for this share of traffic (1..100).
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100))]
        rollout: Option<u8>,
        /// The directory of definitions.
        dir: PathBuf,
    },
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
    let command = cli.command.unwrap_or(Command::Serve { config: None });
    // `--config` goes before or after `serve`/`migrate`, once. The tools
    // that need no server read no configuration: a `--config` given to
    // them would be silently ignored.
    let config = match (&command, cli.config) {
        (Command::Serve { config: Some(_) } | Command::Migrate { config: Some(_) }, Some(_)) => {
            sluice::errln!("error: --config given twice");
            return ExitCode::from(2);
        }
        (Command::Serve { config } | Command::Migrate { config }, top) => config.clone().or(top),
        (_, Some(_)) => {
            sluice::errln!("error: --config applies to serve and migrate only");
            return ExitCode::from(2);
        }
        (_, None) => None,
    };
    match command {
        Command::Serve { .. } => with_config(config, |config| runtime()?.block_on(serve(config))),
        Command::Migrate { .. } => {
            with_config(config, |config| runtime()?.block_on(migrate(config)))
        }
        Command::Lint { files } => cli::lint(&files),
        Command::DryRun {
            workflow,
            payload,
            metadata,
        } => cli::dry_run(&workflow, &payload, metadata.as_deref()),
        Command::Schema { kind } => match cli::schema(&kind) {
            Ok(out) => {
                sluice::outln!("{out}");
                ExitCode::SUCCESS
            }
            Err(message) => {
                sluice::errln!("error: {message}");
                ExitCode::from(2)
            }
        },
        Command::Test { paths } => sluice::testing::run(&paths),
        Command::Apply {
            server,
            api_key,
            prune,
            dry_run,
            rollout,
            dir,
        } => sluice::apply::run(&sluice::apply::ApplyOptions {
            server,
            api_key: api_key.or_else(|| {
                std::env::var("SLUICE_API_KEY")
                    .ok()
                    .filter(|k| !k.is_empty())
            }),
            dir,
            prune,
            dry_run,
            rollout,
        }),
        Command::Logic { rule, data } => match cli::logic(&rule, &data) {
            Ok(out) => {
                sluice::outln!("{out}");
                ExitCode::SUCCESS
            }
            Err(message) => {
                sluice::errln!("error: {message}");
                ExitCode::FAILURE
            }
        },
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(sluice::engine::THREAD_STACK_BYTES)
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

fn with_config(
    path: Option<PathBuf>,
    run: impl FnOnce(config::Config) -> Result<(), String>,
) -> ExitCode {
    let config = match config::Config::load(path.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            sluice::errln!("{e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(&config.logging);
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            sluice::errln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn migrate(config: config::Config) -> Result<(), String> {
    sluice::open_store(&config).await?.shutdown().await;
    sluice::outln!(
        "migrations applied ({})",
        config.storage.url.split("://").next().unwrap_or("storage")
    );
    Ok(())
}

async fn serve(config: config::Config) -> Result<(), String> {
    let host = &config.server.host;
    // An IPv6 address is bracketed before its port is appended.
    let addr = if host.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{host}]:{}", config.server.port)
    } else {
        format!("{host}:{}", config.server.port)
    };
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} (server.host, server.port): {e}"))?;
    // The address actually bound (port 0 picks one).
    let addr = listener.local_addr().map_or(addr, |a| a.to_string());
    // Held while the process serves.
    let _sqlite_lock = lock_sqlite_file(&config.storage.url)?;
    // Probes are answered (not ready) while storage and the engine come up.
    let app = server::while_starting(&listener, sluice::start(config)).await?;
    tracing::info!(%addr, version = app::VERSION, "sluice is serving");
    server::run(listener, app.clone(), shutdown_signal()).await;
    // Leaves a SQLite database whole in its file (bounded: a connection
    // some task still holds must not keep the process from exiting).
    let closing = tokio::time::timeout(std::time::Duration::from_secs(5), app.store.shutdown());
    if closing.await.is_err() {
        tracing::warn!("storage connections not closed within 5 s");
    }
    Ok(())
}

/// SQLite serves one process: a second `sluice serve` on the same file
/// would serve its own engine, never told of the first one's changes. An
/// exclusive advisory lock on the database file (`flock`, which SQLite's
/// own `fcntl` locks do not see) refuses it at start. The file is created
/// here when missing, readable by its owner only, as the storage layer
/// would create it.
fn lock_sqlite_file(url: &str) -> Result<Option<std::fs::File>, String> {
    use std::str::FromStr as _;
    let is_sqlite = url
        .split_once(':')
        .is_some_and(|(s, _)| s.eq_ignore_ascii_case("sqlite"));
    if !is_sqlite || url.contains(":memory:") || url.contains("mode=memory") {
        return Ok(None);
    }
    let Ok(opts) = sqlx::sqlite::SqliteConnectOptions::from_str(url) else {
        // The storage layer reports a bad URL with its own message.
        return Ok(None);
    };
    let path = opts.get_filename();
    let mut open = std::fs::OpenOptions::new();
    open.read(true).write(true).create(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let Ok(file) = open.open(path) else {
        // Not creatable here (a missing directory): the storage layer says why.
        return Ok(None);
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Err(format!(
            "another sluice process is serving the SQLite database {} (SQLite serves one process; \
             use PostgreSQL or MySQL for several replicas)",
            path.display()
        )),
        // A file system without locks: go on as before.
        Err(std::fs::TryLockError::Error(_)) => Ok(None),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::MiMalloc;
    use std::alloc::{GlobalAlloc, Layout};

    /// Every size up to 5 KiB (both sides of the 1 KiB and 16-byte
    /// thresholds) with every alignment up to 4 KiB: the block has the
    /// alignment asked for, holds what is written to it, and keeps it
    /// through a growing and a shrinking `realloc`.
    #[test]
    #[allow(unsafe_code)]
    fn blocks_have_the_layout_asked_for() {
        let sizes = (1..=64)
            .chain((65..=5120).step_by(37))
            .chain([1024, 1025, 4096]);
        for size in sizes {
            for align in (0..=12).map(|p| 1usize << p) {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size; the block is written within its
                // size, reallocated with the layout it has, and freed once.
                unsafe {
                    let p = MiMalloc.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size}, align {align}");
                    std::ptr::write_bytes(p, 0xa5, size);
                    let grown = MiMalloc.realloc(p, layout, size * 3);
                    assert_eq!(
                        grown as usize % align,
                        0,
                        "grown: size {size}, align {align}"
                    );
                    assert!((0..size).all(|i| *grown.add(i) == 0xa5));
                    let grown_layout = Layout::from_size_align(size * 3, align).unwrap();
                    let shrunk = MiMalloc.realloc(grown, grown_layout, size.div_ceil(2));
                    assert_eq!(
                        shrunk as usize % align,
                        0,
                        "shrunk: size {size}, align {align}"
                    );
                    assert!((0..size.div_ceil(2)).all(|i| *shrunk.add(i) == 0xa5));
                    MiMalloc.dealloc(
                        shrunk,
                        Layout::from_size_align(size.div_ceil(2), align).unwrap(),
                    );
                    let z = MiMalloc.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "zeroed: size {size}, align {align}");
                    assert!((0..size).all(|i| *z.add(i) == 0));
                    MiMalloc.dealloc(z, layout);
                }
            }
        }
    }
}
