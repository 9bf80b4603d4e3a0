//! Profiling aid for the request parser and the response writer on the
//! reference workload (`shared/bench/reference`), without the server:
//!
//!   cargo build --release -p sluice-runtime --example json_profile
//!   valgrind --tool=callgrind target/release/examples/json_profile parse 1000
//!
//! Modes: `parse` parses the request body N times, `write` serializes the
//! reference response data N times (compact, into a 1 KiB buffer as
//! `Execution` does), `exec` runs the whole plan N times. Instructions per
//! operation: (count at N) − (count at 0), divided by N.

use bumpalo::Bump;
use sluice_compiler::plan::compile_workflow;
use sluice_runtime::connectors::{CallScope, Services};
use sluice_runtime::exec::{Input, Meta, Options, PayloadFrom, execute};
use sluice_runtime::json;
use std::hint::black_box;
use std::path::PathBuf;

fn shared(rel: &str) -> Vec<u8> {
    let dir = std::env::var_os("SLUICE_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let path = dir.join(rel);
    std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "exec".into());
    let n: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(1000);
    let body = shared("bench/reference/request.json");
    let workflow: serde_json::Value =
        serde_json::from_slice(&shared("bench/reference/workflow.json")).unwrap();
    let plan = compile_workflow(&workflow).unwrap().plan;
    let (services, scope, options) = (
        Services::default(),
        CallScope::default(),
        Options::default(),
    );
    let run = || {
        let input = Input {
            body: body.trim_ascii(),
            payload_from: PayloadFrom::DataMember,
            meta: Meta {
                headers: &[("content-type", "application/json")],
                query: &[],
                path: &[("order_id", "ord-7f3a9c")],
                method: "POST",
                channel: "bench-orders",
                request_id: "5f0c6a52-8d1e-4b7a-9c3e-2f4d6b8a1c0e",
                extra: &[],
            },
            bucket: None,
        };
        futures_executor::block_on(execute(
            std::iter::once(&plan),
            input,
            &services,
            &scope,
            &options,
        ))
        .unwrap()
    };
    let response = run().data;
    let mut arena = Bump::new();
    match mode.as_str() {
        "parse" => {
            for _ in 0..n {
                arena.reset();
                black_box(json::parse(black_box(body.trim_ascii()), &arena).unwrap());
            }
        }
        "write" => {
            let data = json::parse(&response, &arena).unwrap();
            let mut out = Vec::new();
            data.write_json(&mut out);
            assert_eq!(out, response, "the writer reproduces the response");
            for _ in 0..n {
                let mut out = Vec::with_capacity(1024);
                black_box(&data).write_json(&mut out);
                black_box(out);
            }
        }
        _ => {
            for _ in 0..n {
                black_box(run());
            }
        }
    }
}
