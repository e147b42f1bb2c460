//! Read-only reports for the CLI: `rota usage` and `rota why JOB`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::state::{ClusterState, JobId};

/// GPU-seconds used by one group in one queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageLine {
    pub group: String,
    pub queue: String,
    /// Ended allocations (as accounted by apply) plus running ones up to `now_ms`.
    pub gpu_seconds: u64,
    /// GPUs held now.
    pub gpus_now: u64,
}

/// Usage per (group, queue), in that order.
pub fn usage_report(state: &ClusterState, now_ms: u64) -> Vec<UsageLine> {
    let mut lines: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for ((group, queue), &gpu_ms) in &state.usage.gpu_ms {
        lines.entry((group.clone(), queue.clone())).or_default().0 += gpu_ms;
    }
    for alloc in state.allocs.values() {
        let Some(job) = state.jobs.get(&alloc.job_id) else {
            continue;
        };
        let entry = lines.entry((job.spec.group.clone(), job.spec.queue.clone())).or_default();
        entry.0 += alloc.gpu_count() * now_ms.saturating_sub(alloc.created_at_ms);
        entry.1 += alloc.gpu_count();
    }
    lines.into_iter().map(|((group, queue), (gpu_ms, gpus_now))| UsageLine { group, queue, gpu_seconds: gpu_ms / 1000, gpus_now }).collect()
}

/// What `rota why JOB` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Why {
    pub job_id: JobId,
    pub state: String,
    /// The stable code of the reason (e.g. `quota_exhausted`).
    pub code: String,
    pub reason: String,
    pub estimated_start_ms: Option<u64>,
}

pub fn why(state: &ClusterState, job_id: JobId) -> Option<Why> {
    let job = state.jobs.get(&job_id)?;
    Some(Why {
        job_id,
        state: job.state.as_str().to_string(),
        code: job.reason.code.as_str().to_string(),
        reason: job.reason.to_string(),
        estimated_start_ms: job.estimated_start_ms,
    })
}
