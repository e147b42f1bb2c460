//! Reasons and estimates reach every pending job, a bounded number per plan.

use super::pass::MAX_NOTES_PER_PLAN;
use crate::state::{ClusterState, Command, JobSpec, Plan, Proposal};

const NOW_MS: u64 = 1_796_083_200_000;

fn apply(state: &mut ClusterState, commands: Vec<Command>) {
    let index = state.applied_index + 1;
    state.apply_proposal(index, &Proposal { now_ms: NOW_MS, commands });
}

#[test]
fn a_long_queue_is_noted_over_several_plans_none_larger_than_the_cap() {
    let mut state = ClusterState::default();
    let jobs = 2 * MAX_NOTES_PER_PLAN + 100;
    let submits: Vec<Command> = (0..jobs).map(|_| Command::SubmitJob { request_id: None, spec: JobSpec::simple(&["train.py"]) }).collect();
    for batch in submits.chunks(1_000) {
        apply(&mut state, batch.to_vec());
    }
    let mut noted = std::collections::BTreeSet::new();
    let mut sizes = Vec::new();
    for _ in 0..5 {
        let plan = super::plan(&state, NOW_MS);
        sizes.push(plan.pending.len());
        noted.extend(plan.pending.iter().map(|n| n.job_id));
        let notes = Plan { computed_at_index: plan.computed_at_index, pending: plan.pending, ..Plan::default() };
        apply(&mut state, vec![Command::ApplyPlan(notes)]);
    }
    assert_eq!(sizes, vec![MAX_NOTES_PER_PLAN, MAX_NOTES_PER_PLAN, 100, 0, 0], "each plan carries at most the cap");
    assert_eq!(noted.len(), jobs, "every pending job got its reason");
    state.check_invariants().expect("invariants hold");
}
