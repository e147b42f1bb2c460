//! One scheduling pass (see the module docs of `policy` for the actions).

use std::collections::BTreeMap;

use crate::state::idle::IdleAction;
use crate::state::policy_doc::CanaryScope;
use crate::state::{ClusterState, JobId, JobReason, PendingNote, Placement, Plan, Priority, RankPlacement, Stop, StopReason};

use super::config::{Mode, PolicyConfig};
use super::fasthash::FastMap;
use super::order::{self, Cand};
use super::pool::{place, Pool, Spread};
use super::preempt::{self, Scratch};
use super::quota::{Admit, QuotaBook};
use super::reason::Reason;
use super::reserve::{self, Release, Reservation};
use super::view::{FreeGpu, RunningView, View};

/// Most reasons and estimates one plan carries. A plan is one log entry,
/// replicated in one message and applied under the state lock: the first
/// pass after a restore or a burst of submits would otherwise note every
/// pending job at once (6 MB at 130,000 jobs, longer to send than a
/// heartbeat interval). About 50 bytes each, so some 400 KB at most.
pub const MAX_NOTES_PER_PLAN: usize = 8_192;

/// A job's shape for memoisation: class set, replicas, GPUs per replica.
type ShapeKey = (usize, u32, u32);

enum Outcome {
    Placed,
    Pending(Reason, Option<u64>),
}

enum Fit {
    Placed,
    /// It would fit the free GPUs, but only by delaying the reservation.
    Delays,
    Nowhere,
}

pub struct Pass<'a> {
    state: &'a ClusterState,
    now_ms: u64,
    config: &'a PolicyConfig,
    /// The staged document and whose jobs it covers (see `policy_doc`).
    canary: Option<(&'a PolicyConfig, &'a CanaryScope)>,
    view: View<'a>,
    running: Vec<RunningView<'a>>,
    free: Pool,
    free_gpus: Vec<Vec<FreeGpu>>,
    quota: QuotaBook<'a>,
    releases: Vec<Release>,
    reservation: Option<Reservation>,
    blocked_by: Option<JobId>,
    class_sets: FastMap<(Option<&'a str>, u64), usize>,
    class_lists: Vec<Vec<u32>>,
    static_memo: BTreeMap<ShapeKey, Option<Reason>>,
    no_fit_free: BTreeMap<ShapeKey, ()>,
    no_fit_cap: BTreeMap<ShapeKey, ()>,
    /// Class set of jobs with no model or memory constraint.
    any_class: Option<usize>,
    taken: Vec<bool>,
    preempt_attempts: usize,
    /// Preemption attempts that found nothing, by what decides the outcome
    /// (shape, group, admission, priority, queue weight, canary), with the least wait
    /// past the threshold that would make another victim eligible. Kept for
    /// the whole pass to bound its cost, even though a later placement may
    /// make another group a borrower: such a chance waits for the next pass.
    preempt_failed: BTreeMap<(ShapeKey, u32, bool, Priority, u32, bool), u64>,
    plan: Plan,
    /// Rendered reasons of this pass (many jobs share one).
    rendered: FastMap<Reason, JobReason>,
    /// Spent budgets by interned group, for the pass.
    budget_memo: BTreeMap<u32, Option<Reason>>,
}

impl<'a> Pass<'a> {
    pub fn new(state: &'a ClusterState, now_ms: u64, config: &'a PolicyConfig) -> Pass<'a> {
        let mut view = View::build(state, now_ms);
        let quota = QuotaBook::new(state, &mut view);
        let running = std::mem::take(&mut view.running);
        let free = Pool::free_of(&view);
        let free_gpus = view.nodes.iter().map(|n| n.free.clone()).collect();
        let taken = vec![false; running.len()];
        Pass {
            state,
            now_ms,
            config,
            canary: None,
            view,
            running,
            free,
            free_gpus,
            quota,
            releases: Vec::new(),
            reservation: None,
            blocked_by: None,
            class_sets: FastMap::default(),
            class_lists: Vec::new(),
            static_memo: BTreeMap::new(),
            no_fit_free: BTreeMap::new(),
            no_fit_cap: BTreeMap::new(),
            any_class: None,
            taken,
            preempt_attempts: 0,
            preempt_failed: BTreeMap::new(),
            plan: Plan { computed_at_index: state.applied_index, ..Plan::default() },
            rendered: FastMap::default(),
            budget_memo: BTreeMap::new(),
        }
    }

    /// Order and preempt the jobs `scope` covers under `canary`.
    pub fn with_canary(mut self, canary: &'a PolicyConfig, scope: &'a CanaryScope) -> Pass<'a> {
        self.canary = Some((canary, scope));
        self
    }

    /// The settings a candidate is ordered and preempts under.
    fn config_of(&self, cand: &Cand) -> &'a PolicyConfig {
        match self.canary {
            Some((canary, _)) if cand.canary => canary,
            _ => self.config,
        }
    }

    pub fn run(mut self) -> Plan {
        self.enforce_limits();
        self.releases =
            self.running.iter().flat_map(|r| r.release.iter().map(move |&(node, gpus)| Release { end_ms: r.end_ms, node, gpus })).collect();
        let cands = order::pending(self.state, self.now_ms, self.config, self.canary, &mut self.quota);
        for cand in cands.iter() {
            if let Outcome::Pending(reason, estimate) = self.consider(cand) {
                self.note(cand, reason, estimate);
            }
        }
        self.plan
    }

    /// Action 1: stop allocations past their runtime limit.
    fn enforce_limits(&mut self) {
        for run in self.running.iter_mut().filter(|r| !r.stopping && r.deadline_ms <= self.now_ms) {
            self.plan.stops.push(Stop { alloc_id: run.alloc_id, reason: StopReason::RuntimeLimit });
            run.stopping = true;
            run.end_ms = self.now_ms;
        }
        self.reclaim_idle();
    }

    /// Action 1, idle GPUs: stop allocations idle past their queue's idle
    /// time whose queue reclaims them (the committed idle record decides).
    fn reclaim_idle(&mut self) {
        if self.state.idle.allocs.is_empty() {
            return;
        }
        for run in self.running.iter_mut().filter(|r| !r.stopping) {
            let policy = self.state.idle_past_policy(run.alloc_id, self.now_ms);
            if policy.is_some_and(|p| p.action == IdleAction::Reclaim) {
                self.plan.stops.push(Stop { alloc_id: run.alloc_id, reason: StopReason::IdleReclaimed });
                run.stopping = true;
                run.end_ms = self.now_ms;
            }
        }
    }

    fn class_set(&mut self, cand: &Cand<'a>) -> usize {
        let unconstrained = cand.model.is_none() && cand.min_memory_mib == 0;
        if let Some(id) = self.any_class.filter(|_| unconstrained) {
            return id;
        }
        let key = (cand.model, cand.min_memory_mib);
        if let Some(&id) = self.class_sets.get(&key) {
            return id;
        }
        if unconstrained {
            self.any_class = Some(self.class_lists.len());
        }
        let id = self.class_lists.len();
        self.class_lists.push(self.view.matching_classes(&cand.job.spec));
        self.class_sets.insert(key, id);
        id
    }

    fn consider(&mut self, cand: &Cand<'a>) -> Outcome {
        if let Some(spent) = self.budget_spent(cand) {
            // Skipped: it neither places, preempts nor holds a reservation.
            return Outcome::Pending(spent, None);
        }
        let set = self.class_set(cand);
        let shape: ShapeKey = (set, cand.replicas, cand.per);
        if let Some(reason) = self.static_check(shape, cand) {
            return Outcome::Pending(reason, None);
        }
        if let Some(job) = self.blocked_by {
            return Outcome::Pending(Reason::BehindJob { job }, None);
        }
        let admit = if self.config.uses_quotas() {
            match self.quota.admit(cand.group, cand.model, cand.gpus(), self.free.total) {
                Ok(admit) => admit,
                Err(reason) => return Outcome::Pending(reason, None),
            }
        } else {
            Admit::Borrowing
        };
        match self.try_place(cand, shape) {
            Fit::Placed => return Outcome::Placed,
            Fit::Delays if self.reservation.is_some() => {
                if let Some(outcome) = self.try_preempt(cand, shape, admit) {
                    return outcome;
                }
                let job = self.reservation.as_ref().map_or(0, |r| r.job_id);
                return Outcome::Pending(Reason::BehindReservation { job }, None);
            }
            Fit::Delays | Fit::Nowhere => {}
        }
        if let Some(outcome) = self.try_preempt(cand, shape, admit) {
            return outcome;
        }
        let reason = if let Some(fenced) = self.fenced_reason(shape, false) {
            fenced
        } else if self.free.total == 0 {
            Reason::NoFreeGpus
        } else {
            Reason::InsufficientGpus { replicas: cand.replicas, per_replica: cand.per }
        };
        if self.reservation.is_some() {
            return Outcome::Pending(reason, None);
        }
        self.become_head(cand, shape, reason)
    }

    /// `Reason::BudgetExhausted` when the job's group has spent its budget
    /// of the month, memoised by group for the pass.
    fn budget_spent(&mut self, cand: &Cand<'a>) -> Option<Reason> {
        if self.state.tenancy.budgets.is_empty() {
            return None;
        }
        let (state, now_ms) = (self.state, self.now_ms);
        let group = cand.job.spec.group.as_str();
        self.budget_memo
            .entry(cand.group)
            .or_insert_with(|| {
                state.tenancy.exhausted(group, now_ms).map(|spent| Reason::BudgetExhausted {
                    group: group.to_string(),
                    month: spent.month,
                    used_gpu_ms: spent.used_gpu_ms,
                    budget_gpu_ms: spent.budget.gpu_ms,
                })
            })
            .clone()
    }

    /// Nomad-style feasibility against the healthy cluster, memoised by shape.
    fn static_check(&mut self, shape: ShapeKey, cand: &Cand) -> Option<Reason> {
        if let Some(memo) = self.static_memo.get(&shape) {
            return memo.clone();
        }
        let (set, replicas, per) = shape;
        let classes = &self.class_lists[set];
        let spec = &cand.job.spec;
        let no_match =
            Reason::NoMatchingGpus { model: spec.gpu_model.as_deref().map(str::to_string), min_memory_mib: spec.min_gpu_memory_mib };
        let slots: u64 = self.view.nodes.iter().filter(|n| classes.contains(&n.class)).map(|n| u64::from(n.usable / per)).sum();
        let usable_nodes = self.view.nodes.iter().any(|n| classes.contains(&n.class) && n.usable > 0);
        let verdict = if !usable_nodes || slots < u64::from(replicas) {
            self.fenced_reason(shape, true).or(Some(if usable_nodes {
                Reason::GangTooLarge { replicas, per_replica: per, slots }
            } else {
                no_match
            }))
        } else {
            None
        };
        self.static_memo.insert(shape, verdict.clone());
        verdict
    }

    /// `Reason::Fenced` when fenced GPUs of the matching nodes would hold
    /// the gang: counted with every usable GPU (`whole`, the static check)
    /// or with the GPUs free now.
    fn fenced_reason(&self, shape: ShapeKey, whole: bool) -> Option<Reason> {
        let (node, fence) = self.view.fence_example?;
        let (set, replicas, per) = shape;
        let classes = &self.class_lists[set];
        let mut slots = 0u64;
        let mut fenced_gpus = 0u64;
        for (n, view) in self.view.nodes.iter().enumerate().filter(|(_, v)| classes.contains(&v.class)) {
            let open = if whole { view.usable } else { self.free.avail(n as u32) };
            slots += u64::from((open + view.fenced) / per);
            fenced_gpus += u64::from(view.fenced);
        }
        (fenced_gpus > 0 && slots >= u64::from(replicas)).then(|| Reason::Fenced {
            replicas,
            per_replica: per,
            fenced_gpus,
            node: node.to_string(),
            fence: fence.to_string(),
        })
    }

    /// Allocate / backfill: place the gang whole on the free GPUs, or under a
    /// reservation, only where it cannot delay it.
    fn try_place(&mut self, cand: &Cand<'a>, shape: ShapeKey) -> Fit {
        if self.free.total == 0 || self.no_fit_free.contains_key(&shape) {
            return Fit::Nowhere;
        }
        let (set, replicas, per) = shape;
        let topology = self.config.topology;
        let Some((spread, _)) = place(&self.free, &self.view, replicas, per, &self.class_lists[set], topology) else {
            self.no_fit_free.insert(shape, ());
            return Fit::Nowhere;
        };
        let Some(reservation) = &self.reservation else {
            self.commit(cand, &spread, false);
            return Fit::Placed;
        };
        if self.now_ms.saturating_add(cand.limit_ms) <= reservation.at_ms {
            self.commit(cand, &spread, false);
            return Fit::Placed;
        }
        if self.no_fit_cap.contains_key(&shape) {
            return Fit::Delays;
        }
        match place(&reservation.cap, &self.view, replicas, per, &self.class_lists[set], topology) {
            Some((spread, _)) => {
                self.commit(cand, &spread, true);
                Fit::Placed
            }
            None => {
                self.no_fit_cap.insert(shape, ());
                Fit::Delays
            }
        }
    }

    fn commit(&mut self, cand: &Cand<'a>, spread: &Spread, from_cap: bool) {
        let spec = &cand.job.spec;
        let per = spec.gpus_per_replica;
        let mut ranks = Vec::with_capacity(spec.replicas as usize);
        for &(node, count) in spread {
            for _ in 0..count {
                let gpus = choose_gpus(&mut self.free_gpus[node as usize], per);
                ranks.push(RankPlacement { node: self.view.nodes[node as usize].name.to_string(), gpus });
            }
            let gpus = count * per;
            self.free.take(node, gpus);
            let free_now = self.free.avail(node);
            if let Some(reservation) = &mut self.reservation {
                reservation.taken(node, gpus, free_now, from_cap);
            }
            let end_ms = self.now_ms.saturating_add(cand.limit_ms);
            self.releases.push(Release { end_ms, node, gpus });
        }
        self.quota.charge(cand.group, spec.gpu_model.as_deref(), cand.gpus());
        self.plan.placements.push(Placement { job_id: cand.job.id, ranks });
    }

    /// The first job that can neither start nor preempt: reserve for it
    /// (fifo: everyone else waits behind it).
    fn become_head(&mut self, cand: &Cand<'a>, shape: ShapeKey, reason: Reason) -> Outcome {
        if self.config.mode == Mode::Fifo {
            self.blocked_by = Some(cand.job.id);
        }
        let (set, replicas, per) = shape;
        self.releases.sort_unstable();
        let need = reserve::Need { job_id: cand.job.id, replicas, per, classes: &self.class_lists[set] };
        let reservation = reserve::reserve(&self.free, &self.view, &self.releases, &need, self.now_ms, self.config.topology);
        let Some(reservation) = reservation else {
            return Outcome::Pending(reason, None); // yields: nothing makes it fit
        };
        // Far-off reservations hold GPUs idle for long: a head only reserves
        // within the horizon, which grows with its wait (so it reserves
        // eventually; the bound keeps it from starving).
        let grown_ms = cand.wait_ms / self.config.reservation_wait_divisor.max(1);
        let horizon_ms = self.config.reservation_horizon_ms.saturating_add(grown_ms);
        if reservation.at_ms.saturating_sub(self.now_ms) > horizon_ms {
            return Outcome::Pending(reason, None);
        }
        let estimate = Some(reservation.at_ms);
        let gpus = reservation.gpus;
        if self.config.mode == Mode::Fifo {
            return Outcome::Pending(reason, estimate);
        }
        self.reservation = Some(reservation);
        Outcome::Pending(Reason::Reserved { gpus }, estimate)
    }

    /// Preempt / reclaim for a job that waited past the threshold.
    fn try_preempt(&mut self, cand: &Cand<'a>, shape: ShapeKey, admit: Admit) -> Option<Outcome> {
        let own = self.config_of(cand);
        if !self.config.preempts() || cand.wait_ms < own.preempt_after_ms || self.preempt_attempts >= self.config.max_preemptors_per_pass {
            return None;
        }
        let memo = (shape, cand.group, admit == Admit::InQuota, cand.priority, cand.queue_weight, cand.canary);
        let waited_past = cand.wait_ms - own.preempt_after_ms;
        // Waiting longer only makes more victims eligible: after a failure,
        // only a job that has waited long enough to make another victim
        // eligible can do better.
        if self.preempt_failed.get(&memo).is_some_and(|&retry_from| waited_past < retry_from) {
            return None;
        }
        self.preempt_attempts += 1;
        let (set, replicas, per) = shape;
        let mut excluded = vec![false; self.view.nodes.len()];
        if let Some(reservation) = &self.reservation {
            for &(n, _) in &reservation.spread {
                excluded[n as usize] = true;
            }
        }
        let scratch = Scratch {
            view: &self.view,
            running: &self.running,
            free: &self.free,
            taken: &self.taken,
            excluded: &excluded,
            topology: self.config.topology,
        };
        let need = preempt::Need { replicas, per, classes: &self.class_lists[set] };
        let group = cand.group;
        let quota = &self.quota;
        let favour_short = own.favour_short;
        let lost_weight = own.preempt_wait_per_lost;
        let lost_wait_cap_ms = own.preempt_wait_cap_ms;
        // The least wait that would make one more victim eligible (u64::MAX:
        // none was passed over for want of waiting).
        let retry_from = std::cell::Cell::new(u64::MAX);
        let allowed = |victim: &RunningView| {
            let reclaim = admit == Admit::InQuota && victim.group_id != group && quota.is_borrowing(victim.group_id);
            let priority = victim.group_id == group && victim.priority < cand.priority;
            let short = favour_short && cand.queue_weight > victim.queue_weight && quota.is_borrowing(victim.group_id);
            if !(reclaim || priority || short) {
                return false;
            }
            // Work a victim would lose is weighed against the time the job
            // has waited: the more lost, the longer the wait that justifies it.
            let lost_ms = victim.work_lost_gpu_ms / victim.gpus.max(1);
            let wait_needed_ms = (lost_ms.saturating_mul(lost_weight) / 100).min(lost_wait_cap_ms);
            if wait_needed_ms > waited_past {
                retry_from.set(retry_from.get().min(wait_needed_ms));
                return false;
            }
            true
        };
        let Some(found) = scratch.find(&need, self.now_ms, allowed) else {
            self.preempt_failed.insert(memo, retry_from.get());
            return None;
        };
        self.apply_preemption(cand, &found);
        Some(Outcome::Pending(Reason::Preempting { victims: found.victims.len() }, None))
    }

    fn apply_preemption(&mut self, cand: &Cand<'a>, found: &preempt::Preemption) {
        for &i in &found.victims {
            let run = &self.running[i];
            self.taken[i] = true;
            self.plan.stops.push(Stop { alloc_id: run.alloc_id, reason: StopReason::Preempted });
            self.quota.release(run.group_id, run.model, run.gpus);
        }
        // Hold the free GPUs the job will use, so nobody takes them meanwhile.
        let per = cand.job.spec.gpus_per_replica;
        for &(node, ranks) in &found.spread {
            let hold = self.free.avail(node).min(ranks * per);
            if hold > 0 {
                choose_gpus(&mut self.free_gpus[node as usize], hold);
                self.free.take(node, hold);
                if let Some(reservation) = &mut self.reservation {
                    reservation.taken(node, hold, self.free.avail(node), false);
                }
            }
        }
    }

    /// Record the reason, only if it changed (keeps plans small), and at
    /// most [`MAX_NOTES_PER_PLAN`] of them: the rest differ still on the
    /// next pass and are noted then.
    fn note(&mut self, cand: &Cand, reason: Reason, estimate: Option<u64>) {
        if self.plan.pending.len() >= MAX_NOTES_PER_PLAN {
            return;
        }
        let rendered = self.rendered.entry(reason).or_insert_with_key(Reason::to_job_reason);
        let job = cand.job;
        if cand.estimate != estimate || cand.reason != &*rendered {
            self.plan.pending.push(PendingNote { job_id: job.id, reason: rendered.clone(), estimated_start_ms: estimate });
        }
    }
}

/// Take `count` GPUs from a node's free list: inside one NVLink domain when
/// one holds them (the fullest such domain), else the lowest indexes.
fn choose_gpus(free: &mut Vec<FreeGpu>, count: u32) -> Vec<u32> {
    let count = count as usize;
    let mut domains: Vec<(Option<u32>, usize)> = Vec::new();
    for g in free.iter() {
        match domains.iter_mut().find(|(d, _)| *d == g.nvlink) {
            Some(entry) => entry.1 += 1,
            None => domains.push((g.nvlink, 1)),
        }
    }
    let domain: Option<u32> = domains.iter().filter_map(|&(d, n)| d.filter(|_| n >= count).map(|d| (n, d))).min().map(|(_, d)| d);
    let mut chosen = Vec::with_capacity(count);
    free.retain(|g| {
        let pick = chosen.len() < count && domain.is_none_or(|d| g.nvlink == Some(d));
        if pick {
            chosen.push(g.index);
        }
        !pick
    });
    chosen
}
