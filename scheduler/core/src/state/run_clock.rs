//! When each attempt started running (format 12 on): runtime limits count
//! from it, not from the placement.
//!
//! An attempt is placed on GPUs first and runs once every rank's agent has
//! reported its start. Usually that is milliseconds later; it can be much
//! later when a node stays silent for a while but within its TTL and its
//! jobs' grace (the scheduler must not run the job elsewhere yet), after
//! which the agent starts the ranks it was assigned. Counted from the
//! placement, such an attempt would lose that wait from its runtime limit
//! and could be killed soon after it started. As Slurm's time limit does,
//! the limit starts when the job runs: the committed time of the report
//! that left no rank of the attempt waiting to start.
//!
//! An attempt with a rank still waiting to start is not limited: it is
//! stopped by the start timeout instead (`never_started`). An attempt that
//! was already running when the cluster version reached 12 has no record and
//! keeps the placement as its start.

use super::shared::SharedMap;
use super::types::{AllocId, Allocation, RankState};
use super::ClusterState;

/// The first cluster version whose replicas record when attempts started.
pub const RUN_CLOCK_FROM_VERSION: u16 = 12;

/// Committed time (ms) at which each live attempt had every rank started.
pub type RunningSinceTable = SharedMap<AllocId, u64>;

/// When `alloc`'s runtime limit started counting, or None while one of its
/// ranks is still waiting to start (its limit has not begun).
pub fn limit_counts_from_ms(state: &ClusterState, alloc: &Allocation) -> Option<u64> {
    if let Some(&since_ms) = state.running_since.get(&alloc.id) {
        return Some(since_ms);
    }
    let waiting = alloc.ranks.iter().any(|r| r.state == RankState::Assigned);
    if waiting && state.cluster_version() >= RUN_CLOCK_FROM_VERSION {
        return None;
    }
    Some(alloc.created_at_ms)
}

impl ClusterState {
    /// A rank of `alloc_id` reported its start: once none waits any more,
    /// the attempt runs from now on (format 12 on; recorded once).
    pub(super) fn note_rank_started(&mut self, alloc_id: AllocId) {
        if self.cluster_version() < RUN_CLOCK_FROM_VERSION || self.running_since.contains_key(&alloc_id) {
            return;
        }
        let Some(alloc) = self.allocs.get(&alloc_id) else { return };
        if alloc.ranks.iter().any(|r| r.state == RankState::Assigned) {
            return;
        }
        debug_assert!(self.now_ms >= alloc.created_at_ms, "committed time never goes back");
        self.running_since.insert(alloc_id, self.now_ms);
    }

    /// Every record belongs to a live attempt with no rank waiting to start.
    pub(super) fn check_run_clock(&self) -> Result<(), String> {
        for (alloc_id, since_ms) in self.running_since.iter() {
            let Some(alloc) = self.allocs.get(alloc_id) else {
                return Err(format!("allocation {alloc_id} has a start time but is not live"));
            };
            if alloc.ranks.iter().any(|r| r.state == RankState::Assigned) || *since_ms < alloc.created_at_ms {
                return Err(format!(
                    "allocation {alloc_id} is recorded running since {since_ms} ms but a rank waits or it was placed later"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::bench::fleet_registrations;
    use crate::state::{Command, JobSpec, Placement, Plan, Proposal, RankPlacement, StopReason};

    /// A cluster at `version` with a two-node gang placed at 1,000 s, its
    /// runtime limit 60 s.
    fn gang_placed(version: u16) -> (ClusterState, AllocId) {
        let mut state = ClusterState::default();
        let spec = JobSpec { replicas: 2, gpus_per_replica: 1, runtime_limit_s: 60, ..JobSpec::simple(&["train"]) };
        let mut setup = vec![Command::SetClusterVersion { version }];
        setup.extend(fleet_registrations(2, 2));
        setup.push(Command::SubmitJob { request_id: None, spec });
        state.apply_proposal(1, &Proposal { now_ms: 1_000_000, commands: setup });
        let ranks = vec![RankPlacement { node: "n00000".into(), gpus: vec![1] }, RankPlacement { node: "n00001".into(), gpus: vec![1] }];
        let plan = Plan { placements: vec![Placement { job_id: 1, ranks }], ..Plan::default() };
        state.apply_proposal(2, &Proposal { now_ms: 1_000_000, commands: vec![Command::ApplyPlan(plan)] });
        let alloc_id = *state.allocs.keys().next().expect("placed");
        (state, alloc_id)
    }

    fn started(state: &mut ClusterState, index: u64, now_ms: u64, alloc_id: AllocId, rank: u32) {
        state.apply_proposal(index, &Proposal { now_ms, commands: vec![Command::AllocStarted { alloc_id, rank }] });
    }

    fn stopped_for_runtime(state: &ClusterState, now_ms: u64) -> bool {
        crate::policy::plan(state, now_ms).stops.iter().any(|s| s.reason == StopReason::RuntimeLimit)
    }

    #[test]
    fn a_gang_that_started_late_gets_its_whole_runtime_limit_from_its_start() {
        let (mut state, alloc_id) = gang_placed(RUN_CLOCK_FROM_VERSION);
        // Its second node was silent for 40 s: the gang waits, unlimited.
        started(&mut state, 3, 1_001_000, alloc_id, 0);
        assert!(!stopped_for_runtime(&state, 1_070_000), "a rank still waits: the limit has not begun");
        started(&mut state, 4, 1_040_000, alloc_id, 1);
        assert_eq!(limit_counts_from_ms(&state, &state.allocs[&alloc_id]), Some(1_040_000));
        assert!(!stopped_for_runtime(&state, 1_099_000), "59 s after its start");
        assert!(stopped_for_runtime(&state, 1_100_000), "60 s after its start");
        // A repeated report moves nothing.
        started(&mut state, 5, 1_050_000, alloc_id, 1);
        assert_eq!(state.running_since.get(&alloc_id), Some(&1_040_000));
        state.check_invariants().expect("consistent");
    }

    #[test]
    fn the_record_ends_with_its_attempt() {
        let (mut state, alloc_id) = gang_placed(RUN_CLOCK_FROM_VERSION);
        started(&mut state, 3, 1_001_000, alloc_id, 0);
        started(&mut state, 4, 1_001_000, alloc_id, 1);
        let exits = (0..2).map(|rank| Command::AllocExited { alloc_id, rank, exit_code: 0 }).collect();
        state.apply_proposal(5, &Proposal { now_ms: 1_010_000, commands: exits });
        assert!(state.allocs.is_empty() && state.running_since.is_empty());
        state.check_invariants().expect("consistent");
    }

    #[test]
    fn before_format_12_the_limit_counts_from_the_placement() {
        let (mut state, alloc_id) = gang_placed(11);
        started(&mut state, 3, 1_040_000, alloc_id, 0);
        started(&mut state, 4, 1_040_000, alloc_id, 1);
        assert!(state.running_since.is_empty(), "older replicas keep no record: neither may this one");
        assert!(stopped_for_runtime(&state, 1_060_000));
    }
}
