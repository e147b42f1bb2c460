//! A policy document tried before it is trusted: the recent finished jobs
//! (their arrivals and recorded run times) replayed in the simulator under
//! the active and under a proposed document, with per-group wait,
//! preemptions and GPU-hours side by side.
//!
//! The replay is the simulator's: the same cluster size, quotas and jobs,
//! so the difference between the two runs is the document's alone. It says
//! how the document orders and preempts this workload, not what the live
//! cluster will see (arrivals react to waits; run times vary).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::policy::PolicyConfig;
use crate::state::records::JobRecord;

use super::engine::{Outcome, SimConfig, Simulator};
use super::metrics::percentile;
use super::trace::TraceJob;

/// Jobs replayed at most (the newest are kept).
pub const MAX_DRY_RUN_JOBS: usize = 50_000;

/// What one run gave one group.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Figures {
    pub jobs: u64,
    pub mean_wait_s: f64,
    pub p90_wait_s: f64,
    pub preemptions: u64,
    pub gpu_hours: f64,
}

/// One group under both documents.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupComparison {
    pub group: String,
    pub active: Figures,
    pub proposed: Figures,
    /// "gains" (waits less on average), "loses" (waits more) or "same".
    pub verdict: &'static str,
}

/// The finished jobs that ran, as a trace: arrivals rebased to the
/// earliest, run time = finish - latest start, sorted by (arrival, id);
/// the newest `MAX_DRY_RUN_JOBS` at most.
pub fn trace_of(records: &[JobRecord]) -> Vec<TraceJob> {
    let mut ran: Vec<&JobRecord> =
        records.iter().filter(|r| r.gpus > 0 && r.started_ms.is_some() && r.finished_ms.is_some_and(|f| Some(f) > r.started_ms)).collect();
    ran.sort_by_key(|r| (r.submitted_ms, r.job_id));
    if ran.len() > MAX_DRY_RUN_JOBS {
        ran.drain(..ran.len() - MAX_DRY_RUN_JOBS);
    }
    let first_ms = ran.first().map_or(0, |r| r.submitted_ms);
    ran.iter()
        .map(|r| TraceJob {
            id: r.job_id.to_string(),
            submit_ms: r.submitted_ms - first_ms,
            gpus: u32::try_from(r.gpus).unwrap_or(u32::MAX),
            duration_ms: r.finished_ms.unwrap_or(0) - r.started_ms.unwrap_or(0),
            group: r.group.clone(),
        })
        .collect()
}

/// Per-group figures of one simulated run.
pub fn figures(trace: &[TraceJob], outcome: &Outcome) -> BTreeMap<String, Figures> {
    let mut waits: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut out: BTreeMap<String, Figures> = BTreeMap::new();
    for (job, record) in trace.iter().zip(&outcome.records) {
        let figures = out.entry(job.group.clone()).or_default();
        figures.jobs += 1;
        figures.preemptions += u64::from(record.preemptions);
        if let Some(start) = record.first_start_ms {
            waits.entry(job.group.as_str()).or_default().push(start.saturating_sub(job.submit_ms) as f64 / 1000.0);
        }
    }
    for interval in &outcome.intervals {
        let group = &trace[interval.job].group;
        let gpu_ms = interval.gpus * interval.end_ms.saturating_sub(interval.start_ms);
        out.entry(group.clone()).or_default().gpu_hours += gpu_ms as f64 / 3_600_000.0;
    }
    for (group, mut list) in waits {
        list.sort_by(f64::total_cmp);
        let figures = out.get_mut(group).expect("a group with waits has figures");
        figures.mean_wait_s = list.iter().sum::<f64>() / list.len() as f64;
        figures.p90_wait_s = percentile(&list, 0.9);
    }
    out
}

/// Replay `trace` on `cluster` (its policy replaced) under both documents.
pub fn compare(trace: &[TraceJob], cluster: &SimConfig, active: &PolicyConfig, proposed: &PolicyConfig) -> Vec<GroupComparison> {
    let run = |policy: &PolicyConfig| {
        let config = SimConfig { policy: policy.clone(), ..cluster.clone() };
        figures(trace, &Simulator::new(config, trace).run())
    };
    let (before, after) = (run(active), run(proposed));
    before
        .into_iter()
        .map(|(group, active)| {
            let proposed = after.get(&group).cloned().unwrap_or_default();
            let verdict = if proposed.mean_wait_s + 0.5 < active.mean_wait_s {
                "gains"
            } else if proposed.mean_wait_s > active.mean_wait_s + 0.5 {
                "loses"
            } else {
                "same"
            };
            GroupComparison { group, active, proposed, verdict }
        })
        .collect()
}
