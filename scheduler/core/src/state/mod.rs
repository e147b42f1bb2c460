//! The replicated cluster state and its deterministic `apply`.
//!
//! Rules that keep replicas identical: apply never reads a clock (time comes
//! in the `Proposal`), never draws a random number, iterates ordered maps
//! only, and asserts its invariants: no GPU in two live allocations, a gang
//! placed whole or not at all.

mod apply;
mod apply_approvals;
mod apply_policy;
pub mod approvals;
pub mod auth;
pub mod codec;
pub use apply::gpu_matches;
mod apply_tenancy;
pub mod command;
pub mod dedupe;
pub mod env_vars;
pub mod events;
pub mod faults;
pub mod gpu_model;
pub mod idle;
pub mod limits;
pub mod lost_after;
pub mod outcomes;
pub mod policy_doc;
pub mod records;
pub mod request_id;
pub mod run_clock;
pub mod shared;
pub mod tenancy;
pub mod types;
pub mod validate;
pub mod xid;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use shared::{SharedList, SharedMap, SharedValue};

pub use command::*;
pub use dedupe::DedupeTable;
pub use limits::{LimitsChange, StateLimits, TableUse};
pub use types::*;

/// GPU-seconds used, per group and queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Usage {
    pub gpu_ms: BTreeMap<(String, String), u64>,
}

/// How many jobs a walk of the job table passes in the time one lookup by
/// id takes (measured with `rota bench plan --finished`: a walk ~40 ns a
/// job, a lookup ~120 ns at 50,000 pending jobs); chooses how the pending
/// jobs are read.
const WALK_STEPS_PER_LOOKUP: usize = 3;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    pub limits: StateLimits,
    /// Index of the last applied log entry.
    pub applied_index: u64,
    /// The newest leader time seen in the log (Unix ms); never moves back.
    pub now_ms: u64,
    pub next_job_id: JobId,
    pub next_alloc_id: AllocId,
    pub jobs: SharedMap<JobId, SharedValue<Job>>,
    pub allocs: SharedMap<AllocId, Allocation>,
    pub nodes: SharedMap<String, Node>,
    pub queues: BTreeMap<String, QueueConfig>,
    pub quotas: BTreeMap<String, GroupQuota>,
    pub dedupe: DedupeTable,
    /// Which allocation holds each (node, GPU index). Kept in step with `allocs`.
    pub gpu_owner: SharedMap<(String, u32), AllocId>,
    /// Final jobs in the order they ended, for bounded retention.
    pub finished: SharedList<JobId>,
    /// Every held job under (its `changed_at_index`, its id): the change
    /// index that job watches read from a log index on. Derived from `jobs`
    /// (not encoded; rebuilt when a snapshot is decoded).
    #[serde(skip)]
    pub job_changes: SharedMap<(u64, JobId), ()>,
    /// The id of every pending job: the queue a scheduling pass and the
    /// pending gauges read, so their cost follows the queue and not the
    /// finished jobs held beside it. Derived from `jobs` like `job_changes`.
    #[serde(skip)]
    pub pending_jobs: SharedMap<JobId, ()>,
    /// Jobs not in a final state.
    pub live_jobs: usize,
    /// Sum of `payload_bytes` over every job in `jobs`.
    pub spec_bytes: u64,
    pub usage: Usage,
    /// The newest format the cluster writes (see `codec`). Not part of the
    /// bincode layout of format 1: the snapshot codec writes it after the
    /// state from format 2 on, and sets it when reading.
    #[serde(skip)]
    pub cluster_version: u16,
    /// Raised alarms: (replica id, kind). While any is raised, the cluster
    /// takes no new jobs and no configuration. Written after the state from
    /// format 3 on, like `cluster_version`.
    #[serde(skip)]
    pub alarms: BTreeSet<(u64, AlarmKind)>,
    /// Node -> committed time (Unix ms) it was last recorded as heard by a
    /// leader (`NodesHeard`, and registration). Kept from format 4 on,
    /// written after the alarms.
    #[serde(skip)]
    pub node_heard_ms: SharedMap<String, u64>,
    /// Users, tokens, job owners and the audit trail. Kept from format 5
    /// on, written after the heard times.
    #[serde(skip)]
    pub auth: auth::AuthState,
    /// Fences and drained nodes. Kept from format 6 on, written after the
    /// users.
    #[serde(skip)]
    pub faults: faults::FaultState,
    /// Templates, job labels, budgets and metered use. Kept from format 7
    /// on, written after the fences.
    #[serde(skip)]
    pub tenancy: tenancy::TenancyState,
    /// Rules that kinds of change need a second person, and the changes
    /// waiting for one. Kept from format 8 on, written after the tenancy.
    #[serde(skip)]
    pub approvals: approvals::ApprovalState,
    /// Idle records, per-job idle GPU-time and queue idle rules. Kept from
    /// format 8 on, written after the tenancy section.
    #[serde(skip)]
    pub idle: idle::IdleState,
    /// Job statistics for history and reports. Kept from format 8 on,
    /// written after the tenancy section.
    #[serde(skip)]
    pub records: records::RecordsState,
    /// Policy documents: the history, the active and the staged version,
    /// and the version each held job was placed under. Kept from format 9
    /// on, written after the job statistics.
    #[serde(skip)]
    pub policy: policy_doc::PolicyState,
    /// What people's changes produced, by sender and request id. Kept from
    /// format 10 on, written after the policy documents.
    #[serde(skip)]
    pub outcomes: outcomes::OutcomeState,
    /// `--lost-after` of live single-node jobs that set one. Kept from
    /// format 11 on, written after the request outcomes.
    #[serde(skip)]
    pub lost_after: lost_after::LostAfterTable,
    /// When each live attempt had every rank started (`run_clock`). Kept
    /// from format 12 on, written after the lost-after table.
    #[serde(skip)]
    pub running_since: run_clock::RunningSinceTable,
    /// Records of jobs this replica dropped, for its archive (not
    /// replicated; see `records::ArchiveOutbox`).
    #[serde(skip)]
    pub archive_outbox: records::ArchiveOutbox,
}

impl Default for ClusterState {
    fn default() -> Self {
        Self::new(StateLimits::default())
    }
}

impl ClusterState {
    pub fn new(limits: StateLimits) -> Self {
        Self {
            limits,
            applied_index: 0,
            now_ms: 0,
            next_job_id: 1,
            next_alloc_id: 1,
            jobs: SharedMap::new(),
            allocs: SharedMap::new(),
            nodes: SharedMap::new(),
            queues: QueueConfig::defaults().into_iter().map(|q| (q.name.clone(), q)).collect(),
            quotas: BTreeMap::new(),
            dedupe: DedupeTable::new(limits.dedupe_capacity),
            gpu_owner: SharedMap::new(),
            finished: SharedList::new(),
            job_changes: SharedMap::new(),
            pending_jobs: SharedMap::new(),
            live_jobs: 0,
            spec_bytes: 0,
            usage: Usage::default(),
            cluster_version: codec::FIRST_FORMAT_VERSION,
            alarms: BTreeSet::new(),
            node_heard_ms: SharedMap::new(),
            auth: auth::AuthState::default(),
            faults: faults::FaultState::default(),
            tenancy: tenancy::TenancyState::default(),
            approvals: approvals::ApprovalState::default(),
            idle: idle::IdleState::default(),
            records: records::RecordsState::default(),
            policy: policy_doc::PolicyState::default(),
            outcomes: outcomes::OutcomeState::default(),
            lost_after: lost_after::LostAfterTable::new(),
            running_since: run_clock::RunningSinceTable::new(),
            archive_outbox: records::ArchiveOutbox::default(),
        }
    }

    /// Apply one committed log entry. Returns one result per command.
    pub fn apply_proposal(&mut self, index: u64, proposal: &Proposal) -> Vec<CommandResult> {
        assert!(index > self.applied_index, "entries are applied in order: {index} after {}", self.applied_index);
        self.applied_index = index;
        self.now_ms = self.now_ms.max(proposal.now_ms);
        proposal.commands.iter().map(|command| self.apply(index, command)).collect()
    }

    /// The newest format the cluster writes (at least the first).
    pub fn cluster_version(&self) -> u16 {
        self.cluster_version.max(codec::FIRST_FORMAT_VERSION)
    }

    /// Do GPU model names match by alias (`gpu_model`)? Only once every
    /// replica applies the same rule.
    pub fn model_aliases(&self) -> bool {
        self.cluster_version() >= gpu_model::ALIASES_FROM_VERSION
    }

    /// The whole state in the versioned snapshot format (see `codec`).
    pub fn to_snapshot(&self) -> Vec<u8> {
        codec::encode_snapshot(self)
    }

    pub fn from_snapshot(bytes: &[u8]) -> Result<ClusterState, String> {
        codec::decode_snapshot(bytes).map_err(|e| e.to_string())
    }

    /// Runtime limit of a job: its own, else its queue's default.
    pub fn runtime_limit_s(&self, spec: &JobSpec) -> u64 {
        if spec.runtime_limit_s > 0 {
            return spec.runtime_limit_s;
        }
        self.queues.get(&spec.queue).map_or(24 * 3600, |q| q.default_runtime_s)
    }

    /// Is this GPU free, healthy, unfenced and on a node that takes new work?
    pub fn gpu_is_free(&self, node: &Node, gpu: &GpuInfo) -> bool {
        node.state == NodeState::Ready
            && gpu.healthy
            && !self.faults.is_fenced(&node.name, gpu)
            && !self.gpu_owner.contains_key(&(node.name.clone(), gpu.index))
    }

    /// GPUs under a fence (the whole node's, their domain's or their own).
    pub fn fenced_gpus(&self) -> u64 {
        let fenced = |(name, fences): (&String, &faults::NodeFences)| {
            self.nodes.get(name).map_or(0, |n| n.gpus.iter().filter(|g| fences.fence_of(g).is_some()).count() as u64)
        };
        self.faults.fences.iter().map(fenced).sum()
    }

    pub fn free_gpus(&self) -> u64 {
        self.nodes.values().flat_map(|n| n.gpus.iter().map(move |g| (n, g))).filter(|(n, g)| self.gpu_is_free(n, g)).count() as u64
    }

    /// Rebuild the indexes derived from the jobs (after decoding a snapshot).
    pub fn index_jobs(&mut self) {
        self.job_changes = self.derived_job_changes();
        self.pending_jobs = self.derived_pending_jobs();
    }

    /// The pending jobs in id order. Through the pending index when the
    /// queue is a small part of the table, so the cost follows the queue
    /// however many finished jobs are held; by a walk of the table
    /// otherwise, as a lookup per id costs several steps of a walk.
    pub fn pending(&self) -> Box<dyn Iterator<Item = &Job> + '_> {
        if self.pending_jobs.len().saturating_mul(WALK_STEPS_PER_LOOKUP) < self.jobs.len() {
            Box::new(self.pending_jobs.keys().map(|id| &*self.jobs[id]))
        } else {
            Box::new(self.jobs.values().map(|j| &**j).filter(|j| j.state == JobState::Pending))
        }
    }

    /// The pending index as the jobs say it should be.
    fn derived_pending_jobs(&self) -> SharedMap<JobId, ()> {
        self.jobs.values().filter(|j| j.state == JobState::Pending).map(|j| (j.id, ())).collect()
    }

    /// The change index as the jobs say it should be.
    fn derived_job_changes(&self) -> SharedMap<(u64, JobId), ()> {
        self.jobs.values().map(|j| ((j.changed_at_index, j.id), ())).collect()
    }

    /// Jobs changed after log index `after`, in the order of their last
    /// change, from `(after_index, after_job)` on (exclusive): O(log n) to
    /// start, O(1) a job after.
    pub fn jobs_changed_after(&self, after_index: u64, after_job: JobId) -> impl Iterator<Item = &Job> + '_ {
        let from = match after_job.checked_add(1) {
            Some(next) => (after_index, next),
            None => (after_index.saturating_add(1), 0),
        };
        self.job_changes.range(from..).map(|((_, id), ())| &*self.jobs[id])
    }

    /// The live allocations with a rank on `node`, in id order: found
    /// through the GPU owner index (every rank holds at least one GPU until
    /// its allocation ends), so O(log n + the node's GPUs).
    pub fn allocs_on_node(&self, node: &str) -> Vec<AllocId> {
        let first = (node.to_string(), 0);
        let last = (node.to_string(), u32::MAX);
        let ids: BTreeSet<AllocId> = self.gpu_owner.range(first..=last).map(|(_, id)| *id).collect();
        ids.into_iter().collect()
    }

    /// Check the invariants that tie the tables together. O(state); used by
    /// tests and after restore, not on every apply.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut owners: SharedMap<(String, u32), AllocId> = SharedMap::new();
        for alloc in self.allocs.values() {
            let job = self.jobs.get(&alloc.job_id).ok_or(format!("alloc {} has no job", alloc.id))?;
            if job.alloc != Some(alloc.id) {
                return Err(format!("job {} does not point at its alloc {}", job.id, alloc.id));
            }
            if alloc.ranks.len() != job.spec.replicas as usize {
                return Err(format!("alloc {} is not a whole gang", alloc.id));
            }
            for rank in &alloc.ranks {
                for &gpu in &rank.gpus {
                    if let Some(other) = owners.insert((rank.node.clone(), gpu), alloc.id) {
                        return Err(format!("GPU {}:{gpu} held by allocs {other} and {}", rank.node, alloc.id));
                    }
                }
            }
        }
        if owners != self.gpu_owner {
            return Err("gpu_owner index disagrees with allocations".into());
        }
        for (node, gpu) in self.gpu_owner.keys() {
            let exists = self.nodes.get(node).is_some_and(|n| n.gpus.iter().any(|g| g.index == *gpu));
            if !exists {
                return Err(format!("GPU {node}:{gpu} is held but its node has no such GPU"));
            }
        }
        if self.derived_job_changes() != self.job_changes {
            return Err(format!("the change index holds {} jobs, the state {}", self.job_changes.len(), self.jobs.len()));
        }
        let pending = self.derived_pending_jobs();
        if pending != self.pending_jobs {
            return Err(format!("the pending index holds {} jobs, the state {} pending", self.pending_jobs.len(), pending.len()));
        }
        let live = self.jobs.values().filter(|j| !j.state.is_final()).count();
        if live != self.live_jobs {
            return Err(format!("live job count {} but {} live jobs", self.live_jobs, live));
        }
        let spec_bytes: u64 = self.jobs.values().map(|j| j.spec.payload_bytes() as u64).sum();
        if spec_bytes != self.spec_bytes {
            return Err(format!("spec bytes counted {} but the jobs hold {spec_bytes}", self.spec_bytes));
        }
        if let Some(alloc_id) = self.faults.attempt_faults.keys().find(|id| !self.allocs.contains_key(*id)) {
            return Err(format!("allocation {alloc_id} has a fault but is not live"));
        }
        if let Some(job_id) = self.auth.job_marks.keys().find(|id| !self.jobs.contains_key(*id)) {
            return Err(format!("job {job_id} has marks but is not held"));
        }
        if let Some(job_id) = self.tenancy.job_tags.keys().find(|id| !self.jobs.contains_key(*id)) {
            return Err(format!("job {job_id} has labels but is not held"));
        }
        if let Some(alloc_id) = self.idle.allocs.keys().find(|id| !self.allocs.contains_key(*id)) {
            return Err(format!("allocation {alloc_id} has an idle record but is not live"));
        }
        if let Some(job_id) = self.idle.job_idle_gpu_ms.keys().find(|id| !self.jobs.contains_key(*id)) {
            return Err(format!("job {job_id} has idle time but is not held"));
        }
        if let Some(job_id) = self.records.job_stats.keys().find(|id| !self.jobs.contains_key(*id)) {
            return Err(format!("job {job_id} has statistics but is not held"));
        }
        if let Some(job_id) = self.policy.job_versions.keys().find(|id| !self.jobs.contains_key(*id)) {
            return Err(format!("job {job_id} has a policy version but is not held"));
        }
        self.outcomes.check()?;
        for job_id in self.lost_after.keys() {
            match self.jobs.get(job_id) {
                Some(job) if !job.state.is_final() && job.spec.replicas == 1 => {}
                _ => return Err(format!("job {job_id} has a lost-after but is not a live single-node job")),
            }
        }
        self.check_run_clock()?;
        if self.cluster_version() >= tenancy::TENANCY_FROM_VERSION {
            let mut running: BTreeMap<&str, u64> = BTreeMap::new();
            for alloc in self.allocs.values() {
                *running.entry(self.jobs[&alloc.job_id].spec.group.as_str()).or_insert(0) += alloc.gpu_count();
            }
            for (group, meter) in &self.tenancy.meters {
                if meter.running_gpus != running.get(group.as_str()).copied().unwrap_or(0) {
                    return Err(format!(
                        "group {group} is metered for {} GPUs but holds {:?}",
                        meter.running_gpus,
                        running.get(group.as_str())
                    ));
                }
            }
            if let Some(group) = running.keys().find(|g| !self.tenancy.meters.contains_key(**g)) {
                return Err(format!("group {group} holds GPUs but is not metered"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod approvals_tests;
#[cfg(test)]
mod tenancy_tests;
#[cfg(test)]
pub(crate) mod tests;
