//! How the CLI shows things: a readable table, or JSON for scripts.

use rota_core::state::faults::utc_text;
use rota_core::state::idle::duration_text;
use rota_proto::v1 as pb;
use serde_json::{json, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// "pending", "running", ...: the wire enum's name without its prefix.
pub fn state_name(state: i32) -> String {
    pb::JobState::try_from(state).map_or("unknown".into(), |s| s.as_str_name().trim_start_matches("JOB_STATE_").to_lowercase())
}

pub fn priority_name(priority: i32) -> &'static str {
    match pb::Priority::try_from(priority) {
        Ok(pb::Priority::High) => "high",
        Ok(pb::Priority::Low) => "low",
        _ => "medium",
    }
}

pub fn job_json(job: &pb::Job) -> Value {
    let spec = job.spec.clone().unwrap_or_default();
    let allocations: Vec<Value> = job
        .allocations
        .iter()
        .map(|a| json!({"rank": a.rank, "node": a.node, "gpus": a.gpus, "state": a.state, "exit_code": a.exit_code}))
        .collect();
    json!({
        "id": job.id,
        "state": state_name(job.state),
        "name": spec.name,
        "group": spec.group,
        "queue": spec.queue,
        "priority": priority_name(spec.priority),
        "replicas": spec.replicas,
        "gpus": spec.gpus_per_replica,
        "gpu_model": spec.gpu_model,
        "command": spec.command,
        "runtime_limit_s": spec.runtime_limit_s,
        "request_id": job.request_id,
        "submitted_at": job.submitted_at_ms,
        "started_at": job.started_at_ms,
        "finished_at": job.finished_at_ms,
        "reason": job.reason,
        "estimated_start": job.estimated_start_ms,
        "attempts": job.attempts,
        "exit_code": job.exit_code,
        "master_addr": job.master_addr,
        "master_port": job.master_port,
        "allocations": allocations,
        "last_nodes": job.last_nodes,
        "owner": job.owner,
        "env": spec.env,
        "redacted": job.redacted,
        "reason_code": job.reason_code,
        "labels": job.labels,
        "template": job.template,
        "template_version": job.template_version,
        "stop_reason": job.stop_reason,
        "idle_since_ms": job.idle_since_ms,
        "idle_flagged_ms": job.idle_flagged_ms,
        "idle_gpu_ms": job.idle_gpu_ms,
        "policy_version": job.policy_version,
        "lost_after": job.lost_after,
    })
}

pub fn print_job(job: &pb::Job) {
    let spec = job.spec.clone().unwrap_or_default();
    outln!("job {}  {}", job.id, state_name(job.state));
    outln!("  group {}  queue {}  priority {}", spec.group, spec.queue, priority_name(spec.priority));
    outln!("  {} x {} GPU  command {:?}", spec.replicas, spec.gpus_per_replica, spec.command);
    if !job.owner.is_empty() {
        outln!("  owner {}", job.owner);
    }
    if !job.template.is_empty() {
        outln!("  template {} version {}", job.template, job.template_version);
    }
    if !job.labels.is_empty() {
        let mut labels: Vec<String> = job.labels.iter().map(|(key, value)| format!("{key}={value}")).collect();
        labels.sort();
        outln!("  labels {}", labels.join(" "));
    }
    if !spec.env.is_empty() {
        let env: Vec<String> = spec.env.iter().map(|(name, value)| format!("{name}={value}")).collect();
        outln!("  env {}", env.join(" "));
    }
    if !job.reason.is_empty() {
        outln!("  reason: {}", job.reason);
    }
    if !job.stop_reason.is_empty() {
        outln!("  stop reason {}", job.stop_reason);
    }
    if !job.lost_after.is_empty() {
        outln!("  lost after {} of its node's silence", job.lost_after);
    }
    if job.state == pb::JobState::Unknown as i32 {
        outln!("  its node is down: whether it still runs is unknown until the node is heard again");
    }
    if let Some(version) = job.policy_version {
        outln!("  placed under policy version {version}");
    }
    if job.idle_since_ms != 0 {
        let flagged = if job.idle_flagged_ms != 0 { format!(", flagged at {}", utc_text(job.idle_flagged_ms)) } else { String::new() };
        outln!("  idle since {}{flagged}", utc_text(job.idle_since_ms));
    }
    if job.idle_gpu_ms != 0 {
        outln!("  idle GPU time {}", duration_text(job.idle_gpu_ms));
    }
    if job.master_port != 0 {
        outln!("  master {}:{}", job.master_addr, job.master_port);
    }
    for a in &job.allocations {
        let exit = a.exit_code.map_or(String::new(), |c| format!("  exit {c}"));
        outln!("  rank {:>3}  node {:<20} gpus {:<24} {}{exit}", a.rank, a.node, format!("{:?}", a.gpus), a.state);
    }
    if job.allocations.is_empty() && !job.last_nodes.is_empty() {
        outln!("  last attempt ran on: {}", job.last_nodes.join(", "));
    }
    if let Some(code) = job.exit_code {
        outln!("  exit code {code}");
    }
}

pub fn print_jobs(jobs: &[pb::Job], total: u64) {
    outln!("{:>8}  {:<10} {:<12} {:<10} {:>8}  REASON", "ID", "STATE", "GROUP", "QUEUE", "GPUS");
    for job in jobs {
        let spec = job.spec.clone().unwrap_or_default();
        let gpus = u64::from(spec.replicas) * u64::from(spec.gpus_per_replica);
        outln!("{:>8}  {:<10} {:<12} {:<10} {:>8}  {}", job.id, state_name(job.state), spec.group, spec.queue, gpus, job.reason);
    }
    if total as usize > jobs.len() {
        outln!("({} of {} jobs shown)", jobs.len(), total);
    }
}

/// Jobs flagged idle: since when, for how long (to `now_ms`, this
/// machine's clock) and their idle GPU-time.
pub fn print_idle_jobs(jobs: &[pb::Job], total: u64, now_ms: u64) {
    outln!("{:>8}  {:<12} {:<10} {:>5}  {:<20}  {:>9}  {:>12}", "ID", "GROUP", "QUEUE", "GPUS", "IDLE SINCE", "IDLE FOR", "IDLE GPU TIME");
    for job in jobs {
        let spec = job.spec.clone().unwrap_or_default();
        let gpus = u64::from(spec.replicas) * u64::from(spec.gpus_per_replica);
        outln!(
            "{:>8}  {:<12} {:<10} {:>5}  {:<20}  {:>9}  {:>12}",
            job.id,
            spec.group,
            spec.queue,
            gpus,
            utc_text(job.idle_since_ms),
            duration_text(now_ms.saturating_sub(job.idle_since_ms)),
            duration_text(job.idle_gpu_ms)
        );
    }
    if total as usize > jobs.len() {
        outln!("({} of {} jobs shown)", jobs.len(), total);
    }
}

pub fn cluster_json(status: &pb::ClusterStatus) -> Value {
    let members: Vec<Value> = status
        .members
        .iter()
        .map(|m| {
            let applied = if m.id == status.replica_id { status.applied_index } else { m.matched_index };
            json!({"id": m.id, "address": m.address, "role": m.role, "applied_index": applied, "matched_index": m.matched_index})
        })
        .collect();
    json!({
        "replica_id": status.replica_id,
        "leader_id": status.leader_id,
        "leader_address": status.leader_address,
        "term": status.term,
        "last_log_index": status.last_log_index,
        "commit_index": status.commit_index,
        "applied_index": status.applied_index,
        "format_version": status.format_version,
        "cluster_version": status.cluster_version,
        "members": members,
    })
}

pub fn print_cluster(status: &pb::ClusterStatus) {
    outln!(
        "leader {} ({})  term {}  commit {}  applied {}  cluster version {} (this replica reads up to {})",
        status.leader_id,
        status.leader_address,
        status.term,
        status.commit_index,
        status.applied_index,
        status.cluster_version,
        status.format_version
    );
    outln!("{:>4}  {:<22} {:<9} {:>10}", "ID", "ADDRESS", "ROLE", "MATCHED");
    for m in &status.members {
        outln!("{:>4}  {:<22} {:<9} {:>10}", m.id, m.address, m.role, m.matched_index);
    }
}

pub fn node_json(node: &pb::Node) -> Value {
    let gpus: Vec<Value> = node
        .gpus
        .iter()
        .map(|g| {
            json!({"index": g.index, "uuid": g.uuid, "model": g.model, "memory_mib": g.memory_mib, "healthy": g.healthy,
                "job_id": g.job_id, "fence": g.fence, "nvlink_domain": g.nvlink_domain,
                "utilization_percent": g.utilization_percent, "memory_used_mib": g.memory_used_mib})
        })
        .collect();
    let fences: Vec<Value> = node
        .fences
        .iter()
        .map(|f| json!({"scope": f.scope, "id": f.id, "kind": f.kind, "reason": f.reason, "since_ms": f.since_ms}))
        .collect();
    json!({"name": node.name, "address": node.address, "rack": node.rack, "leaf": node.leaf, "state": node.state, "gpus": gpus,
        "fences": fences})
}

/// One line per fence: `fenced node (node): xid 79 at ...`.
fn fence_line(fence: &pb::NodeFence) -> String {
    let scope = match fence.scope.as_str() {
        "node" => "node".to_string(),
        scope => format!("{scope} {}", fence.id),
    };
    format!("fenced {scope} ({}): {}", fence.kind, fence.reason)
}

pub fn print_nodes(nodes: &[pb::Node]) {
    outln!("{:<20} {:<9} {:<8} {:<8} {:>5} {:>5}", "NODE", "STATE", "RACK", "LEAF", "GPUS", "FREE");
    for node in nodes {
        let ready = node.state == "ready";
        let free = node.gpus.iter().filter(|g| ready && g.healthy && g.fence.is_empty() && g.job_id == 0).count();
        outln!("{:<20} {:<9} {:<8} {:<8} {:>5} {:>5}", node.name, node.state, node.rack, node.leaf, node.gpus.len(), free);
        for fence in &node.fences {
            outln!("    {}", fence_line(fence));
        }
        for g in &node.gpus {
            let holder = if g.job_id == 0 { "-".to_string() } else { format!("job {}", g.job_id) };
            let health = match (g.healthy, g.fence.is_empty()) {
                (true, true) => "ok",
                (_, false) => "FENCED",
                (false, true) => "UNHEALTHY",
            };
            let utilization = g.utilization_percent.map_or("-".to_string(), |u| format!("{u}%"));
            let used = g.memory_used_mib.map_or("-".to_string(), |m| format!("{m}"));
            outln!(
                "    gpu {:>2}  {:<12} {:>6} MiB  {:<9}  util {:>4}  used {:>6} MiB  {}",
                g.index,
                g.model,
                g.memory_mib,
                health,
                utilization,
                used,
                holder
            );
        }
    }
}

/// One event as a JSON object (the same fields as the REST API's).
pub fn event_json(event: &pb::Event) -> serde_json::Value {
    json!({
        "index": event.index,
        "seq": event.seq,
        "topic": event.topic,
        "kind": event.kind,
        "job_id": event.job_id,
        "node": event.node,
        "group": event.group,
        "queue": event.queue,
        "reason": event.reason,
        "time_ms": event.time_ms,
        "state": event.state,
    })
}

/// One event as a line for people: index.seq, kind, then what it names.
pub fn event_line(event: &pb::Event) -> String {
    let mut line = format!("{}.{} {}", event.index, event.seq, event.kind);
    let named = [
        ("job", if event.job_id == 0 { String::new() } else { event.job_id.to_string() }),
        ("node", event.node.clone()),
        ("group", event.group.clone()),
        ("queue", event.queue.clone()),
        ("state", event.state.clone()),
        ("reason", event.reason.clone()),
    ];
    for (name, value) in named.iter().filter(|(_, value)| !value.is_empty()) {
        line.push_str(&format!(" {name}={value}"));
    }
    line
}

/// What `out!` and `outln!` call: writes `args` (and a newline) to standard
/// output, ending the CLI through [`stdout_written`] if that fails.
pub fn write_stdout(args: std::fmt::Arguments<'_>, newline: bool) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout_written(stdout.write_fmt(args).and_then(|()| if newline { stdout.write_all(b"\n") } else { Ok(()) }));
}

/// The verdict on a write to standard output, for every writer of the CLI
/// (the macros, the log and event streams). A closed pipe exits with
/// success, since the reader has all it wanted (`rota events | head -3`);
/// any other write error exits non-zero with the error named.
pub fn stdout_written(written: std::io::Result<()>) {
    match written {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(error) => {
            eprintln!("rota: writing to standard output: {error}");
            std::process::exit(1);
        }
    }
}
