//! The JSON shapes of the REST API (their schemas are derived into the
//! OpenAPI document) and their conversions from and to the rota.v1 messages.

use std::collections::BTreeMap;

use rota_proto::v1 as pb;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

/// Scheduling priority inside a group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Low,
    #[default]
    Medium,
    High,
}

impl Priority {
    fn from_pb(value: i32) -> Priority {
        match pb::Priority::try_from(value) {
            Ok(pb::Priority::Low) => Priority::Low,
            Ok(pb::Priority::High) => Priority::High,
            _ => Priority::Medium,
        }
    }

    fn to_pb(self) -> pb::Priority {
        match self {
            Priority::Low => pb::Priority::Low,
            Priority::Medium => pb::Priority::Medium,
            Priority::High => pb::Priority::High,
        }
    }
}

/// A job's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Waiting for GPUs; see the reason.
    #[default]
    Pending,
    /// Ranks placed and (being) started.
    Running,
    /// Cancel or preemption sent; waiting for ranks to exit.
    Stopping,
    Succeeded,
    Failed,
    Cancelled,
    /// Placed on a node that is down, kept there by its lost-after:
    /// whether it still runs is not known until the node is heard again
    /// (also any state this build does not know).
    Unknown,
}

impl JobState {
    pub fn from_pb(value: i32) -> JobState {
        match pb::JobState::try_from(value) {
            Ok(pb::JobState::Pending) => JobState::Pending,
            Ok(pb::JobState::Running) => JobState::Running,
            Ok(pb::JobState::Stopping) => JobState::Stopping,
            Ok(pb::JobState::Succeeded) => JobState::Succeeded,
            Ok(pb::JobState::Failed) => JobState::Failed,
            Ok(pb::JobState::Cancelled) => JobState::Cancelled,
            Ok(pb::JobState::Unknown) => JobState::Unknown,
            _ => JobState::Unknown,
        }
    }

    /// The state as a list filter.
    pub fn to_pb(self) -> Option<pb::JobState> {
        Some(match self {
            JobState::Pending => pb::JobState::Pending,
            JobState::Running => pb::JobState::Running,
            JobState::Stopping => pb::JobState::Stopping,
            JobState::Succeeded => pb::JobState::Succeeded,
            JobState::Failed => pb::JobState::Failed,
            JobState::Cancelled => pb::JobState::Cancelled,
            JobState::Unknown => pb::JobState::Unknown,
        })
    }
}

fn one() -> u32 {
    1
}

/// What a user asks for; the limits of each field are checked on submit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Human-readable name, at most 128 bytes.
    #[serde(default)]
    pub name: String,
    /// Accounting group; empty = "default".
    #[serde(default)]
    pub group: String,
    /// Queue; empty = "training".
    #[serde(default)]
    pub queue: String,
    #[serde(default)]
    pub priority: Priority,
    /// Number of ranks, placed together or not at all.
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 4096)]
    pub replicas: u32,
    /// GPUs per rank.
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 64)]
    pub gpus_per_replica: u32,
    /// Required GPU model; empty = any.
    #[serde(default)]
    pub gpu_model: String,
    /// Minimum memory per GPU, MiB; 0 = any.
    #[serde(default)]
    pub min_gpu_memory_mib: u64,
    /// Program and arguments of each rank.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 256)]
    pub command: Vec<String>,
    /// Extra environment of every rank.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit, seconds; 0 = the queue's default.
    #[serde(default)]
    pub runtime_limit_s: u64,
    /// Time between SIGTERM and SIGKILL, seconds; 0 = 60.
    #[serde(default)]
    pub grace_period_s: u64,
    /// Retries of a failed job.
    #[serde(default)]
    pub max_retries: u32,
    /// Seconds after which a high priority falls back to medium; 0 = never.
    #[serde(default)]
    pub priority_ttl_s: u64,
}

impl JobSpec {
    fn from_pb(spec: pb::JobSpec) -> JobSpec {
        JobSpec {
            name: spec.name,
            group: spec.group,
            queue: spec.queue,
            priority: Priority::from_pb(spec.priority),
            replicas: spec.replicas,
            gpus_per_replica: spec.gpus_per_replica,
            gpu_model: spec.gpu_model,
            min_gpu_memory_mib: spec.min_gpu_memory_mib,
            command: spec.command,
            env: spec.env.into_iter().collect(),
            runtime_limit_s: spec.runtime_limit_s,
            grace_period_s: spec.grace_period_s,
            max_retries: spec.max_retries,
            priority_ttl_s: spec.priority_ttl_s,
        }
    }
}

/// The spec of a submit: as [`JobSpec`], but a field left out is unset,
/// so that with a `template` the template's value holds (as over gRPC);
/// without one, [`JobSpec`]'s defaults do.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitSpec {
    /// Human-readable name, at most 128 bytes.
    pub name: Option<String>,
    /// Accounting group; empty = "default" (or the template's).
    pub group: Option<String>,
    /// Queue; empty = "training" (or the template's).
    pub queue: Option<String>,
    /// Default medium (or the template's).
    pub priority: Option<Priority>,
    /// Number of ranks, placed together or not at all; default 1 (or the template's).
    #[schema(minimum = 1, maximum = 4096)]
    pub replicas: Option<u32>,
    /// GPUs per rank; default 1 (or the template's).
    #[schema(minimum = 1, maximum = 64)]
    pub gpus_per_replica: Option<u32>,
    /// Required GPU model; empty = any.
    pub gpu_model: Option<String>,
    /// Minimum memory per GPU, MiB; 0 = any.
    pub min_gpu_memory_mib: Option<u64>,
    /// Program and arguments of each rank (a template's when left out).
    #[schema(max_items = 256)]
    pub command: Option<Vec<String>>,
    /// Extra environment of every rank (over a template's, entry by entry).
    pub env: Option<BTreeMap<String, String>>,
    /// Wall-clock limit, seconds; 0 = the queue's default.
    pub runtime_limit_s: Option<u64>,
    /// Time between SIGTERM and SIGKILL, seconds; 0 = 60.
    pub grace_period_s: Option<u64>,
    /// Retries of a failed job.
    pub max_retries: Option<u32>,
    /// Seconds after which a high priority falls back to medium; 0 = never.
    pub priority_ttl_s: Option<u64>,
}

impl SubmitSpec {
    /// The gRPC spec. Without a template, what is left out takes
    /// [`JobSpec`]'s defaults; with one, it stays unset (zero) so the
    /// template's value holds.
    pub fn to_pb(&self, from_template: bool) -> pb::JobSpec {
        let or_one = |value: Option<u32>| value.unwrap_or(if from_template { 0 } else { 1 });
        let priority = match self.priority {
            Some(priority) => priority.to_pb(),
            None if from_template => pb::Priority::Unspecified,
            None => Priority::default().to_pb(),
        };
        pb::JobSpec {
            name: self.name.clone().unwrap_or_default(),
            group: self.group.clone().unwrap_or_default(),
            queue: self.queue.clone().unwrap_or_default(),
            priority: priority as i32,
            replicas: or_one(self.replicas),
            gpus_per_replica: or_one(self.gpus_per_replica),
            gpu_model: self.gpu_model.clone().unwrap_or_default(),
            min_gpu_memory_mib: self.min_gpu_memory_mib.unwrap_or(0),
            command: self.command.clone().unwrap_or_default(),
            env: self.env.clone().unwrap_or_default().into_iter().collect(),
            runtime_limit_s: self.runtime_limit_s.unwrap_or(0),
            grace_period_s: self.grace_period_s.unwrap_or(0),
            max_retries: self.max_retries.unwrap_or(0),
            priority_ttl_s: self.priority_ttl_s.unwrap_or(0),
        }
    }
}

/// A job to submit: a spec, or a template with what the spec sets over it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// May be left out with a template.
    #[serde(default)]
    pub spec: SubmitSpec,
    /// Idempotency key, at most 128 bytes: a retry with the same key
    /// returns the job created first. Absent or empty: no deduplication.
    #[serde(default)]
    pub request_id: Option<String>,
    /// Names of environment entries whose values are secret (also cut out of the command when shown to others).
    #[serde(default)]
    pub secret_env: Vec<String>,
    /// The command and its arguments are secret too.
    #[serde(default)]
    pub secret_command: bool,
    /// Labels (cluster version 7 on): at most 16; a key is 1 to 63 bytes of
    /// `[a-z0-9._/-]` starting with a letter or digit, a value at most 128
    /// bytes of `[A-Za-z0-9._-]`. Over a template's, key by key.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Make the job from this template (cluster version 7 on): the fields
    /// the spec sets override the template's. Another group's template
    /// needs its grant.
    #[serde(default)]
    pub template: Option<String>,
    /// The template's version; absent or 0 = its latest.
    #[serde(default)]
    pub template_version: Option<u32>,
    /// How long a single-node job outlives its node's silence (cluster
    /// version 11 on): `never`, or a duration such as `90s`, `30m`, `2h`,
    /// `1d` (at most a week). Absent: the node TTL.
    #[serde(default)]
    pub lost_after: Option<String>,
}

impl SubmitRequest {
    pub fn to_pb(&self) -> pb::SubmitJobRequest {
        let template = self.template.clone().unwrap_or_default();
        pb::SubmitJobRequest {
            spec: Some(self.spec.to_pb(!template.is_empty())),
            request_id: self.request_id.clone().unwrap_or_default(),
            secret_env: self.secret_env.clone(),
            secret_command: self.secret_command,
            template,
            template_version: self.template_version.unwrap_or(0),
            labels: self.labels.clone().into_iter().collect(),
            lost_after: self.lost_after.clone().unwrap_or_default(),
        }
    }
}

/// A submitted job.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Submitted {
    pub job_id: u64,
    /// True when the request id matched an earlier submit and no new job was made.
    pub deduplicated: bool,
    /// Raft log index at which the job was committed.
    pub index: u64,
}

impl From<pb::SubmitJobResponse> for Submitted {
    fn from(r: pb::SubmitJobResponse) -> Submitted {
        Submitted { job_id: r.job_id, deduplicated: r.deduplicated, index: r.index }
    }
}

/// Where one rank runs.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RankAllocation {
    pub rank: u32,
    pub node: String,
    /// Physical GPU indices on that node.
    pub gpus: Vec<u32>,
    /// "assigned", "running" or "exited".
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

/// A job as the caller may see it (environment values redacted for anyone
/// but its owner, its group's admins and operators).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Job {
    pub id: u64,
    pub state: JobState,
    pub spec: JobSpec,
    pub request_id: String,
    /// The user who submitted it; empty on a cluster without access control.
    pub owner: String,
    /// Times are Unix milliseconds; 0 = not yet.
    pub submitted_at_ms: u64,
    pub started_at_ms: u64,
    pub finished_at_ms: u64,
    /// Why the job is in its state, for people ("code: detail").
    pub reason: String,
    /// The reason's stable code ("quota_exhausted", "insufficient_gpus").
    pub reason_code: String,
    pub reason_detail: String,
    /// Estimated start of a pending job, Unix ms; 0 = unknown.
    pub estimated_start_ms: u64,
    pub attempts: u32,
    pub allocations: Vec<RankAllocation>,
    pub master_addr: String,
    pub master_port: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Node of each rank of the latest attempt.
    pub last_nodes: Vec<String>,
    /// True when secrets were replaced by "<redacted>" for this caller.
    pub redacted: bool,
    /// The policy document version its latest placement was made under
    /// (0 = the built-in defaults); absent = never placed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<u64>,
    /// The job's labels (its template's and its own).
    pub labels: BTreeMap<String, String>,
    /// The template it was made from; absent = none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// That template's version; 0 = none.
    pub template_version: u32,
    /// Every rank of the current attempt has been idle since this
    /// committed time, Unix ms; 0 = not idle.
    pub idle_since_ms: u64,
    /// When the attempt was flagged idle past its queue's idle time, Unix ms; 0 = not flagged.
    pub idle_flagged_ms: u64,
    /// GPU-milliseconds the job's attempts have spent idle.
    pub idle_gpu_ms: u64,
    /// Its lost-after as submitted (`never`, `30m`); absent = the node TTL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost_after: Option<String>,
}

impl From<pb::Job> for Job {
    fn from(job: pb::Job) -> Job {
        Job {
            id: job.id,
            state: JobState::from_pb(job.state),
            spec: JobSpec::from_pb(job.spec.unwrap_or_default()),
            request_id: job.request_id,
            owner: job.owner,
            submitted_at_ms: job.submitted_at_ms,
            started_at_ms: job.started_at_ms,
            finished_at_ms: job.finished_at_ms,
            reason: job.reason,
            reason_code: job.reason_code,
            reason_detail: job.reason_detail,
            estimated_start_ms: job.estimated_start_ms,
            attempts: job.attempts,
            allocations: job
                .allocations
                .into_iter()
                .map(|a| RankAllocation { rank: a.rank, node: a.node, gpus: a.gpus, state: a.state, exit_code: a.exit_code })
                .collect(),
            master_addr: job.master_addr,
            master_port: job.master_port,
            exit_code: job.exit_code,
            last_nodes: job.last_nodes,
            redacted: job.redacted,
            policy_version: job.policy_version,
            labels: job.labels.into_iter().collect(),
            template: (!job.template.is_empty()).then_some(job.template),
            template_version: job.template_version,
            idle_since_ms: job.idle_since_ms,
            idle_flagged_ms: job.idle_flagged_ms,
            lost_after: (!job.lost_after.is_empty()).then_some(job.lost_after),
            idle_gpu_ms: job.idle_gpu_ms,
        }
    }
}

/// Filters and paging of a job listing.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListJobsQuery {
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// Only jobs of this queue.
    pub queue: Option<String>,
    /// Only jobs of this group.
    pub group: Option<String>,
    /// Only jobs this user submitted.
    pub user: Option<String>,
    /// Only jobs carrying every one of these labels, `key=value`, comma-separated.
    pub label: Option<String>,
    /// Only jobs flagged idle past their queue's idle time (`rota jobs --idle`).
    pub idle: Option<bool>,
    /// Jobs per page, 1..=500; default 50.
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u32>,
    /// Where the page starts: the `next_cursor` of the page before.
    pub cursor: Option<String>,
}

/// One page of jobs, newest first.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    /// Jobs matching the filters from this page's start on.
    pub total: u64,
    /// Pass as `cursor` for the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// A job's new priority (`POST /v1/jobs/{job_id}/priority`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PriorityChange {
    pub priority: Priority,
}

impl PriorityChange {
    pub fn to_pb(&self, job_id: u64) -> pb::SetJobPriorityRequest {
        pb::SetJobPriorityRequest { job_id, priority: self.priority.to_pb() as i32 }
    }
}

/// A cancelled job.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Cancelled {
    pub job_id: u64,
    /// The job's state after the cancel.
    pub state: JobState,
}

/// Why a job is in its state, and when a pending job should start.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Why {
    pub job_id: u64,
    pub state: JobState,
    /// The stable code ("quota_exhausted", "insufficient_gpus"); empty when there is none.
    pub code: String,
    pub detail: String,
    /// For people: "code: detail".
    pub reason: String,
    /// Estimated start, Unix ms; absent when unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_start_ms: Option<u64>,
}

impl From<Job> for Why {
    fn from(job: Job) -> Why {
        Why {
            job_id: job.id,
            state: job.state,
            code: job.reason_code,
            detail: job.reason_detail,
            reason: job.reason,
            estimated_start_ms: (job.estimated_start_ms > 0).then_some(job.estimated_start_ms),
        }
    }
}

/// Which log of which rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    #[default]
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LogsQuery {
    /// The rank; default 0.
    pub rank: Option<u32>,
    /// stdout (default) or stderr.
    pub stream: Option<LogStream>,
    /// Keep streaming until the rank has exited.
    pub follow: Option<bool>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub healthy: bool,
    /// Job holding the GPU; 0 = free.
    pub job_id: u64,
    /// Why the GPU is fenced (its own, its NVLink domain's or its node's
    /// fence); empty = not fenced.
    pub fence: String,
}

/// A GPU host.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Node {
    pub name: String,
    pub address: String,
    pub rack: String,
    pub leaf: String,
    /// "ready", "draining" or "down".
    pub state: String,
    pub gpus: Vec<Gpu>,
    pub registered_at_ms: u64,
}

/// One page of nodes, by name.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Nodes {
    pub nodes: Vec<Node>,
    /// Pass as `cursor` for the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Paging of the node list.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct NodesQuery {
    /// Nodes per page, 1..=10000; default 2000.
    #[param(minimum = 1, maximum = 10000)]
    pub limit: Option<u32>,
    /// Where the page starts: the `next_cursor` of the page before (nodes after this name).
    pub cursor: Option<String>,
}

impl From<pb::ListNodesResponse> for Nodes {
    fn from(r: pb::ListNodesResponse) -> Nodes {
        let nodes = r
            .nodes
            .into_iter()
            .map(|n| Node {
                name: n.name,
                address: n.address,
                rack: n.rack,
                leaf: n.leaf,
                state: n.state,
                gpus: n
                    .gpus
                    .into_iter()
                    .map(|g| Gpu {
                        index: g.index,
                        uuid: g.uuid,
                        model: g.model,
                        memory_mib: g.memory_mib,
                        healthy: g.healthy,
                        job_id: g.job_id,
                        fence: g.fence,
                    })
                    .collect(),
                registered_at_ms: n.registered_at_ms,
            })
            .collect();
        Nodes { nodes, next_cursor: None }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Queue {
    pub name: String,
    /// Share of the scheduler's favour relative to other queues.
    pub weight: u32,
    /// Largest job in total GPUs; 0 = no cap.
    pub max_gpus_per_job: u32,
    pub default_runtime_s: u64,
    pub max_runtime_s: u64,
    pub preemptible: bool,
    /// A job younger than this is never preempted, seconds.
    pub protected_runtime_s: u64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Queues {
    pub queues: Vec<Queue>,
}

impl From<pb::ListQueuesResponse> for Queues {
    fn from(r: pb::ListQueuesResponse) -> Queues {
        let queues = r
            .queues
            .into_iter()
            .map(|q| Queue {
                name: q.name,
                weight: q.weight,
                max_gpus_per_job: q.max_gpus_per_job,
                default_runtime_s: q.default_runtime_s,
                max_runtime_s: q.max_runtime_s,
                preemptible: q.preemptible,
                protected_runtime_s: q.protected_runtime_s,
            })
            .collect();
        Queues { queues }
    }
}

/// A group's quota with its current use.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Quota {
    pub group: String,
    /// Guaranteed GPUs (any model).
    pub gpus: u32,
    /// Guaranteed GPUs of a model, inside `gpus`.
    pub per_model: BTreeMap<String, u32>,
    /// Idle guaranteed GPUs are lent to other groups.
    pub lend: bool,
    /// When non-empty, lent only to these groups.
    pub lend_to: Vec<String>,
    /// Most GPUs this group may borrow beyond its quota; absent = no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub borrow_limit: Option<u32>,
    /// GPUs the group's running jobs hold.
    pub used: u64,
    /// GPUs used beyond the guarantee.
    pub borrowed: u64,
    /// Guaranteed GPUs idle now and available to others.
    pub lendable: u64,
    /// Of those, GPUs other groups' borrowing jobs hold now.
    pub lent: u64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Quotas {
    pub quotas: Vec<Quota>,
}

impl From<pb::ListQuotasResponse> for Quotas {
    fn from(r: pb::ListQuotasResponse) -> Quotas {
        let quotas = r
            .quotas
            .into_iter()
            .map(|status| {
                let quota = status.quota.unwrap_or_default();
                Quota {
                    group: quota.group,
                    gpus: quota.gpus,
                    per_model: quota.per_model.into_iter().collect(),
                    lend: quota.lend,
                    lend_to: quota.lend_to,
                    borrow_limit: quota.borrow_limit,
                    used: status.used,
                    borrowed: status.borrowed,
                    lendable: status.lendable,
                    lent: status.lent,
                }
            })
            .collect();
        Quotas { quotas }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct UsageLine {
    pub group: String,
    pub queue: String,
    /// Ended allocations plus running ones up to now.
    pub gpu_seconds: u64,
    /// GPUs held now.
    pub gpus_now: u64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub lines: Vec<UsageLine>,
}

impl From<pb::GetUsageResponse> for Usage {
    fn from(r: pb::GetUsageResponse) -> Usage {
        let lines = r
            .lines
            .into_iter()
            .map(|l| UsageLine { group: l.group, queue: l.queue, gpu_seconds: l.gpu_seconds, gpus_now: l.gpus_now })
            .collect();
        Usage { lines }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Member {
    pub id: u64,
    /// Its gRPC address.
    pub address: String,
    /// "leader", "follower" or "learner".
    pub role: String,
}

/// The cluster as the answering replica sees it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Cluster {
    pub cluster_id: String,
    /// The replica that answered.
    pub replica_id: u64,
    /// 0 = no known leader.
    pub leader_id: u64,
    pub leader_address: String,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub members: Vec<Member>,
    /// The answering replica's build.
    pub version: String,
    /// Newest log format this replica reads.
    pub format_version: u32,
    /// Format the cluster writes.
    pub cluster_version: u32,
}

impl From<pb::ClusterStatus> for Cluster {
    fn from(s: pb::ClusterStatus) -> Cluster {
        Cluster {
            cluster_id: s.cluster_id,
            replica_id: s.replica_id,
            leader_id: s.leader_id,
            leader_address: s.leader_address,
            term: s.term,
            commit_index: s.commit_index,
            applied_index: s.applied_index,
            members: s.members.into_iter().map(|m| Member { id: m.id, address: m.address, role: m.role }).collect(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            format_version: s.format_version,
            cluster_version: s.cluster_version,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only records whose actor or impersonator is this user.
    pub user: Option<String>,
    /// Only records at or after this Unix ms.
    pub since_ms: Option<u64>,
    /// At most this many of the newest matching records, 1..=1000; default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AuditRecord {
    /// Raft log index of the command.
    pub index: u64,
    pub at_ms: u64,
    /// The user the command acted as; empty for the cluster itself.
    pub user: String,
    pub impersonator: String,
    /// The client's address as the first replica saw it.
    pub from: String,
    pub what: String,
    /// "ok..." or "refused: ...".
    pub outcome: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Audit {
    pub records: Vec<AuditRecord>,
    /// Records dropped from the front of the bounded trail so far.
    pub dropped: u64,
}

impl From<pb::ListAuditResponse> for Audit {
    fn from(r: pb::ListAuditResponse) -> Audit {
        let records = r
            .records
            .into_iter()
            .map(|a| AuditRecord {
                index: a.index,
                at_ms: a.at_ms,
                user: a.user,
                impersonator: a.impersonator,
                from: a.from,
                what: a.what,
                outcome: a.outcome,
            })
            .collect();
        Audit { records, dropped: r.dropped }
    }
}

/// The query of `GET /v1/events`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// Send the events of log entries after this index; 0 (default) = from
    /// the oldest kept. A `Last-Event-ID` header takes its place.
    pub since: Option<u64>,
    /// Topics, comma-separated: jobs, nodes, quotas, queues; default all.
    pub topic: Option<String>,
}

/// One event, the `data` of an SSE message whose `event` is its kind.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventMessage {
    /// Log index of the entry that made it.
    pub index: u64,
    /// Its place among that entry's events.
    pub seq: u32,
    pub topic: String,
    pub kind: String,
    /// 0 when not about a job.
    pub job_id: u64,
    pub node: String,
    pub group: String,
    pub queue: String,
    pub reason: String,
    /// The entry's leader time (Unix ms).
    pub time_ms: u64,
    /// The job's state after the event; empty when not about a job.
    pub state: String,
}

impl From<pb::Event> for EventMessage {
    fn from(event: pb::Event) -> Self {
        EventMessage {
            index: event.index,
            seq: event.seq,
            topic: event.topic,
            kind: event.kind,
            job_id: event.job_id,
            node: event.node,
            group: event.group,
            queue: event.queue,
            reason: event.reason,
            time_ms: event.time_ms,
            state: event.state,
        }
    }
}

/// The `data` of an SSE `compacted` message: events before `oldest_index`
/// are gone; read the current state, then follow from `current_index`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventsCompacted {
    pub oldest_index: u64,
    pub current_index: u64,
}

/// The `data` of an SSE `progress` message: every entry through `index`
/// was read and none had an event of the topics asked for; its `id` is
/// `index`, where a reconnecting reader resumes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventsProgress {
    pub index: u64,
}
