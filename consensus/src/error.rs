//! Errors of rota-consensus.

use crate::NodeId;

/// Failure of a replica-level operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConsensusError {
    /// The configuration is invalid.
    #[error("invalid consensus config: {0}")]
    Config(String),
    /// RocksDB or (de)serialization of persisted state failed.
    #[error("consensus storage: {0}")]
    Storage(String),
    /// This replica is not the leader; retry on `leader_id` / `leader_addr`.
    #[error("not the leader; forward to {leader_id:?} at {leader_addr:?}")]
    ForwardToLeader { leader_id: Option<NodeId>, leader_addr: Option<String> },
    /// A membership change was refused (e.g. another change in progress,
    /// or a voter that is not a learner yet).
    #[error("membership change refused: {0}")]
    Membership(String),
    /// Initialization was refused (e.g. this replica is not in the members).
    #[error("initialize refused: {0}")]
    Initialize(String),
    /// The Raft node stopped or failed (storage error, shut down, panicked).
    #[error("raft unavailable: {0}")]
    Unavailable(String),
}

/// Failure of [`crate::Replica::write`] / [`crate::Replica::ensure_linearizable`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// This replica is not the leader; retry on `leader_id` / `leader_addr`
    /// (both `None` while no leader is known).
    #[error("not the leader; forward to {leader_id:?} at {leader_addr:?}")]
    ForwardToLeader { leader_id: Option<NodeId>, leader_addr: Option<String> },
    /// The write could not be committed here (no quorum, shutting down,
    /// storage failure).
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl From<WriteError> for ConsensusError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::ForwardToLeader { leader_id, leader_addr } => ConsensusError::ForwardToLeader { leader_id, leader_addr },
            WriteError::Unavailable(s) => ConsensusError::Unavailable(s),
        }
    }
}
