//! JSONLogic evaluation: Sluice's compiled logic against `datalogic-rs` on the
//! same compiled expressions and the same pre-parsed data. Two workloads: the
//! official test suite's expressions (`shared/jsonlogic/tests.json`, cases both
//! engines evaluate without error) and the expressions of the reference
//! workflow over its request. Each iteration evaluates the whole set into a
//! fresh (reset) arena. After the criterion runs, the two engines are timed
//! alternately in one loop and the ratio `sluice / datalogic` is printed.

use bumpalo::Bump;
use criterion::Criterion;
use datalogic_rs::{Engine, ParsedData};
use sluice_compiler::{Value, logic};
use std::hint::black_box;
use std::time::{Duration, Instant};

mod common;

struct Case {
    rule: String,
    ours: logic::Logic,
    theirs: datalogic_rs::Logic,
    data: String,
}

/// The official suite's cases that both engines compile and evaluate.
fn suite_cases(engine: &Engine) -> Vec<Case> {
    let tests = common::read_json("jsonlogic/tests.json");
    tests
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t.as_array())
        .filter_map(|t| {
            let (rule, data) = (&t[0], &t[1]);
            let ours = logic::compile(rule).ok()?;
            let theirs = engine.compile(rule).ok()?;
            let data = data.to_string();
            let parsed = ParsedData::from_json(&data).ok()?;
            let arena = Bump::new();
            engine.evaluate(&theirs, &parsed, &arena).ok()?;
            let ours_data: serde_json::Value = serde_json::from_str(&data).ok()?;
            ours.eval(Value::from_json(&ours_data, &arena), &arena)
                .ok()?;
            Some(Case {
                rule: rule.to_string(),
                ours,
                theirs,
                data,
            })
        })
        .collect()
}

/// Every JSONLogic expression of the reference workflow (workflow condition,
/// task conditions, map logic, validation rules, filter), evaluated against
/// the context the workflow sees after parsing the reference request.
fn reference_cases(engine: &Engine) -> Vec<Case> {
    let workflow = common::read_json("bench/reference/workflow.json");
    let request = common::read_json("bench/reference/request.json");
    let context = serde_json::json!({
        "data": {"order": request["data"]},
        "metadata": {"headers": {"x-request-id": "r-1"}, "path": {"order_id": "ord-7f3a9c"}},
        "temp_data": {},
        "payload": request["data"],
    })
    .to_string();
    let mut rules = vec![workflow["condition"].clone()];
    for task in workflow["tasks"].as_array().unwrap() {
        if let Some(c) = task.get("condition") {
            rules.push(c.clone());
        }
        let input = &task["function"]["input"];
        for m in input["mappings"].as_array().into_iter().flatten() {
            rules.push(m["logic"].clone());
        }
        for r in input["rules"].as_array().into_iter().flatten() {
            rules.push(r["logic"].clone());
        }
        if let Some(c) = input.get("condition") {
            rules.push(c.clone());
        }
    }
    rules
        .iter()
        .map(|rule| Case {
            rule: rule.to_string(),
            ours: logic::compile(rule).expect("reference rule compiles"),
            theirs: engine
                .compile(rule)
                .expect("datalogic compiles reference rule"),
            data: context.clone(),
        })
        .collect()
}

struct Prepared<'a> {
    ours: Vec<(&'a logic::Logic, Value<'a>)>,
    theirs: Vec<(&'a datalogic_rs::Logic, ParsedData)>,
}

fn prepare<'a>(
    cases: &'a [Case],
    data_arena: &'a Bump,
    owned: &'a [serde_json::Value],
) -> Prepared<'a> {
    Prepared {
        ours: cases
            .iter()
            .zip(owned)
            .map(|(c, d)| (&c.ours, Value::from_json(d, data_arena)))
            .collect(),
        theirs: cases
            .iter()
            .map(|c| (&c.theirs, ParsedData::from_json(&c.data).unwrap()))
            .collect(),
    }
}

#[inline(never)]
fn run_ours(p: &Prepared<'_>, arena: &mut Bump) {
    for (logic, data) in &p.ours {
        black_box(logic.eval(*data, arena).ok());
    }
    arena.reset();
}

#[inline(never)]
fn run_theirs(engine: &Engine, p: &Prepared<'_>, arena: &mut Bump) {
    for (logic, data) in &p.theirs {
        black_box(engine.evaluate(logic, data, arena).ok());
    }
    arena.reset();
}

fn ratio(engine: &Engine, p: &Prepared<'_>) -> f64 {
    let (mut ours, mut theirs) = (Duration::ZERO, Duration::ZERO);
    let mut a = Bump::with_capacity(1 << 16);
    let mut b = Bump::with_capacity(1 << 16);
    for _ in 0..20 {
        let t = Instant::now();
        for _ in 0..500 {
            run_ours(p, &mut a);
        }
        ours += t.elapsed();
        let t = Instant::now();
        for _ in 0..500 {
            run_theirs(engine, p, &mut b);
        }
        theirs += t.elapsed();
    }
    ours.as_secs_f64() / theirs.as_secs_f64()
}

/// Profiling aid: `SLUICE_BENCH_PROFILE=<ours|theirs>:<suite|reference>:<passes>`
/// runs only that engine over that set (for `valgrind --tool=callgrind`);
/// `SLUICE_BENCH_CASES=<suite|reference>` prints each expression's time
/// ratio and its index (for the profile's fourth field), worst first.
fn profile(engine: &Engine, spec: &str) {
    let mut parts = spec.split(':');
    let (who, set, passes) = (
        parts.next().unwrap_or("ours"),
        parts.next().unwrap_or("suite"),
        parts.next().and_then(|p| p.parse().ok()).unwrap_or(1000),
    );
    let mut cases = if set == "reference" {
        reference_cases(engine)
    } else {
        suite_cases(engine)
    };
    // An optional fourth field picks one expression by index.
    if let Some(i) = parts.next().and_then(|p| p.parse::<usize>().ok()) {
        cases = vec![cases.swap_remove(i)];
    }
    let owned: Vec<serde_json::Value> = cases
        .iter()
        .map(|c| serde_json::from_str(&c.data).unwrap())
        .collect();
    let data_arena = Bump::new();
    let prepared = prepare(&cases, &data_arena, &owned);
    let mut arena = Bump::with_capacity(1 << 16);
    for _ in 0..passes {
        if who == "theirs" {
            run_theirs(engine, &prepared, &mut arena);
        } else {
            run_ours(&prepared, &mut arena);
        }
    }
}

fn per_case(engine: &Engine, set: &str) {
    let cases = if set == "reference" {
        reference_cases(engine)
    } else {
        suite_cases(engine)
    };
    let owned: Vec<serde_json::Value> = cases
        .iter()
        .map(|c| serde_json::from_str(&c.data).unwrap())
        .collect();
    let data_arena = Bump::new();
    let p = prepare(&cases, &data_arena, &owned);
    let mut arena = Bump::with_capacity(1 << 16);
    let mut rows = Vec::new();
    for i in 0..cases.len() {
        let (mut ours, mut theirs) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..2000 {
                black_box(p.ours[i].0.eval(p.ours[i].1, &arena).ok());
            }
            ours += t.elapsed();
            arena.reset();
            let t = Instant::now();
            for _ in 0..2000 {
                black_box(engine.evaluate(p.theirs[i].0, &p.theirs[i].1, &arena).ok());
            }
            theirs += t.elapsed();
            arena.reset();
        }
        rows.push((ours, theirs, i));
    }
    rows.sort_by(|a, b| {
        (b.0.as_secs_f64() - b.1.as_secs_f64()).total_cmp(&(a.0.as_secs_f64() - a.1.as_secs_f64()))
    });
    for (ours, theirs, i) in rows {
        println!(
            "{:7.1}ns {:7.1}ns {:5.2} {:4}  {}",
            ours.as_secs_f64() * 1e9 / 10_000.0,
            theirs.as_secs_f64() * 1e9 / 10_000.0,
            ours.as_secs_f64() / theirs.as_secs_f64(),
            i,
            cases[i].rule
        );
    }
}

fn main() {
    // `cargo bench` passes --bench; under `cargo test` this binary only
    // checks that every benchmark runs once (criterion's test mode).
    let full = std::env::args().any(|a| a == "--bench");
    let engine = Engine::new();
    if let Ok(spec) = std::env::var("SLUICE_BENCH_PROFILE") {
        profile(&engine, &spec);
        return;
    }
    if let Ok(set) = std::env::var("SLUICE_BENCH_CASES") {
        per_case(&engine, &set);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    let mut ratios = Vec::new();
    for (name, cases) in [
        ("official_suite", suite_cases(&engine)),
        ("reference_workflow", reference_cases(&engine)),
    ] {
        let owned: Vec<serde_json::Value> = cases
            .iter()
            .map(|c| serde_json::from_str(&c.data).unwrap())
            .collect();
        let data_arena = Bump::new();
        let prepared = prepare(&cases, &data_arena, &owned);
        let mut group = c.benchmark_group(format!("jsonlogic_{name}"));
        let mut arena = Bump::with_capacity(1 << 16);
        group.bench_function("sluice", |b| b.iter(|| run_ours(&prepared, &mut arena)));
        group.bench_function("datalogic_rs", |b| {
            b.iter(|| run_theirs(&engine, &prepared, &mut arena))
        });
        group.finish();
        if full {
            ratios.push((name, cases.len(), ratio(&engine, &prepared)));
        }
    }
    c.final_summary();
    for (name, n, r) in ratios {
        println!("jsonlogic {name} ({n} expressions): sluice / datalogic-rs time ratio = {r:.3}");
    }
}
