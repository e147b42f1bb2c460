//! A rank assigned to a node whose agent never reports it started (its
//! exec wedged, its records refused, its reports lost) must not hold its
//! GPUs and its job `running` for good: past `--start-timeout-ms` the
//! leader stops the allocation (`never_started`); the GPUs are freed, and the job
//! requeued, only once the agent is known not to run the rank (it reports
//! the rank ended, as an agent does for a stop of a rank it never started).
//!
//! The test acts as the node's agent itself: it registers, heartbeats and
//! watches its assignments, and never starts the rank.
//!
//! Failed on commit 7bf3673 with the leader's start-timeout pass switched
//! off (the flag still accepted) with "the never-started rank was never
//! stopped": the job stayed `running` with no rank started.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{fake_registration, spec, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_tls::IdentityKind;

const WAIT: Duration = Duration::from_secs(30);
const START_TIMEOUT_MS: u64 = 1_500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_never_started_is_stopped_and_its_gpus_freed_only_once_its_agent_reports_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { start_timeout_ms: Some(START_TIMEOUT_MS), ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    // The stop has its own reason from cluster version 10 on (`node_lost` before).
    wait_until("cluster version 10 or later", WAIT, || async {
        Ok(cluster.status(leader).await.filter(|s| s.cluster_version >= 10).map(|_| ()))
    })
    .await?;
    let as_n1 = cluster.security_of(IdentityKind::Agent, "n1")?;
    let mut agent = AgentServiceClient::new(channel(&cluster.replicas[&leader].addr, &as_n1)?);
    agent.register_node(fake_registration("n1", 8)).await?;
    // Heartbeats keep the node up: only the start is missing.
    let heartbeats = {
        let mut agent = agent.clone();
        tokio::spawn(async move {
            loop {
                let _ = agent.heartbeat(pb::HeartbeatRequest { node: "n1".into(), ..Default::default() }).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let any = AnyReplica::new(&cluster)?;
    let request = pb::SubmitJobRequest {
        spec: Some(pb::JobSpec { gpus_per_replica: 8, ..spec() }),
        request_id: "never-started".into(),
        ..Default::default()
    };
    let job_id = any.submit(request).await?.job_id;
    any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;

    // The assignment arrives, then (past the timeout) its stop.
    let mut watch = agent.watch_assignments(pb::WatchAssignmentsRequest { node: "n1".into(), after_index: 0 }).await?.into_inner();
    let stopped = tokio::time::timeout(WAIT, async {
        loop {
            let set = watch.message().await?.context("the watch ended")?;
            if let Some(rank) = set.ranks.iter().find(|r| r.job_id == job_id && !r.stop_reason.is_empty()) {
                return anyhow::Ok(rank.clone());
            }
        }
    })
    .await
    .context("the never-started rank was never stopped")??;
    ensure!(stopped.stop_reason == "never_started", "stopped as never started: {:?}", stopped.stop_reason);
    let job = any.get(job_id).await?;
    ensure!(job.state == pb::JobState::Stopping as i32, "the job waits for its agent: {job:?}");
    let nodes = rota_e2e::list_nodes(&cluster, leader).await?;
    let held = nodes.iter().flat_map(|n| n.gpus.iter()).filter(|g| g.job_id == job_id).count();
    ensure!(held == 8, "the GPUs stay held until the agent says the rank is not running: {held} held");

    // The agent reports the rank ended without running: the GPUs are freed
    // and the job placed again.
    let exited = pb::RankExited { exit_code: 0, reason: stopped.stop_reason.clone() };
    let event = pb::RankEvent {
        alloc_id: stopped.alloc_id,
        attempt: stopped.attempt,
        rank: stopped.rank,
        kind: Some(pb::rank_event::Kind::Exited(exited)),
    };
    agent.report_rank_events(pb::ReportRankEventsRequest { node: "n1".into(), events: vec![event], ..Default::default() }).await?;
    let again = wait_until("the job to be placed again", WAIT, || async {
        let job = any.get(job_id).await?;
        Ok((job.attempts >= 2).then_some(job))
    })
    .await?;
    ensure!(again.state != pb::JobState::Failed as i32, "requeued, not failed: {again:?}");
    heartbeats.abort();
    Ok(())
}
