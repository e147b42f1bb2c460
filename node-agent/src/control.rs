//! The agent's connection to the control plane: whichever replica leads.
//! Calls follow the `rota-leader` hint of an UNAVAILABLE answer, otherwise
//! move to the next endpoint, and back off with jitter between rounds. A
//! call retries until it succeeds: an agent never gives up on the control
//! plane; what happens to its jobs when it cannot is the lease rule of
//! `reconcile`, not this module's business. What
//! is worth retrying is rota-client's one retry policy (a background loop
//! retries every answer but a final one).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rota_client::retry::{self, Backoff};
pub use rota_client::wire::LEADER_METADATA;
use rota_client::wire::{CONNECT_TIMEOUT_MS, MAX_MESSAGE_BYTES};
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_tls::Security;
use tonic::transport::Channel;
use tonic::Status;

const CALL_TIMEOUT_MS: u64 = 5_000;
const FIRST_BACKOFF_MS: u64 = 50;
const MAX_BACKOFF_MS: u64 = 2_000;
const MAX_ENDPOINTS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("--endpoints: at least one and at most {MAX_ENDPOINTS} replica addresses")]
    Endpoints,
    #[error("--endpoints {0:?}: {1}")]
    BadEndpoint(String, String),
    /// An answer a retry cannot change (the request is wrong).
    #[error("{0}")]
    Refused(Status),
}

#[derive(Clone)]
pub struct ControlPlane {
    endpoints: Arc<Vec<String>>,
    channels: Arc<Vec<Channel>>,
    /// The endpoint believed to lead.
    current: Arc<AtomicUsize>,
}

impl ControlPlane {
    pub fn new(endpoints: &[String], security: &Security) -> Result<ControlPlane, ControlError> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .flat_map(|e| e.split(','))
            .map(|e| e.trim().trim_start_matches("http://").to_string())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() || endpoints.len() > MAX_ENDPOINTS {
            return Err(ControlError::Endpoints);
        }
        let channels = endpoints.iter().map(|e| channel(e, security)).collect::<Result<Vec<_>, _>>()?;
        Ok(ControlPlane { endpoints: Arc::new(endpoints), channels: Arc::new(channels), current: Arc::new(AtomicUsize::new(0)) })
    }

    pub fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }

    pub fn client_at(&self, i: usize) -> AgentServiceClient<Channel> {
        AgentServiceClient::new(self.channels[i % self.channels.len()].clone()).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Call until an answer comes: follow leader hints, rotate endpoints,
    /// back off with jitter. Only an answer no retry can change is an error.
    pub async fn call<T, F, Fut>(&self, what: &str, mut call: F) -> Result<T, ControlError>
    where
        F: FnMut(AgentServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut backoff = Backoff::new(FIRST_BACKOFF_MS, MAX_BACKOFF_MS);
        let mut failures = 0u64;
        loop {
            let target = self.current.load(Ordering::Relaxed) % self.endpoints.len();
            let outcome = tokio::time::timeout(Duration::from_millis(CALL_TIMEOUT_MS), call(self.client_at(target))).await;
            let status = match outcome {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) => status,
                Err(_) => Status::deadline_exceeded("call timed out"),
            };
            if !retry::worth_retrying_later(status.code()) {
                return Err(ControlError::Refused(status));
            }
            failures += 1;
            if failures % 20 == 1 {
                tracing::warn!(what, endpoint = %self.endpoints[target], error = %status.message(), failures, "control plane call failed; retrying");
            }
            match self.leader_hint(&status) {
                Some(leader) if leader != target => self.current.store(leader, Ordering::Relaxed),
                _ => {
                    self.current.store((target + 1) % self.endpoints.len(), Ordering::Relaxed);
                    tokio::time::sleep(retry::jittered(backoff.next_delay())).await;
                }
            }
        }
    }

    fn leader_hint(&self, status: &Status) -> Option<usize> {
        let leader = status.metadata().get(LEADER_METADATA)?.to_str().ok()?;
        self.endpoints.iter().position(|e| e == leader)
    }
}

/// Sleep between half and all of `ms` (rota-client's jitter).
pub async fn sleep_with_jitter(ms: u64) {
    tokio::time::sleep(retry::jittered(Duration::from_millis(ms.max(1)))).await;
}

fn channel(endpoint: &str, security: &Security) -> Result<Channel, ControlError> {
    let parsed = rota_tls::endpoint(endpoint).map_err(|e| ControlError::BadEndpoint(endpoint.to_string(), e.to_string()))?;
    Ok(security.channel(
        parsed
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(3))
            .keep_alive_while_idle(true),
    ))
}
