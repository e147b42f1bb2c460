//! Request outcomes (format 10 on): what a person's change produced, kept
//! by the request id its client sent, so that the change happens once
//! however often it is sent.
//!
//! A client retries a change whose answer it did not get (the leader died
//! after committing it) and hedges a slow call to a second replica; both
//! send the same command twice under one request id. Submits have their own
//! table (`dedupe`); every other change a person makes arrives wrapped in
//! `Command::Once`, and apply keeps its outcome under (sender, request id)
//! with a digest of the command. The same command again under that key
//! gets the first outcome back and changes nothing (no second audit record,
//! no second event); another command under the same key is applied and
//! takes the key over, so a client that reuses an id for a new change is
//! never refused. Outcomes of refused commands are not kept: a refusal
//! changed nothing, and a retry may find the state changed.
//!
//! The table is bounded (`MAX_OUTCOMES`, oldest dropped first, the drop
//! counted); eviction follows the log, so every replica keeps the same.

use super::shared::{SharedList, SharedMap};
use serde::{Deserialize, Serialize};

use super::command::{Command, CommandResult};
use super::ClusterState;

pub use super::command::OUTCOMES_FROM_VERSION;
/// Outcomes kept at most; a retry comes within seconds or minutes, and
/// people change the configuration far more slowly than that.
pub const MAX_OUTCOMES: usize = 10_000;
/// A request id longer than this is applied without keeping its outcome
/// (clients send at most 64 bytes; the bound keeps the table's bytes bounded
/// whatever the log holds).
pub const MAX_KEY_ID_BYTES: usize = 64;
/// A sender's description at most, bytes (two user names and " as ").
pub const MAX_KEY_SENDER_BYTES: usize = 300;

/// Who sent a change and the request id it came with.
pub type OutcomeKey = (String, String);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// `digest` of the command the outcome is of.
    pub digest: u64,
    /// The log index that applied it.
    pub index: u64,
    pub result: CommandResult,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct OutcomeState {
    by_key: SharedMap<OutcomeKey, Outcome>,
    /// Keys in the order they were kept; the front is dropped first. A key
    /// taken over by another command moves to the back.
    order: SharedList<OutcomeKey>,
    /// Outcomes dropped to keep the table bounded.
    pub dropped: u64,
}

impl OutcomeState {
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn get(&self, key: &OutcomeKey) -> Option<&Outcome> {
        self.by_key.get(key)
    }

    fn keep(&mut self, key: OutcomeKey, outcome: Outcome) {
        if self.by_key.insert(key.clone(), outcome).is_some() {
            let at = self.order.index_of(&key).expect("a kept key is in the order");
            self.order.remove(at);
        }
        self.order.push_back(key);
        while self.order.len() > MAX_OUTCOMES {
            let oldest = self.order.pop_front().expect("order is non-empty past the bound");
            let removed = self.by_key.remove(&oldest);
            debug_assert!(removed.is_some(), "order and table disagree");
            self.dropped += 1;
        }
        debug_assert_eq!(self.order.len(), self.by_key.len());
    }

    /// Are the table and its order the same keys?
    pub fn check(&self) -> Result<(), String> {
        if self.order.len() != self.by_key.len() || self.order.iter().any(|key| !self.by_key.contains_key(key)) {
            return Err(format!("request outcomes: {} keys in order, {} kept", self.order.len(), self.by_key.len()));
        }
        if self.by_key.len() > MAX_OUTCOMES {
            return Err(format!("request outcomes: {} kept, bound {MAX_OUTCOMES}", self.by_key.len()));
        }
        Ok(())
    }
}

/// The key a `Once` command's outcome is kept under: the sender named by
/// the audited command inside (or `unchecked`), and the request id. `None`
/// when either is too long to keep.
pub fn key_of(request_id: &str, command: &Command) -> Option<OutcomeKey> {
    let sender = sender(command);
    (request_id.len() <= MAX_KEY_ID_BYTES && sender.len() <= MAX_KEY_SENDER_BYTES).then(|| (sender, request_id.to_string()))
}

fn sender(command: &Command) -> String {
    match command {
        Command::Audited { actor, .. } => actor.describe(),
        Command::Traced { command, .. } | Command::Once { command, .. } => sender(command),
        _ => "unchecked".into(),
    }
}

/// A digest of what a command asks for, without the wrappers (the address
/// a retry comes from may differ). FNV-1a over its encoding: the same on
/// every replica and every build, unlike the standard library's hasher.
pub fn digest(command: &Command) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;
    let bytes = bincode::serialize(command.unwrapped()).expect("replicated types always encode");
    bytes.iter().fold(OFFSET, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(PRIME))
}

impl ClusterState {
    /// Would applying `command` now repeat a kept outcome (and change
    /// nothing)? Asked before apply, so that a repeat makes no events.
    pub fn repeats_an_outcome(&self, command: &Command) -> bool {
        let Command::Once { request_id, command } = command else { return false };
        key_of(request_id, command).and_then(|key| self.outcomes.get(&key)).is_some_and(|kept| kept.digest == digest(command))
    }

    /// Apply a change sent under a request id: its first outcome if the
    /// same sender sent the same command under that id before, else apply
    /// it and keep what it produced.
    pub(super) fn apply_once(&mut self, index: u64, request_id: &str, command: &Command) -> CommandResult {
        let key = match key_of(request_id, command) {
            Some(key) if command.settles_by_request_id() && self.cluster_version() >= OUTCOMES_FROM_VERSION => key,
            _ => return self.apply(index, command),
        };
        let digest = digest(command);
        if let Some(kept) = self.outcomes.get(&key).filter(|kept| kept.digest == digest) {
            return kept.result.clone();
        }
        let result = self.apply(index, command);
        if !matches!(result, CommandResult::Rejected(_)) {
            self.outcomes.keep(key, Outcome { digest, index, result: result.clone() });
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::auth::{Actor, Role};
    use crate::state::command::Proposal;
    use crate::state::types::QueueConfig;

    fn admin(state: &mut ClusterState) -> Actor {
        state.cluster_version = OUTCOMES_FROM_VERSION;
        let bootstrap = Command::BootstrapAdmin { name: "ada".into() };
        let index = state.applied_index + 1;
        state.apply_proposal(index, &Proposal { now_ms: 1_000, commands: vec![bootstrap] });
        Actor::user("ada", "127.0.0.1:1")
    }

    fn once(id: &str, actor: &Actor, command: Command) -> Command {
        Command::Once { request_id: id.into(), command: Box::new(Command::Audited { actor: actor.clone(), command: Box::new(command) }) }
    }

    fn apply(state: &mut ClusterState, command: Command) -> CommandResult {
        let index = state.applied_index + 1;
        state.apply_proposal(index, &Proposal { now_ms: 2_000 + index, commands: vec![command] }).remove(0)
    }

    fn queue(name: &str, weight: u32) -> QueueConfig {
        QueueConfig { name: name.into(), weight, ..QueueConfig::defaults()[0].clone() }
    }

    /// A change sent twice under one id is applied once: one audit record,
    /// the first outcome returned again. Without the table, the second
    /// copy was applied and audited as a change of its own.
    #[test]
    fn a_change_sent_twice_under_one_request_id_is_applied_once() {
        let mut state = ClusterState::default();
        let ada = admin(&mut state);
        let audited = state.auth.audit.len();
        let first = apply(&mut state, once("r1", &ada, Command::SetQueue(queue("q1", 3))));
        let again = apply(&mut state, once("r1", &ada, Command::SetQueue(queue("q1", 3))));
        assert_eq!(first, CommandResult::Done);
        assert_eq!(again, first);
        assert_eq!(state.auth.audit.len(), audited + 1, "one audit record");
        assert_eq!(state.outcomes.len(), 1);
        state.check_invariants().expect("consistent");
    }

    /// A second token under one id would be a token nobody holds; a
    /// repeated approval would be refused although the first one worked.
    #[test]
    fn a_repeat_returns_the_first_outcome_even_where_a_second_apply_would_fail() {
        let mut state = ClusterState::default();
        let ada = admin(&mut state);
        let token = Command::CreateToken { id: "t1".into(), user: "ada".into(), hash: vec![7; 32], expires_ms: u64::MAX };
        assert_eq!(apply(&mut state, once("r2", &ada, token.clone())), CommandResult::Done);
        assert_eq!(apply(&mut state, once("r2", &ada, token.clone())), CommandResult::Done, "not 'token t1 exists'");
        assert_eq!(state.auth.tokens.len(), 1);
        let plain = apply(&mut state, Command::Audited { actor: ada.clone(), command: Box::new(token) });
        assert!(matches!(plain, CommandResult::Rejected(_)), "without an id the copy is applied (and refused): {plain:?}");
    }

    /// The key is the sender and the id: another user's change under the
    /// same id, or another change of the same user, is applied.
    #[test]
    fn another_sender_or_another_command_under_the_id_is_applied() {
        let mut state = ClusterState::default();
        let ada = admin(&mut state);
        let set = Command::SetUser { name: "bob".into(), role: Role::Admin, groups: Default::default(), impersonate: false };
        apply(&mut state, once("r3", &ada, set));
        let bob = Actor::user("bob", "127.0.0.1:2");
        let audited = state.auth.audit.len();
        apply(&mut state, once("r3", &bob, Command::SetQueue(queue("q1", 3))));
        apply(&mut state, once("r3", &ada, Command::SetQueue(queue("q1", 3))));
        apply(&mut state, once("r3", &ada, Command::SetQueue(queue("q1", 5))));
        assert_eq!(state.auth.audit.len(), audited + 3, "three different (sender, command) pairs");
        assert_eq!(state.queues["q1"].weight, 5);
        apply(&mut state, once("r3", &ada, Command::SetQueue(queue("q1", 3))));
        assert_eq!(state.queues["q1"].weight, 3, "an id taken over by another command no longer holds the first");
    }

    #[test]
    fn refused_changes_are_not_kept_and_a_retry_is_applied_again() {
        let mut state = ClusterState::default();
        let ada = admin(&mut state);
        let refused = apply(&mut state, once("r4", &ada, Command::SetQueue(queue("", 3))));
        assert!(matches!(refused, CommandResult::Rejected(_)), "{refused:?}");
        assert!(state.outcomes.is_empty());
    }

    #[test]
    fn before_format_10_a_once_command_is_applied_every_time() {
        let mut state = ClusterState::default();
        let ada = admin(&mut state);
        state.cluster_version = OUTCOMES_FROM_VERSION - 1;
        let audited = state.auth.audit.len();
        apply(&mut state, once("r5", &ada, Command::SetQueue(queue("q1", 3))));
        apply(&mut state, once("r5", &ada, Command::SetQueue(queue("q1", 3))));
        assert_eq!(state.auth.audit.len(), audited + 2);
        assert!(state.outcomes.is_empty());
    }

    #[test]
    fn the_table_drops_its_oldest_outcomes_past_the_bound_and_counts_them() {
        let mut table = OutcomeState::default();
        let outcome = Outcome { digest: 1, index: 1, result: CommandResult::Done };
        for i in 0..MAX_OUTCOMES + 3 {
            table.keep(("u".into(), format!("r{i}")), outcome.clone());
        }
        assert_eq!((table.len(), table.dropped), (MAX_OUTCOMES, 3));
        assert!(table.get(&("u".into(), "r0".into())).is_none());
        assert!(table.get(&("u".into(), format!("r{}", MAX_OUTCOMES + 2))).is_some());
        table.keep(("u".into(), "r5".into()), Outcome { digest: 2, ..outcome });
        assert_eq!(table.len(), MAX_OUTCOMES, "a key taken over is kept once");
        table.check().expect("consistent");
    }

    #[test]
    fn an_overlong_id_is_applied_without_keeping_its_outcome() {
        let mut state = ClusterState::default();
        let ada = admin(&mut state);
        let id = "r".repeat(MAX_KEY_ID_BYTES + 1);
        apply(&mut state, once(&id, &ada, Command::SetQueue(queue("q1", 3))));
        assert!(state.outcomes.is_empty());
    }

    #[test]
    fn the_digest_is_fixed_and_ignores_the_wrappers() {
        let ada = Actor::user("ada", "127.0.0.1:1");
        let moved = Actor::user("ada", "127.0.0.1:9");
        let a = once("x", &ada, Command::CancelJob { job_id: 7 });
        let b = once("y", &moved, Command::CancelJob { job_id: 7 });
        assert_eq!(digest(&a), digest(&b));
        assert_ne!(digest(&a), digest(&Command::CancelJob { job_id: 8 }));
        // Pinned: a build whose digest differed would not see its peers' repeats.
        assert_eq!(digest(&Command::CancelJob { job_id: 7 }), digest_of_cancel_7());
    }

    fn digest_of_cancel_7() -> u64 {
        // bincode: variant index 1 (u32 LE), then the job id (u64 LE).
        let bytes = [1u8, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0];
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
    }
}
