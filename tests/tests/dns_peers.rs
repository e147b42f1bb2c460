//! Replicas named by DNS names, as a Kubernetes StatefulSet's headless
//! Service names its pods: `--peers 1=localhost:PORT,...` and `rota member
//! add ID localhost:PORT`. Names resolve at each connection (here to the
//! loopback); TLS checks the name against the replica's certificate.
//!
//! Before names were accepted, `rota server` refused such peers at start
//! ("address must be IP:PORT") and `member add` refused the address.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{submit_request, wait_until};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_named_by_dns_names_elect_forward_and_grow() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { peer_host: Some("localhost".into()), ..ClusterOptions::default() };
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    let status = cluster.wait_applied(leader, 0, WAIT).await?;
    ensure!(status.members.iter().all(|m| m.address.starts_with("localhost:")), "members by name: {:?}", status.members);

    // A follower forwards a write to the leader at its name.
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    let mut jobs = cluster.jobs_client(follower)?;
    let job_id = wait_until("a submit through a follower", WAIT, || {
        let mut jobs = jobs.clone();
        async move { Ok(jobs.submit_job(submit_request("by-name-1")).await.ok().map(|r| r.into_inner().job_id)) }
    })
    .await?;
    let again = jobs.submit_job(submit_request("by-name-1")).await?.into_inner().job_id;
    ensure!(again == job_id, "a retried submit is the same job");

    let mut admin = cluster.cluster_client(leader)?;
    let refused = admin.add_member(pb::AddMemberRequest { id: 9, address: "bad_name:7000".into() }).await;
    let status = refused.expect_err("an address that is no name is refused");
    ensure!(status.code() == tonic::Code::InvalidArgument && status.message().starts_with("address:"), "{status:?}");

    let joined = cluster.start_joining(4)?;
    let port = joined.rsplit_once(':').map(|(_, port)| port.to_string()).expect("a port");
    let grown = admin.add_member(pb::AddMemberRequest { id: 4, address: format!("localhost:{port}") }).await?.into_inner();
    ensure!(grown.members.iter().any(|m| m.id == 4 && m.address == format!("localhost:{port}")), "{:?}", grown.members);
    cluster.wait_applied(4, grown.applied_index, WAIT).await?;
    Ok(())
}
