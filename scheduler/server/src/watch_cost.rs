//! Benchmark (ignored in the test run): what the watches cost a replica
//! per applied entry, at 10,000 and at 1,000,000 jobs held, with 1,250
//! agent watches and job watches reading from the change index; next to
//! it, the previous reads (an agent watch scanned every allocation for its
//! node's, a job watch every held job for those changed after an index).
//!
//! ```text
//! cargo test --release -p rota-server --lib watch_cost -- --ignored --nocapture
//! ```

use std::time::Instant;

use rota_core::sim::bench::{build, finish_history, BenchShape};
use rota_core::state::auth::Actor;
use rota_core::state::{ClusterState, Command, JobSpec, Proposal};

use crate::agents::node_assignments;
use crate::jobs::changed_jobs;

const NODES: u32 = 1_250;
const JOB_WATCHERS: usize = 16;
const ENTRIES: usize = 200;
const SUBMITS_PER_ENTRY: usize = 16;

fn state_of(held_jobs: u64) -> ClusterState {
    let shape = BenchShape { nodes: NODES, gpus_per_node: 8, pending: 2_000, running: 8_000, groups: 40, seed: 7 };
    let (mut state, _) = build(&shape);
    state.limits.max_finished_jobs = held_jobs as usize;
    state.limits.max_live_jobs = held_jobs as usize + 100_000;
    state.limits.max_spec_bytes = 1 << 40;
    let mut index = state.applied_index + 1;
    let more = held_jobs.saturating_sub(state.jobs.len() as u64);
    finish_history(&mut state, &mut index, more);
    state
}

/// Microseconds per entry: apply one entry of submits, then every agent
/// watch's read and `JOB_WATCHERS` job watches' reads of what changed.
fn per_entry_us(state: &mut ClusterState, previous_reads: bool) -> (f64, f64) {
    let actor = Actor::unchecked("bench");
    let node_names: Vec<String> = state.nodes.keys().cloned().collect();
    let mut watched_to = state.applied_index;
    let mut apply_us = Vec::new();
    let mut watch_us = Vec::new();
    for _ in 0..ENTRIES {
        let index = state.applied_index + 1;
        let commands = (0..SUBMITS_PER_ENTRY).map(|_| Command::SubmitJob { request_id: None, spec: JobSpec::simple(&["x"]) }).collect();
        let at = Instant::now();
        state.apply_proposal(index, &Proposal { now_ms: state.now_ms, commands });
        apply_us.push(at.elapsed().as_secs_f64() * 1e6);
        let at = Instant::now();
        let mut ranks = 0;
        for node in &node_names {
            ranks += if previous_reads {
                state.allocs.values().filter(|a| a.ranks.iter().any(|r| &r.node == node)).count()
            } else {
                node_assignments(state, node).len()
            };
        }
        let mut seen = 0;
        for _ in 0..JOB_WATCHERS {
            seen += if previous_reads {
                state.jobs.values().filter(|job| job.changed_at_index > watched_to).count()
            } else {
                changed_jobs(state, &actor, (watched_to, u64::MAX)).jobs.len()
            };
        }
        watch_us.push(at.elapsed().as_secs_f64() * 1e6);
        assert!(ranks > 0 && seen == SUBMITS_PER_ENTRY * JOB_WATCHERS, "ranks {ranks}, jobs seen {seen}");
        watched_to = index;
    }
    (median(apply_us), median(watch_us))
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

#[test]
#[ignore = "benchmark: a minute and a few GiB"]
fn watch_cost_per_applied_entry_from_10k_to_1m_jobs() {
    for held in [10_000u64, 100_000, 1_000_000] {
        let mut state = state_of(held);
        let allocs = state.allocs.len();
        let (apply_us, watch_us) = per_entry_us(&mut state, false);
        let (_, previous_us) = per_entry_us(&mut state, true);
        println!(
            "{} jobs held, {allocs} allocations on {NODES} nodes: per entry of {SUBMITS_PER_ENTRY} submits: apply {apply_us:.0} us; \
             {NODES} agent watches + {JOB_WATCHERS} job watches {watch_us:.0} us (the previous scans: {previous_us:.0} us); medians of {ENTRIES}",
            state.jobs.len()
        );
    }
}
