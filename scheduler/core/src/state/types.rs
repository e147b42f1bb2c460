//! The data the replicated state is made of. Plain data: no behaviour beyond
//! small accessors, so the policy, the server and the simulator share it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use super::env_vars::EnvVars;
pub use super::request_id::RequestId;

pub type JobId = u64;
pub type AllocId = u64;

/// Priority inside a group. Ordered: `High > Medium > Low`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub enum Priority {
    Low,
    #[default]
    Medium,
    High,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Medium => "medium",
            Priority::High => "high",
        }
    }

    pub fn parse(text: &str) -> Option<Priority> {
        match text {
            "low" => Some(Priority::Low),
            "medium" => Some(Priority::Medium),
            "high" => Some(Priority::High),
            _ => None,
        }
    }
}

/// What a user asked for. Validated before it enters the log (see `validate`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub name: String,
    pub group: String,
    pub queue: String,
    pub priority: Priority,
    /// Ranks of the gang; all are placed together or none is.
    pub replicas: u32,
    pub gpus_per_replica: u32,
    /// Required GPU model; `None` = any. Boxed: 8 bytes less in every job,
    /// which with the other boxed fields fits a job in a 384-byte block.
    pub gpu_model: Option<Box<str>>,
    /// Minimum memory per GPU; 0 = any.
    pub min_gpu_memory_mib: u64,
    pub command: Vec<String>,
    pub env: EnvVars,
    /// 0 = the queue's default.
    pub runtime_limit_s: u64,
    pub grace_period_s: u64,
    pub max_retries: u32,
    /// 0 = never. Once the job has waited this long since submit, a `High`
    /// priority falls back to `Medium` (the policy reads it; apply does not).
    pub priority_ttl_s: u64,
}

impl JobSpec {
    pub fn total_gpus(&self) -> u64 {
        u64::from(self.replicas) * u64::from(self.gpus_per_replica)
    }

    /// Bytes of the spec's variable-length parts (names, command, environment):
    /// what a job costs in the log, in every replica's memory and on the wire.
    pub fn payload_bytes(&self) -> usize {
        let names = self.name.len() + self.group.len() + self.queue.len() + self.gpu_model.as_ref().map_or(0, |model| model.len());
        let command: usize = self.command.iter().map(String::len).sum();
        let env: usize = self.env.iter().map(|(name, value)| name.len() + value.len()).sum();
        names + command + env
    }

    /// A spec with the defaults a user of the CLI gets: one rank, one GPU.
    pub fn simple(command: &[&str]) -> JobSpec {
        JobSpec {
            name: String::new(),
            group: "default".into(),
            queue: "training".into(),
            priority: Priority::Medium,
            replicas: 1,
            gpus_per_replica: 1,
            gpu_model: None,
            min_gpu_memory_mib: 0,
            command: command.iter().map(|s| s.to_string()).collect(),
            env: EnvVars::new(),
            runtime_limit_s: 0,
            grace_period_s: 60,
            max_retries: 0,
            priority_ttl_s: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum JobState {
    Pending,
    Running,
    /// Cancel or preemption decided; waiting for the ranks to exit.
    Stopping,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Stopping => "stopping",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(text: &str) -> Option<JobState> {
        [JobState::Pending, JobState::Running, JobState::Stopping, JobState::Succeeded, JobState::Failed, JobState::Cancelled]
            .into_iter()
            .find(|s| s.as_str() == text)
    }
}

/// Why a job is stopping or stopped; reported by agents, decided by the leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StopReason {
    Cancelled,
    Preempted,
    RuntimeLimit,
    NodeLost,
    /// A rank exited non-zero; the rest of the gang is stopped.
    Failed,
    /// A GPU of the allocation is no longer on its node (the node registered
    /// again with a different set of GPUs).
    GpuLost,
    /// Its GPUs stayed idle past its queue's idle time under the `reclaim`
    /// action (format 8 on): the job ends, not retried (see `idle`).
    IdleReclaimed,
    /// A rank was assigned and not started within the leader's start
    /// timeout (format 10 on; `node_lost` before): the job is requeued.
    NeverStarted,
    /// Its node's agent could not write the rank's files (disk full or
    /// read-only; format 11 on, `node_lost` before): the job is requeued.
    AgentDiskFull,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Cancelled => "cancelled",
            StopReason::Preempted => "preempted",
            StopReason::RuntimeLimit => "runtime_limit",
            StopReason::NodeLost => "node_lost",
            StopReason::GpuLost => "gpu_lost",
            StopReason::Failed => "failed",
            StopReason::IdleReclaimed => "idle_reclaimed",
            StopReason::NeverStarted => "never_started",
            StopReason::AgentDiskFull => "agent_disk_full",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    /// Shared with the dedupe table's key and eviction order.
    pub request_id: Option<RequestId>,
    pub state: JobState,
    /// Original submit time; kept across preemption so a requeued job keeps its place.
    pub submitted_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// Starts so far (first start, retries and restarts after preemption).
    pub attempts: u32,
    /// Failed attempts so far (counted against `max_retries`).
    pub failures: u32,
    /// Current allocation while running or stopping.
    pub alloc: Option<AllocId>,
    /// Why the job is in its state (pending reason, failure cause).
    pub reason: JobReason,
    pub estimated_start_ms: Option<u64>,
    pub stop_reason: Option<StopReason>,
    pub exit_code: Option<i32>,
    /// Last checkpoint the job reported (ROTA_CHECKPOINT_FILE mtime).
    pub checkpoint_at_ms: Option<u64>,
    /// Log index of the last change to this job (for watches).
    pub changed_at_index: u64,
    /// Node of each rank of the latest attempt; kept after the attempt ends
    /// so its logs can still be found. Boxed: set whole, never grown.
    pub last_nodes: Box<[String]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankState {
    Assigned,
    Running,
    Exited,
}

impl RankState {
    pub fn as_str(self) -> &'static str {
        match self {
            RankState::Assigned => "assigned",
            RankState::Running => "running",
            RankState::Exited => "exited",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rank {
    pub rank: u32,
    pub node: String,
    pub gpus: Vec<u32>,
    pub state: RankState,
    pub exit_code: Option<i32>,
}

/// One attempt of a job on concrete GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub id: AllocId,
    pub job_id: JobId,
    pub attempt: u32,
    pub ranks: Vec<Rank>,
    pub master_port: u16,
    pub created_at_ms: u64,
    /// Set when the leader decided to stop it; agents SIGTERM, wait grace, SIGKILL.
    pub stop: Option<StopReason>,
}

impl Allocation {
    pub fn gpu_count(&self) -> u64 {
        self.ranks.iter().map(|r| r.gpus.len() as u64).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub healthy: bool,
    /// GPUs with the same domain share NVLink; `None` = PCIe only.
    pub nvlink_domain: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    Ready,
    Draining,
    Down,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Ready => "ready",
            NodeState::Draining => "draining",
            NodeState::Down => "down",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub address: String,
    pub rack: String,
    pub leaf: String,
    pub gpus: Vec<GpuInfo>,
    pub state: NodeState,
    pub registered_at_ms: u64,
}

/// A queue's rules. `short`, `training` and `service` exist by default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueConfig {
    pub name: String,
    /// Share of the cluster's attention relative to other queues.
    pub weight: u32,
    /// Largest job (total GPUs) the queue accepts; 0 = no cap.
    pub max_gpus_per_job: u32,
    /// Runtime given to jobs that ask for none.
    pub default_runtime_s: u64,
    /// Longest runtime a job may ask for.
    pub max_runtime_s: u64,
    /// Jobs of this queue can be preempted.
    pub preemptible: bool,
    /// A job younger than this is never preempted.
    pub protected_runtime_s: u64,
}

impl QueueConfig {
    pub fn defaults() -> Vec<QueueConfig> {
        const HOUR_S: u64 = 3600;
        vec![
            QueueConfig {
                name: "short".into(),
                weight: 4,
                max_gpus_per_job: 16,
                default_runtime_s: 40 * 60,
                max_runtime_s: 40 * 60,
                preemptible: true,
                protected_runtime_s: 2 * HOUR_S,
            },
            QueueConfig {
                name: "training".into(),
                weight: 2,
                max_gpus_per_job: 0,
                default_runtime_s: 24 * HOUR_S,
                max_runtime_s: 28 * 24 * HOUR_S,
                preemptible: true,
                protected_runtime_s: 2 * HOUR_S,
            },
            QueueConfig {
                name: "service".into(),
                weight: 1,
                max_gpus_per_job: 0,
                default_runtime_s: 365 * 24 * HOUR_S,
                max_runtime_s: 365 * 24 * HOUR_S,
                preemptible: false,
                protected_runtime_s: 0,
            },
        ]
    }
}

/// A group's guaranteed share and lending rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GroupQuota {
    pub group: String,
    /// Guaranteed GPUs (any model).
    pub gpus: u32,
    /// Guaranteed GPUs of a given model, inside `gpus`.
    pub per_model: BTreeMap<String, u32>,
    /// Lends idle guaranteed GPUs to other groups.
    pub lend: bool,
    /// When non-empty, lends only to these groups.
    pub lend_to: Vec<String>,
    /// Most GPUs this group may borrow beyond its quota; `None` = no limit.
    pub borrow_limit: Option<u32>,
}

/// The stable, machine-readable part of a job's reason. Programs match on
/// it (the API carries it in `reason_code`); people read `JobReason::detail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub enum ReasonCode {
    /// No reason to give (a running job).
    #[default]
    Unset,
    /// Submitted, not yet considered by a scheduling pass.
    New,
    // Why a job is pending (set by the policy).
    NoMatchingGpus,
    GangTooLarge,
    QuotaExhausted,
    BorrowLimit,
    InsufficientGpus,
    Reserved,
    BehindReservation,
    BehindJob,
    Preempting,
    NoFreeGpus,
    // How an attempt ended (set by apply).
    Completed,
    Cancelled,
    RuntimeLimit,
    Preempted,
    NodeLost,
    GpuLost,
    Retrying,
    Failed,
    /// Pending: the capacity it needs is fenced (format 6 on).
    Fenced,
    /// Pending: its group's GPU budget of the month is spent (format 7 on).
    BudgetExhausted,
    /// Ended: its GPUs stayed idle past its queue's idle time (format 8 on).
    IdleReclaimed,
    /// Requeued: a rank was assigned and not started in time (format 10 on).
    NeverStarted,
    /// Requeued: its node's agent could not write the rank's files (format 11 on).
    AgentDiskFull,
}

impl ReasonCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonCode::Unset => "",
            ReasonCode::New => "new",
            ReasonCode::NoMatchingGpus => "no_matching_gpus",
            ReasonCode::GangTooLarge => "gang_too_large",
            ReasonCode::QuotaExhausted => "quota_exhausted",
            ReasonCode::BorrowLimit => "borrow_limit",
            ReasonCode::InsufficientGpus => "insufficient_gpus",
            ReasonCode::Reserved => "reserved",
            ReasonCode::BehindReservation => "behind_reservation",
            ReasonCode::BehindJob => "behind_job",
            ReasonCode::Preempting => "preempting",
            ReasonCode::NoFreeGpus => "no_free_gpus",
            ReasonCode::Completed => "completed",
            ReasonCode::Cancelled => "cancelled",
            ReasonCode::RuntimeLimit => "runtime_limit",
            ReasonCode::Preempted => "preempted",
            ReasonCode::NodeLost => "node_lost",
            ReasonCode::GpuLost => "gpu_lost",
            ReasonCode::Retrying => "retrying",
            ReasonCode::Failed => "failed",
            ReasonCode::Fenced => "fenced",
            ReasonCode::BudgetExhausted => "budget_exhausted",
            ReasonCode::IdleReclaimed => "idle_reclaimed",
            ReasonCode::NeverStarted => "never_started",
            ReasonCode::AgentDiskFull => "agent_disk_full",
        }
    }
}

/// Why a job is in its state: a code for programs and a detail for people.
/// Shown as `code: detail` (or the bare code when there is no detail).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct JobReason {
    pub code: ReasonCode,
    /// Boxed: 8 bytes less in every job, which then fits a smaller block.
    pub detail: Box<str>,
}

impl JobReason {
    pub fn new(code: ReasonCode, detail: impl Into<Box<str>>) -> JobReason {
        JobReason { code, detail: detail.into() }
    }

    /// The bare code, no detail.
    pub fn code(code: ReasonCode) -> JobReason {
        JobReason { code, detail: Box::default() }
    }

    pub fn is_unset(&self) -> bool {
        self.code == ReasonCode::Unset && self.detail.is_empty()
    }
}

impl std::fmt::Display for JobReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code.as_str(), &*self.detail) {
            (code, "") => f.write_str(code),
            ("", detail) => f.write_str(detail),
            (code, detail) => write!(f, "{code}: {detail}"),
        }
    }
}

/// A condition on one replica that stops the cluster taking new work until
/// an operator clears it (as etcd's alarms do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AlarmKind {
    /// The replica's data directory is short of free space: new work would
    /// fill it, and a replica that cannot write its log stops.
    NoSpace,
}

impl AlarmKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AlarmKind::NoSpace => "nospace",
        }
    }

    pub fn parse(name: &str) -> Option<AlarmKind> {
        match name {
            "nospace" => Some(AlarmKind::NoSpace),
            _ => None,
        }
    }
}

/// The kinds of change that can be made to need approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ChangeKind {
    /// `SetQuota`.
    Quota,
    /// `SetBudget`.
    Budget,
    /// `GrantTemplate` giving a template to a group other than its own.
    Grant,
    /// Scheduling policy: queue settings (`SetQueue`).
    Policy,
}

impl ChangeKind {
    pub const ALL: [ChangeKind; 4] = [ChangeKind::Quota, ChangeKind::Budget, ChangeKind::Grant, ChangeKind::Policy];

    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Quota => "quota",
            ChangeKind::Budget => "budget",
            ChangeKind::Grant => "grant",
            ChangeKind::Policy => "policy",
        }
    }

    pub fn parse(text: &str) -> Option<ChangeKind> {
        ChangeKind::ALL.into_iter().find(|k| k.as_str() == text)
    }
}
