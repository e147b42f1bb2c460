//! A scheduling pass that panics must not stop scheduling.
//!
//! On commit 81d5657 a panic in a pass ended the planner thread, and every
//! later pass of that leader failed ("planner thread stopped"): nothing was
//! scheduled until leadership moved. That commit has no switch to make a
//! pass panic, so the proof is this test against the fixed build, with the
//! test-only switch `ROTA_TEST_PANIC_PLANNER_ONCE=1` panicking the first
//! pass of every replica: the job is still placed, and the panic is logged
//! and counted.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{spec, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_client::AgentServiceClient;

fn scrape(addr: &str) -> Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduling_resumes_after_a_planner_panic() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { env: vec![("ROTA_TEST_PANIC_PLANNER_ONCE".into(), "1".into())], ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    let gpus = (0..8)
        .map(|index| pb::GpuInventory {
            index,
            uuid: format!("GPU-n1-{index}"),
            model: "H100-80GB".into(),
            memory_mib: 81_920,
            healthy: true,
            nvlink_peers: vec![],
        })
        .collect();
    let registration =
        pb::RegisterNodeRequest { name: "n1".into(), address: "127.0.0.1:1".into(), rack: "r1".into(), leaf: "l1".into(), gpus };
    AgentServiceClient::new(channel(&cluster.replicas[&leader].addr)?).register_node(registration).await?;
    let client = AnyReplica::new(&cluster)?;
    let job_id = client.submit(pb::SubmitJobRequest { spec: Some(spec()), request_id: "after-panic".into() }).await?.job_id;
    client.wait_job_state(job_id, pb::JobState::Running, Duration::from_secs(30)).await?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    let addr = cluster.replicas[&leader].metrics_addr.clone();
    let text = wait_until("the panic counted", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { Ok(scrape(&addr).ok().filter(|t| t.contains("rota_planner_panics_total 1"))) }
    })
    .await?;
    ensure!(!text.contains("rota_planner_restarts_total"), "the thread lived on:\n{text}");
    ensure!(cluster.log_tail(leader, 256 * 1024).contains("a scheduling pass panicked"), "the panic is logged");
    Ok(())
}
