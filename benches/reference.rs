//! In-process execution of the reference workload (`shared/bench/reference`):
//! parse the request, select and run the plan, serialize `data`. Reports time
//! per execution (criterion) and heap allocations per execution (a counting
//! global allocator), and checks the result against `expected.json` first.

use criterion::Criterion;
use sluice_compiler::plan::{Plan, compile_workflow};
use sluice_runtime::connectors::{CallScope, Services};
use sluice_runtime::exec::{Execution, Input, Meta, Options, PayloadFrom, execute};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};

mod common;

/// Counts every allocation (and reallocation) made through the global allocator.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: delegates to the system allocator; only adds a relaxed counter.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const HEADERS: &[(&str, &str)] = &[
    ("content-type", "application/json"),
    ("x-request-id", "5f0c6a52-8d1e-4b7a-9c3e-2f4d6b8a1c0e"),
];
const PATH: &[(&str, &str)] = &[("order_id", "ord-7f3a9c")];

#[inline(never)]
fn run_once(
    plan: &Plan,
    body: &[u8],
    services: &Services,
    scope: &CallScope,
    options: &Options,
) -> Execution {
    let input = Input {
        body,
        payload_from: PayloadFrom::DataMember,
        meta: Meta {
            headers: HEADERS,
            query: &[],
            path: PATH,
            method: "POST",
            channel: "bench-orders",
            request_id: "5f0c6a52-8d1e-4b7a-9c3e-2f4d6b8a1c0e",
            extra: &[],
        },
        bucket: None,
    };
    futures_executor::block_on(execute(
        std::iter::once(plan),
        input,
        services,
        scope,
        options,
    ))
    .expect("request body is valid")
}

fn check_expected(exec: &Execution) {
    let data: serde_json::Value = serde_json::from_slice(&exec.data).unwrap();
    let order = &data["order"];
    let expected = common::read_json("bench/reference/expected.json");
    for (key, want) in expected.as_object().unwrap() {
        let got = &order[key];
        assert!(
            holds(want, got),
            "data.order.{key}: expected {want}, got {got}"
        );
    }
    assert!(
        exec.errors.is_empty(),
        "unexpected errors: {:?}",
        exec.errors
    );
}

fn main() {
    let mut workflow = common::read_json("bench/reference/workflow.json");
    // Profiling aid: `SLUICE_BENCH_TASKS=<k>` keeps the workflow's first k
    // tasks, so the instructions of each task are the difference between
    // two runs (docs/benchmarks.md, session 12).
    let tasks = std::env::var("SLUICE_BENCH_TASKS")
        .ok()
        .and_then(|k| k.parse::<usize>().ok());
    assert!(
        tasks.is_none() || std::env::var_os("SLUICE_BENCH_PROFILE").is_some(),
        "SLUICE_BENCH_TASKS is a profiling aid: set SLUICE_BENCH_PROFILE too"
    );
    if let Some(k) = tasks
        && let Some(list) = workflow["tasks"].as_array_mut()
    {
        list.truncate(k.max(1));
    }
    let body = common::read_bytes("bench/reference/request.json");
    let plan = compile_workflow(&workflow)
        .expect("reference workflow compiles")
        .plan;
    let services = Services::default();
    let scope = CallScope::default();
    let options = Options::default();

    let first = run_once(&plan, &body, &services, &scope, &options);
    if tasks.is_none() {
        check_expected(&first);
    }

    // Profiling aid (`valgrind --tool=callgrind --toggle-collect=reference::run_once`):
    // `SLUICE_BENCH_PROFILE=<n>` runs n executions and exits. A truncated
    // workflow (`SLUICE_BENCH_TASKS`) is only for that.
    if let Some(n) = std::env::var("SLUICE_BENCH_PROFILE")
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
    {
        for _ in 0..n {
            black_box(run_once(&plan, &body, &services, &scope, &options));
        }
        return;
    }

    // Allocations per execution, measured after warm-up (thread-local parser
    // buffers are reused from the second request on).
    for _ in 0..100 {
        black_box(run_once(&plan, &body, &services, &scope, &options));
    }
    let full = std::env::args().any(|a| a == "--bench");
    let runs = if full { 10_000u64 } else { 100 };
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..runs {
        black_box(run_once(&plan, &body, &services, &scope, &options));
    }
    let per_exec = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / runs as f64;
    println!("reference workload: {per_exec:.1} heap allocations per execution");

    let mut c = Criterion::default().configure_from_args();
    c.bench_function("reference_workload_execute", |b| {
        b.iter(|| {
            black_box(run_once(
                &plan,
                black_box(&body),
                &services,
                &scope,
                &options,
            ))
        })
    });
    c.final_summary();
}

/// `got` holds what `want` lists: objects by subset, numbers to 1e-6.
fn holds(want: &serde_json::Value, got: &serde_json::Value) -> bool {
    match (want, got) {
        (serde_json::Value::Object(w), serde_json::Value::Object(g)) => w
            .iter()
            .all(|(k, v)| g.get(k).is_some_and(|gv| holds(v, gv))),
        (serde_json::Value::Number(w), serde_json::Value::Number(g)) => {
            (w.as_f64().unwrap() - g.as_f64().unwrap()).abs() < 1e-6
        }
        _ => want == got,
    }
}
