//! Backup and restore: `rota snapshot save` takes the leader's state with
//! everything acknowledged before it; `rota snapshot restore` builds the
//! data directories of a NEW cluster from it (a new cluster id), which
//! holds every job acknowledged before the save. A corrupt file is refused
//! naming what is wrong, and a replica of a restored cluster can never
//! join the cluster the backup came from.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{free_port, ClusterOptions, LocalCluster};
use rota_e2e::servers::{status_at, wait_agreed_leader, Server};
use rota_e2e::{rota_cli, rota_json, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_client::JobServiceClient;

const WAIT: Duration = Duration::from_secs(30);

/// A job, asked until the leader answers (a new leader first checks its clock).
async fn get_job(jobs: &JobServiceClient<tonic::transport::Channel>, job_id: u64) -> Result<pb::Job> {
    wait_until(&format!("job {job_id}"), WAIT, || {
        let mut jobs = jobs.clone();
        async move { Ok(jobs.get_job(pb::GetJobRequest { job_id }).await.ok().and_then(|r| r.into_inner().job)) }
    })
    .await
}

fn restore(
    cluster: &LocalCluster,
    file: &Path,
    data_dir: &Path,
    id: u64,
    peers: &str,
    cluster_id: Option<&str>,
) -> Result<serde_json::Value> {
    let mut args = vec!["snapshot", "restore", file.to_str().context("utf-8 path")?, "--id"];
    let id = id.to_string();
    args.push(&id);
    args.extend(["--peers", peers, "--output", "json", "--data-dir", data_dir.to_str().context("utf-8 path")?]);
    if let Some(cluster_id) = cluster_id {
        args.extend(["--cluster-id", cluster_id]);
    }
    let (status, stdout, stderr) = rota_cli(cluster, &args)?;
    ensure!(status.success(), "restore of replica {id} failed: {stderr}");
    Ok(serde_json::from_str(&stdout)?)
}

/// Refused restores: exit non-zero, and the message.
fn refused_restore(cluster: &LocalCluster, file: &Path, data_dir: &Path) -> Result<String> {
    let args = [
        "snapshot",
        "restore",
        file.to_str().context("utf-8")?,
        "--id",
        "1",
        "--peers",
        "1=127.0.0.1:1",
        "--data-dir",
        data_dir.to_str().context("utf-8")?,
    ];
    let (status, _, stderr) = rota_cli(cluster, &args)?;
    ensure!(!status.success(), "a bad file is refused");
    Ok(stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_cluster_holds_every_job_acknowledged_before_the_save() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let acked = AnyReplica::new(&cluster)?.submit_many("before-save", 40).await?;

    let file = dir.path().join("backup.rota");
    let saved = rota_json(&cluster, &["snapshot", "save", file.to_str().context("utf-8")?])?;
    let old_cluster_id = saved["cluster_id"].as_str().unwrap_or_default().to_string();
    ensure!(!old_cluster_id.is_empty(), "a founded cluster has an id: {saved}");
    ensure!(saved["index"].as_u64().unwrap_or(0) > 0 && saved["sha256"].as_str().is_some_and(|s| s.len() == 64), "{saved}");

    // Corrupt copies are refused before anything is written.
    let bytes = std::fs::read(&file)?;
    let mut flipped = bytes.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x40;
    let corrupt = dir.path().join("corrupt.rota");
    std::fs::write(&corrupt, &flipped)?;
    let untouched = dir.path().join("untouched");
    let why = refused_restore(&cluster, &corrupt, &untouched)?;
    ensure!(why.contains("checksum mismatch"), "names the checksum: {why}");
    std::fs::write(&corrupt, &bytes[..bytes.len() - 100])?;
    let why = refused_restore(&cluster, &corrupt, &untouched)?;
    ensure!(why.contains("checksum mismatch") || why.contains("truncated"), "a truncated file: {why}");
    std::fs::write(&corrupt, b"not a backup at all, just some text")?;
    ensure!(refused_restore(&cluster, &corrupt, &untouched)?.contains("not a rota backup"));
    ensure!(!untouched.join("identity.json").exists(), "nothing written from a bad file");

    // Stop the old cluster by PID and wipe its data.
    for id in 1..=3 {
        cluster.kill(id)?;
        std::fs::remove_dir_all(cluster.replicas[&id].data_dir.join("db"))?;
    }

    let addrs: Vec<String> = (0..3).map(|_| Ok(format!("127.0.0.1:{}", free_port()?))).collect::<Result<_>>()?;
    let peers = addrs.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect::<Vec<_>>().join(",");
    let data_dir = |id: u64| dir.path().join(format!("restored-{id}"));
    let first = restore(&cluster, &file, &data_dir(1), 1, &peers, None)?;
    let new_cluster_id = first["cluster_id"].as_str().context("the new cluster id")?.to_string();
    ensure!(new_cluster_id != old_cluster_id, "a restored cluster has a new id");
    ensure!(first["jobs"].as_u64() == Some(acked.len() as u64), "every acknowledged job is in the backup: {first}");
    for id in [2, 3] {
        restore(&cluster, &file, &data_dir(id), id, &peers, Some(&new_cluster_id))?;
    }
    let servers: Vec<Server> =
        (1..=3u64).map(|id| Server::start(&cluster.pki, id, &addrs[id as usize - 1], &data_dir(id), &peers, &[])).collect::<Result<_>>()?;
    let refs: Vec<&Server> = servers.iter().collect();
    let status = wait_agreed_leader(cluster.security(), &refs, WAIT).await?;
    ensure!(status.cluster_id == new_cluster_id, "the restored replicas carry the new id: {status:?}");
    ensure!(status.members.len() == 3, "three members: {status:?}");

    let leader = servers.iter().find(|s| s.id == status.leader_id).context("the leader")?;
    let jobs = JobServiceClient::new(cluster.channel(&leader.addr)?);
    for (request_id, job_id) in &acked {
        let job = get_job(&jobs, *job_id).await?;
        ensure!(job.request_id == *request_id, "job {job_id} restored as {request_id}");
    }
    // The restored cluster takes new work, after the restored jobs.
    let next = wait_until("a submit to the restored cluster", WAIT, || {
        let mut jobs = jobs.clone();
        async move { Ok(jobs.submit_job(rota_e2e::submit_request("after-restore")).await.ok().map(|r| r.into_inner())) }
    })
    .await?;
    ensure!(acked.iter().all(|(_, id)| *id < next.job_id), "new ids continue after the restored ones");
    Ok(())
}

/// Prevents a restored cluster and its original from mixing. Without the
/// cluster-id checks (the build of commit 6c59791, run on data directories
/// made by this one: the original's, and a replica restored from its
/// backup), `rota member add` made the restored replica a voter of the
/// original (exit 0, members 1 2 3 4), with its own state and log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_of_a_restored_cluster_cannot_join_the_original() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    AnyReplica::new(&cluster)?.submit_many("original", 10).await?;
    let file = dir.path().join("backup.rota");
    rota_json(&cluster, &["snapshot", "save", file.to_str().context("utf-8")?])?;

    // A one-member restored cluster, replica 4, running beside the original.
    let addr = format!("127.0.0.1:{}", free_port()?);
    let peers = format!("4={addr}");
    let restored_dir = dir.path().join("restored-4");
    restore(&cluster, &file, &restored_dir, 4, &peers, None)?;
    let restored = Server::start(&cluster.pki, 4, &addr, &restored_dir, &peers, &[])?;
    let status = wait_agreed_leader(cluster.security(), &[&restored], WAIT).await?;
    let original = cluster.wait_applied(leader, 0, WAIT).await.context("the original's status")?;
    ensure!(status.cluster_id != original.cluster_id && !original.cluster_id.is_empty(), "{status:?} vs {original:?}");

    let (exit, _, stderr) =
        rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "--timeout-s", "15", "member", "add", "4", &addr])?;
    ensure!(!exit.success(), "the original refuses a replica of another cluster");
    ensure!(stderr.contains("belongs to cluster"), "and says why: {stderr}");
    let after = cluster.wait_applied(leader, 0, WAIT).await.context("the original's status")?;
    let members: BTreeSet<u64> = after.members.iter().map(|m| m.id).collect();
    ensure!(members == BTreeSet::from([1, 2, 3]), "membership unchanged: {members:?}");
    ensure!(status_at(cluster.security(), &addr).await.is_some_and(|s| s.leader_id == 4), "the restored cluster carries on alone");
    Ok(())
}
