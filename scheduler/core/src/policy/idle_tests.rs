//! Idle GPUs end to end in the core: the agent's reports become committed
//! idle records, the policy flags and reclaims from them with the time as
//! input, and the records survive a snapshot (a new leader's state).

use crate::state::auth::Actor;
use crate::state::events::{Event, EventKind};
use crate::state::idle::{idle_gpu_ms, IdleAction, IdlePolicy, IDLE_FROM_VERSION};
use crate::state::{
    ClusterState, Command, CommandResult, GpuInfo, JobSpec, JobState, NodeRegistration, Placement, Plan, Proposal, QueueConfig,
    RankPlacement, ReasonCode, Stop, StopReason,
};

const T0: u64 = 1_796_083_200_000;
const MIN_MS: u64 = 60_000;

fn at(state: &mut ClusterState, now_ms: u64, command: Command) -> (CommandResult, Vec<Event>) {
    let index = state.applied_index + 1;
    let mut events = Vec::new();
    let result = state.apply_proposal_with_events(index, &Proposal { now_ms, commands: vec![command] }, &mut events).remove(0);
    state.check_invariants().expect("invariants hold after every entry");
    (result, events)
}

fn node(name: &str) -> Command {
    let gpus = (0..4)
        .map(|index| GpuInfo {
            index,
            uuid: format!("{name}-{index}"),
            model: "H100-80GB".into(),
            memory_mib: 81_920,
            healthy: true,
            nvlink_domain: None,
        })
        .collect();
    Command::RegisterNode(NodeRegistration { name: name.into(), address: "127.0.0.1:1".into(), rack: "r".into(), leaf: "l".into(), gpus })
}

fn training_queue(idle_after_ms: u64, action: IdleAction) -> Command {
    let queue = QueueConfig::defaults().into_iter().find(|q| q.name == "training").unwrap();
    let command = Command::SetQueueIdle { queue, idle: IdlePolicy { idle_after_ms, action } };
    Command::Audited { actor: Actor::unchecked("127.0.0.1:9"), command: Box::new(command) }
}

/// A cluster at format 8 with a 2-rank gang (job 1, allocation 1) on a and
/// b, 2 GPUs each, placed at T0.
fn cluster() -> ClusterState {
    let mut state = ClusterState::default();
    at(&mut state, T0, Command::SetClusterVersion { version: IDLE_FROM_VERSION });
    at(&mut state, T0, node("a"));
    at(&mut state, T0, node("b"));
    let spec = JobSpec { replicas: 2, gpus_per_replica: 2, ..JobSpec::simple(&["train.py"]) };
    at(&mut state, T0, Command::SubmitJob { request_id: None, spec });
    let ranks = vec![RankPlacement { node: "a".into(), gpus: vec![0, 1] }, RankPlacement { node: "b".into(), gpus: vec![0, 1] }];
    at(&mut state, T0, Command::ApplyPlan(Plan { placements: vec![Placement { job_id: 1, ranks }], ..Plan::default() }));
    for rank in 0..2 {
        at(&mut state, T0, Command::AllocStarted { alloc_id: 1, rank });
    }
    state
}

fn idle(rank: u32, idle_for_ms: Option<u64>) -> Command {
    Command::AllocIdle { alloc_id: 1, rank, idle_for_ms }
}

/// A repeated idle report keeps the first committed time. Prevents a
/// clock reset by any repeat; with apply overwriting the time (`insert`
/// for `or_insert`) it failed on commit 91782d7 with `left: 1796084040000,
/// right: 1796083800000`.
#[test]
fn reports_become_committed_times_and_repeats_keep_the_first() {
    let mut state = cluster();
    let t = T0 + 40 * MIN_MS;
    at(&mut state, t, idle(0, Some(30 * MIN_MS)));
    assert_eq!(state.idle.allocs[&1].ranks[&0], T0 + 10 * MIN_MS, "committed time minus the agent's duration");
    assert_eq!(state.alloc_idle_since_ms(1), None, "the gang is idle only when every rank is");
    // A repeated report (another leader, a restarted agent) keeps the first time.
    at(&mut state, t + 5 * MIN_MS, idle(0, Some(31 * MIN_MS)));
    assert_eq!(state.idle.allocs[&1].ranks[&0], T0 + 10 * MIN_MS);
    // A duration longer than the allocation's life counts from its placement.
    at(&mut state, t + 5 * MIN_MS, idle(1, Some(10 * 60 * MIN_MS)));
    assert_eq!(state.idle.allocs[&1].ranks[&1], T0);
    assert_eq!(state.alloc_idle_since_ms(1), Some(T0 + 10 * MIN_MS), "the latest rank's time");
    assert_eq!(state.idle_gpus_by_group().get("default"), Some(&4));
    // Busy: the span is counted for the job, the record goes.
    let busy_at = T0 + 60 * MIN_MS;
    at(&mut state, busy_at, idle(0, None));
    assert_eq!(state.idle.allocs[&1].ranks.len(), 1);
    assert_eq!(idle_gpu_ms(&state, 1), 2 * 50 * MIN_MS + 2 * 60 * MIN_MS, "rank 0's ended span and rank 1's running one");
    // Busy again, and reports about ranks or allocations that do not exist: no-ops.
    let before = state.idle.clone();
    at(&mut state, busy_at, idle(0, None));
    at(&mut state, busy_at, Command::AllocIdle { alloc_id: 9, rank: 0, idle_for_ms: Some(1) });
    at(&mut state, busy_at, idle(7, Some(1)));
    assert_eq!(state.idle, before);
}

#[test]
fn a_report_for_an_ended_allocation_changes_nothing_and_its_time_stays_with_the_job() {
    let mut state = cluster();
    at(&mut state, T0 + 10 * MIN_MS, idle(0, Some(10 * MIN_MS)));
    at(&mut state, T0 + 20 * MIN_MS, Command::CancelJob { job_id: 1 });
    at(&mut state, T0 + 20 * MIN_MS, Command::AllocExited { alloc_id: 1, rank: 0, exit_code: 143 });
    at(&mut state, T0 + 20 * MIN_MS, Command::AllocExited { alloc_id: 1, rank: 1, exit_code: 143 });
    assert!(state.allocs.is_empty());
    assert!(state.idle.allocs.is_empty(), "the record ends with its allocation");
    assert_eq!(idle_gpu_ms(&state, 1), 2 * 20 * MIN_MS);
    let (result, _) = at(&mut state, T0 + 30 * MIN_MS, idle(1, Some(MIN_MS)));
    assert_eq!(result, CommandResult::Done, "a stale report is accepted and dropped");
    assert!(state.idle.allocs.is_empty());
}

#[test]
fn reports_before_format_8_change_nothing() {
    let mut state = cluster();
    state.cluster_version = 7;
    at(&mut state, T0 + MIN_MS, idle(0, Some(MIN_MS)));
    assert!(state.idle.allocs.is_empty());
    assert_eq!(idle(0, None).min_format(), IDLE_FROM_VERSION);
    assert_eq!(Command::IdleFlagged { alloc_ids: vec![] }.min_format(), IDLE_FROM_VERSION);
}

/// Flag and reclaim at the boundary, and apply's own check of a reclaim:
/// a plan computed before a rank turned busy must not stop it. Without
/// the check in `apply_plan` it failed on commit 91782d7 with `left:
/// PlanApplied { .., stopped: 1 }, right: PlanApplied { .., stopped: 0 }`.
#[test]
fn the_flag_and_the_reclaim_fall_at_the_queues_idle_time_inclusive() {
    let mut state = cluster();
    at(&mut state, T0, training_queue(30 * MIN_MS, IdleAction::Flag));
    at(&mut state, T0 + 5 * MIN_MS, idle(0, Some(5 * MIN_MS)));
    at(&mut state, T0 + 5 * MIN_MS, idle(1, Some(5 * MIN_MS)));
    assert_eq!(state.alloc_idle_since_ms(1), Some(T0));
    let boundary = T0 + 30 * MIN_MS;
    assert!(super::idle::to_flag(&state, boundary - 1).is_empty());
    assert_eq!(super::idle::to_flag(&state, boundary), vec![1]);
    assert!(super::plan(&state, boundary).stops.is_empty(), "flag only: nothing is stopped");
    let (_, events) = at(&mut state, boundary, Command::IdleFlagged { alloc_ids: vec![1, 1, 5] });
    assert_eq!(state.idle.allocs[&1].flagged_ms, Some(boundary));
    let flagged: Vec<&Event> = events.iter().filter(|e| e.kind == EventKind::JobIdleFlagged).collect();
    assert_eq!(flagged.len(), 1, "{events:?}");
    assert_eq!((flagged[0].job_id, flagged[0].reason.as_str()), (1, "idle since 2026-12-01T00:00:00Z"));
    assert!(super::idle::to_flag(&state, boundary + MIN_MS).is_empty(), "flagged once");
    let (_, again) = at(&mut state, boundary + MIN_MS, Command::IdleFlagged { alloc_ids: vec![1] });
    assert!(again.iter().all(|e| e.kind != EventKind::JobIdleFlagged), "no second event");
    // Reclaim: the pass stops it, at the boundary and not before.
    at(&mut state, boundary + MIN_MS, training_queue(40 * MIN_MS, IdleAction::Reclaim));
    let reclaim_at = T0 + 40 * MIN_MS;
    assert!(super::plan(&state, reclaim_at - 1).stops.is_empty());
    let plan = super::plan(&state, reclaim_at);
    assert_eq!(plan.stops, vec![Stop { alloc_id: 1, reason: StopReason::IdleReclaimed }]);
    assert_eq!(Command::ApplyPlan(plan.clone()).min_format(), IDLE_FROM_VERSION);
    // A rank that turned busy after the pass makes apply refuse the stop.
    let mut busy = state.clone();
    at(&mut busy, reclaim_at, idle(1, None));
    let (result, _) = at(&mut busy, reclaim_at, Command::ApplyPlan(plan.clone()));
    assert_eq!(result, CommandResult::PlanApplied { placed: 0, rejected: 0, stopped: 0 });
    // Else it stops, and the job ends failed, not retried.
    let (result, events) = at(&mut state, reclaim_at, Command::ApplyPlan(plan));
    assert_eq!(result, CommandResult::PlanApplied { placed: 0, rejected: 0, stopped: 1 });
    assert!(events.iter().any(|e| e.kind == EventKind::JobStopping && e.reason == "idle_reclaimed"), "{events:?}");
    at(&mut state, reclaim_at + MIN_MS, Command::AllocExited { alloc_id: 1, rank: 0, exit_code: 143 });
    at(&mut state, reclaim_at + MIN_MS, Command::AllocExited { alloc_id: 1, rank: 1, exit_code: 143 });
    let job = &state.jobs[&1];
    assert_eq!(
        (job.state, job.stop_reason, job.reason.code),
        (JobState::Failed, Some(StopReason::IdleReclaimed), ReasonCode::IdleReclaimed)
    );
    assert_eq!(idle_gpu_ms(&state, 1), 4 * 41 * MIN_MS);
}

/// A new leader starts from the replicated state: a snapshot restored and
/// the reports of the same idle span again. The committed time stays.
/// With apply overwriting the time it failed on commit 91782d7 with
/// `left: Some(1796084340000), right: Some(1796083200000)`.
#[test]
fn a_leader_change_does_not_reset_the_idle_clock() {
    let mut state = cluster();
    at(&mut state, T0, training_queue(30 * MIN_MS, IdleAction::Flag));
    at(&mut state, T0 + 35 * MIN_MS, idle(0, Some(35 * MIN_MS)));
    at(&mut state, T0 + 35 * MIN_MS, idle(1, Some(35 * MIN_MS)));
    at(&mut state, T0 + 35 * MIN_MS, Command::IdleFlagged { alloc_ids: vec![1] });
    let since = state.alloc_idle_since_ms(1);
    let mut restored = ClusterState::from_snapshot(&state.to_snapshot()).unwrap();
    assert_eq!(restored.idle, state.idle);
    // The new leader's agents report a shorter duration (a restarted agent
    // counts from its own start): nothing changes.
    at(&mut restored, T0 + 50 * MIN_MS, idle(0, Some(31 * MIN_MS)));
    at(&mut restored, T0 + 50 * MIN_MS, idle(1, Some(31 * MIN_MS)));
    assert_eq!(restored.alloc_idle_since_ms(1), since);
    assert_eq!(restored.idle.allocs[&1].flagged_ms, Some(T0 + 35 * MIN_MS));
    assert!(super::idle::to_flag(&restored, T0 + 50 * MIN_MS).is_empty());
}

#[test]
fn a_queue_idle_rule_needs_format_8_and_a_sane_time() {
    let mut state = cluster();
    let (result, _) = at(&mut state, T0, training_queue(0, IdleAction::Reclaim));
    assert!(
        matches!(result, CommandResult::Rejected(crate::state::Rejection::Invalid { ref field, .. }) if field == "queue.idle_after_ms")
    );
    state.cluster_version = 7;
    let (result, _) = at(&mut state, T0, training_queue(MIN_MS, IdleAction::Reclaim));
    assert!(matches!(result, CommandResult::Rejected(_)), "{result:?}");
    assert_eq!(state.idle.policy("training"), IdlePolicy::default());
}
