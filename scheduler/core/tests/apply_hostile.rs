//! apply under hostile input: random sequences of every command, with ids,
//! ranks, nodes and GPU sets that may not exist, plans that conflict with
//! the state, nodes that register again with other GPUs, and times that jump
//! back and forth. apply must never panic, every refusal must say what it is
//! about, and the state's invariants must hold after every entry.
//!
//! Nothing here is random at run time: each seed gives the same sequence.

use std::collections::BTreeMap;

use rota_core::policy;
use rota_core::sim::bench::Mix;
use rota_core::state::{
    AlarmKind, ClusterState, Command, CommandResult, GpuInfo, GroupQuota, JobSpec, NodeRegistration, PendingNote, Placement, Plan,
    Priority, Proposal, QueueConfig, RankPlacement, Rejection, StateLimits, Stop, StopReason,
};

const NODES: u64 = 4;

fn pick<'a, T>(mix: &mut Mix, items: &'a [T]) -> &'a T {
    &items[mix.below(items.len() as u64) as usize]
}

fn registration(mix: &mut Mix) -> NodeRegistration {
    let name = format!("n{}", mix.below(NODES + 1));
    let count = mix.below(9) as u32;
    let mut gpus: Vec<GpuInfo> = (0..count)
        .map(|i| GpuInfo {
            index: if mix.below(20) == 0 { i + 100 } else { i },
            // Now and then a GPU comes back under another UUID (a swap).
            uuid: format!("GPU-{name}-{i}-{}", mix.below(2)),
            model: pick(mix, &["H100", "A100"]).to_string(),
            memory_mib: 81_920,
            healthy: mix.below(10) != 0,
            nvlink_domain: Some(i / 4),
        })
        .collect();
    if mix.below(15) == 0 && !gpus.is_empty() {
        let copy = gpus[0].clone();
        gpus.push(copy); // a duplicate index: must be refused
    }
    NodeRegistration { name, address: "127.0.0.1".into(), rack: "r1".into(), leaf: "l1".into(), gpus }
}

fn spec(mix: &mut Mix) -> JobSpec {
    let mut spec = JobSpec::simple(&["train"]);
    spec.replicas = mix.below(3) as u32; // 0 is invalid
    spec.gpus_per_replica = mix.below(5) as u32;
    spec.group = pick(mix, &["a", "b", "", "bad group"]).to_string();
    spec.queue = pick(mix, &["training", "short", "service", "nope"]).to_string();
    spec.priority = *pick(mix, &[Priority::Low, Priority::Medium, Priority::High]);
    if mix.below(10) == 0 {
        spec.env.insert("RANK".into(), "7".into());
    }
    spec
}

fn plan(mix: &mut Mix, state: &ClusterState, now_ms: u64) -> Plan {
    if mix.below(2) == 0 {
        return policy::plan(state, now_ms); // an honest plan, maybe stale by the time it applies
    }
    let job_id = mix.below(state.next_job_id + 2);
    let ranks = (0..mix.below(3))
        .map(|_| RankPlacement {
            node: format!("n{}", mix.below(NODES + 1)),
            gpus: (0..mix.below(4)).map(|_| mix.below(10) as u32).collect(),
        })
        .collect();
    let stop =
        Stop { alloc_id: mix.below(state.next_alloc_id + 2), reason: *pick(mix, &[StopReason::Preempted, StopReason::RuntimeLimit]) };
    let note =
        PendingNote { job_id: mix.below(state.next_job_id + 2), reason: Default::default(), estimated_start_ms: Some(mix.next_u64()) };
    Plan { computed_at_index: state.applied_index, placements: vec![Placement { job_id, ranks }], stops: vec![stop], pending: vec![note] }
}

fn command(mix: &mut Mix, state: &ClusterState, now_ms: u64) -> Command {
    let alloc_id = mix.below(state.next_alloc_id + 2);
    let node = format!("n{}", mix.below(NODES + 1));
    match mix.below(12) {
        0 | 1 => Command::SubmitJob { request_id: Some(format!("r{}", mix.below(50))), spec: spec(mix) },
        2 => Command::CancelJob { job_id: mix.below(state.next_job_id + 2) },
        3 => Command::RegisterNode(registration(mix)),
        4 => Command::NodeHealth { node, unhealthy_gpus: (0..mix.below(3)).map(|_| mix.below(10) as u32).collect() },
        5 => Command::DrainNode { node, drain: mix.below(2) == 0 },
        6 => Command::NodeDown { node },
        7 | 8 => Command::ApplyPlan(plan(mix, state, now_ms)),
        9 => Command::AllocStarted { alloc_id, rank: mix.below(3) as u32 },
        10 if mix.below(4) == 0 => Command::AllocLost { alloc_id, rank: mix.below(3) as u32 },
        10 => Command::AllocExited { alloc_id, rank: mix.below(3) as u32, exit_code: *pick(mix, &[0, 1, -9, 137]) },
        _ => match mix.below(6) {
            0 => Command::Checkpoint { alloc_id, at_ms: mix.next_u64() },
            3 => Command::SetClusterVersion { version: mix.below(6) as u16 },
            4 => Command::SetAlarm { replica: mix.below(4), kind: AlarmKind::NoSpace, raised: mix.below(3) == 0 },
            5 => Command::NodesHeard { nodes: (0..mix.below(3)).map(|_| format!("n{}", mix.below(NODES + 2))).collect() },
            1 => Command::SetQueue(QueueConfig { weight: mix.below(3) as u32, ..QueueConfig::defaults()[1].clone() }),
            _ => Command::SetQuota(GroupQuota {
                group: pick(mix, &["a", "b", ""]).to_string(),
                gpus: mix.below(16) as u32,
                per_model: BTreeMap::new(),
                lend: true,
                lend_to: vec![],
                borrow_limit: None,
            }),
        },
    }
}

fn refusal_names_something(rejection: &Rejection) -> bool {
    match rejection {
        Rejection::Invalid { field, message } => !field.is_empty() && !message.is_empty(),
        Rejection::NotFound { what } | Rejection::Exhausted { what, .. } => !what.is_empty(),
        Rejection::RequestIdReused { request_id, .. } => !request_id.is_empty(),
        Rejection::Conflict { message }
        | Rejection::Alarmed { message }
        | Rejection::PermissionDenied { message }
        | Rejection::BudgetExhausted { message } => !message.is_empty(),
    }
}

#[test]
fn hostile_command_sequences_never_panic_and_keep_the_invariants() {
    for seed in 0..40 {
        let mut mix = Mix::new(seed);
        let limits = StateLimits { max_live_jobs: 60, max_finished_jobs: 20, dedupe_capacity: 30, ..StateLimits::default() };
        let mut state = ClusterState::new(limits);
        let mut now_ms = 1_700_000_000_000u64;
        for index in 1..=400u64 {
            // Leader clocks differ: time may jump ahead or back.
            now_ms = if mix.below(10) == 0 { now_ms.saturating_sub(mix.below(60_000)) } else { now_ms + mix.below(30_000) };
            let commands: Vec<Command> = (0..1 + mix.below(4)).map(|_| command(&mut mix, &state, now_ms)).collect();
            let results = state.apply_proposal(index, &Proposal { now_ms, commands });
            for result in &results {
                if let CommandResult::Rejected(rejection) = result {
                    assert!(refusal_names_something(rejection), "seed {seed} entry {index}: {rejection:?}");
                }
            }
            if let Err(broken) = state.check_invariants() {
                panic!("seed {seed} entry {index}: {broken}");
            }
        }
    }
}
