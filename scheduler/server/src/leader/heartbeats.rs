//! The leader's heartbeat table: when each node was last heard from in this
//! term. Pure: time is the caller's monotonic `now_ms`, so the rules are
//! tested without clocks or sleeps.
//!
//! Rules:
//! - a term starts with an empty table; a node first considered in this term
//!   starts its grace period then (one TTL), so a failover alone never marks
//!   a node down;
//! - a node is silent when not heard from for more than the TTL plus the
//!   longest grace period of the jobs running there plus a margin
//!   (`loss_margin_ms`):
//!   its agent, cut off since its last heartbeat, stops those ranks once
//!   its own lease (the same TTL, counted from that heartbeat) runs out, and
//!   they are gone after their grace; only then may the jobs run elsewhere;
//! - down nodes are forgotten, so one that comes back gets a fresh grace period.

use std::collections::HashMap;

use rota_core::state::{ClusterState, NodeState};

/// Added to TTL + grace before a node is declared down. It covers what lies
/// between the agent's lease running out and its ranks being gone: its
/// reconcile pass (every 200 ms), the kill itself, a host too busy to run
/// the agent at once, and the rate difference of two monotonic clocks. A
/// quarter of the TTL on top of 2 s: 2.5 s at a 2 s TTL, 9.5 s at 30 s.
pub fn loss_margin_ms(node_ttl_ms: u64) -> u64 {
    2_000 + node_ttl_ms / 4
}

/// The longest grace period of the jobs with a rank on `node`, in ms.
fn longest_grace_ms(state: &ClusterState, node: &str) -> u64 {
    state
        .allocs
        .values()
        .filter(|alloc| alloc.ranks.iter().any(|rank| rank.node == node))
        .filter_map(|alloc| state.jobs.get(&alloc.job_id))
        .map(|job| job.spec.grace_period_s.saturating_mul(1000))
        .max()
        .unwrap_or(0)
}

#[derive(Debug)]
pub struct HeartbeatTable {
    term: u64,
    node_ttl_ms: u64,
    /// Node name -> monotonic ms of the last heartbeat (or of first sight).
    last_seen_ms: HashMap<String, u64>,
}

impl HeartbeatTable {
    pub fn new(term: u64, node_ttl_ms: u64) -> HeartbeatTable {
        HeartbeatTable { term, node_ttl_ms, last_seen_ms: HashMap::new() }
    }

    pub fn term(&self) -> u64 {
        self.term
    }

    pub fn len(&self) -> usize {
        self.last_seen_ms.len()
    }

    /// A sign of life from `node` at `now_ms`. Times only move forward: a
    /// late-arriving older sample never makes a node look staler.
    pub fn record(&mut self, node: &str, now_ms: u64) {
        match self.last_seen_ms.get_mut(node) {
            Some(seen_ms) => *seen_ms = (*seen_ms).max(now_ms),
            None => {
                self.last_seen_ms.insert(node.to_string(), now_ms);
            }
        }
    }

    /// Nodes of `state` that are not down and were silent past the TTL at
    /// `now_ms`, in name order.
    pub fn silent_nodes(&mut self, state: &ClusterState, now_ms: u64) -> Vec<String> {
        self.last_seen_ms.retain(|name, _| state.nodes.get(name).is_some_and(|n| n.state != NodeState::Down));
        let mut silent = Vec::new();
        for node in state.nodes.values().filter(|n| n.state != NodeState::Down) {
            let seen_ms = *self.last_seen_ms.entry(node.name.clone()).or_insert(now_ms);
            let quiet_ms = now_ms.saturating_sub(seen_ms);
            // Cheap test first; the grace is looked up only for nodes past their TTL.
            let limit_ms = self.node_ttl_ms + loss_margin_ms(self.node_ttl_ms);
            if quiet_ms > limit_ms && quiet_ms > limit_ms + longest_grace_ms(state, &node.name) {
                silent.push(node.name.clone());
            }
        }
        silent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::{Command, GpuInfo, NodeRegistration, Proposal};

    const TTL_MS: u64 = 1_000;
    /// `loss_margin_ms(TTL_MS)`.
    const MARGIN_MS: u64 = 2_250;

    fn state_with(nodes: &[&str]) -> ClusterState {
        let mut state = ClusterState::default();
        let commands = nodes
            .iter()
            .map(|name| {
                Command::RegisterNode(NodeRegistration {
                    name: name.to_string(),
                    address: format!("{name}:1"),
                    rack: String::new(),
                    leaf: String::new(),
                    gpus: vec![GpuInfo {
                        index: 0,
                        uuid: format!("{name}-0"),
                        model: "H100".into(),
                        memory_mib: 81_920,
                        healthy: true,
                        nvlink_domain: None,
                    }],
                })
            })
            .collect();
        state.apply_proposal(1, &Proposal { now_ms: 1, commands });
        state
    }

    fn mark_down(state: &mut ClusterState, node: &str) {
        let index = state.applied_index + 1;
        state.apply_proposal(index, &Proposal { now_ms: 2, commands: vec![Command::NodeDown { node: node.into() }] });
    }

    #[test]
    fn first_sight_in_a_term_starts_the_grace_period() {
        assert_eq!(loss_margin_ms(TTL_MS), MARGIN_MS);
        let state = state_with(&["a", "b"]);
        let mut table = HeartbeatTable::new(3, TTL_MS);
        assert!(table.silent_nodes(&state, 50_000).is_empty(), "a new term never finds a node silent at once");
        assert!(table.silent_nodes(&state, 50_000 + TTL_MS + MARGIN_MS).is_empty(), "exactly TTL + margin is not past it");
        assert_eq!(table.silent_nodes(&state, 50_001 + TTL_MS + MARGIN_MS), ["a", "b"]);
    }

    #[test]
    fn a_heartbeat_keeps_its_node_alive() {
        let state = state_with(&["a", "b"]);
        let mut table = HeartbeatTable::new(1, TTL_MS);
        table.silent_nodes(&state, 0);
        table.record("a", 900);
        assert_eq!(table.silent_nodes(&state, 3_500), ["b"]);
        assert!(table.silent_nodes(&state, 4_150).contains(&"b".to_string()));
        assert_eq!(table.silent_nodes(&state, 4_151), ["a", "b"]);
    }

    #[test]
    fn an_older_sample_never_moves_last_seen_back() {
        let state = state_with(&["a"]);
        let mut table = HeartbeatTable::new(1, TTL_MS);
        table.record("a", 5_000);
        table.record("a", 100);
        assert!(table.silent_nodes(&state, 8_000).is_empty());
    }

    #[test]
    fn a_down_node_is_forgotten_and_gets_a_fresh_grace_period() {
        let mut state = state_with(&["a"]);
        let mut table = HeartbeatTable::new(1, TTL_MS);
        table.record("a", 0);
        mark_down(&mut state, "a");
        assert!(table.silent_nodes(&state, 10_000).is_empty(), "down nodes are not reported again");
        assert_eq!(table.len(), 0, "and are dropped from the table");
        // It registers again: first sight at 20 s, silent only after 21 s.
        let index = state.applied_index + 1;
        let again = state_with(&["a"]).nodes["a"].clone();
        state.nodes.insert("a".into(), again);
        state.applied_index = index;
        assert!(table.silent_nodes(&state, 20_000).is_empty());
        assert!(table.silent_nodes(&state, 23_250).is_empty());
        assert_eq!(table.silent_nodes(&state, 23_251), ["a"]);
    }

    #[test]
    fn a_node_running_a_job_gets_its_grace_period_on_top_of_the_ttl() {
        let mut state = state_with(&["a"]);
        let mut spec = rota_core::state::JobSpec::simple(&["train"]);
        spec.grace_period_s = 30;
        let plan = rota_core::state::Plan {
            placements: vec![rota_core::state::Placement {
                job_id: 1,
                ranks: vec![rota_core::state::RankPlacement { node: "a".into(), gpus: vec![0] }],
            }],
            ..Default::default()
        };
        let commands = vec![Command::SubmitJob { request_id: None, spec }, Command::ApplyPlan(plan)];
        state.apply_proposal(2, &Proposal { now_ms: 3, commands });
        assert_eq!(state.allocs.len(), 1);
        let mut table = HeartbeatTable::new(1, TTL_MS);
        table.record("a", 0);
        let due_ms = TTL_MS + 30_000 + MARGIN_MS;
        assert!(table.silent_nodes(&state, due_ms).is_empty(), "its ranks may still be in their grace period");
        assert_eq!(table.silent_nodes(&state, due_ms + 1), ["a"]);
    }

    #[test]
    fn heartbeats_from_unknown_nodes_are_kept_until_the_state_shows_them() {
        let state = state_with(&["a"]);
        let mut table = HeartbeatTable::new(1, TTL_MS);
        table.record("ghost", 0);
        assert_eq!(table.len(), 1);
        table.silent_nodes(&state, 0);
        assert_eq!(table.len(), 1, "only a, the ghost is dropped");
        assert_eq!(table.term(), 1);
    }
}
