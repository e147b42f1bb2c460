//! The server side of `rota.raft.v1.Raft`: decodes openraft requests and
//! hands them to the local Raft node, and notes when a leader was last heard.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, VoteRequest};
use rota_proto::raft::raft_server::{Raft, RaftServer};
use rota_proto::raft::RaftMessage;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status, Streaming};

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
    /// True once the replica shuts down (closed once it is gone).
    stopping: tokio::sync::watch::Receiver<bool>,
}

impl RaftService {
    pub(crate) fn new(
        raft: RaftHandle,
        contact: Arc<LeaderContact>,
        campaigner: Arc<Campaigner>,
        stopping: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        Self { raft, contact, campaigner, stopping }
    }

    /// Wrap into a tonic server with the message size limits set.
    pub fn into_server(self) -> RaftServer<RaftService> {
        RaftServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

fn decode_payload<T: DeserializeOwned>(payload: &[u8], what: &str) -> Result<T, Status> {
    bincode::deserialize(payload).map_err(|e| Status::invalid_argument(format!("undecodable {what} request: {e}")))
}

fn decode<T: DeserializeOwned>(req: Request<RaftMessage>, what: &str) -> Result<T, Status> {
    decode_payload(&req.into_inner().payload, what)
}

fn reply_payload<T: Serialize>(res: &T) -> Result<RaftMessage, Status> {
    let payload = bincode::serialize(res).map_err(|e| Status::internal(format!("encode raft reply: {e}")))?;
    Ok(RaftMessage { payload: payload.into() })
}

fn reply<T: Serialize>(res: &T) -> Result<Response<RaftMessage>, Status> {
    reply_payload(res).map(Response::new)
}

impl RaftService {
    /// One AppendEntries, asked in a call of its own or on a stream.
    async fn serve_append(&self, message: RaftMessage) -> Result<RaftMessage, Status> {
        let started = std::time::Instant::now();
        let req: AppendEntriesRequest<TypeConfig> = decode_payload(&message.payload, "append_entries")?;
        // Labelled as the leader labels its round trip, so the two split
        // the round trip into this replica's share and the network's.
        let label = append_entries_kind(req.entries.len() as u64);
        let res = self.raft.append_entries(req).await;
        crate::labelled::record("rota_raft_serve_seconds", "kind", label, started.elapsed().as_secs_f64());
        // A stale leader's append is refused (HigherVote): not a leader heard.
        if matches!(&res, Ok(answer) if !matches!(answer, AppendEntriesResponse::HigherVote(_))) {
            self.contact.heard();
        }
        reply_payload(&res)
    }
}

/// The answers of an AppendEntries stream.
type AppendAnswers = Pin<Box<dyn Stream<Item = Result<RaftMessage, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        self.serve_append(request.into_inner()).await.map(Response::new)
    }

    type AppendStreamStream = AppendAnswers;

    /// Each request is served once the one before it is answered: the
    /// leader sends one at a time, and the order of a follower's log is the
    /// order of its appends. The answers are computed as the stream is
    /// polled, in the stream's own task, so no task or queue stands
    /// between a request and its answer. A request that does not decode
    /// ends the stream with the error, as a call of its own would fail.
    /// The stream ends when this replica shuts down: the leader's stream
    /// never ends on its own, and a server stops only once its streams did.
    async fn append_stream(&self, request: Request<Streaming<RaftMessage>>) -> Result<Response<AppendAnswers>, Status> {
        let requests = request.into_inner();
        let answers = futures::stream::unfold(Some((self.clone(), requests)), |open| async move {
            let (mut service, mut requests) = open?;
            let asked = tokio::select! {
                asked = requests.message() => asked,
                _ = service.stopping.wait_for(|stopping| *stopping) => return None,
            };
            let message = match asked {
                Ok(Some(message)) => message,
                Ok(None) => return None,
                Err(status) => return Some((Err(status), None)),
            };
            match service.serve_append(message).await {
                Ok(answer) => Some((Ok(answer), Some((service, requests)))),
                Err(status) => Some((Err(status), None)),
            }
        });
        Ok(Response::new(Box::pin(answers)))
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
