//! A replica that hangs (SIGSTOP: the kernel still accepts its connections,
//! nothing answers) listed first in a client's endpoints. A fresh `rota`
//! process hedges an idempotent call: unanswered after a moment, it is also
//! sent to the next replica, and the first answer wins. It then remembers
//! the replica that answered, so the next process starts there.
//!
//! The CLI's deadline here (1 s) is what an attempt on the hung replica
//! takes to fail (its connect timeout): a client that waits for that
//! attempt gives up before it tries another replica, and only a hedged call
//! succeeds. Without hedging, the first submit failed with "gave up after
//! 1001 ms and 1 attempts".

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::wait_access_control;

const WAIT: Duration = Duration::from_secs(60);

/// `rota --endpoints ENDPOINTS --timeout-s 1 --output json ARGS` with its own cache home.
fn rota(cluster: &LocalCluster, cache: &std::path::Path, endpoints: &str, args: &[&str]) -> Result<serde_json::Value> {
    let output = std::process::Command::new(rota_bin()?)
        .args(cluster.cli_flags()?)
        .env("XDG_CACHE_HOME", cache)
        .args(["--endpoints", endpoints, "--timeout-s", "1", "--output", "json"])
        .args(args)
        .output()
        .context("running rota")?;
    ensure!(output.status.success(), "rota {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).with_context(|| format!("rota {args:?} printed {:?}", String::from_utf8_lossy(&output.stdout)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_clients_get_past_a_hung_first_replica_and_remember_who_answered() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let hung_id = (1..=3).find(|id| *id != leader).context("a follower")?;
    let hung = cluster.replicas[&hung_id].addr.clone();
    let mut endpoints = vec![hung.clone()];
    endpoints.extend(cluster.endpoints().into_iter().filter(|e| *e != hung));
    let endpoints = endpoints.join(",");
    let cache = dir.path().join("cache");
    let memory = cache.join("rota").join("last-endpoint");

    cluster.pause(hung_id)?;
    let first = rota(&cluster, &cache, &endpoints, &["submit", "--group", "e2e", "--", "true"])?;
    let job_id = first["job_id"].as_u64().context("submit answers a job id")?;
    let remembered = std::fs::read_to_string(&memory).context("the CLI remembers who answered")?;
    ensure!(remembered.starts_with(&format!("{endpoints} ")), "the line is keyed by the endpoint list: {remembered:?}");
    ensure!(!remembered.trim_end().ends_with(&hung), "the hung replica is not remembered: {remembered:?}");

    // Reads hedge too, and later processes start at the remembered replica.
    let job = rota(&cluster, &cache, &endpoints, &["status", &job_id.to_string()])?;
    ensure!(job["id"].as_u64() == Some(job_id), "status names the job: {job}");
    for _ in 0..3 {
        rota(&cluster, &cache, &endpoints, &["submit", "--group", "e2e", "--", "true"])?;
    }
    let listed = rota(&cluster, &cache, &endpoints, &["jobs"])?;
    let count = listed["jobs"].as_array().map_or(0, Vec::len);
    ensure!(count >= 4, "the four submits are listed: {listed}");
    cluster.resume(hung_id)?;
    Ok(())
}
