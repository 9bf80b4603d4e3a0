//! Runs the runtime's fuzz target bodies over the checked-in seed corpus
//! (`fuzz/seeds/`), so CI exercises them on stable Rust without libFuzzer.

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
fn json_target_survives_its_seeds() {
    for (name, bytes) in seeds("json") {
        eprintln!("seed {name}");
        sluice_runtime::fuzz::json_body(&bytes);
        // Every prefix too: truncated input is the commonest malformed input.
        for cut in 0..bytes.len() {
            sluice_runtime::fuzz::json_body(&bytes[..cut]);
        }
    }
}

#[test]
fn xml_target_survives_its_seeds() {
    for (name, bytes) in seeds("xml") {
        eprintln!("seed {name}");
        sluice_runtime::fuzz::xml_document(&bytes);
        for cut in 0..bytes.len() {
            sluice_runtime::fuzz::xml_document(&bytes[..cut]);
        }
    }
}
