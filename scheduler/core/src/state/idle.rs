//! Allocated-but-idle GPUs (format 8 on, a trailing snapshot section of its
//! own: older nested types are never changed).
//!
//! One definition of idle, computed by each node's agent: a rank (the GPUs
//! of one allocation's rank on its node) is idle once every one of its GPUs
//! has stayed under the agent's utilization threshold for the agent's
//! window. The agent reports, per rank, for how long it has been under the
//! threshold; the leader commits a change of a rank's idle state only
//! (`Command::AllocIdle`), and apply turns the duration into a committed
//! time: `idle_since_ms` = committed time - the reported duration, never
//! before the allocation was placed. A rank that stays idle keeps its first
//! committed time, whoever leads: the clock is never reset by a failover, a
//! duplicate report or a restarted agent (which reports the rank only once
//! it has watched it for a whole window again).
//!
//! An allocation (the whole gang) is idle when every rank is; it is idle
//! since the latest of its ranks' times. Once it has been idle for longer
//! than its queue's `idle_after_ms` the policy flags it (`IdleFlagged`,
//! which makes an event) and, under the `reclaim` action, stops it with the
//! reason `idle_reclaimed`: the job then ends (failed, not retried: a job
//! idle for hours is stalled or forgotten, and a new attempt would hold new
//! GPUs idle the same way).
//!
//! Idle GPU-time is accumulated per job, from committed times only: when a
//! rank turns busy or its allocation ends, its GPUs times the time it was
//! idle are added to its job ([`idle_gpu_ms`] adds the running span).

use std::collections::BTreeMap;

use super::shared::SharedMap;
use serde::{Deserialize, Serialize};

use super::types::{AllocId, JobId};
use super::ClusterState;

/// The first cluster version whose replicas hold idle records and queue
/// idle policies, and apply the commands that change them.
pub const IDLE_FROM_VERSION: u16 = 8;

/// A queue without a policy of its own flags allocations idle this long.
pub const DEFAULT_IDLE_AFTER_MS: u64 = 2 * 3_600_000;
/// The shortest `idle_after_ms` a queue takes (tests use short ones).
pub const MIN_IDLE_AFTER_MS: u64 = 1;
/// The longest: a year.
pub const MAX_IDLE_AFTER_MS: u64 = 365 * 24 * 3_600_000;
/// Allocations one `IdleFlagged` command names at most.
pub const MAX_FLAGS_PER_COMMAND: usize = 1_024;

/// What happens to an allocation idle past its queue's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum IdleAction {
    /// Flag it (listed by `rota jobs --idle`, an event, the metric).
    #[default]
    Flag,
    /// Flag it and stop the job (`idle_reclaimed`).
    Reclaim,
}

impl IdleAction {
    pub fn as_str(self) -> &'static str {
        match self {
            IdleAction::Flag => "flag",
            IdleAction::Reclaim => "reclaim",
        }
    }

    pub fn parse(text: &str) -> Option<IdleAction> {
        match text {
            "flag" => Some(IdleAction::Flag),
            "reclaim" => Some(IdleAction::Reclaim),
            _ => None,
        }
    }
}

/// A queue's idle rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdlePolicy {
    pub idle_after_ms: u64,
    pub action: IdleAction,
}

impl Default for IdlePolicy {
    fn default() -> Self {
        IdlePolicy { idle_after_ms: DEFAULT_IDLE_AFTER_MS, action: IdleAction::Flag }
    }
}

/// The committed idle record of one live allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct AllocIdleRecord {
    /// Rank -> committed time it has been idle since. Ranks not here are
    /// busy (or not yet reported idle).
    pub ranks: BTreeMap<u32, u64>,
    /// Committed time the allocation was flagged idle past its queue's
    /// time; cleared when a rank turns busy.
    pub flagged_ms: Option<u64>,
}

/// Format 8's part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct IdleState {
    /// Live allocations with at least one idle rank (or a flag). Dropped
    /// when the allocation ends.
    pub allocs: SharedMap<AllocId, AllocIdleRecord>,
    /// Idle GPU-ms of each job's ended idle spans; dropped with the job.
    pub job_idle_gpu_ms: SharedMap<JobId, u64>,
    /// Queues with a policy other than the default; dropped never (bounded
    /// by the queues).
    pub queue_policies: BTreeMap<String, IdlePolicy>,
}

impl IdleState {
    /// The queue's rule (the default when it has none).
    pub fn policy(&self, queue: &str) -> IdlePolicy {
        self.queue_policies.get(queue).copied().unwrap_or_default()
    }
}

impl ClusterState {
    /// When the whole allocation has been idle since: the latest of its
    /// ranks' times, when every rank is idle.
    pub fn alloc_idle_since_ms(&self, alloc_id: AllocId) -> Option<u64> {
        let alloc = self.allocs.get(&alloc_id)?;
        let record = self.idle.allocs.get(&alloc_id)?;
        let mut latest = 0;
        for rank in &alloc.ranks {
            latest = latest.max(*record.ranks.get(&rank.rank)?);
        }
        Some(latest)
    }

    /// Is the live, not stopping allocation idle past its queue's time at
    /// `now_ms`? Returns its policy then.
    pub fn idle_past_policy(&self, alloc_id: AllocId, now_ms: u64) -> Option<IdlePolicy> {
        let alloc = self.allocs.get(&alloc_id).filter(|a| a.stop.is_none())?;
        let since = self.alloc_idle_since_ms(alloc_id)?;
        let job = self.jobs.get(&alloc.job_id)?;
        let policy = self.idle.policy(&job.spec.queue);
        (now_ms.saturating_sub(since) >= policy.idle_after_ms).then_some(policy)
    }

    /// GPUs of idle ranks, per group (`rota_gpus_idle{group}`).
    pub fn idle_gpus_by_group(&self) -> BTreeMap<String, u64> {
        let mut by_group = BTreeMap::new();
        for (alloc_id, record) in &self.idle.allocs {
            let Some(alloc) = self.allocs.get(alloc_id) else { continue };
            let Some(job) = self.jobs.get(&alloc.job_id) else { continue };
            let gpus: u64 = alloc.ranks.iter().filter(|r| record.ranks.contains_key(&r.rank)).map(|r| r.gpus.len() as u64).sum();
            if gpus > 0 {
                *by_group.entry(job.spec.group.clone()).or_insert(0) += gpus;
            }
        }
        by_group
    }

    /// Apply of `Command::AllocIdle`: a rank turned idle (for `idle_for_ms`
    /// by its agent's count) or busy. A report about an ended allocation or
    /// rank, a repeated one, or one before format 8 changes nothing.
    pub(super) fn alloc_idle(&mut self, alloc_id: AllocId, rank: u32, idle_for_ms: Option<u64>) {
        if self.cluster_version() < IDLE_FROM_VERSION {
            return;
        }
        let Some(alloc) = self.allocs.get(&alloc_id) else { return };
        let Some(held) = alloc.ranks.get(rank as usize).filter(|r| r.state != super::types::RankState::Exited) else { return };
        let gpus = held.gpus.len() as u64;
        let (job_id, placed_ms) = (alloc.job_id, alloc.created_at_ms);
        let now_ms = self.now_ms;
        match idle_for_ms {
            Some(idle_for_ms) => {
                let record = self.idle.allocs.entry(alloc_id).or_default();
                // The first committed time stays: the clock is never reset.
                record.ranks.entry(rank).or_insert_with(|| now_ms.saturating_sub(idle_for_ms).max(placed_ms).min(now_ms));
            }
            None => {
                let Some(record) = self.idle.allocs.get_mut(&alloc_id) else { return };
                let Some(since) = record.ranks.remove(&rank) else { return };
                record.flagged_ms = None;
                if record.ranks.is_empty() {
                    self.idle.allocs.remove(&alloc_id);
                }
                self.add_idle_gpu_ms(job_id, gpus.saturating_mul(now_ms.saturating_sub(since)));
            }
        }
    }

    /// Apply of `Command::IdleFlagged`: each allocation still idle past its
    /// queue's time (checked again: it may have turned busy since the
    /// policy looked) and not yet flagged is flagged now.
    pub(super) fn idle_flagged(&mut self, alloc_ids: &[AllocId]) -> Result<(), super::Rejection> {
        if alloc_ids.len() > MAX_FLAGS_PER_COMMAND {
            return Err(super::Rejection::Invalid {
                field: "alloc_ids".into(),
                message: format!("at most {MAX_FLAGS_PER_COMMAND}, got {}", alloc_ids.len()),
            });
        }
        let now_ms = self.now_ms;
        for &alloc_id in alloc_ids {
            if self.idle_past_policy(alloc_id, now_ms).is_none() {
                continue;
            }
            if let Some(record) = self.idle.allocs.get_mut(&alloc_id) {
                record.flagged_ms.get_or_insert(now_ms);
            }
        }
        Ok(())
    }

    /// The allocation ended: its idle ranks' spans count for its job.
    pub(super) fn idle_allocation_ended(&mut self, alloc: &super::types::Allocation) {
        let Some(record) = self.idle.allocs.remove(&alloc.id) else { return };
        let now_ms = self.now_ms;
        let idle_gpu_ms: u64 = alloc
            .ranks
            .iter()
            .filter_map(|r| record.ranks.get(&r.rank).map(|&since| (r.gpus.len() as u64).saturating_mul(now_ms.saturating_sub(since))))
            .sum();
        self.add_idle_gpu_ms(alloc.job_id, idle_gpu_ms);
    }

    fn add_idle_gpu_ms(&mut self, job_id: JobId, gpu_ms: u64) {
        if gpu_ms > 0 && self.jobs.contains_key(&job_id) {
            let total = self.idle.job_idle_gpu_ms.entry(job_id).or_insert(0);
            *total = total.saturating_add(gpu_ms);
        }
    }
}

/// GPU-ms a job's allocations have spent idle, from committed times: the
/// ended spans, plus its live allocation's idle ranks up to the state's
/// committed time.
pub fn idle_gpu_ms(state: &ClusterState, job_id: JobId) -> u64 {
    let ended = state.idle.job_idle_gpu_ms.get(&job_id).copied().unwrap_or(0);
    let Some(alloc) = state.jobs.get(&job_id).and_then(|j| j.alloc).and_then(|id| state.allocs.get(&id)) else { return ended };
    let Some(record) = state.idle.allocs.get(&alloc.id) else { return ended };
    let running: u64 = alloc
        .ranks
        .iter()
        .filter_map(|r| record.ranks.get(&r.rank).map(|&since| (r.gpus.len() as u64).saturating_mul(state.now_ms.saturating_sub(since))))
        .sum();
    ended.saturating_add(running)
}

/// `2h`, `30m`, `90s`, `500ms` as ms (the CLI's `--idle-after`).
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(|| format!("{text:?} needs a unit (ms, s, m, h, d)"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration like 2h or 30m"))?;
    let scale = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (ms, s, m, h, d)")),
    };
    number.checked_mul(scale).ok_or_else(|| format!("{text:?} is too long"))
}

/// `1h 5m`, `42s`, `350ms` for people.
pub fn duration_text(ms: u64) -> String {
    let s = ms / 1_000;
    match s {
        0 => format!("{ms}ms"),
        1..=59 => format!("{s}s"),
        60..=3_599 => format!("{}m {}s", s / 60, s % 60),
        _ => format!("{}h {}m", s / 3_600, (s % 3_600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_a_unit() {
        assert_eq!(parse_duration_ms("2h").unwrap(), 7_200_000);
        assert_eq!(parse_duration_ms("30m").unwrap(), 1_800_000);
        assert_eq!(parse_duration_ms("500ms").unwrap(), 500);
        for bad in ["2", "h", "2w", "-1h", ""] {
            assert!(parse_duration_ms(bad).is_err(), "{bad}");
        }
        assert_eq!(duration_text(3_725_000), "1h 2m");
        assert_eq!(duration_text(42_000), "42s");
        assert_eq!(IdleAction::parse("reclaim"), Some(IdleAction::Reclaim));
        assert_eq!(IdleAction::parse("kill"), None);
    }
}
