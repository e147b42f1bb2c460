//! Who may do what, kept in the replicated state (format 5 on): users with a
//! role and groups, bearer tokens (only their SHA-256 hashes), the owner and
//! secret marks of every job, and the audit trail of every command a person
//! or portal sent.
//!
//! The rules are one pure function, [`AuthState::permits`], used by apply for
//! every audited command (so every replica decides the same, and a change
//! of roles racing a command cannot let it through) and by the replicas'
//! read paths before they answer.

use std::collections::BTreeSet;

use super::shared::{SharedList, SharedMap};
use serde::{Deserialize, Serialize};

use super::types::JobId;

/// Most users the cluster keeps.
pub const MAX_USERS: usize = 10_000;
/// Most tokens the cluster keeps, revoked ones included until they expire.
pub const MAX_TOKENS: usize = 50_000;
/// Most tokens one user holds.
pub const MAX_TOKENS_PER_USER: usize = 64;
/// Most groups one user belongs to.
pub const MAX_GROUPS_PER_USER: usize = 64;
/// Audit records kept; the oldest is dropped first, and the drop counted.
pub const MAX_AUDIT_RECORDS: usize = 100_000;
/// Longest audit description kept, bytes.
pub const MAX_AUDIT_WHAT_BYTES: usize = 512;
/// Longest user, group or token id name, bytes.
pub const MAX_NAME_BYTES: usize = 64;

/// A role, from least to most allowed; each holds what the ones before it hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Reads the cluster; sees environment values of nobody's jobs.
    Viewer,
    /// Submits to its groups, cancels and reads the secrets of its own jobs.
    User,
    /// Also any job of its groups.
    GroupAdmin,
    /// Queues, quotas, nodes, drills, alarms, membership, and every job.
    Operator,
    /// Users, roles and tokens.
    Admin,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Viewer, Role::User, Role::GroupAdmin, Role::Operator, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::User => "user",
            Role::GroupAdmin => "group-admin",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(text: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|role| role.as_str() == text)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRecord {
    pub name: String,
    pub role: Role,
    pub groups: BTreeSet<String>,
    /// May act for other users (`--as`), as a portal does.
    pub impersonate: bool,
    pub created_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// Public part of the token, used to find it and to revoke it.
    pub id: String,
    pub user: String,
    /// SHA-256 of the whole token; the token itself is never replicated.
    pub hash: Vec<u8>,
    pub created_ms: u64,
    /// Unix ms after which the token is refused.
    pub expires_ms: u64,
    pub revoked: bool,
}

/// Who sent a command: a person or portal (`user`, acting for nobody else
/// or, with `impersonator`, a portal acting for `user`), from where.
/// `user: None` is the cluster itself or a replica started `--insecure`,
/// where nothing is checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Actor {
    pub user: Option<String>,
    pub impersonator: Option<String>,
    /// The client's address as the first replica saw it.
    pub from: String,
}

impl Actor {
    pub fn unchecked(from: &str) -> Actor {
        Actor { user: None, impersonator: None, from: from.to_string() }
    }

    pub fn user(name: &str, from: &str) -> Actor {
        Actor { user: Some(name.to_string()), impersonator: None, from: from.to_string() }
    }

    /// `alice`, `portal as alice`, or `unchecked`.
    pub fn describe(&self) -> String {
        match (&self.user, &self.impersonator) {
            (None, _) => "unchecked".into(),
            (Some(user), None) => user.clone(),
            (Some(user), Some(by)) => format!("{by} as {user}"),
        }
    }
}

/// Marks of a job that is not in its spec: who submitted it, and which
/// environment values and whether its command are secret beyond the
/// default rule (every environment value is hidden from other users).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct JobMarks {
    pub owner: Option<String>,
    pub secret_env: BTreeSet<String>,
    pub secret_command: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Log index of the entry that held the command.
    pub index: u64,
    pub at_ms: u64,
    pub actor: Actor,
    /// The command, with no secret in it (see `Command::audit_summary`).
    pub what: String,
    /// `ok`, or the refusal.
    pub outcome: String,
}

/// What an actor wants to do, for [`AuthState::permits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    /// Read the cluster: jobs (secrets redacted), nodes, queues, quotas.
    Read,
    Submit {
        group: &'a str,
    },
    /// Cancel a job, read its logs and its secret values.
    OwnJob {
        owner: Option<&'a str>,
        group: &'a str,
    },
    /// Change a job's priority: its owner may lower it; raising it is
    /// for its group's admins and the operators.
    Reprioritize {
        owner: Option<&'a str>,
        group: &'a str,
        raising: bool,
    },
    /// Queues, quotas, nodes, drills, alarms, membership.
    Operate,
    /// Users, roles, everyone's tokens, the audit trail.
    Administer,
    /// Administer what a group owns (grant its templates): the group's
    /// group-admins and operators.
    AdministerGroup {
        group: &'a str,
    },
    /// Create or revoke a token of `user`: its admin, or the user itself.
    ManageTokensOf {
        user: &'a str,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct AuthState {
    pub users: SharedMap<String, UserRecord>,
    pub tokens: SharedMap<String, TokenRecord>,
    pub job_marks: SharedMap<JobId, JobMarks>,
    pub audit: SharedList<AuditRecord>,
    /// Audit records dropped to keep the trail bounded.
    pub audit_dropped: u64,
}

impl AuthState {
    /// May `actor` do `action`? `Err` says why not, naming the actor and,
    /// where it is the reason, the group.
    pub fn permits(&self, actor: &Actor, action: Action<'_>) -> Result<(), String> {
        let Some(name) = actor.user.as_deref() else { return Ok(()) };
        if let Some(by) = actor.impersonator.as_deref() {
            let allowed = self.users.get(by).is_some_and(|u| u.impersonate);
            if !allowed {
                return Err(format!("{by} may not act for other users (no impersonate permission)"));
            }
        }
        let Some(user) = self.users.get(name) else {
            return Err(format!(
                "user {name:?} has no role in this cluster; an admin adds it with `rota auth user add {name} --role ROLE`"
            ));
        };
        let who = actor.describe();
        let need = |role: Role, what: &str| {
            if user.role >= role {
                Ok(())
            } else {
                Err(format!("{who} ({}) may not {what}: it needs the {} role", user.role.as_str(), role.as_str()))
            }
        };
        match action {
            Action::Read => Ok(()),
            Action::Operate => need(Role::Operator, "change the cluster's configuration"),
            Action::Administer => need(Role::Admin, "manage users, roles and tokens"),
            Action::ManageTokensOf { user: of } if of == name => need(Role::User, "hold tokens"),
            Action::ManageTokensOf { .. } => need(Role::Admin, "manage another user's tokens"),
            Action::Submit { group } => {
                need(Role::User, "submit jobs")?;
                if user.groups.contains(group) || user.role >= Role::Operator {
                    Ok(())
                } else {
                    Err(format!("{who} may not submit to group {group:?}: not a member (groups: {})", join(&user.groups)))
                }
            }
            Action::AdministerGroup { group } => {
                if user.role >= Role::Operator || (user.role >= Role::GroupAdmin && user.groups.contains(group)) {
                    Ok(())
                } else {
                    Err(format!("{who} ({}) may not administer group {group:?}: it needs the group-admin role in it", user.role.as_str()))
                }
            }
            Action::Reprioritize { owner, group, raising } => {
                let owns = owner == Some(name) && user.role >= Role::User;
                let admins = user.role >= Role::GroupAdmin && user.groups.contains(group);
                if admins || user.role >= Role::Operator || (owns && !raising) {
                    Ok(())
                } else if owns {
                    Err(format!(
                        "{who} may lower the priority of its own job only: raising it needs the group-admin role in group {group:?}"
                    ))
                } else {
                    Err(format!("{who} may not change the priority of a job of {} in group {group:?}", owner.unwrap_or("nobody")))
                }
            }
            Action::OwnJob { owner, group } => {
                let owns = owner == Some(name) && user.role >= Role::User;
                let admins = user.role >= Role::GroupAdmin && user.groups.contains(group);
                if owns || admins || user.role >= Role::Operator {
                    Ok(())
                } else {
                    Err(format!("{who} may not act on a job of {} in group {group:?}", owner.unwrap_or("nobody")))
                }
            }
        }
    }

    /// Keep an audit record, dropping the oldest past the bound.
    pub fn record(&mut self, mut record: AuditRecord) {
        truncate_at_char(&mut record.what, MAX_AUDIT_WHAT_BYTES);
        truncate_at_char(&mut record.outcome, MAX_AUDIT_WHAT_BYTES);
        self.audit.push_back(record);
        while self.audit.len() > MAX_AUDIT_RECORDS {
            self.audit.pop_front();
            self.audit_dropped += 1;
        }
        debug_assert!(self.audit.len() <= MAX_AUDIT_RECORDS);
    }

    /// Drop tokens past their expiry, so revoked and expired ones do not
    /// fill the table (apply calls it with the log's clock).
    pub fn drop_expired_tokens(&mut self, now_ms: u64) {
        let expired: Vec<String> = self.tokens.iter().filter(|(_, token)| token.expires_ms <= now_ms).map(|(id, _)| id.clone()).collect();
        for id in expired {
            self.tokens.remove(&id);
        }
    }
}

fn join(set: &BTreeSet<String>) -> String {
    if set.is_empty() {
        return "none".into();
    }
    set.iter().map(String::as_str).collect::<Vec<_>>().join(",")
}

fn truncate_at_char(text: &mut String, max_bytes: usize) {
    let keep = crate::text::prefix_within(text, max_bytes).len();
    text.truncate(keep);
}

/// A user, group or token id name: 1 to 64 of `[A-Za-z0-9._-]`, starting
/// with a letter or digit (it is shown in tables and used in certificates).
pub fn validate_name(field: &str, name: &str) -> Result<(), (String, String)> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err((field.into(), format!("must be 1 to {MAX_NAME_BYTES} bytes, got {}", name.len())));
    }
    if !name.chars().all(ok_char) || !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err((field.into(), format!("{name:?} must be letters, digits, '.', '_' or '-', starting with a letter or digit")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> AuthState {
        let mut auth = AuthState::default();
        let mut add = |name: &str, role: Role, groups: &[&str], impersonate: bool| {
            let groups = groups.iter().map(|g| g.to_string()).collect();
            auth.users.insert(name.into(), UserRecord { name: name.into(), role, groups, impersonate, created_ms: 0 });
        };
        add("vera", Role::Viewer, &["vision"], false);
        add("alice", Role::User, &["vision"], false);
        add("bob", Role::User, &["nlp"], false);
        add("gina", Role::GroupAdmin, &["vision"], false);
        add("otto", Role::Operator, &[], false);
        add("ada", Role::Admin, &[], false);
        add("portal", Role::User, &[], true);
        auth
    }

    fn as_user(name: &str) -> Actor {
        Actor::user(name, "127.0.0.1:1")
    }

    #[test]
    fn roles_allow_what_they_name_and_refuse_the_rest() {
        let auth = state();
        let submit = Action::Submit { group: "vision" };
        assert!(auth.permits(&as_user("vera"), Action::Read).is_ok());
        assert!(auth.permits(&as_user("vera"), submit).unwrap_err().contains("needs the user role"));
        assert!(auth.permits(&as_user("alice"), submit).is_ok());
        assert!(auth.permits(&as_user("bob"), submit).unwrap_err().contains("group \"vision\""));
        assert!(auth.permits(&as_user("alice"), Action::Operate).is_err());
        assert!(auth.permits(&as_user("otto"), Action::Operate).is_ok());
        assert!(auth.permits(&as_user("otto"), Action::Administer).is_err());
        assert!(auth.permits(&as_user("ada"), Action::Administer).is_ok());
        assert!(auth.permits(&as_user("mallory"), Action::Read).unwrap_err().contains("no role"));
        assert!(auth.permits(&Actor::unchecked("x"), Action::Administer).is_ok());
    }

    #[test]
    fn a_job_is_its_owners_its_group_admins_and_the_operators() {
        let auth = state();
        let alices = Action::OwnJob { owner: Some("alice"), group: "vision" };
        assert!(auth.permits(&as_user("alice"), alices).is_ok());
        assert!(auth.permits(&as_user("bob"), alices).is_err());
        assert!(auth.permits(&as_user("vera"), alices).is_err(), "a viewer in the group is not its admin");
        assert!(auth.permits(&as_user("gina"), alices).is_ok());
        assert!(auth.permits(&as_user("gina"), Action::OwnJob { owner: Some("bob"), group: "nlp" }).is_err());
        assert!(auth.permits(&as_user("otto"), Action::OwnJob { owner: Some("bob"), group: "nlp" }).is_ok());
    }

    /// A user may not raise its own job over its group's other jobs; the
    /// group's admins order the group's work.
    #[test]
    fn owners_lower_priorities_and_group_admins_and_operators_set_any() {
        let auth = state();
        let change = |raising| Action::Reprioritize { owner: Some("alice"), group: "vision", raising };
        assert!(auth.permits(&as_user("alice"), change(false)).is_ok());
        assert!(auth.permits(&as_user("alice"), change(true)).unwrap_err().contains("group-admin role in group \"vision\""));
        assert!(auth.permits(&as_user("gina"), change(true)).is_ok());
        assert!(auth.permits(&as_user("otto"), change(true)).is_ok());
        assert!(auth.permits(&as_user("bob"), change(false)).unwrap_err().contains("may not change the priority"));
        assert!(auth.permits(&as_user("vera"), change(false)).is_err(), "a viewer in the group changes nothing");
        let bobs = Action::Reprioritize { owner: Some("bob"), group: "nlp", raising: true };
        assert!(auth.permits(&as_user("gina"), bobs).is_err(), "another group's admin");
    }

    #[test]
    fn only_impersonators_act_for_others_and_then_with_the_others_rights() {
        let auth = state();
        let portal_as_alice = Actor { user: Some("alice".into()), impersonator: Some("portal".into()), from: String::new() };
        assert!(auth.permits(&portal_as_alice, Action::Submit { group: "vision" }).is_ok());
        assert!(auth.permits(&portal_as_alice, Action::Operate).is_err());
        let bob_as_alice = Actor { user: Some("alice".into()), impersonator: Some("bob".into()), from: String::new() };
        assert!(auth.permits(&bob_as_alice, Action::Read).unwrap_err().contains("impersonate"));
        assert_eq!(portal_as_alice.describe(), "portal as alice");
    }

    #[test]
    fn a_group_is_administered_by_its_group_admins_and_the_operators() {
        let auth = state();
        let vision = Action::AdministerGroup { group: "vision" };
        assert!(auth.permits(&as_user("gina"), vision).is_ok());
        assert!(auth.permits(&as_user("alice"), vision).unwrap_err().contains("group-admin"));
        assert!(auth.permits(&as_user("gina"), Action::AdministerGroup { group: "nlp" }).is_err());
        assert!(auth.permits(&as_user("otto"), vision).is_ok());
    }

    #[test]
    fn tokens_are_their_users_and_their_admins() {
        let auth = state();
        assert!(auth.permits(&as_user("alice"), Action::ManageTokensOf { user: "alice" }).is_ok());
        assert!(auth.permits(&as_user("alice"), Action::ManageTokensOf { user: "bob" }).is_err());
        assert!(auth.permits(&as_user("vera"), Action::ManageTokensOf { user: "vera" }).is_err());
        assert!(auth.permits(&as_user("ada"), Action::ManageTokensOf { user: "bob" }).is_ok());
    }

    #[test]
    fn the_audit_trail_is_bounded_and_counts_what_it_drops() {
        let mut auth = AuthState::default();
        for index in 0..(MAX_AUDIT_RECORDS as u64 + 3) {
            auth.record(AuditRecord { index, at_ms: 0, actor: Actor::default(), what: "x".repeat(600), outcome: "ok".into() });
        }
        assert_eq!(auth.audit.len(), MAX_AUDIT_RECORDS);
        assert_eq!(auth.audit_dropped, 3);
        assert_eq!(auth.audit.front().map(|r| r.index), Some(3));
        assert_eq!(auth.audit.back().map(|r| r.what.len()), Some(MAX_AUDIT_WHAT_BYTES));
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("user", "alice").is_ok());
        assert!(validate_name("user", "").is_err());
        assert!(validate_name("user", "-x").is_err());
        assert_eq!(validate_name("groups", "a b").unwrap_err().0, "groups");
        assert!(validate_name("user", &"a".repeat(65)).is_err());
    }
}
