//! Property tests of what a replica does with a request's bytes before
//! anything reaches the log: protobuf decoding of every request message it
//! serves, then the proto -> core conversions and validation.
//!
//! Properties: decoding random bytes never panics; a decoded request is
//! either accepted or refused with a `Rejection::Invalid` naming the
//! offending field in its message. Case counts keep this file to seconds.

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use prost::Message;
use rota_client::convert::{priority_from_pb, queue_from_pb, quota_from_pb, spec_from_pb, state_from_pb, validate_submit};
use rota_core::state::validate::{validate_queue, validate_quota};
use rota_core::state::{ClusterState, Rejection};
use rota_proto::v1 as pb;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// The field a refusal names (without index or key), checked to appear in
/// its message.
fn named_field(rejection: &Rejection) -> Result<String, String> {
    match rejection {
        Rejection::Invalid { field, .. } if !field.is_empty() && rejection.to_string().contains(field.as_str()) => {
            Ok(field.split('[').next().unwrap_or(field).to_string())
        }
        other => Err(format!("a refusal that names no field: {other:?}")),
    }
}

/// Try every request message a replica decodes on `bytes`.
fn decode_everything(bytes: &[u8]) {
    let _ = pb::SubmitJobRequest::decode(bytes);
    let _ = pb::GetJobRequest::decode(bytes);
    let _ = pb::ListJobsRequest::decode(bytes);
    let _ = pb::CancelJobRequest::decode(bytes);
    let _ = pb::WatchJobsRequest::decode(bytes);
    let _ = pb::WatchEventsRequest::decode(bytes);
    let _ = pb::RegisterNodeRequest::decode(bytes);
    let _ = pb::HeartbeatRequest::decode(bytes);
    let _ = pb::WatchAssignmentsRequest::decode(bytes);
    let _ = pb::ReportRankEventsRequest::decode(bytes);
    let _ = pb::Queue::decode(bytes);
    let _ = pb::Quota::decode(bytes);
    let _ = pb::AddMemberRequest::decode(bytes);
    let _ = pb::RemoveMemberRequest::decode(bytes);
    let _ = pb::CampaignRequest::decode(bytes);
    let _ = pb::SetAlarmRequest::decode(bytes);
    let _ = pb::ReadLogRequest::decode(bytes);
}

fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("training".to_string()),
        Just("vision".to_string()),
        Just("ROTA_X".to_string()),
        Just("a\0b".to_string()),
        Just("y".repeat(5_000)),
        "[a-zA-Z0-9_.-]{1,12}",
        any::<String>(),
    ]
}

fn wire_spec() -> impl Strategy<Value = pb::JobSpec> {
    (
        (hostile_string(), hostile_string(), hostile_string(), any::<i32>(), 0u32..5_000, 0u32..100, hostile_string()),
        (
            vec(hostile_string(), 0..4),
            btree_map(hostile_string(), hostile_string(), 0..4),
            any::<u64>(),
            0u64..5_000,
            0u32..20,
            any::<u64>(),
        ),
    )
        .prop_map(|((name, group, queue, priority, replicas, gpus, model), (command, env, runtime, grace, retries, ttl))| {
            pb::JobSpec {
                name,
                group,
                queue,
                priority,
                replicas,
                gpus_per_replica: gpus,
                gpu_model: model,
                min_gpu_memory_mib: 0,
                command,
                env: env.into_iter().collect(),
                runtime_limit_s: runtime,
                grace_period_s: grace,
                max_retries: retries,
                priority_ttl_s: ttl,
            }
        })
}

proptest! {
    #![proptest_config(config(1_024))]

    #[test]
    fn random_bytes_never_panic_a_request_decoder(bytes in vec(any::<u8>(), 0..512)) {
        decode_everything(&bytes);
    }

    /// A valid submit's encoding with bytes overwritten: decoding, then
    /// conversion and validation, refuse by field or accept.
    #[test]
    fn damaged_submits_are_refused_by_field(at in any::<prop::sample::Index>(), byte in any::<u8>(), spec in wire_spec()) {
        let request = pb::SubmitJobRequest { spec: Some(spec), request_id: "r-1".into(), ..Default::default() };
        let mut bytes = request.encode_to_vec();
        let position = at.index(bytes.len());
        bytes[position] = byte;
        decode_everything(&bytes);
        if let Ok(request) = pb::SubmitJobRequest::decode(bytes.as_slice()) {
            let state = ClusterState::default();
            let request_id = Some(request.request_id.as_str()).filter(|id| !id.is_empty());
            let outcome = spec_from_pb(request.spec).and_then(|spec| validate_submit(&state, request_id, &spec));
            if let Err(rejection) = outcome {
                let field = named_field(&rejection).map_err(TestCaseError::fail)?;
                prop_assert!(field == "request_id" || field == "spec" || field.starts_with("spec."), "{:?}", rejection);
            }
        }
    }

    /// Hostile but well-formed wire specs: accepted, or refused naming a
    /// field of the spec.
    #[test]
    fn hostile_wire_specs_are_refused_by_field(spec in wire_spec(), request_id in hostile_string()) {
        let state = ClusterState::default();
        let request_id = Some(request_id.as_str()).filter(|id| !id.is_empty());
        if let Err(rejection) = spec_from_pb(Some(spec)).and_then(|spec| validate_submit(&state, request_id, &spec)) {
            let field = named_field(&rejection).map_err(TestCaseError::fail)?;
            prop_assert!(field == "request_id" || field == "spec" || field.starts_with("spec."), "{:?}", rejection);
        }
    }

    #[test]
    fn enums_queues_and_quotas_from_the_wire_are_refused_by_field(
        value in any::<i32>(), name in hostile_string(), weight in any::<u32>(), runtime in any::<u64>(), gpus in any::<u32>(),
        per_model in btree_map(hostile_string(), any::<u32>(), 0..4), lend_to in vec(hostile_string(), 0..70),
    ) {
        if let Err(rejection) = priority_from_pb(value) {
            prop_assert_eq!(named_field(&rejection).map_err(TestCaseError::fail)?, "spec.priority");
        }
        if let Err(rejection) = state_from_pb(value) {
            prop_assert_eq!(named_field(&rejection).map_err(TestCaseError::fail)?, "state");
        }
        let queue = queue_from_pb(pb::Queue { name: name.clone(), weight, default_runtime_s: runtime, max_runtime_s: runtime / 2, ..Default::default() });
        if let Err(rejection) = validate_queue(&queue) {
            prop_assert!(named_field(&rejection).map_err(TestCaseError::fail)?.starts_with("queue."));
        }
        let quota = quota_from_pb(pb::Quota { group: name, gpus, per_model: per_model.into_iter().collect(), lend: true, lend_to, borrow_limit: None });
        if let Err(rejection) = validate_quota(&quota) {
            prop_assert!(named_field(&rejection).map_err(TestCaseError::fail)?.starts_with("quota."));
        }
    }
}
