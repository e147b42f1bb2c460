//! Allocated-but-idle GPUs end to end, on 3 replicas and one agent with 8
//! fake H100s whose `fake-utilization` file says every GPU is at 0 %, and an
//! idle window of 300 ms (`--idle-after-ms`):
//!
//! - under the training queue's `flag` rule (idle after 2 s), the job is
//!   flagged: `rota jobs --idle` lists it, the event `job_idle_flagged` is
//!   derived, `rota_gpus_idle{group}` counts its GPUs, `rota nodes` shows
//!   the GPUs' utilization;
//! - the leader is killed while the job is idle: the new leader hears the
//!   same idle reports and the committed idle time and flag time stay
//!   (the clock is not reset by a leader change);
//! - the queue is switched to `reclaim`: the job is stopped with the reason
//!   `idle_reclaimed` and ends failed (`rota status` says why).

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_client::events::{EventFollower, Followed};
use rota_client::Client;
use rota_e2e::{list_nodes, rota_cli, rota_json, scrape_metrics, shell_job, wait_access_control, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

/// The job as `rota jobs --idle` lists it, if it does.
fn listed_idle(cluster: &LocalCluster, job_id: u64) -> Result<Option<serde_json::Value>> {
    let listed = rota_json(cluster, &["jobs", "--idle"])?;
    let jobs = listed["jobs"].as_array().context("a jobs array")?;
    Ok(jobs.iter().find(|j| j["id"] == job_id).cloned())
}

/// Follow the event stream from the start until the job's
/// `job_idle_flagged` event has come.
async fn idle_flagged_event(cluster: &LocalCluster, job_id: u64) -> Result<pb::Event> {
    let client = Client::new(&cluster.endpoints(), cluster.security())?;
    let mut follower = EventFollower::new(client, 0, vec!["jobs".into()]);
    loop {
        match tokio::time::timeout(WAIT, follower.next()).await.context("no job_idle_flagged event")?? {
            Followed::Events(events) => {
                if let Some(event) = events.into_iter().find(|e| e.kind == "job_idle_flagged" && e.job_id == job_id) {
                    return Ok(event);
                }
            }
            Followed::Compacted(compacted) => bail!("compacted: {compacted:?}"),
        }
    }
}

/// `rota_gpus_idle{group="GROUP"}`'s value in one replica's scrape.
fn idle_gauge(scrape: &str, group: &str) -> Option<f64> {
    let prefix = format!("rota_gpus_idle{{group=\"{group}\"}} ");
    scrape.lines().find_map(|line| line.strip_prefix(&prefix)).and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_job_is_flagged_keeps_its_idle_clock_through_a_leader_kill_and_is_reclaimed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_until("the newest cluster version (idle records)", WAIT, || async {
        Ok(cluster.status(leader).await.filter(|s| s.cluster_version == s.format_version && s.format_version >= 8).map(|_| ()))
    })
    .await?;
    wait_access_control(&cluster, WAIT).await?;
    let options = AgentOptions { extra_args: vec!["--idle-after-ms".into(), "300".into()], ..AgentOptions::default() };
    let agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), options)?;
    let quiet: String = (0..8).map(|gpu| format!("{gpu} 0\n")).collect();
    std::fs::write(agent.data_dir.join("fake-utilization"), quiet)?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    // The README's commands: flag jobs idle for 2 s in the training queue.
    let queues = rota_json(&cluster, &["queue", "set", "training", "--idle-after", "2s", "--idle-action", "flag"])?;
    let training = queues.as_array().and_then(|q| q.iter().find(|q| q["name"] == "training")).context("training listed")?;
    ensure!(training["idle_after_ms"] == 2_000 && training["idle_action"] == "flag", "{training}");

    let any = AnyReplica::new(&cluster)?;
    let job_id = any.submit(shell_job(1, 2, &marks, "exec sleep 600")).await?.job_id;
    any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;
    let flagged = wait_until("the job listed by rota jobs --idle", WAIT, || async { listed_idle(&cluster, job_id) }).await?;
    let (since, flagged_at) = (flagged["idle_since_ms"].as_u64().unwrap_or(0), flagged["idle_flagged_ms"].as_u64().unwrap_or(0));
    ensure!(since > 0 && flagged_at >= since + 2_000, "flagged 2 s after it turned idle: {flagged}");
    let (_, table, _) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "jobs", "--idle"])?;
    ensure!(table.contains("IDLE SINCE") && table.contains(&format!("{job_id:>8}")), "rota jobs --idle:\n{table}");

    let event = idle_flagged_event(&cluster, job_id).await?;
    ensure!(event.reason.starts_with("idle since ") && event.group == "e2e", "{event:?}");
    let leader = cluster.wait_leader(WAIT).await?;
    let metrics_addr = cluster.replicas[&leader].metrics_addr.clone();
    wait_until("rota_gpus_idle counting the job's 2 GPUs", WAIT, || async {
        Ok((idle_gauge(&scrape_metrics(&metrics_addr)?, "e2e") == Some(2.0)).then_some(()))
    })
    .await?;
    let (_, nodes, _) = rota_cli(&cluster, &["--endpoints", &cluster.replicas[&leader].addr, "nodes"])?;
    ensure!(nodes.contains("util   0%"), "rota nodes shows the leader's telemetry:\n{nodes}");

    // Kill the leader while the job is idle: the new leader hears the same
    // reports, and the committed idle and flag times stay.
    cluster.kill(leader)?;
    let new_leader =
        wait_until("a new leader", WAIT, || async { Ok(cluster.wait_leader(WAIT).await.ok().filter(|id| *id != leader)) }).await?;
    wait_until("the agent heard by the new leader", WAIT, || async {
        let nodes = list_nodes(&cluster, new_leader).await?;
        Ok(nodes.iter().flat_map(|n| &n.gpus).any(|g| g.utilization_percent.is_some()).then_some(()))
    })
    .await?;
    // Past the flag time again under the new leader (plans and heartbeats ran).
    let heard_at = cluster.status(new_leader).await.context("status")?.applied_index;
    wait_until("a few entries under the new leader", WAIT, || async {
        Ok(cluster.status(new_leader).await.filter(|s| s.applied_index >= heard_at + 3).map(|_| ()))
    })
    .await?;
    let after = listed_idle(&cluster, job_id)?.context("still listed as idle after the leader kill")?;
    ensure!(after["idle_since_ms"] == since && after["idle_flagged_ms"] == flagged_at, "the idle clock was reset: {flagged} then {after}");
    cluster.restart(leader)?;

    // Reclaim: the job is stopped with idle_reclaimed and ends failed.
    rota_json(&cluster, &["queue", "set", "training", "--idle-action", "reclaim"])?;
    let ended = any.wait_job_state(job_id, pb::JobState::Failed, WAIT).await?;
    ensure!(ended.stop_reason == "idle_reclaimed" && ended.reason_code == "idle_reclaimed", "{ended:?}");
    ensure!(ended.idle_gpu_ms >= 2 * 2_000, "its idle GPU-time is kept: {ended:?}");
    let (_, status, _) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "status", &job_id.to_string()])?;
    ensure!(status.contains("stop reason idle_reclaimed") && status.contains("reason: idle_reclaimed"), "rota status:\n{status}");
    let why = rota_json(&cluster, &["why", &job_id.to_string()])?;
    ensure!(why["code"] == "idle_reclaimed", "rota why: {why}");
    ensure!(listed_idle(&cluster, job_id)?.is_none(), "an ended job is no longer idle");
    // Its history record carries the same idle GPU-time (reports sum it).
    let history = rota_json(&cluster, &["history", "--limit", "10"])?;
    let record = history["records"].as_array().into_iter().flatten().find(|r| r["job_id"] == job_id).context("no history record")?;
    ensure!(record["idle_gpu_ms"] == ended.idle_gpu_ms, "history says {record}, the job {}", ended.idle_gpu_ms);
    drop(agent);
    Ok(())
}
