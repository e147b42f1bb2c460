//! A synthetic cluster for the plan-pass benchmark: nodes under leaf
//! switches and racks, groups with quotas, running jobs on ~90% of the GPUs
//! (some for hours, with checkpoints), and a large pending backlog of mixed
//! shapes, queues and priorities. Built through `apply`, like a real state.

use crate::state::{
    ClusterState, Command, GpuInfo, GroupQuota, JobSpec, NodeRegistration, Placement, Plan, Priority, Proposal, RankPlacement, StateLimits,
};

/// splitmix64: a tiny deterministic generator (no RNG crate in the core).
pub struct Mix(u64);

impl Mix {
    pub fn new(seed: u64) -> Mix {
        Mix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

pub struct BenchShape {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub pending: u32,
    pub running: u32,
    pub groups: u32,
    pub seed: u64,
}

const HOUR_MS: u64 = 3_600_000;
const T0_MS: u64 = 1_700_000_000_000;

struct Builder {
    state: ClusterState,
    index: u64,
}

impl Builder {
    fn apply(&mut self, now_ms: u64, commands: Vec<Command>) {
        self.index += 1;
        self.state.apply_proposal(self.index, &Proposal { now_ms, commands });
    }
}

fn nodes(shape: &BenchShape) -> Vec<Command> {
    fleet_registrations(shape.nodes, shape.gpus_per_node)
}

/// Registrations of `count` nodes of `gpus_per_node` GPUs each, 32 nodes
/// to a leaf and 4 leaves to a rack; every fifth node holds A100s, a few
/// have an unhealthy GPU.
pub fn fleet_registrations(count: u32, gpus_per_node: u32) -> Vec<Command> {
    (0..count)
        .map(|i| {
            let leaf = i / 32;
            let rack = leaf / 4;
            Command::RegisterNode(NodeRegistration {
                name: format!("n{i:05}"),
                address: format!("10.{rack}.{leaf}.{i}"),
                rack: format!("r{rack:03}"),
                leaf: format!("l{leaf:04}"),
                gpus: (0..gpus_per_node)
                    .map(|g| GpuInfo {
                        index: g,
                        uuid: format!("GPU-{i}-{g}"),
                        model: if i % 5 == 4 { "A100-40GB" } else { "H100-80GB" }.into(),
                        memory_mib: if i % 5 == 4 { 40_960 } else { 81_920 },
                        healthy: !(i % 97 == 0 && g == 0),
                        nvlink_domain: Some(g / 4),
                    })
                    .collect(),
            })
        })
        .collect()
}

fn spec(mix: &mut Mix, shape: &BenchShape, running: bool) -> JobSpec {
    let roll = mix.below(100);
    let (replicas, per) = match (running, roll) {
        (true, 0..=94) | (false, 0..=69) => (1, 1),
        (true, 95..=97) | (false, 70..=84) => (1, 2),
        (true, 98) | (false, 85..=91) => (1, 4),
        (true, _) | (false, 92..=97) => (1, 8),
        (false, _) => (4, 8),
    };
    let queue = if per * replicas <= 8 && !running && mix.below(3) == 0 { "short" } else { "training" };
    let priority = [Priority::Low, Priority::Medium, Priority::Medium, Priority::High][mix.below(4) as usize];
    JobSpec {
        group: format!("g{:02}", mix.below(u64::from(shape.groups))),
        queue: queue.into(),
        priority,
        replicas,
        gpus_per_replica: per,
        gpu_model: if !running && mix.below(10) == 0 { Some("A100-40GB".into()) } else { None },
        runtime_limit_s: match (queue, running) {
            ("short", _) => 1800,
            (_, true) => 3600 * (13 + mix.below(36)),
            _ => 3600 * (1 + mix.below(48)),
        },
        ..JobSpec::simple(&["train.py"])
    }
}

/// First-fit placements of the running jobs, in batches an hour apart.
fn start_running(b: &mut Builder, mix: &mut Mix, shape: &BenchShape) {
    let names: Vec<String> = b.state.nodes.keys().cloned().collect();
    let mut free: Vec<Vec<u32>> = b.state.nodes.values().map(|n| n.gpus.iter().filter(|g| g.healthy).map(|g| g.index).collect()).collect();
    let batches = 10u64;
    // At least one a batch: a cluster with nothing running has no batches at all.
    let per_batch = shape.running.div_ceil(batches as u32).max(1) as usize;
    // Largest first, so first fit does not strand the 8-GPU jobs.
    let mut specs: Vec<JobSpec> = (0..shape.running).map(|_| spec(mix, shape, true)).collect();
    specs.sort_by_key(|s| std::cmp::Reverse(s.total_gpus()));
    let mut cursor = 0usize;
    for (batch, chunk) in specs.chunks(per_batch).enumerate() {
        let now = T0_MS + batch as u64 * HOUR_MS;
        let first = b.state.next_job_id;
        let submits = chunk.iter().map(|s| Command::SubmitJob { request_id: None, spec: s.clone() }).collect();
        b.apply(now, submits);
        let mut placements = Vec::new();
        for (k, s) in chunk.iter().enumerate() {
            let need = s.gpus_per_replica as usize;
            let Some(offset) = (0..names.len()).find(|o| free[(cursor + o) % names.len()].len() >= need) else {
                continue;
            };
            let n = (cursor + offset) % names.len();
            let gpus: Vec<u32> = free[n].drain(..need).collect();
            cursor = n;
            placements.push(Placement { job_id: first + k as u64, ranks: vec![RankPlacement { node: names[n].clone(), gpus }] });
        }
        b.apply(now, vec![Command::ApplyPlan(Plan { placements, ..Plan::default() })]);
    }
}

fn checkpoints(b: &mut Builder, now: u64) {
    let commands = b
        .state
        .allocs
        .values()
        .filter(|a| a.id % 3 != 0)
        .map(|a| Command::Checkpoint { alloc_id: a.id, at_ms: a.created_at_ms + (now - a.created_at_ms) / 2 })
        .collect();
    b.apply(now, commands);
}

/// The state to benchmark and the `now` to plan at.
pub fn build(shape: &BenchShape) -> (ClusterState, u64) {
    let limits = StateLimits { max_live_jobs: 1_000_000, ..StateLimits::default() };
    let mut b = Builder { state: ClusterState::new(limits), index: 0 };
    let mut mix = Mix::new(shape.seed);
    b.apply(T0_MS, nodes(shape));
    let total = u64::from(shape.nodes) * u64::from(shape.gpus_per_node);
    let quotas = (0..shape.groups)
        .map(|g| {
            let gpus = (total * 8 / 10 / u64::from(shape.groups)) as u32;
            Command::SetQuota(GroupQuota { group: format!("g{g:02}"), gpus, lend: true, ..GroupQuota::default() })
        })
        .collect();
    b.apply(T0_MS, quotas);
    start_running(&mut b, &mut mix, shape);
    let pending_start = T0_MS + 10 * HOUR_MS;
    let chunk = 1000u32;
    for c in 0..shape.pending.div_ceil(chunk) {
        let n = chunk.min(shape.pending - c * chunk);
        let submits = (0..n).map(|_| Command::SubmitJob { request_id: None, spec: spec(&mut mix, shape, false) }).collect();
        b.apply(pending_start + u64::from(c) * 60_000, submits);
    }
    let now = T0_MS + 12 * HOUR_MS;
    checkpoints(&mut b, now);
    (b.state, now)
}

/// Apply only the pending notes of a plan, so the next pass sees the
/// reasons it would find in steady state.
pub fn settle_notes(state: &mut ClusterState, plan: &Plan, now: u64) {
    let notes = Plan { computed_at_index: plan.computed_at_index, pending: plan.pending.clone(), ..Plan::default() };
    let index = state.applied_index + 1;
    state.apply_proposal(index, &Proposal { now_ms: now, commands: vec![Command::ApplyPlan(notes)] });
}

/// Submits or cancels per log entry in [`build_history`], as the leader
/// batches concurrent requests.
pub const HISTORY_COMMANDS_PER_ENTRY: u64 = 256;

/// A job spec of a typical size for the history benchmarks (about 150
/// bytes of name, command and environment).
pub fn history_spec(i: u64) -> JobSpec {
    let mut spec = JobSpec::simple(&["python", "train.py", "--lr", "0.1"]);
    spec.name = format!("train-{i}");
    spec.env.insert("EPOCHS".into(), "90".into());
    spec
}

/// A state of a long-lived cluster without nodes: `finished` jobs
/// submitted and cancelled, then `pending` jobs waiting, every table sized
/// to keep them all. Built through `apply`, with a request id per submit.
/// Returns it with the next free log index.
pub fn build_history(finished: u64, pending: u64) -> (ClusterState, u64) {
    let limits = StateLimits {
        max_finished_jobs: finished.max(1) as usize,
        max_live_jobs: (finished + pending + 1) as usize,
        max_spec_bytes: 1 << 40,
        ..StateLimits::default()
    };
    let mut state = ClusterState::new(limits);
    let mut index = 1;
    finish_history(&mut state, &mut index, finished);
    submit_history(&mut state, &mut index, pending);
    (state, index)
}

/// Submit `count` jobs of [`history_spec`] and cancel them, in full entries
/// (each entry's time is its index, never behind the state's clock).
pub fn finish_history(state: &mut ClusterState, index: &mut u64, count: u64) {
    let first = state.next_job_id;
    submit_history(state, index, count);
    let mut job = first;
    while job < first + count {
        let last = (job + HISTORY_COMMANDS_PER_ENTRY).min(first + count);
        let commands = (job..last).map(|job_id| Command::CancelJob { job_id }).collect();
        state.apply_proposal(*index, &Proposal { now_ms: state.now_ms.max(*index), commands });
        *index += 1;
        job = last;
    }
}

/// A request id shaped as the CLI's (`cli-` and 32 hex digits), distinct
/// per job: the ids a held job carries are as long as real ones.
pub fn history_request_id(n: u64) -> String {
    format!("cli-{:032x}", u128::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

/// Submit `count` more jobs of [`history_spec`] in full entries.
pub fn submit_history(state: &mut ClusterState, index: &mut u64, count: u64) {
    let mut left = count;
    while left > 0 {
        let batch = left.min(HISTORY_COMMANDS_PER_ENTRY);
        let base = state.next_job_id;
        let commands = (0..batch)
            .map(|k| Command::SubmitJob { request_id: Some(history_request_id(base + k)), spec: history_spec(base + k) })
            .collect();
        state.apply_proposal(*index, &Proposal { now_ms: state.now_ms.max(*index), commands });
        *index += 1;
        left -= batch;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_with_nothing_running_builds_with_its_pending_jobs() {
        let shape = BenchShape { nodes: 4, gpus_per_node: 8, pending: 100, running: 0, groups: 2, seed: 1 };
        let (state, _) = build(&shape);
        assert_eq!(state.pending().count(), 100);
        assert_eq!(state.nodes.len(), 4);
        assert!(state.jobs.values().all(|job| job.state == crate::state::JobState::Pending));
    }
}
