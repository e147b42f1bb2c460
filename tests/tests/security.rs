//! Transport security and machine identities, end to end: real replicas
//! with TLS on, and clients holding the wrong certificate, or none.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{fake_registration, wait_until};
use rota_proto::raft::raft_client::RaftClient;
use rota_proto::raft::RaftMessage;
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_tls::identity::serial_hex;
use rota_tls::pem::certificates;
use rota_tls::{IdentityKind, Security};
use tonic::Code;

const WAIT: Duration = Duration::from_secs(30);
/// A refused call must come back well within this.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

async fn one_replica(dir: &std::path::Path) -> Result<(LocalCluster, String)> {
    let cluster = LocalCluster::start(dir, 1, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    let addr = cluster.replicas[&leader].addr.clone();
    Ok((cluster, addr))
}

async fn cluster_status(addr: &str, security: &Security) -> Result<pb::ClusterStatus, tonic::Status> {
    let mut client = ClusterServiceClient::new(channel(addr, security).map_err(|e| tonic::Status::internal(e.to_string()))?);
    let call = client.get_cluster_status(pb::GetClusterStatusRequest {});
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(answer) => answer.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded("no answer in time")),
    }
}

/// A plaintext gRPC client gets nothing from a TLS replica: the connection
/// never gets past the handshake. Prevents a replica answering (and taking
/// submits from) anyone without TLS. Failed against a replica started
/// `--insecure` (on commit a8e65a5, ClusterOptions::insecure) with "a
/// plaintext client was answered: ClusterStatus { ... }".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_client_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cluster, addr) = one_replica(dir.path()).await?;
    cluster_status(&addr, cluster.security()).await.context("the harness's own TLS client is answered")?;
    match cluster_status(&addr, &Security::Plaintext).await {
        Ok(status) => bail!("a plaintext client was answered: {status:?}"),
        // The replica's TLS alert is no HTTP/2 to the plaintext client: the
        // connection breaks (the code depends on what the client read or
        // wrote first), and no service ever answers.
        Err(status) => {
            let transport = std::error::Error::source(&status).is_some_and(|e| e.downcast_ref::<tonic::transport::Error>().is_some());
            ensure!(transport, "a plaintext client got an answer: {status:?}");
        }
    }
    Ok(())
}

/// A TLS client that presents no certificate is refused UNAUTHENTICATED,
/// on the client API as on the agent API. Prevents anonymous callers from
/// submitting jobs (commands run on GPU hosts). Failed on commit a8e65a5
/// with `authenticate` letting certificate-less callers through, with "an
/// anonymous client was answered: ClusterStatus { ... }".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cluster, addr) = one_replica(dir.path()).await?;
    let anonymous = cluster.pki.anonymous()?;
    match cluster_status(&addr, &anonymous).await {
        Ok(status) => bail!("an anonymous client was answered: {status:?}"),
        Err(status) => ensure!(status.code() == Code::Unauthenticated, "an anonymous client got {status:?}"),
    }
    let mut agents = AgentServiceClient::new(channel(&addr, &anonymous)?);
    let refused = agents.register_node(fake_registration("n1", 8)).await.expect_err("an anonymous registration is refused");
    ensure!(refused.code() == Code::Unauthenticated, "an anonymous registration got {refused:?}");
    Ok(())
}

/// Raft RPCs (append, vote, snapshot) are taken only from certificates
/// naming a replica: a user's or an agent's certificate, though signed by
/// the same CA, gets PERMISSION_DENIED before the request is even decoded.
/// Prevents forged appends and votes from any machine of the cluster.
/// Failed on commit a8e65a5 with RAFT_CALLERS allowing users and agents:
/// "User mallory: append_entries got ... InvalidArgument, undecodable
/// append_entries request" (the forged request reached Raft).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_a_replica_certificate_cannot_send_raft_rpcs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cluster, addr) = one_replica(dir.path()).await?;
    let garbage = || RaftMessage { payload: vec![0xff; 16].into() };
    for (kind, name) in [(IdentityKind::User, "mallory"), (IdentityKind::Agent, "node-a")] {
        let mut raft = RaftClient::new(channel(&addr, &cluster.security_of(kind, name)?)?);
        for (rpc, answer) in [
            ("append_entries", raft.append_entries(garbage()).await),
            ("vote", raft.vote(garbage()).await),
            ("install_snapshot", raft.install_snapshot(garbage()).await),
        ] {
            let status = answer.err().with_context(|| format!("{kind:?} {name}: {rpc} was accepted"))?;
            ensure!(status.code() == Code::PermissionDenied, "{kind:?} {name}: {rpc} got {status:?}");
        }
    }
    // A replica's certificate gets through to Raft (which cannot decode the garbage).
    let mut raft = RaftClient::new(channel(&addr, &cluster.security_of(IdentityKind::Replica, "9")?)?);
    let status = raft.append_entries(garbage()).await.expect_err("garbage is not an append");
    ensure!(status.code() == Code::InvalidArgument, "a replica's append got {status:?}");
    Ok(())
}

/// An agent's certificate names its node: it may register, heartbeat,
/// watch and report for that node only. Prevents one compromised GPU host
/// from posing as another (taking its assignments, keeping a dead node
/// alive). Failed on commit a8e65a5 without the may_act_for_node checks
/// in the AgentService handlers with "heartbeat as node-b was accepted".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_certificate_for_one_node_cannot_heartbeat_as_another() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cluster, addr) = one_replica(dir.path()).await?;
    let mut node_a = AgentServiceClient::new(channel(&addr, &cluster.security_of(IdentityKind::Agent, "node-a")?)?);
    node_a.register_node(fake_registration("node-a", 8)).await.context("node-a registers itself")?;
    // Its own heartbeat is taken once the new leader has checked its clock.
    wait_until("node-a's heartbeat for itself is taken", WAIT, || {
        let mut node_a = node_a.clone();
        async move {
            match node_a.heartbeat(pb::HeartbeatRequest { node: "node-a".into(), ..Default::default() }).await {
                Ok(_) => Ok(Some(())),
                Err(status) if status.code() == Code::Unavailable => Ok(None),
                Err(status) => bail!("node-a's heartbeat for itself got {status:?}"),
            }
        }
    })
    .await?;

    let as_b = node_a.heartbeat(pb::HeartbeatRequest { node: "node-b".into(), ..Default::default() }).await;
    let status = as_b.err().context("heartbeat as node-b was accepted")?;
    ensure!(status.code() == Code::PermissionDenied, "heartbeat as node-b got {status:?}");
    let register = node_a.register_node(fake_registration("node-b", 8)).await.err().context("registering node-b was accepted")?;
    ensure!(register.code() == Code::PermissionDenied, "registering node-b got {register:?}");
    let watch = node_a.watch_assignments(pb::WatchAssignmentsRequest { node: "node-b".into(), ..Default::default() }).await;
    let watch = watch.err().context("watching node-b's assignments was accepted")?;
    ensure!(watch.code() == Code::PermissionDenied, "watching node-b got {watch:?}");
    let report = node_a.report_rank_events(pb::ReportRankEventsRequest { node: "node-b".into(), ..Default::default() }).await;
    let report = report.err().context("reporting for node-b was accepted")?;
    ensure!(report.code() == Code::PermissionDenied, "reporting for node-b got {report:?}");
    // A user's certificate is no agent's.
    let mut user = AgentServiceClient::new(channel(&addr, cluster.security())?);
    let status = user.heartbeat(pb::HeartbeatRequest { node: "node-a".into(), ..Default::default() }).await.expect_err("refused");
    ensure!(status.code() == Code::PermissionDenied, "a user's heartbeat got {status:?}");
    Ok(())
}

/// An agent's certificate is for its node's work, not the cluster's: a
/// compromised GPU host cannot add a voting member, move leadership, rewrite
/// quotas or clear alarms. Failed when the cluster service admitted agent
/// certificates: "an agent added a member" (its AddMember got past identity
/// and was refused only because the address did not answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_certificate_cannot_change_the_cluster() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cluster, addr) = one_replica(dir.path()).await?;
    let mut agent = ClusterServiceClient::new(channel(&addr, &cluster.security_of(IdentityKind::Agent, "node-a")?)?);
    let add = agent.add_member(pb::AddMemberRequest { id: 9, address: "127.0.0.1:1".into() }).await;
    ensure!(add.as_ref().is_err_and(|s| s.code() == Code::PermissionDenied), "an agent added a member: {add:?}");
    let quota = agent.set_quota(pb::Quota { group: "vision".into(), gpus: 8, ..Default::default() }).await;
    ensure!(quota.as_ref().is_err_and(|s| s.code() == Code::PermissionDenied), "an agent set a quota: {quota:?}");
    let disarm = agent.set_alarm(pb::SetAlarmRequest { replica_id: 0, kind: "nospace".into(), raised: false }).await;
    ensure!(disarm.as_ref().is_err_and(|s| s.code() == Code::PermissionDenied), "an agent cleared alarms: {disarm:?}");
    let campaign = agent.campaign(pb::CampaignRequest { replica_id: 1 }).await;
    ensure!(campaign.as_ref().is_err_and(|s| s.code() == Code::PermissionDenied), "an agent moved leadership: {campaign:?}");
    // The same calls with a user's certificate get past identity (and fail or not on their merits).
    let mut user = ClusterServiceClient::new(channel(&addr, cluster.security())?);
    let status = user.get_cluster_status(pb::GetClusterStatusRequest {}).await;
    ensure!(status.is_ok(), "a user reads the cluster's status: {status:?}");
    Ok(())
}

/// Replacing a replica's certificate files is enough: new connections get
/// the new certificate (its serial) without a restart, and the replica keeps
/// serving. Prevents certificate rotation from needing downtime (or expired
/// certificates lingering until one). Failed on commit a8e65a5 with
/// ReloadingKey::current never re-reading the files: "timed out after 30s
/// waiting for the new certificate (serial ..., was ...) is served".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_without_restart() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cluster, addr) = one_replica(dir.path()).await?;
    let pid = cluster.replicas[&1].pid();
    let security = cluster.security().clone();
    let old = serial_hex(&security.server_certificate(&addr).await?)?;
    let files = cluster.pki.rotate(IdentityKind::Replica, "1")?;
    let new = serial_hex(&certificates(&files.cert)?[0])?;
    ensure!(old != new, "the rotation made a new serial");
    wait_until(&format!("the new certificate (serial {new}, was {old}) is served"), WAIT, || {
        let (security, addr, new) = (security.clone(), addr.clone(), new.clone());
        async move { Ok(security.server_certificate(&addr).await.ok().and_then(|cert| serial_hex(&cert).ok()).filter(|s| *s == new)) }
    })
    .await?;
    ensure!(cluster.replicas[&1].pid() == pid, "the replica was not restarted");
    cluster_status(&addr, &security).await.context("the replica serves with its new certificate")?;
    Ok(())
}
