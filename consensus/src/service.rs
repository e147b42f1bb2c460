//! The server side of `rota.raft.v1.Raft`: decodes openraft requests and
//! hands them to the local Raft node, and notes when a leader was last heard.

use std::sync::Arc;

use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, VoteRequest};
use rota_proto::raft::raft_server::{Raft, RaftServer};
use rota_proto::raft::RaftMessage;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use crate::campaign::Campaigner;
use crate::leader_contact::LeaderContact;
use crate::network::{append_entries_kind, MAX_MESSAGE_BYTES};
use crate::types::{RaftHandle, TypeConfig};
use crate::NodeId;

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
    Ok(Response::new(RaftMessage { payload: payload.into() }))
}

#[tonic::async_trait]
impl Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let started = std::time::Instant::now();
        let req: AppendEntriesRequest<TypeConfig> = decode(request, "append_entries")?;
        // Labelled as the leader labels its round trip, so the two split
        // the round trip into this replica's share and the network's.
        let label = append_entries_kind(req.entries.len() as u64);
        let res = self.raft.append_entries(req).await;
        metrics::histogram!("rota_raft_serve_seconds", "kind" => label).record(started.elapsed().as_secs_f64());
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
