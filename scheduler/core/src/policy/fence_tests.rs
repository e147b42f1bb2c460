//! The policy and fenced capacity: nothing is placed on it, and a job it
//! keeps waiting says so.

use crate::state::ClusterState;
use crate::state::{
    codec, Command, CommandResult, GpuInfo, JobSpec, NodeRegistration, Placement, Plan, Proposal, RankPlacement, ReasonCode,
};

fn run(state: &mut ClusterState, commands: Vec<Command>) -> Vec<CommandResult> {
    let index = state.applied_index + 1;
    let now_ms = state.now_ms + 1_000;
    let results = state.apply_proposal(index, &Proposal { now_ms, commands });
    state.check_invariants().expect("invariants hold after every entry");
    results
}

fn node(name: &str) -> Command {
    let gpus = (0..8)
        .map(|index| GpuInfo {
            index,
            uuid: format!("GPU-{name}-{index}"),
            model: "H100-80GB".into(),
            memory_mib: 81_920,
            healthy: true,
            nvlink_domain: Some(0),
        })
        .collect();
    Command::RegisterNode(NodeRegistration { name: name.into(), address: "127.0.0.1".into(), rack: "r1".into(), leaf: "l1".into(), gpus })
}

fn submit(replicas: u32, gpus_per_replica: u32) -> Command {
    Command::SubmitJob { request_id: None, spec: JobSpec { replicas, gpus_per_replica, ..JobSpec::simple(&["train.py"]) } }
}

fn xid(node: &str, gpu: u32, xid: u32) -> Command {
    Command::GpuXid { node: node.into(), gpu, xid, at_ms: 1_796_073_307_000 }
}

#[test]
fn the_policy_never_places_on_fenced_capacity_and_why_names_the_fence() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::SetClusterVersion { version: codec::FORMAT_VERSION }, node("a"), node("b")]);
    run(&mut state, vec![xid("a", 0, 79), submit(2, 8), submit(1, 8)]);
    let plan = super::plan(&state, state.now_ms);
    assert_eq!(plan.placements.len(), 1, "{plan:?}");
    assert!(plan.placements[0].ranks.iter().all(|r| r.node == "b"));
    let note = plan.pending.iter().find(|n| n.job_id == 1).expect("the gang waits");
    assert_eq!(note.reason.code, ReasonCode::Fenced);
    assert!(note.reason.detail.contains("node a: xid 79"), "{}", note.reason);
    assert_eq!(Command::ApplyPlan(plan.clone()).min_format(), 6, "a fenced reason needs format 6");
    run(&mut state, vec![Command::ApplyPlan(plan)]);
    assert!(super::why(&state, 1).unwrap().reason.contains("fenced"));
    // Apply re-checks: a plan computed before a fence is refused.
    run(&mut state, vec![xid("b", 7, 95), submit(1, 1)]);
    let stale = Plan {
        placements: vec![Placement { job_id: 3, ranks: vec![RankPlacement { node: "b".into(), gpus: vec![7] }] }],
        ..Plan::default()
    };
    assert_eq!(run(&mut state, vec![Command::ApplyPlan(stale)]), vec![CommandResult::PlanApplied { placed: 0, rejected: 1, stopped: 0 }]);
}

#[test]
fn a_gpu_fenced_for_a_reset_is_skipped_and_its_node_keeps_taking_work() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::SetClusterVersion { version: codec::FORMAT_VERSION }, node("a"), node("b")]);
    // Node b is busy; node a has one GPU fenced for a reset.
    run(&mut state, vec![submit(1, 8), xid("a", 3, 48)]);
    let plan = super::plan(&state, state.now_ms);
    run(&mut state, vec![Command::ApplyPlan(plan)]);
    assert_eq!(state.jobs[&1].alloc.map(|a| state.allocs[&a].ranks[0].node.clone()).as_deref(), Some("b"));
    run(&mut state, vec![submit(1, 8), submit(1, 2)]);
    let plan = super::plan(&state, state.now_ms);
    assert!(plan.placements.iter().all(|p| p.job_id != 2), "8 GPUs on a only with the fenced one: {plan:?}");
    assert!(plan.placements.iter().any(|p| p.job_id == 3 && p.ranks[0].node == "a" && !p.ranks[0].gpus.contains(&3)));
}
