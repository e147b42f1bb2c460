//! Every build reads what earlier builds wrote. The fixtures are a log entry
//! holding one command of every kind and the snapshot of a small cluster,
//! each as written by the build that introduced its format version; they
//! are committed and never rewritten. A build whose types changed layout
//! without a new format version (and a decoder for the old one) fails here.
//!
//! `ROTA_WRITE_FIXTURES=1` writes the fixtures of the current version once,
//! when its files do not exist yet.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use rota_core::state::approvals::ChangeKind;
use rota_core::state::auth::{Actor, Role};
use rota_core::state::codec::{self, FIRST_FORMAT_VERSION, FORMAT_VERSION};
use rota_core::state::idle::{IdleAction, IdlePolicy};
use rota_core::state::lost_after::LostAfter;
use rota_core::state::policy_doc::{CanaryScope, PolicyDocument};
use rota_core::state::tenancy::TemplateRef;
use rota_core::state::{
    AlarmKind, ClusterState, Command, GpuInfo, GroupQuota, JobReason, JobSpec, LimitsChange, NodeRegistration, PendingNote, Placement,
    Plan, Priority, Proposal, QueueConfig, RankPlacement, ReasonCode, Stop, StopReason,
};

/// The newest format that added commands: a log entry of every command is
/// written in it (formats after it added only snapshot sections).
const NEWEST_ENTRY_FORMAT: u16 = 13;
/// Formats that added no command, so no entry fixture of their own.
const SNAPSHOT_ONLY_FORMATS: [u16; 1] = [12];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn registration() -> NodeRegistration {
    let gpus = (0..2)
        .map(|index| GpuInfo {
            index,
            uuid: format!("GPU-n1-{index}"),
            model: "H100-80GB".into(),
            memory_mib: 81_920,
            healthy: true,
            nvlink_domain: Some(0),
        })
        .collect();
    NodeRegistration { name: "n1".into(), address: "127.0.0.1:9000".into(), rack: "r1".into(), leaf: "l1".into(), gpus }
}

fn spec() -> JobSpec {
    let mut spec = JobSpec::simple(&["python", "train.py"]);
    spec.name = "fixture".into();
    spec.group = "vision".into();
    spec.priority = Priority::High;
    spec.env = [("SEED".to_string(), "7".to_string())].into();
    spec.runtime_limit_s = 3_600;
    spec.priority_ttl_s = 600;
    spec
}

/// One command of every kind format `version` has, in the order of the
/// `Command` enum.
fn every_command(version: u16) -> Proposal {
    let mut proposal = every_command_of_the_first_format();
    if version >= 2 {
        proposal.commands.push(Command::SetClusterVersion { version: 2 });
    }
    if version >= 3 {
        proposal.commands.push(Command::SetAlarm { replica: 2, kind: AlarmKind::NoSpace, raised: true });
    }
    if version >= 4 {
        proposal.commands.push(Command::NodesHeard { nodes: vec!["n1".into(), "gone".into()] });
    }
    if version >= 5 {
        proposal.commands.extend(commands_of_format_5());
    }
    if version >= 6 {
        proposal.commands.extend(commands_of_format_6());
    }
    if version >= 7 {
        proposal.commands.extend(commands_of_format_7());
    }
    if version >= 8 {
        proposal.commands.extend(commands_of_format_8());
    }
    if version >= 9 {
        proposal.commands.extend(commands_of_format_9());
    }
    if version >= 10 {
        proposal.commands.extend(commands_of_format_10());
    }
    if version >= 11 {
        proposal.commands.extend(commands_of_format_11());
    }
    if version >= 13 {
        let change = LimitsChange { max_live_jobs: Some(300_000), max_finished_jobs: None, max_spec_bytes: Some(2 << 30) };
        proposal.commands.push(Command::Audited { actor: admin(), command: Box::new(Command::SetLimits(change)) });
    }
    proposal
}

fn commands_of_format_11() -> Vec<Command> {
    let submit = Command::SubmitJob { request_id: Some("fixture-11".into()), spec: spec() };
    let kept = Command::WithLostAfter { lost_after: LostAfter::After { ms: 1_800_000 }, command: Box::new(submit) };
    vec![
        Command::Audited { actor: admin(), command: Box::new(kept) },
        Command::AllocLostFor { alloc_id: 1, rank: 0, reason: StopReason::AgentDiskFull },
        Command::ApplyPlan(Plan {
            pending: vec![PendingNote {
                job_id: 2,
                reason: JobReason::new(ReasonCode::AgentDiskFull, "requeued: its node's agent could not write the rank's files"),
                estimated_start_ms: None,
            }],
            ..Plan::default()
        }),
    ]
}

fn commands_of_format_10() -> Vec<Command> {
    let audited = |command: Command| Box::new(Command::Audited { actor: admin(), command: Box::new(command) });
    vec![
        Command::Once { request_id: "cli-q".into(), command: audited(Command::SetQueue(QueueConfig::defaults()[1].clone())) },
        Command::Once { request_id: "cli-c".into(), command: audited(Command::CancelJob { job_id: 9 }) },
        Command::Once { request_id: "cli-p".into(), command: audited(Command::SetJobPriority { job_id: 9, priority: Priority::Low }) },
        Command::ApplyPlan(Plan {
            stops: vec![Stop { alloc_id: 1, reason: StopReason::NeverStarted }],
            pending: vec![PendingNote {
                job_id: 2,
                reason: JobReason::new(ReasonCode::NeverStarted, "requeued: a rank was assigned and not started in time"),
                estimated_start_ms: None,
            }],
            ..Plan::default()
        }),
    ]
}

fn commands_of_format_9() -> Vec<Command> {
    let audited = |command: Command| Command::Audited { actor: admin(), command: Box::new(command) };
    let document = PolicyDocument { queue_points: 20, favour_short: true, ..PolicyDocument::default() };
    vec![
        audited(Command::ApplyPolicy { document: document.clone(), comment: "weigh queues more".into(), canary: None }),
        audited(Command::ApplyPolicy { document, comment: "try it".into(), canary: Some(CanaryScope::Group("vision".into())) }),
        audited(Command::PromotePolicy),
        audited(Command::RollbackPolicy { to: Some(1) }),
        audited(Command::RollbackPolicy { to: None }),
    ]
}

fn commands_of_format_8() -> Vec<Command> {
    let audited = |command: Command| Command::Audited { actor: admin(), command: Box::new(command) };
    let idle = IdlePolicy { idle_after_ms: 7_200_000, action: IdleAction::Reclaim };
    let queue = QueueConfig::defaults()[1].clone();
    vec![
        audited(Command::RequireApproval { kind: ChangeKind::Quota, required: true, expire_after_ms: 3_600_000 }),
        audited(Command::ApproveChange { id: 1 }),
        audited(Command::WithdrawChange { id: 2 }),
        Command::AllocIdle { alloc_id: 1, rank: 0, idle_for_ms: Some(1_800_000) },
        Command::AllocIdle { alloc_id: 1, rank: 0, idle_for_ms: None },
        Command::IdleFlagged { alloc_ids: vec![1, 2] },
        Command::Audited { actor: admin(), command: Box::new(Command::SetQueueIdle { queue, idle }) },
        Command::ApplyPlan(Plan { stops: vec![Stop { alloc_id: 1, reason: StopReason::IdleReclaimed }], ..Plan::default() }),
    ]
}

fn commands_of_format_7() -> Vec<Command> {
    let audited = |command: Command| Command::Audited { actor: admin(), command: Box::new(command) };
    let labels = BTreeMap::from([("team".to_string(), "asr".to_string())]);
    let spent_note = PendingNote { job_id: 2, reason: JobReason::new(ReasonCode::BudgetExhausted, "spent"), estimated_start_ms: None };
    vec![
        audited(Command::SubmitTagged {
            request_id: Some("req-7".into()),
            spec: spec(),
            secret_env: BTreeSet::new(),
            secret_command: false,
            labels: labels.clone(),
            template: Some(TemplateRef { name: "asr".into(), version: 3 }),
        }),
        audited(Command::SaveTemplate { name: "asr".into(), group: "vision".into(), spec: spec(), labels }),
        audited(Command::DeleteTemplate { name: "asr".into() }),
        audited(Command::GrantTemplate { name: "asr".into(), group: "nlp".into(), granted: true }),
        audited(Command::SetBudget { group: "vision".into(), month: 202_612, gpu_ms: Some(3_600_000), strict: true }),
        Command::ApplyPlan(Plan { pending: vec![spent_note], ..Plan::default() }),
        Command::Traced { request_id: "trace-7".into(), command: Box::new(audited(Command::CancelJob { job_id: 1 })) },
    ]
}

fn commands_of_format_6() -> Vec<Command> {
    let audited = |command: Command| Command::Audited { actor: admin(), command: Box::new(command) };
    let fenced_note = PendingNote { job_id: 2, reason: JobReason::new(ReasonCode::Fenced, "fenced"), estimated_start_ms: None };
    vec![
        Command::GpuXid { node: "n1".into(), gpu: 1, xid: 79, at_ms: 1_700_000_006_000 },
        Command::GpuReset { node: "n1".into(), gpu: 1 },
        audited(Command::ReadmitNode { node: "n1".into(), gpu: Some(1) }),
        audited(Command::FenceNode { node: "n1".into(), gpu: None, reason: "fan".into() }),
        Command::ApplyPlan(Plan { pending: vec![fenced_note], ..Plan::default() }),
    ]
}

fn admin() -> Actor {
    Actor::user("ada", "127.0.0.1:5000")
}

fn commands_of_format_5() -> Vec<Command> {
    let audited = |command: Command| Command::Audited { actor: admin(), command: Box::new(command) };
    let groups = BTreeSet::from(["vision".to_string()]);
    let impersonated = Actor { user: Some("alice".into()), impersonator: Some("portal".into()), from: "127.0.0.1:5001".into() };
    vec![
        Command::BootstrapAdmin { name: "ada".into() },
        audited(Command::SetUser { name: "alice".into(), role: Role::User, groups, impersonate: false }),
        audited(Command::SetUser { name: "portal".into(), role: Role::User, groups: BTreeSet::new(), impersonate: true }),
        audited(Command::CreateToken { id: "t1".into(), user: "alice".into(), hash: vec![7; 32], expires_ms: 1_800_000_000_000 }),
        Command::Audited {
            actor: impersonated,
            command: Box::new(Command::SubmitMarked {
                request_id: Some("req-5".into()),
                spec: spec(),
                secret_env: BTreeSet::from(["SEED".to_string()]),
                secret_command: true,
            }),
        },
        audited(Command::RevokeToken { id: "t1".into() }),
        audited(Command::RemoveUser { name: "alice".into() }),
        audited(Command::Note { what: "add member 4".into(), outcome: "ok".into() }),
    ]
}

fn every_command_of_the_first_format() -> Proposal {
    let plan = Plan {
        computed_at_index: 4,
        placements: vec![Placement { job_id: 1, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![0] }] }],
        stops: vec![Stop { alloc_id: 1, reason: StopReason::Preempted }],
        pending: vec![PendingNote { job_id: 2, reason: Default::default(), estimated_start_ms: Some(5) }],
    };
    let quota =
        GroupQuota { group: "vision".into(), gpus: 2, per_model: BTreeMap::new(), lend: true, lend_to: vec![], borrow_limit: Some(1) };
    Proposal {
        now_ms: 1_700_000_000_000,
        commands: vec![
            Command::SubmitJob { request_id: Some("req-1".into()), spec: spec() },
            Command::CancelJob { job_id: 9 },
            Command::RegisterNode(registration()),
            Command::NodeHealth { node: "n1".into(), unhealthy_gpus: vec![1] },
            Command::DrainNode { node: "n1".into(), drain: true },
            Command::NodeDown { node: "n2".into() },
            Command::ApplyPlan(plan),
            Command::AllocStarted { alloc_id: 1, rank: 0 },
            Command::AllocExited { alloc_id: 1, rank: 0, exit_code: 137 },
            Command::Checkpoint { alloc_id: 1, at_ms: 1_700_000_100_000 },
            Command::SetQueue(QueueConfig::defaults()[0].clone()),
            Command::SetQuota(quota),
            Command::AllocLost { alloc_id: 1, rank: 0 },
        ],
    }
}

/// A small cluster: a node, a quota, a running and a pending job; from
/// format 2 on, its cluster version raised to `version`.
fn small_cluster(version: u16) -> ClusterState {
    let mut state = ClusterState::default();
    let quota = GroupQuota { group: "vision".into(), gpus: 2, per_model: BTreeMap::new(), lend: true, lend_to: vec![], borrow_limit: None };
    let setup = vec![
        Command::RegisterNode(registration()),
        Command::SetQuota(quota),
        Command::SubmitJob { request_id: Some("a".into()), spec: spec() },
        Command::SubmitJob { request_id: Some("b".into()), spec: JobSpec { gpus_per_replica: 2, ..spec() } },
    ];
    state.apply_proposal(1, &Proposal { now_ms: 1_700_000_000_000, commands: setup });
    let plan = Plan {
        placements: vec![Placement { job_id: 1, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![0] }] }],
        ..Plan::default()
    };
    state.apply_proposal(2, &Proposal { now_ms: 1_700_000_001_000, commands: vec![Command::ApplyPlan(plan)] });
    if version >= 2 {
        // Raised to 6 first where the fixture is newer: the faults above are written at 6.
        let raise = version.min(6);
        state.apply_proposal(3, &Proposal { now_ms: 1_700_000_002_000, commands: vec![Command::SetClusterVersion { version: raise }] });
    }
    if version >= 3 {
        let alarm = Command::SetAlarm { replica: 2, kind: AlarmKind::NoSpace, raised: true };
        state.apply_proposal(4, &Proposal { now_ms: 1_700_000_003_000, commands: vec![alarm] });
    }
    if version >= 4 {
        let heard = Command::NodesHeard { nodes: vec!["n1".into()] };
        state.apply_proposal(5, &Proposal { now_ms: 1_700_000_004_000, commands: vec![heard] });
    }
    if version >= 5 {
        let mut commands = vec![Command::SetAlarm { replica: 2, kind: AlarmKind::NoSpace, raised: false }];
        commands.extend(commands_of_format_5().into_iter().take(5));
        let results = state.apply_proposal(6, &Proposal { now_ms: 1_700_000_005_000, commands });
        assert!(!results.iter().any(|r| matches!(r, rota_core::state::CommandResult::Rejected(_))), "{results:?}");
        assert_eq!((state.auth.users.len(), state.auth.tokens.len(), state.auth.job_marks.len()), (3, 1, 1));
    }
    if version >= 6 {
        // A reset fence on GPU 1, the running job's attempt ended by an
        // application XID on GPU 0 (it waits for its rank's exit), a drain.
        let commands = vec![
            Command::GpuXid { node: "n1".into(), gpu: 1, xid: 48, at_ms: 1_700_000_006_000 },
            Command::GpuXid { node: "n1".into(), gpu: 0, xid: 94, at_ms: 1_700_000_006_500 },
            Command::DrainNode { node: "n1".into(), drain: true },
        ];
        let results = state.apply_proposal(7, &Proposal { now_ms: 1_700_000_007_000, commands });
        assert!(results.iter().all(|r| *r == rota_core::state::CommandResult::Done), "{results:?}");
        assert_eq!((state.faults.fences.len(), state.faults.attempt_faults.len(), state.faults.drained.len()), (1, 1, 1));
    }
    if version >= 7 {
        state.apply_proposal(8, &Proposal { now_ms: 1_700_000_008_000, commands: vec![Command::SetClusterVersion { version: 7 }] });
        // A template granted to nlp, a labelled job made from it, a budget;
        // the running job is metered from the raise.
        let labels = BTreeMap::from([("team".to_string(), "asr".to_string())]);
        let commands = vec![
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::SaveTemplate {
                    name: "asr".into(),
                    group: "vision".into(),
                    spec: spec(),
                    labels: labels.clone(),
                }),
            },
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::GrantTemplate { name: "asr".into(), group: "nlp".into(), granted: true }),
            },
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::SetBudget { group: "vision".into(), month: 202_311, gpu_ms: Some(3_600_000), strict: false }),
            },
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::SubmitTagged {
                    request_id: Some("c".into()),
                    spec: spec(),
                    secret_env: BTreeSet::new(),
                    secret_command: false,
                    labels,
                    template: Some(TemplateRef { name: "asr".into(), version: 1 }),
                }),
            },
        ];
        let results = state.apply_proposal(9, &Proposal { now_ms: 1_700_000_009_000, commands });
        assert!(!results.iter().any(|r| matches!(r, rota_core::state::CommandResult::Rejected(_))), "{results:?}");
        let tenancy = &state.tenancy;
        assert_eq!((tenancy.templates.len(), tenancy.job_tags.len(), tenancy.budgets.len(), tenancy.meters.len()), (1, 1, 1, 1));
    }
    if version >= 8 {
        state.apply_proposal(10, &Proposal { now_ms: 1_700_000_010_000, commands: vec![Command::SetClusterVersion { version: 8 }] });
        // The stopping attempt of job 1 was idle before its rank exited
        // (its idle time stays with the job); job 3 runs on GPU 0, idle and
        // flagged under a reclaiming training queue.
        let queue = QueueConfig::defaults()[1].clone();
        let placement = Placement { job_id: 3, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![0] }] };
        let commands = vec![
            Command::AllocIdle { alloc_id: 1, rank: 0, idle_for_ms: Some(4_000) },
            Command::AllocExited { alloc_id: 1, rank: 0, exit_code: 1 },
            Command::DrainNode { node: "n1".into(), drain: false },
            Command::ApplyPlan(Plan { placements: vec![placement], ..Plan::default() }),
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::SetQueueIdle { queue, idle: IdlePolicy { idle_after_ms: 1_000, action: IdleAction::Reclaim } }),
            },
        ];
        let results = state.apply_proposal(11, &Proposal { now_ms: 1_700_000_011_000, commands });
        assert!(!results.iter().any(|r| matches!(r, rota_core::state::CommandResult::Rejected(_))), "{results:?}");
        let commands =
            vec![Command::AllocIdle { alloc_id: 2, rank: 0, idle_for_ms: Some(5_000) }, Command::IdleFlagged { alloc_ids: vec![2] }];
        state.apply_proposal(12, &Proposal { now_ms: 1_700_000_012_000, commands });
        let idle = &state.idle;
        assert_eq!((idle.allocs.len(), idle.job_idle_gpu_ms.len(), idle.queue_policies.len()), (1, 1, 1));
        assert!(idle.allocs[&2].flagged_ms.is_some());
        // Quota changes need approval; one waits.
        let quota =
            GroupQuota { group: "nlp".into(), gpus: 1, per_model: BTreeMap::new(), lend: false, lend_to: vec![], borrow_limit: None };
        let commands = vec![
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::RequireApproval { kind: ChangeKind::Quota, required: true, expire_after_ms: 3_600_000 }),
            },
            Command::Audited { actor: admin(), command: Box::new(Command::SetQuota(quota)) },
        ];
        let results = state.apply_proposal(13, &Proposal { now_ms: 1_700_000_013_000, commands });
        assert!(!results.iter().any(|r| matches!(r, rota_core::state::CommandResult::Rejected(_))), "{results:?}");
        assert_eq!((state.approvals.rules.len(), state.approvals.pending.len()), (1, 1));
        // Job statistics: the faulted attempt of job 1 ended, leaving its span.
        assert_eq!(state.records.job_stats.get(&1).map(|s| s.spans.len()), Some(1));
    }
    if version >= 9 {
        state.apply_proposal(14, &Proposal { now_ms: 1_700_000_014_000, commands: vec![Command::SetClusterVersion { version: 9 }] });
        // Version 1 active, version 2 staged for the training queue; a job
        // placed on the reset GPU runs under the canary.
        let document = PolicyDocument { aging_cap: 30, ..PolicyDocument::default() };
        let commands = vec![
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::ApplyPolicy { document: document.clone(), comment: "less aging".into(), canary: None }),
            },
            Command::Audited {
                actor: admin(),
                command: Box::new(Command::ApplyPolicy {
                    document: PolicyDocument { aging_cap: 10, ..document },
                    comment: "even less".into(),
                    canary: Some(CanaryScope::Queue("training".into())),
                }),
            },
            Command::GpuReset { node: "n1".into(), gpu: 1 },
            Command::SubmitJob { request_id: Some("d".into()), spec: spec() },
        ];
        let results = state.apply_proposal(15, &Proposal { now_ms: 1_700_000_015_000, commands });
        assert!(!results.iter().any(|r| matches!(r, rota_core::state::CommandResult::Rejected(_))), "{results:?}");
        let rota_core::state::CommandResult::Submitted { job_id, .. } = results[3] else { panic!("{results:?}") };
        let placement = Placement { job_id, ranks: vec![RankPlacement { node: "n1".into(), gpus: vec![1] }] };
        let results = state.apply_proposal(
            16,
            &Proposal {
                now_ms: 1_700_000_016_000,
                commands: vec![Command::ApplyPlan(Plan { placements: vec![placement], ..Plan::default() })],
            },
        );
        assert_eq!(results[0], rota_core::state::CommandResult::PlanApplied { placed: 1, rejected: 0, stopped: 0 });
        assert_eq!((state.policy.active, state.policy.history.len(), state.policy.job_versions.get(&job_id)), (1, 2, Some(&2)));
    }
    if version >= 10 {
        state.apply_proposal(17, &Proposal { now_ms: 1_700_000_017_000, commands: vec![Command::SetClusterVersion { version: 10 }] });
        // A queue change sent twice under one request id: one outcome kept.
        let queue = QueueConfig { weight: 7, ..QueueConfig::defaults()[1].clone() };
        let change = Command::Once {
            request_id: "cli-1".into(),
            command: Box::new(Command::Audited { actor: admin(), command: Box::new(Command::SetQueue(queue)) }),
        };
        let results = state.apply_proposal(18, &Proposal { now_ms: 1_700_000_018_000, commands: vec![change.clone(), change] });
        assert_eq!(results, vec![rota_core::state::CommandResult::Done; 2]);
        assert_eq!(state.outcomes.len(), 1);
    }
    if version >= 11 {
        state.apply_proposal(19, &Proposal { now_ms: 1_700_000_019_000, commands: vec![Command::SetClusterVersion { version: 11 }] });
        // A single-node job that rides out its node's silence forever.
        let submit = Command::SubmitJob { request_id: Some("fixture-never".into()), spec: spec() };
        let kept = Command::WithLostAfter { lost_after: LostAfter::Never, command: Box::new(submit) };
        let audited = Command::Audited { actor: admin(), command: Box::new(kept) };
        let results = state.apply_proposal(20, &Proposal { now_ms: 1_700_000_020_000, commands: vec![audited] });
        assert!(matches!(results[0], rota_core::state::CommandResult::Submitted { deduplicated: false, .. }), "{results:?}");
        assert_eq!(state.lost_after.len(), 1);
    }
    if version >= 12 {
        state.apply_proposal(21, &Proposal { now_ms: 1_700_000_021_000, commands: vec![Command::SetClusterVersion { version: 12 }] });
        // The canary job of format 9 reports its rank started: it runs, and
        // its runtime limit counts, from now.
        let alloc_id = *state.allocs.keys().next_back().expect("the canary job's attempt");
        let started = Command::AllocStarted { alloc_id, rank: 0 };
        let results = state.apply_proposal(22, &Proposal { now_ms: 1_700_000_022_000, commands: vec![started] });
        assert_eq!(results, vec![rota_core::state::CommandResult::Done]);
        assert_eq!(state.running_since.get(&alloc_id), Some(&1_700_000_022_000));
    }
    if version >= 13 {
        // The bounds travel in the state itself (no new section): a lowered
        // finished bound drops the oldest finished job of the fixture.
        state.apply_proposal(23, &Proposal { now_ms: 1_700_000_023_000, commands: vec![Command::SetClusterVersion { version: 13 }] });
        let kept = state.finished.len() as u64 - 1;
        let change = LimitsChange { max_live_jobs: Some(1_000), max_finished_jobs: Some(kept), max_spec_bytes: None };
        let audited = Command::Audited { actor: admin(), command: Box::new(Command::SetLimits(change)) };
        let results = state.apply_proposal(24, &Proposal { now_ms: 1_700_000_024_000, commands: vec![audited] });
        assert_eq!(results, vec![rota_core::state::CommandResult::Done]);
        assert_eq!(state.limits.max_live_jobs, 1_000);
    }
    state.check_invariants().expect("a consistent fixture");
    state
}

fn write_once(name: &str, bytes: &[u8]) {
    let path = fixture(name);
    if std::env::var("ROTA_WRITE_FIXTURES").is_ok_and(|v| v == "1") && !path.exists() {
        std::fs::write(&path, bytes).expect("fixture written");
    }
}

#[test]
fn the_log_entry_fixture_of_every_version_decodes() {
    write_once(&format!("entry-v{NEWEST_ENTRY_FORMAT}.bin"), &codec::encode_proposal(&every_command(NEWEST_ENTRY_FORMAT)));
    for version in (FIRST_FORMAT_VERSION..=NEWEST_ENTRY_FORMAT).filter(|v| !SNAPSHOT_ONLY_FORMATS.contains(v)) {
        let bytes = std::fs::read(fixture(&format!("entry-v{version}.bin"))).expect("every version's entry fixture is committed");
        assert_eq!(codec::version_of("entry", &bytes).expect("a header").0, version);
        assert_eq!(codec::decode_proposal(&bytes).expect("entries decode"), every_command(version), "format {version}");
    }
}

#[test]
fn the_snapshot_fixture_of_every_version_decodes() {
    write_once(&format!("snapshot-v{FORMAT_VERSION}.bin"), &codec::encode_snapshot(&small_cluster(FORMAT_VERSION)));
    for version in FIRST_FORMAT_VERSION..=FORMAT_VERSION {
        let bytes = std::fs::read(fixture(&format!("snapshot-v{version}.bin"))).expect("every version's snapshot fixture is committed");
        let restored = codec::decode_snapshot(&bytes).expect("snapshots decode");
        restored.check_invariants().expect("a restored fixture is consistent");
        assert_eq!(restored, small_cluster(version), "format {version}");
    }
}

#[test]
fn this_build_writes_the_oldest_format_that_holds_the_data() {
    let first = codec::encode_proposal(&every_command(FIRST_FORMAT_VERSION));
    assert_eq!(codec::version_of("entry", &first).expect("a header").0, FIRST_FORMAT_VERSION);
    let newest = codec::encode_proposal(&every_command(FORMAT_VERSION));
    assert_eq!(codec::version_of("entry", &newest).expect("a header").0, NEWEST_ENTRY_FORMAT);
    for version in FIRST_FORMAT_VERSION..=FORMAT_VERSION {
        let snapshot = codec::encode_snapshot(&small_cluster(version));
        assert_eq!(codec::version_of("snapshot", &snapshot).expect("a header").0, version);
    }
}
