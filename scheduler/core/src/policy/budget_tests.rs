//! The policy and spent budgets: a group's pending jobs are skipped (no
//! placement, no preemption, no reservation) with the reason
//! `budget_exhausted`, until the budget is raised.

use crate::state::tenancy::TENANCY_FROM_VERSION;
use crate::state::{ClusterState, Command, CommandResult, JobSpec, Placement, Plan, Proposal, RankPlacement, ReasonCode};

/// 2026-12-01T00:00:00Z.
const DEC_2026: u64 = 1_796_083_200_000;
const HOUR_MS: u64 = 3_600_000;

fn at(state: &mut ClusterState, now_ms: u64, command: Command) -> CommandResult {
    let index = state.applied_index + 1;
    let result = state.apply_proposal(index, &Proposal { now_ms, commands: vec![command] }).remove(0);
    state.check_invariants().expect("invariants hold after every entry");
    result
}

fn node() -> Command {
    Command::RegisterNode(crate::state::tests::node("n1", 8))
}

fn submit(group: &str, gpus_per_replica: u32) -> Command {
    let spec = JobSpec { group: group.into(), gpus_per_replica, ..JobSpec::simple(&["train.py"]) };
    Command::SubmitJob { request_id: None, spec }
}

fn budget(gpu_ms: u64) -> Command {
    Command::SetBudget { group: "vision".into(), month: 202_612, gpu_ms: Some(gpu_ms), strict: false }
}

fn audited(command: Command) -> Command {
    Command::Audited { actor: crate::state::auth::Actor::unchecked("127.0.0.1:9"), command: Box::new(command) }
}

#[test]
fn a_spent_budget_keeps_its_groups_jobs_pending_until_it_is_raised() {
    let mut state = ClusterState::default();
    let t = DEC_2026 + 1_000;
    at(&mut state, t, Command::SetClusterVersion { version: TENANCY_FROM_VERSION });
    at(&mut state, t, node());
    assert_eq!(at(&mut state, t, audited(budget(HOUR_MS))), CommandResult::Done);
    at(&mut state, t, submit("vision", 2)); // job 1, runs
    at(&mut state, t, submit("vision", 4)); // job 2, waits
    let placement = Placement { job_id: 1, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![0, 1] }] };
    at(&mut state, t, Command::ApplyPlan(Plan { placements: vec![placement], ..Plan::default() }));
    at(&mut state, t, submit("nlp", 1)); // job 3, another group
                                         // 2 GPUs for 30 minutes spend the hour.
    let spent = t + 30 * 60_000;
    let plan = super::plan(&state, spent);
    assert!(plan.placements.iter().all(|p| p.job_id != 2), "{plan:?}");
    assert!(plan.placements.iter().any(|p| p.job_id == 3), "other groups are placed: {plan:?}");
    assert!(plan.stops.is_empty(), "running jobs are not stopped: {plan:?}");
    let note = plan.pending.iter().find(|n| n.job_id == 2).expect("a note for the waiting job");
    assert_eq!(note.reason.code, ReasonCode::BudgetExhausted);
    assert!(note.reason.detail.contains("group vision used 1.000 of its 1.000 GPU-hours for 2026-12"), "{}", note.reason);
    assert_eq!(note.estimated_start_ms, None);
    assert_eq!(Command::ApplyPlan(plan.clone()).min_format(), TENANCY_FROM_VERSION);
    at(&mut state, spent, Command::ApplyPlan(plan));
    assert_eq!(state.jobs[&2].reason.code, ReasonCode::BudgetExhausted);
    // A plan computed before the budget was spent is refused by apply.
    let stale = Placement { job_id: 2, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![4, 5, 6, 7] }] };
    let result = at(&mut state, spent, Command::ApplyPlan(Plan { placements: vec![stale], ..Plan::default() }));
    assert_eq!(result, CommandResult::PlanApplied { placed: 0, rejected: 1, stopped: 0 });
    // Raising the budget releases it.
    assert_eq!(at(&mut state, spent, audited(budget(3 * HOUR_MS))), CommandResult::Done);
    let plan = super::plan(&state, spent);
    assert!(plan.placements.iter().any(|p| p.job_id == 2), "{plan:?}");
}
