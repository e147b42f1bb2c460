//! [`Replica`]: one member of rota's Raft group (openraft node + RocksDB +
//! tonic transport), generic over the [`StateMachine`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use openraft::error::{CheckIsLeaderError, ClientWriteError, ForwardToLeader, InitializeError, RaftError};
use openraft::{BasicNode, Config, ServerState, SnapshotPolicy};
use rota_proto::raft::raft_server::RaftServer;
use tokio::sync::watch;

use crate::db::{open_db, DbClosed};
use crate::log_store::{LogStore, LogWatch};
use crate::network::NetworkFactory;
use crate::service::RaftService;
use crate::state_machine::{SmData, StateMachineStore};
use crate::types::{Payload, RaftHandle};
use crate::{ConsensusConfig, ConsensusError, NodeId, StateMachine, WriteError};

/// How often a replica waiting for a leader looks whether silence ended.
const LEADER_POLL_MS: u64 = 20;

/// Name of the RocksDB directory under `ConsensusConfig::data_dir`.
pub const DB_DIR: &str = "raft";

/// Result of a committed and applied [`Replica::write`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Log index of the entry.
    pub index: u64,
    /// What [`StateMachine::apply`] returned for it.
    pub response: Vec<u8>,
}

/// A point-in-time copy of the applied state (a backup), with the log id it
/// was applied up to and the membership then.
#[derive(Debug, Clone)]
pub struct Exported {
    pub last_applied: Option<crate::LogId>,
    pub membership: crate::StoredMembership,
    pub data: Vec<u8>,
}

/// Raft role of a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower,
    Candidate,
    Learner,
    Shutdown,
}

impl From<ServerState> for Role {
    fn from(s: ServerState) -> Self {
        match s {
            ServerState::Leader => Role::Leader,
            ServerState::Follower => Role::Follower,
            ServerState::Candidate => Role::Candidate,
            ServerState::Learner => Role::Learner,
            ServerState::Shutdown => Role::Shutdown,
        }
    }
}

/// One member of the group as seen by this replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    pub id: NodeId,
    /// Address used to reach it (configured peer address, else membership).
    pub addr: String,
    /// Voter (true) or learner (false).
    pub voter: bool,
    /// Highest log index known replicated to it; only known on the leader.
    pub matched_index: Option<u64>,
}

/// Point-in-time view of the group from this replica's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterStatus {
    pub id: NodeId,
    pub role: Role,
    pub leader_id: Option<NodeId>,
    pub term: u64,
    pub last_log_index: Option<u64>,
    /// Committed index as last persisted by this replica, if known.
    pub committed_index: Option<u64>,
    pub applied_index: Option<u64>,
    /// Last log index covered by this replica's current snapshot.
    pub snapshot_index: Option<u64>,
    /// Last purged log index.
    pub purged_index: Option<u64>,
    pub members: Vec<MemberStatus>,
}

struct Inner<S> {
    cfg: ConsensusConfig,
    raft: RaftHandle,
    network: NetworkFactory,
    state: Arc<RwLock<SmData<S>>>,
    applied_rx: watch::Receiver<u64>,
    committed: Arc<AtomicU64>,
    installed: Arc<AtomicU64>,
    db_closed: Mutex<Option<DbClosed>>,
    quorum_contact: Arc<std::sync::Mutex<QuorumContact>>,
    /// When a leader was last heard here (see `crate::leader_contact::LeaderContact`).
    leader_contact: Arc<crate::leader_contact::LeaderContact>,
    /// Off while this replica's clock is suspect (see `allow_elections`).
    elections_allowed: Arc<AtomicBool>,
    campaigner: Arc<crate::campaign::Campaigner>,
    /// Turns of [`Replica::read_detached`].
    walks: tokio::sync::Semaphore,
    /// How far the log is on disk, and its writer's stall (not the log
    /// store itself: holding it would keep the database open after shutdown).
    log: LogWatch,
    /// Set when this replica shuts down: ends the AppendEntries streams it
    /// serves (a server waits for its open streams before it stops).
    stopping: watch::Sender<bool>,
}

/// Walks over whole tables ([`Replica::read_detached`]) running at once at
/// most: each takes a background thread and, held beside the state, the
/// versions of the tables that apply replaces meanwhile.
pub const MAX_CONCURRENT_WALKS: usize = 2;

/// The leader's last known quorum acknowledgement: openraft reports its age
/// only when it publishes metrics, so the age is kept with the time it was read.
#[derive(Debug, Clone, Copy)]
struct QuorumContact {
    age_ms: Option<u64>,
    read_at: std::time::Instant,
}

/// Keep `contact` current from the metrics stream, until the replica stops.
async fn track_quorum_contact(raft: RaftHandle, contact: Arc<std::sync::Mutex<QuorumContact>>) {
    let mut metrics = raft.metrics();
    loop {
        let age_ms = metrics.borrow().millis_since_quorum_ack;
        *contact.lock().expect("quorum contact lock") = QuorumContact { age_ms, read_at: std::time::Instant::now() };
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// A replica of the Raft group. Cheap to clone.
pub struct Replica<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for Replica<S> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

/// Build and validate openraft's config from ours.
pub fn raft_config(cfg: &ConsensusConfig) -> Result<Config, ConsensusError> {
    let bad = |m: &str| Err(ConsensusError::Config(m.to_string()));
    if cfg.heartbeat_interval_ms == 0 {
        return bad("heartbeat_interval_ms must be > 0");
    }
    if cfg.heartbeat_interval_ms >= cfg.election_timeout_min_ms {
        return bad("heartbeat_interval_ms must be < election_timeout_min_ms");
    }
    if cfg.election_timeout_min_ms >= cfg.election_timeout_max_ms {
        return bad("election_timeout_min_ms must be < election_timeout_max_ms");
    }
    if cfg.snapshot_every_entries == 0 {
        return bad("snapshot_every_entries must be > 0");
    }
    if cfg.rpc_timeout_ms == 0 || cfg.install_snapshot_timeout_ms == 0 {
        return bad("rpc_timeout_ms and install_snapshot_timeout_ms must be > 0");
    }
    let c = Config {
        cluster_name: "rota".to_string(),
        heartbeat_interval: cfg.heartbeat_interval_ms,
        election_timeout_min: cfg.election_timeout_min_ms,
        election_timeout_max: cfg.election_timeout_max_ms,
        install_snapshot_timeout: cfg.install_snapshot_timeout_ms.max(cfg.rpc_timeout_ms),
        snapshot_policy: SnapshotPolicy::LogsSinceLast(cfg.snapshot_every_entries),
        max_in_snapshot_log_to_keep: cfg.keep_logs_behind_snapshot,
        purge_batch_size: cfg.snapshot_every_entries.clamp(1, 64),
        snapshot_max_chunk_size: 4 * 1024 * 1024,
        ..Config::default()
    };
    c.validate().map_err(|e| ConsensusError::Config(e.to_string()))
}

fn fatal(e: impl std::fmt::Display) -> ConsensusError {
    ConsensusError::Unavailable(e.to_string())
}

impl<S: StateMachine> Replica<S> {
    /// Open the replica's RocksDB under `cfg.data_dir` (restoring the
    /// persisted snapshot into `initial` and re-applying the committed log)
    /// and start its Raft node. Serve [`Replica::raft_service`] to let peers
    /// reach it.
    pub async fn open(cfg: ConsensusConfig, initial: S) -> Result<Self, ConsensusError> {
        let config = raft_config(&cfg)?;
        let (db, db_closed) = open_db(&cfg.data_dir.join(DB_DIR))?;
        let log = LogStore::new(db.clone(), cfg.node_id)?;
        let sm = StateMachineStore::new(db, initial, log.watch())?;
        let state = sm.state();
        let applied_rx = sm.applied_watch();
        let committed = log.committed_handle();
        let installed = sm.installed_handle();
        let log_handle = log.watch();
        let network = NetworkFactory::new(
            cfg.node_id,
            cfg.peer_addrs.clone(),
            Duration::from_millis(cfg.rpc_timeout_ms),
            Duration::from_millis(cfg.install_snapshot_timeout_ms),
            Duration::from_millis(cfg.election_timeout_min_ms),
            cfg.peer_channels.clone(),
            cfg.request_tags.clone(),
        )
        .bounding_commits_by(sm.applied_id(), sm.applied_watch());
        let raft = openraft::Raft::new(cfg.node_id, Arc::new(config), network.clone(), log, sm).await.map_err(fatal)?;
        let quorum_contact = Arc::new(std::sync::Mutex::new(QuorumContact { age_ms: None, read_at: std::time::Instant::now() }));
        tokio::spawn(track_quorum_contact(raft.clone(), quorum_contact.clone()));
        let leader_contact = Arc::new(crate::leader_contact::LeaderContact::new());
        let elections_allowed = Arc::new(AtomicBool::new(true));
        let campaigner = Arc::new(crate::campaign::Campaigner::new(
            raft.clone(),
            leader_contact.clone(),
            cfg.election_timeout_max_ms,
            cfg.election_timeout_min_ms / 2,
            elections_allowed.clone(),
        ));
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                raft,
                network,
                state,
                applied_rx,
                committed,
                installed,
                db_closed: Mutex::new(Some(db_closed)),
                quorum_contact,
                leader_contact,
                elections_allowed,
                campaigner,
                walks: tokio::sync::Semaphore::new(MAX_CONCURRENT_WALKS),
                log: log_handle,
                stopping: watch::channel(false).0,
            }),
        })
    }

    pub fn node_id(&self) -> NodeId {
        self.inner.cfg.node_id
    }

    pub fn config(&self) -> &ConsensusConfig {
        &self.inner.cfg
    }

    /// The underlying openraft node.
    pub fn raft(&self) -> &RaftHandle {
        &self.inner.raft
    }

    /// The shared in-memory state (application state + last applied + membership).
    pub fn state(&self) -> Arc<RwLock<SmData<S>>> {
        self.inner.state.clone()
    }

    /// Wait until the Raft node stops for good (a storage error, a panic in
    /// its core) and say why. A replica that cannot write its log must not
    /// linger as a member that answers but never acknowledges: the caller
    /// exits, and the service manager restarts it or an operator looks.
    pub async fn fatal(&self) -> String {
        let mut metrics = self.inner.raft.metrics();
        loop {
            if let Err(fatal) = &metrics.borrow().running_state {
                return fatal.to_string();
            }
            if metrics.changed().await.is_err() {
                return "the Raft node stopped".into();
            }
        }
    }

    /// Run `f` on the current application state under the read lock.
    pub fn read<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        let g = self.inner.state.read().unwrap_or_else(PoisonError::into_inner);
        let _hold = crate::state_machine::LockHold::new("read");
        f(&g.app)
    }

    /// Run `f` on what `copy` takes of the applied state under the read
    /// lock, after the lock is released and on a background thread: for
    /// reads that walk whole tables. Under the lock such a walk holds up
    /// apply, and every acknowledgement waiting for it, for as long as it
    /// takes; on an async worker it holds up the tasks queued behind it
    /// (the Raft core's among them), and at normal priority it takes the
    /// CPU the commit path needs. `copy` must be cheap (a structurally
    /// shared state clones in O(1)). At most [`MAX_CONCURRENT_WALKS`] run
    /// at once; the others wait their turn, and their copy is taken when it
    /// comes, so it is never older than the call.
    pub async fn read_detached<C, R>(
        &self,
        copy: impl FnOnce(&S) -> C,
        f: impl FnOnce(C) -> R + Send + 'static,
    ) -> Result<R, ConsensusError>
    where
        C: Send + 'static,
        R: Send + 'static,
    {
        let _turn = self.inner.walks.acquire().await.map_err(|_| ConsensusError::Unavailable("the replica is stopping".into()))?;
        let copied = self.read(copy);
        crate::background::run("rota-walk", move || f(copied)).await.map_err(ConsensusError::Unavailable)
    }

    /// Copy the applied state with its log id, under one read lock (so the
    /// copy is exactly the state at that index).
    pub fn export(&self) -> Exported {
        let (encode, last_applied, membership) = {
            let g = self.inner.state.read().unwrap_or_else(PoisonError::into_inner);
            let _hold = crate::state_machine::LockHold::new("export");
            (g.app.freeze(), g.last_applied, g.last_membership.clone())
        };
        Exported { last_applied, membership, data: encode() }
    }

    /// Last applied log index, updated after each applied batch or
    /// installed snapshot (0 before anything was applied).
    pub fn applied_watch(&self) -> watch::Receiver<u64> {
        self.inner.applied_rx.clone()
    }

    /// Wait until the applied index reaches `index`.
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> Result<(), ConsensusError> {
        let mut rx = self.applied_watch();
        let res = tokio::time::timeout(timeout, rx.wait_for(|&a| a >= index)).await.map(|r| r.map(|_| ()));
        match res {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(ConsensusError::Unavailable("state machine closed".into())),
            Err(_) => Err(ConsensusError::Unavailable(format!("applied index did not reach {index} within {timeout:?}"))),
        }
    }

    /// Number of snapshots received from a leader and installed since open.
    pub fn installed_snapshots(&self) -> u64 {
        self.inner.installed.load(Ordering::Acquire)
    }

    /// The tonic service peers call; add it to the public tonic server.
    /// Its decode/encode limits are set to [`crate::MAX_MESSAGE_BYTES`].
    pub fn raft_service(&self) -> RaftServer<RaftService> {
        RaftService::new(
            self.inner.raft.clone(),
            self.inner.leader_contact.clone(),
            self.inner.campaigner.clone(),
            self.inner.stopping.subscribe(),
        )
        .into_server()
    }

    pub async fn is_initialized(&self) -> bool {
        self.inner.raft.is_initialized().await.unwrap_or(false)
    }

    /// Initialize the group with `members` (id -> address) as voters. A
    /// no-op when this replica already has a log or membership.
    pub async fn initialize(&self, members: BTreeMap<NodeId, String>) -> Result<(), ConsensusError> {
        let nodes: BTreeMap<NodeId, BasicNode> = members.into_iter().map(|(id, addr)| (id, BasicNode { addr })).collect();
        match self.inner.raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(RaftError::APIError(e)) => Err(ConsensusError::Initialize(e.to_string())),
            Err(RaftError::Fatal(f)) => Err(fatal(f)),
        }
    }

    fn leader_addr(&self, leader_id: Option<NodeId>, node: Option<&BasicNode>) -> Option<String> {
        let id = leader_id?;
        self.inner.network.resolve(id, node).or_else(|| {
            let m = self.inner.raft.metrics();
            let m = m.borrow();
            m.membership_config.membership().get_node(&id).map(|n| n.addr.clone())
        })
    }

    fn forward(&self, f: ForwardToLeader<NodeId, BasicNode>) -> WriteError {
        let leader_id = f.leader_id.filter(|_| !self.leader_silent());
        WriteError::ForwardToLeader { leader_id, leader_addr: self.leader_addr(leader_id, f.leader_node.as_ref()) }
    }

    /// Has the leader this replica knows gone unheard for longer than an
    /// election timeout? Then it names no leader: a caller does better to
    /// try another replica at once than to be forwarded into silence (a
    /// follower's own election timer clears its leader too, but a learner
    /// has none). Also ends a call already forwarded to a leader that then
    /// fell silent. A replica that leads is never silent to itself: it
    /// hears no other leader, and a request it holds through the election
    /// it wins is forwarded to itself, which must not be taken for silence.
    pub fn leader_silent(&self) -> bool {
        self.leading_term().is_none() && self.inner.leader_contact.silent_ms() > self.inner.cfg.election_timeout_max_ms
    }

    /// The leader this replica hears from now, with its address: itself
    /// when it leads, else a leader heard within an election timeout.
    pub fn live_leader(&self) -> Option<(NodeId, String)> {
        let (id, node) = {
            let metrics = self.inner.raft.metrics();
            let m = metrics.borrow();
            let leader = m.current_leader?;
            let leads = m.state == ServerState::Leader && leader == m.id;
            if !leads && self.leader_silent() {
                return None;
            }
            (leader, m.membership_config.membership().get_node(&leader).cloned())
        };
        Some((id, self.leader_addr(Some(id), node.as_ref())?))
    }

    /// Wait for a live leader (see [`Replica::live_leader`]) other than
    /// one at `unreachable` (a leader this replica just failed to reach),
    /// for at most `silence_ms`, and only while the silence since it last
    /// heard a leader is under `silence_ms`. A follower asked for a write
    /// while an election runs does better to hold it until the winner is
    /// known and pass it on than to answer "no leader" and leave the caller
    /// polling: the caller would find the new leader only at its next
    /// retry, up to its longest backoff late. A replica that has heard no
    /// leader for longer (cut off, or elections failing) answers at once.
    pub async fn await_leader(&self, silence_ms: u64, unreachable: Option<&str>) -> Option<(NodeId, String)> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(silence_ms);
        let mut metrics = self.inner.raft.metrics();
        // Bounded by the deadline; the count is a second guard.
        for _ in 0..4 * (silence_ms / LEADER_POLL_MS + 1) {
            match self.live_leader() {
                Some((_, addr)) if Some(addr.as_str()) == unreachable => {}
                Some(leader) => return Some(leader),
                None => {}
            }
            if self.inner.leader_contact.silent_ms() >= silence_ms || tokio::time::Instant::now() >= deadline {
                return None;
            }
            // A new leader shows in the metrics; a leader heard again after
            // a pause, or one falling silent, does not: hence the poll.
            let poll = tokio::time::sleep(Duration::from_millis(LEADER_POLL_MS));
            tokio::select! {
                changed = metrics.changed() => if changed.is_err() { return None },
                () = poll => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
        None
    }

    /// Replicate `payload`; returns once it is committed and applied here
    /// (this replica must be the leader).
    pub async fn write(&self, payload: Vec<u8>) -> Result<Written, WriteError> {
        match self.inner.raft.client_write(Payload(payload)).await {
            Ok(resp) => Ok(Written { index: resp.log_id.index, response: resp.data }),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(self.forward(f)),
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(e))) => Err(WriteError::Unavailable(e.to_string())),
            Err(RaftError::Fatal(f)) => Err(WriteError::Unavailable(f.to_string())),
        }
    }

    /// Confirm leadership with a quorum and wait until everything committed
    /// before this call is applied here; reads after it are linearizable.
    pub async fn ensure_linearizable(&self) -> Result<(), WriteError> {
        match self.inner.raft.ensure_linearizable().await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => Err(self.forward(f)),
            Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e))) => Err(WriteError::Unavailable(e.to_string())),
            Err(RaftError::Fatal(f)) => Err(WriteError::Unavailable(f.to_string())),
        }
    }

    /// Snapshot of this replica's view of the group.
    /// On a leader: milliseconds since a quorum last acknowledged it (now,
    /// not as of the last metrics report). `None` on a non-leader, or before
    /// a first acknowledgement. A leader cut off from its followers sees this
    /// grow and should stop taking requests it cannot commit.
    pub fn quorum_contact_age_ms(&self) -> Option<u64> {
        let contact = *self.inner.quorum_contact.lock().expect("quorum contact lock");
        contact.age_ms.map(|age| age + contact.read_at.elapsed().as_millis() as u64)
    }

    /// The last log index on this replica's disk, if any. A leader's own
    /// entries may be ahead of it for the time of one sync (they go to the
    /// followers meanwhile); nothing is applied past it.
    pub fn durable_index(&self) -> Option<u64> {
        self.inner.log.durable.borrow().next_index.checked_sub(1)
    }

    /// TEST ONLY: hold this replica's log writes (`true`) until released
    /// (`false`), as a stalled disk would.
    #[doc(hidden)]
    pub fn stall_log_writes(&self, held: bool) {
        self.inner.log.shared.stall.set(held);
    }

    /// The current term if this replica leads it, else None. Cheap (no copy
    /// of the metrics, no member list): for checks made on every request.
    pub fn leading_term(&self) -> Option<u64> {
        let metrics = self.inner.raft.metrics();
        let m = metrics.borrow();
        (m.state == ServerState::Leader && m.current_leader == Some(m.id)).then_some(m.current_term)
    }

    pub fn status(&self) -> ClusterStatus {
        let m = self.inner.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let is_leader = m.state == ServerState::Leader;
        let members = membership
            .nodes()
            .map(|(id, node)| {
                let mut matched = m.replication.as_ref().and_then(|r| r.get(id).cloned()).flatten().map(|l| l.index);
                if *id == m.id && is_leader && matched.is_none() {
                    matched = m.last_log_index;
                }
                MemberStatus {
                    id: *id,
                    addr: self.inner.network.resolve(*id, Some(node)).unwrap_or_default(),
                    voter: voters.contains(id),
                    matched_index: matched,
                }
            })
            .collect();
        let committed = match self.inner.committed.load(Ordering::Acquire) {
            0 => None,
            n => Some(n - 1),
        };
        ClusterStatus {
            id: m.id,
            role: m.state.into(),
            leader_id: m.current_leader.filter(|_| is_leader || !self.leader_silent()),
            term: m.current_term,
            last_log_index: m.last_log_index,
            committed_index: committed,
            applied_index: m.last_applied.map(|l| l.index),
            snapshot_index: m.snapshot.map(|l| l.index),
            purged_index: m.purged.map(|l| l.index),
            members,
        }
    }

    fn map_change(&self, e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>) -> ConsensusError {
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => self.forward(f).into(),
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
                // openraft validates the change before checking leadership; a
                // non-leader cannot change membership either way.
                let (state, leader) = {
                    let m = self.inner.raft.metrics();
                    let m = m.borrow();
                    (m.state, m.current_leader)
                };
                if state != ServerState::Leader {
                    self.forward(ForwardToLeader { leader_id: leader, leader_node: None }).into()
                } else {
                    ConsensusError::Membership(e.to_string())
                }
            }
            RaftError::Fatal(f) => fatal(f),
        }
    }

    /// Add `id` at `addr` as a learner; returns once it has caught up.
    pub async fn add_learner(&self, id: NodeId, addr: String) -> Result<(), ConsensusError> {
        self.inner.raft.add_learner(id, BasicNode { addr }, true).await.map(|_| ()).map_err(|e| self.map_change(e))
    }

    /// Make `voters` the voter set (each must already be a member). Removed
    /// voters leave the group.
    pub async fn change_membership(&self, voters: BTreeSet<NodeId>) -> Result<(), ConsensusError> {
        self.inner.raft.change_membership(voters, false).await.map(|_| ()).map_err(|e| self.map_change(e))
    }

    /// Build a snapshot now (asynchronously).
    pub async fn trigger_snapshot(&self) -> Result<(), ConsensusError> {
        self.inner.raft.trigger().snapshot().await.map_err(fatal)
    }

    /// Let this replica's election timer start campaigns (the default), or
    /// not: a replica that knows it must not lead stays a follower for as
    /// long as it is told to, and never wins an election it did not start.
    pub fn allow_elections(&self, allowed: bool) {
        self.inner.elections_allowed.store(allowed, Ordering::Release);
        self.inner.raft.runtime_config().elect(allowed);
    }

    /// Start an election now.
    pub async fn trigger_elect(&self) -> Result<(), ConsensusError> {
        self.inner.raft.trigger().elect().await.map_err(fatal)
    }

    /// Stop the Raft node and wait until its RocksDB is closed, so the data
    /// dir can be reopened.
    pub async fn shutdown(&self) -> Result<(), ConsensusError> {
        self.inner.stopping.send_replace(true);
        self.inner.raft.shutdown().await.map_err(fatal)?;
        let closed = self.inner.db_closed.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(closed) = closed {
            // The sender is dropped (not sent) right after RocksDB closed.
            if tokio::time::timeout(Duration::from_secs(30), closed).await.is_err() {
                return Err(ConsensusError::Storage("storage still open 30s after shutdown".into()));
            }
        }
        Ok(())
    }
}
