//! How long a single-node job outlives its node's silence (format 11 on).
//!
//! By default a rank runs only while its node holds its lease: once no
//! heartbeat has been acknowledged for a node TTL the agent stops it, and
//! the scheduler requeues the job after the TTL, the job's grace and a
//! margin. A single-node job may ask to ride out longer outages instead
//! (`--lost-after`), as Nomad's `max_client_disconnect` does:
//!
//! - `After { ms }`: its agent stops it only once it has heard nothing for
//!   that long (never sooner than the TTL); the scheduler keeps it
//!   allocated to the silent node, shown `unknown`, and requeues it only
//!   after that bound, the grace and the margin, counted from the node's
//!   last heard record (`allocs_lost_past_their_bound`);
//! - `Never`: neither side ever gives up on it. It stays allocated to the
//!   silent node, shown `unknown`, and is never run twice; it runs on
//!   when the node comes back, or ends when an operator cancels it and the
//!   node reports the rank's end.
//!
//! A gang spanning nodes never gets this: its ranks on healthy nodes would
//! wait for a rank that may never come back, so its ranks stop with the lease.

use serde::{Deserialize, Serialize};

use super::types::{AllocId, JobId, JobSpec, JobState, NodeState, RankState};
use super::ClusterState;

/// The first cluster version whose replicas keep `--lost-after`.
pub const LOST_AFTER_FROM_VERSION: u16 = 11;
/// The longest finite `--lost-after`: a week.
pub const MAX_LOST_AFTER_MS: u64 = 7 * 24 * 3_600_000;

/// How long a job outlives its node's silence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LostAfter {
    After { ms: u64 },
    Never,
}

impl LostAfter {
    /// How long the rank outlives its node's silence with this TTL: never
    /// less than the TTL (a shorter value acts as the TTL). `None`: forever.
    pub fn effective_ms(self, node_ttl_ms: u64) -> Option<u64> {
        match self {
            LostAfter::After { ms } => Some(ms.max(node_ttl_ms)),
            LostAfter::Never => None,
        }
    }

    /// `never`, or a duration as people write it (`90s`, `30m`, `2h`, `1d`,
    /// or milliseconds with `ms`).
    pub fn parse(text: &str) -> Result<LostAfter, String> {
        let text = text.trim();
        if text == "never" {
            return Ok(LostAfter::Never);
        }
        let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: u64 = number.parse().map_err(|_| format!("{text:?}: expected never or a duration such as 90s, 30m, 2h, 1d"))?;
        let unit_ms: u64 = match unit {
            "ms" => 1,
            "s" | "" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            other => return Err(format!("{text:?}: unknown unit {other:?} (ms, s, m, h, d)")),
        };
        let ms = number.checked_mul(unit_ms).ok_or_else(|| format!("{text:?}: too long"))?;
        let lost_after = LostAfter::After { ms };
        lost_after.validate()?;
        Ok(lost_after)
    }

    fn validate(self) -> Result<(), String> {
        match self {
            LostAfter::After { ms: 0 } => Err("must be above zero (leave it out for the node TTL)".into()),
            LostAfter::After { ms } if ms > MAX_LOST_AFTER_MS => {
                Err(format!("{ms} ms is above the longest, {MAX_LOST_AFTER_MS} ms (a week); use never"))
            }
            _ => Ok(()),
        }
    }

    /// As `parse` reads it back.
    pub fn text(self) -> String {
        match self {
            LostAfter::Never => "never".into(),
            LostAfter::After { ms } if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
            LostAfter::After { ms } if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
            LostAfter::After { ms } if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
            LostAfter::After { ms } if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
            LostAfter::After { ms } => format!("{ms}ms"),
        }
    }
}

/// Is `lost_after` allowed for a job of `spec`? The reason if not (the
/// caller names the field, `lost_after`).
pub fn validate_lost_after(spec: &JobSpec, lost_after: LostAfter) -> Result<(), String> {
    lost_after.validate()?;
    if spec.replicas != 1 {
        return Err(format!(
            "only single-node jobs (replicas 1) outlive their node's lease; this job has {} ranks, which stop with the lease",
            spec.replicas
        ));
    }
    Ok(())
}

impl ClusterState {
    /// The job's `--lost-after`, if it set one.
    pub fn lost_after_of(&self, job_id: JobId) -> Option<LostAfter> {
        self.lost_after.get(&job_id).copied()
    }

    /// Does the allocation stay on its node when the node is declared down?
    pub fn held_through_node_loss(&self, alloc_id: AllocId) -> bool {
        let Some(alloc) = self.allocs.get(&alloc_id) else { return false };
        alloc.ranks.len() == 1 && self.lost_after.contains_key(&alloc.job_id)
    }

    /// A job kept by its lost-after on a node that is down: whether its
    /// rank still runs is unknown until the node is heard again. (A gang
    /// stopping because a node went down is not: its rank there counts as
    /// ended.)
    pub fn job_state_unknown(&self, job_id: JobId) -> bool {
        if !self.lost_after.contains_key(&job_id) {
            return false;
        }
        let Some(job) = self.jobs.get(&job_id) else { return false };
        let Some(alloc) = job.alloc.and_then(|id| self.allocs.get(&id)) else { return false };
        debug_assert!(!job.state.is_final() && job.state != JobState::Pending, "a job holding an allocation is placed");
        alloc.ranks.iter().filter(|rank| rank.state != RankState::Exited).any(|rank| self.node_is_down(&rank.node))
    }

    fn node_is_down(&self, name: &str) -> bool {
        self.nodes.get(name).is_some_and(|node| node.state == NodeState::Down)
    }

    /// Ranks held on a down node past their `--lost-after`, as (allocation,
    /// rank): their agent, silent since at latest its node's heard record
    /// plus a TTL (see the leader's heartbeat table), stopped them at its
    /// bound and they are gone after their grace and `margin_ms`. Measured
    /// in committed time. At most `limit` (the caller proposes them).
    pub fn allocs_lost_past_their_bound(&self, node_ttl_ms: u64, margin_ms: u64, limit: usize) -> Vec<(AllocId, u32)> {
        let mut lost = Vec::new();
        // Called on every leader pass: nothing to look at without a down node.
        if self.lost_after.is_empty() || !self.nodes.values().any(|node| node.state == NodeState::Down) {
            return lost;
        }
        for (&job_id, lost_after) in &self.lost_after {
            if lost.len() >= limit {
                break;
            }
            let Some(bound_ms) = lost_after.effective_ms(node_ttl_ms) else { continue };
            let Some(job) = self.jobs.get(&job_id) else { continue };
            let Some(alloc) = job.alloc.and_then(|id| self.allocs.get(&id)) else { continue };
            for rank in alloc.ranks.iter().filter(|rank| rank.state != RankState::Exited) {
                let down = self.node_is_down(&rank.node);
                // No record (never heard by a leader that kept one): not yet.
                let Some(&heard_ms) = self.node_heard_ms.get(&rank.node) else { continue };
                let grace_ms = job.spec.grace_period_s.saturating_mul(1_000);
                let due_ms =
                    heard_ms.saturating_add(node_ttl_ms).saturating_add(bound_ms).saturating_add(grace_ms).saturating_add(margin_ms);
                if down && self.now_ms > due_ms {
                    lost.push((alloc.id, rank.rank));
                }
            }
        }
        lost
    }
}

/// The table of `--lost-after` by job: live jobs only.
pub type LostAfterTable = super::shared::SharedMap<JobId, LostAfter>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::node;
    use crate::state::{Command, CommandResult, Placement, Plan, Proposal, RankPlacement, Rejection, StopReason};

    const TTL_MS: u64 = 2_000;
    const MARGIN_MS: u64 = 2_500;

    fn run(state: &mut ClusterState, now_ms: u64, commands: Vec<Command>) -> Vec<CommandResult> {
        let index = state.applied_index + 1;
        let results = state.apply_proposal(index, &Proposal { now_ms, commands });
        state.check_invariants().expect("invariants hold after every entry");
        results
    }

    /// A cluster at format 11 with nodes `a` and `b`, running job 1 on `a`
    /// (submitted with `lost_after`, if any) and a 2-node gang, job 2.
    fn running(lost_after: Option<LostAfter>) -> ClusterState {
        let mut state = ClusterState::default();
        run(&mut state, 1_000, vec![Command::SetClusterVersion { version: LOST_AFTER_FROM_VERSION }]);
        run(&mut state, 1_000, vec![Command::RegisterNode(node("a", 8)), Command::RegisterNode(node("b", 8))]);
        let single = Command::SubmitJob { request_id: None, spec: JobSpec { gpus_per_replica: 1, ..JobSpec::simple(&["x"]) } };
        let single = match lost_after {
            Some(lost_after) => Command::WithLostAfter { lost_after, command: Box::new(single) },
            None => single,
        };
        let gang = Command::SubmitJob { request_id: None, spec: JobSpec { replicas: 2, gpus_per_replica: 1, ..JobSpec::simple(&["x"]) } };
        let results = run(&mut state, 1_000, vec![single, gang]);
        assert!(results.iter().all(|r| matches!(r, CommandResult::Submitted { .. })), "{results:?}");
        let rank = |node: &str, gpu: u32| RankPlacement { node: node.into(), gpus: vec![gpu] };
        let plan = Plan {
            computed_at_index: state.applied_index,
            placements: vec![
                Placement { job_id: 1, ranks: vec![rank("a", 0)] },
                Placement { job_id: 2, ranks: vec![rank("a", 1), rank("b", 0)] },
            ],
            ..Plan::default()
        };
        run(&mut state, 1_000, vec![Command::ApplyPlan(plan)]);
        run(&mut state, 1_000, vec![Command::NodesHeard { nodes: vec!["a".into(), "b".into()] }]);
        state
    }

    #[test]
    fn a_down_node_keeps_its_single_node_job_with_a_lost_after_and_ends_the_rest() {
        let mut state = running(Some(LostAfter::After { ms: 60_000 }));
        assert_eq!(state.lost_after_of(1), Some(LostAfter::After { ms: 60_000 }));
        run(&mut state, 10_000, vec![Command::NodeDown { node: "a".into() }]);
        assert_eq!(state.jobs[&1].state, JobState::Running, "kept on its silent node");
        assert!(state.job_state_unknown(1), "shown unknown while its node is down");
        assert_eq!(state.jobs[&2].state, JobState::Stopping, "the gang stops with the lease");
        assert!(!state.job_state_unknown(2), "a gang stopping for its lost node is shown stopping");
        // Not before heard + TTL + bound + grace (60 s) + margin.
        let due_ms = 1_000 + TTL_MS + 60_000 + 60_000 + MARGIN_MS;
        run(&mut state, due_ms, vec![]);
        assert_eq!(state.allocs_lost_past_their_bound(TTL_MS, MARGIN_MS, 10), vec![]);
        run(&mut state, due_ms + 1, vec![]);
        let lost = state.allocs_lost_past_their_bound(TTL_MS, MARGIN_MS, 10);
        assert_eq!(lost, vec![(1, 0)]);
        run(&mut state, due_ms + 2, vec![Command::AllocLost { alloc_id: 1, rank: 0 }]);
        assert_eq!(state.jobs[&1].state, JobState::Pending, "requeued once past its bound");
        assert_eq!(state.jobs[&1].reason.code, crate::state::ReasonCode::NodeLost);
        assert_eq!(state.lost_after_of(1), Some(LostAfter::After { ms: 60_000 }), "kept for its next attempt");
    }

    #[test]
    fn never_stays_on_its_node_through_any_silence_and_runs_on_when_it_returns() {
        let mut state = running(Some(LostAfter::Never));
        run(&mut state, 10_000, vec![Command::NodeDown { node: "a".into() }]);
        run(&mut state, 1_000_000_000, vec![]);
        assert_eq!(state.allocs_lost_past_their_bound(TTL_MS, MARGIN_MS, 10), vec![]);
        assert!(state.job_state_unknown(1));
        run(&mut state, 1_000_000_001, vec![Command::RegisterNode(node("a", 8))]);
        assert_eq!(state.jobs[&1].state, JobState::Running);
        assert!(!state.job_state_unknown(1), "its node is back");
        // Its end, reported by the node, ends it as usual and drops the bound.
        run(&mut state, 1_000_000_002, vec![Command::AllocExited { alloc_id: 1, rank: 0, exit_code: 0 }]);
        assert_eq!(state.jobs[&1].state, JobState::Succeeded);
        assert_eq!(state.lost_after_of(1), None);
    }

    #[test]
    fn without_a_lost_after_a_down_node_requeues_at_once() {
        let mut state = running(None);
        run(&mut state, 10_000, vec![Command::NodeDown { node: "a".into() }]);
        assert_eq!(state.jobs[&1].state, JobState::Pending);
        assert!(!state.job_state_unknown(1));
    }

    #[test]
    fn a_lost_after_on_a_gang_or_an_old_cluster_is_refused_and_nothing_is_stored() {
        let mut state = ClusterState::default();
        let gang = Command::SubmitJob { request_id: Some("r".into()), spec: JobSpec { replicas: 2, ..JobSpec::simple(&["x"]) } };
        let wrapped = Command::WithLostAfter { lost_after: LostAfter::Never, command: Box::new(gang) };
        let old = run(&mut state, 1_000, vec![wrapped.clone()]);
        assert!(matches!(&old[0], CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "lost_after"), "{old:?}");
        run(&mut state, 1_000, vec![Command::SetClusterVersion { version: LOST_AFTER_FROM_VERSION }]);
        let gang = run(&mut state, 1_000, vec![wrapped]);
        assert!(matches!(&gang[0], CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "lost_after"), "{gang:?}");
        assert!(state.jobs.is_empty() && state.dedupe.is_empty() && state.lost_after.is_empty());
        let cancel = Command::WithLostAfter { lost_after: LostAfter::Never, command: Box::new(Command::CancelJob { job_id: 1 }) };
        assert!(matches!(&run(&mut state, 1_000, vec![cancel])[0], CommandResult::Rejected(Rejection::Invalid { .. })));
    }

    #[test]
    fn a_rank_lost_to_a_full_disk_requeues_its_job_with_that_reason() {
        let mut state = running(None);
        let lost = Command::AllocLostFor { alloc_id: 1, rank: 0, reason: StopReason::AgentDiskFull };
        run(&mut state, 2_000, vec![lost]);
        assert_eq!(state.jobs[&1].state, JobState::Pending);
        assert_eq!(state.jobs[&1].reason.code, crate::state::ReasonCode::AgentDiskFull);
        let bogus = Command::AllocLostFor { alloc_id: 2, rank: 0, reason: StopReason::Cancelled };
        assert!(
            matches!(&run(&mut state, 2_000, vec![bogus])[0], CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "reason")
        );
        assert_eq!(state.jobs[&2].state, JobState::Running, "a refused cause changes nothing");
    }

    #[test]
    fn the_table_survives_a_snapshot_in_format_11() {
        let state = running(Some(LostAfter::After { ms: 90_000 }));
        let restored = ClusterState::from_snapshot(&state.to_snapshot()).expect("decodes");
        assert_eq!(restored.lost_after, state.lost_after);
        assert_eq!(restored, state);
    }

    #[test]
    fn durations_and_never_parse_and_print_back() {
        assert_eq!(LostAfter::parse("never"), Ok(LostAfter::Never));
        assert_eq!(LostAfter::parse("90s"), Ok(LostAfter::After { ms: 90_000 }));
        assert_eq!(LostAfter::parse("30m"), Ok(LostAfter::After { ms: 1_800_000 }));
        assert_eq!(LostAfter::parse("250ms"), Ok(LostAfter::After { ms: 250 }));
        assert_eq!(LostAfter::parse("2h").map(LostAfter::text), Ok("2h".to_string()));
        assert_eq!(LostAfter::parse("1500ms").map(LostAfter::text), Ok("1500ms".to_string()));
        assert_eq!(LostAfter::parse("7d"), Ok(LostAfter::After { ms: MAX_LOST_AFTER_MS }));
    }

    #[test]
    fn bad_values_say_why() {
        assert!(LostAfter::parse("0s").unwrap_err().contains("above zero"));
        assert!(LostAfter::parse("8d").unwrap_err().contains("a week"));
        assert!(LostAfter::parse("5 parsecs").unwrap_err().contains("unit"));
        assert!(LostAfter::parse("soon").unwrap_err().contains("never or a duration"));
        assert!(LostAfter::parse("99999999999999999999d").is_err());
    }

    #[test]
    fn a_bound_below_the_ttl_acts_as_the_ttl() {
        assert_eq!(LostAfter::After { ms: 500 }.effective_ms(2_000), Some(2_000));
        assert_eq!(LostAfter::After { ms: 60_000 }.effective_ms(2_000), Some(60_000));
        assert_eq!(LostAfter::Never.effective_ms(2_000), None);
    }

    #[test]
    fn gangs_may_not_outlive_their_lease() {
        let spec = JobSpec { replicas: 2, ..JobSpec::simple(&["train.py"]) };
        let Err(message) = validate_lost_after(&spec, LostAfter::Never) else { panic!("accepted") };
        assert!(message.contains("single-node"), "{message}");
        let single = JobSpec::simple(&["train.py"]);
        assert_eq!(validate_lost_after(&single, LostAfter::Never), Ok(()));
    }
}
