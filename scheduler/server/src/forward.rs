//! Followers forward client requests to the leader, once: the forwarded
//! request carries `rota-forwarded`, and a replica that gets a forwarded
//! request while not leading answers UNAVAILABLE with the leader hint instead.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
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
/// How often a forwarded call looks whether the leader has fallen silent.
const SILENCE_POLL_MS: u64 = 20;
const CONNECT_TIMEOUT_MS: u64 = 1_000;
const MAX_CACHED_CHANNELS: usize = 16;

/// Whether the leader this replica knows has gone unheard for longer than
/// an election timeout.
pub type LeaderSilent = Arc<dyn Fn() -> bool + Send + Sync>;

pub struct Forwarder {
    security: Security,
    channels: Mutex<HashMap<String, Channel>>,
    leader_silent: LeaderSilent,
}

impl Forwarder {
    /// Forwards under this replica's own certificate; a forwarded call is
    /// abandoned once `leader_silent` says the leader fell silent.
    pub fn new(security: Security, leader_silent: LeaderSilent) -> Self {
        Self { security, channels: Mutex::new(HashMap::new()), leader_silent }
    }

    /// Wait for a forwarded call, or until the leader falls silent. A leader
    /// paused or cut off just after the call was forwarded says nothing, and
    /// the call would hang for its whole deadline while a new leader is
    /// elected; the caller (the same request id on every attempt) does
    /// better to hear "try another replica" and go to it.
    pub async fn unless_leader_falls_silent<T>(&self, call: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
        let silence = async {
            loop {
                tokio::time::sleep(Duration::from_millis(SILENCE_POLL_MS)).await;
                if (self.leader_silent)() {
                    return;
                }
            }
        };
        tokio::select! {
            outcome = call => outcome,
            () = silence => {
                metrics::counter!("rota_forwards_abandoned_total").increment(1);
                Err(Status::unavailable("the leader fell silent while this request was forwarded to it; try another replica"))
            }
        }
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
/// `forward` gets the leader's address and the request marked as forwarded;
/// its call is abandoned if the leader falls silent meanwhile.
pub async fn serve_or_forward<Req, Resp, HereFut, FwdFut>(
    forwarder: &Forwarder,
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
                forwarder.unless_leader_falls_silent(forward(addr, forwarded(message, actor.as_ref()))).await
            }
            Err(status) => Err(status),
        },
    };
    metrics::histogram!("rota_request_duration_seconds", "method" => method).record(started.elapsed().as_secs_f64());
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn forwarder(silent: Arc<AtomicBool>) -> Forwarder {
        Forwarder::new(Security::Plaintext, Arc::new(move || silent.load(Ordering::Relaxed)))
    }

    #[tokio::test]
    async fn a_call_forwarded_to_a_leader_that_falls_silent_ends_with_try_another() {
        let silent = Arc::new(AtomicBool::new(false));
        let forwarder = forwarder(silent.clone());
        let falls_silent = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            silent.store(true, Ordering::Relaxed);
            std::future::pending::<()>().await
        };
        let started = Instant::now();
        let hung_leader = std::future::pending::<Result<u32, Status>>();
        let outcome = tokio::select! {
            outcome = forwarder.unless_leader_falls_silent(hung_leader) => outcome,
            () = falls_silent => unreachable!(),
        };
        let status = outcome.expect_err("a hung leader's call cannot succeed");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
        assert!(started.elapsed() < Duration::from_secs(2), "ended {:?} after the call, not at its deadline", started.elapsed());
    }

    #[tokio::test]
    async fn a_leader_that_answers_is_waited_for() {
        let forwarder = forwarder(Arc::new(AtomicBool::new(false)));
        let slow_answer = async {
            tokio::time::sleep(Duration::from_millis(3 * SILENCE_POLL_MS)).await;
            Ok::<u32, Status>(7)
        };
        assert_eq!(forwarder.unless_leader_falls_silent(slow_answer).await.unwrap(), 7);
    }
}
