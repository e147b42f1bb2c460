//! Limits on everything a user can send. The same checks run on the replica
//! that receives a request (to answer InvalidArgument at once) and inside
//! apply (so a spec that became invalid, say after a queue change, is refused
//! the same way on every replica).

use std::collections::BTreeMap;

use super::command::Rejection;
use super::types::{JobSpec, QueueConfig};

pub const MAX_NAME_BYTES: usize = 128;
pub const MAX_GROUP_BYTES: usize = 64;
pub const MAX_REQUEST_ID_BYTES: usize = 128;
pub const MAX_REPLICAS: u32 = 4096;
pub const MAX_GPUS_PER_REPLICA: u32 = 64;
pub const MAX_MODEL_BYTES: usize = 64;
pub const MAX_COMMAND_ARGS: usize = 256;
pub const MAX_ARG_BYTES: usize = 4096;
pub const MAX_ENV_ENTRIES: usize = 128;
pub const MAX_ENV_NAME_BYTES: usize = 256;
pub const MAX_ENV_VALUE_BYTES: usize = 4096;
pub const MAX_GRACE_PERIOD_S: u64 = 3600;
pub const MAX_RETRIES: u32 = 10;
/// All of a spec's names, arguments and environment together. Every field
/// has its own limit too, but their sum would be megabytes: this bound keeps
/// any one job small in the log, in memory and in every response.
pub const MAX_SPEC_BYTES: usize = 128 * 1024;

/// Variables the agent sets for every rank; a job may not override them.
pub const RESERVED_ENV: [&str; 7] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"];

fn invalid(field: &str, message: impl Into<String>) -> Rejection {
    Rejection::Invalid { field: field.to_string(), message: message.into() }
}

fn is_identifier(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

pub fn validate_request_id(request_id: Option<&str>) -> Result<(), Rejection> {
    let Some(id) = request_id else { return Ok(()) };
    if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES {
        return Err(invalid("request_id", format!("must be 1..={MAX_REQUEST_ID_BYTES} bytes")));
    }
    Ok(())
}

/// Check a spec against the limits and the configured queues.
pub fn validate_spec(spec: &JobSpec, queues: &BTreeMap<String, QueueConfig>) -> Result<(), Rejection> {
    if spec.name.len() > MAX_NAME_BYTES {
        return Err(invalid("spec.name", format!("at most {MAX_NAME_BYTES} bytes")));
    }
    if spec.group.is_empty() || spec.group.len() > MAX_GROUP_BYTES || !is_identifier(&spec.group) {
        return Err(invalid("spec.group", format!("1..={MAX_GROUP_BYTES} bytes of [A-Za-z0-9._-]")));
    }
    let Some(queue) = queues.get(&spec.queue) else {
        let known: Vec<&str> = queues.keys().map(String::as_str).collect();
        return Err(invalid("spec.queue", format!("unknown queue {:?} (known: {})", spec.queue, known.join(", "))));
    };
    validate_shape(spec, queue)?;
    validate_command(spec)?;
    validate_env(spec)?;
    let bytes = spec.payload_bytes();
    if bytes > MAX_SPEC_BYTES {
        return Err(invalid("spec", format!("{bytes} bytes of names, command and environment; at most {MAX_SPEC_BYTES}")));
    }
    if spec.runtime_limit_s > queue.max_runtime_s {
        return Err(invalid(
            "spec.runtime_limit_s",
            format!("{} s is above queue {}'s maximum of {} s", spec.runtime_limit_s, queue.name, queue.max_runtime_s),
        ));
    }
    if spec.grace_period_s > MAX_GRACE_PERIOD_S {
        return Err(invalid("spec.grace_period_s", format!("at most {MAX_GRACE_PERIOD_S}")));
    }
    if spec.max_retries > MAX_RETRIES {
        return Err(invalid("spec.max_retries", format!("at most {MAX_RETRIES}")));
    }
    Ok(())
}

fn validate_shape(spec: &JobSpec, queue: &QueueConfig) -> Result<(), Rejection> {
    if spec.replicas == 0 || spec.replicas > MAX_REPLICAS {
        return Err(invalid("spec.replicas", format!("must be 1..={MAX_REPLICAS}")));
    }
    if spec.gpus_per_replica == 0 || spec.gpus_per_replica > MAX_GPUS_PER_REPLICA {
        return Err(invalid("spec.gpus_per_replica", format!("must be 1..={MAX_GPUS_PER_REPLICA}")));
    }
    if queue.max_gpus_per_job > 0 && spec.total_gpus() > u64::from(queue.max_gpus_per_job) {
        return Err(invalid(
            "spec.gpus_per_replica",
            format!("job asks for {} GPUs; queue {} takes at most {}", spec.total_gpus(), queue.name, queue.max_gpus_per_job),
        ));
    }
    if let Some(model) = &spec.gpu_model {
        if model.is_empty() || model.len() > MAX_MODEL_BYTES || !is_identifier(model) {
            return Err(invalid("spec.gpu_model", format!("1..={MAX_MODEL_BYTES} bytes of [A-Za-z0-9._-]")));
        }
    }
    Ok(())
}

fn validate_command(spec: &JobSpec) -> Result<(), Rejection> {
    if spec.command.is_empty() || spec.command[0].is_empty() {
        return Err(invalid("spec.command", "must name a program"));
    }
    if spec.command.len() > MAX_COMMAND_ARGS {
        return Err(invalid("spec.command", format!("at most {MAX_COMMAND_ARGS} arguments")));
    }
    if let Some(i) = spec.command.iter().position(|a| a.len() > MAX_ARG_BYTES || a.contains('\0')) {
        return Err(invalid(&format!("spec.command[{i}]"), format!("at most {MAX_ARG_BYTES} bytes, no NUL")));
    }
    Ok(())
}

fn validate_env(spec: &JobSpec) -> Result<(), Rejection> {
    if spec.env.len() > MAX_ENV_ENTRIES {
        return Err(invalid("spec.env", format!("at most {MAX_ENV_ENTRIES} entries")));
    }
    for (name, value) in &spec.env {
        let well_formed = !name.is_empty()
            && name.len() <= MAX_ENV_NAME_BYTES
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !well_formed {
            return Err(invalid(&format!("spec.env[{name:?}]"), "name must be 1..=256 bytes of [A-Za-z0-9_], not starting with a digit"));
        }
        if name.starts_with("ROTA_") || RESERVED_ENV.contains(&name.as_str()) {
            return Err(invalid(&format!("spec.env[{name:?}]"), "is set by rota and cannot be overridden"));
        }
        if value.len() > MAX_ENV_VALUE_BYTES || value.contains('\0') {
            return Err(invalid(&format!("spec.env[{name:?}]"), format!("value at most {MAX_ENV_VALUE_BYTES} bytes, no NUL")));
        }
    }
    Ok(())
}

pub fn validate_queue(queue: &QueueConfig) -> Result<(), Rejection> {
    if queue.name.is_empty() || queue.name.len() > MAX_GROUP_BYTES || !is_identifier(&queue.name) {
        return Err(invalid("queue.name", format!("1..={MAX_GROUP_BYTES} bytes of [A-Za-z0-9._-]")));
    }
    if queue.weight == 0 || queue.weight > 1000 {
        return Err(invalid("queue.weight", "must be 1..=1000"));
    }
    if queue.default_runtime_s == 0 || queue.default_runtime_s > queue.max_runtime_s {
        return Err(invalid("queue.default_runtime_s", "must be 1..=max_runtime_s"));
    }
    Ok(())
}

pub fn validate_quota(quota: &super::types::GroupQuota) -> Result<(), Rejection> {
    if quota.group.is_empty() || quota.group.len() > MAX_GROUP_BYTES || !is_identifier(&quota.group) {
        return Err(invalid("quota.group", format!("1..={MAX_GROUP_BYTES} bytes of [A-Za-z0-9._-]")));
    }
    let per_model: u64 = quota.per_model.values().map(|&g| u64::from(g)).sum();
    if per_model > u64::from(quota.gpus) {
        return Err(invalid("quota.per_model", "per-model quotas add up to more than the group's gpus"));
    }
    if quota.lend_to.len() > 64 {
        return Err(invalid("quota.lend_to", "at most 64 groups"));
    }
    Ok(())
}
