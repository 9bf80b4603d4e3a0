//! Runs the fuzz target bodies over the checked-in seed corpus (`fuzz/seeds/`),
//! so CI exercises them on stable Rust without libFuzzer.

use std::path::PathBuf;

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/seeds")
        .join(target);
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no seeds in {}", dir.display());
    out
}

#[test]
fn workflow_target_survives_its_seeds() {
    for (name, bytes) in seeds("workflow") {
        eprintln!("seed {name}");
        sluice_compiler::fuzz::workflow_definition(&bytes);
        // Every prefix too: truncated input is the commonest malformed input.
        for cut in (0..bytes.len()).step_by(7) {
            sluice_compiler::fuzz::workflow_definition(&bytes[..cut]);
        }
    }
}

#[test]
fn logic_target_survives_its_seeds() {
    for (name, bytes) in seeds("logic") {
        eprintln!("seed {name}");
        sluice_compiler::fuzz::logic_rule(&bytes);
        for cut in (0..bytes.len()).step_by(5) {
            sluice_compiler::fuzz::logic_rule(&bytes[..cut]);
        }
    }
}

#[test]
fn sql_target_survives_its_seeds() {
    for (name, bytes) in seeds("sql") {
        eprintln!("seed {name}");
        sluice_compiler::fuzz::sql_statement(&bytes);
        for cut in 0..bytes.len() {
            sluice_compiler::fuzz::sql_statement(&bytes[..cut]);
        }
    }
}
