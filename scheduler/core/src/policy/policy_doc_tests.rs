//! Policy documents (format 9): apply, canary, promote, rollback, the
//! bounded history, validation, and the pass under the state's documents.

use serde_json::json;

use crate::state::auth::{Actor, Role};
use crate::state::policy_doc::{CanaryScope, PolicyDocument, MAX_POLICY_VERSIONS, POLICY_DOC_FROM_VERSION};
use crate::state::{ClusterState, Command, CommandResult, GpuInfo, JobSpec, NodeRegistration, Priority, Proposal, Rejection};

use super::order;
use super::quota::QuotaBook;
use super::view::View;
use super::PolicyConfig;

const T0: u64 = 1_796_083_200_000;

fn at(state: &mut ClusterState, now_ms: u64, command: Command) -> CommandResult {
    let index = state.applied_index + 1;
    let result = state.apply_proposal(index, &Proposal { now_ms, commands: vec![command] }).remove(0);
    state.check_invariants().expect("invariants hold after every entry");
    result
}

fn by(user: &str, command: Command) -> Command {
    Command::Audited { actor: Actor::user(user, "127.0.0.1:9"), command: Box::new(command) }
}

fn node(gpus: u32) -> Command {
    let gpus = (0..gpus)
        .map(|index| GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "H100-80GB".into(),
            memory_mib: 81_920,
            healthy: true,
            nvlink_domain: Some(0),
        })
        .collect();
    Command::RegisterNode(NodeRegistration { name: "n1".into(), address: "127.0.0.1".into(), rack: "r1".into(), leaf: "l1".into(), gpus })
}

fn submit(queue: &str, priority: Priority, runtime_limit_s: u64) -> Command {
    let spec = JobSpec { queue: queue.into(), priority, runtime_limit_s, ..JobSpec::simple(&["train.py"]) };
    Command::SubmitJob { request_id: None, spec }
}

/// A format 9 cluster with an admin ada and a plain user uma.
fn cluster() -> ClusterState {
    let mut state = ClusterState::default();
    assert_eq!(at(&mut state, T0, Command::SetClusterVersion { version: POLICY_DOC_FROM_VERSION }), CommandResult::Done);
    assert_eq!(at(&mut state, T0, Command::BootstrapAdmin { name: "ada".into() }), CommandResult::Done);
    let uma = Command::SetUser { name: "uma".into(), role: Role::User, groups: ["default".to_string()].into(), impersonate: false };
    assert_eq!(at(&mut state, T0, by("ada", uma)), CommandResult::Done);
    state
}

/// Priority counts for much, shortness for nothing.
fn by_priority() -> PolicyDocument {
    PolicyDocument { priority_points: 100, limit_points: 0, ..PolicyDocument::default() }
}

fn apply(document: PolicyDocument, comment: &str, canary: Option<CanaryScope>) -> Command {
    Command::ApplyPolicy { document, comment: comment.into(), canary }
}

#[test]
fn the_default_document_is_the_default_policy() {
    assert_eq!(PolicyConfig::from_document(&PolicyDocument::default()), PolicyConfig::default());
    assert_eq!(ClusterState::default().policy.active_document(), PolicyDocument::default());
}

/// Placements record the version they were made under (the canary's for
/// its queue). Without the record at apply (`record_policy_version`) it
/// failed with `left: None, right: Some(1)`.
#[test]
fn apply_promote_and_rollback_move_the_active_version_and_placements_record_it() {
    let mut state = cluster();
    at(&mut state, T0, node(8));
    assert_eq!(at(&mut state, T0, by("ada", apply(by_priority(), "priority first", None))), CommandResult::Done);
    assert_eq!((state.policy.active, state.policy.last_version), (1, 1));
    let kept = state.policy.version(1).unwrap();
    assert_eq!((kept.author.as_str(), kept.applied_ms, kept.comment.as_str()), ("ada", T0, "priority first"));
    at(&mut state, T0, submit("training", Priority::Medium, 0));
    let plan = super::plan(&state, T0);
    at(&mut state, T0, Command::ApplyPlan(plan));
    assert_eq!(state.policy.job_versions.get(&1), Some(&1), "the job was placed under version 1");

    // A canary on the service queue: its jobs are placed under version 2.
    let canary =
        apply(PolicyDocument { aging_cap: 5, ..PolicyDocument::default() }, "less aging", Some(CanaryScope::Queue("service".into())));
    assert_eq!(at(&mut state, T0, by("ada", canary)), CommandResult::Done);
    assert_eq!((state.policy.active, state.policy.canary.as_ref().map(|c| c.version)), (1, Some(2)));
    at(&mut state, T0, submit("service", Priority::Medium, 0));
    at(&mut state, T0, submit("training", Priority::Medium, 0));
    let plan = super::plan(&state, T0);
    at(&mut state, T0, Command::ApplyPlan(plan));
    assert_eq!((state.policy.job_versions.get(&2), state.policy.job_versions.get(&3)), (Some(&2), Some(&1)));
    // A second document waits for the staged one.
    let refused = at(&mut state, T0, by("ada", apply(PolicyDocument::default(), "", None)));
    assert!(matches!(refused, CommandResult::Rejected(Rejection::Conflict { .. })), "{refused:?}");

    assert_eq!(at(&mut state, T0, by("ada", Command::PromotePolicy)), CommandResult::Done);
    assert_eq!((state.policy.active, state.policy.canary.clone()), (2, None));
    // Rollback returns to the version active before.
    assert_eq!(at(&mut state, T0, by("ada", Command::RollbackPolicy { to: None })), CommandResult::Done);
    assert_eq!(state.policy.active, 1);
    assert_eq!(state.policy.active_document(), by_priority());
    // A staged canary that is rolled back is dropped; the active stays.
    let canary = apply(PolicyDocument::default(), "try defaults", Some(CanaryScope::Group("default".into())));
    assert_eq!(at(&mut state, T0, by("ada", canary)), CommandResult::Done);
    assert_eq!(at(&mut state, T0, by("ada", Command::RollbackPolicy { to: None })), CommandResult::Done);
    assert_eq!((state.policy.active, state.policy.canary.clone()), (1, None));
    // Back to the defaults, and to a version not kept.
    assert_eq!(at(&mut state, T0, by("ada", Command::RollbackPolicy { to: Some(0) })), CommandResult::Done);
    assert_eq!(state.policy.active, 0);
    let missing = at(&mut state, T0, by("ada", Command::RollbackPolicy { to: Some(99) }));
    assert!(matches!(missing, CommandResult::Rejected(Rejection::NotFound { .. })), "{missing:?}");
    let nothing = at(&mut state, T0, by("ada", Command::PromotePolicy));
    assert!(matches!(nothing, CommandResult::Rejected(Rejection::Conflict { .. })), "{nothing:?}");
    // The whole part round-trips in a format 9 snapshot.
    let restored = ClusterState::from_snapshot(&state.to_snapshot()).unwrap();
    assert_eq!(restored.policy, state.policy);
}

/// Plain users are refused. With the policy commands authorized as reads
/// it failed: uma's apply returned `Done`.
#[test]
fn only_admins_apply_documents_and_the_commands_need_format_9() {
    let mut state = cluster();
    let refused = at(&mut state, T0, by("uma", apply(by_priority(), "", None)));
    assert!(matches!(refused, CommandResult::Rejected(Rejection::PermissionDenied { .. })), "{refused:?}");
    for command in [Command::PromotePolicy, Command::RollbackPolicy { to: None }] {
        let refused = at(&mut state, T0, by("uma", command));
        assert!(matches!(refused, CommandResult::Rejected(Rejection::PermissionDenied { .. })), "{refused:?}");
    }
    assert_eq!(state.policy.last_version, 0);
    let bare = at(&mut state, T0, apply(by_priority(), "", None));
    assert!(matches!(bare, CommandResult::Rejected(Rejection::Invalid { .. })), "only inside Audited: {bare:?}");
    assert_eq!(by("ada", apply(by_priority(), "", None)).min_format(), 9);
    assert_eq!(Command::PromotePolicy.min_format(), 9);
}

/// The history is bounded and keeps the active version. Trimming the
/// oldest whatever it is failed: the front was no longer version 1.
#[test]
fn the_history_keeps_the_newest_versions_and_never_the_active_one_dropped() {
    let mut state = cluster();
    let staged = apply(PolicyDocument { aging_cap: 1, ..PolicyDocument::default() }, "first", None);
    assert_eq!(at(&mut state, T0, by("ada", staged)), CommandResult::Done);
    // Version 1 stays active while a canary is staged and rolled back many times.
    for i in 0..(MAX_POLICY_VERSIONS as u64 + 10) {
        let doc = PolicyDocument { aging_cap: 100 + i, ..PolicyDocument::default() };
        let canary = apply(doc, &"x".repeat(1024), Some(CanaryScope::Queue("training".into())));
        assert_eq!(at(&mut state, T0, by("ada", canary)), CommandResult::Done);
        assert_eq!(at(&mut state, T0, by("ada", Command::RollbackPolicy { to: None })), CommandResult::Done);
    }
    assert_eq!(state.policy.history.len(), MAX_POLICY_VERSIONS);
    assert_eq!(state.policy.active, 1);
    assert_eq!(state.policy.history.front().map(|v| v.version), Some(1), "the active version is never dropped");
    assert_eq!(state.policy.history.back().map(|v| v.version), Some(MAX_POLICY_VERSIONS as u64 + 11));
    let bytes = bincode::serialize(&state.policy).unwrap().len();
    assert!(bytes <= MAX_POLICY_VERSIONS * crate::state::policy_doc::MAX_POLICY_VERSION_BYTES, "{bytes} bytes");
    let long = at(&mut state, T0, by("ada", apply(PolicyDocument::default(), &"x".repeat(1025), None)));
    assert!(matches!(long, CommandResult::Rejected(Rejection::Invalid { ref field, .. }) if field == "comment"), "{long:?}");
}

#[test]
fn a_bad_document_is_refused_naming_the_field_and_its_range() {
    let unknown = PolicyDocument::from_json(&json!({"queue_points": 3, "qeue_points": 4})).unwrap_err();
    assert_eq!(unknown.field, "qeue_points");
    assert!(unknown.to_string().contains("unknown field"), "{unknown}");
    let range = PolicyDocument::from_json(&json!({"aging_step_ms": 0})).unwrap_err();
    assert_eq!(range.to_string(), "aging_step_ms: must be an integer in 1000..=604800000, got 0");
    let negative = PolicyDocument::from_json(&json!({"queue_points": -1})).unwrap_err();
    assert_eq!(negative.to_string(), "queue_points: must be an integer in 0..=1000, got -1");
    let wrong = PolicyDocument::from_json(&json!({"topology": "yes"})).unwrap_err();
    assert_eq!(wrong.to_string(), "topology: must be true or false, got \"yes\"");
    let partial = PolicyDocument::from_json(&json!({"queue_points": 3})).unwrap();
    assert_eq!(partial, PolicyDocument { queue_points: 3, ..PolicyDocument::default() });
    assert_eq!(partial.diff(&PolicyDocument::default()), vec![("queue_points", json!(3), json!(10))]);
    // Apply refuses it too, changing nothing.
    let mut state = cluster();
    let bad = PolicyDocument { reservation_wait_divisor: 0, ..PolicyDocument::default() };
    let refused = at(&mut state, T0, by("ada", apply(bad, "", None)));
    assert!(
        matches!(&refused, CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "reservation_wait_divisor"),
        "{refused:?}"
    );
    assert_eq!((state.policy.last_version, state.policy.history.len()), (0, 0));
    assert_eq!(CanaryScope::parse("queue=short").unwrap(), CanaryScope::Queue("short".into()));
    assert_eq!(CanaryScope::parse("team=x").unwrap_err().field, "canary");
}

/// Two queues with a high-priority day-long job and a low-priority
/// ten-minute job each: under the defaults the short job goes first
/// (shortness outweighs priority); under a canary document that weighs
/// priority only, the canary queue's high-priority job goes first while
/// the other queue keeps the defaults' order. With the leader's `plan`
/// running the built-in defaults (as before policy documents) it failed:
/// the one GPU went to job 2, not to the canary's job 3.
#[test]
fn the_canary_queue_is_ordered_under_its_document_and_the_rest_under_the_active_one() {
    let mut state = cluster();
    at(&mut state, T0, node(1));
    at(&mut state, T0, submit("training", Priority::High, 24 * 3600)); // 1
    at(&mut state, T0, submit("training", Priority::Low, 600)); // 2
    at(&mut state, T0, submit("service", Priority::High, 24 * 3600)); // 3
    at(&mut state, T0, submit("service", Priority::Low, 600)); // 4
    let order_of = |state: &ClusterState| -> Vec<u64> {
        let config = PolicyConfig::from_document(&state.policy.active_document());
        let staged = state.policy.canary_document().map(|(document, scope)| (PolicyConfig::from_document(&document), scope.clone()));
        let mut view = View::build(state, T0);
        let mut quota = QuotaBook::new(state, &mut view);
        let canary = staged.as_ref().map(|(config, scope)| (config, scope));
        order::pending(state, T0, &config, canary, &mut quota).iter().map(|c| c.job.id).collect()
    };
    let within = |order: &[u64], a: u64, b: u64| order.iter().position(|&id| id == a) < order.iter().position(|&id| id == b);
    let before = order_of(&state);
    assert!(within(&before, 2, 1) && within(&before, 4, 3), "defaults: short first in both queues: {before:?}");
    let canary = apply(by_priority(), "priority first", Some(CanaryScope::Queue("service".into())));
    assert_eq!(at(&mut state, T0, by("ada", canary)), CommandResult::Done);
    let after = order_of(&state);
    assert!(within(&after, 3, 4), "the canary queue orders by priority: {after:?}");
    assert!(within(&after, 2, 1), "the other queue keeps the active order: {after:?}");
    // The leader's pass reads the same from the state: the one GPU goes
    // to the canary's high-priority job, which outranks everything now.
    let plan = super::plan(&state, T0);
    assert_eq!(plan.placements.iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![3], "{plan:?}");
    // Promoted, both queues order by priority.
    assert_eq!(at(&mut state, T0, by("ada", Command::PromotePolicy)), CommandResult::Done);
    let promoted = order_of(&state);
    assert!(within(&promoted, 1, 2) && within(&promoted, 3, 4), "{promoted:?}");
}
