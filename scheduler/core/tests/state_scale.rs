//! The state at the size of a year of a large cluster: what a frozen copy,
//! a snapshot and its decode cost, and how many bytes a job takes.
//!
//! The test run in CI builds a small state and checks that a frozen copy is
//! independent of the live state and that its snapshot restores it. The
//! benchmark (ignored) builds 1,000,000 finished and 50,000 pending jobs:
//!
//! ```text
//! cargo test --release -p rota-core --test state_scale -- --ignored --nocapture
//! ROTA_SCALE_FINISHED=200000 ROTA_SCALE_PENDING=50000 cargo test ... (smaller)
//! ```

use std::time::Instant;

use rota_core::sim::bench::{build_history, fleet_registrations, submit_history};
use rota_core::state::{ClusterState, Command, Proposal, StateLimits};

/// The allocator the `rota` binary runs with, so the figures are a replica's.
#[global_allocator]
static ALLOCATOR: rota_alloc::Allocator = rota_alloc::Allocator;

#[test]
fn a_frozen_copy_is_independent_and_its_snapshot_restores_it() {
    let (mut state, mut index) = build_history(3_000, 1_000);
    let frozen = state.clone();
    let before = frozen.jobs.len();
    submit_history(&mut state, &mut index, 1_024);
    state.apply_proposal(index, &Proposal { now_ms: index, commands: vec![Command::CancelJob { job_id: 3_500 }] });
    assert_eq!(frozen.jobs.len(), before, "the frozen copy does not see later submits");
    assert!(!frozen.jobs[&3_500].state.is_final(), "nor a later cancel");
    assert!(state.jobs[&3_500].state.is_final());
    let restored = ClusterState::from_snapshot(&frozen.to_snapshot()).expect("decodes");
    restored.check_invariants().expect("consistent");
    assert_eq!(restored, frozen);
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("resident pages");
    pages * 4096
}

/// What a registered node of 8 GPUs costs the replicated state: resident
/// bytes and snapshot bytes per node.
fn node_bytes(nodes: u32) {
    let rss_before = resident_bytes();
    let mut state = ClusterState::new(StateLimits::default());
    let empty_snapshot = state.to_snapshot().len();
    state.apply_proposal(1, &Proposal { now_ms: 1, commands: fleet_registrations(nodes, 8) });
    assert_eq!(state.nodes.len(), nodes as usize, "every node registered");
    let rss_after = resident_bytes();
    let snapshot = state.to_snapshot().len();
    println!(
        "{nodes} nodes of 8 GPUs: resident bytes per node {:.0}; snapshot bytes per node {:.0}",
        rss_after.saturating_sub(rss_before) as f64 / f64::from(nodes.max(1)),
        (snapshot - empty_snapshot) as f64 / f64::from(nodes.max(1)),
    );
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
#[ignore = "benchmark: minutes and several GiB"]
fn state_copy_and_snapshot_at_scale() {
    let finished = env_count("ROTA_SCALE_FINISHED", 1_000_000);
    let pending = env_count("ROTA_SCALE_PENDING", 50_000);
    // First, while freed memory cannot be reused and hide the growth.
    node_bytes(env_count("ROTA_SCALE_NODES", 1_250) as u32);
    let rss_empty = resident_bytes();
    let (pending_only, _) = build_history(0, pending);
    let rss_pending = resident_bytes();
    let started = Instant::now();
    let (finished_only, _) = build_history(finished, 0);
    let rss_both = resident_bytes();
    println!("built {finished} finished jobs in {:.1} s", started.elapsed().as_secs_f64());
    println!(
        "resident bytes per pending job: {:.0}; per finished job: {:.0} (rss {} MiB empty, {} MiB with both states)",
        (rss_pending - rss_empty) as f64 / pending.max(1) as f64,
        (rss_both - rss_pending) as f64 / finished.max(1) as f64,
        rss_empty >> 20,
        rss_both >> 20,
    );
    drop(pending_only);
    drop(finished_only);

    let (mut state, mut index) = build_history(finished, pending);
    println!("state: {} jobs held, {} live, rss {} MiB", state.jobs.len(), state.live_jobs, resident_bytes() >> 20);
    let clone_us = median(
        (0..101)
            .map(|_| {
                let at = Instant::now();
                let copy = state.clone();
                let us = at.elapsed().as_secs_f64() * 1e6;
                drop(copy);
                us
            })
            .collect(),
    );
    let encode = Instant::now();
    let bytes = state.to_snapshot();
    let encode_ms = encode.elapsed().as_secs_f64() * 1e3;
    let decode = Instant::now();
    let restored = ClusterState::from_snapshot(&bytes).expect("decodes");
    let check = Instant::now();
    restored.check_invariants().expect("consistent");
    let check_ms = check.elapsed().as_secs_f64() * 1e3;
    let decode_ms = decode.elapsed().as_secs_f64() * 1e3;
    let dropping = Instant::now();
    drop(restored);
    println!("dropping a whole decoded state: {:.0} ms", dropping.elapsed().as_secs_f64() * 1e3);
    println!("of the decode, checking the invariants: {check_ms:.0} ms");
    println!("frozen copy (the lock's share of a snapshot now): median {clone_us:.1} us of 101");
    println!("encode (the lock's share of a snapshot before): {encode_ms:.0} ms, {} MiB", bytes.len() >> 20);
    println!("decode and check (a snapshot install, off the lock now): {decode_ms:.0} ms");

    // Apply with a frozen copy alive pays for the paths it copies.
    let rounds = 20;
    let mut alone = Vec::new();
    let mut beside_copy = Vec::new();
    for _ in 0..rounds {
        let at = Instant::now();
        submit_history(&mut state, &mut index, 2_048);
        alone.push(at.elapsed().as_secs_f64() * 1e3);
        let copy = state.clone();
        let at = Instant::now();
        submit_history(&mut state, &mut index, 2_048);
        beside_copy.push(at.elapsed().as_secs_f64() * 1e3);
        drop(copy);
    }
    println!(
        "2,048 submits applied: median {:.1} ms alone, {:.1} ms just after a frozen copy ({rounds} rounds each, alternating)",
        median(alone),
        median(beside_copy)
    );
}
