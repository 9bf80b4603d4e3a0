//! Building the engine snapshot with 1,000 active workflows and their 1,000
//! channels (copies of the reference workload): the CPU part of a reload
//! (`sluice::engine::assemble`), cold (every plan compiled, as at start-up)
//! and warm (a reload after a change elsewhere: unchanged plans reused).
//! Definitions are given as stored text, as a reload reads them; a warm
//! build compares texts and parses none. The storage read that precedes it
//! is in the load benchmark's reload
//! figure (`benches/load/run.sh`), which goes through the admin API.

use criterion::Criterion;
use sluice::engine::{Snapshot, assemble};
use sluice::storage::{Record, Status, StoredRecord};
use std::hint::black_box;
use std::time::Instant;

mod common;

const WORKFLOWS: usize = 1000;

fn record(id: String, definition: serde_json::Value) -> Record {
    Record {
        id,
        version: 1,
        status: Status::Active,
        rollout_percentage: 100,
        definition,
        created_at: "2026-11-22T10:00:00Z".into(),
        updated_at: "2026-11-22T10:00:00Z".into(),
    }
}

fn main() {
    let workflow = common::read_json("bench/reference/workflow.json");
    let channel = common::read_json("bench/reference/channel.json");
    let mut workflows = Vec::with_capacity(WORKFLOWS);
    let mut channels = Vec::with_capacity(WORKFLOWS);
    for i in 0..WORKFLOWS {
        let (wid, cid) = (format!("reload-wf-{i:04}"), format!("reload-ch-{i:04}"));
        let mut w = workflow.clone();
        w["workflow_id"] = wid.clone().into();
        let mut c = channel.clone();
        c["channel_id"] = cid.clone().into();
        c["name"] = cid.clone().into();
        c["workflow_id"] = wid.clone().into();
        c["route_pattern"] = format!("/reload/{i:04}/{{order_id}}").into();
        workflows.push(record(wid, w));
        channels.push(record(cid, c));
    }
    // As a reload reads them: definitions as text. The warm builds get their
    // own copies (as from a fresh storage read), so reuse is decided by
    // comparing texts, not by pointer.
    let stored = |records: &[Record]| -> Vec<StoredRecord> {
        records.iter().map(StoredRecord::from).collect()
    };
    let (base_workflows, base_channels) = (stored(&workflows), stored(&channels));
    let (workflows, channels) = (stored(&workflows), stored(&channels));
    let empty = Snapshot::default();
    let started = Instant::now();
    let (warm_base, compiled) =
        assemble(&base_workflows, &base_channels, 1, &empty).expect("compiles");
    let cold_once = started.elapsed();
    assert_eq!(compiled, WORKFLOWS);
    assert_eq!(warm_base.channels.len(), WORKFLOWS);
    let (_, compiled) = assemble(&workflows, &channels, 2, &warm_base).expect("compiles");
    assert_eq!(compiled, 0, "a warm rebuild reuses every plan");
    println!(
        "engine build, {WORKFLOWS} workflows + {WORKFLOWS} channels: first cold build {:.1} ms",
        cold_once.as_secs_f64() * 1000.0
    );

    let mut c = Criterion::default().configure_from_args().sample_size(10);
    c.bench_function("engine_build_1000_cold", |b| {
        b.iter(|| black_box(assemble(&workflows, &channels, 3, &empty).unwrap()))
    });
    c.bench_function("engine_build_1000_warm", |b| {
        b.iter(|| black_box(assemble(&workflows, &channels, 3, &warm_base).unwrap()))
    });
    c.final_summary();
}
