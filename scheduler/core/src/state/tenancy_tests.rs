//! Apply of templates, labels and budgets (format 7).

use std::collections::{BTreeMap, BTreeSet};

use super::auth::{Actor, Role};
use super::tenancy::{month_start_ms, TemplateRef, MAX_TEMPLATE_VERSIONS};
use super::*;

/// 2026-12-01T00:00:00Z.
const DEC_2026: u64 = 1_796_083_200_000;
const HOUR_MS: u64 = 3_600_000;

fn at(state: &mut ClusterState, now_ms: u64, commands: Vec<Command>) -> Vec<CommandResult> {
    let index = state.applied_index + 1;
    let results = state.apply_proposal(index, &Proposal { now_ms, commands });
    state.check_invariants().expect("invariants hold after every entry");
    results
}

fn one(state: &mut ClusterState, now_ms: u64, command: Command) -> CommandResult {
    at(state, now_ms, vec![command]).remove(0)
}

fn by(user: &str, command: Command) -> Command {
    Command::Audited { actor: Actor::user(user, "127.0.0.1:9"), command: Box::new(command) }
}

fn spec(group: &str, gpus: u32) -> JobSpec {
    JobSpec { group: group.into(), gpus_per_replica: gpus, runtime_limit_s: 3600, ..JobSpec::simple(&["train"]) }
}

fn tagged(group: &str, gpus: u32, labels: &[(&str, &str)], template: Option<(&str, u32)>) -> Command {
    Command::SubmitTagged {
        request_id: None,
        spec: spec(group, gpus),
        secret_env: BTreeSet::new(),
        secret_command: false,
        labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        template: template.map(|(name, version)| TemplateRef { name: name.into(), version }),
    }
}

/// A format 7 cluster at the start of November's last hour: users of
/// vision and nlp, a group-admin of vision, an operator, one 8-GPU node.
fn cluster() -> ClusterState {
    let mut state = ClusterState::default();
    let t = DEC_2026 - HOUR_MS;
    assert_eq!(one(&mut state, t, Command::SetClusterVersion { version: tenancy::TENANCY_FROM_VERSION }), CommandResult::Done);
    assert_eq!(one(&mut state, t, Command::BootstrapAdmin { name: "ada".into() }), CommandResult::Done);
    let users = [
        ("alice", Role::User, "vision"),
        ("bob", Role::User, "nlp"),
        ("gina", Role::GroupAdmin, "vision"),
        ("otto", Role::Operator, "ops"),
    ];
    for (name, role, group) in users {
        let set = Command::SetUser { name: name.into(), role, groups: BTreeSet::from([group.to_string()]), impersonate: false };
        assert_eq!(one(&mut state, t, by("ada", set)), CommandResult::Done);
    }
    let node = super::tests::node("n1", 8);
    assert_eq!(one(&mut state, t, Command::RegisterNode(node)), CommandResult::Done);
    state
}

fn job_id(result: CommandResult) -> JobId {
    match result {
        CommandResult::Submitted { job_id, deduplicated: false } => job_id,
        other => panic!("expected a new job, got {other:?}"),
    }
}

fn place(state: &mut ClusterState, now_ms: u64, job_id: JobId, gpus: &[u32]) -> CommandResult {
    let placement = Placement { job_id, ranks: vec![RankPlacement { node: "n1".into(), gpus: gpus.to_vec() }] };
    one(state, now_ms, Command::ApplyPlan(Plan { placements: vec![placement], ..Plan::default() }))
}

fn exit(state: &mut ClusterState, now_ms: u64, job_id: JobId) {
    let alloc_id = state.jobs[&job_id].alloc.expect("running");
    assert_eq!(one(state, now_ms, Command::AllocExited { alloc_id, rank: 0, exit_code: 0 }), CommandResult::Done);
}

fn budget(group: &str, month: u32, gpu_ms: u64, strict: bool) -> Command {
    Command::SetBudget { group: group.into(), month, gpu_ms: Some(gpu_ms), strict }
}

#[test]
fn use_is_metered_from_committed_times_and_split_at_month_boundaries() {
    let mut state = cluster();
    let job = job_id(one(&mut state, DEC_2026 - HOUR_MS, by("alice", tagged("vision", 2, &[], None))));
    assert_eq!(place(&mut state, DEC_2026 - 30 * 60_000, job, &[0, 1]), CommandResult::PlanApplied { placed: 1, rejected: 0, stopped: 0 });
    // Read mid-run: counted up to the read's time, not yet accrued.
    assert_eq!(state.tenancy.used_gpu_ms("vision", 202_611, DEC_2026 + HOUR_MS), 2 * 30 * 60_000);
    exit(&mut state, DEC_2026 + 15 * 60_000, job);
    let meter = &state.tenancy.meters["vision"];
    assert_eq!(meter.used_gpu_ms[&202_611], 2 * 30 * 60_000, "November: 30 minutes on 2 GPUs");
    assert_eq!(meter.used_gpu_ms[&202_612], 2 * 15 * 60_000, "December: 15 minutes on 2 GPUs");
    assert_eq!(meter.running_gpus, 0);
    // Exactly the allocation's committed start and end, whatever happened between.
    let job = &state.jobs[&job];
    let held = job.finished_at_ms.unwrap() - job.started_at_ms.unwrap();
    assert_eq!(meter.used_gpu_ms.values().sum::<u64>(), 2 * held);
    assert_eq!(month_start_ms(202_612), DEC_2026);
}

/// Prevents a stale plan from starting a job of a group whose budget is
/// spent: with apply's budget re-check of placements removed, the waiting
/// job's placement was answered `placed: 1`.
#[test]
fn a_spent_budget_refuses_submits_keeps_running_jobs_and_rises_to_release() {
    let mut state = cluster();
    let t = DEC_2026 + 1_000;
    assert!(matches!(
        one(&mut state, t, by("alice", budget("vision", 202_612, HOUR_MS, false))),
        CommandResult::Rejected(Rejection::PermissionDenied { .. })
    ));
    assert_eq!(one(&mut state, t, by("otto", budget("vision", 202_612, HOUR_MS, false))), CommandResult::Done);
    let running = job_id(one(&mut state, t, by("alice", tagged("vision", 2, &[], None))));
    let waiting = job_id(one(&mut state, t, by("alice", tagged("vision", 4, &[], None))));
    assert_eq!(place(&mut state, t, running, &[0, 1]), CommandResult::PlanApplied { placed: 1, rejected: 0, stopped: 0 });
    // 2 GPUs for 30 minutes spend the hour.
    let spent = t + 30 * 60_000;
    let refused = one(&mut state, spent, by("alice", tagged("vision", 1, &[], None)));
    let CommandResult::Rejected(Rejection::BudgetExhausted { message }) = refused else {
        panic!("expected a spent budget, got {refused:?}")
    };
    assert!(message.contains("group vision used 1.000 of its 1.000 GPU-hours for 2026-12"), "{message}");
    assert_eq!(one(&mut state, spent, by("bob", tagged("nlp", 1, &[], None))), CommandResult::Submitted { job_id: 3, deduplicated: false });
    assert_eq!(state.jobs[&running].state, JobState::Running, "running jobs are not stopped");
    // A placement of the waiting job is refused (the planner's side is in `policy`).
    assert_eq!(place(&mut state, spent, waiting, &[4, 5, 6, 7]), CommandResult::PlanApplied { placed: 0, rejected: 1, stopped: 0 });
    // Raising the budget lets it start.
    assert_eq!(one(&mut state, spent, by("otto", budget("vision", 202_612, 3 * HOUR_MS, false))), CommandResult::Done);
    assert_eq!(place(&mut state, spent, waiting, &[4, 5, 6, 7]), CommandResult::PlanApplied { placed: 1, rejected: 0, stopped: 0 });
}

#[test]
fn a_strict_budget_refuses_a_job_whose_worst_case_would_pass_it() {
    let mut state = cluster();
    let t = DEC_2026 + 1_000;
    assert_eq!(one(&mut state, t, by("otto", budget("vision", 202_612, 10 * HOUR_MS, true))), CommandResult::Done);
    // 8 GPUs x 1 h limit = 8 GPU-hours fit in 10; 12 GPUs do not.
    assert!(matches!(one(&mut state, t, by("alice", tagged("vision", 8, &[], None))), CommandResult::Submitted { .. }));
    let refused =
        one(&mut state, t, by("alice", Command::SubmitJob { request_id: None, spec: JobSpec { replicas: 2, ..spec("vision", 6) } }));
    let CommandResult::Rejected(Rejection::BudgetExhausted { message }) = refused else {
        panic!("expected a strict refusal, got {refused:?}")
    };
    assert!(message.contains("worst case (12 GPUs"), "{message}");
    // Not strict: only a spent budget refuses.
    assert_eq!(one(&mut state, t, by("otto", budget("vision", 202_612, 10 * HOUR_MS, false))), CommandResult::Done);
    let spec = JobSpec { replicas: 2, ..spec("vision", 6) };
    assert!(matches!(one(&mut state, t, by("alice", Command::SubmitJob { request_id: None, spec })), CommandResult::Submitted { .. }));
}

fn save(name: &str, group: &str, command: &str) -> Command {
    let spec = JobSpec { command: vec![command.into()], ..spec(group, 2) };
    Command::SaveTemplate { name: name.into(), group: group.into(), spec, labels: BTreeMap::new() }
}

/// A client retrying a save that committed (its answer lost) once made a
/// second, identical version. From format 8 on the same content keeps the
/// latest version; a format 7 cluster still applies such an entry as its
/// older replicas do.
#[test]
fn saving_what_the_latest_version_holds_makes_no_new_version_from_format_8() {
    let mut state = cluster();
    let t = DEC_2026;
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v1"))), CommandResult::TemplateSaved { version: 1 });
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v1"))), CommandResult::TemplateSaved { version: 2 }, "format 7");
    assert_eq!(one(&mut state, t, Command::SetClusterVersion { version: 8 }), CommandResult::Done);
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v1"))), CommandResult::TemplateSaved { version: 2 });
    assert_eq!(state.tenancy.templates["asr"].versions.len(), 2);
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v2"))), CommandResult::TemplateSaved { version: 3 });
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v1"))), CommandResult::TemplateSaved { version: 4 }, "not the latest");
}

#[test]
fn templates_are_versioned_bounded_and_owned_by_their_group() {
    let mut state = cluster();
    let t = DEC_2026;
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v1"))), CommandResult::TemplateSaved { version: 1 });
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v2"))), CommandResult::TemplateSaved { version: 2 });
    assert!(matches!(one(&mut state, t, by("bob", save("asr", "nlp", "x"))), CommandResult::Rejected(Rejection::PermissionDenied { .. })));
    assert!(matches!(
        one(&mut state, t, by("bob", save("asr", "vision", "x"))),
        CommandResult::Rejected(Rejection::PermissionDenied { .. })
    ));
    assert!(matches!(
        one(&mut state, t, by("bob", Command::DeleteTemplate { name: "asr".into() })),
        CommandResult::Rejected(Rejection::PermissionDenied { .. })
    ));
    for n in 3..=(MAX_TEMPLATE_VERSIONS as u32 + 2) {
        assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", &format!("v{n}")))), CommandResult::TemplateSaved { version: n });
    }
    let template = &state.tenancy.templates["asr"];
    assert_eq!(template.versions.len(), MAX_TEMPLATE_VERSIONS);
    assert_eq!(template.versions.keys().next(), Some(&3), "the oldest versions are dropped");
    let bad = Command::SaveTemplate { name: "bad name".into(), group: "vision".into(), spec: spec("vision", 1), labels: BTreeMap::new() };
    assert!(matches!(one(&mut state, t, by("alice", bad)), CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "name"));
    let wrong_group = Command::SaveTemplate { name: "x".into(), group: "vision".into(), spec: spec("nlp", 1), labels: BTreeMap::new() };
    assert!(
        matches!(one(&mut state, t, by("alice", wrong_group)), CommandResult::Rejected(Rejection::Invalid { field, .. }) if field == "spec.group")
    );
    assert_eq!(one(&mut state, t, by("alice", Command::DeleteTemplate { name: "asr".into() })), CommandResult::Done);
    assert!(state.tenancy.templates.is_empty());
}

/// Prevents a group from running jobs from another group's template
/// without that group's grant: with apply's grant check removed, bob's
/// nlp job from vision's template was answered `Submitted`.
#[test]
fn another_groups_template_needs_its_grant_and_jobs_record_their_template_and_labels() {
    let mut state = cluster();
    let t = DEC_2026;
    assert_eq!(one(&mut state, t, by("alice", save("asr", "vision", "v1"))), CommandResult::TemplateSaved { version: 1 });
    let own = job_id(one(&mut state, t, by("alice", tagged("vision", 2, &[("team", "asr")], Some(("asr", 1))))));
    let tags = &state.tenancy.job_tags[&own];
    assert_eq!(tags.template, Some(TemplateRef { name: "asr".into(), version: 1 }));
    assert_eq!(tags.labels["team"], "asr");
    let refused = one(&mut state, t, by("bob", tagged("nlp", 2, &[], Some(("asr", 1)))));
    let CommandResult::Rejected(Rejection::PermissionDenied { message }) = refused else { panic!("expected a refusal, got {refused:?}") };
    assert!(message.contains("template asr of group \"vision\"") && message.contains("\"nlp\""), "{message}");
    let grant = Command::GrantTemplate { name: "asr".into(), group: "nlp".into(), granted: true };
    assert!(
        matches!(one(&mut state, t, by("alice", grant.clone())), CommandResult::Rejected(Rejection::PermissionDenied { .. })),
        "users do not grant"
    );
    assert_eq!(one(&mut state, t, by("gina", grant)), CommandResult::Done);
    assert!(matches!(one(&mut state, t, by("bob", tagged("nlp", 2, &[], Some(("asr", 1))))), CommandResult::Submitted { .. }));
    let missing = one(&mut state, t, by("bob", tagged("nlp", 2, &[], Some(("asr", 9)))));
    assert!(matches!(missing, CommandResult::Rejected(Rejection::NotFound { .. })), "{missing:?}");
    let revoke = Command::GrantTemplate { name: "asr".into(), group: "nlp".into(), granted: false };
    assert_eq!(one(&mut state, t, by("otto", revoke)), CommandResult::Done);
    assert!(matches!(
        one(&mut state, t, by("bob", tagged("nlp", 2, &[], Some(("asr", 1))))),
        CommandResult::Rejected(Rejection::PermissionDenied { .. })
    ));
    let bad_label = one(&mut state, t, by("alice", tagged("vision", 1, &[("Team", "x")], None)));
    assert!(
        matches!(bad_label, CommandResult::Rejected(Rejection::Invalid { ref field, .. }) if field == "labels[\"Team\"]"),
        "{bad_label:?}"
    );
}

#[test]
fn tags_are_dropped_with_their_jobs_and_survive_a_snapshot() {
    let mut state = ClusterState::new(StateLimits { max_finished_jobs: 1, ..StateLimits::default() });
    one(&mut state, DEC_2026, Command::SetClusterVersion { version: tenancy::TENANCY_FROM_VERSION });
    one(&mut state, DEC_2026, Command::SetBudget { group: "x".into(), month: 202_612, gpu_ms: None, strict: false });
    let first = job_id(one(&mut state, DEC_2026, by_unchecked(tagged("default", 1, &[("a", "1")], None))));
    let restored = ClusterState::from_snapshot(&state.to_snapshot()).expect("a snapshot decodes");
    assert_eq!(restored, state);
    for _ in 0..2 {
        let id = job_id(one(&mut state, DEC_2026, by_unchecked(tagged("default", 1, &[("a", "1")], None))));
        one(&mut state, DEC_2026, Command::CancelJob { job_id: id });
    }
    one(&mut state, DEC_2026, Command::CancelJob { job_id: first });
    assert_eq!(state.tenancy.job_tags.len(), 1);
}

fn by_unchecked(command: Command) -> Command {
    Command::Audited { actor: Actor::unchecked("127.0.0.1:9"), command: Box::new(command) }
}

#[test]
fn a_cluster_reaching_format_7_meters_its_running_allocations_from_then() {
    // A format 6 cluster with the same users and node, and a running job.
    let mut fresh = cluster();
    fresh.cluster_version = 6;
    fresh.tenancy = Default::default();
    let job = job_id(one(&mut fresh, DEC_2026, Command::SubmitJob { request_id: None, spec: spec("vision", 2) }));
    place(&mut fresh, DEC_2026, job, &[0, 1]);
    assert!(fresh.tenancy.meters.is_empty(), "no metering before format 7");
    one(&mut fresh, DEC_2026 + 1_000, Command::SetClusterVersion { version: 7 });
    exit(&mut fresh, DEC_2026 + 5_000, job);
    assert_eq!(fresh.tenancy.meters["vision"].used_gpu_ms[&202_612], 2 * 4_000);
}
