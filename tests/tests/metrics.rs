//! Every replica serves Prometheus metrics: leadership, term, indexes,
//! leader changes, submits and request latency histograms, and (followers
//! too) the scheduling gauges of the applied state.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{scrape_metrics as scrape, submit_request, wait_until, AnyReplica};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_serve_prometheus_metrics() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    AnyReplica::new(&cluster)?.submit(submit_request("metrics-1")).await?;
    let addr = cluster.replicas[&leader].metrics_addr.clone();
    let text = wait_until("leader metrics", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { Ok(scrape(&addr).ok().filter(|t| t.contains("rota_is_leader 1"))) }
    })
    .await?;
    for name in [
        "rota_term",
        "rota_commit_index",
        "rota_applied_index",
        "rota_leader_changes_total",
        "rota_submits_total{result=\"created\"} 1",
        "rota_request_duration_seconds_bucket{method=\"submit_job\"",
        "rota_state_lock_hold_seconds_bucket{kind=\"apply\"",
        "rota_state_lock_hold_seconds_bucket{kind=\"read\"",
    ] {
        ensure!(text.contains(name), "metrics lack {name}:\n{text}");
    }
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    let follower_text = scrape(&cluster.replicas[&follower].metrics_addr)?;
    ensure!(follower_text.contains("rota_is_leader 0"), "a follower says it leads");
    // The scheduling gauges come from the applied state on every replica,
    // followers included (within a second of start).
    let follower_addr = cluster.replicas[&follower].metrics_addr.clone();
    wait_until("a follower's scheduling gauges", Duration::from_secs(30), || {
        let addr = follower_addr.clone();
        async move {
            let text = scrape(&addr)?;
            let wanted = [
                "rota_gpus{state=\"free\"} 0",
                "rota_nodes{state=\"ready\"} 0",
                "rota_job_oldest_pending_seconds{queue=\"training\"}",
                "rota_jobs_pending{queue=\"training\",group=\"e2e\"} 1",
                "rota_gpus_fenced 0",
                "rota_snapshot_index",
                "rota_applied_entries_total",
                "# HELP rota_jobs_pending",
            ];
            Ok(wanted.iter().all(|w| text.contains(w)).then_some(()))
        }
    })
    .await?;
    Ok(())
}
