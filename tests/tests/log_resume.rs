//! `rota logs -f` through the loss of the replica relaying the stream: a
//! 3-replica TLS cluster and one fake-GPU agent; a rank prints numbered
//! lines for a few seconds while `rota logs -f` follows it through a
//! follower, which is SIGKILLed mid-stream. The command opens the stream
//! again through another replica from the bytes it has printed, and its
//! output is the rank's whole log, each line once, in order. Before that,
//! the same follow with its standard output closed ends quietly.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::{check_ends_quietly_on_a_closed_pipe, rota_cli, shell_job, wait_access_control, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const LINES: usize = 400;

/// Before `rota logs` resumed, the kill ended the command (exit status 1,
/// "job 1 rank 0: h2 protocol error: error reading a body from
/// connection") after 25 of the 400 lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_follow_resumes_where_it_broke_when_its_replica_is_killed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_access_control(&cluster, WAIT).await?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let script = format!("i=1; while [ $i -le {LINES} ]; do echo line-$i; i=$((i + 1)); sleep 0.02; done");
    let job = any.submit(shell_job(1, 1, &marks, &script)).await?.job_id;
    any.wait_job_state(job, pb::JobState::Running, WAIT).await?;
    // The rank has a log on its node (before, the agent answers NOT_FOUND, for good).
    wait_until("the rank's first line", WAIT, || async {
        let (_, printed, _) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "logs", &job.to_string()])?;
        Ok(printed.starts_with("line-1\n").then_some(()))
    })
    .await?;

    // A reader that stops early (`rota logs -f JOB | head -1`) ends the
    // follow quietly with success: the first chunk's write finds the pipe
    // closed. Before, it ended with "Error: Broken pipe" and exit status 1.
    let args = ["--endpoints", &cluster.endpoints_csv(), "logs", &job.to_string(), "--follow"];
    check_ends_quietly_on_a_closed_pipe(&cluster, &args, WAIT).await?;

    // The command reads through a follower first (the endpoint listed first).
    let leader = cluster.wait_leader(WAIT).await?;
    let relay = *cluster.replicas.keys().find(|id| **id != leader).context("a follower")?;
    let mut endpoints = vec![cluster.replicas[&relay].addr.clone()];
    endpoints.extend(cluster.replicas.values().filter(|r| r.id != relay).map(|r| r.addr.clone()));
    let output = dir.path().join("logs.out");
    let errors = dir.path().join("logs.err");
    let mut follow = std::process::Command::new(rota_bin()?)
        .args(cluster.cli_flags()?)
        .args(["--endpoints", &endpoints.join(","), "logs", &job.to_string(), "--follow"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&output)?)
        .stderr(std::fs::File::create(&errors)?)
        .spawn()
        .context("rota logs -f")?;
    let lines_out = || std::fs::read_to_string(&output).map(|text| text.lines().count()).unwrap_or(0);
    let waited = std::time::Instant::now();
    while lines_out() < 20 {
        if let Some(status) = follow.try_wait()? {
            anyhow::bail!("rota logs -f ended ({status}) before the kill: {}", std::fs::read_to_string(&errors)?);
        }
        ensure!(waited.elapsed() < WAIT, "no lines through the relay within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(lines_out() < LINES, "the rank ended before the kill: make it print longer");
    cluster.kill(relay)?;
    let printed_at_kill = lines_out();

    let waited = std::time::Instant::now();
    let status = loop {
        if let Some(status) = follow.try_wait()? {
            break status;
        }
        if waited.elapsed() > WAIT {
            follow.kill()?;
            follow.wait()?;
            anyhow::bail!("rota logs -f did not end with the rank: {}", std::fs::read_to_string(&errors)?);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let printed = std::fs::read_to_string(&output)?;
    let expected: String = (1..=LINES).map(|i| format!("line-{i}\n")).collect();
    ensure!(
        status.success(),
        "rota logs -f failed ({status}) after {} of {LINES} lines: {}",
        printed.lines().count(),
        std::fs::read_to_string(&errors)?
    );
    ensure!(printed == expected, "the log came with lines missing or twice (killed after {printed_at_kill} lines):\n{printed}");
    cluster.restart(relay)?;
    Ok(())
}
