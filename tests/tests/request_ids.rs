//! One client action, followed through the logs of every replica by its
//! request id: `rota --request-id ID submit` sent to a follower shows up in
//! the follower's log (forwarded), in the leader's (proposed and
//! committed), and in every replica's apply of the entry. Logs are JSON
//! lines (`--log-format json`), each one parseable on its own.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{rota_cli, wait_until};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

/// The JSON log lines of replica `id`; fails on a line that is not JSON.
fn log_lines(cluster: &LocalCluster, id: u64) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(cluster.replicas[&id].data_dir.join("server.log"))?;
    // The last line may be half written while we read.
    let complete = text.rsplit_once('\n').map_or("", |(done, _)| done);
    complete.lines().map(|line| serde_json::from_str(line).with_context(|| format!("replica {id}: not a JSON log line: {line}"))).collect()
}

/// The messages of replica `id`'s log lines made for request `request_id`.
fn messages_for(cluster: &LocalCluster, id: u64, request_id: &str) -> Result<Vec<String>> {
    let lines = log_lines(cluster, id)?;
    let named = |line: &Value| line["span"]["request_id"] == request_id || line["fields"]["request_id"] == request_id;
    Ok(lines.iter().filter(|line| named(line)).map(|line| line["fields"]["message"].as_str().unwrap_or_default().to_string()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_is_followed_through_every_replicas_log() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let env = vec![
        ("ROTA_LOG".to_string(), "info,openraft=warn,rota_server=debug".to_string()),
        ("ROTA_LOG_FORMAT".to_string(), "json".to_string()),
    ];
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions { env, ..ClusterOptions::default() })?;
    let leader = cluster.wait_leader(WAIT).await?;
    rota_e2e::wait_access_control(&cluster, WAIT).await?;
    let follower = (1..=3).find(|id| *id != leader).context("a follower")?;
    let other = (1..=3).find(|id| *id != leader && *id != follower).context("another follower")?;

    let id = "trace-e2e-1";
    let endpoint = cluster.replicas[&follower].addr.clone();
    let (status, stdout, stderr) =
        rota_cli(&cluster, &["--endpoints", &endpoint, "--request-id", id, "submit", "--group", "e2e", "--", "true"])?;
    ensure!(status.success(), "submit: {stderr}");
    ensure!(stdout.trim().parse::<u64>().is_ok(), "submit answers the job id: {stdout}");

    let forwarded = wait_until("the follower to log the forward", WAIT, || async {
        let messages = messages_for(&cluster, follower, id)?;
        Ok(messages.iter().any(|m| m.contains("forwarded")).then_some(messages))
    })
    .await?;
    let proposed = wait_until("the leader to log the proposal", WAIT, || async {
        let messages = messages_for(&cluster, leader, id)?;
        Ok(messages.iter().any(|m| m.contains("committed")).then_some(messages))
    })
    .await?;
    for replica in [leader, follower, other] {
        wait_until("every replica to log the apply", WAIT, || async {
            Ok(messages_for(&cluster, replica, id)?.iter().any(|m| m.contains("applied")).then_some(()))
        })
        .await
        .with_context(|| format!("replica {replica} (leader {leader}); follower logged {forwarded:?}, leader {proposed:?}"))?;
    }

    // A malformed id is refused by the CLI, naming the flag; a failed
    // command prints the id it used.
    let (status, _, stderr) = rota_cli(&cluster, &["--endpoints", &endpoint, "--request-id", "a b", "whoami"])?;
    ensure!(!status.success() && stderr.contains("--request-id"), "a malformed id is refused: {stderr}");
    let (status, _, stderr) = rota_cli(&cluster, &["--endpoints", &endpoint, "--request-id", "trace-e2e-2", "status", "999999"])?;
    ensure!(!status.success() && stderr.contains("request id: trace-e2e-2"), "a failure names its request id: {stderr}");
    for replica in 1..=3 {
        log_lines(&cluster, replica)?;
    }
    Ok(())
}
