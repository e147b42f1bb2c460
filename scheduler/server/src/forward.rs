//! Followers forward client requests to the leader, once: the forwarded
//! request carries `rota-forwarded`, and a replica that gets a forwarded
//! request while not leading answers UNAVAILABLE with the leader hint instead.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_proto::v1::auth_service_client::AuthServiceClient;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_proto::v1::job_service_client::JobServiceClient;
use rota_proto::v1::node_agent_service_client::NodeAgentServiceClient;
use rota_tls::Security;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use rota_consensus::{ConsensusError, WriteError};

use crate::status::{write_error, FORWARDED_METADATA};

/// Deadline of one forwarded call; longer than an election, shorter than a client's patience.
const FORWARD_TIMEOUT_MS: u64 = 10_000;
const CONNECT_TIMEOUT_MS: u64 = 1_000;
const MAX_CACHED_CHANNELS: usize = 16;

pub struct Forwarder {
    security: Security,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Forwarder {
    /// Forwards under this replica's own certificate.
    pub fn new(security: Security) -> Self {
        Self { security, channels: Mutex::new(HashMap::new()) }
    }

    fn channel(&self, addr: &str) -> Result<Channel, Status> {
        let mut channels = self.channels.lock().expect("channel cache lock");
        if let Some(channel) = channels.get(addr) {
            return Ok(channel.clone());
        }
        let endpoint = rota_tls::endpoint(addr)
            .map_err(|e| Status::unavailable(format!("bad leader address {addr}: {e}")))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .timeout(Duration::from_millis(FORWARD_TIMEOUT_MS));
        let channel = self.security.channel(endpoint);
        if channels.len() >= MAX_CACHED_CHANNELS {
            channels.clear();
        }
        channels.insert(addr.to_string(), channel.clone());
        Ok(channel)
    }

    pub fn jobs(&self, addr: &str) -> Result<JobServiceClient<Channel>, Status> {
        Ok(JobServiceClient::new(self.channel(addr)?).max_decoding_message_size(super::MAX_MESSAGE_BYTES))
    }

    pub fn agents(&self, addr: &str) -> Result<AgentServiceClient<Channel>, Status> {
        Ok(AgentServiceClient::new(self.channel(addr)?).max_decoding_message_size(super::MAX_MESSAGE_BYTES))
    }

    /// The log service of `node`'s agent at `addr`, under this replica's
    /// certificate; the server must show that node's agent certificate.
    pub fn agent_logs(&self, addr: &str, node: &str) -> Result<NodeAgentServiceClient<Channel>, Status> {
        let agent = rota_tls::Identity::new(rota_tls::IdentityKind::Agent, node)
            .map_err(|e| Status::failed_precondition(format!("node name {node:?}: {e}")))?;
        let security = self
            .security
            .expecting(rota_tls::ServerIdentity::Exactly(agent))
            .map_err(|e| Status::internal(format!("TLS setup for node {node}: {e}")))?;
        let endpoint = rota_tls::endpoint(addr)
            .map_err(|e| Status::unavailable(format!("node {node} has a bad address {addr}: {e}")))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS));
        Ok(NodeAgentServiceClient::new(security.channel(endpoint)))
    }

    pub fn auth(&self, addr: &str) -> Result<AuthServiceClient<Channel>, Status> {
        Ok(AuthServiceClient::new(self.channel(addr)?))
    }

    pub fn cluster(&self, addr: &str) -> Result<ClusterServiceClient<Channel>, Status> {
        Ok(ClusterServiceClient::new(self.channel(addr)?))
    }
}

fn is_forwarded<T>(request: &Request<T>) -> bool {
    request.metadata().contains_key(FORWARDED_METADATA)
}

/// The message as a forwarded request, carrying the actor the handler
/// resolved (if it put one in the request's extensions).
fn forwarded<T>(message: T, actor: Option<&rota_core::state::auth::Actor>) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(FORWARDED_METADATA, "1".parse().expect("ascii"));
    // The leader serves it under the same request id (see `request_id`).
    if let Some(id) = crate::request_id::current().and_then(|id| id.parse().ok()) {
        request.metadata_mut().insert(rota_client::wire::REQUEST_ID_METADATA, id);
    }
    if let Some(actor) = actor {
        crate::authz::mark_forwarded(request.metadata_mut(), actor);
    }
    request
}

/// Why a request was not served here: a status for the client, or "not the
/// leader", which the caller may turn into a forward.
pub enum Failure {
    Status(Status),
    NotLeader(WriteError),
}

impl From<Status> for Failure {
    fn from(status: Status) -> Self {
        Failure::Status(status)
    }
}

impl From<WriteError> for Failure {
    fn from(error: WriteError) -> Self {
        match error {
            WriteError::ForwardToLeader { .. } => Failure::NotLeader(error),
            other => Failure::Status(write_error(&other)),
        }
    }
}

impl From<ConsensusError> for Failure {
    fn from(error: ConsensusError) -> Self {
        match error {
            ConsensusError::ForwardToLeader { leader_id, leader_addr } => {
                Failure::NotLeader(WriteError::ForwardToLeader { leader_id, leader_addr })
            }
            ConsensusError::Membership(message) => Failure::Status(Status::failed_precondition(message)),
            other => Failure::Status(Status::unavailable(other.to_string())),
        }
    }
}

/// The leader's address, if this request may still be forwarded there.
fn forward_target(was_forwarded: bool, failure: Failure) -> Result<String, Status> {
    match failure {
        Failure::Status(status) => Err(status),
        Failure::NotLeader(WriteError::ForwardToLeader { leader_addr: Some(addr), .. }) if !was_forwarded => Ok(addr),
        Failure::NotLeader(error) => Err(write_error(&error)),
    }
}

/// Serve a request on this replica, or forward it once to the leader: every
/// service method goes through here, so the rule "forwarded at most once,
/// else UNAVAILABLE with the leader hint" lives in one place, and every
/// method's latency lands in `rota_request_duration_seconds{method}`.
///
/// `here` gets a copy of the message (the original is what is forwarded);
/// `forward` gets the leader's address and the request marked as forwarded.
pub async fn serve_or_forward<Req, Resp, HereFut, FwdFut>(
    method: &'static str,
    request: Request<Req>,
    here: impl FnOnce(Req) -> HereFut,
    forward: impl FnOnce(String, Request<Req>) -> FwdFut,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    HereFut: Future<Output = Result<Resp, Failure>>,
    FwdFut: Future<Output = Result<Response<Resp>, Status>>,
{
    let started = Instant::now();
    let was_forwarded = is_forwarded(&request);
    let actor = request.extensions().get::<rota_core::state::auth::Actor>().cloned();
    let message = request.into_inner();
    let result = match here(message.clone()).await {
        Ok(response) => Ok(Response::new(response)),
        Err(failure) => match forward_target(was_forwarded, failure) {
            Ok(addr) => {
                tracing::debug!(method, leader = %addr, "forwarded to the leader");
                forward(addr, forwarded(message, actor.as_ref())).await
            }
            Err(status) => Err(status),
        },
    };
    metrics::histogram!("rota_request_duration_seconds", "method" => method).record(started.elapsed().as_secs_f64());
    result
}
