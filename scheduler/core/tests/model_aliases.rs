//! GPU model aliases: the planner and apply use one rule, and only from
//! the cluster version whose replicas all have it.

use std::collections::BTreeSet;

use rota_core::policy;
use rota_core::state::codec::FIRST_FORMAT_VERSION;
use rota_core::state::gpu_model::ALIASES_FROM_VERSION;
use rota_core::state::*;

fn h200_node() -> NodeRegistration {
    NodeRegistration {
        name: "h".into(),
        address: "127.0.0.1".into(),
        rack: "r1".into(),
        leaf: "l1".into(),
        gpus: (0..8)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-h-{index}"),
                model: "H200-140GB".into(),
                memory_mib: 143_771,
                healthy: true,
                nvlink_domain: Some(0),
            })
            .collect(),
    }
}

fn run(state: &mut ClusterState, commands: Vec<Command>) -> Vec<CommandResult> {
    let index = state.applied_index + 1;
    let now_ms = state.now_ms + 1_000;
    let results = state.apply_proposal(index, &Proposal { now_ms, commands });
    state.check_invariants().expect("invariants hold after every entry");
    results
}

fn submit(state: &mut ClusterState, request_id: &str, model: &str) -> JobId {
    let spec = JobSpec { gpu_model: Some(model.into()), gpus_per_replica: 2, ..JobSpec::simple(&["train.py"]) };
    match run(state, vec![Command::SubmitJob { request_id: Some(request_id.into()), spec }]).remove(0) {
        CommandResult::Submitted { job_id, .. } => job_id,
        other => panic!("submit of a {model} job: {other:?}"),
    }
}

/// A job asking for the size a GPU is sold as (`H200-141GB`) or its family
/// (`h200`) runs on the GPU rota names `H200-140GB` once the cluster's
/// version has the alias rule; before, the planner offers nothing and
/// apply refuses a placement a newer leader would propose, so replicas of
/// two builds never disagree.
#[test]
fn model_aliases_match_from_their_cluster_version_in_plan_and_apply_alike() {
    for version in [FIRST_FORMAT_VERSION, ALIASES_FROM_VERSION] {
        let mut state = ClusterState { cluster_version: version, ..ClusterState::default() };
        run(&mut state, vec![Command::RegisterNode(h200_node())]);
        let sold = submit(&mut state, "r1", "H200-141GB");
        let family = submit(&mut state, "r2", "h200");
        let exact = submit(&mut state, "r3", "H200-140GB");
        let other_part = submit(&mut state, "r4", "H200-94GB");
        let planned: BTreeSet<JobId> = policy::plan(&state, state.now_ms).placements.iter().map(|p| p.job_id).collect();
        let aliases = version >= ALIASES_FROM_VERSION;
        let expected: BTreeSet<JobId> = if aliases { [sold, family, exact].into() } else { [exact].into() };
        assert_eq!(planned, expected, "at cluster version {version}");
        assert!(!planned.contains(&other_part));
        let rank = RankPlacement { node: "h".into(), gpus: vec![0, 1] };
        let proposed = Plan { placements: vec![Placement { job_id: sold, ranks: vec![rank] }], ..Plan::default() };
        let result = run(&mut state, vec![Command::ApplyPlan(proposed)]).remove(0);
        let CommandResult::PlanApplied { placed, rejected, .. } = result else { panic!("{result:?}") };
        assert_eq!((placed, rejected), if aliases { (1, 0) } else { (0, 1) }, "at cluster version {version}");
        assert_eq!(state.jobs[&sold].state == JobState::Running, aliases);
    }
}
