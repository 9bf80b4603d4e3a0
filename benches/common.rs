//! Shared helpers for the benchmarks: locating `../shared` and loading the
//! reference workload.

#![allow(dead_code)]

use std::path::PathBuf;

/// The `shared/` directory beside the repository (or `SLUICE_SHARED_DIR`).
pub fn shared_dir() -> PathBuf {
    std::env::var_os("SLUICE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared"))
}

pub fn read_json(rel: &str) -> serde_json::Value {
    let path = shared_dir().join(rel);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

pub fn read_bytes(rel: &str) -> Vec<u8> {
    let path = shared_dir().join(rel);
    std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}
