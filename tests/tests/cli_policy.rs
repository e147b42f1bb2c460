//! The policy and the operator commands on a real cluster, through the `rota`
//! binary: `rota why` explains a pending job, `rota quota`/`queue`/`usage`
//! read and change the replicated settings, and `rota drill` moves the
//! leader (only with --confirm) and measures recovery.

use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::{rota_json, shell_job, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn why_quota_queue_usage_and_drill_on_a_live_cluster() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;

    // A 16-GPU gang on an 8-GPU cluster can never start: `rota why` says so.
    let job_id = any.submit(shell_job(2, 8, &marks, "exit 0")).await?.job_id;
    let why = wait_until("a pending reason", WAIT, || async {
        let why = rota_json(&cluster, &["why", &job_id.to_string()])?;
        let code = why["code"].as_str().unwrap_or("").to_string();
        Ok((!code.is_empty() && code != "new").then_some(why))
    })
    .await?;
    ensure!(why["state"] == "pending", "{why}");
    ensure!(why["reason"].as_str().is_some_and(|r| r.contains("16")), "the reason names the gang's size: {why}");

    // A job that fits runs; usage then shows its group.
    let small = any.submit(shell_job(1, 2, &marks, "exit 0")).await?.job_id;
    any.wait_job_state(small, pb::JobState::Succeeded, WAIT).await?;
    let usage = rota_json(&cluster, &["usage"])?;
    ensure!(usage.as_array().is_some_and(|lines| !lines.is_empty()), "usage lists groups: {usage}");

    let quotas = rota_json(&cluster, &["quota", "set", "vision", "--gpus", "4", "--lend", "--borrow-limit", "2"])?;
    let vision = quotas.as_array().and_then(|q| q.iter().find(|q| q["group"] == "vision")).cloned().context("quota listed")?;
    ensure!(vision["gpus"] == 4 && vision["lend"] == true && vision["borrow_limit"] == 2, "{vision}");
    // Every replica answers with the change just acknowledged: followers
    // forward the read to the leader, which confirms it still leads.
    for endpoint in cluster.endpoints_csv().split(',') {
        let output = Command::new(rota_bin()?)
            .args(cluster.cli_flags()?)
            .args(["--endpoints", endpoint, "--output", "json", "quota", "show"])
            .output()?;
        ensure!(output.status.success(), "quota show at {endpoint}: {}", String::from_utf8_lossy(&output.stderr));
        let shown: Value = serde_json::from_slice(&output.stdout)?;
        let seen = shown.as_array().and_then(|q| q.iter().find(|q| q["group"] == "vision")).cloned();
        ensure!(seen.is_some_and(|v| v["gpus"] == 4), "quota show at {endpoint}: {shown}");
    }
    let queues = rota_json(&cluster, &["queue", "set", "short", "--weight", "6"])?;
    let short = queues.as_array().and_then(|q| q.iter().find(|q| q["name"] == "short")).cloned().context("queue listed")?;
    ensure!(short["weight"] == 6 && short["max_gpus_per_job"] == 16, "only the weight changed: {short}");

    // The drill refuses without --confirm, then moves the leader and measures.
    let refused = Command::new(rota_bin()?).args(cluster.cli_flags()?).args(["--endpoints", &cluster.endpoints_csv(), "drill"]).output()?;
    ensure!(!refused.status.success(), "drill ran without --confirm");
    let leader = cluster.wait_leader(WAIT).await?;
    let drill = rota_json(&cluster, &["drill", "--confirm"])?;
    ensure!(drill["leader_before"] == leader && drill["leader_after"] != leader, "{drill}");
    ensure!(drill["submits_ok_ms"].as_u64().is_some_and(|ms| ms < 60_000), "{drill}");
    ensure!(drill["first_schedule_ms"].as_u64().is_some(), "the new leader scheduled the probe: {drill}");
    Ok(())
}
