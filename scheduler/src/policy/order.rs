//! Queue order of pending jobs.
//!
//! Rota: `(tier, standing desc, submitted_at, id)`.
//! * tier 0 = the job has waited `starve_after_ms` (default 36 h): it goes
//!   ahead of everything, oldest first, and so gets the reservation: no job
//!   waits much longer than that plus the runtime limits it must wait for.
//! * tier 1 = the job fits in what is left of its group's guaranteed quota
//!   (counted cumulatively over the group's jobs in standing order); tier 2 =
//!   it would borrow. Guarantees come first.
//! * standing = `queue_points x queue weight + priority_points x priority
//!   level + limit_points x shortness + aging`. Shortness = halvings of the
//!   runtime limit below one day (10 min: 7, 40 min: 5, 1 h: 4, >= 1 d: 0):
//!   asking for less gets a job going sooner, as with shortest-job-first.
//!   Aging = one point per `aging_step_ms` waited (since the original submit,
//!   kept across preemption), at most `aging_cap` points. With the defaults
//!   (10/15/15 points, 10 min steps, cap 60) a job gains at most 60 points
//!   over 10 h, as much as a fourfold shorter limit or two priority levels.
//!   Beyond that, tier 0 bounds every wait.
//! * equal standing: earlier submit first, then lower id (stable).
//!
//! Baselines: `(submitted_at, id)`.

use crate::state::{ClusterState, Job, JobState, Priority};

use super::fasthash::FastMap;
use super::quota::QuotaBook;
use super::{Mode, PolicyConfig};

/// Priority after its expiry: a `High` job past `priority_ttl_s` of waiting
/// counts as `Medium`.
pub fn effective_priority(job: &Job, now_ms: u64) -> Priority {
    let ttl_ms = job.spec.priority_ttl_s.saturating_mul(1000);
    if job.spec.priority == Priority::High && ttl_ms > 0 && now_ms >= job.submitted_at_ms.saturating_add(ttl_ms) {
        return Priority::Medium;
    }
    job.spec.priority
}

fn priority_level(priority: Priority) -> u64 {
    match priority {
        Priority::Low => 0,
        Priority::Medium => 1,
        Priority::High => 2,
    }
}

/// A pending job with what the pass needs of it.
#[derive(Debug, Clone)]
pub struct Cand<'a> {
    pub job: &'a Job,
    /// Copies of what every pass reads of each job, taken while its record
    /// is in cache (the pass is memory-bound at 50,000 pending jobs).
    pub replicas: u32,
    pub per: u32,
    pub model: Option<&'a str>,
    pub min_memory_mib: u64,
    pub reason: &'a str,
    pub estimate: Option<u64>,
    /// Group id in the quota book.
    pub group: u32,
    pub tier: u8,
    pub standing: u64,
    pub priority: Priority,
    pub queue_weight: u32,
    pub limit_ms: u64,
    pub wait_ms: u64,
}

impl Cand<'_> {
    pub fn gpus(&self) -> u64 {
        u64::from(self.replicas) * u64::from(self.per)
    }
}

/// Halvings of the runtime limit below one day: 10 min -> 7, 1 h -> 4, >= 1 d -> 0.
fn shortness(limit_ms: u64) -> u64 {
    let mut steps = 0;
    let mut span = 86_400_000u64;
    while steps < 16 && limit_ms.saturating_mul(2) <= span {
        span /= 2;
        steps += 1;
    }
    steps
}

pub fn standing(config: &PolicyConfig, queue_weight: u32, priority: Priority, wait_ms: u64, limit_ms: u64) -> u64 {
    let aging = (wait_ms / config.aging_step_ms.max(1)).min(config.aging_cap);
    config.queue_points * u64::from(queue_weight)
        + config.priority_points * priority_level(priority)
        + config.limit_points * shortness(limit_ms)
        + aging
}

/// Pending jobs in the order the pass considers them.
pub fn pending<'a>(state: &'a ClusterState, now_ms: u64, config: &PolicyConfig, quota: &mut QuotaBook<'a>) -> Vec<Cand<'a>> {
    let mut queues: FastMap<&str, (u32, u64)> = FastMap::default();
    for (name, q) in &state.queues {
        queues.insert(name.as_str(), (q.weight, q.default_runtime_s));
    }
    let mut cands: Vec<Cand<'a>> = state
        .jobs
        .values()
        .filter(|j| j.state == JobState::Pending)
        .map(|job| {
            let (queue_weight, default_s) = queues.get(job.spec.queue.as_str()).copied().unwrap_or((1, 24 * 3600));
            let priority = effective_priority(job, now_ms);
            let wait_ms = now_ms.saturating_sub(job.submitted_at_ms);
            let limit_s = if job.spec.runtime_limit_s > 0 { job.spec.runtime_limit_s } else { default_s };
            let limit_ms = limit_s.saturating_mul(1000);
            Cand {
                job,
                replicas: job.spec.replicas,
                per: job.spec.gpus_per_replica,
                model: job.spec.gpu_model.as_deref(),
                min_memory_mib: job.spec.min_gpu_memory_mib,
                reason: job.reason.as_str(),
                estimate: job.estimated_start_ms,
                group: quota.intern(job.spec.group.as_str()),
                tier: 0,
                standing: standing(config, queue_weight, priority, wait_ms, limit_ms),
                priority,
                queue_weight,
                limit_ms,
                wait_ms,
            }
        })
        .collect();
    if config.mode != Mode::Rota {
        cands.sort_unstable_by_key(|c| (c.job.submitted_at_ms, c.job.id));
        return cands;
    }
    // Ids are unique, so an unstable sort is deterministic.
    let mut keys: Vec<(u128, u64, u32)> = cands
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let standing = u128::from(u64::MAX - c.standing) << 64;
            (standing | u128::from(c.job.submitted_at_ms), c.job.id, i as u32)
        })
        .collect();
    keys.sort_unstable();
    let order: Vec<u32> = keys.into_iter().map(|(_, _, i)| i).collect();
    if config.quota_tiers {
        assign_tiers(&mut cands, &order, quota);
    }
    for cand in cands.iter_mut().filter(|c| c.wait_ms >= config.starve_after_ms) {
        cand.tier = 0;
    }
    // Stable by tier (0..=2): one walk over the order per tier.
    let mut out = Vec::with_capacity(cands.len());
    for tier in 0..=2u8 {
        out.extend(order.iter().map(|&i| &cands[i as usize]).filter(|c| c.tier.min(2) == tier).cloned());
    }
    out
}

/// Tier 1 for the jobs that fit, in standing order, in what is left of their
/// group's guarantee; tier 2 for the rest.
fn assign_tiers(cands: &mut [Cand], order: &[u32], quota: &QuotaBook) {
    let mut room: Vec<Option<u64>> = Vec::new();
    for &i in order {
        let cand = &mut cands[i as usize];
        let g = cand.group as usize;
        if room.len() <= g {
            room.resize(g + 1, None);
        }
        let left = room[g].get_or_insert_with(|| quota.room(cand.group));
        if cand.gpus() <= *left {
            *left -= cand.gpus();
            cand.tier = 1;
        } else {
            cand.tier = 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortness_counts_halvings_below_a_day() {
        let min = 60_000;
        assert_eq!(shortness(10 * min), 7);
        assert_eq!(shortness(20 * min), 6);
        assert_eq!(shortness(40 * min), 5);
        assert_eq!(shortness(60 * min), 4);
        assert_eq!(shortness(12 * 60 * min), 1);
        assert_eq!(shortness(24 * 60 * min), 0);
        assert_eq!(shortness(7 * 24 * 60 * min), 0);
        assert_eq!(shortness(0), 16);
    }

    #[test]
    fn aging_is_bounded() {
        let config = PolicyConfig::default();
        let fresh = standing(&config, 2, Priority::Medium, 0, 3_600_000);
        let old = standing(&config, 2, Priority::Medium, 1_000 * 3_600_000, 3_600_000);
        assert_eq!(old - fresh, config.aging_cap);
    }
}
