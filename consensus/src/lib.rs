//! rota-consensus: openraft 0.9 (storage-v2) over RocksDB, with the Raft RPCs
//! carried by tonic. Generic over the replicated state machine: the log holds
//! opaque byte payloads and a [`StateMachine`] gives them meaning.
//!
//! Durability contract: a vote is on disk before `save_vote` returns, a
//! follower's log entries are fsynced before openraft is told they are
//! flushed, and a leader applies (and so acknowledges) an entry only once it
//! is fsynced on its own disk too, so an acknowledged write survives a crash
//! of every replica. A leader's own appends are reported flushed once
//! queued, so it replicates them while its disk syncs them; followers hear
//! of a commit only once the leader applied it (see `log_writer`).
//!
//! THIS FILE IS THE PUBLIC CONTRACT. Implementation lives in the modules.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub mod background;
mod campaign;
mod db;
mod error;
pub mod labelled;
mod leader_contact;
mod log_store;
mod log_writer;
mod network;
mod recovery;
mod replica;
mod service;
mod snapshot_file;
mod state_machine;
mod types;

pub use error::{ConsensusError, WriteError};
pub use log_store::LogStore;
pub use network::{failed_in_transport, NetworkFactory, PeerClient, MAX_MESSAGE_BYTES};
pub use recovery::{force_new_cluster, judge_force, restore_snapshot, ForcedCluster, Restored};
pub use replica::{raft_config, ClusterStatus, Exported, MemberStatus, Replica, Role, Written, DB_DIR, MAX_CONCURRENT_WALKS};
pub use service::RaftService;
pub use state_machine::{open_storage, SmData, StateMachineStore};
pub use types::{Entry, LogId, Payload, RaftHandle, SnapshotMeta, StoredMembership, TypeConfig};

/// Re-export of the openraft version this crate is built on.
pub use openraft;

/// A replica's id in the Raft group. Never reused for another replica.
pub type NodeId = u64;

/// The deterministic state machine that committed entries are applied to.
///
/// `apply` must be a pure function of the state and the payload: no clock,
/// no randomness, no I/O. Every replica applies the same entries in the same
/// order and must reach the same state.
///
/// The state lock is held only for what must be atomic with apply: taking a
/// frozen copy (`freeze`) and swapping in a decoded snapshot (`install`).
/// Encoding, decoding and checking a snapshot, and dropping a replaced
/// state, happen with the lock released, so neither a snapshot nor its
/// install stalls apply for longer than those two steps.
pub trait StateMachine: Send + Sync + 'static {
    /// A snapshot decoded and checked, ready to be installed.
    type Restored: Send + 'static;
    /// Apply one committed entry's payload at log `index`; the returned bytes
    /// are handed back to the writer of that entry (on the leader).
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8>;
    /// A point-in-time copy of the whole state, taken under the read lock
    /// (so it must be cheap: O(1) for a structurally shared state), and the
    /// work that encodes it, run after the lock is released.
    fn freeze(&self) -> Box<dyn FnOnce() -> Vec<u8> + Send>;
    /// Decode and check bytes made by `freeze`'s encoder. No lock is held.
    fn decode(bytes: &[u8]) -> Result<Self::Restored, String>;
    /// Replace the whole state with a decoded snapshot (under the write
    /// lock); returns what it replaced, to be dropped after the lock.
    fn install(&mut self, restored: Self::Restored) -> Self::Restored;

    /// Freeze and encode at once.
    fn snapshot(&self) -> Vec<u8> {
        (self.freeze())()
    }

    /// Decode and install at once.
    fn restore(&mut self, bytes: &[u8]) -> Result<(), String>
    where
        Self: Sized,
    {
        let restored = Self::decode(bytes)?;
        self.install(restored);
        Ok(())
    }
}

/// Settings of one replica.
#[derive(Debug, Clone)]
pub struct ConsensusConfig {
    pub node_id: NodeId,
    /// RocksDB lives under this directory, in `raft/` (created if missing).
    pub data_dir: PathBuf,
    /// Addresses (host:port) of the peers this replica knows from its own
    /// configuration. They take precedence over the addresses stored in the
    /// replicated membership, so a proxy can sit between replicas.
    pub peer_addrs: BTreeMap<NodeId, String>,
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many applied entries since the last one.
    pub snapshot_every_entries: u64,
    /// Log entries kept behind the last snapshot, so a slightly lagging
    /// replica catches up by log rather than by snapshot.
    pub keep_logs_behind_snapshot: u64,
    /// Timeout of one Raft RPC to a peer.
    pub rpc_timeout_ms: u64,
    pub install_snapshot_timeout_ms: u64,
    /// How a channel to a peer is made (TLS, certificates): the embedding
    /// program's business. None: plaintext.
    pub peer_channels: Option<PeerChannels>,
    /// Metadata added to every Raft RPC this replica sends (the embedder's
    /// cluster id, say, for the receiver to check).
    pub request_tags: Option<RequestTags>,
}

/// Makes a lazily connected channel to a peer's `host:port`, connecting
/// within the given timeout.
pub type MakeChannel = dyn Fn(&str, Duration) -> Result<tonic::transport::Channel, String> + Send + Sync;

/// The embedder's channel maker for Raft RPCs to peers.
#[derive(Clone)]
pub struct PeerChannels(pub Arc<MakeChannel>);

impl std::fmt::Debug for PeerChannels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerChannels")
    }
}

/// Adds the embedder's metadata to an outgoing Raft RPC.
pub type TagRequest = dyn Fn(&mut tonic::metadata::MetadataMap) + Send + Sync;

/// The embedder's tags for outgoing Raft RPCs.
#[derive(Clone)]
pub struct RequestTags(pub Arc<TagRequest>);

impl std::fmt::Debug for RequestTags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestTags")
    }
}

/// Default timings and log bounds (what `ConsensusConfig::new` sets, and the
/// defaults of `rota server`'s flags).
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 = 50;
pub const DEFAULT_ELECTION_TIMEOUT_MIN_MS: u64 = 100;
pub const DEFAULT_ELECTION_TIMEOUT_MAX_MS: u64 = 200;
pub const DEFAULT_SNAPSHOT_EVERY_ENTRIES: u64 = 20_000;
pub const DEFAULT_KEEP_LOGS_BEHIND_SNAPSHOT: u64 = 5_000;

impl ConsensusConfig {
    pub fn new(node_id: NodeId, data_dir: PathBuf) -> Self {
        Self {
            node_id,
            data_dir,
            peer_addrs: BTreeMap::new(),
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            election_timeout_min_ms: DEFAULT_ELECTION_TIMEOUT_MIN_MS,
            election_timeout_max_ms: DEFAULT_ELECTION_TIMEOUT_MAX_MS,
            snapshot_every_entries: DEFAULT_SNAPSHOT_EVERY_ENTRIES,
            keep_logs_behind_snapshot: DEFAULT_KEEP_LOGS_BEHIND_SNAPSHOT,
            rpc_timeout_ms: 1_000,
            install_snapshot_timeout_ms: 10_000,
            peer_channels: None,
            request_tags: None,
        }
    }
}
