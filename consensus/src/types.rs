//! openraft type configuration: opaque byte payloads, `u64` node ids and
//! `BasicNode { addr }` members.

use std::fmt;
use std::io::Cursor;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// One replicated log payload: opaque bytes that the [`crate::StateMachine`]
/// gives meaning to.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payload(pub Vec<u8>);

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Payload({} bytes)", self.0.len())
    }
}

impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "payload[{}B]", self.0.len())
    }
}

openraft::declare_raft_types!(
    /// rota's openraft type configuration.
    pub TypeConfig:
        D = Payload,
        R = Vec<u8>,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The openraft handle of a replica.
pub type RaftHandle = openraft::Raft<TypeConfig>;
/// A log id (leader term + node, index).
pub type LogId = openraft::LogId<NodeId>;
/// A membership as stored in the log / a snapshot.
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;
/// Snapshot metadata.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, openraft::BasicNode>;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// openraft's storage error for this type config.
pub type StorageError = openraft::StorageError<NodeId>;
