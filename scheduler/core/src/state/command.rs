//! Every change of cluster state is a `Command` in the Raft log. A log entry
//! holds one `Proposal`: a batch of commands and the leader's wall-clock time,
//! so that apply itself never reads a clock.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::auth::{Actor, Role};
use super::idle::IdlePolicy;
use super::limits::{LimitsChange, LIMITS_FROM_VERSION};
use super::lost_after::{LostAfter, LOST_AFTER_FROM_VERSION};
use super::policy_doc::{CanaryScope, PolicyDocument};
use super::tenancy::{Month, TemplateRef};
use super::types::{
    AlarmKind, AllocId, ChangeKind, GpuInfo, GroupQuota, JobId, JobReason, JobSpec, Priority, QueueConfig, ReasonCode, StopReason,
};

/// The format of every entry whose commands existed in the first layout,
/// and of a cluster that has not raised its version yet (see `codec`).
pub const FIRST_FORMAT_VERSION: u16 = 1;

/// One Raft entry's payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proposal {
    /// Leader's clock when it proposed the batch (Unix ms). The state's clock
    /// only moves forward: a leader with a slower clock cannot move it back.
    pub now_ms: u64,
    pub commands: Vec<Command>,
}

impl Proposal {
    /// The oldest format that holds every command of the entry.
    pub fn min_format(&self) -> u16 {
        self.commands.iter().map(Command::min_format).max().unwrap_or(FIRST_FORMAT_VERSION)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    SubmitJob {
        request_id: Option<String>,
        spec: JobSpec,
    },
    CancelJob {
        job_id: JobId,
    },
    RegisterNode(NodeRegistration),
    /// GPU health changed (only changes are logged, never heartbeats).
    NodeHealth {
        node: String,
        unhealthy_gpus: Vec<u32>,
    },
    DrainNode {
        node: String,
        drain: bool,
    },
    /// Silent past its TTL: its allocations are ended and their jobs requeued.
    NodeDown {
        node: String,
    },
    ApplyPlan(Plan),
    AllocStarted {
        alloc_id: AllocId,
        rank: u32,
    },
    AllocExited {
        alloc_id: AllocId,
        rank: u32,
        exit_code: i32,
    },
    Checkpoint {
        alloc_id: AllocId,
        at_ms: u64,
    },
    SetQueue(QueueConfig),
    SetQuota(GroupQuota),
    /// The rank's agent stopped it because it lost the control plane for
    /// longer than the node TTL (its lease ran out): the rank ended with its
    /// node's contact, so the job is requeued (not failed) once the rest of
    /// the gang has stopped.
    AllocLost {
        alloc_id: AllocId,
        rank: u32,
    },
    /// Raise the format the cluster writes (format 2 on). Proposed by the
    /// leader only once every voter runs a build that reads `version`.
    SetClusterVersion {
        version: u16,
    },
    /// Raise (a replica found the condition) or clear (an operator) an
    /// alarm of one replica (format 3 on).
    SetAlarm {
        replica: u64,
        kind: AlarmKind,
        raised: bool,
    },
    /// The leader heard these nodes since its previous record (format 4 on).
    /// Coarse on purpose (a few per TTL): a new leader grants a node at most
    /// the TTL from its last record, so leaders that change more often than
    /// the TTL still find a dead node down.
    NodesHeard {
        nodes: Vec<String>,
    },
    /// A command a person or portal sent (format 5 on): apply checks it
    /// against the actor's role (`AuthState::permits`), applies it as the
    /// actor, and records both in the audit trail.
    Audited {
        actor: Actor,
        command: Box<Command>,
    },
    /// A submit with secrets marked (format 5 on, inside `Audited`): the
    /// named environment values, and the command if `secret_command`, are
    /// shown to the job's owner, its group's admins and operators only.
    SubmitMarked {
        request_id: Option<String>,
        spec: JobSpec,
        secret_env: BTreeSet<String>,
        secret_command: bool,
    },
    /// Add a user or change its role, groups and impersonation right
    /// (format 5 on, inside `Audited`).
    SetUser {
        name: String,
        role: Role,
        groups: BTreeSet<String>,
        impersonate: bool,
    },
    /// Remove a user and revoke its tokens (format 5 on, inside `Audited`).
    RemoveUser {
        name: String,
    },
    /// Keep the hash of a new bearer token (format 5 on, inside `Audited`);
    /// the token itself was made by the replica that took the request and
    /// went back to its caller only.
    CreateToken {
        id: String,
        user: String,
        hash: Vec<u8>,
        expires_ms: u64,
    },
    RevokeToken {
        id: String,
    },
    /// Make `name` the first admin of a cluster with no users (format 5
    /// on): proposed by the leader from `--bootstrap-admin`; a no-op once
    /// any user exists.
    BootstrapAdmin {
        name: String,
    },
    /// A state change outside the log (membership, drills) recorded in the
    /// audit trail (format 5 on, inside `Audited`; the check was made by
    /// the replica that did it).
    Note {
        what: String,
        outcome: String,
    },
    /// A node's agent saw an XID error on one of its GPUs at `at_ms` (its
    /// clock, for people) (format 6 on). Apply acts by the XID table
    /// (`xid::xid_action`).
    GpuXid {
        node: String,
        gpu: u32,
        xid: u32,
        at_ms: u64,
    },
    /// The node's agent saw the GPU reset and read it healthy since (format
    /// 6 on): its reset fence is lifted.
    GpuReset {
        node: String,
        gpu: u32,
    },
    /// Lift the fences of a node (`gpu: None`) or of one GPU and its NVLink
    /// domain (format 6 on, inside `Audited`, operators).
    ReadmitNode {
        node: String,
        gpu: Option<u32>,
    },
    /// Fence a node or one GPU by hand (format 6 on, inside `Audited`,
    /// operators): its attempts end and nothing is placed there until it is
    /// readmitted.
    FenceNode {
        node: String,
        gpu: Option<u32>,
        reason: String,
    },
    /// A submit with labels, or made from a template (format 7 on, inside
    /// `Audited`). `spec` is the whole spec (a template is expanded by the
    /// replica that took the request); apply checks that `template` still
    /// holds that version and that the job's group may use it.
    SubmitTagged {
        request_id: Option<String>,
        spec: JobSpec,
        secret_env: BTreeSet<String>,
        secret_command: bool,
        labels: BTreeMap<String, String>,
        template: Option<TemplateRef>,
    },
    /// Save a new version of a template of `group` (format 7 on, inside
    /// `Audited`, members of the group).
    SaveTemplate {
        name: String,
        group: String,
        spec: JobSpec,
        labels: BTreeMap<String, String>,
    },
    /// Delete a template with every version (format 7 on, inside `Audited`,
    /// members of its group).
    DeleteTemplate {
        name: String,
    },
    /// Let jobs of `group` use a template, or stop them (format 7 on,
    /// inside `Audited`, the owner group's admins and operators).
    GrantTemplate {
        name: String,
        group: String,
        granted: bool,
    },
    /// Set (`gpu_ms: Some`) or remove a group's GPU budget of a month
    /// (format 7 on, inside `Audited`, operators).
    SetBudget {
        group: String,
        month: Month,
        gpu_ms: Option<u64>,
        strict: bool,
    },
    /// A command with the request id of the client action that caused it
    /// (format 7 on, outermost), so that its apply on every replica can
    /// be found in the logs by that id. Applied as the command it holds.
    Traced {
        request_id: String,
        command: Box<Command>,
    },
    /// Make a kind of change need a second person's approval, or stop
    /// (format 8 on, inside `Audited`, operators; stopping is itself a
    /// change of that kind and needs approval while the rule holds).
    RequireApproval {
        kind: ChangeKind,
        required: bool,
        expire_after_ms: u64,
    },
    /// Approve a pending change: it is applied now, as asked for (format 8
    /// on, inside `Audited`; by another person who may make the change).
    ApproveChange {
        id: u64,
    },
    /// Withdraw a pending change (format 8 on, inside `Audited`; its
    /// requester or an operator).
    WithdrawChange {
        id: u64,
    },
    /// A rank turned idle (`idle_for_ms: Some`: every GPU of it under the
    /// agent's utilization threshold for that long, at least the agent's
    /// window) or busy (format 8 on). Proposed by the leader from
    /// heartbeats, only on a change of the committed record; apply makes
    /// the duration a committed time and keeps the first one (see `idle`).
    AllocIdle {
        alloc_id: AllocId,
        rank: u32,
        idle_for_ms: Option<u64>,
    },
    /// The policy found these allocations idle past their queue's time
    /// (format 8 on); apply checks again and flags those still idle.
    IdleFlagged {
        alloc_ids: Vec<AllocId>,
    },
    /// `SetQueue` with the queue's idle rule (format 8 on, inside
    /// `Audited`, operators).
    SetQueueIdle {
        queue: QueueConfig,
        idle: IdlePolicy,
    },
    /// Apply a policy document as the next version (format 9 on, inside
    /// `Audited`, admins; a `policy` change for two-person approval): for
    /// every job, or staged as a canary for the jobs of one queue or group
    /// (see `policy_doc`).
    ApplyPolicy {
        document: PolicyDocument,
        comment: String,
        canary: Option<CanaryScope>,
    },
    /// Make the staged document active for every job (format 9 on, inside
    /// `Audited`, admins).
    PromotePolicy,
    /// Drop the staged document, or (none staged) return to an earlier
    /// version: `to`, else the newest older version that was active, else
    /// the defaults (format 9 on, inside `Audited`, admins).
    RollbackPolicy {
        to: Option<u64>,
    },
    /// A person's change with the request id its client sent (format 10
    /// on, outermost, in place of `Traced`): applied once per sender and
    /// id, a repeat getting the first outcome back (see `outcomes`).
    Once {
        request_id: String,
        command: Box<Command>,
    },
    /// Change the priority of a job not yet finished (format 10 on, inside
    /// `Audited`): its owner may lower it, its group's admins and the
    /// operators may set any.
    SetJobPriority {
        job_id: JobId,
        priority: Priority,
    },
    /// A submit of a single-node job that outlives its node's silence for
    /// `lost_after` (format 11 on, around the submit, inside `Audited`
    /// when that is there): applied as the submit, then the job keeps its
    /// bound (see `lost_after`).
    WithLostAfter {
        lost_after: LostAfter,
        command: Box<Command>,
    },
    /// A rank ended by its node, not by itself, for `reason` (format 11
    /// on): `AllocLost` with the cause kept, e.g. an agent whose disk is
    /// full. The job is requeued once the rest of the gang has stopped.
    AllocLostFor {
        alloc_id: AllocId,
        rank: u32,
        reason: StopReason,
    },
    /// Change the bounds of the replicated tables (format 13 on, inside
    /// `Audited`, admins; see `limits`).
    SetLimits(LimitsChange),
}

/// The first format with `Command::Traced`.
pub const TRACED_FROM_VERSION: u16 = 7;
/// The first cluster version whose replicas keep request outcomes and
/// apply `Command::Once` (see `outcomes`) and `Command::SetJobPriority`.
pub const OUTCOMES_FROM_VERSION: u16 = 10;
/// The first cluster version whose replicas keep pending changes and apply
/// the commands that need and give approval (see `approvals`).
pub const APPROVALS_FROM_VERSION: u16 = 8;

impl Command {
    /// The oldest encoding format that has this command.
    ///
    /// Never inlined: one incremental release build compiled a caller that
    /// had this match inlined so that `GpuReset`'s 6 compared unequal to 6
    /// (`fault_commands_need_format_6_and_round_trip_in_the_snapshot`
    /// failed with `left: 6, right: 6`). It did not come back in a fresh
    /// build, and the cause was not found; the cluster-version check must
    /// not depend on it, so the function keeps one body.
    #[inline(never)]
    pub fn min_format(&self) -> u16 {
        match self {
            // A wrapper is as new as what it holds: an older replica must
            // refuse the entry (TooNew), never misread it.
            Command::Audited { command, .. } => command.min_format().max(5),
            Command::Traced { command, .. } => command.min_format().max(TRACED_FROM_VERSION),
            Command::Once { command, .. } => command.min_format().max(OUTCOMES_FROM_VERSION),
            Command::WithLostAfter { command, .. } => command.min_format().max(LOST_AFTER_FROM_VERSION),
            Command::ApplyPlan(plan) => plan.min_format(),
            other => other.own_format(),
        }
    }

    /// The format that introduced this command's own variant. Every variant
    /// is named, with no catch-all arm: a release build of one match with a
    /// catch-all, wrappers and this together returned 5 for `CancelJob`
    /// (its debug build returned 1); split and exhaustive, both agree
    /// (`codec::tests` and the fixtures check every variant).
    #[inline(never)]
    fn own_format(&self) -> u16 {
        match self {
            Command::SetClusterVersion { .. } => 2,
            Command::SetAlarm { .. } => 3,
            Command::NodesHeard { .. } => 4,
            Command::SubmitMarked { .. }
            | Command::SetUser { .. }
            | Command::RemoveUser { .. }
            | Command::CreateToken { .. }
            | Command::RevokeToken { .. }
            | Command::BootstrapAdmin { .. }
            | Command::Note { .. }
            | Command::Audited { .. } => 5,
            Command::GpuXid { .. } | Command::GpuReset { .. } | Command::ReadmitNode { .. } | Command::FenceNode { .. } => {
                super::faults::FAULTS_FROM_VERSION
            }
            Command::SubmitTagged { .. }
            | Command::SaveTemplate { .. }
            | Command::DeleteTemplate { .. }
            | Command::GrantTemplate { .. }
            | Command::SetBudget { .. }
            | Command::Traced { .. } => super::tenancy::TENANCY_FROM_VERSION,
            Command::AllocIdle { .. } | Command::IdleFlagged { .. } | Command::SetQueueIdle { .. } => super::idle::IDLE_FROM_VERSION,
            Command::RequireApproval { .. } | Command::ApproveChange { .. } | Command::WithdrawChange { .. } => APPROVALS_FROM_VERSION,
            Command::ApplyPolicy { .. } | Command::PromotePolicy | Command::RollbackPolicy { .. } => {
                super::policy_doc::POLICY_DOC_FROM_VERSION
            }
            Command::Once { .. } | Command::SetJobPriority { .. } => OUTCOMES_FROM_VERSION,
            Command::WithLostAfter { .. } | Command::AllocLostFor { .. } => LOST_AFTER_FROM_VERSION,
            Command::SetLimits(_) => LIMITS_FROM_VERSION,
            Command::SubmitJob { .. }
            | Command::CancelJob { .. }
            | Command::RegisterNode(_)
            | Command::NodeHealth { .. }
            | Command::DrainNode { .. }
            | Command::NodeDown { .. }
            | Command::ApplyPlan(_)
            | Command::AllocStarted { .. }
            | Command::AllocExited { .. }
            | Command::Checkpoint { .. }
            | Command::SetQueue(_)
            | Command::SetQuota(_)
            | Command::AllocLost { .. } => FIRST_FORMAT_VERSION,
        }
    }

    /// The command itself, without the request id and sender it may carry.
    pub fn unwrapped(&self) -> &Command {
        match self {
            Command::Traced { command, .. }
            | Command::Audited { command, .. }
            | Command::Once { command, .. }
            | Command::WithLostAfter { command, .. } => command.unwrapped(),
            other => other,
        }
    }

    /// The spec of a submit (any of its kinds); `None` for other commands.
    pub fn submitted_spec(&self) -> Option<&JobSpec> {
        match self {
            Command::SubmitJob { spec, .. } | Command::SubmitMarked { spec, .. } | Command::SubmitTagged { spec, .. } => Some(spec),
            _ => None,
        }
    }

    /// Is this a change a person makes whose repeat under one request id
    /// must not apply twice (see `outcomes`)? Submits have their own table;
    /// what agents and the leader send is not sent under a person's id.
    pub fn settles_by_request_id(&self) -> bool {
        matches!(
            self.unwrapped(),
            Command::CancelJob { .. }
                | Command::SetJobPriority { .. }
                | Command::DrainNode { .. }
                | Command::SetQueue(_)
                | Command::SetQuota(_)
                | Command::SetAlarm { .. }
                | Command::SetUser { .. }
                | Command::RemoveUser { .. }
                | Command::CreateToken { .. }
                | Command::RevokeToken { .. }
                | Command::ReadmitNode { .. }
                | Command::FenceNode { .. }
                | Command::SaveTemplate { .. }
                | Command::DeleteTemplate { .. }
                | Command::GrantTemplate { .. }
                | Command::SetBudget { .. }
                | Command::RequireApproval { .. }
                | Command::ApproveChange { .. }
                | Command::WithdrawChange { .. }
                | Command::SetQueueIdle { .. }
                | Command::ApplyPolicy { .. }
                | Command::PromotePolicy
                | Command::RollbackPolicy { .. }
                | Command::SetLimits(_)
        )
    }
}

impl Command {
    /// What the audit trail says of a command: its kind and the names it
    /// touches, never a job's command, its environment or a token.
    pub fn audit_summary(&self) -> String {
        let submit = |spec: &JobSpec| {
            format!(
                "submit {:?} to group {} queue {} ({} x {} GPUs)",
                spec.name, spec.group, spec.queue, spec.replicas, spec.gpus_per_replica
            )
        };
        match self {
            Command::SubmitJob { spec, .. } | Command::SubmitMarked { spec, .. } => submit(spec),
            Command::SubmitTagged { spec, template: Some(template), .. } => {
                format!("{} from template {} version {}", submit(spec), template.name, template.version)
            }
            Command::SubmitTagged { spec, .. } => submit(spec),
            Command::SaveTemplate { name, group, .. } => format!("save template {name} of group {group}"),
            Command::DeleteTemplate { name } => format!("delete template {name}"),
            Command::GrantTemplate { name, group, granted: true } => format!("grant template {name} to group {group}"),
            Command::GrantTemplate { name, group, granted: false } => format!("revoke template {name} from group {group}"),
            Command::SetBudget { group, month, gpu_ms: Some(gpu_ms), strict } => format!(
                "set budget of group {group} for {} to {} GPU-hours{}",
                super::tenancy::month_text(*month),
                super::tenancy::gpu_hours(*gpu_ms),
                if *strict { " (strict)" } else { "" }
            ),
            Command::SetBudget { group, month, gpu_ms: None, .. } => {
                format!("remove budget of group {group} for {}", super::tenancy::month_text(*month))
            }
            Command::CancelJob { job_id } => format!("cancel job {job_id}"),
            Command::SetJobPriority { job_id, priority } => format!("set priority of job {job_id} to {}", priority.as_str()),
            Command::DrainNode { node, drain } => format!("{} node {node}", if *drain { "drain" } else { "undrain" }),
            Command::SetQueue(queue) => format!("set queue {}", queue.name),
            Command::SetQueueIdle { queue, idle } => {
                format!("set queue {} (idle after {} ms: {})", queue.name, idle.idle_after_ms, idle.action.as_str())
            }
            Command::SetQuota(quota) => format!("set quota of group {}", quota.group),
            Command::SetAlarm { replica, kind, raised } => {
                format!("{} alarm {} of replica {replica}", if *raised { "raise" } else { "disarm" }, kind.as_str())
            }
            Command::SetUser { name, role, groups, impersonate } => {
                let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
                format!("set user {name} role {} groups [{}] impersonate {impersonate}", role.as_str(), groups.join(","))
            }
            Command::RemoveUser { name } => format!("remove user {name}"),
            Command::CreateToken { id, user, expires_ms, .. } => format!("create token {id} for {user}, expiring at {expires_ms} ms"),
            Command::RevokeToken { id } => format!("revoke token {id}"),
            Command::BootstrapAdmin { name } => format!("bootstrap admin {name}"),
            Command::Note { what, .. } => what.clone(),
            Command::ReadmitNode { node, gpu: None } => format!("readmit node {node}"),
            Command::ReadmitNode { node, gpu: Some(gpu) } => format!("readmit GPU {gpu} of node {node}"),
            Command::FenceNode { node, gpu: None, reason } => format!("fence node {node}: {reason}"),
            Command::FenceNode { node, gpu: Some(gpu), reason } => format!("fence GPU {gpu} of node {node}: {reason}"),
            Command::RequireApproval { kind, required: true, expire_after_ms } => {
                format!("require approval of {} changes (a request waits {expire_after_ms} ms)", kind.as_str())
            }
            Command::RequireApproval { kind, required: false, .. } => format!("stop requiring approval of {} changes", kind.as_str()),
            Command::ApproveChange { id } => format!("approve change {id}"),
            Command::WithdrawChange { id } => format!("withdraw change {id}"),
            Command::ApplyPolicy { comment, canary: None, .. } => format!("apply a policy document ({comment:?})"),
            Command::ApplyPolicy { comment, canary: Some(scope), .. } => {
                format!("stage a policy document as a canary for {} ({comment:?})", scope.describe())
            }
            Command::PromotePolicy => "promote the staged policy document".into(),
            Command::SetLimits(change) => change.summary(),
            Command::RollbackPolicy { to: Some(version) } => format!("roll the policy back to version {version}"),
            Command::RollbackPolicy { to: None } => "roll the policy back".into(),
            Command::Audited { command, .. } | Command::Traced { command, .. } | Command::Once { command, .. } => command.audit_summary(),
            Command::WithLostAfter { lost_after, command } => format!("{} (lost after {})", command.audit_summary(), lost_after.text()),
            other => format!("{:?}", std::mem::discriminant(other)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRegistration {
    pub name: String,
    pub address: String,
    pub rack: String,
    pub leaf: String,
    pub gpus: Vec<GpuInfo>,
}

/// The leader's decisions from one pass over a state, proposed as one command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Plan {
    /// Applied index of the state the plan was computed from.
    pub computed_at_index: u64,
    pub placements: Vec<Placement>,
    pub stops: Vec<Stop>,
    /// Reasons and estimates for jobs left pending.
    pub pending: Vec<PendingNote>,
}

impl Plan {
    /// The oldest format that has every stop reason and pending reason of
    /// the plan.
    pub fn min_format(&self) -> u16 {
        // A stop or reason naming an agent's full disk exists from format 11 on.
        let disk_full = self.stops.iter().any(|s| s.reason == StopReason::AgentDiskFull)
            || self.pending.iter().any(|n| n.reason.code == ReasonCode::AgentDiskFull);
        if disk_full {
            return LOST_AFTER_FROM_VERSION;
        }
        // A stop of a rank that never started exists from format 10 on.
        if self.stops.iter().any(|s| s.reason == StopReason::NeverStarted) {
            return OUTCOMES_FROM_VERSION;
        }
        // A stop that reclaims idle GPUs exists from format 8 on.
        if self.stops.iter().any(|s| s.reason == StopReason::IdleReclaimed) {
            return super::idle::IDLE_FROM_VERSION;
        }
        // A pending reason that names a spent budget exists from format 7 on.
        if self.pending.iter().any(|n| n.reason.code == ReasonCode::BudgetExhausted) {
            return super::tenancy::TENANCY_FROM_VERSION;
        }
        // A pending reason that names fenced capacity exists from format 6 on.
        if self.pending.iter().any(|n| n.reason.code == ReasonCode::Fenced) {
            return super::faults::FAULTS_FROM_VERSION;
        }
        FIRST_FORMAT_VERSION
    }

    pub fn is_empty(&self) -> bool {
        self.placements.is_empty() && self.stops.is_empty() && self.pending.is_empty()
    }
}

/// A whole gang on concrete GPUs: rank i runs on `ranks[i]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub job_id: JobId,
    pub ranks: Vec<RankPlacement>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlacement {
    pub node: String,
    pub gpus: Vec<u32>,
}

/// Stop a running allocation (preemption, runtime limit).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stop {
    pub alloc_id: AllocId,
    pub reason: StopReason,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingNote {
    pub job_id: JobId,
    pub reason: JobReason,
    pub estimated_start_ms: Option<u64>,
}

/// What applying one command produced, returned to its proposer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandResult {
    Submitted {
        job_id: JobId,
        deduplicated: bool,
    },
    Cancelled {
        job_id: JobId,
        state: super::types::JobState,
    },
    PlanApplied {
        placed: u32,
        rejected: u32,
        stopped: u32,
    },
    Done,
    /// A template version was saved (format 7 on).
    TemplateSaved {
        version: u32,
    },
    Rejected(Rejection),
    /// The change needs a second person: it was kept as pending change
    /// `change_id`, applied only once approved before `expires_ms` (format
    /// 8 on).
    AwaitingApproval {
        change_id: u64,
        expires_ms: u64,
    },
}

/// Why a command changed nothing. Deterministic: every replica reaches the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rejection {
    /// The command's input is invalid; `field` names the offending field.
    Invalid {
        field: String,
        message: String,
    },
    NotFound {
        what: String,
    },
    /// A bounded table is full.
    Exhausted {
        what: String,
        limit: u64,
    },
    /// request_id was used before with a different spec.
    RequestIdReused {
        request_id: String,
        job_id: JobId,
    },
    /// The command no longer applies to the current state.
    Conflict {
        message: String,
    },
    /// New work is refused while a replica's alarm is raised.
    Alarmed {
        message: String,
    },
    /// The actor's role does not allow the command (format 5 on).
    PermissionDenied {
        message: String,
    },
    /// The group's GPU budget of the month is spent, or a strict budget
    /// cannot hold the job's worst case (format 7 on).
    BudgetExhausted {
        message: String,
    },
}

impl Rejection {
    /// A stable code for programs (the API sends it beside the message).
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::Invalid { .. } => "invalid",
            Rejection::NotFound { .. } => "not_found",
            Rejection::Exhausted { .. } => "exhausted",
            Rejection::RequestIdReused { .. } => "request_id_reused",
            Rejection::Conflict { .. } => "conflict",
            Rejection::Alarmed { .. } => "alarm",
            Rejection::PermissionDenied { .. } => "permission_denied",
            Rejection::BudgetExhausted { .. } => "budget_exhausted",
        }
    }

    /// The request field at fault, where there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Rejection::Invalid { field, .. } => Some(field),
            Rejection::RequestIdReused { .. } => Some("request_id"),
            _ => None,
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::Invalid { field, message } => write!(f, "{field}: {message}"),
            Rejection::NotFound { what } => write!(f, "{what} not found"),
            Rejection::Exhausted { what, limit } => write!(f, "{what} is full (limit {limit})"),
            Rejection::RequestIdReused { request_id, job_id } => {
                write!(f, "request_id {request_id:?} was used for job {job_id} with a different spec")
            }
            Rejection::Conflict { message }
            | Rejection::Alarmed { message }
            | Rejection::PermissionDenied { message }
            | Rejection::BudgetExhausted { message } => {
                write!(f, "{message}")
            }
        }
    }
}
