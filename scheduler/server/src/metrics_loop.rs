//! Publishes the replica's Raft view as Prometheus gauges, on every change:
//! leadership, term, indexes, snapshot, each follower's lag (on the
//! leader), and the time left on the TLS certificates in use.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rota_consensus::Replica;

use crate::replicated::Replicated;

/// Certificates are re-read this often (they are reloaded when they change).
const CERTIFICATE_CHECK_EVERY: Duration = Duration::from_secs(60);

/// `certificate_files`: (name for the `cert` label, PEM path) of the CA
/// bundle and the replica's certificate when TLS is on; empty otherwise.
pub async fn run(replica: Replica<Replicated>, certificate_files: Vec<(&'static str, PathBuf)>) {
    // Counters an alert or a dashboard reads are shown from the start (at
    // 0), not only after their first event.
    for name in ["rota_leader_changes_total", "rota_applied_entries_total", "rota_snapshot_failures_total", "rota_preemptions_total"] {
        metrics::counter!(name).increment(0);
    }
    let mut applied = replica.applied_watch();
    let mut last_leader = None;
    let mut expiry_s: Vec<(&'static str, f64)> = Vec::new();
    let mut certificates_read_at: Option<Instant> = None;
    loop {
        let status = replica.status();
        let leading = status.leader_id == Some(status.id);
        metrics::gauge!("rota_is_leader").set(if leading { 1.0 } else { 0.0 });
        metrics::gauge!("rota_term").set(status.term as f64);
        metrics::gauge!("rota_commit_index").set(status.committed_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_applied_index").set(status.applied_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_last_log_index").set(status.last_log_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_snapshot_index").set(status.snapshot_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_members").set(status.members.len() as f64);
        metrics::gauge!("rota_has_leader").set(if status.leader_id.is_some() { 1.0 } else { 0.0 });
        if leading {
            // openraft's replication metrics: the highest index known on
            // each follower. A follower not heard from yet lags by the whole log.
            let last = status.last_log_index.unwrap_or(0);
            for member in status.members.iter().filter(|m| m.id != status.id) {
                let lag = last.saturating_sub(member.matched_index.unwrap_or(0));
                metrics::gauge!("rota_follower_lag_entries", "follower" => member.id.to_string()).set(lag as f64);
            }
        }
        if status.leader_id != last_leader {
            if last_leader.is_some() || status.leader_id.is_some() {
                metrics::counter!("rota_leader_changes_total").increment(1);
            }
            last_leader = status.leader_id;
        }
        if certificates_read_at.is_none_or(|at| at.elapsed() >= CERTIFICATE_CHECK_EVERY) {
            certificates_read_at = Some(Instant::now());
            expiry_s =
                certificate_files.iter().filter_map(|(name, path)| certificate_seconds_left(name, path).map(|s| (*name, s))).collect();
        }
        for (name, left_s) in &expiry_s {
            metrics::gauge!("rota_certificate_expiry_seconds", "cert" => *name).set(*left_s);
        }
        // Wake on applied entries (at most every 100 ms), and at least every
        // second for term and leader changes.
        let _ = tokio::time::timeout(Duration::from_secs(1), applied.changed()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Seconds until the first certificate in `path` (PEM) expires (in base
/// units, as Prometheus names want); None (logged) when it cannot be read.
fn certificate_seconds_left(name: &str, path: &std::path::Path) -> Option<f64> {
    let read = || -> Result<i64, String> {
        let certificates = rota_tls::pem::certificates(path).map_err(|e| e.to_string())?;
        let first = certificates.first().ok_or("no certificate in the file")?;
        rota_tls::der::not_after_unix_s(first).map_err(|e| e.to_string())
    };
    match read() {
        Ok(not_after_s) => {
            let now_s = crate::clock::wall_clock_ms() as f64 / 1000.0;
            Some(not_after_s as f64 - now_s)
        }
        Err(error) => {
            tracing::warn!(cert = name, path = %path.display(), %error, "cannot read the certificate's expiry");
            None
        }
    }
}

/// Help text of every metric a replica serves (shown as `# HELP`).
const DESCRIPTIONS: &[(&str, &str)] = &[
    ("rota_is_leader", "1 while this replica leads"),
    ("rota_has_leader", "1 while this replica knows a leader"),
    ("rota_term", "Raft term"),
    ("rota_commit_index", "Highest log index known committed"),
    ("rota_applied_index", "Highest log index applied to the state"),
    ("rota_last_log_index", "Highest log index held"),
    ("rota_snapshot_index", "Last log index covered by the current snapshot"),
    ("rota_members", "Members of the Raft group, voters and learners"),
    ("rota_follower_lag_entries", "On the leader: log entries a follower does not hold yet"),
    ("rota_leader_changes_total", "Leader changes this replica saw (to none included)"),
    ("rota_certificate_expiry_seconds", "Seconds until the TLS certificate in use expires"),
    ("rota_applied_entries_total", "Log entries applied to the state"),
    ("rota_snapshot_build_seconds", "Time to build and persist a snapshot"),
    ("rota_snapshot_bytes", "Size of the last snapshot built"),
    ("rota_snapshot_last_success_timestamp_seconds", "Unix time of the last snapshot built"),
    ("rota_snapshot_failures_total", "Snapshots that failed to build or persist"),
    ("rota_state_lock_hold_seconds", "How long the state lock was held, by holder"),
    (
        "rota_log_sync_seconds",
        "Time to write and fsync appended Raft log entries (every commit waits for it on the leader and on a follower)",
    ),
    ("rota_raft_serve_seconds", "Time this replica took to answer a leader's AppendEntries, decode to answer, by kind: append_entries (with entries: includes its log sync), heartbeat"),
    ("rota_raft_rpc_seconds", "Round trip of an answered Raft call to a peer, by kind: append_entries (with entries: includes the peer's log sync), heartbeat, vote, install_snapshot"),
    (
        "rota_raft_streams_opened_total",
        "AppendEntries streams this replica opened as leader, by peer: one per follower while links hold, more when a link or a peer fails",
    ),
    ("rota_heartbeats_total", "Node heartbeats received"),
    ("rota_data_dir_free_bytes", "Free space in the data directory"),
    ("rota_alarms_raised", "Alarms raised in the cluster (no new work while any is)"),
    ("rota_request_duration_seconds", "Time to serve a request, by method"),
    ("rota_forwards_abandoned_total", "Requests forwarded to a leader that then fell silent, answered with try another replica"),
    ("rota_submits_total", "Job submits, by result"),
    ("rota_limited_total", "Requests refused by the caller limits, by reason"),
    ("rota_proposal_bytes", "Bytes of one proposed log entry"),
    ("rota_proposal_batch_size", "Commands batched into one log entry"),
    ("rota_plan_pass_seconds", "Time of one scheduling pass on the leader"),
    ("rota_planner_rest_seconds", "On the leader: the wait before the next scheduling pass, longer after a costly pass"),
    ("rota_planner_restarts_total", "Planner threads restarted"),
    ("rota_planner_panics_total", "Scheduling passes that panicked"),
    ("rota_job_wait_seconds", "On the leader: time from submit to placement, by queue"),
    ("rota_preemptions_total", "On the leader: allocations preempted by committed plans"),
    ("rota_allocs_never_started_total", "Allocations stopped because a rank never started"),
    ("rota_clock_skew_refusals_total", "Times this replica refused to lead for clock skew"),
    ("rota_nodes_declared_down_total", "Nodes the leader declared down"),
    ("rota_jobs_pending", "Pending jobs, by queue and group"),
    ("rota_gpus_pending", "GPUs asked for by pending jobs, by queue and group"),
    ("rota_job_oldest_pending_seconds", "Age of the oldest pending job, by queue"),
    ("rota_gpus_running", "GPUs held by live allocations, by group and model"),
    ("rota_gpus_idle", "GPUs of ranks their agents report idle, by group"),
    ("rota_table_held", "What the replicated state holds of each bounded table: live_jobs, finished_jobs, spec_bytes, nodes, queues, quotas"),
    ("rota_table_limit", "The bound of each table (`rota limits`): past it a submit or registration is refused"),
    ("rota_gpus", "GPUs by state: free, allocated, unhealthy (or fenced), down (on nodes not ready)"),
    ("rota_gpus_fenced", "GPUs not placeable for health: reported unhealthy or fenced"),
    ("rota_nodes", "Nodes by state"),
    ("rota_node_heartbeat_age_max_seconds", "Oldest last-heard age among ready nodes"),
    ("rota_quota_gpus", "Quota figures by group: limit, guarantee, used, borrowed, lendable, lent"),
    ("rota_budget_used_ratio", "GPU-hours used of the group's budget of the month (1 = spent), by group and month"),
    ("rota_archive_records_total", "Records of dropped finished jobs appended to this replica's monthly archive"),
    ("rota_archive_write_errors_total", "Failed appends or syncs of this replica's monthly archive"),
];

/// Give every metric its help text (once, after the exporter is installed).
pub fn describe() {
    for (name, help) in DESCRIPTIONS {
        // The Prometheus exporter keeps one help text per name, whatever
        // the kind it is described as.
        metrics::describe_gauge!(*name, *help);
    }
}
