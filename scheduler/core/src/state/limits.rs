//! Bounds on the replicated tables, and how an administrator changes them.
//!
//! The bounds decide what apply does (a submit beyond `max_live_jobs` is
//! refused, the oldest finished job beyond `max_finished_jobs` is dropped),
//! so every replica must hold the same ones at every log index. They start
//! at the defaults on every replica and change only through
//! `Command::SetLimits` in the log (format 13 on); a snapshot carries them.
//! No replica takes them from its own command line: a replica restarted or
//! joined with other flags would replay the same log to another state.

use serde::{Deserialize, Serialize};

use super::ClusterState;

/// A refused change: the field at fault and why (apply makes it a
/// `Rejection::Invalid`).
pub type LimitError = (&'static str, String);

/// The first cluster version whose replicas apply `Command::SetLimits`.
pub const LIMITS_FROM_VERSION: u16 = 13;

/// Highest live-job bound: some 2 KB of every replica's memory a job, so
/// 1,000,000 live jobs take about 2 GB beside the finished ones.
pub const MAX_LIVE_JOBS_BOUND: u64 = 1_000_000;
/// Highest finished-job bound: 1,000,000 finished and 50,000 pending jobs
/// took 2.4 GB per replica (BENCHMARKS.md, "The state at a million jobs").
pub const MAX_FINISHED_JOBS_BOUND: u64 = 2_000_000;
/// Spec bytes may be set from 1 MiB to 8 GiB.
pub const SPEC_BYTES_RANGE: (u64, u64) = (1 << 20, 8 << 30);
/// Most finished jobs one `SetLimits` may drop: each is removed from the
/// tables and its record archived within one apply, which holds the state
/// lock; a larger cut is made in several changes.
pub const MAX_DROPPED_PER_CHANGE: u64 = 100_000;

/// Bounds on the replicated tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateLimits {
    /// Live (not final) jobs; a submit beyond this is refused.
    pub max_live_jobs: usize,
    /// Finished jobs kept for reading; older ones are dropped.
    pub max_finished_jobs: usize,
    pub dedupe_capacity: usize,
    pub max_nodes: usize,
    pub max_queues: usize,
    pub max_quotas: usize,
    /// Bytes of specs (`JobSpec::payload_bytes`) of every job held, live or
    /// finished: the state's memory budget for what users send.
    pub max_spec_bytes: u64,
}

impl Default for StateLimits {
    fn default() -> Self {
        Self {
            max_live_jobs: 200_000,
            max_finished_jobs: 100_000,
            dedupe_capacity: 300_000,
            max_nodes: 10_000,
            max_queues: 64,
            max_quotas: 4_096,
            max_spec_bytes: 1 << 30,
        }
    }
}

/// The bounds an administrator may change; `None` keeps the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LimitsChange {
    pub max_live_jobs: Option<u64>,
    pub max_finished_jobs: Option<u64>,
    pub max_spec_bytes: Option<u64>,
}

impl LimitsChange {
    /// Each given bound within its range; at least one given.
    pub fn check(&self) -> Result<(), LimitError> {
        if self.max_live_jobs.is_none() && self.max_finished_jobs.is_none() && self.max_spec_bytes.is_none() {
            return Err(("limits", "give at least one of max_live_jobs, max_finished_jobs, max_spec_bytes".into()));
        }
        if let Some(live) = self.max_live_jobs.filter(|n| !(1..=MAX_LIVE_JOBS_BOUND).contains(n)) {
            return Err(("max_live_jobs", format!("must be 1..={MAX_LIVE_JOBS_BOUND}, got {live}")));
        }
        if let Some(kept) = self.max_finished_jobs.filter(|n| *n > MAX_FINISHED_JOBS_BOUND) {
            return Err(("max_finished_jobs", format!("must be 0..={MAX_FINISHED_JOBS_BOUND}, got {kept}")));
        }
        let (low, high) = SPEC_BYTES_RANGE;
        if let Some(bytes) = self.max_spec_bytes.filter(|n| !(low..=high).contains(n)) {
            return Err(("max_spec_bytes", format!("must be {low}..={high}, got {bytes}")));
        }
        Ok(())
    }

    /// What the audit trail says of it.
    pub fn summary(&self) -> String {
        let parts: Vec<String> =
            [("max_live_jobs", self.max_live_jobs), ("max_finished_jobs", self.max_finished_jobs), ("max_spec_bytes", self.max_spec_bytes)]
                .into_iter()
                .filter_map(|(name, value)| value.map(|v| format!("{name}={v}")))
                .collect();
        format!("set limits {}", parts.join(" "))
    }
}

/// One bounded table: what the state holds of it and its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableUse {
    /// `live_jobs`, `finished_jobs`, `spec_bytes`, `nodes`, `queues`, `quotas`.
    pub table: &'static str,
    pub held: u64,
    pub max: u64,
}

impl ClusterState {
    /// Each bounded table beside its bound (`rota limits show`, the
    /// `rota_table_held` and `rota_table_limit` gauges). O(1).
    pub fn table_use(&self) -> [TableUse; 6] {
        let limits = &self.limits;
        let table = |table, held: usize, max: usize| TableUse { table, held: held as u64, max: max as u64 };
        [
            table("live_jobs", self.live_jobs, limits.max_live_jobs),
            table("finished_jobs", self.finished.len(), limits.max_finished_jobs),
            TableUse { table: "spec_bytes", held: self.spec_bytes, max: limits.max_spec_bytes },
            table("nodes", self.nodes.len(), limits.max_nodes),
            table("queues", self.queues.len(), limits.max_queues),
            table("quotas", self.quotas.len(), limits.max_quotas),
        ]
    }

    /// Apply `change`: bounds below what is held refuse new work (live jobs,
    /// spec bytes) or drop the oldest finished jobs at once, at most
    /// `MAX_DROPPED_PER_CHANGE` of them.
    pub(super) fn set_limits(&mut self, index: u64, change: &LimitsChange) -> Result<(), LimitError> {
        change.check()?;
        if let Some(kept) = change.max_finished_jobs {
            let dropped = (self.finished.len() as u64).saturating_sub(kept);
            if dropped > MAX_DROPPED_PER_CHANGE {
                let held = self.finished.len();
                return Err((
                    "max_finished_jobs",
                    format!("{kept} would drop {dropped} of the {held} finished jobs held at once; lower it in steps that drop at most {MAX_DROPPED_PER_CHANGE}"),
                ));
            }
            self.limits.max_finished_jobs = kept as usize;
        }
        if let Some(live) = change.max_live_jobs {
            self.limits.max_live_jobs = live as usize;
        }
        if let Some(bytes) = change.max_spec_bytes {
            self.limits.max_spec_bytes = bytes;
        }
        self.drop_finished_over_limit(index);
        debug_assert!(self.finished.len() <= self.limits.max_finished_jobs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::state::auth::{Actor, Role};
    use crate::state::{Command, CommandResult, JobSpec, Proposal, Rejection};

    const T0: u64 = 1_796_083_200_000;

    fn one(state: &mut ClusterState, command: Command) -> CommandResult {
        let index = state.applied_index + 1;
        let result = state.apply_proposal(index, &Proposal { now_ms: T0 + index, commands: vec![command] }).remove(0);
        state.check_invariants().expect("invariants hold after every entry");
        result
    }

    fn by(user: &str, command: Command) -> Command {
        let actor = Actor { user: Some(user.into()), impersonator: None, from: "127.0.0.1:9".into() };
        Command::Audited { actor, command: Box::new(command) }
    }

    fn submit(state: &mut ClusterState, n: u64) -> CommandResult {
        one(state, Command::SubmitJob { request_id: Some(format!("r{n}")), spec: JobSpec::simple(&["train.py"]) })
    }

    /// A format 13 cluster with an admin ada and an operator otto.
    fn cluster() -> ClusterState {
        let mut state = ClusterState::default();
        assert_eq!(one(&mut state, Command::SetClusterVersion { version: LIMITS_FROM_VERSION }), CommandResult::Done);
        assert_eq!(one(&mut state, Command::BootstrapAdmin { name: "ada".into() }), CommandResult::Done);
        let otto = Command::SetUser { name: "otto".into(), role: Role::Operator, groups: BTreeSet::new(), impersonate: false };
        assert_eq!(one(&mut state, by("ada", otto)), CommandResult::Done);
        state
    }

    #[test]
    fn each_bound_out_of_range_names_its_field() {
        let field_of = |change: LimitsChange| match change.check() {
            Err((field, _)) => field,
            Ok(()) => panic!("{change:?} was not refused"),
        };
        assert_eq!(field_of(LimitsChange::default()), "limits");
        assert_eq!(field_of(LimitsChange { max_live_jobs: Some(0), ..Default::default() }), "max_live_jobs");
        assert_eq!(field_of(LimitsChange { max_live_jobs: Some(MAX_LIVE_JOBS_BOUND + 1), ..Default::default() }), "max_live_jobs");
        assert_eq!(
            field_of(LimitsChange { max_finished_jobs: Some(MAX_FINISHED_JOBS_BOUND + 1), ..Default::default() }),
            "max_finished_jobs"
        );
        assert_eq!(field_of(LimitsChange { max_spec_bytes: Some(1_000), ..Default::default() }), "max_spec_bytes");
        assert_eq!(field_of(LimitsChange { max_spec_bytes: Some((8 << 30) + 1), ..Default::default() }), "max_spec_bytes");
        let edges =
            LimitsChange { max_live_jobs: Some(MAX_LIVE_JOBS_BOUND), max_finished_jobs: Some(0), max_spec_bytes: Some(SPEC_BYTES_RANGE.0) };
        assert_eq!(edges.check(), Ok(()));
    }

    #[test]
    fn the_summary_names_only_what_changes() {
        let change = LimitsChange { max_live_jobs: Some(5), max_spec_bytes: Some(1 << 20), ..Default::default() };
        assert_eq!(change.summary(), "set limits max_live_jobs=5 max_spec_bytes=1048576");
    }

    #[test]
    fn only_an_admin_changes_the_limits_and_a_refused_change_changes_nothing() {
        let mut state = cluster();
        let before = state.limits;
        let change = LimitsChange { max_live_jobs: Some(10), ..Default::default() };
        let refused = one(&mut state, by("otto", Command::SetLimits(change)));
        assert!(matches!(refused, CommandResult::Rejected(Rejection::PermissionDenied { .. })), "{refused:?}");
        let bad = LimitsChange { max_live_jobs: Some(10), max_spec_bytes: Some(1), ..Default::default() };
        let invalid = one(&mut state, by("ada", Command::SetLimits(bad)));
        assert!(matches!(&invalid, CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "max_spec_bytes"), "{invalid:?}");
        assert_eq!(state.limits, before, "neither change applied any bound");
        assert_eq!(one(&mut state, by("ada", Command::SetLimits(change))), CommandResult::Done);
        assert_eq!(state.limits, StateLimits { max_live_jobs: 10, ..before });
        let bare = one(&mut state, Command::SetLimits(change));
        assert!(matches!(bare, CommandResult::Rejected(Rejection::Invalid { .. })), "only inside an audited command: {bare:?}");
    }

    #[test]
    fn a_lower_live_bound_refuses_new_jobs_and_keeps_the_held_ones() {
        let mut state = cluster();
        for n in 0..3 {
            assert!(matches!(submit(&mut state, n), CommandResult::Submitted { .. }));
        }
        let change = LimitsChange { max_live_jobs: Some(2), ..Default::default() };
        assert_eq!(one(&mut state, by("ada", Command::SetLimits(change))), CommandResult::Done);
        assert_eq!(state.live_jobs, 3, "held jobs stay");
        let refused = submit(&mut state, 3);
        assert!(matches!(refused, CommandResult::Rejected(Rejection::Exhausted { limit: 2, .. })), "{refused:?}");
    }

    #[test]
    fn a_lower_finished_bound_drops_the_oldest_finished_jobs_at_once() {
        let mut state = cluster();
        for n in 0..5 {
            submit(&mut state, n);
        }
        let ids: Vec<_> = state.jobs.keys().copied().collect();
        for id in &ids {
            let cancelled = one(&mut state, Command::CancelJob { job_id: *id });
            assert!(matches!(cancelled, CommandResult::Cancelled { .. }), "{cancelled:?}");
        }
        assert_eq!(state.finished.len(), 5);
        let change = LimitsChange { max_finished_jobs: Some(2), ..Default::default() };
        assert_eq!(one(&mut state, by("ada", Command::SetLimits(change))), CommandResult::Done);
        assert_eq!(state.jobs.keys().copied().collect::<Vec<_>>(), ids[3..].to_vec(), "the newest two are kept");
        assert_eq!(state.finished.len(), 2);
    }

    #[test]
    fn replicas_started_with_other_bounds_end_alike_once_the_log_sets_them() {
        // Before the bounds were in the log, a replica took the finished
        // bound from its command line: two replicas applying one log kept
        // different jobs. The log's change now decides on both.
        let mut log = vec![Command::SetClusterVersion { version: LIMITS_FROM_VERSION }, Command::BootstrapAdmin { name: "ada".into() }];
        let change = LimitsChange { max_finished_jobs: Some(1), ..Default::default() };
        log.push(by("ada", Command::SetLimits(change)));
        for n in 0..3u64 {
            log.push(Command::SubmitJob { request_id: Some(format!("r{n}")), spec: JobSpec::simple(&["train.py"]) });
            log.push(Command::CancelJob { job_id: n + 1 });
        }
        let replay = |limits: StateLimits| {
            let mut state = ClusterState::new(limits);
            for command in &log {
                one(&mut state, command.clone());
            }
            state
        };
        let founding = replay(StateLimits::default());
        let other = replay(StateLimits { max_finished_jobs: 50, ..StateLimits::default() });
        assert_eq!(founding.jobs.keys().copied().collect::<Vec<_>>(), vec![3]);
        assert_eq!(founding, other);
    }
}
