use super::*;
use crate::state::auth::Actor;
use crate::state::codec;
use crate::state::tests::node;
use crate::state::{GroupQuota, JobSpec, Placement, Plan, QueueConfig, RankPlacement, Stop};

/// Apply one entry of `commands`; its events.
fn run(state: &mut ClusterState, commands: Vec<Command>) -> Vec<Event> {
    let index = state.applied_index + 1;
    let now_ms = state.now_ms + 1_000;
    let mut events = Vec::new();
    state.apply_proposal_with_events(index, &Proposal { now_ms, commands }, &mut events);
    state.check_invariants().expect("invariants hold");
    for (seq, event) in events.iter().enumerate() {
        assert_eq!((event.index, event.seq as usize, event.time_ms), (index, seq, now_ms), "{event:?}");
    }
    events
}

fn kinds(events: &[Event]) -> Vec<&'static str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

fn operator(command: Command) -> Command {
    Command::Audited { actor: Actor::unchecked("127.0.0.1:1"), command: Box::new(command) }
}

/// A cluster of format 6 with two 8-GPU nodes.
fn cluster() -> ClusterState {
    let mut state = ClusterState::default();
    run(&mut state, vec![Command::SetClusterVersion { version: codec::FORMAT_VERSION }]);
    let registered = run(&mut state, vec![Command::RegisterNode(node("a", 8)), Command::RegisterNode(node("b", 8))]);
    assert_eq!(kinds(&registered), ["node_registered", "node_registered"]);
    state
}

fn spec(replicas: u32, gpus: u32) -> JobSpec {
    let mut spec = JobSpec { replicas, gpus_per_replica: gpus, group: "vision".into(), ..JobSpec::simple(&["train.py", "--secret"]) };
    spec.env.insert("TOKEN".into(), "hunter2".into());
    spec
}

fn submit(state: &mut ClusterState, spec: JobSpec) -> JobId {
    let events = run(state, vec![Command::SubmitJob { request_id: None, spec }]);
    assert_eq!(kinds(&events), ["job_submitted"]);
    assert_eq!((events[0].group.as_str(), events[0].queue.as_str(), events[0].state), ("vision", "training", Some(JobState::Pending)));
    events[0].job_id
}

fn place(state: &mut ClusterState, job_id: JobId, ranks: &[(&str, &[u32])]) -> Vec<Event> {
    let ranks = ranks.iter().map(|(n, g)| RankPlacement { node: n.to_string(), gpus: g.to_vec() }).collect();
    let plan = Plan { computed_at_index: state.applied_index, placements: vec![Placement { job_id, ranks }], ..Plan::default() };
    run(state, vec![Command::ApplyPlan(plan)])
}

fn alloc_of(state: &ClusterState, job_id: JobId) -> AllocId {
    state.jobs[&job_id].alloc.expect("placed")
}

#[test]
fn a_job_submitted_placed_started_and_finished() {
    let mut state = cluster();
    let job = submit(&mut state, spec(2, 4));
    let placed = place(&mut state, job, &[("a", &[0, 1, 2, 3]), ("b", &[0, 1, 2, 3])]);
    assert_eq!(kinds(&placed), ["job_placed"]);
    assert_eq!((placed[0].node.as_str(), placed[0].state), ("a,b", Some(JobState::Running)));
    let alloc_id = alloc_of(&state, job);
    let first = run(&mut state, vec![Command::AllocStarted { alloc_id, rank: 0 }]);
    assert!(first.is_empty(), "one rank of two started: {first:?}");
    let started = run(&mut state, vec![Command::AllocStarted { alloc_id, rank: 1 }]);
    assert_eq!(kinds(&started), ["job_started"]);
    let exits = vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 0 }, Command::AllocExited { alloc_id, rank: 1, exit_code: 0 }];
    let finished = run(&mut state, exits);
    assert_eq!(kinds(&finished), ["job_finished"]);
    assert_eq!((finished[0].state, finished[0].reason.as_str()), (Some(JobState::Succeeded), "completed"));
}

#[test]
fn a_failed_rank_stops_the_gang_and_fails_the_job_or_requeues_it_for_a_retry() {
    let mut state = cluster();
    let job = submit(&mut state, JobSpec { max_retries: 1, ..spec(1, 1) });
    place(&mut state, job, &[("a", &[0])]);
    let alloc_id = alloc_of(&state, job);
    let failed = run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 3 }]);
    assert_eq!(kinds(&failed), ["job_stopping", "job_requeued"]);
    assert_eq!(failed[0].reason, "failed");
    assert!(failed[1].reason.starts_with("retrying"), "{:?}", failed[1]);
    assert_eq!(failed[1].state, Some(JobState::Pending));
    place(&mut state, job, &[("a", &[0])]);
    let alloc_id = alloc_of(&state, job);
    let failed = run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 3 }]);
    assert_eq!(kinds(&failed), ["job_stopping", "job_failed"]);
    assert_eq!(failed[1].state, Some(JobState::Failed));
}

#[test]
fn cancels_while_pending_and_while_running() {
    let mut state = cluster();
    let pending = submit(&mut state, spec(1, 1));
    let cancelled = run(&mut state, vec![Command::CancelJob { job_id: pending }]);
    assert_eq!(kinds(&cancelled), ["job_cancelled"]);
    assert_eq!(cancelled[0].state, Some(JobState::Cancelled));
    let again = run(&mut state, vec![Command::CancelJob { job_id: pending }]);
    assert!(again.is_empty(), "a second cancel changes nothing: {again:?}");

    let running = submit(&mut state, spec(1, 1));
    place(&mut state, running, &[("a", &[0])]);
    let alloc_id = alloc_of(&state, running);
    let stopping = run(&mut state, vec![Command::CancelJob { job_id: running }]);
    assert_eq!(kinds(&stopping), ["job_stopping"]);
    assert_eq!((stopping[0].reason.as_str(), stopping[0].state), ("cancelled", Some(JobState::Stopping)));
    let ended = run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 143 }]);
    assert_eq!(kinds(&ended), ["job_cancelled"]);
}

#[test]
fn a_preempted_job_is_requeued_with_its_reason() {
    let mut state = cluster();
    let job = submit(&mut state, spec(1, 8));
    place(&mut state, job, &[("a", &[0, 1, 2, 3, 4, 5, 6, 7])]);
    let alloc_id = alloc_of(&state, job);
    let stops = vec![Stop { alloc_id, reason: StopReason::Preempted }];
    let preempted = run(&mut state, vec![Command::ApplyPlan(Plan { stops, ..Plan::default() })]);
    assert_eq!(kinds(&preempted), ["job_preempted"]);
    assert_eq!(preempted[0].reason, "preempted");
    let requeued = run(&mut state, vec![Command::AllocExited { alloc_id, rank: 0, exit_code: 143 }]);
    assert_eq!(kinds(&requeued), ["job_requeued"]);
    assert!(requeued[0].reason.starts_with("preempted"), "{:?}", requeued[0]);
}

#[test]
fn a_node_down_drained_fenced_and_readmitted() {
    let mut state = cluster();
    let job = submit(&mut state, spec(2, 1));
    place(&mut state, job, &[("a", &[0]), ("b", &[0])]);
    let alloc_id = alloc_of(&state, job);
    let down = run(&mut state, vec![Command::NodeDown { node: "a".into() }]);
    assert_eq!(kinds(&down), ["node_down", "job_stopping"]);
    assert_eq!((down[0].node.as_str(), down[1].reason.as_str()), ("a", "node_lost"));
    let requeued = run(&mut state, vec![Command::AllocExited { alloc_id, rank: 1, exit_code: 143 }]);
    assert_eq!(kinds(&requeued), ["job_requeued"]);
    let up = run(&mut state, vec![Command::RegisterNode(node("a", 8))]);
    assert_eq!(kinds(&up), ["node_registered", "node_up"]);

    let drained = run(&mut state, vec![operator(Command::DrainNode { node: "b".into(), drain: true })]);
    assert_eq!(kinds(&drained), ["node_drained"]);
    let undrained = run(&mut state, vec![operator(Command::DrainNode { node: "b".into(), drain: false })]);
    assert_eq!(kinds(&undrained), ["node_undrained"]);

    place(&mut state, job, &[("a", &[0]), ("b", &[0])]);
    let fenced = run(&mut state, vec![Command::GpuXid { node: "b".into(), gpu: 0, xid: 79, at_ms: 0 }]);
    assert_eq!(kinds(&fenced), ["node_fenced", "job_stopping"]);
    assert_eq!(fenced[0].reason, "node: xid 79 at 1970-01-01T00:00:00Z");
    let readmitted = run(&mut state, vec![operator(Command::ReadmitNode { node: "b".into(), gpu: None })]);
    assert_eq!(kinds(&readmitted), ["node_readmitted"]);
    assert_eq!(readmitted[0].reason, "node");
}

#[test]
fn a_node_registering_without_a_gpu_requeues_the_job_on_it() {
    let mut state = cluster();
    let job = submit(&mut state, spec(1, 1));
    place(&mut state, job, &[("a", &[7])]);
    let lost = run(&mut state, vec![Command::RegisterNode(node("a", 4))]);
    assert_eq!(kinds(&lost), ["node_registered", "job_requeued"]);
    assert!(lost[1].reason.starts_with("gpu_lost"), "{:?}", lost[1]);
}

#[test]
fn queues_and_quotas_changed_and_refusals_make_no_event() {
    let mut state = cluster();
    let queue = QueueConfig { name: "batch".into(), ..QueueConfig::defaults().remove(1) };
    let changed = run(&mut state, vec![operator(Command::SetQueue(queue))]);
    assert_eq!(kinds(&changed), ["queue_changed"]);
    assert_eq!(changed[0].queue, "batch");
    let quota = GroupQuota { group: "vision".into(), gpus: 8, ..GroupQuota::default() };
    let changed = run(&mut state, vec![Command::SetQuota(quota)]);
    assert_eq!(kinds(&changed), ["quota_changed"]);
    assert_eq!(changed[0].group, "vision");
    let refused = run(&mut state, vec![Command::SubmitJob { request_id: None, spec: spec(0, 1) }, Command::CancelJob { job_id: 99 }]);
    assert!(refused.is_empty(), "{refused:?}");
}

#[test]
fn events_of_one_entry_are_numbered_in_order_and_carry_no_secrets() {
    let mut state = cluster();
    let commands = (0..3).map(|i| Command::SubmitJob { request_id: Some(format!("r{i}")), spec: spec(1, 1) }).collect();
    let events = run(&mut state, commands);
    assert_eq!(events.iter().map(|e| (e.seq, e.job_id)).collect::<Vec<_>>(), [(0, 1), (1, 2), (2, 3)]);
    let retried = run(&mut state, vec![Command::SubmitJob { request_id: Some("r0".into()), spec: spec(1, 1) }]);
    assert!(retried.is_empty(), "a deduplicated submit makes nothing new: {retried:?}");
    let text = format!("{events:?}");
    assert!(!text.contains("hunter2") && !text.contains("--secret"), "{text}");
}

#[test]
fn every_replica_derives_the_same_events_and_the_same_state_as_apply_proposal() {
    let mut with_events = cluster();
    let mut plain = with_events.clone();
    let job = submit(&mut with_events, spec(1, 1));
    plain.apply_proposal(
        with_events.applied_index,
        &Proposal { now_ms: with_events.now_ms, commands: vec![Command::SubmitJob { request_id: None, spec: spec(1, 1) }] },
    );
    assert_eq!(plain, with_events);
    let mut replayed = plain.clone();
    let first = place(&mut with_events, job, &[("a", &[0])]);
    let again = place(&mut replayed, job, &[("a", &[0])]);
    assert_eq!(first, again);
    assert_eq!(with_events, replayed);
}

#[test]
fn a_traced_command_applies_and_makes_events_as_the_command_it_holds() {
    let submit = |request_id: &str| Command::SubmitJob { request_id: Some(request_id.into()), spec: spec(1, 1) };
    let mut plain = cluster();
    let mut traced = cluster();
    let plain_events = run(&mut plain, vec![operator(submit("r1"))]);
    let wrapped = Command::Traced { request_id: "trace-1".into(), command: Box::new(operator(submit("r1"))) };
    assert_eq!(wrapped.min_format(), crate::state::TRACED_FROM_VERSION.max(operator(submit("r1")).min_format()));
    assert!(matches!(wrapped.unwrapped(), Command::SubmitJob { .. }), "seen through both wrappers");
    let traced_events = run(&mut traced, vec![wrapped]);
    assert_eq!(kinds(&traced_events), kinds(&plain_events));
    assert_eq!(kinds(&traced_events), ["job_submitted"]);
    assert_eq!(plain.jobs, traced.jobs, "the same job either way");
}

#[test]
fn a_budget_warns_once_at_its_share_and_once_when_spent() {
    let mut state = cluster();
    // 8 GPUs held: each entry (1 s later) adds 8,000 GPU-ms; warn at 64,000, spent at 80,000.
    let set = |gpu_ms| operator(Command::SetBudget { group: "vision".into(), month: 197_001, gpu_ms: Some(gpu_ms), strict: false });
    let changed = run(&mut state, vec![set(80_000)]);
    assert_eq!(kinds(&changed), ["budget_changed"]);
    assert_eq!((changed[0].topic(), changed[0].group.as_str(), changed[0].reason.as_str()), (Topic::Budgets, "vision", "1970-01"));
    let job_id = submit(&mut state, spec(1, 8));
    place(&mut state, job_id, &[("a", &[0, 1, 2, 3, 4, 5, 6, 7])]);
    let mut crossed = Vec::new();
    for _ in 0..12 {
        let used_before = state.tenancy.used_gpu_ms("vision", 197_001, state.now_ms);
        for event in run(&mut state, vec![]) {
            crossed.push((event.kind, used_before, state.tenancy.used_gpu_ms("vision", 197_001, state.now_ms)));
        }
    }
    assert_eq!(crossed.len(), 2, "{crossed:?}");
    let (warned, spent) = (crossed[0], crossed[1]);
    assert_eq!(warned.0, EventKind::BudgetWarning);
    assert!(warned.1 < 64_000 && warned.2 >= 64_000, "{warned:?}");
    assert_eq!(spent.0, EventKind::BudgetExhausted);
    assert!(spent.1 < 80_000 && spent.2 >= 80_000, "{spent:?}");
    // Raised: no event but the change, until the new share is reached.
    assert_eq!(kinds(&run(&mut state, vec![set(10_000_000)])), ["budget_changed"]);
    assert!(run(&mut state, vec![]).is_empty());
    // Lowered under the use: spent at once (the warning share is passed too).
    assert_eq!(kinds(&run(&mut state, vec![set(1_000)])), ["budget_changed", "budget_warning", "budget_exhausted"]);
}
