//! The bounds of the replicated tables (`rota limits`), end to end: a
//! 3-replica TLS cluster with its founding admin and a plain user.
//!
//! - Everyone may read the bounds; bad values are refused naming the
//!   field, a user's change is refused, and neither changes anything.
//! - The admin lowers the live and finished bounds: a submit past the live
//!   bound is refused, and the oldest finished job leaves the state.
//! - A follower killed and restarted replays the log from its start: made
//!   leader, it holds the bounds the log set and the same finished job.
//!   Before the bounds were in the log, each replica took the finished
//!   bound from its own `--keep-finished-jobs`, so a replica restarted
//!   with another value replayed the same log to other jobs.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::users::UserCli;
use rota_e2e::{wait_access_control, wait_until};
use rota_proto::v1 as pb;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

fn submit(rota: &UserCli) -> Result<std::process::Output> {
    rota.run("harness", &["submit", "--group", "e2e", "--", "true"])
}

fn job_ids(rota: &UserCli) -> Result<Vec<u64>> {
    let listed = rota.ok("harness", &["jobs"])?;
    let jobs = listed["jobs"].as_array().with_context(|| format!("no jobs in {listed}"))?;
    Ok(jobs.iter().filter_map(|job| job["id"].as_u64()).collect())
}

fn bound(limits: &Value, table: &str) -> (u64, u64) {
    (limits[table]["held"].as_u64().unwrap_or(u64::MAX), limits[table]["max"].as_u64().unwrap_or(u64::MAX))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bounds_change_only_through_the_log_and_survive_a_replay() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let rota = UserCli::new(&cluster, &["alice"])?;
    wait_until("cluster version 13 or later", WAIT, || async {
        Ok(rota.ok("harness", &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(13)).map(|_| ()))
    })
    .await?;
    rota.ok("harness", &["auth", "user", "add", "alice", "--role", "user", "--groups", "e2e"])?;

    let shown = rota.ok("alice", &["limits", "show"])?;
    ensure!(bound(&shown, "live_jobs") == (0, 200_000), "the default live bound: {shown}");
    ensure!(bound(&shown, "finished_jobs") == (0, 100_000), "the default finished bound: {shown}");
    rota.refused("harness", &["limits", "set", "--max-live-jobs", "0"], &["max_live_jobs", "1..="])?;
    rota.refused("harness", &["limits", "set", "--max-spec-bytes", "10"], &["max_spec_bytes"])?;
    rota.refused("harness", &["limits", "set"], &["at least one"])?;
    rota.refused("alice", &["limits", "set", "--max-live-jobs", "5"], &["permission denied"])?;
    ensure!(rota.ok("alice", &["limits", "show"])? == shown, "refused changes changed nothing");

    let set = rota.ok("harness", &["limits", "set", "--max-live-jobs", "2", "--max-finished-jobs", "1"])?;
    ensure!(bound(&set, "live_jobs") == (0, 2) && bound(&set, "finished_jobs") == (0, 1), "the new bounds: {set}");
    for _ in 0..2 {
        let output = submit(&rota)?;
        ensure!(output.status.success(), "a submit within the bound: {}", String::from_utf8_lossy(&output.stderr));
    }
    let refused = submit(&rota)?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(!refused.status.success() && stderr.contains("live jobs"), "a third live job is refused: {stderr}");
    let mut ids = job_ids(&rota)?;
    ensure!(ids.len() == 2, "two jobs held: {ids:?}");
    // Oldest first: the finished bound keeps the job that ended last.
    ids.sort_unstable();
    for id in &ids {
        rota.ok("harness", &["cancel", &id.to_string()])?;
    }
    let newest = *ids.iter().max().context("a job")?;
    wait_until("one finished job kept", WAIT, || async { Ok((job_ids(&rota)? == vec![newest]).then_some(())) }).await?;

    // Restart a follower: it replays the whole log (no snapshot yet), the
    // change of bounds included, then leads.
    let leader = cluster.wait_leader(WAIT).await?;
    let follower = (1..=3).find(|id| *id != leader).context("a follower")?;
    let applied = cluster.status(leader).await.context("the leader's status")?.applied_index;
    cluster.kill(follower)?;
    cluster.restart(follower)?;
    cluster.wait_applied(follower, applied, WAIT).await?;
    let restarted = cluster.cluster_client(follower)?;
    wait_until("the restarted replica to lead", WAIT, || {
        let mut restarted = restarted.clone();
        async move {
            let status = restarted.get_cluster_status(pb::GetClusterStatusRequest {}).await;
            if status.is_ok_and(|s| s.into_inner().leader_id == follower) {
                return Ok(Some(()));
            }
            let _ = restarted.campaign(pb::CampaignRequest { replica_id: follower }).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok(None)
        }
    })
    .await?;
    let replayed = rota.ok("harness", &["limits", "show"])?;
    ensure!(bound(&replayed, "live_jobs") == (0, 2), "the replayed live bound: {replayed}");
    ensure!(bound(&replayed, "finished_jobs") == (1, 1), "the replayed finished bound: {replayed}");
    ensure!(job_ids(&rota)? == vec![newest], "the restarted leader keeps the same finished job");
    Ok(())
}
