//! 3 replicas + 2 agents with 8 fake H100s each: a 2 x 8 GPU gang runs one
//! rank on each node with the right environment, and succeeds. While it
//! runs, `rota status` and the REST API show the master its ranks were
//! given (the CLI once printed the agent's own address and port before it).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::{list_nodes, read_env, shell_job, wait_nodes_ready, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_two_node_gang_runs_with_the_right_environment() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let _a = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    let _b = LocalAgent::start(dir.path(), "node-b", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;
    let nodes = list_nodes(&cluster, 1).await?;
    ensure!(nodes.iter().all(|n| n.gpus.len() == 8 && n.gpus.iter().all(|g| g.model == "H100-80GB" && g.memory_mib == 81_920)));

    let any = AnyReplica::new(&cluster)?;
    // Each rank records its environment, then waits (at most 60 s) for the
    // test to have read the master from every surface.
    let script = r#"echo "hello from rank $RANK"; echo "oops $RANK" >&2
env > "$MARK_DIR/env-$RANK.tmp" && mv "$MARK_DIR/env-$RANK.tmp" "$MARK_DIR/env-$RANK"
for i in $(seq 600); do [ -e "$MARK_DIR/go" ] && break; sleep 0.1; done"#;
    let job_id = any.submit(shell_job(2, 8, &marks, script)).await?.job_id;
    rota_e2e::wait_until("both ranks to record their environment", WAIT, || {
        let ready = marks.join("env-0").exists() && marks.join("env-1").exists();
        async move { Ok(ready.then_some(())) }
    })
    .await?;
    let given = read_env(&marks.join("env-0"))?;
    let status: serde_json::Value = serde_json::from_str(&rota(&cluster, &["--output", "json", "status", &job_id.to_string()])?)?;
    let rest = rest_job(&cluster, job_id)?;
    for (surface, shown) in [("rota status", &status), ("GET /v1/jobs", &rest)] {
        ensure!(shown["master_addr"] == given["MASTER_ADDR"].as_str(), "{surface} shows the master address the ranks were given: {shown}");
        let port = shown["master_port"].as_u64().map(|port| port.to_string());
        ensure!(port.as_deref() == Some(given["MASTER_PORT"].as_str()), "{surface} shows the master port the ranks were given: {shown}");
    }
    let text = rota(&cluster, &["status", &job_id.to_string()])?;
    let master = format!("master {}:{}\n", given["MASTER_ADDR"], given["MASTER_PORT"]);
    ensure!(text.contains(&master), "rota status prints {master:?}: {text}");
    std::fs::write(marks.join("go"), b"")?;
    let job = any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(job.attempts == 1, "one attempt, got {}", job.attempts);
    ensure!(job.last_nodes.iter().collect::<BTreeSet<_>>().len() == 2, "one rank per node: {:?}", job.last_nodes);

    let ranks = [read_env(&marks.join("env-0"))?, read_env(&marks.join("env-1"))?];
    let nodes: BTreeSet<&str> = ranks.iter().map(|e| e["ROTA_NODE"].as_str()).collect();
    ensure!(nodes.len() == 2, "ranks on distinct nodes: {nodes:?}");
    for (i, env) in ranks.iter().enumerate() {
        ensure!(env["RANK"] == i.to_string(), "RANK {:?}", env["RANK"]);
        ensure!(env["NODE_RANK"] == i.to_string(), "NODE_RANK {:?}", env["NODE_RANK"]);
        ensure!(env["LOCAL_RANK"] == "0");
        ensure!(env["WORLD_SIZE"] == "2");
        ensure!(env["ROTA_JOB_ID"] == job_id.to_string());
        ensure!(env["MASTER_ADDR"] == "127.0.0.1");
        ensure!(env["MASTER_PORT"] == ranks[0]["MASTER_PORT"] && env["MASTER_PORT"].parse::<u16>()? >= 29_500);
        ensure!(env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7", "CUDA_VISIBLE_DEVICES {:?}", env["CUDA_VISIBLE_DEVICES"]);
        ensure!(env["ROTA_CHECKPOINT_FILE"].ends_with("/checkpoint"));
        ensure!(env["MARK_DIR"] == marks.display().to_string(), "the job's own env is passed");
    }
    ensure!(ranks[0]["ROTA_NODE"] == job.last_nodes[0], "rank 0 ran where the scheduler placed it");

    // The CLI reads each rank's output from the agent that ran it.
    let out = rota(&cluster, &["logs", &job_id.to_string(), "--rank", "1"])?;
    ensure!(out == "hello from rank 1\n", "rota logs: {out:?}");
    let err = rota(&cluster, &["logs", &job_id.to_string(), "--rank", "0", "--stderr", "--follow"])?;
    ensure!(err == "oops 0\n", "rota logs --stderr: {err:?}");
    let status = rota(&cluster, &["status", &job_id.to_string()])?;
    ensure!(status.contains("succeeded") && status.contains("node-a"), "rota status: {status}");
    let nodes = rota(&cluster, &["nodes"])?;
    ensure!(nodes.contains("node-a") && nodes.contains("H100-80GB") && nodes.contains("81920 MiB"), "rota nodes: {nodes}");
    Ok(())
}

/// A job as the REST API shows it, read with `curl` and the harness's certificate.
fn rest_job(cluster: &LocalCluster, job_id: u64) -> Result<serde_json::Value> {
    let files = cluster.pki.files(rota_tls::IdentityKind::User, rota_chaos::pki::HARNESS_USER)?;
    let url = format!("https://{}/v1/jobs/{job_id}", cluster.replicas[&1].http_addr);
    let output = std::process::Command::new("curl")
        .args(["-sS", "--fail-with-body", "--max-time", "30", "--cacert"])
        .arg(cluster.pki.ca())
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg(&url)
        .output()?;
    ensure!(output.status.success(), "curl {url}: {}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn rota(cluster: &LocalCluster, args: &[&str]) -> Result<String> {
    let command = std::process::Command::new(rota_bin()?)
        .args(cluster.cli_flags()?)
        .args(["--endpoints", &cluster.endpoints_csv()])
        .args(args)
        .output();
    let output = command?;
    ensure!(output.status.success(), "rota {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8(output.stdout)?)
}
