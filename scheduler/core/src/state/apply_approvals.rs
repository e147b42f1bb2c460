//! Apply of two-person changes (format 8 on; see `approvals`). Like every
//! apply function, each either changes the state and says so, or returns
//! a `Rejection` having changed nothing.

use super::approvals::{
    same_person, ApprovalRule, ChangeKind, PendingChange, APPROVALS_FROM_VERSION, MAX_EXPIRE_AFTER_MS, MAX_PENDING_CHANGES,
    MIN_EXPIRE_AFTER_MS,
};
use super::auth::Actor;
use super::command::{Command, CommandResult, Rejection};
use super::tenancy::month_text;
use super::validate::{validate_queue, validate_quota};
use super::ClusterState;

fn encoded<T: serde::Serialize>(value: &T) -> Vec<u8> {
    bincode::serialize(value).expect("replicated values encode")
}

impl ClusterState {
    /// The kind of approval `command` needs on this cluster now, if any.
    pub(super) fn approval_needed(&self, command: &Command) -> Option<ChangeKind> {
        if self.approvals.rules.is_empty() {
            return None;
        }
        let kind = match command {
            Command::SetQuota(_) => ChangeKind::Quota,
            Command::SetBudget { .. } => ChangeKind::Budget,
            Command::SetQueue(_)
            | Command::SetQueueIdle { .. }
            | Command::ApplyPolicy { .. }
            | Command::PromotePolicy
            | Command::RollbackPolicy { .. } => ChangeKind::Policy,
            Command::GrantTemplate { name, group, granted: true } => match self.tenancy.templates.get(name) {
                Some(template) if template.group != *group => ChangeKind::Grant,
                _ => return None,
            },
            // Loosening a rule is a change of the kind it guards.
            Command::RequireApproval { kind, required: false, .. } => *kind,
            _ => return None,
        };
        self.approvals.rules.contains_key(&kind).then_some(kind)
    }

    /// What a guarded command changes, for people, and the encoding of its
    /// current value.
    fn change_target(&self, command: &Command) -> (String, Vec<u8>) {
        match command {
            Command::SetQuota(quota) => (format!("quota of group {}", quota.group), encoded(&self.quotas.get(&quota.group))),
            Command::SetBudget { group, month, .. } => (
                format!("budget of group {group} for {}", month_text(*month)),
                encoded(&self.tenancy.budgets.get(&(group.clone(), *month))),
            ),
            Command::SetQueue(queue) | Command::SetQueueIdle { queue, .. } => {
                let now = (self.queues.get(&queue.name), self.idle.queue_policies.get(&queue.name));
                (format!("queue {}", queue.name), encoded(&now))
            }
            Command::GrantTemplate { name, group, .. } => {
                let template = self.tenancy.templates.get(name).map(|t| (&t.group, t.grants.contains(group)));
                (format!("use of template {name} by group {group}"), encoded(&template))
            }
            Command::ApplyPolicy { .. } | Command::PromotePolicy | Command::RollbackPolicy { .. } => {
                ("the policy document".into(), encoded(&(self.policy.active, &self.policy.canary, self.policy.last_version)))
            }
            Command::RequireApproval { kind, .. } => {
                (format!("the approval rule of {} changes", kind.as_str()), encoded(&self.approvals.rules.get(kind)))
            }
            other => (other.audit_summary(), Vec::new()),
        }
    }

    /// Bad input is refused when the change is asked for, not when it is
    /// approved.
    fn check_change_input(&self, command: &Command) -> Result<(), Rejection> {
        match command {
            Command::SetQuota(quota) => validate_quota(quota),
            Command::SetQueue(queue) | Command::SetQueueIdle { queue, .. } => validate_queue(queue),
            Command::ApplyPolicy { document, comment, canary } => {
                super::apply_policy::check_policy_input(document, comment, canary.as_ref())
            }
            Command::SetBudget { month, .. } if !(1..=12).contains(&(month % 100)) => {
                Err(Rejection::Invalid { field: "month".into(), message: format!("{month} is not a month as yyyymm") })
            }
            Command::GrantTemplate { group, .. } => {
                super::auth::validate_name("group", group).map_err(|(field, message)| Rejection::Invalid { field, message })
            }
            _ => Ok(()),
        }
    }

    /// Keep `command` as a pending change of `requester` instead of
    /// applying it.
    pub(super) fn request_change(&mut self, requester: &Actor, kind: ChangeKind, command: &Command) -> Result<CommandResult, Rejection> {
        if requester.user.is_none() {
            return Err(Rejection::PermissionDenied {
                message: format!("{} changes need a second person's approval, and this request names no user", kind.as_str()),
            });
        }
        self.check_change_input(command)?;
        let live = self.approvals.live(self.now_ms).count();
        if live >= MAX_PENDING_CHANGES {
            return Err(Rejection::Exhausted { what: "pending changes".into(), limit: MAX_PENDING_CHANGES as u64 });
        }
        self.approvals.drop_expired(self.now_ms);
        let rule = self.approvals.rules[&kind];
        let (target, before) = self.change_target(command);
        let id = self.approvals.next_change_id.max(1);
        self.approvals.next_change_id = id + 1;
        let expires_ms = self.now_ms.saturating_add(rule.expire_after_ms);
        let change = PendingChange {
            id,
            kind,
            requested_by: requester.clone(),
            command: command.clone(),
            target,
            before,
            requested_ms: self.now_ms,
            expires_ms,
        };
        self.approvals.pending.insert(id, change);
        debug_assert!(self.approvals.pending.len() <= MAX_PENDING_CHANGES);
        Ok(CommandResult::AwaitingApproval { change_id: id, expires_ms })
    }

    /// Apply a pending change asked for by someone else, if the approver
    /// may make it and what it changes is as it was when asked for.
    pub(super) fn approve_change(&mut self, index: u64, approver: &Actor, id: u64) -> Result<CommandResult, Rejection> {
        let change = self.approvals.pending.get(&id).ok_or_else(|| Rejection::NotFound { what: format!("pending change {id}") })?;
        if change.expired(self.now_ms) {
            return Err(Rejection::Conflict {
                message: format!("change {id} expired at {} ms unapproved; ask for it again", change.expires_ms),
            });
        }
        if approver.user.is_none() || same_person(approver, &change.requested_by) {
            return Err(Rejection::PermissionDenied {
                message: format!(
                    "change {id} ({}) was asked for by {}; a second person must approve it, not {}",
                    change.target,
                    change.requested_by.describe(),
                    approver.describe()
                ),
            });
        }
        self.authorize(approver, &change.command).map_err(|message| Rejection::PermissionDenied { message })?;
        let (_, now) = self.change_target(&change.command);
        if now != change.before {
            return Err(Rejection::Conflict {
                message: format!("the {} changed since change {id} was asked for; withdraw it and ask again", change.target),
            });
        }
        let (requester, command) = (change.requested_by.clone(), change.command.clone());
        let result = match &command {
            // Applied directly: the top-level path refuses guarded commands.
            Command::SetQuota(quota) => self.set_quota(quota),
            Command::SetQueue(queue) => self.set_queue(queue),
            other => self.apply_as(index, &requester, other),
        }?;
        if let CommandResult::Rejected(rejection) = result {
            return Err(rejection);
        }
        self.approvals.pending.remove(&id);
        Ok(result)
    }

    /// The requester or an operator takes a pending change back.
    pub(super) fn withdraw_change(&mut self, actor: &Actor, id: u64) -> Result<CommandResult, Rejection> {
        let change = self.approvals.pending.get(&id).ok_or_else(|| Rejection::NotFound { what: format!("pending change {id}") })?;
        if !same_person(actor, &change.requested_by) {
            self.auth.permits(actor, super::auth::Action::Operate).map_err(|message| Rejection::PermissionDenied { message })?;
        }
        self.approvals.pending.remove(&id);
        Ok(CommandResult::Done)
    }

    /// Set or lift the rule that a kind of change needs approval. Lifting
    /// a rule in force reaches here only once approved (`approval_needed`).
    pub(super) fn require_approval(
        &mut self,
        actor: &Actor,
        kind: ChangeKind,
        required: bool,
        expire_after_ms: u64,
    ) -> Result<CommandResult, Rejection> {
        if !required {
            self.approvals.rules.remove(&kind);
            return Ok(CommandResult::Done);
        }
        if actor.user.is_none() {
            return Err(Rejection::PermissionDenied {
                message: "two-person changes tell people apart by name: this cluster serves requests without users".into(),
            });
        }
        if !(MIN_EXPIRE_AFTER_MS..=MAX_EXPIRE_AFTER_MS).contains(&expire_after_ms) {
            return Err(Rejection::Invalid {
                field: "expire_after_ms".into(),
                message: format!("{expire_after_ms} ms is outside {MIN_EXPIRE_AFTER_MS}..={MAX_EXPIRE_AFTER_MS} ms"),
            });
        }
        debug_assert!(self.cluster_version() >= APPROVALS_FROM_VERSION);
        self.approvals.rules.insert(kind, ApprovalRule { expire_after_ms, set_ms: self.now_ms });
        Ok(CommandResult::Done)
    }
}
