//! `rota drill`: an operator's failover drill against a running cluster. It
//! asks a follower to campaign (no process is stopped), then measures from
//! outside how long until the new leader is agreed on, until submits succeed
//! again, and until the new leader has made a scheduling decision.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rota_proto::v1 as pb;
use serde_json::json;

use crate::{cluster_status, random_request_id};
use rota_client::Client;

const POLL_MS: u64 = 10;

#[derive(Debug, clap::Args)]
pub struct DrillArgs {
    /// Required: the drill moves the leader of a live cluster.
    #[arg(long)]
    pub confirm: bool,
    /// Replica that should lead next (default: the most caught-up follower).
    #[arg(long)]
    pub to: Option<u64>,
    /// Give up waiting after this long.
    #[arg(long, default_value_t = 30)]
    pub wait_s: u64,
}

pub async fn run(client: &Client, args: &DrillArgs) -> Result<serde_json::Value> {
    if !args.confirm {
        bail!("rota drill moves the leader of a live cluster; run it again with --confirm");
    }
    let before = cluster_status(client).await?;
    if before.leader_id == 0 {
        bail!("the cluster has no leader now; nothing to drill");
    }
    let target = pick_target(&before, args.to)?;
    let endpoint = client
        .endpoints()
        .iter()
        .position(|e| *e == target.address)
        .with_context(|| format!("replica {} ({}) is not among --endpoints; add it", target.id, target.address))?;
    let deadline = Duration::from_secs(args.wait_s);
    let started = Instant::now();
    client
        .cluster_at(endpoint)
        .campaign(pb::CampaignRequest { replica_id: target.id })
        .await
        .with_context(|| format!("asking replica {} to campaign", target.id))?;
    let (new_leader, leader_ms) = wait_new_leader(client, before.leader_id, before.term, started, deadline).await?;
    let (job_id, submit_ms) = submit_probe(client, started).await?;
    let schedule_ms = wait_scheduled(client, job_id, started, deadline).await;
    cancel_probe(client, job_id).await;
    Ok(json!({
        "leader_before": before.leader_id,
        "term_before": before.term,
        "leader_after": new_leader.leader_id,
        "term_after": new_leader.term,
        "leader_elected_ms": leader_ms,
        "submits_ok_ms": submit_ms,
        "first_schedule_ms": schedule_ms,
        "probe_job": job_id,
    }))
}

fn pick_target(status: &pb::ClusterStatus, to: Option<u64>) -> Result<pb::Member> {
    let followers = status.members.iter().filter(|m| m.role == "follower");
    let target = match to {
        Some(id) => followers.clone().find(|m| m.id == id).with_context(|| format!("--to {id}: not a follower"))?,
        None => followers.max_by_key(|m| m.matched_index).context("no follower to take over")?,
    };
    Ok(target.clone())
}

async fn wait_new_leader(
    client: &Client,
    old: u64,
    old_term: u64,
    started: Instant,
    deadline: Duration,
) -> Result<(pb::ClusterStatus, u64)> {
    while started.elapsed() < deadline {
        if let Ok(status) = cluster_status(client).await {
            if status.leader_id != 0 && status.leader_id != old && status.term > old_term {
                return Ok((status, started.elapsed().as_millis() as u64));
            }
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    bail!("leadership did not move within {deadline:?}")
}

/// A one-GPU job in the short queue; its ack shows submits work again.
async fn submit_probe(client: &Client, started: Instant) -> Result<(u64, u64)> {
    let spec = pb::JobSpec {
        name: "drill-probe".into(),
        group: "drill".into(),
        queue: "short".into(),
        replicas: 1,
        gpus_per_replica: 1,
        command: vec!["true".into()],
        ..Default::default()
    };
    let request = pb::SubmitJobRequest { spec: Some(spec), request_id: random_request_id(), ..Default::default() };
    let response = client.submit_job(&request).await?;
    Ok((response.job_id, started.elapsed().as_millis() as u64))
}

/// Time until the probe job was placed, if the cluster has room for it.
async fn wait_scheduled(client: &Client, job_id: u64, started: Instant, deadline: Duration) -> Option<u64> {
    while started.elapsed() < deadline {
        if let Ok(job) = crate::get_job(client, job_id).await {
            if job.started_at_ms > 0 {
                return Some(started.elapsed().as_millis() as u64);
            }
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    None
}

async fn cancel_probe(client: &Client, job_id: u64) {
    let _ = client.cancel_job(job_id).await;
}
