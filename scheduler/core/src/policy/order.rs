//! Queue order of pending jobs.
//!
//! Rota: the oldest starving job first, then `(standing desc, submitted_at, id)`.
//! * starving = the job has waited `starve_after_ms` (default 36 h). The
//!   oldest such job (at most `starving_ahead`, default 1) goes ahead of
//!   everything and so gets the reservation; when it starts, the next oldest
//!   follows. Only one goes ahead at a time because a whole group of them
//!   would hand every freed GPU to long jobs while short ones pile up.
//! * standing = `queue_points x queue weight + priority_points x priority
//!   level + limit_points x shortness + aging (+ quota_points if the job fits
//!   in what is left of its group's guarantee)`. Shortness = halvings of the
//!   runtime limit below one day (10 min: 7, 40 min: 5, 1 h: 4, >= 1 d: 0):
//!   asking for less gets a job going sooner, as with shortest-job-first.
//!   Aging = one point per `aging_step_ms` waited (since the original submit,
//!   kept across preemption), at most `aging_cap` points. With the defaults
//!   (10/15/15 points, 10 min steps, cap 60) a job gains at most 60 points
//!   over 10 h, as much as a fourfold shorter limit or two priority levels.
//!   Beyond that, the starving job's reservation bounds every wait.
//! * quota_points is 0 by default: guarantees are kept by reclaim (a job
//!   inside its guarantee preempts borrowers, see `pass`), not by
//!   reordering, which measured better overall across the trace windows
//!   (BENCHMARKS.md). A large value puts every job inside its guarantee
//!   ahead of all borrowers.
//! * equal standing: earlier submit first, then lower id (stable).
//!
//! Baselines: `(submitted_at, id)`.

use crate::state::policy_doc::CanaryScope;
use crate::state::{ClusterState, Job, JobReason, Priority};

use super::config::{Mode, PolicyConfig};
use super::fasthash::FastMap;
use super::priority::{effective_priority, priority_level};
use super::quota::QuotaBook;

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
    pub reason: &'a JobReason,
    pub estimate: Option<u64>,
    /// Group id in the quota book.
    pub group: u32,
    /// Fits in what is left of its group's guarantee (in standing order);
    /// worked out only when `quota_points` > 0.
    pub in_quota: bool,
    pub standing: u64,
    pub priority: Priority,
    pub queue_weight: u32,
    pub limit_ms: u64,
    pub wait_ms: u64,
    /// Ordered and preempting under the staged (canary) document.
    pub canary: bool,
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

/// Pending jobs in the order the pass considers them. The jobs `canary`
/// covers get their standing and starving time from its settings, all
/// others from `config`; what shapes the pass as a whole (the mode, the
/// quota bonus, how many starving jobs go ahead) comes from `config`.
pub fn pending<'a>(
    state: &'a ClusterState,
    now_ms: u64,
    config: &PolicyConfig,
    canary: Option<(&PolicyConfig, &CanaryScope)>,
    quota: &mut QuotaBook<'a>,
) -> Ordered<'a> {
    let mut queues: FastMap<&str, (u32, u64)> = FastMap::default();
    for (name, q) in &state.queues {
        queues.insert(name.as_str(), (q.weight, q.default_runtime_s));
    }
    // Sized once: grown by doubling, a long queue's vector was copied several
    // times a pass, each copy into fresh pages the kernel had to fault in and
    // zero. Read from the pending index: walking the whole job table spent
    // more of a pass on finished jobs than on the queue once a million of
    // them were held.
    let mut cands: Vec<Cand<'a>> = Vec::with_capacity(state.pending_jobs.len());
    // The pending index walks jobs by id, and ids and submit times rise
    // together (both are given at apply, the time never going back), so the
    // candidates come in submit order; checked here, as a restored or
    // hand-built state need not keep it.
    let mut previous: Option<(u64, u64)> = None;
    let mut in_submit_order = true;
    cands.extend(state.pending().map(|job| {
        let submitted = (job.submitted_at_ms, job.id);
        in_submit_order &= previous.is_none_or(|before| before < submitted);
        previous = Some(submitted);
        let (queue_weight, default_s) = queues.get(job.spec.queue.as_str()).copied().unwrap_or((1, 24 * 3600));
        let priority = effective_priority(job, now_ms);
        let wait_ms = now_ms.saturating_sub(job.submitted_at_ms);
        let limit_s = if job.spec.runtime_limit_s > 0 { job.spec.runtime_limit_s } else { default_s };
        let limit_ms = limit_s.saturating_mul(1000);
        let (job_config, in_canary) = match canary {
            Some((canary_config, scope)) if scope.covers(job) => (canary_config, true),
            _ => (config, false),
        };
        Cand {
            job,
            replicas: job.spec.replicas,
            per: job.spec.gpus_per_replica,
            model: job.spec.gpu_model.as_deref(),
            min_memory_mib: job.spec.min_gpu_memory_mib,
            reason: &job.reason,
            estimate: job.estimated_start_ms,
            group: quota.intern(job.spec.group.as_str()),
            in_quota: false,
            standing: standing(job_config, queue_weight, priority, wait_ms, limit_ms),
            priority,
            queue_weight,
            limit_ms,
            wait_ms,
            canary: in_canary,
        }
    }));
    if config.mode != Mode::Rota {
        if !in_submit_order {
            cands.sort_unstable_by_key(|c| (c.job.submitted_at_ms, c.job.id));
        }
        let order = (0..cands.len() as u32).collect();
        return Ordered { cands, order };
    }
    let order = if in_submit_order { bucket_order(&cands) } else { None };
    let order = order.unwrap_or_else(|| comparison_order(&cands));
    debug_assert_eq!(order.len(), cands.len());
    if config.quota_points > 0 {
        mark_in_quota(&mut cands, &order, quota);
    }
    // Ahead of the rest: the longest-waiting starving jobs (oldest first), at
    // most `starving_ahead` of them. One is enough to bound every wait: it
    // gets the reservation, and the next one follows when it starts.
    let mut ahead: Vec<(u64, u64, u32)> = (0..cands.len() as u32)
        .filter(|&i| {
            let cand = &cands[i as usize];
            let starve_after_ms = match canary {
                Some((canary_config, _)) if cand.canary => canary_config.starve_after_ms,
                _ => config.starve_after_ms,
            };
            cand.wait_ms >= starve_after_ms
        })
        .map(|i| (cands[i as usize].job.submitted_at_ms, cands[i as usize].job.id, i))
        .collect();
    ahead.sort_unstable();
    ahead.truncate(config.starving_ahead);
    if ahead.is_empty() && config.quota_points == 0 {
        return Ordered { cands, order };
    }
    let mut is_ahead = vec![false; cands.len()];
    for &(_, _, i) in &ahead {
        is_ahead[i as usize] = true;
    }
    let mut in_order: Vec<u32> = Vec::with_capacity(cands.len());
    in_order.extend(ahead.iter().map(|&(_, _, i)| i));
    let rest = order.into_iter().filter(|&i| !is_ahead[i as usize]);
    if config.quota_points == 0 {
        in_order.extend(rest);
    } else {
        in_order.extend(merge_quota_bonus(&cands, rest, config.quota_points));
    }
    debug_assert_eq!(in_order.len(), cands.len());
    Ordered { cands, order: in_order }
}

/// The pending jobs of one pass in the order it considers them. The
/// candidates stay where they were built and only their indices are put in
/// order: copying 100-byte candidates into a second vector cost a pass more
/// than ordering them (the copy's fresh pages faulted in besides).
#[derive(Debug)]
pub struct Ordered<'a> {
    cands: Vec<Cand<'a>>,
    /// Indices into `cands`, each once.
    order: Vec<u32>,
}

impl<'a> Ordered<'a> {
    pub fn iter(&self) -> impl Iterator<Item = &Cand<'a>> + '_ {
        self.order.iter().map(|&i| &self.cands[i as usize])
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// Candidates (by index) in `(standing desc, submitted_at, id)` order, for
/// candidates given in `(submitted_at, id)` order: a stable counting sort
/// on the standing alone, linear in the queue. Standings span a few
/// hundred points (queue, priority, shortness and aging, each bounded), so
/// there are few buckets; None when they span more than [`MAX_BUCKETS`],
/// and the caller sorts by comparison. At 150,000 pending jobs the sort by
/// comparison was a fifth of a whole pass.
fn bucket_order(cands: &[Cand]) -> Option<Vec<u32>> {
    let highest = cands.iter().map(|c| c.standing).max()?;
    let lowest = cands.iter().map(|c| c.standing).min()?;
    let span = usize::try_from(highest - lowest).ok().filter(|&span| span < MAX_BUCKETS)?;
    // Bucket 0 holds the highest standing.
    let bucket = |c: &Cand| (highest - c.standing) as usize;
    let mut next_slot = vec![0u32; span + 1];
    for cand in cands {
        next_slot[bucket(cand)] += 1;
    }
    let mut slot = 0u32;
    for entry in &mut next_slot {
        let count = *entry;
        *entry = slot;
        slot += count;
    }
    debug_assert_eq!(slot as usize, cands.len());
    let mut order = vec![0u32; cands.len()];
    for (i, cand) in cands.iter().enumerate() {
        let at = &mut next_slot[bucket(cand)];
        order[*at as usize] = i as u32;
        *at += 1;
    }
    Some(order)
}

/// Buckets [`bucket_order`] allocates at most (a 256 KiB table).
const MAX_BUCKETS: usize = 1 << 16;

/// Candidates (by index) in `(standing desc, submitted_at, id)` order, in
/// any input order. Ids are unique, so an unstable sort is deterministic.
fn comparison_order(cands: &[Cand]) -> Vec<u32> {
    let mut keys: Vec<(u128, u64, u32)> = cands
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let standing = u128::from(u64::MAX - c.standing) << 64;
            (standing | u128::from(c.job.submitted_at_ms), c.job.id, i as u32)
        })
        .collect();
    keys.sort_unstable();
    keys.into_iter().map(|(_, _, i)| i).collect()
}

/// Mark the jobs that fit, in standing order, in what is left of their
/// group's guarantee.
fn mark_in_quota(cands: &mut [Cand], order: &[u32], quota: &QuotaBook) {
    let mut room: Vec<Option<u64>> = Vec::new();
    for &i in order {
        let cand = &mut cands[i as usize];
        let g = cand.group as usize;
        if room.len() <= g {
            room.resize(g + 1, None);
        }
        let left = room[g].get_or_insert_with(|| quota.room(cand.group));
        cand.in_quota = cand.gpus() <= *left;
        if cand.in_quota {
            *left -= cand.gpus();
        }
    }
}

/// Jobs (by index) in standing order, with `bonus` points added to those
/// inside their guarantee. The bonus is the same for all of them, so each
/// half stays in order and one linear merge re-sorts the whole (no second
/// sort).
fn merge_quota_bonus(cands: &[Cand], ordered: impl Iterator<Item = u32>, bonus: u64) -> Vec<u32> {
    let (inside, borrowing): (Vec<u32>, Vec<u32>) = ordered.partition(|&i| cands[i as usize].in_quota);
    let key = |i: u32, plus: u64| {
        let c = &cands[i as usize];
        (std::cmp::Reverse(c.standing.saturating_add(plus)), c.job.submitted_at_ms, c.job.id)
    };
    let mut out = Vec::with_capacity(inside.len() + borrowing.len());
    let (mut a, mut b) = (inside.into_iter().peekable(), borrowing.into_iter().peekable());
    loop {
        let take_inside = match (a.peek(), b.peek()) {
            (Some(&x), Some(&y)) => key(x, bonus) <= key(y, 0),
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        out.push(if take_inside { a.next() } else { b.next() }.expect("peeked"));
    }
    out
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

    /// A cluster whose pending jobs differ in queue, priority, limit and
    /// wait, submitted over `spread_ms`.
    fn mixed_queue(jobs: u64, spread_ms: u64) -> ClusterState {
        use crate::state::{Command, JobSpec, Proposal};
        let mut state = ClusterState::default();
        let priorities = [Priority::Low, Priority::Medium, Priority::High];
        let limits_s = [0, 600, 3_600, 7 * 3_600, 3 * 86_400];
        for i in 0..jobs {
            let spec = JobSpec {
                queue: ["training", "service"][(i % 2) as usize].into(),
                group: format!("g{}", i % 5),
                priority: priorities[(i % 3) as usize],
                runtime_limit_s: limits_s[(i % 5) as usize],
                ..JobSpec::simple(&["train.py"])
            };
            let proposal =
                Proposal { now_ms: 1_000 + i * spread_ms / jobs.max(1), commands: vec![Command::SubmitJob { request_id: None, spec }] };
            let results = state.apply_proposal(state.applied_index + 1, &proposal);
            assert!(matches!(results[..], [crate::state::CommandResult::Submitted { .. }]), "{results:?}");
        }
        assert_eq!(state.pending().count() as u64, jobs);
        state
    }

    /// The order `pending` must give: `(standing desc, submitted_at, id)`.
    fn expected_order(cands: &[Cand]) -> Vec<u64> {
        let mut keys: Vec<(std::cmp::Reverse<u64>, u64, u64)> =
            cands.iter().map(|c| (std::cmp::Reverse(c.standing), c.job.submitted_at_ms, c.job.id)).collect();
        keys.sort();
        keys.into_iter().map(|(_, _, id)| id).collect()
    }

    /// `pending` as a pass calls it, with no canary.
    fn ordered<'a>(state: &'a ClusterState, now_ms: u64, config: &PolicyConfig) -> Ordered<'a> {
        let mut view = super::super::view::View::build(state, now_ms);
        let mut quota = QuotaBook::new(state, &mut view);
        pending(state, now_ms, config, None, &mut quota)
    }

    fn order_of(state: &ClusterState, now_ms: u64, config: &PolicyConfig) -> Vec<u64> {
        let ordered = ordered(state, now_ms, config);
        assert_eq!(ordered.len(), state.pending().count(), "every pending job once");
        let order: Vec<u64> = ordered.iter().map(|c| c.job.id).collect();
        assert_eq!(order, expected_order(&ordered.cands));
        order
    }

    #[test]
    fn counting_by_standing_gives_the_comparison_order() {
        // Over 10 h, so aging spreads the standings too.
        let state = mixed_queue(3_000, 10 * 3_600_000);
        let now_ms = 11 * 3_600_000;
        let config = PolicyConfig { starving_ahead: 0, ..PolicyConfig::default() };
        let cands = ordered(&state, now_ms, &config).cands;
        let distinct: std::collections::BTreeSet<u64> = cands.iter().map(|c| c.standing).collect();
        assert!(distinct.len() > 20, "the queue spans many standings: {}", distinct.len());
        let counted = bucket_order(&cands).expect("few buckets");
        assert_eq!(counted, comparison_order(&cands));
        order_of(&state, now_ms, &config);
    }

    #[test]
    fn jobs_out_of_submit_order_are_still_ordered_right() {
        let mut state = mixed_queue(500, 3_600_000);
        let now_ms = 2 * 3_600_000;
        // No aging: the moved job keeps its standing and shares it with
        // others, so only the submit-time tie-break moves it.
        let config = PolicyConfig { starving_ahead: 0, aging_cap: 0, ..PolicyConfig::default() };
        let before = order_of(&state, now_ms, &config);
        // A state not built by apply alone (restored, imported) may hold a
        // later id submitted earlier: the order follows the submit time.
        let last = *state.pending_jobs.keys().next_back().expect("pending");
        state.jobs.get_mut(&last).expect("held").submitted_at_ms = 0;
        let after = order_of(&state, now_ms, &config);
        assert_ne!(before, after, "the moved job changes place");
        let fifo = PolicyConfig { mode: Mode::Fifo, ..config };
        let fifo_order = order_of_fifo(&state, now_ms, &fifo);
        assert_eq!(fifo_order[0], last, "first submitted, first in FIFO: {:?}", &fifo_order[..3]);
    }

    fn order_of_fifo(state: &ClusterState, now_ms: u64, config: &PolicyConfig) -> Vec<u64> {
        let cands = ordered(state, now_ms, config);
        let keys: Vec<(u64, u64)> = cands.iter().map(|c| (c.job.submitted_at_ms, c.job.id)).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "FIFO is submit order");
        cands.iter().map(|c| c.job.id).collect()
    }

    #[test]
    fn standings_too_far_apart_for_buckets_are_sorted_by_comparison() {
        let state = mixed_queue(200, 3_600_000);
        // Points so large that standings span more than the bucket table.
        let config = PolicyConfig { starving_ahead: 0, priority_points: MAX_BUCKETS as u64, ..PolicyConfig::default() };
        let cands = ordered(&state, 2 * 3_600_000, &config).cands;
        assert!(bucket_order(&cands).is_none());
        order_of(&state, 2 * 3_600_000, &config);
    }

    #[test]
    fn aging_is_bounded() {
        let config = PolicyConfig::default();
        let fresh = standing(&config, 2, Priority::Medium, 0, 3_600_000);
        let old = standing(&config, 2, Priority::Medium, 1_000 * 3_600_000, 3_600_000);
        assert_eq!(old - fresh, config.aging_cap);
    }
}
