//! Scheduling gauges derived from the applied state, published on every
//! replica (leader and followers alike), so a dashboard or an alert works
//! against whichever replica it scrapes.
//!
//! A task reads the state once a second under a short read lock: one pass
//! over jobs, allocations and nodes into a few small maps (`StateGauges`),
//! then publishes outside the lock. Nothing here runs in apply. Labels are
//! queues, groups, models and states: bounded by the configuration and the
//! inventory, never a job id.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use rota_core::state::tenancy::{month_of, month_text, BUDGET_WARN_RATIO};
use rota_core::state::{ClusterState, NodeState, TableUse};

use crate::Context;

/// How often the gauges are recomputed.
const EVERY_MS: u64 = 1_000;
/// The quota report builds the planner's view of every running job: done
/// every this many ticks only.
const QUOTA_EVERY_TICKS: u64 = 5;

/// What one reading of the state publishes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateGauges {
    /// (queue, group) -> (pending jobs, GPUs they ask for).
    pub pending: BTreeMap<(String, String), (u64, u64)>,
    /// queue -> age of its oldest pending job in seconds (0 when none; every
    /// configured queue is present).
    pub oldest_pending_s: BTreeMap<String, f64>,
    /// (group, model) -> GPUs held by live allocations.
    pub running: BTreeMap<(String, String), u64>,
    /// GPU state (free|allocated|unhealthy|down) -> count; a fenced GPU
    /// not allocated counts as unhealthy.
    pub gpus: BTreeMap<&'static str, u64>,
    /// GPUs not placeable for health: reported unhealthy or fenced.
    pub fenced: u64,
    /// Node state (ready|draining|down) -> count.
    pub nodes: BTreeMap<&'static str, u64>,
    /// Oldest last-heard age among Ready nodes, seconds (0 without any).
    pub heartbeat_age_max_s: f64,
    /// (group, month `YYYY-MM`) -> used / budget, for the budgets of the
    /// month holding `now_ms` (bounded by the budgets set).
    pub budget_used_ratio: BTreeMap<(String, String), f64>,
    /// group -> GPUs of its ranks that their agents report idle (committed
    /// idle records); every group holding GPUs is present, 0 when none.
    pub idle: BTreeMap<String, u64>,
    /// Each bounded table: (name, held, bound).
    pub tables: Vec<TableUse>,
}

/// GPU states, in the order they are judged.
pub const GPU_STATES: [&str; 4] = ["free", "allocated", "unhealthy", "down"];
const NODE_STATES: [NodeState; 3] = [NodeState::Ready, NodeState::Draining, NodeState::Down];

/// One pass over the state; `now_ms` is this replica's wall clock (ages of
/// pending jobs and heartbeats are meant for people, not decisions).
pub fn state_gauges(state: &ClusterState, now_ms: u64) -> StateGauges {
    let mut gauges = StateGauges::default();
    let mut oldest_submit_ms: BTreeMap<&str, u64> = BTreeMap::new();
    // Keyed by borrowed names during the walk: cloning two strings per
    // pending job made this once-a-second pass a few percent of a busy
    // leader at 100,000s of pending jobs; the owned keys are made once per
    // (queue, group) at the end.
    let mut pending: BTreeMap<(&str, &str), (u64, u64)> = BTreeMap::new();
    for job in state.pending() {
        let entry = pending.entry((job.spec.queue.as_str(), job.spec.group.as_str())).or_default();
        entry.0 += 1;
        entry.1 += job.spec.total_gpus();
        let oldest = oldest_submit_ms.entry(job.spec.queue.as_str()).or_insert(u64::MAX);
        *oldest = (*oldest).min(job.submitted_at_ms);
    }
    gauges.pending = pending.into_iter().map(|((queue, group), counts)| ((queue.to_string(), group.to_string()), counts)).collect();
    for queue in state.queues.keys() {
        gauges.oldest_pending_s.insert(queue.clone(), 0.0);
    }
    for (queue, submitted_ms) in oldest_submit_ms {
        gauges.oldest_pending_s.insert(queue.to_string(), now_ms.saturating_sub(submitted_ms) as f64 / 1000.0);
    }
    let mut running: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for alloc in state.allocs.values() {
        let Some(job) = state.jobs.get(&alloc.job_id) else { continue };
        for rank in &alloc.ranks {
            let node = state.nodes.get(&rank.node);
            for gpu in &rank.gpus {
                let model = node.and_then(|n| n.gpus.iter().find(|g| g.index == *gpu)).map_or("unknown", |g| g.model.as_str());
                *running.entry((job.spec.group.as_str(), model)).or_default() += 1;
            }
        }
        if !gauges.idle.contains_key(&job.spec.group) {
            gauges.idle.insert(job.spec.group.clone(), 0);
        }
    }
    gauges.running = running.into_iter().map(|((group, model), gpus)| ((group.to_string(), model.to_string()), gpus)).collect();
    gauges.idle.extend(state.idle_gpus_by_group());
    for name in GPU_STATES {
        gauges.gpus.insert(name, 0);
    }
    for node_state in NODE_STATES {
        gauges.nodes.insert(node_state.as_str(), 0);
    }
    let mut heartbeat_age_max_ms = 0;
    for node in state.nodes.values() {
        *gauges.nodes.entry(node.state.as_str()).or_default() += 1;
        if node.state == NodeState::Ready {
            let heard_ms = state.node_heard_ms.get(&node.name).copied().unwrap_or(node.registered_at_ms);
            heartbeat_age_max_ms = heartbeat_age_max_ms.max(now_ms.saturating_sub(heard_ms));
        }
        for gpu in &node.gpus {
            // Not placeable for health: reported unhealthy, or under a
            // fence (its own, its NVLink domain's or its node's).
            let unplaceable = !gpu.healthy || state.faults.is_fenced(&node.name, gpu);
            let gpu_state = if state.gpu_owner.contains_key(&(node.name.clone(), gpu.index)) {
                "allocated"
            } else if node.state != NodeState::Ready {
                "down"
            } else if unplaceable {
                "unhealthy"
            } else {
                "free"
            };
            *gauges.gpus.entry(gpu_state).or_default() += 1;
            if unplaceable {
                gauges.fenced += 1;
            }
        }
    }
    gauges.heartbeat_age_max_s = heartbeat_age_max_ms as f64 / 1000.0;
    let month = month_of(now_ms.max(state.now_ms));
    for (group, _) in state.tenancy.budgets.keys().filter(|(_, m)| *m == month) {
        if let Some(standing) = state.tenancy.standing(group, now_ms.max(state.now_ms)) {
            gauges.budget_used_ratio.insert((group.clone(), month_text(month)), standing.ratio());
        }
    }
    gauges.tables = state.table_use().to_vec();
    gauges
}

/// A budget crossing a threshold, once per (group, month, threshold).
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetWarning {
    pub group: String,
    pub month: String,
    pub ratio: f64,
    /// The threshold crossed: `BUDGET_WARN_RATIO` or 1.0 (spent).
    pub threshold: f64,
}

/// The warnings not given yet: `warned` remembers those given (bounded by
/// the budgets the replica saw; a month's entries go when its budget does).
pub fn budget_warnings(ratios: &BTreeMap<(String, String), f64>, warned: &mut BTreeSet<(String, String, u8)>) -> Vec<BudgetWarning> {
    warned.retain(|(group, month, _)| ratios.contains_key(&(group.clone(), month.clone())));
    let mut out = Vec::new();
    for ((group, month), &ratio) in ratios {
        for (level, threshold) in [(0u8, BUDGET_WARN_RATIO), (1u8, 1.0)] {
            if ratio >= threshold && warned.insert((group.clone(), month.clone(), level)) {
                out.push(BudgetWarning { group: group.clone(), month: month.clone(), ratio, threshold });
            }
        }
        if ratio < BUDGET_WARN_RATIO {
            // Raised again: warn again when it is next crossed.
            warned.remove(&(group.clone(), month.clone(), 0));
        }
        if ratio < 1.0 {
            warned.remove(&(group.clone(), month.clone(), 1));
        }
    }
    out
}

/// One group's quota figures for `rota_quota_gpus{group,kind}`, from the
/// core's quota report (`rota quota show`).
pub fn quota_gauges(state: &ClusterState) -> Vec<(String, &'static str, f64)> {
    let mut out = Vec::new();
    for line in rota_core::policy::quota_report(state) {
        out.push((line.group.clone(), "guarantee", line.guaranteed as f64));
        out.push((line.group.clone(), "used", line.used as f64));
        out.push((line.group.clone(), "borrowed", line.borrowed as f64));
        // Idle guarantee other groups may borrow now, and what they hold of it.
        out.push((line.group.clone(), "lendable", line.lendable as f64));
        out.push((line.group.clone(), "lent", line.lent as f64));
        // The most the group may hold: its guarantee plus its borrow limit
        // (absent: no limit).
        if let Some(limit) = line.borrow_limit {
            out.push((line.group.clone(), "limit", (line.guaranteed + u64::from(limit)) as f64));
        }
    }
    out
}

fn publish(gauges: &StateGauges) {
    for ((queue, group), (jobs, gpus)) in &gauges.pending {
        let labels = [("queue", queue.clone()), ("group", group.clone())];
        metrics::gauge!("rota_jobs_pending", &labels).set(*jobs as f64);
        metrics::gauge!("rota_gpus_pending", &labels).set(*gpus as f64);
    }
    for (queue, age_s) in &gauges.oldest_pending_s {
        metrics::gauge!("rota_job_oldest_pending_seconds", "queue" => queue.clone()).set(*age_s);
    }
    for ((group, model), gpus) in &gauges.running {
        metrics::gauge!("rota_gpus_running", "group" => group.clone(), "model" => model.clone()).set(*gpus as f64);
    }
    for (gpu_state, count) in &gauges.gpus {
        metrics::gauge!("rota_gpus", "state" => *gpu_state).set(*count as f64);
    }
    metrics::gauge!("rota_gpus_fenced").set(gauges.fenced as f64);
    for (node_state, count) in &gauges.nodes {
        metrics::gauge!("rota_nodes", "state" => *node_state).set(*count as f64);
    }
    metrics::gauge!("rota_node_heartbeat_age_max_seconds").set(gauges.heartbeat_age_max_s);
    for ((group, month), ratio) in &gauges.budget_used_ratio {
        metrics::gauge!("rota_budget_used_ratio", "group" => group.clone(), "month" => month.clone()).set(*ratio);
    }
    for (group, gpus) in &gauges.idle {
        metrics::gauge!("rota_gpus_idle", "group" => group.clone()).set(*gpus as f64);
    }
    for table in &gauges.tables {
        metrics::gauge!("rota_table_held", "table" => table.table).set(table.held as f64);
        metrics::gauge!("rota_table_limit", "table" => table.table).set(table.max as f64);
    }
}

/// Run for the life of the replica. Label sets that disappear (a queue with
/// nothing pending any more) stop being set and the exporter drops them
/// after its gauge idle timeout (see `lib.rs`).
pub async fn run(ctx: Arc<Context>) {
    let mut quota = Vec::new();
    let mut warned = BTreeSet::new();
    for tick in 0u64.. {
        let now_ms = crate::clock::wall_clock_ms();
        // A scan of every job takes tens of milliseconds at 100,000s of
        // jobs: under the state lock it held up apply (and with it every
        // acknowledgement) once a second. The copy is O(1); the scan runs
        // on it, off the lock and off the async workers.
        let frozen = ctx.read(|state| state.clone());
        let with_quota = tick % QUOTA_EVERY_TICKS == 0;
        let Ok((gauges, new_quota)) =
            tokio::task::spawn_blocking(move || (state_gauges(&frozen, now_ms), with_quota.then(|| quota_gauges(&frozen)))).await
        else {
            tracing::warn!("state metrics pass failed; retrying next tick");
            tokio::time::sleep(Duration::from_millis(EVERY_MS)).await;
            continue;
        };
        publish(&gauges);
        for warning in budget_warnings(&gauges.budget_used_ratio, &mut warned) {
            let (group, month, percent) = (&warning.group, &warning.month, warning.ratio * 100.0);
            if warning.threshold >= 1.0 {
                tracing::warn!(group, month, "GPU budget spent ({percent:.1} %): new jobs of the group are refused, pending ones wait");
            } else {
                tracing::warn!(group, month, "GPU budget at {percent:.1} % (warning at {:.0} %)", BUDGET_WARN_RATIO * 100.0);
            }
        }
        if let Some(new_quota) = new_quota {
            quota = new_quota;
        }
        for (group, kind, value) in &quota {
            metrics::gauge!("rota_quota_gpus", "group" => group.clone(), "kind" => *kind).set(*value);
        }
        tokio::time::sleep(Duration::from_millis(EVERY_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::faults::{Fence, FenceKind};
    use rota_core::state::{Allocation, GpuInfo, Job, JobSpec, JobState, Node, Priority, Rank, RankState};

    fn node(name: &str, state: NodeState, gpus: u32) -> Node {
        Node {
            name: name.into(),
            address: String::new(),
            rack: String::new(),
            leaf: String::new(),
            gpus: (0..gpus)
                .map(|index| GpuInfo {
                    index,
                    uuid: format!("{name}-{index}"),
                    model: "H100-80GB".into(),
                    memory_mib: 81_920,
                    healthy: index != 3,
                    nvlink_domain: None,
                })
                .collect(),
            state,
            registered_at_ms: 1_000,
        }
    }

    fn job(id: u64, queue: &str, group: &str, gpus: u32, state: JobState, submitted_at_ms: u64) -> Job {
        let spec = JobSpec {
            name: String::new(),
            group: group.into(),
            queue: queue.into(),
            priority: Priority::Medium,
            replicas: 2,
            gpus_per_replica: gpus,
            gpu_model: None,
            min_gpu_memory_mib: 0,
            command: vec!["true".into()],
            env: Default::default(),
            runtime_limit_s: 0,
            grace_period_s: 0,
            max_retries: 0,
            priority_ttl_s: 0,
        };
        Job {
            id,
            spec,
            request_id: None,
            state,
            submitted_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            attempts: 0,
            failures: 0,
            alloc: None,
            reason: Default::default(),
            estimated_start_ms: None,
            stop_reason: None,
            exit_code: None,
            checkpoint_at_ms: None,
            changed_at_index: 0,
            last_nodes: Box::default(),
        }
    }

    #[test]
    fn budget_warnings_are_given_once_per_threshold_and_again_after_a_raise() {
        let key = ("vision".to_string(), "2026-12".to_string());
        let mut warned = BTreeSet::new();
        let mut ratios = BTreeMap::from([(key.clone(), 0.5)]);
        assert!(budget_warnings(&ratios, &mut warned).is_empty());
        ratios.insert(key.clone(), 0.85);
        let first = budget_warnings(&ratios, &mut warned);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].threshold, BUDGET_WARN_RATIO);
        assert!(budget_warnings(&ratios, &mut warned).is_empty(), "once");
        ratios.insert(key.clone(), 1.0);
        assert_eq!(budget_warnings(&ratios, &mut warned).iter().map(|w| w.threshold).collect::<Vec<_>>(), vec![1.0]);
        ratios.insert(key.clone(), 0.4);
        assert!(budget_warnings(&ratios, &mut warned).is_empty());
        ratios.insert(key, 0.9);
        assert_eq!(budget_warnings(&ratios, &mut warned).len(), 1, "warned again after the budget was raised");
    }

    #[test]
    fn gauges_count_pending_running_and_gpu_states() {
        let mut state = ClusterState::default();
        state.nodes.insert("a".into(), node("a", NodeState::Ready, 8));
        state.nodes.insert("b".into(), node("b", NodeState::Down, 4));
        state.node_heard_ms.insert("a".into(), 50_000);
        state.jobs.insert(1, job(1, "training", "vision", 4, JobState::Pending, 10_000).into());
        state.jobs.insert(2, job(2, "training", "vision", 1, JobState::Pending, 40_000).into());
        let mut running = job(3, "short", "nlp", 1, JobState::Running, 0);
        running.alloc = Some(7);
        state.jobs.insert(3, running.into());
        state.index_jobs();
        let rank = |r: u32, gpu: u32| Rank { rank: r, node: "a".into(), gpus: vec![gpu], state: RankState::Running, exit_code: None };
        let alloc =
            Allocation { id: 7, job_id: 3, attempt: 1, ranks: vec![rank(0, 0), rank(1, 1)], master_port: 0, created_at_ms: 0, stop: None };
        state.allocs.insert(7, alloc);
        state.gpu_owner.insert(("a".into(), 0), 7);
        state.gpu_owner.insert(("a".into(), 1), 7);
        // GPU 5 of a is fenced for an XID (healthy as reported).
        let fence = Fence { kind: FenceKind::GpuReset, reason: "xid 48".into(), since_ms: 1_000 };
        state.faults.fences.entry("a".into()).or_default().gpus.insert(5, fence);

        let gauges = state_gauges(&state, 70_000);
        assert_eq!(gauges.pending[&("training".into(), "vision".into())], (2, 10));
        assert_eq!(gauges.oldest_pending_s["training"], 60.0);
        assert_eq!(gauges.oldest_pending_s["short"], 0.0, "every configured queue is present");
        assert_eq!(gauges.running[&("nlp".into(), "H100-80GB".into())], 2);
        // a: 2 allocated, GPU 3 unhealthy, GPU 5 fenced, 4 free; b (down): 4.
        assert_eq!(gauges.gpus["allocated"], 2);
        assert_eq!(gauges.gpus["unhealthy"], 2);
        assert_eq!(gauges.gpus["free"], 4);
        assert_eq!(gauges.gpus["down"], 4);
        assert_eq!(gauges.fenced, 3, "an unhealthy GPU on each node, and the fenced one");
        assert_eq!((gauges.nodes["ready"], gauges.nodes["down"], gauges.nodes["draining"]), (1, 1, 0));
        assert_eq!(gauges.heartbeat_age_max_s, 20.0);
    }

    #[test]
    fn every_bounded_table_is_published_beside_its_bound() {
        let mut state = ClusterState::default();
        state.limits.max_live_jobs = 10;
        state.nodes.insert("a".into(), node("a", NodeState::Ready, 8));
        state.jobs.insert(1, job(1, "training", "vision", 4, JobState::Pending, 10_000).into());
        state.live_jobs = 1;
        state.index_jobs();
        let gauges = state_gauges(&state, 20_000);
        let table = |name: &str| gauges.tables.iter().find(|t| t.table == name).map(|t| (t.held, t.max));
        assert_eq!(table("live_jobs"), Some((1, 10)));
        assert_eq!(table("nodes"), Some((1, 10_000)));
        assert_eq!(table("queues"), Some((state.queues.len() as u64, 64)));
        let names: Vec<&str> = gauges.tables.iter().map(|t| t.table).collect();
        assert_eq!(names, ["live_jobs", "finished_jobs", "spec_bytes", "nodes", "queues", "quotas"]);
    }
}
