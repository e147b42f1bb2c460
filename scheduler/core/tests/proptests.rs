//! Property tests of everything in the core that reads input it did not
//! make: the entry and snapshot codec (every format version), the request
//! validators and apply. Random bytes, valid encodings with bytes
//! overwritten, and well-formed but hostile commands.
//!
//! Properties: nothing panics (or aborts on a huge allocation); every
//! refusal of a validator names the field at fault, and the one that was
//! made wrong; apply keeps the state's invariants (`check_invariants`)
//! after every entry.
//!
//! Case counts keep the whole file well under a minute in release;
//! `PROPTEST_CASES=N` runs more.

use std::collections::BTreeMap;

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use rota_core::state::codec::{
    decode_proposal, decode_proposal_up_to, decode_snapshot, decode_snapshot_up_to, encode_proposal, encode_snapshot, FORMAT_VERSION,
};
use rota_core::state::validate::{validate_queue, validate_quota, validate_request_id, validate_spec};
use rota_core::state::{
    AlarmKind, ClusterState, Command, CommandResult, GpuInfo, GroupQuota, JobSpec, NodeRegistration, PendingNote, Placement, Plan,
    Priority, Proposal, QueueConfig, RankPlacement, Rejection, StateLimits, Stop, StopReason,
};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// Strings a hostile client would send: empty, huge, NULs, reserved names,
/// names of things that exist and things that do not.
fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("n0".to_string()),
        Just("n1".to_string()),
        Just("training".to_string()),
        Just("short".to_string()),
        Just("a".to_string()),
        Just("ROTA_JOB_ID".to_string()),
        Just("RANK".to_string()),
        Just("nul\0inside".to_string()),
        Just("x".repeat(5_000)),
        Just("bad group".to_string()),
        "[a-z]{1,8}",
        any::<String>(),
    ]
}

fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(u64::MAX / 2), 0u64..10, any::<u64>()]
}

fn hostile_u32() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), Just(1), Just(u32::MAX), 0u32..10, any::<u32>()]
}

fn priority() -> impl Strategy<Value = Priority> {
    prop_oneof![Just(Priority::Low), Just(Priority::Medium), Just(Priority::High)]
}

/// A spec that passes validation (against the default queues).
fn valid_spec() -> JobSpec {
    let mut spec = JobSpec::simple(&["train", "--epochs", "3"]);
    spec.group = "vision".into();
    spec.env.insert("SEED".into(), "1".into());
    spec
}

/// One field of a valid spec made hostile, and the field's name.
fn spec_with_one_hostile_field() -> impl Strategy<Value = (JobSpec, &'static str)> {
    let base = valid_spec();
    (
        0usize..13,
        hostile_string(),
        hostile_u64(),
        hostile_u32(),
        priority(),
        vec(hostile_string(), 0..300),
        btree_map(hostile_string(), hostile_string(), 0..200),
    )
        .prop_map(move |(which, text, number, small, priority, strings, env)| {
            let mut spec = base.clone();
            let field = match which {
                0 => {
                    spec.name = text;
                    "name"
                }
                1 => {
                    spec.group = text;
                    "group"
                }
                2 => {
                    spec.queue = text;
                    "queue"
                }
                3 => {
                    spec.priority = priority;
                    "priority"
                }
                4 => {
                    spec.replicas = small;
                    "replicas"
                }
                5 => {
                    spec.gpus_per_replica = small;
                    "gpus_per_replica"
                }
                6 => {
                    spec.gpu_model = Some(text.into_boxed_str());
                    "gpu_model"
                }
                7 => {
                    spec.min_gpu_memory_mib = number;
                    "min_gpu_memory_mib"
                }
                8 => {
                    spec.command = strings;
                    "command"
                }
                9 => {
                    spec.env = env.into();
                    "env"
                }
                10 => {
                    spec.runtime_limit_s = number;
                    "runtime_limit_s"
                }
                11 => {
                    spec.grace_period_s = number;
                    "grace_period_s"
                }
                _ => {
                    spec.max_retries = small;
                    "max_retries"
                }
            };
            (spec, field)
        })
}

/// The field a refusal names, without an index or key (`spec.env["X"]` -> `spec.env`).
fn field_of(rejection: &Rejection) -> Option<&str> {
    match rejection {
        Rejection::Invalid { field, .. } => Some(field.split('[').next().unwrap_or(field)),
        _ => None,
    }
}

fn registration(name: String, gpus: Vec<(u32, bool)>) -> NodeRegistration {
    let gpus = gpus
        .into_iter()
        .map(|(index, healthy)| GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "H100".into(),
            memory_mib: 81_920,
            healthy,
            nvlink_domain: None,
        })
        .collect();
    NodeRegistration { name, address: "127.0.0.1".into(), rack: "r1".into(), leaf: "l1".into(), gpus }
}

/// What one command of a hostile sequence is made from; the ids it names
/// are taken relative to the state when it is applied, so that most name
/// things that exist and some do not.
#[derive(Debug, Clone)]
struct CommandSeed {
    kind: u8,
    name: String,
    number: u64,
    small: u32,
    flag: bool,
    gpus: Vec<(u32, bool)>,
    spec: JobSpec,
}

fn command_seed() -> impl Strategy<Value = CommandSeed> {
    let spec = prop_oneof![Just(valid_spec()), spec_with_one_hostile_field().prop_map(|(spec, _)| spec)];
    (
        0u8..16,
        prop_oneof![Just("n0".to_string()), Just("n1".to_string()), hostile_string()],
        hostile_u64(),
        0u32..12,
        any::<bool>(),
        vec((0u32..10, any::<bool>()), 0..10),
        spec,
    )
        .prop_map(|(kind, name, number, small, flag, gpus, spec)| CommandSeed { kind, name, number, small, flag, gpus, spec })
}

fn command(seed: &CommandSeed, state: &ClusterState) -> Command {
    // Ids near what exists, or anything.
    let job_id = if seed.flag { seed.number % (state.next_job_id + 2) } else { seed.number };
    let alloc_id = if seed.flag { seed.number % (state.next_alloc_id + 2) } else { seed.number };
    match seed.kind {
        0..=2 => Command::SubmitJob { request_id: Some(format!("r{}", seed.small)), spec: seed.spec.clone() },
        3 => Command::CancelJob { job_id },
        4 => Command::RegisterNode(registration(seed.name.clone(), seed.gpus.clone())),
        5 => Command::NodeHealth { node: seed.name.clone(), unhealthy_gpus: seed.gpus.iter().map(|(i, _)| *i).collect() },
        6 => Command::DrainNode { node: seed.name.clone(), drain: seed.flag },
        7 => Command::NodeDown { node: seed.name.clone() },
        8 => {
            let ranks = seed
                .gpus
                .chunks(2)
                .map(|gpus| RankPlacement { node: seed.name.clone(), gpus: gpus.iter().map(|(i, _)| *i).collect() })
                .collect();
            let plan = Plan {
                computed_at_index: state.applied_index,
                placements: vec![Placement { job_id, ranks }],
                stops: vec![Stop { alloc_id, reason: if seed.flag { StopReason::Preempted } else { StopReason::RuntimeLimit } }],
                pending: vec![PendingNote { job_id, reason: Default::default(), estimated_start_ms: Some(seed.number) }],
            };
            Command::ApplyPlan(plan)
        }
        9 => Command::ApplyPlan(rota_core::policy::plan(state, state.now_ms)),
        10 => Command::AllocStarted { alloc_id, rank: seed.small },
        11 => Command::AllocExited { alloc_id, rank: seed.small, exit_code: seed.number as i32 },
        12 => Command::AllocLost { alloc_id, rank: seed.small },
        13 => Command::Checkpoint { alloc_id, at_ms: seed.number },
        14 => Command::SetQueue(QueueConfig { name: seed.name.clone(), weight: seed.small, ..QueueConfig::defaults()[0].clone() }),
        _ => match seed.small % 4 {
            0 => Command::SetQuota(GroupQuota {
                group: seed.name.clone(),
                gpus: seed.small,
                per_model: BTreeMap::new(),
                lend: seed.flag,
                lend_to: vec![],
                borrow_limit: None,
            }),
            1 => Command::SetClusterVersion { version: (seed.number % 8) as u16 },
            2 => Command::SetAlarm { replica: seed.number % 4, kind: AlarmKind::NoSpace, raised: seed.flag },
            _ => Command::NodesHeard { nodes: vec![seed.name.clone()] },
        },
    }
}

/// A state with a node, jobs (some running), a quota and an alarm, and its
/// encodings in every snapshot format that can hold it.
fn busy_state() -> ClusterState {
    let mut state = ClusterState::new(StateLimits::default());
    let mut commands = vec![Command::RegisterNode(registration("n0".into(), (0..8).map(|i| (i, true)).collect()))];
    for i in 0..6 {
        let mut spec = valid_spec();
        spec.name = format!("job-{i}");
        commands.push(Command::SubmitJob { request_id: Some(format!("req-{i}")), spec });
    }
    state.apply_proposal(1, &Proposal { now_ms: 1_700_000_000_000, commands });
    let plan = rota_core::policy::plan(&state, state.now_ms);
    state.apply_proposal(2, &Proposal { now_ms: 1_700_000_001_000, commands: vec![Command::ApplyPlan(plan)] });
    state.check_invariants().expect("a consistent state");
    state
}

fn snapshots_of_every_format(state: &ClusterState) -> Vec<Vec<u8>> {
    (1..=FORMAT_VERSION)
        .map(|version| {
            let mut state = state.clone();
            state.cluster_version = version;
            if version < 3 {
                state.alarms.clear();
            }
            if version < 4 {
                state.node_heard_ms.clear();
            }
            encode_snapshot(&state)
        })
        .collect()
}

proptest! {
    #![proptest_config(config(512))]

    /// Any bytes, with or without a header of every version: an error or a
    /// value, never a panic.
    #[test]
    fn the_codec_never_panics_on_random_bytes(version in 0u16..=FORMAT_VERSION + 1, with_header in any::<bool>(), body in vec(any::<u8>(), 0..1_024)) {
        let mut bytes = Vec::new();
        if with_header {
            bytes.extend_from_slice(b"rota");
            bytes.extend_from_slice(&version.to_le_bytes());
        }
        bytes.extend_from_slice(&body);
        let _ = decode_proposal(&bytes);
        let _ = decode_snapshot(&bytes);
        for supported in 1..=FORMAT_VERSION {
            let _ = decode_proposal_up_to(&bytes, supported);
            let _ = decode_snapshot_up_to(&bytes, supported);
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Valid entries and snapshots of every format, cut short or with a
    /// word overwritten (a length prefix becomes huge, an enum tag unknown):
    /// the decoder says what it was decoding, never panics and never tries
    /// to allocate what a length prefix claims. Failed on commit 6c59791
    /// (snapshot parts read with `bincode::deserialize_from`, no limit)
    /// with "memory allocation of 281474976710658 bytes failed" (SIGABRT).
    #[test]
    fn damaged_encodings_are_refused_not_fatal(at in any::<prop::sample::Index>(), word in hostile_u64(), cut in any::<bool>()) {
        let state = busy_state();
        let proposal = Proposal { now_ms: 5, commands: vec![Command::SubmitJob { request_id: Some("r".into()), spec: valid_spec() }, Command::NodesHeard { nodes: vec!["n0".into()] }] };
        let mut encodings: Vec<(bool, Vec<u8>)> = snapshots_of_every_format(&state).into_iter().map(|bytes| (true, bytes)).collect();
        encodings.push((false, encode_proposal(&proposal)));
        for (is_snapshot, mut bytes) in encodings {
            let position = 6 + at.index(bytes.len() - 6);
            if cut {
                bytes.truncate(position);
            } else {
                let end = (position + 8).min(bytes.len());
                let len = end - position;
                bytes[position..end].copy_from_slice(&word.to_le_bytes()[..len]);
            }
            if is_snapshot {
                if let Err(error) = decode_snapshot(&bytes) {
                    prop_assert!(error.to_string().starts_with("snapshot"), "{}", error);
                }
            } else if let Err(error) = decode_proposal(&bytes) {
                prop_assert!(error.to_string().starts_with("log entry"), "{}", error);
            }
        }
    }

    /// A spec valid but for one hostile field is refused naming that field
    /// (or, for the limits that add fields up, the whole spec or the GPU
    /// count), never another.
    #[test]
    fn a_refused_spec_names_the_field_made_wrong((spec, changed) in spec_with_one_hostile_field()) {
        let queues: BTreeMap<String, QueueConfig> = QueueConfig::defaults().into_iter().map(|q| (q.name.clone(), q)).collect();
        if let Err(rejection) = validate_spec(&spec, &queues) {
            let field = field_of(&rejection).unwrap_or_default().to_string();
            let allowed = [format!("spec.{changed}"), "spec".to_string(), "spec.gpus_per_replica".to_string()];
            prop_assert!(allowed.contains(&field), "changed {} but refused {:?}", changed, rejection);
            prop_assert!(rejection.to_string().contains(&field), "the message names no field: {}", rejection);
            // The sum bound and the GPU count are refused only where they can be reached.
            if field == "spec" {
                prop_assert!(spec.payload_bytes() > rota_core::state::validate::MAX_SPEC_BYTES);
            }
        }
    }

    #[test]
    fn refused_queues_quotas_and_request_ids_name_their_field(name in hostile_string(), weight in hostile_u32(), runtime in hostile_u64(), gpus in hostile_u32(), lend_to in vec(hostile_string(), 0..80)) {
        let queue = QueueConfig { name: name.clone(), weight, default_runtime_s: runtime, ..QueueConfig::defaults()[0].clone() };
        if let Err(rejection) = validate_queue(&queue) {
            prop_assert!(field_of(&rejection).is_some_and(|f| f.starts_with("queue.")), "{:?}", rejection);
        }
        let quota = GroupQuota { group: name.clone(), gpus, per_model: BTreeMap::from([("H100".to_string(), gpus / 2 + 1)]), lend: true, lend_to, borrow_limit: None };
        if let Err(rejection) = validate_quota(&quota) {
            prop_assert!(field_of(&rejection).is_some_and(|f| f.starts_with("quota.")), "{:?}", rejection);
        }
        if let Err(rejection) = validate_request_id(Some(&name)) {
            prop_assert_eq!(field_of(&rejection), Some("request_id"));
        }
    }
}

proptest! {
    #![proptest_config(config(48))]

    /// Hostile command sequences: apply never panics, every refusal names
    /// what it is about (an invalid input names its field in the message),
    /// and the invariants (no GPU held twice, whole gangs, the indexes and
    /// counters agree with the tables) hold after every entry.
    #[test]
    fn apply_keeps_the_invariants_under_hostile_commands(entries in vec((vec(command_seed(), 1..5), 0u64..60_000, any::<bool>()), 1..40)) {
        let limits = StateLimits { max_live_jobs: 40, max_finished_jobs: 10, dedupe_capacity: 20, ..StateLimits::default() };
        let mut state = ClusterState::new(limits);
        let mut now_ms = 1_700_000_000_000u64;
        for (index, (seeds, step_ms, backwards)) in entries.iter().enumerate() {
            // Leaders' clocks differ: time may go back.
            now_ms = if *backwards { now_ms.saturating_sub(*step_ms) } else { now_ms + step_ms };
            let commands: Vec<Command> = seeds.iter().map(|seed| command(seed, &state)).collect();
            let results = state.apply_proposal(index as u64 + 1, &Proposal { now_ms, commands });
            for result in &results {
                if let CommandResult::Rejected(rejection) = result {
                    let text = rejection.to_string();
                    prop_assert!(!text.is_empty(), "an empty refusal");
                    if let Rejection::Invalid { field, .. } = rejection {
                        prop_assert!(!field.is_empty() && text.contains(field.as_str()), "{:?}", rejection);
                    }
                }
            }
            if let Err(broken) = state.check_invariants() {
                prop_assert!(false, "entry {}: {}", index + 1, broken);
            }
        }
        // What apply built survives a snapshot.
        let restored = decode_snapshot(&encode_snapshot(&state)).expect("a snapshot of a valid state decodes");
        prop_assert_eq!(restored.check_invariants(), Ok(()));
    }
}
