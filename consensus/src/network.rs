//! Raft RPCs to peers over tonic (`rota.raft.v1.Raft`).
//!
//! Requests are the bincode-encoded openraft request; responses are the
//! bincode-encoded `Result<response, RaftError>`. A peer's address comes from
//! `ConsensusConfig::peer_addrs` first and from the membership's
//! `BasicNode::addr` otherwise. Channels connect lazily and are shared per
//! address; every RPC runs under a timeout.
//!
//! TEST ONLY: `ROTA_TEST_PEER_ROUTES=ADDR=VIA,...` dials `VIA` wherever a
//! resolved peer address is `ADDR`. The chaos harness puts a proxy on every
//! replica-to-replica link so it can cut one replica off; a replica that
//! joins later under a new id (on a wiped replica's host) is known to the
//! running ones only by its membership address, and without a route they
//! would reach it directly, past the proxy, so a "partitioned" leader kept
//! its quorum through it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError, Timeout, Unreachable};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{AnyError, BasicNode, RPCTypes};
use rota_proto::raft::raft_client::RaftClient;
use rota_proto::raft::RaftMessage;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};

use crate::state_machine::AppliedId;
use crate::types::TypeConfig;
use crate::{NodeId, PeerChannels, RequestTags};

/// Largest Raft message accepted or sent (tonic encode/decode limit).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
/// Bytes of entries one AppendEntries should carry at most; a larger batch
/// is split (openraft retries with fewer entries on `PayloadTooLarge`).
pub const APPEND_TARGET_BYTES: usize = 4 * 1024 * 1024;

type RpcErr<E> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

struct NetInner {
    self_id: NodeId,
    peer_addrs: BTreeMap<NodeId, String>,
    rpc_timeout: Duration,
    snapshot_timeout: Duration,
    /// Wait before trying an unreachable peer again (see `PeerClient::backoff`).
    unreachable_retry: Duration,
    make_channel: Option<PeerChannels>,
    tags: Option<RequestTags>,
    channels: Mutex<HashMap<String, Channel>>,
    /// Resolved address -> address dialled instead (see the module doc).
    routes: BTreeMap<String, String>,
    /// The last log id this replica applied: the highest commit it tells a
    /// follower of (see `PeerClient::append_entries`).
    applied: AppliedId,
    /// The last index this replica applied, to wait on (see `commit_notice`).
    applied_index: Option<watch::Receiver<u64>>,
}

/// How long a commit notice waits for the leader to apply the commit it
/// carries: about one sync, well under any election timeout.
const COMMIT_NOTICE_WAIT: Duration = Duration::from_millis(10);

const PEER_ROUTES_ENV: &str = "ROTA_TEST_PEER_ROUTES";

/// The test-only routes of `ROTA_TEST_PEER_ROUTES` (empty when unset).
fn test_routes() -> BTreeMap<String, String> {
    let Ok(text) = std::env::var(PEER_ROUTES_ENV) else {
        return BTreeMap::new();
    };
    tracing::error!("{PEER_ROUTES_ENV}: peer addresses are rerouted; never use this outside tests");
    parse_routes(&text)
}

fn parse_routes(text: &str) -> BTreeMap<String, String> {
    text.split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(from, via)| (from.trim().to_string(), via.trim().to_string()))
        .filter(|(from, via)| !from.is_empty() && !via.is_empty())
        .collect()
}

/// Creates [`PeerClient`]s for openraft. Cheap to clone.
#[derive(Clone)]
pub struct NetworkFactory {
    inner: Arc<NetInner>,
}

impl NetworkFactory {
    pub fn new(
        self_id: NodeId,
        peer_addrs: BTreeMap<NodeId, String>,
        rpc_timeout: Duration,
        snapshot_timeout: Duration,
        unreachable_retry: Duration,
        make_channel: Option<PeerChannels>,
        tags: Option<RequestTags>,
    ) -> Self {
        let channels = Mutex::new(HashMap::new());
        let routes = test_routes();
        let applied = Arc::new(Mutex::new(None));
        let inner = NetInner {
            self_id,
            peer_addrs,
            rpc_timeout,
            snapshot_timeout,
            unreachable_retry,
            make_channel,
            tags,
            channels,
            routes,
            applied,
            applied_index: None,
        };
        Self { inner: Arc::new(inner) }
    }

    /// Tell followers of commits only up to the log id `applied` holds
    /// (this replica's last applied one, whose index `applied_index`
    /// publishes; see `PeerClient::append_entries`).
    pub(crate) fn bounding_commits_by(mut self, applied: AppliedId, applied_index: watch::Receiver<u64>) -> Self {
        let inner = Arc::get_mut(&mut self.inner).expect("bound before the factory is shared");
        inner.applied = applied;
        inner.applied_index = Some(applied_index);
        self
    }

    /// The address to reach `target` at: configured peer address first,
    /// then the one stored in the membership.
    pub fn resolve(&self, target: NodeId, node: Option<&BasicNode>) -> Option<String> {
        let addr = self.inner.peer_addrs.get(&target).cloned().or_else(|| node.map(|n| n.addr.clone()))?;
        Some(self.inner.routes.get(&addr).cloned().unwrap_or(addr))
    }
}

/// Tries of one call: the second on a new connection (see
/// `PeerClient::send_on_a_live_connection`).
const SEND_ATTEMPTS: u32 = 2;

/// Did the call fail in the connection (none could be made, or it broke)
/// rather than in the peer's answer? Such a call may be tried again on a
/// new connection; an answer, even an error, may not.
pub fn failed_in_transport(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some_and(|source| source.downcast_ref::<tonic::transport::Error>().is_some())
}

impl NetInner {
    fn forget_channel(&self, addr: &str) {
        if let Ok(mut channels) = self.channels.lock() {
            channels.remove(addr);
        }
    }

    fn channel(&self, addr: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().map_err(|_| "channel cache poisoned".to_string())?;
        if let Some(ch) = channels.get(addr) {
            return Ok(ch.clone());
        }
        if let Some(PeerChannels(make)) = &self.make_channel {
            let ch = make(addr, self.rpc_timeout)?;
            channels.insert(addr.to_string(), ch.clone());
            return Ok(ch);
        }
        let uri = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
        let ch = Endpoint::from_shared(uri)
            .map_err(|e| format!("invalid peer address {addr:?}: {e}"))?
            .connect_timeout(self.rpc_timeout)
            .tcp_nodelay(true)
            .connect_lazy();
        channels.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        let addr = self.resolve(target, Some(node)).unwrap_or_default();
        PeerClient { net: self.inner.clone(), target, node: node.clone(), addr, client: None, stream: None, unary_only: false }
    }
}

/// The `kind` label of an AppendEntries carrying `entries` entries, the
/// same on the leader's round trip and the follower's answer. One without
/// entries only carries the leader's term and commit index (a heartbeat):
/// told apart, the time of one with entries shows the follower's sync.
pub(crate) fn append_entries_kind(entries: u64) -> &'static str {
    if entries == 0 {
        "heartbeat"
    } else {
        "append_entries"
    }
}

/// The connection to one peer.
pub struct PeerClient {
    net: Arc<NetInner>,
    target: NodeId,
    node: BasicNode,
    addr: String,
    client: Option<RaftClient<Channel>>,
    /// The open AppendEntries stream to the peer (see `append_on_stream`).
    stream: Option<AppendStream>,
    /// The peer answered a stream with UNIMPLEMENTED (a build without
    /// one): AppendEntries go to it one call each, for as long as this
    /// client lives (openraft makes a new one at each change of leader or
    /// membership, which tries again).
    unary_only: bool,
}

/// A leader's AppendEntries stream to one follower: requests go out one at
/// a time, each answered in order.
struct AppendStream {
    requests: futures::channel::mpsc::Sender<RaftMessage>,
    answers: tonic::Streaming<RaftMessage>,
}

impl AppendStream {
    async fn ask(&mut self, payload: tonic::codegen::Bytes) -> Result<RaftMessage, tonic::Status> {
        use futures::SinkExt;
        self.requests.send(RaftMessage { payload }).await.map_err(|_| tonic::Status::unavailable("AppendEntries stream closed"))?;
        self.answers.message().await?.ok_or_else(|| tonic::Status::unavailable("AppendEntries stream ended by the peer"))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Msg(String);

fn unreachable<E: std::error::Error>(msg: impl Into<String>) -> RpcErr<E> {
    RPCError::Unreachable(Unreachable::new(&Msg(msg.into())))
}

fn network<E: std::error::Error>(msg: impl Into<String>) -> RpcErr<E> {
    RPCError::Network(NetworkError::new(&Msg(msg.into())))
}

impl PeerClient {
    fn client(&mut self) -> Result<RaftClient<Channel>, String> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        if self.addr.is_empty() {
            return Err(format!("no address known for node {}", self.target));
        }
        let ch = self.net.channel(&self.addr)?;
        let c = RaftClient::new(ch).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES);
        self.client = Some(c.clone());
        Ok(c)
    }

    async fn call<Resp, E>(&mut self, kind: RPCTypes, label: &'static str, payload: Vec<u8>, timeout: Duration) -> Result<Resp, RpcErr<E>>
    where
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let started = std::time::Instant::now();
        let answered = tokio::time::timeout(timeout, self.send(kind, payload.into())).await;
        if matches!(answered, Ok(Ok(_))) {
            // The round trip of an answered call: the network both ways
            // and, for AppendEntries, the follower's own sync.
            crate::labelled::record("rota_raft_rpc_seconds", "kind", label, started.elapsed().as_secs_f64());
        }
        let reply = match answered {
            Err(_) => return Err(RPCError::Timeout(Timeout { action: kind, id: self.net.self_id, target: self.target, timeout })),
            Ok(Err(status)) => {
                let text = format!("{kind} to node {} at {}: {status}", self.target, self.addr);
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Unimplemented => unreachable(text),
                    tonic::Code::DeadlineExceeded => {
                        RPCError::Timeout(Timeout { action: kind, id: self.net.self_id, target: self.target, timeout })
                    }
                    _ => network(text),
                });
            }
            Ok(Ok(r)) => r,
        };
        let res: Result<Resp, RaftError<NodeId, E>> =
            bincode::deserialize(&reply.payload).map_err(|e| network(format!("decode {kind} reply from node {}: {e}", self.target)))?;
        match res {
            Ok(r) => Ok(r),
            // The peer's Raft is stopped or failed: back off like for a dead peer.
            Err(RaftError::Fatal(f)) => Err(RPCError::Unreachable(Unreachable::new(&f))),
            Err(e) => Err(RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e))),
        }
    }

    /// Send one request and wait for its answer: an AppendEntries on the
    /// peer's stream where it has one, anything else in a call of its own.
    async fn send(&mut self, kind: RPCTypes, payload: tonic::codegen::Bytes) -> Result<RaftMessage, tonic::Status> {
        if kind == RPCTypes::AppendEntries && !self.unary_only {
            match self.append_on_stream(payload.clone()).await {
                Err(status) if status.code() == tonic::Code::Unimplemented => {
                    tracing::info!(target = self.target, addr = %self.addr, "the peer has no AppendEntries stream (an older build): one call per AppendEntries");
                    self.unary_only = true;
                }
                outcome => return outcome,
            }
        }
        self.send_on_a_live_connection(kind, payload).await.map(tonic::Response::into_inner)
    }

    /// One AppendEntries on the stream to the peer, opened if none is. The
    /// stream is taken out while a request is on it: a call its timeout
    /// cancels drops the stream with it, so an answer that comes late is
    /// never read as the next request's. A stream kept from before that
    /// fails without an answer (the peer restarted, the connection broke)
    /// is replaced and the request sent once more on a new one: an
    /// AppendEntries may reach a follower twice, its second copy changes
    /// nothing.
    async fn append_on_stream(&mut self, payload: tonic::codegen::Bytes) -> Result<RaftMessage, tonic::Status> {
        let (mut stream, kept) = match self.stream.take() {
            Some(stream) => (stream, true),
            None => (self.open_stream().await?, false),
        };
        let outcome = stream.ask(payload.clone()).await;
        let outcome = match outcome {
            Err(status) if kept => {
                tracing::debug!(target = self.target, addr = %self.addr, %status, "AppendEntries stream broken; once more on a new one");
                stream = self.open_stream().await?;
                stream.ask(payload).await
            }
            outcome => outcome,
        };
        if outcome.is_ok() {
            self.stream = Some(stream);
        }
        outcome
    }

    /// Open an AppendEntries stream, once more on a new connection if the
    /// first try failed in the transport.
    async fn open_stream(&mut self) -> Result<AppendStream, tonic::Status> {
        let mut attempt = 1;
        loop {
            let mut client = self.client().map_err(tonic::Status::unavailable)?;
            let (requests, outgoing) = futures::channel::mpsc::channel(0);
            let mut msg = tonic::Request::new(outgoing);
            if let Some(RequestTags(tag)) = &self.net.tags {
                tag(msg.metadata_mut());
            }
            match client.append_stream(msg).await {
                Ok(answers) => {
                    // One per follower for as long as the link holds: a count
                    // that keeps rising is a link or a peer that keeps failing.
                    metrics::counter!("rota_raft_streams_opened_total", "peer" => self.target.to_string()).increment(1);
                    return Ok(AppendStream { requests, answers: answers.into_inner() });
                }
                Err(status) if attempt < SEND_ATTEMPTS && failed_in_transport(&status) => {
                    self.net.forget_channel(&self.addr);
                    self.client = None;
                    attempt += 1;
                }
                Err(status) => return Err(status),
            }
        }
    }

    /// Send once, and once more on a new connection if the first failed in
    /// the transport. A connection a cut link left broken is found out only
    /// by the next call on it, however much later: a vote sent on it is
    /// lost for the whole election (openraft does not send a vote again
    /// within a term), and the candidate waits out its election timeout.
    async fn send_on_a_live_connection(
        &mut self,
        kind: RPCTypes,
        payload: tonic::codegen::Bytes,
    ) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
        let mut attempt = 1;
        loop {
            let mut client = self.client().map_err(tonic::Status::unavailable)?;
            let mut msg = tonic::Request::new(RaftMessage { payload: payload.clone() });
            if let Some(RequestTags(tag)) = &self.net.tags {
                tag(msg.metadata_mut());
            }
            let outcome = match kind {
                RPCTypes::AppendEntries => client.append_entries(msg).await,
                RPCTypes::Vote => client.vote(msg).await,
                RPCTypes::InstallSnapshot => client.install_snapshot(msg).await,
            };
            match outcome {
                Err(status) if attempt < SEND_ATTEMPTS && failed_in_transport(&status) => {
                    tracing::debug!(target = self.target, addr = %self.addr, %status, "{kind} failed in the transport; once more on a new connection");
                    self.net.forget_channel(&self.addr);
                    self.client = None;
                    attempt += 1;
                }
                outcome => return outcome,
            }
        }
    }

    /// An AppendEntries without entries is openraft's notice of a new
    /// commit (or a heartbeat): it is sent as soon as the commit is counted,
    /// before this leader applied it, and would carry only the commit
    /// applied before. It waits (at most `COMMIT_NOTICE_WAIT`) for the
    /// commit to be applied, so followers learn of it now and not at the
    /// next entry or heartbeat: a client that wrote through the leader and
    /// reads on a follower finds its write there as before.
    async fn commit_notice(&self, commit: Option<crate::LogId>) {
        let (Some(commit), Some(applied)) = (commit, &self.net.applied_index) else { return };
        let mut applied = applied.clone();
        let _ = tokio::time::timeout(COMMIT_NOTICE_WAIT, applied.wait_for(|a| *a >= commit.index)).await;
    }

    fn timeout(&self, option: &RPCOption) -> Duration {
        self.net.rpc_timeout.min(option.hard_ttl())
    }
}

// RPCError is openraft's (large) error type for network calls.
#[allow(clippy::result_large_err)]
fn encode<T: serde::Serialize, E: std::error::Error>(v: &T) -> Result<Vec<u8>, RpcErr<E>> {
    bincode::serialize(v).map_err(|e| RPCError::Network(NetworkError::new(&AnyError::new(&*e))))
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr<openraft::error::Infallible>> {
        let mut rpc = rpc;
        // A follower hears of commits only up to what this leader applied.
        // openraft counts the leader's own entries towards a commit once
        // appended, and the log store acknowledges those appends before they
        // are on disk (`LogStore::append`); the leader applies an entry only
        // once its disk has it, so a commit it applied is on a quorum's
        // disks. Told of a higher one, a follower could apply an entry that
        // a crash of this leader before its sync then loses.
        if rpc.entries.is_empty() {
            self.commit_notice(rpc.leader_commit).await;
        }
        let applied = *self.net.applied.lock().expect("applied id lock");
        rpc.leader_commit = std::cmp::min(rpc.leader_commit, applied);
        let n = rpc.entries.len() as u64;
        let payload = encode(&rpc)?;
        // One AppendEntries must reach a follower well within its timeout,
        // so it carries at most APPEND_TARGET_BYTES (one entry may be larger,
        // up to the message limit less headroom for gRPC framing).
        if payload.len() > APPEND_TARGET_BYTES && n > 1 {
            return Err(RPCError::PayloadTooLarge(PayloadTooLarge::new_entries_hint(n / 2)));
        }
        let timeout = self.timeout(&option);
        self.call(RPCTypes::AppendEntries, append_entries_kind(n), payload, timeout).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        let payload = encode(&rpc)?;
        let timeout = self.net.snapshot_timeout.min(option.hard_ttl());
        self.call(RPCTypes::InstallSnapshot, "install_snapshot", payload, timeout).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr<openraft::error::Infallible>> {
        let payload = encode(&rpc)?;
        let timeout = self.timeout(&option);
        self.call(RPCTypes::Vote, "vote", payload, timeout).await
    }

    /// How long the leader's stream to a peer that could not be reached
    /// waits before trying again. openraft's default, 500 ms, is longer than
    /// a rejoining replica waits before it campaigns: a replica back from a
    /// restart or a partition learns the new term from the first answer it
    /// gets, then starts an election once leader lease plus its election
    /// timeout (at least `election_timeout_max + election_timeout_min`) pass
    /// without an AppendEntries. Unheard for that long, it raised the term
    /// and unseated a healthy leader; and having lost that campaign for its
    /// shorter log, it kept openraft's "greater log seen" mark, which adds
    /// twice `election_timeout_max` to its next election, long after. A
    /// retry every `election_timeout_min` reaches it first.
    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(self.net.unreachable_retry))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that answers every vote with a grant.
    struct GrantingPeer;

    #[tonic::async_trait]
    impl rota_proto::raft::raft_server::Raft for GrantingPeer {
        async fn append_entries(&self, _: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
            Err(tonic::Status::unimplemented("votes only"))
        }

        async fn vote(&self, request: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
            let asked: VoteRequest<NodeId> = bincode::deserialize(&request.into_inner().payload).unwrap();
            let answer: Result<VoteResponse<NodeId>, RaftError<NodeId>> = Ok(VoteResponse::new(asked.vote, asked.last_log_id, true));
            Ok(tonic::Response::new(RaftMessage { payload: bincode::serialize(&answer).unwrap().into() }))
        }

        async fn install_snapshot(&self, _: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
            Err(tonic::Status::unimplemented("votes only"))
        }

        type AppendStreamStream = futures::stream::Empty<Result<RaftMessage, tonic::Status>>;

        async fn append_stream(
            &self,
            _: tonic::Request<tonic::Streaming<RaftMessage>>,
        ) -> Result<tonic::Response<Self::AppendStreamStream>, tonic::Status> {
            Err(tonic::Status::unimplemented("votes only"))
        }
    }

    /// A follower that accepts every AppendEntries and counts how they came:
    /// in calls of their own, or on streams (with or without streams, as a
    /// build before them; or ending each stream after its first answer).
    #[derive(Clone, Default)]
    struct AcceptingPeer {
        without_streams: bool,
        one_answer_per_stream: bool,
        counts: Arc<AppendCounts>,
    }

    /// How the AppendEntries an `AcceptingPeer` accepted came.
    #[derive(Default)]
    struct AppendCounts {
        /// In calls of their own.
        calls: std::sync::atomic::AtomicU32,
        /// Streams opened.
        streams: std::sync::atomic::AtomicU32,
        /// Requests answered on streams.
        streamed: std::sync::atomic::AtomicU32,
    }

    impl AppendCounts {
        fn get(&self) -> (u32, u32, u32) {
            use std::sync::atomic::Ordering::SeqCst;
            (self.calls.load(SeqCst), self.streams.load(SeqCst), self.streamed.load(SeqCst))
        }
    }

    fn accepted() -> RaftMessage {
        let answer: Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>> = Ok(AppendEntriesResponse::Success);
        RaftMessage { payload: bincode::serialize(&answer).unwrap().into() }
    }

    #[tonic::async_trait]
    impl rota_proto::raft::raft_server::Raft for AcceptingPeer {
        async fn append_entries(&self, _: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
            self.counts.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(tonic::Response::new(accepted()))
        }

        async fn vote(&self, _: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
            Err(tonic::Status::unimplemented("appends only"))
        }

        async fn install_snapshot(&self, _: tonic::Request<RaftMessage>) -> Result<tonic::Response<RaftMessage>, tonic::Status> {
            Err(tonic::Status::unimplemented("appends only"))
        }

        type AppendStreamStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<RaftMessage, tonic::Status>> + Send>>;

        async fn append_stream(
            &self,
            request: tonic::Request<tonic::Streaming<RaftMessage>>,
        ) -> Result<tonic::Response<Self::AppendStreamStream>, tonic::Status> {
            use futures::StreamExt;
            if self.without_streams {
                return Err(tonic::Status::unimplemented("an older build"));
            }
            self.counts.streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let take = if self.one_answer_per_stream { 1 } else { usize::MAX };
            let counts = self.counts.clone();
            let answers = request.into_inner().take(take).map(move |asked| {
                asked?;
                counts.streamed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(accepted())
            });
            Ok(tonic::Response::new(Box::pin(answers)))
        }
    }

    /// Sends `n` AppendEntries to `peer` and returns (calls, streams,
    /// streamed): how they came.
    async fn appends_to(peer: AcceptingPeer, n: u32) -> (u32, u32, u32) {
        let counts = peer.counts.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let service = rota_proto::raft::raft_server::RaftServer::new(peer);
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
        let timeout = Duration::from_secs(5);
        let peers = BTreeMap::from([(2, addr.clone())]);
        let mut factory = NetworkFactory::new(1, peers, timeout, timeout, Duration::from_millis(100), None, None);
        let mut client = factory.new_client(2, &BasicNode { addr }).await;
        for _ in 0..n {
            let asked =
                AppendEntriesRequest { vote: openraft::Vote::new_committed(3, 1), prev_log_id: None, entries: vec![], leader_commit: None };
            let answer = client.append_entries(asked, RPCOption::new(timeout)).await.expect("appended");
            assert!(matches!(answer, AppendEntriesResponse::Success));
        }
        counts.get()
    }

    #[tokio::test]
    async fn appends_share_one_stream() {
        let (calls, streams, streamed) = appends_to(AcceptingPeer::default(), 5).await;
        assert_eq!((calls, streams, streamed), (0, 1, 5), "every append on one stream, none in a call of its own");
    }

    /// A rolling upgrade: a follower on a build without the stream still
    /// gets every AppendEntries, one call each.
    #[tokio::test]
    async fn a_peer_without_streams_gets_appends_one_call_each() {
        let (calls, _, streamed) = appends_to(AcceptingPeer { without_streams: true, ..Default::default() }, 4).await;
        assert_eq!((calls, streamed), (4, 0));
    }

    /// A stream the peer ends (a restart, a broken connection) is replaced
    /// and the append that found it ended is sent again on the new one.
    #[tokio::test]
    async fn an_ended_stream_is_replaced_and_the_append_sent_again() {
        let (calls, streams, streamed) = appends_to(AcceptingPeer { one_answer_per_stream: true, ..Default::default() }, 3).await;
        assert_eq!((calls, streams, streamed), (0, 3, 3), "a new stream for each append, every append answered on one");
    }

    async fn granting_peer() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let service = rota_proto::raft::raft_server::RaftServer::new(GrantingPeer);
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
        addr
    }

    /// Where a connection that was cut ends: accepted, then closed.
    async fn cut_link() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        addr
    }

    /// A vote is sent once per election: one that fails on a broken
    /// connection goes again on a new one, or the candidate waits out its
    /// election timeout for nothing.
    #[tokio::test]
    async fn a_vote_that_fails_in_the_transport_is_sent_again_on_a_new_connection() {
        let (broken, live) = (cut_link().await, granting_peer().await);
        let made = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = made.clone();
        // The first connection to the peer is the broken one.
        let make: Arc<crate::MakeChannel> = Arc::new(move |_addr: &str, timeout: Duration| {
            let to = if counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 { &broken } else { &live };
            Ok(Endpoint::from_shared(format!("http://{to}")).map_err(|e| e.to_string())?.connect_timeout(timeout).connect_lazy())
        });
        let mut factory = NetworkFactory::new(
            1,
            BTreeMap::from([(2, "peer-2".to_string())]),
            Duration::from_secs(5),
            Duration::from_secs(5),
            Duration::from_millis(100),
            Some(PeerChannels(make)),
            None,
        );
        let mut peer = factory.new_client(2, &BasicNode { addr: "peer-2".into() }).await;
        let asked = VoteRequest::new(openraft::Vote::new(8, 1), None);
        let answer = peer.vote(asked, RPCOption::new(Duration::from_secs(5))).await.expect("answered on the second connection");
        assert!(answer.vote_granted);
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 2, "a new connection for the second try");
    }

    #[test]
    fn routes_parse_pairs_and_skip_malformed_ones() {
        let routes = parse_routes("127.0.0.1:1=127.0.0.1:9, junk ,=x,127.0.0.1:2=127.0.0.1:8");
        assert_eq!(routes.len(), 2);
        assert_eq!(routes["127.0.0.1:1"], "127.0.0.1:9");
        assert_eq!(routes["127.0.0.1:2"], "127.0.0.1:8");
    }
}
