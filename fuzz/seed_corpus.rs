//! The checked-in seed corpus (`fuzz/seeds/<target>/`), run by the
//! compiler's and the runtime's `fuzz_seeds` tests (each includes this
//! file), so CI exercises the fuzz target bodies on stable Rust without
//! libFuzzer.

use std::path::PathBuf;

/// Runs `body` over every seed of `target`, and over every `step`-th prefix
/// of each: truncated input is the commonest malformed input.
pub fn run_seeds(target: &str, step: usize, body: impl Fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/seeds")
        .join(target);
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    for (name, bytes) in seeds {
        eprintln!("seed {name}");
        body(&bytes);
        for cut in (0..bytes.len()).step_by(step) {
            body(&bytes[..cut]);
        }
    }
}
