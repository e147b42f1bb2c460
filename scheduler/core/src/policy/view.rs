//! A read-only, indexed view of the state for one pass: nodes numbered in
//! name order, their free GPUs, node classes (GPU model and memory), topology
//! ids, and the running allocations with what preemption and reservations
//! need to know about them.

use std::collections::BTreeMap;

use crate::state::gpu_model::model_matches;
use crate::state::{AllocId, ClusterState, GpuInfo, JobId, JobSpec, NodeState, Priority, QueueConfig};

use super::fasthash::FastMap;

use super::priority::effective_priority;

/// A free GPU on a node: its index and NVLink domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeGpu {
    pub index: u32,
    pub nvlink: Option<u32>,
}

/// What the policy knows of a node. Nodes are treated as homogeneous: the
/// class is the model of their first GPU and the smallest memory among them.
#[derive(Debug, Clone)]
pub struct NodeView<'a> {
    pub name: &'a str,
    pub class: u32,
    pub leaf: u32,
    pub rack: u32,
    /// Free, healthy GPUs of a Ready node (empty for other nodes).
    pub free: Vec<FreeGpu>,
    /// Healthy, unfenced GPUs of a Ready node, free or not (what a job
    /// could ever get).
    pub usable: u32,
    /// Healthy GPUs of a Ready node that a fence keeps off limits.
    pub fenced: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeClass {
    pub model: String,
    pub memory_mib: u64,
}

/// A running (or stopping) allocation.
#[derive(Debug, Clone)]
pub struct RunningView<'a> {
    pub alloc_id: AllocId,
    pub job_id: JobId,
    pub group: &'a str,
    /// Interned by the quota book.
    pub group_id: u32,
    pub queue_weight: u32,
    pub priority: Priority,
    pub preemptible: bool,
    /// Preemptible from this time on (protected runtime over).
    pub protected_until_ms: u64,
    /// When it ends at the latest (start + runtime limit; now if stopping).
    pub end_ms: u64,
    /// Start + runtime limit.
    pub deadline_ms: u64,
    pub stopping: bool,
    /// GPUs per node index, counting only healthy GPUs of Ready nodes
    /// (the ones that become free for others when it ends).
    pub release: Vec<(u32, u32)>,
    pub gpus: u64,
    /// GPU-milliseconds since the last checkpoint (or the start).
    pub work_lost_gpu_ms: u64,
    /// The GPU model the job asked for (per-model quota accounting).
    pub model: Option<&'a str>,
}

pub struct View<'a> {
    pub nodes: Vec<NodeView<'a>>,
    pub node_index: FastMap<&'a str, u32>,
    pub classes: Vec<NodeClass>,
    pub leaves: usize,
    pub racks: usize,
    pub running: Vec<RunningView<'a>>,
    refs: Vec<&'a crate::state::Node>,
    faults: &'a crate::state::faults::FaultState,
    /// Largest number of GPUs on one node (bounds the pool's buckets).
    pub max_gpus_per_node: u32,
    /// The first fenced node (name order) and its fence's reason, for the
    /// reasons of jobs that fenced capacity keeps waiting.
    pub fence_example: Option<(&'a str, &'a str)>,
    /// Model names match by alias (`state::gpu_model`), as apply does.
    pub model_aliases: bool,
}

fn node_class(gpus: &[GpuInfo]) -> NodeClass {
    let model = gpus.first().map(|g| g.model.clone()).unwrap_or_default();
    let memory_mib = gpus.iter().map(|g| g.memory_mib).min().unwrap_or(0);
    NodeClass { model, memory_mib }
}

impl<'a> View<'a> {
    pub fn build(state: &'a ClusterState, now_ms: u64) -> View<'a> {
        let mut classes: Vec<NodeClass> = Vec::new();
        let mut leaf_ids: BTreeMap<(&str, &str), u32> = BTreeMap::new();
        let mut rack_ids: BTreeMap<&str, u32> = BTreeMap::new();
        let mut nodes = Vec::with_capacity(state.nodes.len());
        let mut node_index = FastMap::default();
        let mut max_gpus_per_node = 0;
        let mut fence_example = None;
        let mut owners = state.gpu_owner.keys().map(|(n, i)| (n, i)).peekable();
        for node in state.nodes.values() {
            let class = node_class(&node.gpus);
            let class_id = match classes.iter().position(|c| *c == class) {
                Some(i) => i as u32,
                None => {
                    classes.push(class);
                    (classes.len() - 1) as u32
                }
            };
            let next_rack = rack_ids.len() as u32;
            let rack = *rack_ids.entry(node.rack.as_str()).or_insert(next_rack);
            let next_leaf = leaf_ids.len() as u32;
            let leaf = *leaf_ids.entry((node.rack.as_str(), node.leaf.as_str())).or_insert(next_leaf);
            let ready = node.state == NodeState::Ready;
            let fence_of = |g: &GpuInfo| state.faults.fence_of(&node.name, g);
            let usable = if ready { node.gpus.iter().filter(|g| g.healthy && fence_of(g).is_none()).count() as u32 } else { 0 };
            let fenced = if ready { node.gpus.iter().filter(|g| g.healthy && fence_of(g).is_some()).count() as u32 } else { 0 };
            if fence_example.is_none() {
                fence_example = node.gpus.iter().find_map(fence_of).map(|f| (node.name.as_str(), f.reason.as_str()));
            }
            // gpu_owner and nodes are both in node-name order: one merge walk.
            let mut owned: Vec<u32> = Vec::new();
            while let Some(&(owner, index)) = owners.peek() {
                match owner.as_str().cmp(node.name.as_str()) {
                    std::cmp::Ordering::Less => {}
                    std::cmp::Ordering::Equal => owned.push(*index),
                    std::cmp::Ordering::Greater => break,
                }
                owners.next();
            }
            let free = node
                .gpus
                .iter()
                .filter(|g| ready && g.healthy && fence_of(g).is_none() && !owned.contains(&g.index))
                .map(|g| FreeGpu { index: g.index, nvlink: g.nvlink_domain })
                .collect::<Vec<_>>();
            let mut free = free;
            free.sort_by_key(|g| g.index);
            max_gpus_per_node = max_gpus_per_node.max(node.gpus.len() as u32);
            node_index.insert(node.name.as_str(), nodes.len() as u32);
            nodes.push(NodeView { name: node.name.as_str(), class: class_id, leaf, rack, free, usable, fenced });
        }
        let mut view = View {
            nodes,
            node_index,
            classes,
            leaves: leaf_ids.len(),
            racks: rack_ids.len(),
            running: Vec::new(),
            refs: state.nodes.values().collect(),
            faults: &state.faults,
            max_gpus_per_node,
            fence_example,
            model_aliases: state.model_aliases(),
        };
        view.running = view.running_allocs(state, now_ms);
        view
    }

    fn running_allocs(&self, state: &'a ClusterState, now_ms: u64) -> Vec<RunningView<'a>> {
        let mut out = Vec::with_capacity(state.allocs.len());
        let queues: FastMap<&str, &QueueConfig> = state.queues.iter().map(|(n, q)| (n.as_str(), q)).collect();
        for alloc in state.allocs.values() {
            let Some(job) = state.jobs.get(&alloc.job_id) else {
                continue;
            };
            let queue = queues.get(job.spec.queue.as_str()).copied();
            let limit_s = match job.spec.runtime_limit_s {
                0 => queue.map_or(24 * 3600, |q| q.default_runtime_s),
                s => s,
            };
            let limit_ms = limit_s.saturating_mul(1000);
            let stopping = alloc.stop.is_some();
            // Not yet limited while a rank waits to start (see `run_clock`).
            let deadline_ms = match crate::state::run_clock::limit_counts_from_ms(state, alloc) {
                Some(since_ms) => since_ms.saturating_add(limit_ms),
                None => now_ms.saturating_add(limit_ms),
            };
            let end_ms = if stopping { now_ms } else { deadline_ms.max(now_ms) };
            let mut release: Vec<(u32, u32)> = Vec::with_capacity(alloc.ranks.len());
            for rank in &alloc.ranks {
                let Some(&n) = self.node_index.get(rank.node.as_str()) else {
                    continue;
                };
                let count = self.releasable(self.refs[n as usize], &rank.gpus);
                match release.iter_mut().find(|(m, _)| *m == n) {
                    Some(entry) => entry.1 += count,
                    None => release.push((n, count)),
                }
            }
            let since = job.checkpoint_at_ms.unwrap_or(0).max(alloc.created_at_ms);
            let gpus = alloc.gpu_count();
            out.push(RunningView {
                alloc_id: alloc.id,
                job_id: job.id,
                group: job.spec.group.as_str(),
                group_id: 0,
                queue_weight: queue.map_or(1, |q| q.weight),
                priority: effective_priority(job, now_ms),
                preemptible: queue.is_some_and(|q| q.preemptible),
                protected_until_ms: alloc.created_at_ms.saturating_add(queue.map_or(0, |q| q.protected_runtime_s).saturating_mul(1000)),
                end_ms,
                deadline_ms,
                stopping,
                release,
                gpus,
                work_lost_gpu_ms: gpus * now_ms.saturating_sub(since),
                model: job.spec.gpu_model.as_deref(),
            });
        }
        out
    }

    fn releasable(&self, node: &crate::state::Node, gpus: &[u32]) -> u32 {
        if node.state != NodeState::Ready {
            return 0;
        }
        gpus.iter().filter(|&&i| node.gpus.iter().any(|g| g.index == i && g.healthy && !self.faults.is_fenced(&node.name, g))).count()
            as u32
    }

    /// Node classes a job can run on (model and memory constraints).
    pub fn matching_classes(&self, spec: &JobSpec) -> Vec<u32> {
        self.classes
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                let model_ok = spec.gpu_model.as_ref().is_none_or(|m| model_matches(m, &c.model, self.model_aliases));
                model_ok && c.memory_mib >= spec.min_gpu_memory_mib
            })
            .map(|(i, _)| i as u32)
            .collect()
    }

    pub fn free_total(&self) -> u64 {
        self.nodes.iter().map(|n| n.free.len() as u64).sum()
    }

    /// GPUs a job could be given at all: healthy GPUs of Ready nodes plus
    /// those held by allocations (the quota book's capacity).
    pub fn capacity(&self) -> u64 {
        self.nodes.iter().map(|n| u64::from(n.usable)).sum()
    }
}
