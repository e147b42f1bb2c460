//! Followers forward client requests to the leader, once: the forwarded
//! request carries `rota-forwarded`, and a replica that gets a forwarded
//! request while not leading answers UNAVAILABLE with the leader hint instead.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_proto::v1::job_service_client::JobServiceClient;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use rota_consensus::{ConsensusError, WriteError};

use super::status::{write_error, FORWARDED_METADATA};

/// Deadline of one forwarded call; longer than an election, shorter than a client's patience.
const FORWARD_TIMEOUT_MS: u64 = 10_000;
const CONNECT_TIMEOUT_MS: u64 = 1_000;
const MAX_CACHED_CHANNELS: usize = 16;

#[derive(Default)]
pub struct Forwarder {
    channels: Mutex<HashMap<String, Channel>>,
}

impl Forwarder {
    fn channel(&self, addr: &str) -> Result<Channel, Status> {
        let mut channels = self.channels.lock().expect("channel cache lock");
        if let Some(channel) = channels.get(addr) {
            return Ok(channel.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| Status::unavailable(format!("bad leader address {addr}: {e}")))?
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .timeout(Duration::from_millis(FORWARD_TIMEOUT_MS));
        let channel = endpoint.connect_lazy();
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

    pub fn cluster(&self, addr: &str) -> Result<ClusterServiceClient<Channel>, Status> {
        Ok(ClusterServiceClient::new(self.channel(addr)?))
    }
}

pub fn is_forwarded<T>(request: &Request<T>) -> bool {
    request.metadata().contains_key(FORWARDED_METADATA)
}

pub fn forwarded<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(FORWARDED_METADATA, "1".parse().expect("ascii"));
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
pub fn forward_target(was_forwarded: bool, failure: Failure) -> Result<String, Status> {
    match failure {
        Failure::Status(status) => Err(status),
        Failure::NotLeader(WriteError::ForwardToLeader { leader_addr: Some(addr), .. }) if !was_forwarded => Ok(addr),
        Failure::NotLeader(error) => Err(write_error(&error)),
    }
}
