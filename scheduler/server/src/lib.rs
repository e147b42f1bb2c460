//! rota-server, a scheduler replica: the consensus replica, the gRPC services on one port
//! (public API and Raft transport), the proposer, metrics, and bootstrap.

mod agents;
pub mod alarms;
mod approvals;
pub mod archive;
mod auth_api;
pub mod authz;
pub mod backup;
pub mod clock;
mod cluster;
pub mod cluster_id;
pub mod events;
pub mod format;
mod forward;
pub mod health;
pub mod history;
pub mod identity;
mod jobs;
pub mod leader;
pub mod limits;
pub mod log_format;
mod metrics_loop;
mod policy;
mod proposer;
pub mod replicated;
pub mod report_chart;
pub mod request_id;
pub mod rest;
pub mod state_metrics;
pub mod status;
mod stream_guard;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rota_consensus::{ConsensusConfig, NodeId, Replica};
use rota_proto::v1::agent_service_server::AgentServiceServer;
use rota_proto::v1::auth_service_server::AuthServiceServer;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_proto::v1::cluster_service_server::ClusterServiceServer;
use rota_proto::v1::event_service_server::EventServiceServer;
use rota_proto::v1::job_service_server::JobServiceServer;
use rota_proto::v1::GetClusterStatusRequest;
use rota_tls::auth::interceptor;
use rota_tls::{IdentityKind, Security};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Server;

pub use clock::wall_clock_ms;
pub use proposer::Proposer;
pub use replicated::Replicated;
use rota_core::state::{ClusterState, StateLimits};

pub use rota_client::wire::MAX_MESSAGE_BYTES;

/// Defaults of a replica's settings (Raft timing, snapshots), for the flags
/// of `rota server`.
pub mod defaults {
    pub use rota_consensus::{
        DEFAULT_ELECTION_TIMEOUT_MAX_MS, DEFAULT_ELECTION_TIMEOUT_MIN_MS, DEFAULT_HEARTBEAT_INTERVAL_MS, DEFAULT_KEEP_LOGS_BEHIND_SNAPSHOT,
        DEFAULT_SNAPSHOT_EVERY_ENTRIES,
    };
}
/// Streams a client may reset before being accepted, per connection.
const MAX_PENDING_RESETS: usize = 1_024;
/// A request that finds no live leader waits for one while this replica
/// has heard no leader for less than this many election timeouts (an
/// election in progress, two rounds included); past that it is answered
/// "no leader" at once (this replica is cut off, or elections fail).
const AWAIT_LEADER_ELECTION_TIMEOUTS: u64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("consensus: {0}")]
    Consensus(#[from] rota_consensus::ConsensusError),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("metrics exporter: {0}")]
    Metrics(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("data directory: {0}")]
    DataDir(String),
    #[error("backup: {0}")]
    Backup(String),
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub id: NodeId,
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// Initial members (id -> API address). Must include this replica unless joining.
    pub peers: BTreeMap<NodeId, String>,
    /// A joining replica waits to be added with `rota member add`; it never bootstraps.
    pub join: bool,
    pub metrics_listen: Option<SocketAddr>,
    /// Serve the REST/JSON API (`/v1`) on this address (TLS when the
    /// replica's links are, with the same certificate).
    pub http_listen: Option<SocketAddr>,
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    pub snapshot_every_entries: u64,
    pub keep_logs_behind_snapshot: u64,
    /// A node without a heartbeat for this long is declared down (leader only).
    pub node_ttl_ms: u64,
    /// A replica whose clock is further than this from a majority of its
    /// peers' refuses to lead.
    pub max_clock_skew_ms: u64,
    /// A rank assigned and not started this long gets its allocation
    /// stopped as lost (None: 2 x `node_ttl_ms` + 30 s; see `leader::starts`).
    pub start_timeout_ms: Option<u64>,
    /// Free bytes in the data directory below which this replica raises the
    /// `nospace` alarm (the cluster then takes no new work).
    pub min_free_bytes: u64,
    /// TLS with this replica's certificate on every link (served and
    /// dialed), or plaintext when started `--insecure`.
    pub security: Security,
    /// The user made the cluster's first admin when it has no users yet
    /// (given to the founding replicas; ignored once any user exists).
    pub bootstrap_admin: Option<String>,
    /// Events kept for readers of the event stream at most (bytes are
    /// bounded by `events::MAX_KEPT_EVENT_BYTES`).
    pub keep_events: usize,
    /// Request rate, streams and requests in flight per caller identity.
    pub limits: limits::LimitsConfig,
    /// The CA bundle and certificate in use, as (`cert` label, PEM path),
    /// for `rota_certificate_expiry_seconds`; empty without TLS.
    pub certificate_files: Vec<(&'static str, PathBuf)>,
}

/// A gauge label set not set for this long is dropped from the scrape
/// (every gauge is set at least once a second while it means something: a
/// queue with nothing pending any more, a follower of a former leadership).
const GAUGE_IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// Buckets for a disk sync or a round trip between replicas: a healthy
/// NVMe syncs in well under a millisecond, a struggling disk in tens.
const FAST_IO_BUCKETS_S: &[f64] = &[0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Who may call each service (a replica also forwards clients' and agents'
/// requests to the leader under its own certificate).
const RAFT_CALLERS: &[IdentityKind] = &[IdentityKind::Replica];
const CLIENT_CALLERS: &[IdentityKind] = &[IdentityKind::User, IdentityKind::Replica];
/// Not agents: a compromised GPU host must not add members, move
/// leadership, rewrite queues and quotas or clear alarms.
const CLUSTER_CALLERS: &[IdentityKind] = &[IdentityKind::User, IdentityKind::Replica];
const AGENT_CALLERS: &[IdentityKind] = &[IdentityKind::Agent, IdentityKind::Replica];
/// Health and reflection: anyone with a certificate of the cluster (a
/// readiness probe runs with the replica's own, an agent may check its replica).
const PROBE_CALLERS: &[IdentityKind] = &[IdentityKind::User, IdentityKind::Replica, IdentityKind::Agent];
/// The methods that answer with a stream (capped per identity).
const JOB_STREAMS: &[&str] = &["/rota.v1.JobService/WatchJobs", "/rota.v1.JobService/ReadLogs"];
const AGENT_STREAMS: &[&str] = &["/rota.v1.AgentService/WatchAssignments"];
const EVENT_STREAMS: &[&str] = &["/rota.v1.EventService/WatchEvents"];

/// What the services share.
pub struct Context {
    pub replica: Replica<Replicated>,
    pub proposer: Proposer,
    forwarder: forward::Forwarder,
    /// The leader lease: followers may elect another leader once a leader
    /// has gone this long without hearing from a quorum.
    lease_ms: u64,
    /// TEST ONLY (`ROTA_TEST_ACK_BEFORE_COMMIT=1`): acknowledge a submit as
    /// soon as it is queued, before it commits. A deliberately broken build,
    /// so the chaos harness can prove its checkers catch lost submits.
    pub unsafe_ack_before_commit: bool,
    /// The leader's in-memory heartbeat table (empty while not leading).
    pub leader: leader::Leadership,
    /// `--bootstrap-admin`: proposed by a leader of a cluster without users.
    pub bootstrap_admin: Option<String>,
    /// The cluster this replica belongs to (kept in its data directory).
    pub cluster_identity: cluster_id::ClusterIdentity,
    /// This replica's monthly archive of job records (`DATA/archive`).
    pub archive_dir: PathBuf,
    /// Held through one membership change: copies of one change (a retry,
    /// a hedge) then find it made instead of racing it, which Raft refuses
    /// ("already undergoing a configuration change").
    pub membership_change: tokio::sync::Mutex<()>,
}

impl Context {
    /// Refuse leader work while this leader has not heard from a quorum for
    /// a lease: it is probably cut off, and the client does better to try
    /// another replica at once than to wait for a commit that will not come.
    /// A leader takes work only once its clock agrees with its peers':
    /// a request that comes first waits for the check (bounded).
    pub async fn leader_in_contact(&self) -> Result<(), tonic::Status> {
        if let Some(age_ms) = self.replica.quorum_contact_age_ms().filter(|age_ms| *age_ms > self.lease_ms) {
            return Err(tonic::Status::unavailable(format!(
                "this leader has not heard from a quorum for {age_ms} ms; try another replica"
            )));
        }
        let Some(term) = self.replica.leading_term() else { return Ok(()) };
        let wait = Duration::from_millis(AWAIT_LEADER_ELECTION_TIMEOUTS * self.lease_ms);
        if !self.leader.wait_clock_verified(term, wait).await {
            return Err(tonic::Status::unavailable("this leader has not yet checked its clock against its peers'; try again"));
        }
        Ok(())
    }

    /// Read the applied state under its lock. Keep `f` short: apply waits.
    pub fn read<R>(&self, f: impl FnOnce(&ClusterState) -> R) -> R {
        self.replica.read(|replicated| f(&replicated.state))
    }

    /// Read a copy of the applied state, taken in O(1) under its lock and
    /// read after it is released, on a background thread: for walks over
    /// the job table (listings, history, reports), which with a million
    /// jobs held take longer than apply may wait (see
    /// `Replica::read_detached`). `what` names the read in its error.
    pub async fn read_detached<R: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(&ClusterState) -> R + Send + 'static,
    ) -> Result<R, tonic::Status> {
        self.replica
            .read_detached(|replicated| replicated.state.clone(), move |state| f(&state))
            .await
            .map_err(|e| tonic::Status::unavailable(format!("{what}: {e}")))
    }
}

/// Run a replica until the process is stopped.
pub async fn run(config: ServerConfig) -> Result<(), ServerError> {
    if !config.join && !config.peers.contains_key(&config.id) {
        return Err(ServerError::Config(format!("--peers must include this replica's id {}", config.id)));
    }
    if let Some(addr) = config.metrics_listen {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .set_buckets(&[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0])
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full("rota_job_wait_seconds".into()),
                &[1.0, 10.0, 60.0, 300.0, 900.0, 1_800.0, 3_600.0, 7_200.0, 14_400.0, 43_200.0, 86_400.0],
            )
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full("rota_proposal_batch_size".into()),
                &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1_024.0],
            )
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full("rota_log_sync_seconds".into()), FAST_IO_BUCKETS_S)
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full("rota_raft_rpc_seconds".into()), FAST_IO_BUCKETS_S)
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full("rota_raft_serve_seconds".into()), FAST_IO_BUCKETS_S)
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full("rota_snapshot_build_seconds".into()),
                &[0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0],
            )
            .map_err(|e| ServerError::Metrics(e.to_string()))?
            .idle_timeout(metrics_util::MetricKindMask::GAUGE, Some(GAUGE_IDLE_TIMEOUT))
            .install()
            .map_err(|e| ServerError::Metrics(e.to_string()))?;
        metrics_loop::describe();
    }
    let peer_addrs: Vec<String> = config.peers.iter().filter(|(id, _)| **id != config.id).map(|(_, addr)| addr.clone()).collect();
    if !config.security.is_tls() {
        tracing::warn!("--insecure: plaintext links, no certificates: anyone who reaches this port can act as any replica, agent or user");
    }
    identity::check(config.id, &config.data_dir, config.join, &peer_addrs, &config.security).await.map_err(ServerError::DataDir)?;
    let cluster_identity = cluster_id::ClusterIdentity::load(&config.data_dir).map_err(ServerError::DataDir)?;
    let events = events::EventRing::new(config.keep_events, events::MAX_KEPT_EVENT_BYTES);
    let archive = archive::ArchiveWriter::open(&archive::archive_dir(&config.data_dir)).map_err(|e| ServerError::DataDir(e.to_string()))?;
    // Every replica starts from the same bounds; only the log changes them
    // (`rota limits set`), so a restart or a join replays to the same state.
    let replicated = Replicated::new(ClusterState::new(StateLimits::default()), events, Some(archive));
    let replica = Replica::open(consensus_config(&config, &cluster_identity), replicated).await?;
    let ctx = Arc::new(Context {
        proposer: Proposer::start(replica.clone()),
        replica: replica.clone(),
        forwarder: forward::Forwarder::new(
            config.security.clone(),
            {
                let replica = replica.clone();
                Arc::new(move || replica.leader_silent())
            },
            {
                let replica = replica.clone();
                let silence_ms = AWAIT_LEADER_ELECTION_TIMEOUTS * config.election_timeout_max_ms;
                Arc::new(move |unreachable: Option<String>| {
                    let replica = replica.clone();
                    Box::pin(async move { replica.await_leader(silence_ms, unreachable.as_deref()).await.map(|(_, addr)| addr) })
                })
            },
        ),
        lease_ms: config.election_timeout_max_ms,
        unsafe_ack_before_commit: std::env::var("ROTA_TEST_ACK_BEFORE_COMMIT").is_ok_and(|v| v == "1"),
        leader: leader::Leadership::new(config.node_ttl_ms, config.max_clock_skew_ms).with_start_timeout_ms(config.start_timeout_ms),
        bootstrap_admin: config.bootstrap_admin.clone(),
        cluster_identity: cluster_identity.clone(),
        archive_dir: archive::archive_dir(&config.data_dir),
        membership_change: tokio::sync::Mutex::new(()),
    });
    if ctx.unsafe_ack_before_commit {
        tracing::error!("ROTA_TEST_ACK_BEFORE_COMMIT=1: submits are acknowledged before they commit; never use this outside tests");
    }
    tokio::spawn(metrics_loop::run(replica.clone(), config.certificate_files.clone()));
    tokio::spawn(state_metrics::run(ctx.clone()));
    tokio::spawn(exit_on_fatal(replica.clone()));
    tokio::spawn(leader::run(ctx.clone()));
    tokio::spawn(alarms::watch_disk(ctx.clone(), config.data_dir.clone(), config.min_free_bytes));
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let election_ms = Duration::from_millis(config.election_timeout_max_ms);
    tokio::spawn(health::run(ctx.clone(), health_reporter, config.election_timeout_max_ms, election_ms));
    let reflection = health::reflection().map_err(|e| ServerError::Config(format!("reflection: {e}")))?;
    let listener =
        tokio::net::TcpListener::bind(config.listen).await.map_err(|e| ServerError::Config(format!("--listen {}: {e}", config.listen)))?;
    config.limits.check().map_err(ServerError::Config)?;
    let limiter = limits::Limiter::new(config.limits);
    let limited = |class, streams| (limiter.clone(), class, streams);
    if let Some(addr) = config.http_listen {
        let http = tokio::net::TcpListener::bind(addr).await.map_err(|e| ServerError::Config(format!("--http-listen {addr}: {e}")))?;
        let router = rest::router(ctx.clone(), limiter.clone());
        let security = config.security.clone();
        tokio::spawn(async move {
            if let Err(error) = rest::serve(router, security, http).await {
                tracing::error!(%error, "the REST API stopped");
            }
        });
        tracing::info!(%addr, "REST API serving");
    }
    let incoming = config.security.incoming(listener).map_err(|e| ServerError::Config(e.to_string()))?;
    // Every service first establishes its caller from the connection's
    // certificate (rota_tls::auth) and refuses callers of the wrong kind;
    // then the caller's limits (limits.rs) are taken, before any work.
    // Clients that give up on slow attempts during a failover reset their
    // streams; hyper's default allowance for that (20 pending resets) is made
    // for hostile peers and would cut off honest clients with GOAWAY.
    let server = Server::builder()
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_RESETS))
        .add_service(InterceptedService::new(
            replica.raft_service(),
            cluster_id::raft_interceptor(cluster_identity.clone(), interceptor(RAFT_CALLERS)),
        ))
        .add_service(InterceptedService::new(health_service, interceptor(PROBE_CALLERS)))
        .add_service(InterceptedService::new(reflection, interceptor(PROBE_CALLERS)))
        .add_service(InterceptedService::new(
            request_id::Traced::new(limits::Limited::new(
                JobServiceServer::new(jobs::JobApi::new(ctx.clone()))
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
                limited(limits::Class::User, JOB_STREAMS),
            )),
            interceptor(CLIENT_CALLERS),
        ))
        .add_service(InterceptedService::new(
            request_id::Traced::new(limits::Limited::new(
                EventServiceServer::new(events::EventApi::new(ctx.clone())).max_encoding_message_size(MAX_MESSAGE_BYTES),
                limited(limits::Class::User, EVENT_STREAMS),
            )),
            interceptor(CLIENT_CALLERS),
        ))
        .add_service(InterceptedService::new(
            request_id::Traced::new(limits::Limited::new(
                ClusterServiceServer::new(cluster::ClusterApi::new(ctx.clone())),
                limited(limits::Class::User, &[]),
            )),
            interceptor(CLUSTER_CALLERS),
        ))
        .add_service(InterceptedService::new(
            request_id::Traced::new(limits::Limited::new(
                AuthServiceServer::new(auth_api::AuthApi::new(ctx.clone())),
                limited(limits::Class::User, &[]),
            )),
            interceptor(CLIENT_CALLERS),
        ))
        .add_service(InterceptedService::new(
            limits::Limited::new(
                AgentServiceServer::new(agents::AgentApi::new(ctx.clone()))
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
                limited(limits::Class::Agent, AGENT_STREAMS),
            ),
            interceptor(AGENT_CALLERS),
        ))
        .serve_with_incoming(incoming);
    tokio::spawn(bootstrap(config.clone(), replica.clone(), cluster_identity));
    tracing::info!(id = config.id, listen = %config.listen, "replica serving");
    server.await?;
    Ok(())
}

/// Exit code of a replica whose storage failed (EX_IOERR).
const EXIT_STORAGE_FAILED: i32 = 74;

/// A replica whose Raft node failed for good (its disk refused a write, say)
/// exits non-zero, so systemd or Kubernetes restarts it and an operator sees
/// it, instead of lingering as a member that never acknowledges.
async fn exit_on_fatal(replica: Replica<Replicated>) {
    let why = replica.fatal().await;
    tracing::error!(%why, "the replica's storage or Raft core failed; exiting");
    eprintln!("rota server: fatal: {why}");
    // _exit, not exit: RocksDB's background threads are still running, and
    // the C++ static destructors that exit() runs would pull the store from
    // under them (an abort instead of the exit code).
    // SAFETY: ends the process at once; nothing after it runs.
    unsafe { libc::_exit(EXIT_STORAGE_FAILED) }
}

fn consensus_config(config: &ServerConfig, cluster_identity: &cluster_id::ClusterIdentity) -> ConsensusConfig {
    let mut consensus = ConsensusConfig::new(config.id, config.data_dir.clone());
    consensus.peer_addrs = config.peers.clone();
    consensus.heartbeat_interval_ms = config.heartbeat_interval_ms;
    consensus.election_timeout_min_ms = config.election_timeout_min_ms;
    consensus.election_timeout_max_ms = config.election_timeout_max_ms;
    consensus.snapshot_every_entries = staggered_snapshot_interval(config.snapshot_every_entries, config.id);
    consensus.keep_logs_behind_snapshot = config.keep_logs_behind_snapshot;
    let security = config.security.clone();
    consensus.peer_channels = Some(rota_consensus::PeerChannels(Arc::new(move |addr: &str, connect_timeout: Duration| {
        let endpoint = rota_tls::endpoint(addr).map_err(|e| e.to_string())?;
        Ok(security.channel(endpoint.connect_timeout(connect_timeout)))
    })));
    let cluster_identity = cluster_identity.clone();
    consensus.request_tags = Some(rota_consensus::RequestTags(Arc::new(move |metadata| cluster_identity.tag(metadata))));
    consensus
}

/// Replicas apply the same entries at about the same time; with one interval
/// they would all serialize the whole state at once, and on a busy host the
/// quorum can then miss heartbeats together. Each replica adds an eighth of
/// the interval per id step (ids mod 5), so at most one snapshots at a time.
fn staggered_snapshot_interval(every_entries: u64, id: NodeId) -> u64 {
    every_entries.saturating_add(every_entries / 8 * (id % 5))
}

/// The lowest id initializes a new cluster, once. It first asks the other
/// peers whether a cluster already exists, so a replica whose data dir was
/// lost does not found a second cluster beside the first.
async fn bootstrap(config: ServerConfig, replica: Replica<Replicated>, cluster_identity: cluster_id::ClusterIdentity) {
    let lowest = config.peers.keys().next().copied();
    if config.join || lowest != Some(config.id) || replica.is_initialized().await {
        return;
    }
    for (id, addr) in config.peers.iter().filter(|(id, _)| **id != config.id) {
        if peer_has_cluster(addr, &config.security).await {
            tracing::warn!(peer = id, "a peer already belongs to a cluster; not initializing a new one");
            return;
        }
    }
    // The founder names the cluster before it exists; the other members
    // learn the id from its first messages.
    if let Err(error) = cluster_identity.found() {
        tracing::error!(%error, "cannot keep a cluster id; not initializing");
        return;
    }
    match replica.initialize(config.peers.clone()).await {
        Ok(()) => tracing::info!(members = ?config.peers.keys().collect::<Vec<_>>(), "initialized a new cluster"),
        Err(error) => tracing::error!(%error, "initializing the cluster failed"),
    }
}

async fn peer_has_cluster(addr: &str, security: &Security) -> bool {
    peer_status(addr, security, 500, 1_000).await.is_some_and(|status| !status.members.is_empty())
}

/// A peer's cluster status over a connection of its own, asked before this
/// replica serves (bootstrap, data-directory check); None if it does not
/// answer in time.
async fn peer_status(addr: &str, security: &Security, connect_timeout_ms: u64, timeout_ms: u64) -> Option<rota_proto::v1::ClusterStatus> {
    let endpoint = rota_tls::endpoint(addr).ok()?;
    let endpoint = endpoint.connect_timeout(Duration::from_millis(connect_timeout_ms)).timeout(Duration::from_millis(timeout_ms));
    let channel = security.connect(endpoint).await.ok()?;
    let status = ClusterServiceClient::new(channel).get_cluster_status(GetClusterStatusRequest {}).await.ok()?;
    Some(status.into_inner())
}

#[cfg(test)]
mod watch_cost;

#[cfg(test)]
mod tests {
    #[test]
    fn replicas_snapshot_at_different_intervals() {
        let intervals: Vec<u64> = (1..=5).map(|id| super::staggered_snapshot_interval(20_000, id)).collect();
        assert_eq!(intervals, vec![22_500, 25_000, 27_500, 30_000, 20_000]);
        assert_eq!(super::staggered_snapshot_interval(u64::MAX, 3), u64::MAX);
    }
}
