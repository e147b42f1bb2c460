//! A scheduling pass that panics must not stop scheduling.
//!
//! On commit 81d5657 a panic in a pass ended the planner thread, and every
//! later pass of that leader failed ("planner thread stopped"): nothing was
//! scheduled until leadership moved. That commit has no switch to make a
//! pass panic, so the proof is this test against the fixed build, with the
//! test-only switch `ROTA_TEST_PANIC_PLANNER_ONCE=1` panicking the first
//! pass of every replica: the job is still placed, and the panic is logged
//! and counted.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{fake_registration, scrape_metrics, spec, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_tls::IdentityKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduling_resumes_after_a_planner_panic() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { env: vec![("ROTA_TEST_PANIC_PLANNER_ONCE".into(), "1".into())], ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    // The test registers node n1 as its agent would, with n1's certificate.
    let as_n1 = cluster.security_of(IdentityKind::Agent, "n1")?;
    AgentServiceClient::new(channel(&cluster.replicas[&leader].addr, &as_n1)?).register_node(fake_registration("n1", 8)).await?;
    let client = AnyReplica::new(&cluster)?;
    let job_id =
        client.submit(pb::SubmitJobRequest { spec: Some(spec()), request_id: "after-panic".into(), ..Default::default() }).await?.job_id;
    client.wait_job_state(job_id, pb::JobState::Running, Duration::from_secs(30)).await?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    let addr = cluster.replicas[&leader].metrics_addr.clone();
    let text = wait_until("the panic counted", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { Ok(scrape_metrics(&addr).ok().filter(|t| t.contains("rota_planner_panics_total 1"))) }
    })
    .await?;
    ensure!(!text.contains("rota_planner_restarts_total"), "the thread lived on:\n{text}");
    ensure!(cluster.log_tail(leader, 256 * 1024).contains("a scheduling pass panicked"), "the panic is logged");
    Ok(())
}
