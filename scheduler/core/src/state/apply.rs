//! One function per command. Each either changes the state and says so, or
//! returns a `Rejection` having changed nothing.

use std::collections::BTreeSet;

use super::auth::{
    validate_name as validate_auth_name, Action, Actor, AuditRecord, JobMarks, Role, TokenRecord, UserRecord, MAX_GROUPS_PER_USER,
    MAX_TOKENS, MAX_TOKENS_PER_USER, MAX_USERS,
};
use super::command::*;
use super::faults::{utc_text, Fence, FenceKind};
use super::shared::SharedMap;
use super::types::*;
use super::validate::{validate_queue, validate_quota, validate_request_id, validate_spec};
use super::xid::{xid_action, XidAction};
use super::ClusterState;

fn validate_name(name: &str) -> Result<(), (String, String)> {
    validate_auth_name("name", name)
}

fn invalid((field, message): (String, String)) -> Rejection {
    Rejection::Invalid { field, message }
}

/// MASTER_PORT is chosen from this range, unique per rank-0 node.
const MASTER_PORT_FIRST: u16 = 29_500;
const MASTER_PORT_COUNT: u16 = 10_000;
/// An operator's fence reason at most.
const MAX_FENCE_REASON_BYTES: usize = 256;

impl ClusterState {
    pub(super) fn apply(&mut self, index: u64, command: &Command) -> CommandResult {
        let result = match command {
            Command::SubmitJob { request_id, spec } => self.submit(index, request_id.as_deref(), spec),
            Command::CancelJob { job_id } => self.cancel(index, *job_id),
            Command::RegisterNode(registration) => self.register_node(index, registration),
            Command::NodeHealth { node, unhealthy_gpus } => self.node_health(node, unhealthy_gpus),
            Command::DrainNode { node, drain } => self.drain_node(node, *drain),
            Command::NodeDown { node } => self.node_down(index, node),
            Command::ApplyPlan(plan) => Ok(self.apply_plan(index, plan)),
            Command::AllocStarted { alloc_id, rank } => self.alloc_started(index, *alloc_id, *rank),
            Command::AllocExited { alloc_id, rank, exit_code } => self.alloc_exited(index, *alloc_id, *rank, *exit_code),
            Command::Checkpoint { alloc_id, at_ms } => self.checkpoint(index, *alloc_id, *at_ms),
            Command::SetQueue(_) | Command::SetQuota(_) if self.approval_needed(command).is_some() => Err(Rejection::PermissionDenied {
                message: format!("{} needs a second person's approval, asked for by a named user", command.audit_summary()),
            }),
            Command::SetQueue(queue) => self.set_queue(queue),
            Command::SetQuota(quota) => self.set_quota(quota),
            Command::AllocLost { alloc_id, rank } => self.alloc_lost(index, *alloc_id, *rank, StopReason::NodeLost),
            Command::AllocLostFor { alloc_id, rank, reason } => self.alloc_lost_for(index, *alloc_id, *rank, *reason),
            Command::WithLostAfter { lost_after, command } => self.with_lost_after(index, None, *lost_after, command),
            Command::SetClusterVersion { version } => self.set_cluster_version(*version),
            Command::SetAlarm { replica, kind, raised } => Ok(self.set_alarm(*replica, *kind, *raised)),
            Command::NodesHeard { nodes } => Ok(self.nodes_heard(nodes)),
            Command::Audited { actor, command } => Ok(self.apply_audited(index, actor, command)),
            Command::Traced { command, .. } => Ok(self.apply(index, command)),
            Command::Once { request_id, command } => Ok(self.apply_once(index, request_id, command)),
            Command::BootstrapAdmin { name } => self.bootstrap_admin(name),
            Command::GpuXid { node, gpu, xid, at_ms } => self.gpu_xid(index, node, *gpu, *xid, *at_ms),
            Command::GpuReset { node, gpu } => self.gpu_reset(node, *gpu),
            Command::AllocIdle { alloc_id, rank, idle_for_ms } => {
                self.alloc_idle(*alloc_id, *rank, *idle_for_ms);
                Ok(CommandResult::Done)
            }
            Command::IdleFlagged { alloc_ids } => self.idle_flagged(alloc_ids).map(|()| CommandResult::Done),
            Command::SubmitMarked { .. }
            | Command::ReadmitNode { .. }
            | Command::FenceNode { .. }
            | Command::SetUser { .. }
            | Command::RemoveUser { .. }
            | Command::CreateToken { .. }
            | Command::RevokeToken { .. }
            | Command::Note { .. }
            | Command::SubmitTagged { .. }
            | Command::SaveTemplate { .. }
            | Command::DeleteTemplate { .. }
            | Command::GrantTemplate { .. }
            | Command::SetBudget { .. }
            | Command::RequireApproval { .. }
            | Command::ApproveChange { .. }
            | Command::WithdrawChange { .. }
            | Command::ApplyPolicy { .. }
            | Command::PromotePolicy
            | Command::RollbackPolicy { .. }
            | Command::SetJobPriority { .. }
            | Command::SetLimits(_)
            | Command::SetQueueIdle { .. } => Err(Rejection::Invalid {
                field: "command".into(),
                message: "this command is applied only inside an audited command naming its sender".into(),
            }),
        };
        result.unwrap_or_else(CommandResult::Rejected)
    }

    /// The cluster version only rises, and only to a format this build
    /// reads (a replica on an older build never gets here: it cannot decode
    /// the entry).
    fn set_cluster_version(&mut self, version: u16) -> Result<CommandResult, Rejection> {
        let current = self.cluster_version();
        if version <= current || version > super::codec::FORMAT_VERSION {
            return Err(Rejection::Invalid {
                field: "version".into(),
                message: format!("cluster version {current} can rise only, up to {}; asked for {version}", super::codec::FORMAT_VERSION),
            });
        }
        self.cluster_version = version;
        if version >= super::tenancy::TENANCY_FROM_VERSION && current < super::tenancy::TENANCY_FROM_VERSION {
            self.start_metering();
        }
        Ok(CommandResult::Done)
    }

    /// Unknown names are skipped: a node may be gone by the time the record
    /// commits. The map exists from format 4 on (older snapshots cannot
    /// carry it, so replicas restored from one would disagree).
    fn nodes_heard(&mut self, nodes: &[String]) -> CommandResult {
        for name in nodes.iter().filter(|name| self.nodes.contains_key(*name)) {
            self.node_heard_ms.insert(name.clone(), self.now_ms);
        }
        CommandResult::Done
    }

    /// Raising a raised alarm or clearing a clear one changes nothing.
    fn set_alarm(&mut self, replica: u64, kind: AlarmKind, raised: bool) -> CommandResult {
        if raised {
            self.alarms.insert((replica, kind));
        } else {
            self.alarms.remove(&(replica, kind));
        }
        CommandResult::Done
    }

    /// New work is refused while an alarm is raised: a replica short of
    /// disk must not be pushed into failing its log writes.
    fn check_no_alarm(&self) -> Result<(), Rejection> {
        match self.alarms.iter().next() {
            None => Ok(()),
            Some((replica, kind)) => Err(Rejection::Alarmed {
                message: format!(
                    "alarm {} raised by replica {replica}: the cluster takes no new work until an operator frees space and runs `rota alarm disarm`",
                    kind.as_str()
                ),
            }),
        }
    }

    /// Check a command against its actor's role, apply it as the actor and
    /// record both, with the outcome, in the audit trail.
    fn apply_audited(&mut self, index: u64, actor: &Actor, command: &Command) -> CommandResult {
        let result = match (self.authorize(actor, command), self.approval_needed(command)) {
            (Err(message), _) => Err(Rejection::PermissionDenied { message }),
            (Ok(()), Some(kind)) => self.request_change(actor, kind, command),
            (Ok(()), None) => self.apply_as(index, actor, command),
        };
        let result = result.unwrap_or_else(CommandResult::Rejected);
        let outcome = match &result {
            CommandResult::Rejected(rejection) => format!("refused: {rejection}"),
            CommandResult::AwaitingApproval { change_id, .. } => format!("awaiting approval as change {change_id}"),
            CommandResult::Submitted { job_id, deduplicated: false } => format!("ok: job {job_id}"),
            CommandResult::Submitted { job_id, deduplicated: true } => format!("ok: job {job_id} (a retry)"),
            _ => "ok".into(),
        };
        let record = AuditRecord { index, at_ms: self.now_ms, actor: actor.clone(), what: command.audit_summary(), outcome };
        self.auth.record(record);
        result
    }

    /// The rule of `AuthState::permits` for each command a person may send.
    pub(super) fn authorize(&self, actor: &Actor, command: &Command) -> Result<(), String> {
        let action = match command {
            Command::SubmitJob { spec, .. } | Command::SubmitMarked { spec, .. } => Action::Submit { group: &spec.group },
            Command::SubmitTagged { spec, template, .. } => {
                self.auth.permits(actor, Action::Submit { group: &spec.group })?;
                return match template.as_ref().and_then(|t| self.tenancy.templates.get(&t.name)) {
                    // An unknown template or version is NotFound in apply.
                    None => Ok(()),
                    Some(found) if found.usable_by(&spec.group) => Ok(()),
                    Some(found) => self.auth.permits(actor, Action::Operate).map_err(|_| {
                        format!(
                            "{} may not use template {} of group {:?} for a job of group {:?}: not granted (its group-admin runs `rota template grant {} --to {}`)",
                            actor.describe(),
                            found.name,
                            found.group,
                            spec.group,
                            found.name,
                            spec.group
                        )
                    }),
                };
            }
            Command::WithLostAfter { command, .. } => return self.authorize(actor, command),
            Command::SaveTemplate { name, group, .. } => match self.tenancy.templates.get(name) {
                Some(existing) if existing.group != *group => Action::Submit { group: &existing.group },
                _ => Action::Submit { group },
            },
            Command::DeleteTemplate { name } => match self.tenancy.templates.get(name) {
                Some(existing) => Action::Submit { group: &existing.group },
                None => Action::Read,
            },
            Command::GrantTemplate { name, .. } => match self.tenancy.templates.get(name) {
                Some(existing) => Action::AdministerGroup { group: &existing.group },
                None => Action::Read,
            },
            Command::SetBudget { .. } | Command::RequireApproval { .. } => Action::Operate,
            // Who may approve or withdraw depends on the change (checked in apply).
            Command::ApproveChange { .. } | Command::WithdrawChange { .. } => Action::Read,
            Command::SetJobPriority { job_id, priority } => match self.jobs.get(job_id) {
                None => Action::Read,
                Some(job) => {
                    let owner = self.auth.job_marks.get(job_id).and_then(|m| m.owner.as_deref());
                    Action::Reprioritize { owner, group: &job.spec.group, raising: *priority > job.spec.priority }
                }
            },
            Command::CancelJob { job_id } => match self.jobs.get(job_id) {
                // Apply answers NotFound; nothing is revealed by it that a read would not show.
                None => Action::Read,
                Some(job) => {
                    let owner = self.auth.job_marks.get(job_id).and_then(|m| m.owner.as_deref());
                    Action::OwnJob { owner, group: &job.spec.group }
                }
            },
            Command::DrainNode { .. }
            | Command::SetQueue(_)
            | Command::SetQueueIdle { .. }
            | Command::SetQuota(_)
            | Command::SetAlarm { .. }
            | Command::Note { .. }
            | Command::ReadmitNode { .. }
            | Command::FenceNode { .. } => Action::Operate,
            Command::SetUser { .. }
            | Command::RemoveUser { .. }
            | Command::ApplyPolicy { .. }
            | Command::PromotePolicy
            | Command::RollbackPolicy { .. }
            | Command::SetLimits(_) => Action::Administer,
            Command::CreateToken { user, .. } => Action::ManageTokensOf { user },
            Command::RevokeToken { id } => match self.auth.tokens.get(id) {
                Some(token) => Action::ManageTokensOf { user: &token.user },
                None => Action::Administer,
            },
            _ => return Err(format!("{} is not a command people send", command.audit_summary())),
        };
        self.auth.permits(actor, action)
    }

    pub(super) fn apply_as(&mut self, index: u64, actor: &Actor, command: &Command) -> Result<CommandResult, Rejection> {
        let marks = |secret_env: &BTreeSet<String>, secret_command: bool| JobMarks {
            owner: actor.user.clone(),
            secret_env: secret_env.clone(),
            secret_command,
        };
        match command {
            Command::SubmitJob { request_id, spec } => {
                self.submit_marked(index, request_id.as_deref(), spec, marks(&BTreeSet::new(), false))
            }
            Command::SubmitMarked { request_id, spec, secret_env, secret_command } => {
                self.submit_marked(index, request_id.as_deref(), spec, marks(secret_env, *secret_command))
            }
            Command::SetUser { name, role, groups, impersonate } => self.set_user(name, *role, groups, *impersonate),
            Command::RemoveUser { name } => self.remove_user(name),
            Command::CreateToken { id, user, hash, expires_ms } => self.create_token(id, user, hash, *expires_ms),
            Command::RevokeToken { id } => self.revoke_token(id),
            Command::Note { .. } => Ok(CommandResult::Done),
            Command::ReadmitNode { node, gpu } => self.readmit(node, *gpu),
            Command::FenceNode { node, gpu, reason } => self.fence_by_operator(index, node, *gpu, reason),
            Command::SubmitTagged { request_id, spec, secret_env, secret_command, labels, template } => {
                let marks = marks(secret_env, *secret_command);
                self.submit_tagged(index, request_id.as_deref(), spec, marks, labels, template.as_ref())
            }
            Command::SaveTemplate { name, group, spec, labels } => {
                self.save_template(name, group, spec, labels, actor.user.as_deref().unwrap_or(""))
            }
            Command::DeleteTemplate { name } => self.delete_template(name),
            Command::GrantTemplate { name, group, granted } => self.grant_template(name, group, *granted),
            Command::SetBudget { group, month, gpu_ms, strict } => self.set_budget(group, *month, *gpu_ms, *strict),
            Command::RequireApproval { kind, required, expire_after_ms } => {
                self.require_approval(actor, *kind, *required, *expire_after_ms)
            }
            Command::ApproveChange { id } => self.approve_change(index, actor, *id),
            Command::WithdrawChange { id } => self.withdraw_change(actor, *id),
            Command::SetQueueIdle { queue, idle } => self.set_queue_idle(queue, *idle),
            Command::ApplyPolicy { document, comment, canary } => {
                self.apply_policy(actor.user.as_deref().unwrap_or(""), document, comment, canary.as_ref())
            }
            Command::PromotePolicy => self.promote_policy(),
            Command::RollbackPolicy { to } => self.rollback_policy(*to),
            Command::SetJobPriority { job_id, priority } => self.set_job_priority(*job_id, *priority),
            Command::WithLostAfter { lost_after, command } => self.with_lost_after(index, Some(actor), *lost_after, command),
            Command::SetLimits(change) => self
                .set_limits(index, change)
                .map(|()| CommandResult::Done)
                .map_err(|(field, message)| Rejection::Invalid { field: field.into(), message }),
            other => Ok(self.apply(index, other)),
        }
    }

    pub(super) fn submit_marked(
        &mut self,
        index: u64,
        request_id: Option<&str>,
        spec: &JobSpec,
        marks: JobMarks,
    ) -> Result<CommandResult, Rejection> {
        for name in &marks.secret_env {
            if !spec.env.contains_key(name) {
                return Err(Rejection::Invalid {
                    field: "secret_env".into(),
                    message: format!("{name:?} is not in the job's environment"),
                });
            }
        }
        let result = self.submit(index, request_id, spec)?;
        if let CommandResult::Submitted { job_id, deduplicated: false } = result {
            if marks != JobMarks::default() {
                self.auth.job_marks.insert(job_id, marks);
            }
        }
        Ok(result)
    }

    fn bootstrap_admin(&mut self, name: &str) -> Result<CommandResult, Rejection> {
        validate_name(name).map_err(invalid)?;
        if !self.auth.users.is_empty() {
            return Ok(CommandResult::Done);
        }
        let admin =
            UserRecord { name: name.to_string(), role: Role::Admin, groups: BTreeSet::new(), impersonate: false, created_ms: self.now_ms };
        self.auth.users.insert(name.to_string(), admin);
        let record = AuditRecord {
            index: self.applied_index,
            at_ms: self.now_ms,
            actor: Actor::default(),
            what: format!("bootstrap admin {name}"),
            outcome: "ok".into(),
        };
        self.auth.record(record);
        Ok(CommandResult::Done)
    }

    fn set_user(&mut self, name: &str, role: Role, groups: &BTreeSet<String>, impersonate: bool) -> Result<CommandResult, Rejection> {
        validate_name(name).map_err(invalid)?;
        if groups.len() > MAX_GROUPS_PER_USER {
            return Err(Rejection::Invalid {
                field: "groups".into(),
                message: format!("at most {MAX_GROUPS_PER_USER} groups, got {}", groups.len()),
            });
        }
        for group in groups {
            validate_auth_name("groups", group).map_err(invalid)?;
        }
        if !self.auth.users.contains_key(name) && self.auth.users.len() >= MAX_USERS {
            return Err(Rejection::Exhausted { what: "users".into(), limit: MAX_USERS as u64 });
        }
        if self.auth.users.get(name).is_some_and(|u| u.role == Role::Admin) && role != Role::Admin && self.admins() == 1 {
            return Err(Rejection::Conflict { message: format!("{name} is the last admin; make another admin first") });
        }
        let created_ms = self.auth.users.get(name).map_or(self.now_ms, |u| u.created_ms);
        let record = UserRecord { name: name.to_string(), role, groups: groups.clone(), impersonate, created_ms };
        self.auth.users.insert(name.to_string(), record);
        Ok(CommandResult::Done)
    }

    fn admins(&self) -> usize {
        self.auth.users.values().filter(|u| u.role == Role::Admin).count()
    }

    fn remove_user(&mut self, name: &str) -> Result<CommandResult, Rejection> {
        let user = self.auth.users.get(name).ok_or(Rejection::NotFound { what: format!("user {name}") })?;
        if user.role == Role::Admin && self.admins() == 1 {
            return Err(Rejection::Conflict { message: format!("{name} is the last admin; make another admin first") });
        }
        self.auth.users.remove(name);
        let owned: Vec<String> = self.auth.tokens.iter().filter(|(_, t)| t.user == name).map(|(id, _)| id.clone()).collect();
        for id in owned {
            if let Some(token) = self.auth.tokens.get_mut(&id) {
                token.revoked = true;
            }
        }
        Ok(CommandResult::Done)
    }

    fn create_token(&mut self, id: &str, user: &str, hash: &[u8], expires_ms: u64) -> Result<CommandResult, Rejection> {
        validate_auth_name("id", id).map_err(invalid)?;
        if !self.auth.users.contains_key(user) {
            return Err(Rejection::NotFound { what: format!("user {user}") });
        }
        if hash.len() != 32 {
            return Err(Rejection::Invalid { field: "hash".into(), message: format!("a SHA-256 hash is 32 bytes, got {}", hash.len()) });
        }
        if expires_ms <= self.now_ms {
            return Err(Rejection::Invalid { field: "expires_ms".into(), message: "the token would be expired already".into() });
        }
        if self.auth.tokens.contains_key(id) {
            return Err(Rejection::Conflict { message: format!("token id {id} is taken") });
        }
        self.auth.drop_expired_tokens(self.now_ms);
        if self.auth.tokens.len() >= MAX_TOKENS {
            return Err(Rejection::Exhausted { what: "tokens".into(), limit: MAX_TOKENS as u64 });
        }
        if self.auth.tokens.values().filter(|t| t.user == user && !t.revoked).count() >= MAX_TOKENS_PER_USER {
            return Err(Rejection::Exhausted { what: format!("tokens of {user}"), limit: MAX_TOKENS_PER_USER as u64 });
        }
        let token = TokenRecord {
            id: id.to_string(),
            user: user.to_string(),
            hash: hash.to_vec(),
            created_ms: self.now_ms,
            expires_ms,
            revoked: false,
        };
        self.auth.tokens.insert(id.to_string(), token);
        Ok(CommandResult::Done)
    }

    fn revoke_token(&mut self, id: &str) -> Result<CommandResult, Rejection> {
        let token = self.auth.tokens.get_mut(id).ok_or(Rejection::NotFound { what: format!("token {id}") })?;
        token.revoked = true;
        Ok(CommandResult::Done)
    }

    fn submit(&mut self, index: u64, request_id: Option<&str>, spec: &JobSpec) -> Result<CommandResult, Rejection> {
        validate_request_id(request_id)?;
        if let Some(id) = request_id {
            if let Some(job_id) = self.dedupe.get(id) {
                return match self.jobs.get(&job_id) {
                    Some(job) if job.spec != *spec => Err(Rejection::RequestIdReused { request_id: id.to_string(), job_id }),
                    _ => Ok(CommandResult::Submitted { job_id, deduplicated: true }),
                };
            }
        }
        validate_spec(spec, &self.queues)?;
        self.check_no_alarm()?;
        self.check_budget(spec)?;
        if self.live_jobs >= self.limits.max_live_jobs {
            return Err(Rejection::Exhausted { what: "live jobs".into(), limit: self.limits.max_live_jobs as u64 });
        }
        let bytes = spec.payload_bytes() as u64;
        if self.spec_bytes.saturating_add(bytes) > self.limits.max_spec_bytes {
            return Err(Rejection::Exhausted { what: "job spec bytes held by the cluster".into(), limit: self.limits.max_spec_bytes });
        }
        let job_id = self.next_job_id;
        self.next_job_id += 1;
        let request_id = request_id.map(RequestId::from);
        let job = Job {
            id: job_id,
            spec: spec.clone(),
            request_id: request_id.clone(),
            state: JobState::Pending,
            submitted_at_ms: self.now_ms,
            started_at_ms: None,
            finished_at_ms: None,
            attempts: 0,
            failures: 0,
            alloc: None,
            reason: JobReason::new(ReasonCode::New, "not yet considered by the scheduler"),
            estimated_start_ms: None,
            stop_reason: None,
            exit_code: None,
            checkpoint_at_ms: None,
            changed_at_index: index,
            last_nodes: Box::default(),
        };
        self.jobs.insert(job_id, job.into());
        self.job_changes.insert((index, job_id), ());
        let queued = self.pending_jobs.insert(job_id, ());
        assert!(queued.is_none(), "job {job_id} was queued before it was submitted");
        self.live_jobs += 1;
        self.spec_bytes += bytes;
        if let Some(id) = request_id {
            self.dedupe.insert(id, job_id);
        }
        Ok(CommandResult::Submitted { job_id, deduplicated: false })
    }

    fn cancel(&mut self, index: u64, job_id: JobId) -> Result<CommandResult, Rejection> {
        let job = self.jobs.get_mut(&job_id).ok_or(Rejection::NotFound { what: format!("job {job_id}") })?;
        match job.state {
            JobState::Pending => {
                job.reason = JobReason::new(ReasonCode::Cancelled, "while pending");
                self.finish_job(index, job_id, JobState::Cancelled);
            }
            JobState::Running | JobState::Stopping => {
                let alloc_id = job.alloc.expect("running job has an allocation");
                self.request_stop(index, alloc_id, StopReason::Cancelled);
            }
            JobState::Succeeded | JobState::Failed | JobState::Cancelled => {}
        }
        let state = self.jobs[&job_id].state;
        Ok(CommandResult::Cancelled { job_id, state })
    }

    /// A pending job is ordered by its new priority from the next pass on;
    /// a running one may preempt, or be preempted, by it.
    fn set_job_priority(&mut self, job_id: JobId, priority: Priority) -> Result<CommandResult, Rejection> {
        let job = self.jobs.get_mut(&job_id).ok_or(Rejection::NotFound { what: format!("job {job_id}") })?;
        if job.state.is_final() {
            return Err(Rejection::Invalid {
                field: "job_id".into(),
                message: format!("job {job_id} has ended ({}); its priority no longer matters", job.state.as_str()),
            });
        }
        job.spec.priority = priority;
        Ok(CommandResult::Done)
    }

    fn register_node(&mut self, index: u64, registration: &NodeRegistration) -> Result<CommandResult, Rejection> {
        if registration.name.is_empty() || registration.name.len() > 253 {
            return Err(Rejection::Invalid { field: "node.name".into(), message: "1..=253 bytes".into() });
        }
        let indexes: BTreeSet<u32> = registration.gpus.iter().map(|g| g.index).collect();
        if indexes.len() != registration.gpus.len() || registration.gpus.len() > 64 {
            return Err(Rejection::Invalid { field: "node.gpus".into(), message: "at most 64 GPUs, unique indexes".into() });
        }
        if !self.nodes.contains_key(&registration.name) && self.nodes.len() >= self.limits.max_nodes {
            return Err(Rejection::Exhausted { what: "nodes".into(), limit: self.limits.max_nodes as u64 });
        }
        self.end_allocations_on_vanished_gpus(index, registration);
        let now_ms = self.now_ms;
        let node = self.nodes.entry(registration.name.clone()).or_insert_with(|| Node {
            name: registration.name.clone(),
            address: String::new(),
            rack: String::new(),
            leaf: String::new(),
            gpus: Vec::new(),
            state: NodeState::Ready,
            registered_at_ms: now_ms,
        });
        node.address = registration.address.clone();
        node.rack = registration.rack.clone();
        node.leaf = registration.leaf.clone();
        node.gpus = registration.gpus.clone();
        if node.state == NodeState::Down {
            // A drained node that was down comes back drained.
            node.state = if self.faults.drained.contains(&registration.name) { NodeState::Draining } else { NodeState::Ready };
            node.registered_at_ms = now_ms;
        }
        if self.cluster_version() >= 4 {
            self.node_heard_ms.insert(registration.name.clone(), now_ms);
        }
        Ok(CommandResult::Done)
    }

    /// A node that registers again may bring a different set of GPUs (one
    /// fell off the bus, a board was swapped). An allocation holding a GPU
    /// that is gone, or whose UUID changed, ends now (the whole gang) and its
    /// job is requeued; otherwise it would hold a GPU that no longer exists.
    fn end_allocations_on_vanished_gpus(&mut self, index: u64, registration: &NodeRegistration) {
        let Some(node) = self.nodes.get(&registration.name) else { return };
        let kept = |gpu: &GpuInfo| registration.gpus.iter().any(|g| g.index == gpu.index && g.uuid == gpu.uuid);
        let vanished: BTreeSet<u32> = node.gpus.iter().filter(|g| !kept(g)).map(|g| g.index).collect();
        if vanished.is_empty() {
            return;
        }
        let name = registration.name.as_str();
        let lost: BTreeSet<AllocId> = vanished.iter().filter_map(|&gpu| self.gpu_owner.get(&(name.to_string(), gpu)).copied()).collect();
        for alloc_id in lost {
            let alloc = self.allocs.get_mut(&alloc_id).expect("gpu_owner names live allocations");
            if alloc.stop != Some(StopReason::Cancelled) {
                alloc.stop = Some(StopReason::GpuLost);
            }
            self.end_allocation(index, alloc_id);
        }
    }

    fn node_health(&mut self, name: &str, unhealthy: &[u32]) -> Result<CommandResult, Rejection> {
        let node = self.nodes.get_mut(name).ok_or(Rejection::NotFound { what: format!("node {name}") })?;
        for gpu in &mut node.gpus {
            gpu.healthy = !unhealthy.contains(&gpu.index);
        }
        Ok(CommandResult::Done)
    }

    fn drain_node(&mut self, name: &str, drain: bool) -> Result<CommandResult, Rejection> {
        let node = self.nodes.get_mut(name).ok_or(Rejection::NotFound { what: format!("node {name}") })?;
        node.state = match (node.state, drain) {
            (NodeState::Down, _) => NodeState::Down,
            (_, true) => NodeState::Draining,
            (_, false) => NodeState::Ready,
        };
        // The drained set exists from format 6 on (an older snapshot could not carry it).
        if self.cluster_version() >= super::faults::FAULTS_FROM_VERSION {
            if drain {
                self.faults.drained.insert(name.to_string());
            } else {
                self.faults.drained.remove(name);
            }
        }
        Ok(CommandResult::Done)
    }

    /// The node is gone. The leader declares it only after the node's TTL
    /// plus the grace of its jobs (and a margin): by then the node's agent,
    /// cut off as long, has stopped those ranks itself. So its ranks count
    /// as ended. The rest of each gang is asked to stop, and the allocation
    /// ends (GPUs released, job requeued) only once every other rank has
    /// reported its exit: a new attempt never overlaps an old one.
    fn node_down(&mut self, index: u64, name: &str) -> Result<CommandResult, Rejection> {
        let node = self.nodes.get_mut(name).ok_or(Rejection::NotFound { what: format!("node {name}") })?;
        node.state = NodeState::Down;
        let lost: Vec<AllocId> = self.allocs.values().filter(|a| a.ranks.iter().any(|r| r.node == name)).map(|a| a.id).collect();
        // A single-node job with a lost-after stays: its agent keeps it
        // past the lease, and the leader ends it at its own bound.
        let lost: Vec<AllocId> = lost.into_iter().filter(|&alloc_id| !self.held_through_node_loss(alloc_id)).collect();
        for alloc_id in lost {
            let alloc = self.allocs.get_mut(&alloc_id).expect("listed above");
            for rank in alloc.ranks.iter_mut().filter(|r| r.node == name) {
                rank.state = RankState::Exited;
            }
            // A cancel already under way still ends as a cancel.
            self.request_stop(index, alloc_id, StopReason::NodeLost);
        }
        Ok(CommandResult::Done)
    }

    fn apply_plan(&mut self, index: u64, plan: &Plan) -> CommandResult {
        let mut placed = 0;
        let mut rejected = 0;
        for placement in &plan.placements {
            match self.check_placement(placement) {
                Ok(()) => {
                    self.place(index, placement);
                    self.record_policy_version(placement.job_id);
                    placed += 1;
                }
                Err(_) => rejected += 1,
            }
        }
        let mut stopped = 0;
        for stop in &plan.stops {
            let live = self.allocs.get(&stop.alloc_id).is_some_and(|a| a.stop.is_none());
            // Checked again as placements are: the allocation may have
            // turned busy, or its queue's rule changed, since the plan.
            let reclaimable = stop.reason != StopReason::IdleReclaimed
                || self.idle_past_policy(stop.alloc_id, self.now_ms).is_some_and(|p| p.action == super::idle::IdleAction::Reclaim);
            if live && reclaimable {
                self.request_stop(index, stop.alloc_id, stop.reason);
                stopped += 1;
            }
        }
        for note in &plan.pending {
            if let Some(job) = self.jobs.get_mut(&note.job_id) {
                if job.state == JobState::Pending {
                    job.reason.clone_from(&note.reason);
                    job.estimated_start_ms = note.estimated_start_ms;
                }
            }
        }
        CommandResult::PlanApplied { placed, rejected, stopped }
    }

    /// Re-check a placement against the state as it is now (optimistic
    /// concurrency): the plan may have been computed from an older state.
    pub fn check_placement(&self, placement: &Placement) -> Result<(), Rejection> {
        let conflict = |message: String| Rejection::Conflict { message };
        let job = self.jobs.get(&placement.job_id).ok_or(Rejection::NotFound { what: format!("job {}", placement.job_id) })?;
        if job.state != JobState::Pending {
            return Err(conflict(format!("job {} is {}", job.id, job.state.as_str())));
        }
        if let Some(spent) = self.tenancy.exhausted(&job.spec.group, self.now_ms) {
            return Err(conflict(super::apply_tenancy::spent_message(&job.spec.group, &spent)));
        }
        if placement.ranks.len() != job.spec.replicas as usize {
            return Err(conflict(format!("job {} needs {} ranks, plan has {}", job.id, job.spec.replicas, placement.ranks.len())));
        }
        let mut claimed: BTreeSet<(&str, u32)> = BTreeSet::new();
        for rank in &placement.ranks {
            if rank.gpus.len() != job.spec.gpus_per_replica as usize {
                return Err(conflict(format!(
                    "rank on {} has {} GPUs, job needs {}",
                    rank.node,
                    rank.gpus.len(),
                    job.spec.gpus_per_replica
                )));
            }
            let node = self.nodes.get(&rank.node).ok_or(conflict(format!("node {} unknown", rank.node)))?;
            for &index in &rank.gpus {
                let gpu = node.gpus.iter().find(|g| g.index == index).ok_or(conflict(format!("GPU {}:{index} unknown", node.name)))?;
                if !self.gpu_is_free(node, gpu) {
                    return Err(conflict(format!("GPU {}:{index} is not free", node.name)));
                }
                if !gpu_matches(&job.spec, gpu, self.model_aliases()) {
                    return Err(conflict(format!("GPU {}:{index} does not match the job's constraints", node.name)));
                }
                if !claimed.insert((node.name.as_str(), index)) {
                    return Err(conflict(format!("GPU {}:{index} named twice", node.name)));
                }
            }
        }
        Ok(())
    }

    fn place(&mut self, index: u64, placement: &Placement) {
        let alloc_id = self.next_alloc_id;
        self.next_alloc_id += 1;
        let master_port = self.free_master_port(&placement.ranks[0].node);
        let job = self.jobs.get_mut(&placement.job_id).expect("checked");
        move_job(&mut self.pending_jobs, job, JobState::Running);
        job.attempts += 1;
        job.alloc = Some(alloc_id);
        job.started_at_ms = Some(self.now_ms);
        job.reason = JobReason::default();
        job.estimated_start_ms = None;
        job.stop_reason = None;
        job.exit_code = None;
        note_change(&mut self.job_changes, job, index);
        job.last_nodes = placement.ranks.iter().map(|r| r.node.clone()).collect();
        let attempt = job.attempts;
        if let Some(first) = placement.ranks.first() {
            self.record_placed(placement.job_id, &first.node, first.gpus.first().copied().unwrap_or(0));
        }
        let ranks: Vec<Rank> = placement
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| Rank { rank: i as u32, node: r.node.clone(), gpus: r.gpus.clone(), state: RankState::Assigned, exit_code: None })
            .collect();
        for rank in &ranks {
            for &gpu in &rank.gpus {
                let previous = self.gpu_owner.insert((rank.node.clone(), gpu), alloc_id);
                assert!(previous.is_none(), "GPU {}:{gpu} given to two allocations", rank.node);
            }
        }
        let alloc =
            Allocation { id: alloc_id, job_id: placement.job_id, attempt, ranks, master_port, created_at_ms: self.now_ms, stop: None };
        if self.cluster_version() >= super::tenancy::TENANCY_FROM_VERSION {
            let group = &self.jobs[&placement.job_id].spec.group;
            self.tenancy.allocation_started(group, alloc.gpu_count(), self.now_ms);
        }
        self.allocs.insert(alloc_id, alloc);
    }

    /// Smallest port not used as MASTER_PORT by a live allocation whose rank 0
    /// is on the same node. Bounded by the range size.
    fn free_master_port(&self, node: &str) -> u16 {
        let used: BTreeSet<u16> =
            self.allocs.values().filter(|a| a.ranks.first().is_some_and(|r| r.node == node)).map(|a| a.master_port).collect();
        (0..MASTER_PORT_COUNT)
            .map(|offset| MASTER_PORT_FIRST + offset)
            .find(|port| !used.contains(port))
            .expect("fewer than 10,000 allocations start on one node")
    }

    fn request_stop(&mut self, index: u64, alloc_id: AllocId, reason: StopReason) {
        let alloc = self.allocs.get_mut(&alloc_id).expect("stop of a live allocation");
        // A cancel overrides any other reason; other reasons never override a cancel.
        if alloc.stop.is_none() || reason == StopReason::Cancelled {
            alloc.stop = Some(reason);
        }
        let job = self.jobs.get_mut(&alloc.job_id).expect("allocation has a job");
        move_job(&mut self.pending_jobs, job, JobState::Stopping);
        job.stop_reason = alloc.stop;
        note_change(&mut self.job_changes, job, index);
        let all_exited = alloc.ranks.iter().all(|r| r.state == RankState::Exited);
        if all_exited {
            self.end_allocation(index, alloc_id);
        }
    }

    fn alloc_started(&mut self, index: u64, alloc_id: AllocId, rank: u32) -> Result<CommandResult, Rejection> {
        let rank = self.rank_mut(alloc_id, rank)?;
        if rank.state == RankState::Assigned {
            rank.state = RankState::Running;
        }
        self.note_rank_started(alloc_id);
        let job_id = self.allocs[&alloc_id].job_id;
        note_change(&mut self.job_changes, self.jobs.get_mut(&job_id).expect("allocation has a job"), index);
        Ok(CommandResult::Done)
    }

    fn alloc_lost(&mut self, index: u64, alloc_id: AllocId, rank: u32, reason: StopReason) -> Result<CommandResult, Rejection> {
        let rank = self.rank_mut(alloc_id, rank)?;
        if rank.state == RankState::Exited {
            return Ok(CommandResult::Done); // a retried report, or its node was declared down first
        }
        rank.state = RankState::Exited;
        self.request_stop(index, alloc_id, reason);
        Ok(CommandResult::Done)
    }

    /// `AllocLost` with its cause: only causes that lie with the node
    /// (the job is requeued, never failed for them).
    fn alloc_lost_for(&mut self, index: u64, alloc_id: AllocId, rank: u32, reason: StopReason) -> Result<CommandResult, Rejection> {
        if !matches!(reason, StopReason::NodeLost | StopReason::AgentDiskFull) {
            return Err(Rejection::Invalid {
                field: "reason".into(),
                message: format!("{} is not a cause that lies with the node", reason.as_str()),
            });
        }
        self.alloc_lost(index, alloc_id, rank, reason)
    }

    /// A submit whose job outlives its node's silence for `lost_after`:
    /// checked whole before the submit, so a refusal leaves nothing behind.
    fn with_lost_after(
        &mut self,
        index: u64,
        actor: Option<&Actor>,
        lost_after: super::lost_after::LostAfter,
        command: &Command,
    ) -> Result<CommandResult, Rejection> {
        use super::lost_after::{validate_lost_after, LOST_AFTER_FROM_VERSION};
        if self.cluster_version() < LOST_AFTER_FROM_VERSION {
            return Err(Rejection::Invalid {
                field: "lost_after".into(),
                message: format!("needs cluster version {LOST_AFTER_FROM_VERSION}"),
            });
        }
        let Some(spec) = command.submitted_spec() else {
            return Err(Rejection::Invalid { field: "command".into(), message: "a lost-after holds a submit only".into() });
        };
        validate_lost_after(spec, lost_after).map_err(|message| Rejection::Invalid { field: "lost_after".into(), message })?;
        let result = match actor {
            Some(actor) => self.apply_as(index, actor, command)?,
            None => self.apply(index, command),
        };
        if let CommandResult::Submitted { job_id, deduplicated: false } = result {
            self.lost_after.insert(job_id, lost_after);
        }
        Ok(result)
    }

    fn alloc_exited(&mut self, index: u64, alloc_id: AllocId, rank: u32, exit_code: i32) -> Result<CommandResult, Rejection> {
        let rank = self.rank_mut(alloc_id, rank)?;
        if rank.state == RankState::Exited {
            return Ok(CommandResult::Done); // a retried report
        }
        rank.state = RankState::Exited;
        rank.exit_code = Some(exit_code);
        let alloc = self.allocs.get_mut(&alloc_id).expect("found above");
        let job_id = alloc.job_id;
        if exit_code != 0 && alloc.stop.is_none() {
            // One failed rank fails the gang: the others are stopped.
            self.jobs.get_mut(&job_id).expect("allocation has a job").exit_code = Some(exit_code);
            self.request_stop(index, alloc_id, StopReason::Failed);
            return Ok(CommandResult::Done);
        }
        note_change(&mut self.job_changes, self.jobs.get_mut(&job_id).expect("allocation has a job"), index);
        if alloc.ranks.iter().all(|r| r.state == RankState::Exited) {
            self.end_allocation(index, alloc_id);
        }
        Ok(CommandResult::Done)
    }

    fn rank_mut(&mut self, alloc_id: AllocId, rank: u32) -> Result<&mut Rank, Rejection> {
        let alloc = self.allocs.get_mut(&alloc_id).ok_or(Rejection::NotFound { what: format!("allocation {alloc_id}") })?;
        alloc.ranks.get_mut(rank as usize).ok_or(Rejection::NotFound { what: format!("rank {rank} of allocation {alloc_id}") })
    }

    /// Free the allocation's GPUs, account its use, and move its job on:
    /// done, failed, retried, or back to the queue.
    fn end_allocation(&mut self, index: u64, alloc_id: AllocId) {
        let alloc = self.allocs.remove(&alloc_id).expect("ending a live allocation");
        self.running_since.remove(&alloc_id);
        for rank in &alloc.ranks {
            for &gpu in &rank.gpus {
                let owner = self.gpu_owner.remove(&(rank.node.clone(), gpu));
                assert_eq!(owner, Some(alloc_id), "GPU {}:{gpu} was not held by allocation {alloc_id}", rank.node);
            }
        }
        self.idle_allocation_ended(&alloc);
        let held_ms = self.now_ms.saturating_sub(alloc.created_at_ms);
        if alloc.stop != Some(StopReason::Failed) {
            // A cancel that overtook a fault ends as a cancel.
            self.faults.attempt_faults.remove(&alloc_id);
        }
        let job = self.jobs.get_mut(&alloc.job_id).expect("allocation has a job");
        assert_eq!(job.alloc, Some(alloc_id));
        job.alloc = None;
        let key = (job.spec.group.clone(), job.spec.queue.clone());
        *self.usage.gpu_ms.entry(key).or_insert(0) += held_ms * alloc.gpu_count();
        let span = super::records::GpuSpan {
            start_ms: alloc.created_at_ms,
            end_ms: self.now_ms.max(alloc.created_at_ms),
            gpu_ms: held_ms.saturating_mul(alloc.gpu_count()),
            preemptions: u32::from(alloc.stop == Some(StopReason::Preempted)),
        };
        self.record_attempt_ended(alloc.job_id, span);
        let job = self.jobs.get_mut(&alloc.job_id).expect("allocation has a job");
        if self.cluster_version >= super::tenancy::TENANCY_FROM_VERSION {
            self.tenancy.allocation_ended(&job.spec.group, alloc.gpu_count(), self.now_ms);
        }
        let next = match alloc.stop {
            None => (JobState::Succeeded, JobReason::code(ReasonCode::Completed)),
            Some(StopReason::Cancelled) => (JobState::Cancelled, JobReason::code(ReasonCode::Cancelled)),
            Some(StopReason::RuntimeLimit) => (JobState::Failed, JobReason::new(ReasonCode::RuntimeLimit, "runtime limit exceeded")),
            Some(StopReason::Preempted) => (JobState::Pending, JobReason::new(ReasonCode::Preempted, "requeued after preemption")),
            Some(StopReason::IdleReclaimed) => (
                JobState::Failed,
                JobReason::new(ReasonCode::IdleReclaimed, "its GPUs stayed idle past its queue's idle time and were reclaimed"),
            ),
            Some(StopReason::NodeLost) => {
                (JobState::Pending, JobReason::new(ReasonCode::NodeLost, "requeued: a node of the gang was lost"))
            }
            Some(StopReason::NeverStarted) => {
                (JobState::Pending, JobReason::new(ReasonCode::NeverStarted, "requeued: a rank was assigned and not started in time"))
            }
            Some(StopReason::AgentDiskFull) => (
                JobState::Pending,
                JobReason::new(
                    ReasonCode::AgentDiskFull,
                    "requeued: its node's agent could not write the rank's files (disk full or read-only)",
                ),
            ),
            Some(StopReason::GpuLost) => {
                (JobState::Pending, JobReason::new(ReasonCode::GpuLost, "requeued: a GPU of the gang left its node"))
            }
            Some(StopReason::Failed) => {
                job.failures += 1;
                let fault = self.faults.attempt_faults.remove(&alloc_id);
                let retry = job.failures <= job.spec.max_retries;
                match (retry, fault) {
                    (true, None) => (JobState::Pending, JobReason::new(ReasonCode::Retrying, "retrying after a failed attempt")),
                    (false, None) => (JobState::Failed, JobReason::new(ReasonCode::Failed, "a rank exited non-zero")),
                    (true, Some(fault)) => (JobState::Pending, JobReason::new(ReasonCode::Retrying, format!("retrying: {fault}"))),
                    (false, Some(fault)) => (JobState::Failed, JobReason::new(ReasonCode::Failed, fault)),
                }
            }
        };
        job.reason = next.1;
        note_change(&mut self.job_changes, job, index);
        if next.0 == JobState::Pending {
            move_job(&mut self.pending_jobs, job, JobState::Pending);
            job.estimated_start_ms = None;
        } else {
            self.finish_job(index, alloc.job_id, next.0);
        }
    }

    /// Move a job to a final state and keep the finished table bounded.
    fn finish_job(&mut self, index: u64, job_id: JobId, state: JobState) {
        assert!(state.is_final());
        let job = self.jobs.get_mut(&job_id).expect("finishing a known job");
        assert!(!job.state.is_final(), "job {job_id} finished twice");
        assert!(job.alloc.is_none(), "job {job_id} finished while holding GPUs");
        move_job(&mut self.pending_jobs, job, state);
        job.finished_at_ms = Some(self.now_ms);
        note_change(&mut self.job_changes, job, index);
        self.live_jobs -= 1;
        self.lost_after.remove(&job_id);
        self.finished.push_back(job_id);
        self.drop_finished_over_limit(index);
    }

    /// Drop the oldest finished jobs beyond `max_finished_jobs`: one at a
    /// job's end, more when the bound was lowered (`limits`).
    pub(super) fn drop_finished_over_limit(&mut self, index: u64) {
        while self.finished.len() > self.limits.max_finished_jobs {
            let oldest = self.finished.pop_front().expect("non-empty");
            let removed = self.jobs.remove(&oldest).expect("a finished job is held until dropped here");
            assert!(removed.state.is_final());
            assert!(!self.pending_jobs.contains_key(&oldest), "dropped job {oldest} is still queued");
            let unindexed = self.job_changes.remove(&(removed.changed_at_index, oldest));
            assert!(unindexed.is_some(), "a held job is in the change index");
            let bytes = removed.spec.payload_bytes() as u64;
            assert!(self.spec_bytes >= bytes, "spec bytes {} below a held job's {bytes}", self.spec_bytes);
            self.spec_bytes -= bytes;
            self.record_dropped(index, &removed);
            self.auth.job_marks.remove(&oldest);
            self.tenancy.job_tags.remove(&oldest);
            self.idle.job_idle_gpu_ms.remove(&oldest);
        }
    }

    /// An XID from a node's agent, acted on by the XID table. Unknown nodes
    /// and GPUs are NotFound: the agent registers before it reports.
    fn gpu_xid(&mut self, index: u64, name: &str, gpu: u32, xid: u32, at_ms: u64) -> Result<CommandResult, Rejection> {
        let node = self.nodes.get(name).ok_or(Rejection::NotFound { what: format!("node {name}") })?;
        let info = node.gpus.iter().find(|g| g.index == gpu).ok_or(Rejection::NotFound { what: format!("GPU {gpu} of node {name}") })?;
        let domain = info.nvlink_domain;
        let reason = format!("xid {xid} at {}", utc_text(at_ms));
        let fence = |kind| Fence { kind, reason: reason.clone(), since_ms: self.now_ms };
        match xid_action(xid) {
            XidAction::Ignore => {}
            XidAction::FailAttempt => {
                let fault = format!("xid {xid} on gpu {gpu} of node {name}");
                if let Some(&alloc_id) = self.gpu_owner.get(&(name.to_string(), gpu)) {
                    self.end_attempt_for_fault(index, alloc_id, fault);
                }
            }
            XidAction::FenceGpu => {
                let fence = fence(FenceKind::GpuReset);
                self.faults.fences.entry(name.to_string()).or_default().gpus.entry(gpu).or_insert(fence);
                self.end_attempts_on_fenced(index, name, &reason);
            }
            XidAction::FenceNode => {
                let fence = fence(FenceKind::Node);
                let fences = self.faults.fences.entry(name.to_string()).or_default();
                fences.node.get_or_insert(fence);
                self.end_attempts_on_fenced(index, name, &reason);
            }
            XidAction::FenceNvlinkDomain => {
                let fence = fence(FenceKind::NvlinkDomain);
                let fences = self.faults.fences.entry(name.to_string()).or_default();
                match domain {
                    Some(domain) => fences.nvlink_domains.entry(domain).or_insert(fence),
                    // A GPU without NVLink peers is a domain of its own.
                    None => fences.gpus.entry(gpu).or_insert(fence),
                };
                self.end_attempts_on_fenced(index, name, &reason);
            }
        }
        Ok(CommandResult::Done)
    }

    /// The agent reset the GPU and read it healthy: a reset fence is
    /// lifted. Fences an operator must lift stay.
    fn gpu_reset(&mut self, name: &str, gpu: u32) -> Result<CommandResult, Rejection> {
        if !self.nodes.contains_key(name) {
            return Err(Rejection::NotFound { what: format!("node {name}") });
        }
        if let Some(fences) = self.faults.fences.get_mut(name) {
            if fences.gpus.get(&gpu).is_some_and(|f| f.kind == FenceKind::GpuReset) {
                fences.gpus.remove(&gpu);
            }
            if fences.is_empty() {
                self.faults.fences.remove(name);
            }
        }
        Ok(CommandResult::Done)
    }

    /// An operator lifts every fence of a node, or those of one GPU (its
    /// own and its NVLink domain's).
    fn readmit(&mut self, name: &str, gpu: Option<u32>) -> Result<CommandResult, Rejection> {
        let node = self.nodes.get(name).ok_or(Rejection::NotFound { what: format!("node {name}") })?;
        let Some(gpu) = gpu else {
            self.faults.fences.remove(name);
            return Ok(CommandResult::Done);
        };
        let info = node.gpus.iter().find(|g| g.index == gpu).ok_or(Rejection::NotFound { what: format!("GPU {gpu} of node {name}") })?;
        let domain = info.nvlink_domain;
        if let Some(fences) = self.faults.fences.get_mut(name) {
            fences.gpus.remove(&gpu);
            if let Some(domain) = domain {
                fences.nvlink_domains.remove(&domain);
            }
            if fences.is_empty() {
                self.faults.fences.remove(name);
            }
        }
        Ok(CommandResult::Done)
    }

    fn fence_by_operator(&mut self, index: u64, name: &str, gpu: Option<u32>, reason: &str) -> Result<CommandResult, Rejection> {
        let node = self.nodes.get(name).ok_or(Rejection::NotFound { what: format!("node {name}") })?;
        if reason.is_empty() || reason.len() > MAX_FENCE_REASON_BYTES {
            return Err(Rejection::Invalid { field: "reason".into(), message: format!("1..={MAX_FENCE_REASON_BYTES} bytes") });
        }
        if let Some(gpu) = gpu {
            if !node.gpus.iter().any(|g| g.index == gpu) {
                return Err(Rejection::NotFound { what: format!("GPU {gpu} of node {name}") });
            }
        }
        let fence = Fence { kind: FenceKind::Operator, reason: reason.to_string(), since_ms: self.now_ms };
        let fences = self.faults.fences.entry(name.to_string()).or_default();
        match gpu {
            None => fences.node = Some(fence),
            Some(gpu) => {
                fences.gpus.insert(gpu, fence);
            }
        }
        self.end_attempts_on_fenced(index, name, reason);
        Ok(CommandResult::Done)
    }

    /// End every live attempt holding a fenced GPU of `name` (the whole
    /// gang, under its job's retry rule), naming the fault.
    fn end_attempts_on_fenced(&mut self, index: u64, name: &str, fault: &str) {
        let Some(node) = self.nodes.get(name) else { return };
        let fenced: BTreeSet<u32> = node.gpus.iter().filter(|g| self.faults.is_fenced(name, g)).map(|g| g.index).collect();
        let hit: BTreeSet<AllocId> = fenced.iter().filter_map(|&gpu| self.gpu_owner.get(&(name.to_string(), gpu)).copied()).collect();
        for alloc_id in hit {
            self.end_attempt_for_fault(index, alloc_id, format!("{fault}: capacity of node {name} fenced"));
        }
    }

    /// Fail one attempt for a GPU fault: its ranks are stopped and the job
    /// is retried (or failed) by its retry rule, with the fault as reason.
    /// An attempt already stopping keeps its reason.
    fn end_attempt_for_fault(&mut self, index: u64, alloc_id: AllocId, fault: String) {
        let live = self.allocs.get(&alloc_id).is_some_and(|a| a.stop.is_none());
        if live {
            self.faults.attempt_faults.insert(alloc_id, fault);
            self.request_stop(index, alloc_id, StopReason::Failed);
        }
    }

    fn checkpoint(&mut self, index: u64, alloc_id: AllocId, at_ms: u64) -> Result<CommandResult, Rejection> {
        let alloc = self.allocs.get(&alloc_id).ok_or(Rejection::NotFound { what: format!("allocation {alloc_id}") })?;
        let job = self.jobs.get_mut(&alloc.job_id).expect("allocation has a job");
        if job.checkpoint_at_ms.is_none_or(|previous| previous < at_ms) {
            job.checkpoint_at_ms = Some(at_ms);
            note_change(&mut self.job_changes, job, index);
        }
        Ok(CommandResult::Done)
    }

    pub(super) fn set_queue(&mut self, queue: &QueueConfig) -> Result<CommandResult, Rejection> {
        validate_queue(queue)?;
        self.check_no_alarm()?;
        if !self.queues.contains_key(&queue.name) && self.queues.len() >= self.limits.max_queues {
            return Err(Rejection::Exhausted { what: "queues".into(), limit: self.limits.max_queues as u64 });
        }
        self.queues.insert(queue.name.clone(), queue.clone());
        Ok(CommandResult::Done)
    }

    /// A queue and its idle rule (format 8 on).
    fn set_queue_idle(&mut self, queue: &QueueConfig, idle: super::idle::IdlePolicy) -> Result<CommandResult, Rejection> {
        use super::idle::{IDLE_FROM_VERSION, MAX_IDLE_AFTER_MS, MIN_IDLE_AFTER_MS};
        if self.cluster_version() < IDLE_FROM_VERSION {
            return Err(Rejection::Invalid { field: "idle".into(), message: format!("needs cluster version {IDLE_FROM_VERSION}") });
        }
        if !(MIN_IDLE_AFTER_MS..=MAX_IDLE_AFTER_MS).contains(&idle.idle_after_ms) {
            return Err(Rejection::Invalid {
                field: "queue.idle_after_ms".into(),
                message: format!("must be {MIN_IDLE_AFTER_MS}..={MAX_IDLE_AFTER_MS}, got {}", idle.idle_after_ms),
            });
        }
        self.set_queue(queue)?;
        self.idle.queue_policies.insert(queue.name.clone(), idle);
        Ok(CommandResult::Done)
    }

    pub(super) fn set_quota(&mut self, quota: &GroupQuota) -> Result<CommandResult, Rejection> {
        validate_quota(quota)?;
        self.check_no_alarm()?;
        if !self.quotas.contains_key(&quota.group) && self.quotas.len() >= self.limits.max_quotas {
            return Err(Rejection::Exhausted { what: "quotas".into(), limit: self.limits.max_quotas as u64 });
        }
        self.quotas.insert(quota.group.clone(), quota.clone());
        Ok(CommandResult::Done)
    }
}

/// Does this GPU satisfy the job's model and memory constraints? Model
/// names match by alias where `aliases` (`ClusterState::model_aliases`).
pub fn gpu_matches(spec: &JobSpec, gpu: &GpuInfo, aliases: bool) -> bool {
    let model_ok = spec.gpu_model.as_ref().is_none_or(|m| super::gpu_model::model_matches(m, &gpu.model, aliases));
    model_ok && gpu.memory_mib >= spec.min_gpu_memory_mib
}

/// Set `job`'s state, keeping the pending index (`ClusterState::pending_jobs`)
/// in step: every change of state goes through here.
fn move_job(pending: &mut SharedMap<JobId, ()>, job: &mut Job, next: JobState) {
    let was_pending = job.state == JobState::Pending;
    let now_pending = next == JobState::Pending;
    if was_pending && !now_pending {
        let removed = pending.remove(&job.id);
        assert!(removed.is_some(), "pending job {} was not in the pending index", job.id);
    }
    if now_pending && !was_pending {
        let held = pending.insert(job.id, ());
        assert!(held.is_none(), "job {} was in the pending index while {:?}", job.id, job.state);
    }
    job.state = next;
}

/// Move `job` to `index` in the change index (`ClusterState::job_changes`),
/// which must follow every change of `changed_at_index`.
fn note_change(changes: &mut SharedMap<(u64, JobId), ()>, job: &mut Job, index: u64) {
    let previous = changes.remove(&(job.changed_at_index, job.id));
    debug_assert!(previous.is_some(), "job {} was not in the change index", job.id);
    job.changed_at_index = index;
    changes.insert((index, job.id), ());
}
