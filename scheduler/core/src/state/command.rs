//! Every change of cluster state is a `Command` in the Raft log. A log entry
//! holds one `Proposal`: a batch of commands and the leader's wall-clock time,
//! so that apply itself never reads a clock.

use serde::{Deserialize, Serialize};

use super::types::{AlarmKind, AllocId, GpuInfo, GroupQuota, JobId, JobReason, JobSpec, QueueConfig, StopReason};

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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

impl Command {
    /// The oldest encoding format that has this command.
    pub fn min_format(&self) -> u16 {
        match self {
            Command::SetClusterVersion { .. } => 2,
            Command::SetAlarm { .. } => 3,
            Command::NodesHeard { .. } => 4,
            _ => FIRST_FORMAT_VERSION,
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
    Submitted { job_id: JobId, deduplicated: bool },
    Cancelled { job_id: JobId, state: super::types::JobState },
    PlanApplied { placed: u32, rejected: u32, stopped: u32 },
    Done,
    Rejected(Rejection),
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
            Rejection::Conflict { message } | Rejection::Alarmed { message } => write!(f, "{message}"),
        }
    }
}
