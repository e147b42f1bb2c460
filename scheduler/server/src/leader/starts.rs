//! Ranks assigned but never started. An agent that accepts an assignment
//! and never reports the rank started (its exec wedged, its disk refusing
//! the rank's records, its reports lost) would otherwise hold the
//! allocation's GPUs and leave its job `running` for good. Past a bound
//! (`--start-timeout-ms`, by default 2 x the node TTL + 30 s) the leader
//! stops the allocation as lost, so its job is requeued.
//!
//! Stopping is all it does: the GPUs are freed only once the agent is known
//! not to run the rank, when it reports the rank's exit (an agent that gets
//! a stop for a rank it never started reports it ended at once) or its node
//! is declared down. A job is never started twice because of this bound.
//!
//! Pure: time is the caller's monotonic `now_ms`. Each term starts with an
//! empty table, so a rank's wait counts from when this leader first saw it
//! assigned: a failover only lengthens the wait.

use std::collections::{BTreeSet, HashMap};

use rota_core::state::{AllocId, ClusterState, RankState};

/// The default bound: two node TTLs (an agent that restarts, or whose watch
/// lags, gets a whole lease to catch up) plus 30 s for its slowest start.
pub fn default_start_timeout_ms(node_ttl_ms: u64) -> u64 {
    node_ttl_ms.saturating_mul(2).saturating_add(30_000)
}

/// Most ranks the table follows at once (a cluster assigns far fewer).
const MAX_WATCHED: usize = 100_000;

#[derive(Debug)]
pub struct StartWatch {
    timeout_ms: u64,
    /// (allocation, rank) -> monotonic ms when this leader first saw it assigned.
    first_seen_ms: HashMap<(AllocId, u32), u64>,
}

impl StartWatch {
    pub fn new(timeout_ms: u64) -> StartWatch {
        StartWatch { timeout_ms, first_seen_ms: HashMap::new() }
    }

    /// Allocations with a rank assigned, not stopping, and not started
    /// within the bound. Ranks no longer waiting are forgotten.
    pub fn overdue(&mut self, state: &ClusterState, now_ms: u64) -> Vec<AllocId> {
        let mut waiting = BTreeSet::new();
        for alloc in state.allocs.values().filter(|a| a.stop.is_none()) {
            for (rank, _) in alloc.ranks.iter().enumerate().filter(|(_, r)| r.state == RankState::Assigned) {
                waiting.insert((alloc.id, rank as u32));
            }
        }
        self.first_seen_ms.retain(|key, _| waiting.contains(key));
        let mut overdue = BTreeSet::new();
        for key in waiting {
            if !self.first_seen_ms.contains_key(&key) && self.first_seen_ms.len() >= MAX_WATCHED {
                continue;
            }
            let first = *self.first_seen_ms.entry(key).or_insert(now_ms);
            if now_ms.saturating_sub(first) > self.timeout_ms {
                overdue.insert(key.0);
            }
        }
        overdue.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::{Command, GpuInfo, JobSpec, NodeRegistration, Placement, Plan, Proposal, RankPlacement, Stop, StopReason};

    fn apply(state: &mut ClusterState, command: Command) {
        let index = state.applied_index + 1;
        state.apply_proposal(index, &Proposal { now_ms: 1_000, commands: vec![command] });
    }

    fn state_with_one_assigned_rank() -> (ClusterState, AllocId) {
        let mut state = ClusterState::default();
        let gpus = (0..8)
            .map(|index| GpuInfo {
                index,
                uuid: format!("n1-{index}"),
                model: "H100".into(),
                memory_mib: 81_920,
                healthy: true,
                nvlink_domain: None,
            })
            .collect();
        let node = NodeRegistration { name: "n1".into(), address: "n1:1".into(), rack: String::new(), leaf: String::new(), gpus };
        apply(&mut state, Command::RegisterNode(node));
        apply(&mut state, Command::SubmitJob { request_id: None, spec: JobSpec::simple(&["true"]) });
        let job_id = *state.jobs.keys().next().expect("submitted");
        let placement = Placement { job_id, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![0] }] };
        let computed_at_index = state.applied_index;
        apply(&mut state, Command::ApplyPlan(Plan { computed_at_index, placements: vec![placement], ..Plan::default() }));
        let alloc_id = *state.allocs.keys().next().expect("placed");
        (state, alloc_id)
    }

    #[test]
    fn a_rank_not_started_within_the_bound_is_overdue_once() {
        let (mut state, alloc_id) = state_with_one_assigned_rank();
        let mut watch = StartWatch::new(5_000);
        assert!(watch.overdue(&state, 100).is_empty(), "first seen now");
        assert!(watch.overdue(&state, 5_100).is_empty(), "at the bound: not yet");
        assert_eq!(watch.overdue(&state, 5_101), vec![alloc_id]);
        let stop = Plan {
            computed_at_index: state.applied_index,
            stops: vec![Stop { alloc_id, reason: StopReason::NodeLost }],
            ..Plan::default()
        };
        apply(&mut state, Command::ApplyPlan(stop));
        assert!(watch.overdue(&state, 9_000).is_empty(), "a stopping allocation is not stopped again");
    }

    #[test]
    fn a_started_rank_is_never_overdue_and_a_new_term_waits_anew() {
        let (mut state, alloc_id) = state_with_one_assigned_rank();
        let mut watch = StartWatch::new(5_000);
        watch.overdue(&state, 0);
        let mut next_term = StartWatch::new(5_000);
        assert!(next_term.overdue(&state, 5_500).is_empty(), "a new leader counts from when it first saw the rank");
        apply(&mut state, Command::AllocStarted { alloc_id, rank: 0 });
        assert!(watch.overdue(&state, 60_000).is_empty());
        assert!(watch.first_seen_ms.is_empty(), "started ranks are forgotten");
    }

    #[test]
    fn the_default_bound_is_two_ttls_and_thirty_seconds() {
        assert_eq!(default_start_timeout_ms(30_000), 90_000);
    }
}
