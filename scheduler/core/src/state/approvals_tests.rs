//! Apply of two-person changes (format 8).

use std::collections::{BTreeMap, BTreeSet};

use super::approvals::{ChangeKind, APPROVALS_FROM_VERSION, MAX_PENDING_CHANGES};
use super::auth::{Actor, Role};
use super::*;

const T0: u64 = 1_796_083_200_000;
const EXPIRE_MS: u64 = 60_000;

fn one(state: &mut ClusterState, now_ms: u64, command: Command) -> CommandResult {
    let index = state.applied_index + 1;
    let result = state.apply_proposal(index, &Proposal { now_ms, commands: vec![command] }).remove(0);
    state.check_invariants().expect("invariants hold after every entry");
    result
}

fn actor(user: &str, impersonator: Option<&str>) -> Actor {
    Actor { user: Some(user.into()), impersonator: impersonator.map(Into::into), from: "127.0.0.1:9".into() }
}

fn by(user: &str, command: Command) -> Command {
    Command::Audited { actor: actor(user, None), command: Box::new(command) }
}

fn quota(group: &str, gpus: u32) -> Command {
    Command::SetQuota(GroupQuota { group: group.into(), gpus, per_model: BTreeMap::new(), lend: true, lend_to: vec![], borrow_limit: None })
}

fn require(kind: ChangeKind, required: bool) -> Command {
    Command::RequireApproval { kind, required, expire_after_ms: EXPIRE_MS }
}

fn pending_id(result: CommandResult) -> u64 {
    match result {
        CommandResult::AwaitingApproval { change_id, .. } => change_id,
        other => panic!("expected a pending change, got {other:?}"),
    }
}

fn denied(result: &CommandResult) -> bool {
    matches!(result, CommandResult::Rejected(Rejection::PermissionDenied { .. }))
}

/// A format 8 cluster with operators otto and olga, an admin ada who may
/// act for others, a portal account that may too, and a plain user.
fn cluster() -> ClusterState {
    let mut state = ClusterState::default();
    assert_eq!(one(&mut state, T0, Command::SetClusterVersion { version: APPROVALS_FROM_VERSION }), CommandResult::Done);
    assert_eq!(one(&mut state, T0, Command::BootstrapAdmin { name: "ada".into() }), CommandResult::Done);
    let users =
        [("otto", Role::Operator, true), ("olga", Role::Operator, false), ("portal", Role::Operator, true), ("uma", Role::User, false)];
    for (name, role, impersonate) in users {
        let set = Command::SetUser { name: name.into(), role, groups: BTreeSet::from(["vision".to_string()]), impersonate };
        assert_eq!(one(&mut state, T0, by("ada", set)), CommandResult::Done);
    }
    assert_eq!(one(&mut state, T0, by("otto", require(ChangeKind::Quota, true))), CommandResult::Done);
    state
}

#[test]
fn a_ruled_change_waits_for_a_second_person_and_then_applies() {
    let mut state = cluster();
    let id = pending_id(one(&mut state, T0, by("otto", quota("vision", 16))));
    assert!(!state.quotas.contains_key("vision"), "nothing is applied before approval");
    let again = one(&mut state, T0 + 1, by("otto", Command::ApproveChange { id }));
    assert!(denied(&again), "the requester cannot approve: {again:?}");
    assert_eq!(one(&mut state, T0 + 2, by("olga", Command::ApproveChange { id })), CommandResult::Done);
    assert_eq!(state.quotas["vision"].gpus, 16);
    assert!(state.approvals.pending.is_empty());
    let twice = one(&mut state, T0 + 3, by("olga", Command::ApproveChange { id }));
    assert!(matches!(twice, CommandResult::Rejected(Rejection::NotFound { .. })));
    let trail: Vec<&str> = state.auth.audit.iter().rev().take(4).map(|r| r.outcome.as_str()).collect();
    assert!(trail.iter().any(|o| o.contains("awaiting approval as change")), "{trail:?}");
}

#[test]
fn the_same_person_acting_as_someone_else_cannot_approve() {
    let mut state = cluster();
    let id = pending_id(one(&mut state, T0, by("otto", quota("vision", 8))));
    let as_olga = Command::Audited { actor: actor("olga", Some("otto")), command: Box::new(Command::ApproveChange { id }) };
    assert!(denied(&one(&mut state, T0 + 1, as_olga)), "otto acting as olga is still otto");
    // One portal account acting for two different people is one person.
    let asked = Command::Audited { actor: actor("uma", Some("portal")), command: Box::new(quota("vision", 4)) };
    let denied_for_uma = one(&mut state, T0 + 2, asked);
    assert!(denied(&denied_for_uma), "uma may not set quotas at all: {denied_for_uma:?}");
    let asked = Command::Audited { actor: actor("olga", Some("portal")), command: Box::new(quota("nlp", 4)) };
    let id = pending_id(one(&mut state, T0 + 3, asked));
    let approved = Command::Audited { actor: actor("otto", Some("portal")), command: Box::new(Command::ApproveChange { id }) };
    assert!(denied(&one(&mut state, T0 + 4, approved)), "the portal approved its own change");
    assert!(!state.quotas.contains_key("nlp"));
}

#[test]
fn an_approver_needs_the_right_to_make_the_change() {
    let mut state = cluster();
    let id = pending_id(one(&mut state, T0, by("otto", quota("vision", 8))));
    assert!(denied(&one(&mut state, T0 + 1, by("uma", Command::ApproveChange { id }))));
    assert!(!state.quotas.contains_key("vision"));
}

#[test]
fn a_change_expires_and_a_stale_one_is_refused() {
    let mut state = cluster();
    let late = pending_id(one(&mut state, T0, by("otto", quota("vision", 8))));
    let expired = one(&mut state, T0 + EXPIRE_MS, by("olga", Command::ApproveChange { id: late }));
    assert!(matches!(expired, CommandResult::Rejected(Rejection::Conflict { .. })), "{expired:?}");
    assert!(!state.quotas.contains_key("vision"));
    // Two requests on one quota: approving the first makes the second stale.
    let t = T0 + 2 * EXPIRE_MS;
    let first = pending_id(one(&mut state, t, by("otto", quota("vision", 8))));
    let second = pending_id(one(&mut state, t, by("otto", quota("vision", 32))));
    assert_eq!(state.approvals.pending.len(), 2, "the expired change was dropped");
    assert_eq!(one(&mut state, t + 1, by("olga", Command::ApproveChange { id: second })), CommandResult::Done);
    let stale = one(&mut state, t + 2, by("olga", Command::ApproveChange { id: first }));
    assert!(matches!(stale, CommandResult::Rejected(Rejection::Conflict { .. })), "{stale:?}");
    assert_eq!(state.quotas["vision"].gpus, 32, "the newer change stays");
    assert_eq!(one(&mut state, t + 3, by("otto", Command::WithdrawChange { id: first })), CommandResult::Done);
    assert!(state.approvals.pending.is_empty());
}

#[test]
fn no_path_changes_a_ruled_kind_without_approval() {
    let mut state = cluster();
    // An unaudited command (the path of clusters without users) is refused.
    assert!(denied(&one(&mut state, T0, quota("vision", 8))));
    // Lifting the rule is itself a quota change.
    let id = pending_id(one(&mut state, T0, by("otto", require(ChangeKind::Quota, false))));
    assert!(state.approvals.rules.contains_key(&ChangeKind::Quota));
    assert_eq!(one(&mut state, T0 + 1, by("olga", Command::ApproveChange { id })), CommandResult::Done);
    assert!(state.approvals.rules.is_empty());
    assert_eq!(one(&mut state, T0 + 2, by("otto", quota("vision", 8))), CommandResult::Done);
    // A kind not ruled applies at once.
    let queue = QueueConfig { name: "batch".into(), ..QueueConfig::defaults().remove(0) };
    assert_eq!(one(&mut state, T0 + 3, by("otto", Command::SetQueue(queue))), CommandResult::Done);
}

#[test]
fn bad_input_is_refused_when_asked_and_pending_changes_are_bounded() {
    let mut state = cluster();
    let bad = Command::RequireApproval { kind: ChangeKind::Budget, required: true, expire_after_ms: 1 };
    let refused = one(&mut state, T0, by("otto", bad));
    assert!(matches!(&refused, CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "expire_after_ms"), "{refused:?}");
    let bad_quota = quota("no such group!", 8);
    assert!(matches!(one(&mut state, T0, by("otto", bad_quota)), CommandResult::Rejected(Rejection::Invalid { .. })));
    for n in 0..MAX_PENDING_CHANGES {
        pending_id(one(&mut state, T0, by("otto", quota(&format!("g{n}"), 1))));
    }
    let full = one(&mut state, T0, by("otto", quota("vision", 1)));
    assert!(matches!(full, CommandResult::Rejected(Rejection::Exhausted { .. })), "{full:?}");
    // Once they expire, there is room again.
    pending_id(one(&mut state, T0 + EXPIRE_MS, by("otto", quota("vision", 1))));
    assert_eq!(state.approvals.pending.len(), 1);
}

#[test]
fn pending_changes_survive_a_snapshot() {
    let mut state = cluster();
    let id = pending_id(one(&mut state, T0, by("otto", quota("vision", 8))));
    let mut restored = ClusterState::from_snapshot(&state.to_snapshot()).expect("a format 8 snapshot decodes");
    assert_eq!(restored.approvals, state.approvals);
    assert_eq!(one(&mut restored, T0 + 1, by("olga", Command::ApproveChange { id })), CommandResult::Done);
    assert_eq!(restored.quotas["vision"].gpus, 8);
}

/// A command a person sent is written in the format of what it holds, not
/// of its wrapper: an `Audited` template, budget or approval command once
/// claimed format 5, so a replica on an older build would have misread the
/// entry as corrupt (or the proposer would have let it into the log of a
/// cluster not yet upgraded) instead of waiting for the cluster version.
#[test]
fn a_wrapped_command_needs_the_format_of_what_it_holds() {
    let approve = by("otto", Command::ApproveChange { id: 1 });
    assert_eq!(approve.min_format(), APPROVALS_FROM_VERSION);
    let budget = by("otto", Command::SetBudget { group: "vision".into(), month: 202_612, gpu_ms: None, strict: false });
    assert_eq!(budget.min_format(), tenancy::TENANCY_FROM_VERSION);
    let traced = Command::Traced { request_id: "r".into(), command: Box::new(approve) };
    assert_eq!(traced.min_format(), APPROVALS_FROM_VERSION);
    assert_eq!(by("otto", Command::CancelJob { job_id: 1 }).min_format(), 5);
    let entry = codec::encode_proposal(&Proposal { now_ms: 1, commands: vec![budget] });
    assert_eq!(codec::version_of("entry", &entry).unwrap().0, tenancy::TENANCY_FROM_VERSION);
}

/// A queue's idle rule is queue policy: with policy changes ruled, an
/// idle-reclaim switch waits for approval like any queue setting.
#[test]
fn a_queue_idle_rule_is_a_policy_change() {
    let mut state = cluster();
    assert_eq!(one(&mut state, T0, by("otto", require(ChangeKind::Policy, true))), CommandResult::Done);
    let queue = QueueConfig::defaults().remove(1);
    let idle = super::idle::IdlePolicy { idle_after_ms: 60_000, action: super::idle::IdleAction::Reclaim };
    let id = pending_id(one(&mut state, T0, by("otto", Command::SetQueueIdle { queue: queue.clone(), idle })));
    assert!(!state.idle.queue_policies.contains_key(&queue.name));
    assert_eq!(one(&mut state, T0 + 1, by("olga", Command::ApproveChange { id })), CommandResult::Done);
    assert_eq!(state.idle.queue_policies[&queue.name], idle);
}
