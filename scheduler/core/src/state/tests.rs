use super::*;

/// A node of `gpus` H100s in one NVLink domain (shared by the state's unit tests).
pub(crate) fn node(name: &str, gpus: u32) -> NodeRegistration {
    NodeRegistration {
        name: name.into(),
        address: "127.0.0.1".into(),
        rack: "r1".into(),
        leaf: "l1".into(),
        gpus: (0..gpus)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{name}-{i}"),
                model: "H100-80GB".into(),
                memory_mib: 81_920,
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

fn submit(state: &mut ClusterState, request_id: &str, spec: JobSpec) -> CommandResult {
    run(state, vec![Command::SubmitJob { request_id: Some(request_id.into()), spec }]).remove(0)
}

fn gang(replicas: u32, gpus: u32) -> JobSpec {
    JobSpec { replicas, gpus_per_replica: gpus, ..JobSpec::simple(&["train.py"]) }
}

fn placement(job_id: JobId, ranks: &[(&str, &[u32])]) -> Placement {
    Placement { job_id, ranks: ranks.iter().map(|(n, g)| RankPlacement { node: n.to_string(), gpus: g.to_vec() }).collect() }
}

#[test]
fn retried_submit_returns_the_same_job() {
    let mut state = ClusterState::default();
    let first = submit(&mut state, "req-1", gang(1, 1));
    let again = submit(&mut state, "req-1", gang(1, 1));
    assert_eq!(first, CommandResult::Submitted { job_id: 1, deduplicated: false });
    assert_eq!(again, CommandResult::Submitted { job_id: 1, deduplicated: true });
    assert_eq!(state.jobs.len(), 1);
    let reused = submit(&mut state, "req-1", gang(2, 1));
    assert!(matches!(reused, CommandResult::Rejected(Rejection::RequestIdReused { job_id: 1, .. })));
}

#[test]
fn a_submitted_jobs_request_id_is_the_dedupe_tables_block() {
    let mut state = ClusterState::default();
    submit(&mut state, "cli-0123456789abcdef0123456789abcdef", gang(1, 1));
    let id = state.jobs[&1].request_id.clone().expect("the job keeps its request id");
    assert_eq!(id, "cli-0123456789abcdef0123456789abcdef");
    assert!(state.dedupe.held(&id).is_some_and(|key| key.shares_with(&id)), "one block for the job and the table");
}

/// Every job is one block behind a counted pointer (16 bytes of counts).
/// mimalloc serves a 376-byte block from its 384-byte class and a 384-byte
/// one from the 448-byte class (measured): a field more in `Job` moves every
/// job on every replica up a class, 64 bytes each.
#[test]
fn a_job_and_its_counts_fit_a_384_byte_block() {
    let block = std::mem::size_of::<Job>() + 16;
    assert!(block <= 376, "a job's block is {block} bytes: box a field or accept the larger class and change this bound");
}

#[test]
fn invalid_spec_is_rejected_naming_the_field_and_stores_nothing() {
    let mut state = ClusterState::default();
    let cases = [
        (JobSpec { command: vec![], ..gang(1, 1) }, "spec.command"),
        (gang(1, 0), "spec.gpus_per_replica"),
        (gang(0, 1), "spec.replicas"),
        (JobSpec { queue: "nope".into(), ..gang(1, 1) }, "spec.queue"),
        (JobSpec { name: "x".repeat(1000), ..gang(1, 1) }, "spec.name"),
    ];
    for (i, (spec, field)) in cases.into_iter().enumerate() {
        let result = submit(&mut state, &format!("r{i}"), spec);
        match result {
            CommandResult::Rejected(Rejection::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected rejection of {field}, got {other:?}"),
        }
    }
    assert!(state.jobs.is_empty());
    assert!(state.dedupe.is_empty());
}

#[test]
fn gang_is_placed_whole_or_not_at_all() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("a", 8)), Command::RegisterNode(node("b", 8))]);
    submit(&mut state, "small", gang(1, 4));
    submit(&mut state, "gang", gang(2, 8));
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("a", &[0, 1, 2, 3])])], ..Plan::default() })]);
    // The gang's first rank overlaps GPUs job 1 holds: the whole gang is refused.
    let result = run(
        &mut state,
        vec![Command::ApplyPlan(Plan {
            placements: vec![placement(2, &[("b", &[0, 1, 2, 3, 4, 5, 6, 7]), ("a", &[0, 1, 2, 3, 4, 5, 6, 7])])],
            ..Plan::default()
        })],
    );
    assert_eq!(result[0], CommandResult::PlanApplied { placed: 0, rejected: 1, stopped: 0 });
    assert_eq!(state.jobs[&2].state, JobState::Pending);
    assert_eq!(state.gpu_owner.len(), 4);
}

#[test]
fn gang_success_failure_and_retry() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("a", 8)), Command::RegisterNode(node("b", 8))]);
    submit(&mut state, "g", JobSpec { max_retries: 1, ..gang(2, 8) });
    let all: Vec<u32> = (0..8).collect();
    let place = |state: &mut ClusterState| {
        run(state, vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("a", &all), ("b", &all)])], ..Plan::default() })])
    };
    place(&mut state);
    let alloc_id = state.jobs[&1].alloc.unwrap();
    assert_eq!(state.allocs[&alloc_id].master_port, 29_500);
    run(&mut state, vec![Command::AllocStarted { alloc_id, rank: 0 }, Command::AllocStarted { alloc_id, rank: 1 }]);
    // Rank 1 fails: the gang stops; once rank 0 exits the job is retried.
    run(&mut state, vec![Command::AllocExited { alloc_id, rank: 1, exit_code: 3 }]);
    assert_eq!(state.jobs[&1].state, JobState::Stopping);
    assert_eq!(state.gpu_owner.len(), 16, "GPUs stay held until the whole gang has exited");
    run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 143 }]);
    assert_eq!(state.jobs[&1].state, JobState::Pending);
    assert!(state.gpu_owner.is_empty());
    place(&mut state);
    let alloc_id = state.jobs[&1].alloc.unwrap();
    run(
        &mut state,
        vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 0 }, Command::AllocExited { alloc_id, rank: 1, exit_code: 0 }],
    );
    assert_eq!(state.jobs[&1].state, JobState::Succeeded);
    assert_eq!(state.jobs[&1].attempts, 2);
    assert_eq!(state.live_jobs, 0);
}

#[test]
fn cancel_pending_and_running_jobs() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("a", 8))]);
    submit(&mut state, "p", gang(1, 1));
    submit(&mut state, "r", gang(1, 2));
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(2, &[("a", &[0, 1])])], ..Plan::default() })]);
    let results =
        run(&mut state, vec![Command::CancelJob { job_id: 1 }, Command::CancelJob { job_id: 2 }, Command::CancelJob { job_id: 99 }]);
    assert_eq!(results[0], CommandResult::Cancelled { job_id: 1, state: JobState::Cancelled });
    assert_eq!(results[1], CommandResult::Cancelled { job_id: 2, state: JobState::Stopping });
    assert!(matches!(results[2], CommandResult::Rejected(Rejection::NotFound { .. })));
    let alloc_id = state.jobs[&2].alloc.unwrap();
    run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 137 }]);
    assert_eq!(state.jobs[&2].state, JobState::Cancelled);
}

/// A priority change reaches the job's spec while it is held, and is
/// refused (naming the job) once it ended or without the sender's name.
#[test]
fn a_held_jobs_priority_changes_and_an_ended_jobs_does_not() {
    let mut state = ClusterState { cluster_version: OUTCOMES_FROM_VERSION, ..ClusterState::default() };
    let otto = auth::Actor::unchecked("127.0.0.1:1");
    let set = |job_id, priority| Command::Audited { actor: otto.clone(), command: Box::new(Command::SetJobPriority { job_id, priority }) };
    submit(&mut state, "p", gang(1, 1));
    let results = run(&mut state, vec![set(1, Priority::High), set(99, Priority::Low)]);
    assert_eq!(results[0], CommandResult::Done);
    assert!(matches!(results[1], CommandResult::Rejected(Rejection::NotFound { .. })), "{results:?}");
    assert_eq!(state.jobs[&1].spec.priority, Priority::High);
    let bare = run(&mut state, vec![Command::SetJobPriority { job_id: 1, priority: Priority::Low }]);
    assert!(matches!(&bare[0], CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "command"), "{bare:?}");
    run(&mut state, vec![Command::CancelJob { job_id: 1 }]);
    let ended = run(&mut state, vec![set(1, Priority::Low)]);
    assert!(matches!(&ended[0], CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "job_id"), "{ended:?}");
    assert_eq!(state.jobs[&1].spec.priority, Priority::High);
}

/// Job 1, a gang of 2 x 4 GPUs, running on nodes a and b (GPUs 0-3 of each).
fn running_gang_on_a_and_b() -> ClusterState {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("a", 8)), Command::RegisterNode(node("b", 8))]);
    submit(&mut state, "g", gang(2, 4));
    run(
        &mut state,
        vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("a", &[0, 1, 2, 3]), ("b", &[0, 1, 2, 3])])], ..Plan::default() })],
    );
    state
}

#[test]
fn node_down_requeues_the_whole_gang() {
    let mut state = running_gang_on_a_and_b();
    run(&mut state, vec![Command::NodeDown { node: "b".into() }]);
    assert_eq!(state.nodes["b"].state, NodeState::Down);
    // The rank on the surviving node is asked to stop; its GPUs stay held
    // until it reports its exit, so the next attempt cannot overlap it.
    assert_eq!(state.jobs[&1].state, JobState::Stopping);
    assert!(state.gpu_owner.keys().any(|(node, _)| node == "a"), "node a's GPUs are still held");
    let alloc_id = state.jobs[&1].alloc.unwrap();
    run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 143 }]);
    let job = &state.jobs[&1];
    assert_eq!(job.state, JobState::Pending, "requeued whole once every rank ended");
    assert!(job.reason.to_string().contains("node"));
    assert!(state.gpu_owner.is_empty(), "then every GPU of the gang is free");
}

#[test]
fn a_rank_lost_with_its_agents_lease_requeues_the_gang_without_failing_it() {
    let mut state = running_gang_on_a_and_b();
    let alloc_id = state.jobs[&1].alloc.unwrap();
    run(&mut state, vec![Command::AllocLost { alloc_id, rank: 1 }]);
    assert_eq!(state.jobs[&1].state, JobState::Stopping, "rank 0 is asked to stop");
    run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 143 }]);
    let job = &state.jobs[&1];
    assert_eq!((job.state, job.reason.code, job.failures), (JobState::Pending, ReasonCode::NodeLost, 0), "{job:?}");
}

#[test]
fn node_down_ends_an_allocation_at_once_when_no_other_rank_runs() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("a", 8))]);
    submit(&mut state, "one", gang(1, 4));
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("a", &[0, 1, 2, 3])])], ..Plan::default() })]);
    run(&mut state, vec![Command::NodeDown { node: "a".into() }]);
    assert_eq!(state.jobs[&1].state, JobState::Pending);
    assert!(state.gpu_owner.is_empty());
}

#[test]
fn snapshot_restores_exactly() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("a", 8))]);
    for i in 0..50 {
        submit(&mut state, &format!("req-{i}"), gang(1, 1));
    }
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(3, &[("a", &[5])])], ..Plan::default() })]);
    let bytes = state.to_snapshot();
    let restored = ClusterState::from_snapshot(&bytes).unwrap();
    assert_eq!(restored, state);
    assert!(ClusterState::from_snapshot(&bytes[..bytes.len() / 2]).is_err());
}

#[test]
fn live_jobs_are_bounded() {
    let limits = StateLimits { max_live_jobs: 3, ..StateLimits::default() };
    let mut state = ClusterState::new(limits);
    for i in 0..3 {
        assert!(matches!(submit(&mut state, &format!("{i}"), gang(1, 1)), CommandResult::Submitted { .. }));
    }
    assert!(matches!(submit(&mut state, "x", gang(1, 1)), CommandResult::Rejected(Rejection::Exhausted { .. })));
}

#[test]
fn finished_jobs_are_bounded() {
    let limits = StateLimits { max_finished_jobs: 2, ..StateLimits::default() };
    let mut state = ClusterState::new(limits);
    for i in 0..5 {
        submit(&mut state, &format!("{i}"), gang(1, 1));
        run(&mut state, vec![Command::CancelJob { job_id: i + 1 }]);
    }
    assert_eq!(state.jobs.keys().copied().collect::<Vec<_>>(), vec![4, 5]);
}

#[test]
fn clock_never_moves_back() {
    let mut state = ClusterState::default();
    state.apply_proposal(1, &Proposal { now_ms: 5_000, commands: vec![] });
    state.apply_proposal(2, &Proposal { now_ms: 4_000, commands: vec![] });
    assert_eq!(state.now_ms, 5_000);
}

/// Every field within its own limit, but together far over the spec bound:
/// 256 arguments of 4,000 bytes (about 1 MiB).
fn fat_spec() -> JobSpec {
    JobSpec { command: vec!["x".repeat(4_000); 256], ..gang(1, 1) }
}

#[test]
fn a_spec_over_the_byte_bound_is_refused_naming_the_spec() {
    let mut state = ClusterState::default();
    let result = submit(&mut state, "fat", fat_spec());
    match result {
        CommandResult::Rejected(Rejection::Invalid { field, message }) => {
            assert_eq!(field, "spec");
            assert!(message.contains(&validate::MAX_SPEC_BYTES.to_string()), "{message}");
        }
        other => panic!("a 1 MiB spec was not refused: {other:?}"),
    }
    assert!(state.jobs.is_empty() && state.spec_bytes == 0);
}

#[test]
fn the_spec_memory_budget_refuses_submits_when_full_and_frees_with_retention() {
    let limits = StateLimits { max_spec_bytes: 100_000, max_finished_jobs: 1, ..StateLimits::default() };
    let mut state = ClusterState::new(limits);
    let spec = JobSpec { command: vec!["y".repeat(4_000); 10], ..gang(1, 1) };
    let per_job = spec.payload_bytes() as u64;
    let fits = (100_000 / per_job) as usize;
    for i in 0..fits {
        assert!(matches!(submit(&mut state, &format!("r{i}"), spec.clone()), CommandResult::Submitted { .. }));
    }
    let full = submit(&mut state, "over", spec.clone());
    assert!(
        matches!(&full, CommandResult::Rejected(Rejection::Exhausted { what, limit: 100_000 }) if what.contains("spec bytes")),
        "{full:?}"
    );
    assert_eq!(state.spec_bytes, per_job * fits as u64);
    // Cancelled pending jobs are final; all but the newest are dropped by
    // retention, and their bytes come back to the budget.
    let cancels = (1..=fits as u64).map(|job_id| Command::CancelJob { job_id }).collect();
    run(&mut state, cancels);
    assert_eq!(state.spec_bytes, per_job, "one finished job is kept");
    assert!(matches!(submit(&mut state, "after", spec), CommandResult::Submitted { .. }));
}

#[test]
fn a_node_registering_with_fewer_gpus_ends_the_allocations_on_the_vanished_ones() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("n1", 8))]);
    submit(&mut state, "big", gang(1, 4));
    submit(&mut state, "small", gang(1, 2));
    let plan = Plan { placements: vec![placement(1, &[("n1", &[4, 5, 6, 7])]), placement(2, &[("n1", &[0, 1])])], ..Plan::default() };
    run(&mut state, vec![Command::ApplyPlan(plan)]);
    assert_eq!(state.jobs[&1].state, JobState::Running);
    // The same GPUs again: nothing changes.
    run(&mut state, vec![Command::RegisterNode(node("n1", 8))]);
    assert_eq!(state.allocs.len(), 2);
    // GPUs 4-7 are gone: the allocation on them ends and its job is
    // requeued; the one on GPUs 0-1 runs on.
    run(&mut state, vec![Command::RegisterNode(node("n1", 4))]);
    let big = &state.jobs[&1];
    assert_eq!((big.state, big.reason.code), (JobState::Pending, ReasonCode::GpuLost), "{big:?}");
    assert_eq!(state.jobs[&2].state, JobState::Running);
    assert!(state.gpu_owner.keys().all(|(_, gpu)| *gpu < 4), "no GPU above 3 is held: {:?}", state.gpu_owner);
}

#[test]
fn a_gpu_swapped_under_the_same_index_ends_its_allocation() {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::RegisterNode(node("n1", 2))]);
    submit(&mut state, "job", gang(1, 1));
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("n1", &[1])])], ..Plan::default() })]);
    let mut swapped = node("n1", 2);
    swapped.gpus[1].uuid = "GPU-replacement".into();
    run(&mut state, vec![Command::RegisterNode(swapped)]);
    assert_eq!(state.jobs[&1].reason.code, ReasonCode::GpuLost);
    assert!(state.allocs.is_empty());
}

#[test]
fn a_raised_alarm_refuses_new_work_and_keeps_answering_retries() {
    let mut state = ClusterState::default();
    assert!(matches!(submit(&mut state, "before", gang(1, 1)), CommandResult::Submitted { deduplicated: false, .. }));
    run(&mut state, vec![Command::SetAlarm { replica: 2, kind: AlarmKind::NoSpace, raised: true }]);
    assert_eq!(state.alarms.iter().copied().collect::<Vec<_>>(), vec![(2, AlarmKind::NoSpace)]);
    let refused = submit(&mut state, "during", gang(1, 1));
    let CommandResult::Rejected(rejection @ Rejection::Alarmed { .. }) = &refused else { panic!("refused by the alarm: {refused:?}") };
    assert!(rejection.to_string().contains("nospace") && rejection.to_string().contains("replica 2"), "{rejection}");
    let queue = run(&mut state, vec![Command::SetQueue(QueueConfig::defaults()[0].clone())]).remove(0);
    assert!(matches!(queue, CommandResult::Rejected(Rejection::Alarmed { .. })), "{queue:?}");
    // A retry of a submit acknowledged before the alarm still gets its answer.
    assert!(matches!(submit(&mut state, "before", gang(1, 1)), CommandResult::Submitted { deduplicated: true, .. }));
    // Clearing twice is harmless; afterwards work is taken again.
    for _ in 0..2 {
        run(&mut state, vec![Command::SetAlarm { replica: 2, kind: AlarmKind::NoSpace, raised: false }]);
    }
    assert!(state.alarms.is_empty());
    assert!(matches!(submit(&mut state, "after", gang(1, 1)), CommandResult::Submitted { deduplicated: false, .. }));
}

mod audited {
    use super::super::auth::{Actor, Role};
    use super::super::*;
    use std::collections::BTreeSet;

    fn apply(state: &mut ClusterState, command: Command) -> CommandResult {
        let index = state.applied_index + 1;
        state.apply_proposal(index, &Proposal { now_ms: 1_000 + index, commands: vec![command] }).remove(0)
    }

    fn by(user: &str, command: Command) -> Command {
        Command::Audited { actor: Actor::user(user, "127.0.0.1:9"), command: Box::new(command) }
    }

    fn cluster() -> ClusterState {
        let mut state = ClusterState::default();
        assert_eq!(apply(&mut state, Command::BootstrapAdmin { name: "ada".into() }), CommandResult::Done);
        for (name, role, group) in [("alice", Role::User, "vision"), ("bob", Role::User, "nlp"), ("vera", Role::Viewer, "vision")] {
            let set = Command::SetUser { name: name.into(), role, groups: BTreeSet::from([group.to_string()]), impersonate: false };
            assert_eq!(apply(&mut state, by("ada", set)), CommandResult::Done);
        }
        state
    }

    fn submit(group: &str) -> Command {
        let mut spec = JobSpec::simple(&["train"]);
        spec.group = group.into();
        Command::SubmitJob { request_id: None, spec }
    }

    #[test]
    fn a_user_cancels_its_own_jobs_only_and_the_trail_says_who_tried() {
        let mut state = cluster();
        let CommandResult::Submitted { job_id, .. } = apply(&mut state, by("alice", submit("vision"))) else { panic!("submitted") };
        let refused = apply(&mut state, by("bob", Command::CancelJob { job_id }));
        assert!(
            matches!(&refused, CommandResult::Rejected(Rejection::PermissionDenied { message }) if message.contains("bob")),
            "{refused:?}"
        );
        assert_eq!(state.jobs[&job_id].state, JobState::Pending, "the job is unchanged");
        assert!(matches!(apply(&mut state, by("alice", Command::CancelJob { job_id })), CommandResult::Cancelled { .. }));
        let last_two: Vec<_> = state.auth.audit.iter().rev().take(2).map(|r| (r.actor.describe(), r.outcome.starts_with("ok"))).collect();
        assert_eq!(last_two, vec![("alice".to_string(), true), ("bob".to_string(), false)]);
        state.check_invariants().expect("consistent");
    }

    #[test]
    fn submits_need_the_user_role_and_the_group() {
        let mut state = cluster();
        assert!(matches!(apply(&mut state, by("vera", submit("vision"))), CommandResult::Rejected(Rejection::PermissionDenied { .. })));
        let other_group = apply(&mut state, by("alice", submit("nlp")));
        assert!(matches!(&other_group, CommandResult::Rejected(Rejection::PermissionDenied { message }) if message.contains("\"nlp\"")));
        assert_eq!(state.jobs.len(), 0);
        assert!(matches!(apply(&mut state, by("mallory", submit("vision"))), CommandResult::Rejected(Rejection::PermissionDenied { .. })));
    }

    #[test]
    fn user_commands_outside_an_audit_are_refused_and_bootstrap_happens_once() {
        let mut state = cluster();
        let bare = Command::SetUser { name: "eve".into(), role: Role::Admin, groups: BTreeSet::new(), impersonate: false };
        assert!(matches!(apply(&mut state, bare), CommandResult::Rejected(Rejection::Invalid { .. })));
        assert_eq!(apply(&mut state, Command::BootstrapAdmin { name: "eve".into() }), CommandResult::Done);
        assert!(!state.auth.users.contains_key("eve"), "a second bootstrap changes nothing");
        let nested = by("ada", by("ada", submit("vision")));
        assert!(matches!(apply(&mut state, nested), CommandResult::Rejected(Rejection::PermissionDenied { .. })));
        let demote = by("ada", Command::SetUser { name: "ada".into(), role: Role::User, groups: BTreeSet::new(), impersonate: false });
        assert!(matches!(apply(&mut state, demote), CommandResult::Rejected(Rejection::Conflict { .. })), "the last admin stays");
    }

    #[test]
    fn marks_are_dropped_with_their_jobs() {
        let mut state = ClusterState::new(StateLimits { max_finished_jobs: 1, ..StateLimits::default() });
        apply(&mut state, Command::BootstrapAdmin { name: "ada".into() });
        for _ in 0..3 {
            let CommandResult::Submitted { job_id, .. } = apply(&mut state, by("ada", submit("vision"))) else { panic!("submitted") };
            apply(&mut state, by("ada", Command::CancelJob { job_id }));
        }
        assert_eq!(state.auth.job_marks.len(), 1);
        state.check_invariants().expect("consistent");
    }
}

/// GPU faults: the XID table's actions, fences, readmission and drain.
mod faults {
    use super::super::auth::{Actor, Role};
    use super::super::faults::FenceKind;
    use super::*;

    /// A format-6 cluster with nodes a and b (8 GPUs each, one NVLink
    /// domain per half of the board) and an operator and a user.
    fn cluster() -> ClusterState {
        let mut state = ClusterState::default();
        run(&mut state, vec![Command::SetClusterVersion { version: codec::FORMAT_VERSION }]);
        let mut a = node("a", 8);
        let mut b = node("b", 8);
        for gpu in a.gpus.iter_mut().chain(b.gpus.iter_mut()) {
            gpu.nvlink_domain = Some(gpu.index / 4 * 4);
        }
        run(&mut state, vec![Command::RegisterNode(a), Command::RegisterNode(b), Command::BootstrapAdmin { name: "ada".into() }]);
        for (name, role) in [("otto", Role::Operator), ("alice", Role::User)] {
            let set = Command::SetUser { name: name.into(), role, groups: Default::default(), impersonate: false };
            assert_eq!(run(&mut state, vec![by("ada", set)]), vec![CommandResult::Done]);
        }
        state
    }

    fn by(user: &str, command: Command) -> Command {
        Command::Audited { actor: Actor::user(user, "127.0.0.1:9"), command: Box::new(command) }
    }

    fn xid(node: &str, gpu: u32, xid: u32) -> Command {
        Command::GpuXid { node: node.into(), gpu, xid, at_ms: 1_796_073_307_000 }
    }

    /// Job 1, a gang of 2 x 4 GPUs with one retry, on GPUs 0-3 of a and b.
    fn with_gang(state: &mut ClusterState) -> AllocId {
        submit(state, "g", JobSpec { max_retries: 1, ..gang(2, 4) });
        let plan = Plan { placements: vec![placement(1, &[("a", &[0, 1, 2, 3]), ("b", &[0, 1, 2, 3])])], ..Plan::default() };
        run(state, vec![Command::ApplyPlan(plan)]);
        state.jobs[&1].alloc.expect("placed")
    }

    fn exit_all(state: &mut ClusterState, alloc_id: AllocId) {
        run(state, (0..2).map(|rank| Command::AllocExited { alloc_id, rank, exit_code: 143 }).collect());
    }

    fn free_on(state: &ClusterState, name: &str) -> usize {
        let node = &state.nodes[name];
        node.gpus.iter().filter(|g| state.gpu_is_free(node, g)).count()
    }

    #[test]
    fn xid_79_fences_the_node_and_requeues_the_whole_gang_under_its_retry_rule() {
        let mut state = cluster();
        let alloc_id = with_gang(&mut state);
        assert_eq!(run(&mut state, vec![xid("a", 2, 79)]), vec![CommandResult::Done]);
        let fence = state.faults.fences["a"].node.clone().expect("node fenced");
        assert_eq!((fence.kind, fence.reason.as_str()), (FenceKind::Node, "xid 79 at 2026-11-30T21:15:07Z"));
        assert_eq!(state.jobs[&1].state, JobState::Stopping, "the whole gang is stopped, b's rank too");
        exit_all(&mut state, alloc_id);
        let job = &state.jobs[&1];
        assert_eq!((job.state, job.failures), (JobState::Pending, 1));
        assert!(job.reason.detail.contains("xid 79"), "{}", job.reason);
        assert_eq!((free_on(&state, "a"), free_on(&state, "b")), (0, 8));
        assert_eq!(state.fenced_gpus(), 8);
    }

    #[test]
    fn an_application_xid_fails_the_attempt_of_the_whole_gang_and_fences_nothing() {
        let mut state = cluster();
        let alloc_id = with_gang(&mut state);
        run(&mut state, vec![xid("b", 3, 94)]);
        assert!(state.faults.fences.is_empty());
        assert_eq!(state.allocs[&alloc_id].stop, Some(StopReason::Failed), "the whole attempt, never a lone rank");
        exit_all(&mut state, alloc_id);
        let job = &state.jobs[&1];
        assert_eq!((job.state, job.failures), (JobState::Pending, 1), "retried by its rule");
        assert!(job.reason.detail.contains("xid 94 on gpu 3"), "{}", job.reason);
        // The retry runs; a second application error is past max_retries.
        let plan = Plan { placements: vec![placement(1, &[("a", &[0, 1, 2, 3]), ("b", &[0, 1, 2, 3])])], ..Plan::default() };
        run(&mut state, vec![Command::ApplyPlan(plan)]);
        let alloc_id = state.jobs[&1].alloc.unwrap();
        run(&mut state, vec![xid("a", 0, 13)]);
        exit_all(&mut state, alloc_id);
        assert_eq!(state.jobs[&1].state, JobState::Failed);
        assert!(state.faults.attempt_faults.is_empty());
    }

    #[test]
    fn an_informational_xid_changes_nothing() {
        let mut state = cluster();
        with_gang(&mut state);
        let before = state.clone();
        run(&mut state, vec![xid("a", 1, 63), xid("a", 1, 92)]);
        assert_eq!((state.jobs.clone(), state.allocs.clone(), state.faults.clone()), (before.jobs, before.allocs, before.faults));
    }

    #[test]
    fn xid_74_fences_the_nvlink_domain_until_an_operator_readmits_it() {
        let mut state = cluster();
        run(&mut state, vec![xid("a", 5, 74)]);
        assert_eq!(state.faults.fences["a"].nvlink_domains[&4].kind, FenceKind::NvlinkDomain);
        assert_eq!(free_on(&state, "a"), 4, "GPUs 4-7 share the domain");
        run(&mut state, vec![Command::GpuReset { node: "a".into(), gpu: 5 }]);
        assert_eq!(free_on(&state, "a"), 4, "a reset does not lift an NVLink fence");
        run(&mut state, vec![by("otto", Command::ReadmitNode { node: "a".into(), gpu: Some(6) })]);
        assert_eq!(free_on(&state, "a"), 8);
        assert!(state.faults.fences.is_empty());
    }

    #[test]
    fn a_reset_code_fences_the_gpu_until_its_agent_reports_a_reset() {
        let mut state = cluster();
        let alloc_id = with_gang(&mut state);
        run(&mut state, vec![xid("a", 1, 48), xid("b", 7, 12_345)]);
        assert_eq!(state.faults.fences["a"].gpus[&1].kind, FenceKind::GpuReset);
        assert_eq!(state.faults.fences["b"].gpus[&7].kind, FenceKind::GpuReset, "an unknown code fences its GPU");
        assert_eq!(state.allocs[&alloc_id].stop, Some(StopReason::Failed));
        exit_all(&mut state, alloc_id);
        assert_eq!((free_on(&state, "a"), free_on(&state, "b")), (7, 7));
        run(&mut state, vec![Command::GpuReset { node: "a".into(), gpu: 1 }, Command::GpuReset { node: "b".into(), gpu: 7 }]);
        assert_eq!((free_on(&state, "a"), free_on(&state, "b")), (8, 8));
        assert!(state.faults.fences.is_empty());
    }

    #[test]
    fn only_operators_readmit_fence_and_drain() {
        let mut state = cluster();
        run(&mut state, vec![xid("a", 0, 79)]);
        for command in [
            Command::ReadmitNode { node: "a".into(), gpu: None },
            Command::FenceNode { node: "b".into(), gpu: Some(1), reason: "bad fan".into() },
            Command::DrainNode { node: "b".into(), drain: true },
        ] {
            let result = run(&mut state, vec![by("alice", command.clone())]).remove(0);
            assert!(matches!(result, CommandResult::Rejected(Rejection::PermissionDenied { .. })), "{result:?}");
            let bare = run(&mut state, vec![command.clone()]).remove(0);
            if !matches!(command, Command::DrainNode { .. }) {
                assert!(matches!(bare, CommandResult::Rejected(Rejection::Invalid { .. })), "outside an audit: {bare:?}");
            }
        }
        run(&mut state, vec![by("otto", Command::DrainNode { node: "b".into(), drain: false })]);
        assert_eq!(state.nodes["b"].state, NodeState::Ready);
        assert!(state.faults.fences.contains_key("a"));
        run(&mut state, vec![by("otto", Command::FenceNode { node: "b".into(), gpu: Some(1), reason: "bad fan".into() })]);
        assert_eq!(state.faults.fences["b"].gpus[&1].kind, FenceKind::Operator);
        run(&mut state, vec![by("otto", Command::ReadmitNode { node: "a".into(), gpu: None })]);
        run(&mut state, vec![by("otto", Command::ReadmitNode { node: "b".into(), gpu: Some(1) })]);
        assert!(state.faults.fences.is_empty());
    }

    #[test]
    fn a_drained_node_keeps_its_ranks_takes_nothing_new_and_stays_drained_after_down() {
        let mut state = cluster();
        let alloc_id = with_gang(&mut state);
        run(&mut state, vec![by("otto", Command::DrainNode { node: "a".into(), drain: true })]);
        assert_eq!(state.jobs[&1].state, JobState::Running, "running ranks finish");
        assert_eq!(free_on(&state, "a"), 0);
        run(&mut state, (0..2).map(|rank| Command::AllocExited { alloc_id, rank, exit_code: 0 }).collect());
        assert_eq!(state.jobs[&1].state, JobState::Succeeded);
        run(&mut state, vec![Command::NodeDown { node: "a".into() }, Command::RegisterNode(node("a", 8))]);
        assert_eq!(state.nodes["a"].state, NodeState::Draining);
        run(&mut state, vec![by("otto", Command::DrainNode { node: "a".into(), drain: false })]);
        assert_eq!(free_on(&state, "a"), 8);
    }

    #[test]
    fn fault_commands_need_format_6_and_round_trip_in_the_snapshot() {
        for command in [
            xid("a", 0, 79),
            Command::GpuReset { node: "a".into(), gpu: 0 },
            Command::ReadmitNode { node: "a".into(), gpu: None },
            Command::FenceNode { node: "a".into(), gpu: None, reason: "x".into() },
        ] {
            assert_eq!(command.min_format(), 6);
        }
        let mut state = cluster();
        with_gang(&mut state);
        run(&mut state, vec![xid("a", 0, 79), xid("b", 6, 74), by("otto", Command::DrainNode { node: "b".into(), drain: true })]);
        let restored = ClusterState::from_snapshot(&state.to_snapshot()).unwrap();
        assert_eq!(restored, state);
        assert!(!restored.faults.attempt_faults.is_empty() && !restored.faults.drained.is_empty());
    }
}

/// A job placed, preempted, placed again and finished leaves a record with
/// its first start, both spans and the preemption when the bounded
/// finished table drops it; its statistics go with it.
#[test]
fn a_dropped_job_leaves_its_record_in_the_outbox() {
    let mut state = ClusterState::new(StateLimits { max_finished_jobs: 1, ..StateLimits::default() });
    state.archive_outbox.collect = true;
    run(&mut state, vec![Command::SetClusterVersion { version: records::RECORDS_FROM_VERSION }]);
    run(&mut state, vec![Command::RegisterNode(node("a", 4))]);
    submit(&mut state, "j", gang(1, 2));
    let submitted_ms = state.now_ms;
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("a", &[0, 1])])], ..Plan::default() })]);
    let first_start_ms = state.now_ms;
    run(&mut state, vec![Command::ApplyPlan(Plan { stops: vec![Stop { alloc_id: 1, reason: StopReason::Preempted }], ..Plan::default() })]);
    run(&mut state, vec![Command::AllocExited { alloc_id: 1, rank: 0, exit_code: 143 }]);
    assert_eq!(state.jobs[&1].state, JobState::Pending);
    run(&mut state, vec![Command::ApplyPlan(Plan { placements: vec![placement(1, &[("a", &[2, 3])])], ..Plan::default() })]);
    let live = records::record_of(&state, &state.jobs[&1], 0);
    assert_eq!((live.spans.len(), live.gpu_ms), (2, 2 * 2_000), "the live attempt counts up to the committed time");
    run(&mut state, vec![Command::AllocExited { alloc_id: 2, rank: 0, exit_code: 0 }]);
    assert_eq!(state.jobs[&1].state, JobState::Succeeded);
    assert!(state.archive_outbox.drain().is_empty(), "a finished job is held until dropped");
    submit(&mut state, "k", gang(1, 1));
    run(&mut state, vec![Command::CancelJob { job_id: 2 }]);
    let index = state.applied_index;
    let records = state.archive_outbox.drain();
    assert_eq!(records.len(), 1);
    let record = &records[0];
    assert_eq!((record.job_id, record.archived_index, record.state.as_str()), (1, index, "succeeded"));
    assert_eq!(record.wait_ms, Some(first_start_ms - submitted_ms));
    assert_eq!((record.attempts, record.preemptions, record.gpus), (2, 1, 2));
    assert_eq!(record.gpu_ms, 2 * 2_000 + 2 * 1_000, "attempts of 2 s and 1 s on 2 GPUs");
    assert_eq!(record.gpu_model, "H100-80GB");
    assert_eq!(record.nodes, vec!["a".to_string()]);
    assert!(!state.records.job_stats.contains_key(&1));
    assert!(!state.clone().archive_outbox.collect, "a copy of the state does not collect");
}

/// The change index yields the jobs changed after a log index, in the
/// order of their last change, and a job once only (at its newest change).
#[test]
fn jobs_changed_after_an_index_come_in_change_order_once_each() {
    let mut state = running_gang_on_a_and_b();
    submit(&mut state, "p", JobSpec::simple(&["x"]));
    let before = state.applied_index;
    submit(&mut state, "q", JobSpec::simple(&["x"]));
    run(&mut state, vec![Command::CancelJob { job_id: 2 }]);
    let changed: Vec<JobId> = state.jobs_changed_after(before, JobId::MAX).map(|job| job.id).collect();
    assert_eq!(changed, vec![3, 2], "job 3 submitted, then job 2 cancelled");
    let all: Vec<JobId> = state.jobs_changed_after(0, JobId::MAX).map(|job| job.id).collect();
    assert_eq!(all, vec![1, 3, 2]);
    let after_three = state.jobs_changed_after(state.jobs[&3].changed_at_index, 3).map(|job| job.id).collect::<Vec<_>>();
    assert_eq!(after_three, vec![2], "a cursor inside one index resumes after its job");
    assert_eq!(state.allocs_on_node("a"), vec![state.jobs[&1].alloc.unwrap()]);
    assert!(state.allocs_on_node("c").is_empty());
    let restored = ClusterState::from_snapshot(&state.to_snapshot()).unwrap();
    assert_eq!(restored.job_changes, state.job_changes, "rebuilt when decoded");
}
