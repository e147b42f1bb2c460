//! Two-person changes (format 8 on, a trailing snapshot section of its
//! own).
//!
//! An operator can make a kind of change (quotas, budgets, cross-group
//! template grants, queue policy) need a second person's approval. From
//! then on every such command a person sends is kept as a pending change
//! instead of being applied; another person who may make the change
//! approves it (`ApproveChange`) and only then is it applied. A pending
//! change expires after the kind's time, and is refused if what it
//! changes was changed since it was asked for (approving it would undo the
//! newer change without the approver seeing it).
//!
//! "Another person" is decided after impersonation is resolved: no name of
//! the request's actor (the user, or whoever acted for it) may be a name of
//! the approval's actor, so one service account cannot approve its own
//! change by acting for two different users.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::auth::Actor;
use super::command::Command;
/// Defined with the other plain types so that `command` need not import
/// this module (which holds commands).
pub use super::types::ChangeKind;

pub use super::command::APPROVALS_FROM_VERSION;

/// Pending changes kept at most; expired ones are dropped first.
pub const MAX_PENDING_CHANGES: usize = 256;
/// How long a pending change waits for approval unless the rule says.
pub const DEFAULT_EXPIRE_AFTER_MS: u64 = 24 * 3_600_000;
/// The longest a rule may let a change wait.
pub const MAX_EXPIRE_AFTER_MS: u64 = 30 * 24 * 3_600_000;
/// The shortest (tests use milliseconds; anything shorter cannot be
/// approved by a person).
pub const MIN_EXPIRE_AFTER_MS: u64 = 1_000;

/// A kind of change that needs approval, and for how long a request waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalRule {
    pub expire_after_ms: u64,
    /// Committed time the rule was set (Unix ms).
    pub set_ms: u64,
}

/// A change someone asked for that waits for a second person.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingChange {
    pub id: u64,
    pub kind: ChangeKind,
    /// Who asked, as apply saw it (user and impersonator).
    pub requested_by: Actor,
    /// The command to apply once approved (never `Audited`/`Traced`).
    pub command: Command,
    /// What the change touches, for people: `quota of group vision`.
    pub target: String,
    /// The encoding of the target's value when the change was asked for;
    /// approval is refused once it differs.
    pub before: Vec<u8>,
    pub requested_ms: u64,
    pub expires_ms: u64,
}

impl PendingChange {
    pub fn expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_ms
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ApprovalState {
    pub rules: BTreeMap<ChangeKind, ApprovalRule>,
    pub pending: BTreeMap<u64, PendingChange>,
    /// The id the next pending change gets (ids are never reused).
    pub next_change_id: u64,
}

impl ApprovalState {
    /// Drop the changes whose time ran out.
    pub fn drop_expired(&mut self, now_ms: u64) {
        self.pending.retain(|_, change| !change.expired(now_ms));
    }

    /// Pending changes not yet expired, oldest first.
    pub fn live(&self, now_ms: u64) -> impl Iterator<Item = &PendingChange> {
        self.pending.values().filter(move |c| !c.expired(now_ms))
    }
}

/// Every name an actor stands for: its user and whoever acted for it.
fn names(actor: &Actor) -> impl Iterator<Item = &str> {
    actor.user.as_deref().into_iter().chain(actor.impersonator.as_deref())
}

/// Do two actors share a person? (`alice` and `portal as alice` do; so do
/// `portal as alice` and `portal as bob`.)
pub fn same_person(a: &Actor, b: &Actor) -> bool {
    names(a).any(|name| names(b).any(|other| other == name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(user: &str, impersonator: Option<&str>) -> Actor {
        Actor { user: Some(user.into()), impersonator: impersonator.map(Into::into), from: "127.0.0.1".into() }
    }

    #[test]
    fn people_are_compared_after_impersonation_is_resolved() {
        assert!(same_person(&actor("alice", None), &actor("alice", None)));
        assert!(!same_person(&actor("alice", None), &actor("bob", None)));
        assert!(same_person(&actor("alice", None), &actor("bob", Some("alice"))), "alice acting as bob is alice");
        assert!(same_person(&actor("bob", Some("portal")), &actor("carol", Some("portal"))), "one portal for two users");
        assert!(same_person(&actor("alice", Some("portal")), &actor("alice", None)));
        assert!(!same_person(&actor("alice", Some("portal")), &actor("bob", None)));
    }

    #[test]
    fn kinds_read_back_from_their_names() {
        for kind in ChangeKind::ALL {
            assert_eq!(ChangeKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(ChangeKind::parse("quotas"), None);
    }

    #[test]
    fn expired_changes_are_dropped_and_not_listed() {
        let change = |id, expires_ms| PendingChange {
            id,
            kind: ChangeKind::Quota,
            requested_by: actor("alice", None),
            command: Command::CancelJob { job_id: 1 },
            target: "x".into(),
            before: vec![],
            requested_ms: 0,
            expires_ms,
        };
        let mut state = ApprovalState::default();
        state.pending.insert(1, change(1, 10));
        state.pending.insert(2, change(2, 20));
        assert_eq!(state.live(10).map(|c| c.id).collect::<Vec<_>>(), vec![2]);
        state.drop_expired(10);
        assert_eq!(state.pending.keys().copied().collect::<Vec<_>>(), vec![2]);
    }
}
