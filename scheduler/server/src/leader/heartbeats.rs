//! The leader's heartbeat table: when each node was last heard from in this
//! term. Pure: time is the caller's monotonic `now_ms`, so the rules are
//! tested without clocks or sleeps.
//!
//! Rules:
//! - a term starts with an empty table; a node first considered in this term
//!   starts its grace period then, so a failover alone never marks a node
//!   down. A node with a committed heard record (`NodesHeard`, written by
//!   every leader every `heard_record_every_ms`) has been quiet since that
//!   record plus two periods, not since this term began: if leaders change
//!   more often than the TTL, a dead node is still declared down;
//! - a node is silent when not heard from for more than the TTL plus the
//!   longest grace period of the jobs running there plus a margin
//!   (`loss_margin_ms`):
//!   its agent, cut off since its last heartbeat, stops those ranks once
//!   its own lease (the same TTL, counted from that heartbeat) runs out, and
//!   they are gone after their grace; only then may the jobs run elsewhere;
//! - down nodes are forgotten, so one that comes back gets a fresh grace period.

use std::collections::{BTreeSet, HashMap};

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

/// How often a leader records which nodes it heard: twice per TTL, so a
/// live node's record is never older than half a TTL (plus a commit) when
/// leadership changes.
pub fn heard_record_every_ms(node_ttl_ms: u64) -> u64 {
    (node_ttl_ms / 2).max(100)
}

/// Shortest gap between a term's records while it has nodes to record for
/// the first time in the term. A leader that waited a whole period before
/// its first record would, if leaders change faster than that, leave the
/// last record to age until a new leader finds live nodes quiet past the
/// TTL at first sight and declares them down.
pub fn first_record_gap_ms(node_ttl_ms: u64) -> u64 {
    (heard_record_every_ms(node_ttl_ms) / 8).max(50)
}

/// How long a node has surely been quiet when a new leader first considers
/// it. Its last heard record says it was heard before that record; it may
/// also have been heard (and its lease renewed) after it, until the next
/// record that never committed: up to a record period later, and as long
/// again for the record's commit and a cut-off leader still answering
/// heartbeats. So the silence counts from the record plus two periods (one
/// TTL), never from the record alone: a new leader must never requeue work
/// before the node's agent has let its lease run out. No record: not quiet
/// (the grace of a whole TTL from now). `committed_ms` is the committed time
/// of the state read.
pub fn quiet_at_first_sight_ms(node_ttl_ms: u64, heard_ms: Option<u64>, committed_ms: u64) -> u64 {
    heard_ms.map_or(0, |heard_ms| committed_ms.saturating_sub(heard_ms + 2 * heard_record_every_ms(node_ttl_ms)))
}

#[derive(Debug)]
pub struct HeartbeatTable {
    term: u64,
    node_ttl_ms: u64,
    /// Node name -> monotonic ms of the last heartbeat (or, at first sight,
    /// the time that leaves the node its grace). Signed: a grace shorter
    /// than a TTL puts it before this replica's monotonic epoch.
    last_seen_ms: HashMap<String, i64>,
    /// Nodes heard since the leader last recorded them in the log.
    heard_since_record: BTreeSet<String>,
    /// Nodes recorded in this term (bounded, as the above, by the nodes
    /// that send heartbeats).
    recorded_this_term: BTreeSet<String>,
    /// A node not yet recorded in this term was heard since the last record.
    news: bool,
}

impl HeartbeatTable {
    pub fn new(term: u64, node_ttl_ms: u64) -> HeartbeatTable {
        HeartbeatTable {
            term,
            node_ttl_ms,
            last_seen_ms: HashMap::new(),
            heard_since_record: BTreeSet::new(),
            recorded_this_term: BTreeSet::new(),
            news: false,
        }
    }

    /// The nodes heard since the previous call, for the next `NodesHeard`.
    pub fn take_heard(&mut self) -> Vec<String> {
        let heard: Vec<String> = std::mem::take(&mut self.heard_since_record).into_iter().collect();
        self.recorded_this_term.extend(heard.iter().cloned());
        self.news = false;
        heard
    }

    /// Whether the leader records the nodes it heard now, `since_record_ms`
    /// after its previous record (or the start of its term): once a period,
    /// and sooner (`first_record_gap_ms`) while a node heard in this term
    /// has not been recorded in it yet.
    pub fn record_due(&self, since_record_ms: u64) -> bool {
        if since_record_ms >= heard_record_every_ms(self.node_ttl_ms) {
            return true;
        }
        self.news && since_record_ms >= first_record_gap_ms(self.node_ttl_ms)
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
        let now_ms = now_ms as i64;
        match self.last_seen_ms.get_mut(node) {
            Some(seen_ms) => *seen_ms = (*seen_ms).max(now_ms),
            None => {
                self.last_seen_ms.insert(node.to_string(), now_ms);
            }
        }
        // Bounded by the nodes that send heartbeats; drained every record period.
        if !self.heard_since_record.contains(node) {
            self.news |= !self.recorded_this_term.contains(node);
            self.heard_since_record.insert(node.to_string());
        }
    }

    /// Nodes of `state` that are not down and were silent past the TTL at
    /// `now_ms`, in name order.
    pub fn silent_nodes(&mut self, state: &ClusterState, now_ms: u64) -> Vec<String> {
        self.last_seen_ms.retain(|name, _| state.nodes.get(name).is_some_and(|n| n.state != NodeState::Down));
        let mut silent = Vec::new();
        for node in state.nodes.values().filter(|n| n.state != NodeState::Down) {
            let seen_ms = *self.last_seen_ms.entry(node.name.clone()).or_insert_with(|| {
                let heard_ms = state.node_heard_ms.get(&node.name).copied();
                now_ms as i64 - quiet_at_first_sight_ms(self.node_ttl_ms, heard_ms, state.now_ms) as i64
            });
            let quiet_ms = (now_ms as i64).saturating_sub(seen_ms).max(0) as u64;
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
    fn a_new_leader_counts_silence_from_the_last_heard_record() {
        let mut state = state_with(&["fresh", "stale", "never"]);
        // Records committed at 10 s ("fresh") and 6 s ("stale"); now 10.2 s.
        state.node_heard_ms.insert("fresh".into(), 10_000);
        state.node_heard_ms.insert("stale".into(), 6_000);
        state.now_ms = 10_200;
        // Heard up to two record periods (one TTL) after the record, perhaps.
        assert_eq!(quiet_at_first_sight_ms(TTL_MS, Some(6_000), state.now_ms), 3_200);
        assert_eq!(quiet_at_first_sight_ms(TTL_MS, Some(10_000), state.now_ms), 0, "a recent record: a whole TTL");
        assert_eq!(quiet_at_first_sight_ms(TTL_MS, None, state.now_ms), 0, "no record: a whole TTL from now");
        let mut table = HeartbeatTable::new(9, TTL_MS);
        let start_ms = 5;
        assert!(table.silent_nodes(&state, start_ms).is_empty(), "3.2 s is not past TTL + margin (3.25 s)");
        assert_eq!(table.silent_nodes(&state, start_ms + 51), ["stale"]);
        assert_eq!(table.silent_nodes(&state, start_ms + 3_250), ["stale"]);
        assert_eq!(table.silent_nodes(&state, start_ms + 3_251), ["fresh", "never", "stale"]);
    }

    #[test]
    fn leaders_changing_faster_than_the_ttl_still_find_a_dead_node() {
        let mut state = state_with(&["dead"]);
        state.node_heard_ms.insert("dead".into(), 0);
        // A new leader every half TTL, each with a table of its own; the
        // committed time moves on with real time.
        let mut declared_at_ms = None;
        for term in 1..100u64 {
            let term_start_ms = term * TTL_MS / 2;
            state.now_ms = term_start_ms;
            let mut table = HeartbeatTable::new(term, TTL_MS);
            for step_ms in [0, TTL_MS / 4] {
                if !table.silent_nodes(&state, 1_000_000 + step_ms).is_empty() {
                    declared_at_ms = declared_at_ms.or(Some(term_start_ms + step_ms));
                }
            }
        }
        let declared_at_ms = declared_at_ms.expect("the dead node is declared down");
        // Due once two record periods, the TTL and the margin have passed
        // since the record, seen by the first leader to look after that
        // (each looks every quarter TTL, for half a TTL).
        let due_ms = 2 * heard_record_every_ms(TTL_MS) + TTL_MS + MARGIN_MS;
        assert!(declared_at_ms > due_ms && declared_at_ms <= due_ms + TTL_MS / 2, "declared at {declared_at_ms} ms, due after {due_ms}");
    }

    #[test]
    fn a_node_first_heard_in_a_term_is_recorded_soon_then_once_a_period() {
        let gap_ms = first_record_gap_ms(TTL_MS);
        let period_ms = heard_record_every_ms(TTL_MS);
        assert!(gap_ms < period_ms);
        let mut table = HeartbeatTable::new(1, TTL_MS);
        assert!(!table.record_due(gap_ms), "nothing heard: nothing to record early");
        table.record("a", 10);
        assert!(!table.record_due(gap_ms - 1));
        assert!(table.record_due(gap_ms), "a node heard for the first time this term");
        assert_eq!(table.take_heard(), ["a"]);
        table.record("a", 20);
        assert!(!table.record_due(gap_ms), "already recorded this term: the period applies");
        assert!(table.record_due(period_ms));
        table.record("b", 30);
        assert!(table.record_due(gap_ms), "b is news");
    }

    /// Leaders that each lead for less than a record period, with live
    /// nodes heartbeating every quarter TTL: every new leader must find them
    /// alive. Recording only once a period, no leader ever recorded, the
    /// last record aged, and a new leader declared the live nodes down at
    /// first sight.
    #[test]
    fn live_nodes_stay_up_when_leaders_change_faster_than_the_record_period() {
        let mut state = state_with(&["a", "b"]);
        state.node_heard_ms.insert("a".into(), 1);
        state.node_heard_ms.insert("b".into(), 1);
        let term_ms = heard_record_every_ms(TTL_MS) * 2 / 3;
        let tick_ms = 25;
        let beat_every_ms = TTL_MS / 4;
        let mut now_ms = 0u64;
        for term in 1..200u64 {
            let mut table = HeartbeatTable::new(term, TTL_MS);
            let mut recorded_at_ms = now_ms;
            let term_end_ms = now_ms + term_ms;
            while now_ms < term_end_ms {
                if now_ms.is_multiple_of(beat_every_ms) {
                    table.record("a", now_ms);
                    table.record("b", now_ms);
                }
                state.now_ms = now_ms;
                assert!(table.silent_nodes(&state, now_ms).is_empty(), "live nodes found silent in term {term} at {now_ms} ms");
                if table.record_due(now_ms - recorded_at_ms) {
                    recorded_at_ms = now_ms;
                    let nodes = table.take_heard();
                    if !nodes.is_empty() {
                        let index = state.applied_index + 1;
                        state.apply_proposal(index, &Proposal { now_ms, commands: vec![Command::NodesHeard { nodes }] });
                    }
                }
                now_ms += tick_ms;
            }
        }
        assert!(state.node_heard_ms["a"] > 1, "the records moved on");
    }

    #[test]
    fn heard_nodes_are_taken_once_for_the_record() {
        let mut table = HeartbeatTable::new(1, TTL_MS);
        table.record("b", 1);
        table.record("a", 2);
        table.record("b", 3);
        assert_eq!(table.take_heard(), ["a", "b"]);
        assert!(table.take_heard().is_empty());
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
