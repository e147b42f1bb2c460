//! Randomised clusters (mixed GPU models, unhealthy GPUs, drained nodes,
//! quotas, gangs, priorities, queues) driven for many passes: every plan must
//! be accepted whole by apply (no placement refused, so the free-GPU index
//! never disagrees with the state), invariants must hold, and the same state
//! must always give the same plan.

use rota_core::policy;
use rota_core::sim::bench::Mix;
use rota_core::state::{
    ClusterState, Command, CommandResult, GpuInfo, GroupQuota, JobSpec, NodeRegistration, Priority, Proposal, RankState,
};

struct World {
    state: ClusterState,
    index: u64,
    now_s: u64,
}

impl World {
    fn apply(&mut self, commands: Vec<Command>) -> Vec<CommandResult> {
        self.index += 1;
        let results = self.state.apply_proposal(self.index, &Proposal { now_ms: self.now_s * 1000, commands });
        self.state.check_invariants().expect("invariants hold");
        results
    }
}

fn cluster(mix: &mut Mix) -> Vec<Command> {
    let nodes = 2 + mix.below(6) as u32;
    let mut commands = Vec::new();
    for i in 0..nodes {
        let gpus = [4, 8, 8][mix.below(3) as usize];
        let a100 = mix.below(3) == 0;
        let name = format!("n{i}");
        commands.push(Command::RegisterNode(NodeRegistration {
            name: name.clone(),
            address: "127.0.0.1".into(),
            rack: format!("r{}", i / 4),
            leaf: format!("l{}", i / 2),
            gpus: (0..gpus)
                .map(|g| GpuInfo {
                    index: g,
                    uuid: format!("{name}-{g}"),
                    model: if a100 { "A100" } else { "H100" }.into(),
                    memory_mib: if a100 { 40_960 } else { 81_920 },
                    healthy: true,
                    nvlink_domain: Some(g / 4),
                })
                .collect(),
        }));
        if mix.below(5) == 0 {
            commands.push(Command::NodeHealth { node: name.clone(), unhealthy_gpus: vec![mix.below(4) as u32] });
        }
        if mix.below(8) == 0 {
            commands.push(Command::DrainNode { node: name, drain: true });
        }
    }
    for (g, group) in ["a", "b", "c"].into_iter().enumerate() {
        commands.push(Command::SetQuota(GroupQuota {
            group: group.into(),
            gpus: mix.below(12) as u32,
            lend: g != 2 || mix.below(2) == 0,
            lend_to: if mix.below(4) == 0 { vec!["a".into()] } else { vec![] },
            borrow_limit: if mix.below(3) == 0 { Some(mix.below(8) as u32) } else { None },
            ..GroupQuota::default()
        }));
    }
    commands
}

fn job(mix: &mut Mix) -> JobSpec {
    let (replicas, per) = [(1, 1), (1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (3, 2)][mix.below(8) as usize];
    let short = replicas * per <= 8 && mix.below(3) == 0;
    JobSpec {
        group: ["a", "b", "c", "d"][mix.below(4) as usize].into(),
        queue: if short { "short" } else { ["training", "training", "service"][mix.below(3) as usize] }.into(),
        priority: [Priority::Low, Priority::Medium, Priority::High][mix.below(3) as usize],
        replicas,
        gpus_per_replica: per,
        gpu_model: match mix.below(6) {
            0 => Some("A100".into()),
            1 => Some("V100".into()),
            _ => None,
        },
        min_gpu_memory_mib: if mix.below(8) == 0 { 65_536 } else { 0 },
        runtime_limit_s: if short { 600 * (1 + mix.below(4)) } else { 1800 * (1 + mix.below(16)) },
        priority_ttl_s: if mix.below(5) == 0 { 1200 } else { 0 },
        ..JobSpec::simple(&["x"])
    }
}

/// Agents: stopped allocations exit; some running ones finish or checkpoint.
fn agents(w: &mut World, mix: &mut Mix) -> Vec<Command> {
    let mut commands = Vec::new();
    for alloc in w.state.allocs.values() {
        let stop = alloc.stop.is_some();
        if stop || mix.below(6) == 0 {
            for rank in alloc.ranks.iter().filter(|r| r.state != RankState::Exited) {
                commands.push(Command::AllocExited { alloc_id: alloc.id, rank: rank.rank, exit_code: 0 });
            }
        } else if mix.below(3) == 0 {
            commands.push(Command::Checkpoint { alloc_id: alloc.id, at_ms: w.now_s * 1000 });
        }
    }
    commands
}

#[test]
fn random_clusters_plan_only_what_apply_accepts() {
    let mut placed = 0;
    let mut stopped = 0;
    for seed in 0..60u64 {
        let mut mix = Mix::new(seed);
        let mut w = World { state: ClusterState::default(), index: 0, now_s: 1_000 };
        let setup = cluster(&mut mix);
        w.apply(setup);
        for _ in 0..80 {
            w.now_s += 60 + mix.below(900);
            let submits = (0..mix.below(4)).map(|_| Command::SubmitJob { request_id: None, spec: job(&mut mix) }).collect();
            w.apply(submits);
            let plan = policy::plan(&w.state, w.now_s * 1000);
            assert_eq!(plan, policy::plan(&w.state, w.now_s * 1000), "seed {seed}: plan is not deterministic");
            let (n_placed, n_stops) = (plan.placements.len() as u32, plan.stops.len());
            match w.apply(vec![Command::ApplyPlan(plan)]).remove(0) {
                CommandResult::PlanApplied { placed: p, rejected, .. } => {
                    assert_eq!(rejected, 0, "seed {seed}: apply refused a placement");
                    assert_eq!(p, n_placed);
                }
                other => panic!("seed {seed}: {other:?}"),
            }
            placed += n_placed;
            stopped += n_stops;
            let exits = agents(&mut w, &mut mix);
            w.apply(exits);
        }
    }
    assert!(placed > 1000, "placed {placed}");
    assert!(stopped > 10, "stopped {stopped}");
}

#[test]
fn usage_and_why_reports() {
    let mut mix = Mix::new(7);
    let mut w = World { state: ClusterState::default(), index: 0, now_s: 1_000 };
    let setup = cluster(&mut mix);
    w.apply(setup);
    let spec = JobSpec { group: "a".into(), runtime_limit_s: 3600, ..JobSpec::simple(&["x"]) };
    let huge = JobSpec { group: "a".into(), replicas: 64, gpus_per_replica: 8, ..JobSpec::simple(&["x"]) };
    w.apply(vec![Command::SubmitJob { request_id: None, spec }, Command::SubmitJob { request_id: None, spec: huge }]);
    let plan = policy::plan(&w.state, w.now_s * 1000);
    w.apply(vec![Command::ApplyPlan(plan)]);
    w.now_s += 100;
    let usage = policy::usage_report(&w.state, w.now_s * 1000);
    assert_eq!(usage.len(), 1);
    assert_eq!((usage[0].group.as_str(), usage[0].queue.as_str()), ("a", "training"));
    assert_eq!((usage[0].gpu_seconds, usage[0].gpus_now), (100, 1));
    let why = policy::why(&w.state, 2).expect("job 2 exists");
    assert_eq!((why.state.as_str(), why.code.as_str()), ("pending", "gang_too_large"));
    assert!(policy::why(&w.state, 99).is_none());
}
