//! The server side of `rota.raft.v1.Raft`: decodes openraft requests and
//! hands them to the local Raft node, and notes when a leader was last heard.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, VoteRequest};
use rota_proto::raft::raft_server::{Raft, RaftServer};
use rota_proto::raft::RaftMessage;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use crate::campaign::Campaigner;
use crate::network::MAX_MESSAGE_BYTES;
use crate::types::{RaftHandle, TypeConfig};
use crate::NodeId;

/// When this replica last took entries, a heartbeat or a snapshot chunk
/// from a leader it accepts. openraft keeps no such time for a follower or
/// a learner, and a learner never campaigns, so it would name a leader
/// that is long gone as the one to forward to.
#[derive(Debug)]
pub struct LeaderContact {
    since: Instant,
    /// Milliseconds after `since` of the last contact.
    last_ms: AtomicU64,
}

impl LeaderContact {
    /// Counted as heard at creation: a replica that just started has not
    /// missed anything yet.
    pub fn new() -> LeaderContact {
        LeaderContact { since: Instant::now(), last_ms: AtomicU64::new(0) }
    }

    fn heard(&self) {
        self.last_ms.fetch_max(self.since.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Milliseconds since a leader was last heard.
    pub fn silent_ms(&self) -> u64 {
        (self.since.elapsed().as_millis() as u64).saturating_sub(self.last_ms.load(Ordering::Relaxed))
    }
}

impl Default for LeaderContact {
    fn default() -> Self {
        Self::new()
    }
}

/// tonic service for the Raft transport. Cheap to clone.
#[derive(Clone)]
pub struct RaftService {
    raft: RaftHandle,
    contact: Arc<LeaderContact>,
    campaigner: Arc<Campaigner>,
}

impl RaftService {
    pub(crate) fn new(raft: RaftHandle, contact: Arc<LeaderContact>, campaigner: Arc<Campaigner>) -> Self {
        Self { raft, contact, campaigner }
    }

    /// Wrap into a tonic server with the message size limits set.
    pub fn into_server(self) -> RaftServer<RaftService> {
        RaftServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

fn decode<T: DeserializeOwned>(req: Request<RaftMessage>, what: &str) -> Result<T, Status> {
    bincode::deserialize(&req.into_inner().payload).map_err(|e| Status::invalid_argument(format!("undecodable {what} request: {e}")))
}

fn reply<T: Serialize>(res: &T) -> Result<Response<RaftMessage>, Status> {
    let payload = bincode::serialize(res).map_err(|e| Status::internal(format!("encode raft reply: {e}")))?;
    Ok(Response::new(RaftMessage { payload }))
}

#[tonic::async_trait]
impl Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let req: AppendEntriesRequest<TypeConfig> = decode(request, "append_entries")?;
        let res = self.raft.append_entries(req).await;
        // A stale leader's append is refused (HigherVote): not a leader heard.
        if matches!(&res, Ok(answer) if !matches!(answer, AppendEntriesResponse::HigherVote(_))) {
            self.contact.heard();
        }
        reply(&res)
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let req: VoteRequest<NodeId> = decode(request, "vote")?;
        let res = self.raft.vote(req.clone()).await;
        if let Ok(answer) = &res {
            self.campaigner.after_vote(&req, answer);
        }
        reply(&res)
    }

    async fn install_snapshot(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let req: InstallSnapshotRequest<TypeConfig> = decode(request, "install_snapshot")?;
        let res = self.raft.install_snapshot(req).await;
        if res.is_ok() {
            self.contact.heard();
        }
        reply(&res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_counts_from_the_last_contact() {
        let contact = LeaderContact::new();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(contact.silent_ms() >= 20, "{}", contact.silent_ms());
        contact.heard();
        assert!(contact.silent_ms() < 20, "{}", contact.silent_ms());
    }
}
