//! Conversions between the rota.v1 wire types and the state's domain types.
//! Shape checks that need no state (field present, enum known) happen here
//! and name the field; limits are checked by `state::validate`.

use rota_proto::v1 as pb;

use rota_core::state::{self, ClusterState, GroupQuota, Job, JobSpec, JobState, Node, Priority, QueueConfig, Rejection};

fn invalid(field: &str, message: &str) -> Rejection {
    Rejection::Invalid { field: field.into(), message: message.into() }
}

pub fn priority_from_pb(value: i32) -> Result<Priority, Rejection> {
    match pb::Priority::try_from(value) {
        Ok(pb::Priority::Unspecified) | Ok(pb::Priority::Medium) => Ok(Priority::Medium),
        Ok(pb::Priority::Low) => Ok(Priority::Low),
        Ok(pb::Priority::High) => Ok(Priority::High),
        Err(_) => Err(invalid("spec.priority", "unknown priority")),
    }
}

pub fn priority_to_pb(priority: Priority) -> pb::Priority {
    match priority {
        Priority::Low => pb::Priority::Low,
        Priority::Medium => pb::Priority::Medium,
        Priority::High => pb::Priority::High,
    }
}

/// A wire spec with defaults filled in: group "default", queue "training",
/// one replica, grace period 60 s.
pub fn spec_from_pb(spec: Option<pb::JobSpec>) -> Result<JobSpec, Rejection> {
    let spec = spec.ok_or_else(|| invalid("spec", "is required"))?;
    Ok(JobSpec {
        name: spec.name,
        group: if spec.group.is_empty() { "default".into() } else { spec.group },
        queue: if spec.queue.is_empty() { "training".into() } else { spec.queue },
        priority: priority_from_pb(spec.priority)?,
        replicas: spec.replicas,
        gpus_per_replica: spec.gpus_per_replica,
        gpu_model: Some(spec.gpu_model).filter(|m| !m.is_empty()).map(String::into_boxed_str),
        min_gpu_memory_mib: spec.min_gpu_memory_mib,
        command: spec.command,
        env: spec.env.into_iter().collect(),
        runtime_limit_s: spec.runtime_limit_s,
        grace_period_s: if spec.grace_period_s == 0 { 60 } else { spec.grace_period_s },
        max_retries: spec.max_retries,
        priority_ttl_s: spec.priority_ttl_s,
    })
}

pub fn spec_to_pb(spec: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        name: spec.name.clone(),
        group: spec.group.clone(),
        queue: spec.queue.clone(),
        priority: priority_to_pb(spec.priority) as i32,
        replicas: spec.replicas,
        gpus_per_replica: spec.gpus_per_replica,
        gpu_model: spec.gpu_model.as_deref().unwrap_or_default().to_string(),
        min_gpu_memory_mib: spec.min_gpu_memory_mib,
        command: spec.command.clone(),
        env: spec.env.clone().into_iter().collect(),
        runtime_limit_s: spec.runtime_limit_s,
        grace_period_s: spec.grace_period_s,
        max_retries: spec.max_retries,
        priority_ttl_s: spec.priority_ttl_s,
    }
}

pub fn state_to_pb(state: JobState) -> pb::JobState {
    match state {
        JobState::Pending => pb::JobState::Pending,
        JobState::Running => pb::JobState::Running,
        JobState::Stopping => pb::JobState::Stopping,
        JobState::Succeeded => pb::JobState::Succeeded,
        JobState::Failed => pb::JobState::Failed,
        JobState::Cancelled => pb::JobState::Cancelled,
    }
}

/// The state people see: `Unknown` for a job kept on a node that is down
/// (by its lost-after), else the job's own.
pub fn shown_state(state: &ClusterState, job: &Job) -> pb::JobState {
    if state.job_state_unknown(job.id) {
        return pb::JobState::Unknown;
    }
    state_to_pb(job.state)
}

pub fn state_from_pb(value: i32) -> Result<Option<JobState>, Rejection> {
    Ok(match pb::JobState::try_from(value) {
        Ok(pb::JobState::Unspecified) => None,
        Ok(pb::JobState::Pending) => Some(JobState::Pending),
        Ok(pb::JobState::Running) => Some(JobState::Running),
        Ok(pb::JobState::Stopping) => Some(JobState::Stopping),
        Ok(pb::JobState::Succeeded) => Some(JobState::Succeeded),
        Ok(pb::JobState::Failed) => Some(JobState::Failed),
        Ok(pb::JobState::Cancelled) => Some(JobState::Cancelled),
        // Shown, not kept: a list asks for it with its own filter.
        Ok(pb::JobState::Unknown) => return Err(invalid("state", "unknown is a shown state, not a kept one")),
        Err(_) => return Err(invalid("state", "unknown job state")),
    })
}

pub fn job_to_pb(state: &ClusterState, job: &Job) -> pb::Job {
    let alloc = job.alloc.and_then(|id| state.allocs.get(&id));
    let allocations = alloc
        .map(|a| {
            a.ranks
                .iter()
                .map(|r| pb::RankAllocation {
                    rank: r.rank,
                    node: r.node.clone(),
                    gpus: r.gpus.clone(),
                    state: r.state.as_str().into(),
                    exit_code: r.exit_code,
                })
                .collect()
        })
        .unwrap_or_default();
    // The host only: the node's address carries its agent's port, which is
    // not what the ranks were given (MASTER_ADDR is the host).
    let master_addr = alloc
        .and_then(|a| a.ranks.first())
        .and_then(|r| state.nodes.get(&r.node))
        .map(|n| host_of(&n.address).to_string())
        .unwrap_or_default();
    let tags = state.tenancy.job_tags.get(&job.id);
    pb::Job {
        id: job.id,
        spec: Some(spec_to_pb(&job.spec)),
        state: shown_state(state, job) as i32,
        request_id: job.request_id.as_deref().unwrap_or_default().to_string(),
        submitted_at_ms: job.submitted_at_ms,
        started_at_ms: job.started_at_ms.unwrap_or(0),
        finished_at_ms: job.finished_at_ms.unwrap_or(0),
        reason: job.reason.to_string(),
        reason_code: job.reason.code.as_str().to_string(),
        reason_detail: job.reason.detail.to_string(),
        estimated_start_ms: job.estimated_start_ms.unwrap_or(0),
        attempts: job.attempts,
        allocations,
        master_addr,
        master_port: alloc.map_or(0, |a| u32::from(a.master_port)),
        exit_code: job.exit_code,
        last_nodes: job.last_nodes.to_vec(),
        owner: state.auth.job_marks.get(&job.id).and_then(|m| m.owner.clone()).unwrap_or_default(),
        redacted: false,
        labels: tags.map(|t| t.labels.clone().into_iter().collect()).unwrap_or_default(),
        template: tags.and_then(|t| t.template.as_ref()).map(|t| t.name.clone()).unwrap_or_default(),
        template_version: tags.and_then(|t| t.template.as_ref()).map_or(0, |t| t.version),
        idle_since_ms: alloc.and_then(|a| state.alloc_idle_since_ms(a.id)).unwrap_or(0),
        idle_flagged_ms: alloc.and_then(|a| state.idle.allocs.get(&a.id)).and_then(|r| r.flagged_ms).unwrap_or(0),
        idle_gpu_ms: rota_core::state::idle::idle_gpu_ms(state, job.id),
        stop_reason: job.stop_reason.map(|r| r.as_str().to_string()).unwrap_or_default(),
        policy_version: state.policy.job_versions.get(&job.id).copied(),
        lost_after: state.lost_after_of(job.id).map(|l| l.text()).unwrap_or_default(),
    }
}

/// A job's spec made from a template's: each field the request sets
/// (non-empty, non-zero; environment entries one by one) overrides the
/// template's. A field a request cannot tell from unset (zero retries, an
/// empty name) keeps the template's value.
pub fn spec_over_template(base: &JobSpec, given: Option<pb::JobSpec>) -> Result<JobSpec, Rejection> {
    let Some(given) = given else { return Ok(base.clone()) };
    let mut spec = base.clone();
    let text = |value: String, into: &mut String| {
        if !value.is_empty() {
            *into = value;
        }
    };
    text(given.name, &mut spec.name);
    text(given.group, &mut spec.group);
    text(given.queue, &mut spec.queue);
    if given.priority != pb::Priority::Unspecified as i32 {
        spec.priority = priority_from_pb(given.priority)?;
    }
    let number = |value: u64, into: &mut u64| {
        if value != 0 {
            *into = value;
        }
    };
    if given.replicas != 0 {
        spec.replicas = given.replicas;
    }
    if given.gpus_per_replica != 0 {
        spec.gpus_per_replica = given.gpus_per_replica;
    }
    if !given.gpu_model.is_empty() {
        spec.gpu_model = Some(given.gpu_model.into_boxed_str());
    }
    number(given.min_gpu_memory_mib, &mut spec.min_gpu_memory_mib);
    if !given.command.is_empty() {
        spec.command = given.command;
    }
    spec.env.extend(given.env);
    number(given.runtime_limit_s, &mut spec.runtime_limit_s);
    number(given.grace_period_s, &mut spec.grace_period_s);
    if given.max_retries != 0 {
        spec.max_retries = given.max_retries;
    }
    number(given.priority_ttl_s, &mut spec.priority_ttl_s);
    Ok(spec)
}

/// A template as `show_env` allows: environment values are shown to the
/// template's group and operators only.
pub fn template_to_pb(template: &state::tenancy::Template, show_env: bool) -> pb::Template {
    let versions = template
        .versions
        .values()
        .map(|v| {
            let mut spec = spec_to_pb(&v.spec);
            if !show_env {
                spec.env.values_mut().for_each(|value| *value = REDACTED.to_string());
            }
            pb::TemplateVersion {
                version: v.version,
                spec: Some(spec),
                labels: v.labels.clone().into_iter().collect(),
                saved_at_ms: v.saved_ms,
                saved_by: v.saved_by.clone(),
            }
        })
        .collect();
    pb::Template {
        name: template.name.clone(),
        group: template.group.clone(),
        latest_version: template.latest,
        versions,
        grants: template.grants.iter().cloned().collect(),
    }
}

/// What replaces a secret value for a reader who may not see it.
pub const REDACTED: &str = "<redacted>";

/// Hide a job's secrets from a reader who is not its owner, an admin of its
/// group or an operator: every environment value, the values of its secret
/// entries wherever they appear in the command, and the whole command when
/// the job marked it secret.
pub fn redact_job(state: &ClusterState, job: &mut pb::Job) {
    let marks = state.auth.job_marks.get(&job.id);
    let Some(spec) = job.spec.as_mut() else { return };
    let secret_values: Vec<String> = marks
        .map(|m| m.secret_env.iter().filter_map(|name| spec.env.get(name)).filter(|v| !v.is_empty()).cloned().collect())
        .unwrap_or_default();
    for value in spec.env.values_mut() {
        *value = REDACTED.to_string();
    }
    if marks.is_some_and(|m| m.secret_command) {
        spec.command = vec![REDACTED.to_string()];
    } else {
        for part in &mut spec.command {
            for secret in &secret_values {
                *part = part.replace(secret.as_str(), REDACTED);
            }
        }
    }
    job.redacted = true;
}

/// The host of `host:port` (IPv6 brackets removed).
pub fn host_of(address: &str) -> &str {
    address.rsplit_once(':').map_or(address, |(host, _)| host).trim_start_matches('[').trim_end_matches(']')
}

pub fn node_to_pb(state: &ClusterState, node: &Node) -> pb::Node {
    let gpus = node
        .gpus
        .iter()
        .map(|g| {
            let holder = state.gpu_owner.get(&(node.name.clone(), g.index));
            pb::Gpu {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                healthy: g.healthy,
                job_id: holder.and_then(|a| state.allocs.get(a)).map_or(0, |a| a.job_id),
                fence: state.faults.fence_of(&node.name, g).map(|f| f.reason.clone()).unwrap_or_default(),
                nvlink_domain: g.nvlink_domain,
                // Telemetry is not in the replicated state: the server adds it.
                utilization_percent: None,
                memory_used_mib: None,
            }
        })
        .collect();
    let fences = state.faults.fences.get(&node.name).map(node_fences_to_pb).unwrap_or_default();
    pb::Node {
        name: node.name.clone(),
        address: node.address.clone(),
        rack: node.rack.clone(),
        leaf: node.leaf.clone(),
        state: node.state.as_str().into(),
        gpus,
        registered_at_ms: node.registered_at_ms,
        fences,
    }
}

fn node_fences_to_pb(fences: &state::faults::NodeFences) -> Vec<pb::NodeFence> {
    let fence = |scope: &str, id: u32, f: &state::faults::Fence| pb::NodeFence {
        scope: scope.into(),
        id,
        kind: f.kind.as_str().into(),
        reason: f.reason.clone(),
        since_ms: f.since_ms,
    };
    let node = fences.node.iter().map(|f| fence("node", 0, f));
    let domains = fences.nvlink_domains.iter().map(|(&id, f)| fence("nvlink-domain", id, f));
    let gpus = fences.gpus.iter().map(|(&id, f)| fence("gpu", id, f));
    node.chain(domains).chain(gpus).collect()
}

/// Check a submit fully against the current state, so the receiving replica
/// answers InvalidArgument at once; apply checks again when it commits.
pub fn validate_submit(state: &ClusterState, request_id: Option<&str>, spec: &JobSpec) -> Result<(), Rejection> {
    state::validate::validate_request_id(request_id)?;
    state::validate::validate_spec(spec, &state.queues)
}

pub fn queue_to_pb(queue: &QueueConfig) -> pb::Queue {
    pb::Queue {
        name: queue.name.clone(),
        weight: queue.weight,
        max_gpus_per_job: queue.max_gpus_per_job,
        default_runtime_s: queue.default_runtime_s,
        max_runtime_s: queue.max_runtime_s,
        preemptible: queue.preemptible,
        protected_runtime_s: queue.protected_runtime_s,
        idle_after_ms: None,
        idle_action: String::new(),
    }
}

/// A queue with its idle rule, as the replicas list it.
pub fn queue_with_idle_to_pb(queue: &QueueConfig, idle: &rota_core::state::idle::IdlePolicy) -> pb::Queue {
    pb::Queue { idle_after_ms: Some(idle.idle_after_ms), idle_action: idle.action.as_str().into(), ..queue_to_pb(queue) }
}

pub fn queue_from_pb(queue: pb::Queue) -> QueueConfig {
    QueueConfig {
        name: queue.name,
        weight: queue.weight,
        max_gpus_per_job: queue.max_gpus_per_job,
        default_runtime_s: queue.default_runtime_s,
        max_runtime_s: queue.max_runtime_s,
        preemptible: queue.preemptible,
        protected_runtime_s: queue.protected_runtime_s,
    }
}

pub fn quota_to_pb(quota: &GroupQuota) -> pb::Quota {
    pb::Quota {
        group: quota.group.clone(),
        gpus: quota.gpus,
        per_model: quota.per_model.clone().into_iter().collect(),
        lend: quota.lend,
        lend_to: quota.lend_to.clone(),
        borrow_limit: quota.borrow_limit,
    }
}

pub fn quota_from_pb(quota: pb::Quota) -> GroupQuota {
    GroupQuota {
        group: quota.group,
        gpus: quota.gpus,
        per_model: quota.per_model.into_iter().collect(),
        lend: quota.lend,
        lend_to: quota.lend_to,
        borrow_limit: quota.borrow_limit,
    }
}
