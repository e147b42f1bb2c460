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

use rota_client::hedge::{self, Hedging};
use rota_client::retry::{self, Backoff};
pub use rota_client::wire::LEADER_METADATA;
use rota_client::wire::{CONNECT_TIMEOUT_MS, MAX_MESSAGE_BYTES};
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_tls::Security;
use tonic::transport::Channel;
use tonic::Status;

const CALL_TIMEOUT_MS: u64 = 5_000;
/// A call unanswered this long is also sent to the next replica.
const HEDGE_AFTER_MS: u64 = 250;
const HEDGED_BACKOFF_MAX_MS: u64 = 200;
const FIRST_BACKOFF_MS: u64 = 50;
const MAX_BACKOFF_MS: u64 = 2_000;
const MAX_ENDPOINTS: usize = 16;
/// Most failure lines one call logs.
const MAX_FAILURE_LOGS: u64 = 50;

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
    pub async fn call<T, F, Fut>(&self, what: &str, call: F) -> Result<T, ControlError>
    where
        F: FnMut(AgentServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_with(what, false, call).await
    }

    /// `call`, each attempt hedged past a replica that hangs (see
    /// `hedging`): for heartbeats, which keep the node's lease and which
    /// only the leader takes (a follower refuses one at once, naming the
    /// leader), so a second attempt costs the leader nothing while it is
    /// slow. Reports and registrations are forwarded by followers and stay
    /// one attempt at a time, so a slow leader is not sent each twice.
    pub async fn call_hedged<T, F, Fut>(&self, what: &str, call: F) -> Result<T, ControlError>
    where
        F: FnMut(AgentServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_with(what, true, call).await
    }

    async fn call_with<T, F, Fut>(&self, what: &str, hedged: bool, mut call: F) -> Result<T, ControlError>
    where
        F: FnMut(AgentServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut backoff = Backoff::new(FIRST_BACKOFF_MS, MAX_BACKOFF_MS);
        let mut failures = 0u64;
        // What was logged last: a new kind of failure is logged at once
        // (the lease may hang on which replica said what), a repeat every
        // 20th time; at most `MAX_FAILURE_LOGS` lines a call.
        let mut logged: (u64, String) = (0, String::new());
        let mut at = |i: usize| call(self.client_at(i));
        loop {
            let current = self.current.load(Ordering::Relaxed) % self.endpoints.len();
            let (target, outcome) = if hedged && self.endpoints.len() > 1 {
                hedge::round(&self.hedging(), &mut at, current, |status| self.leader_hint(status)).await
            } else {
                let outcome = tokio::time::timeout(Duration::from_millis(CALL_TIMEOUT_MS), at(current)).await;
                (current, outcome.unwrap_or_else(|_| Err(Status::deadline_exceeded("call timed out"))))
            };
            let status = match outcome {
                Ok(response) => {
                    self.current.store(target, Ordering::Relaxed);
                    return Ok(response.into_inner());
                }
                Err(status) => status,
            };
            if !retry::worth_retrying_later(status.code()) {
                return Err(ControlError::Refused(status));
            }
            failures += 1;
            let new_kind = logged.1 != status.message();
            if logged.0 < MAX_FAILURE_LOGS && (new_kind || failures % 20 == 1) {
                tracing::warn!(what, endpoint = %self.endpoints[target], error = %status.message(), failures, "control plane call failed; retrying");
                logged = (logged.0 + 1, status.message().to_string());
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

    /// A heartbeat is safe to send twice, and a paused or cut-off leader
    /// would otherwise cost a whole call timeout of the node's lease.
    fn hedging(&self) -> Hedging {
        Hedging::within(
            self.endpoints.len(),
            Duration::from_millis(HEDGE_AFTER_MS),
            Duration::from_millis(CALL_TIMEOUT_MS),
            HEDGED_BACKOFF_MAX_MS,
        )
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
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(3))
            .keep_alive_while_idle(true),
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use rota_proto::v1 as pb;
    use rota_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
    use tonic::{Request, Response};

    use super::*;

    /// A replica that answers heartbeats and counts them.
    struct Answering {
        heartbeats: Arc<AtomicU32>,
    }

    #[tonic::async_trait]
    impl AgentService for Answering {
        async fn register_node(&self, _: Request<pb::RegisterNodeRequest>) -> Result<Response<pb::RegisterNodeResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn heartbeat(&self, _: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
            self.heartbeats.fetch_add(1, Ordering::SeqCst);
            Ok(Response::new(pb::HeartbeatResponse { ttl_ms: 1_000, ..Default::default() }))
        }

        type WatchAssignmentsStream = futures::stream::Empty<Result<pb::Assignments, Status>>;

        async fn watch_assignments(
            &self,
            _: Request<pb::WatchAssignmentsRequest>,
        ) -> Result<Response<Self::WatchAssignmentsStream>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn report_rank_events(
            &self,
            _: Request<pb::ReportRankEventsRequest>,
        ) -> Result<Response<pb::ReportRankEventsResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    /// A replica that accepts connections and never says a word (as a
    /// paused process does: the kernel still accepts for it).
    fn hung_replica() -> (std::net::TcpListener, String) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = listener.local_addr().expect("bound").to_string();
        (listener, addr)
    }

    async fn answering_replica(heartbeats: Arc<AtomicU32>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let addr = listener.local_addr().expect("bound").to_string();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let service = AgentServiceServer::new(Answering { heartbeats });
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
        addr
    }

    fn heartbeat(control: &ControlPlane) -> impl Future<Output = Result<pb::HeartbeatResponse, ControlError>> + '_ {
        control.call_hedged("heartbeat", |mut c| async move {
            c.heartbeat(pb::HeartbeatRequest { node: "n1".into(), ..Default::default() }).await
        })
    }

    /// The first endpoint hangs: a hedged heartbeat is answered by the next
    /// one long before a call's timeout (5 s) would have moved it there,
    /// and the next call starts at the replica that answered. Before
    /// heartbeats were hedged, the first took the whole timeout.
    #[tokio::test]
    async fn a_heartbeat_gets_past_a_hung_replica_well_within_a_call_timeout() {
        let (_hung, hung_addr) = hung_replica();
        let heartbeats = Arc::new(AtomicU32::new(0));
        let answering_addr = answering_replica(heartbeats.clone()).await;
        let control = ControlPlane::new(&[hung_addr, answering_addr], &Security::Plaintext).expect("two endpoints");
        let bound = Duration::from_millis(CALL_TIMEOUT_MS / 2);
        let answer = tokio::time::timeout(bound, heartbeat(&control)).await;
        let answer = answer.expect("answered before half a call timeout").expect("a heartbeat answer");
        assert_eq!(answer.ttl_ms, 1_000);
        assert_eq!(control.current.load(Ordering::SeqCst), 1, "the next call starts at the replica that answered");
        tokio::time::timeout(bound, heartbeat(&control)).await.expect("answered at once").expect("a heartbeat answer");
        assert_eq!(heartbeats.load(Ordering::SeqCst), 2);
    }

    /// A call that is not hedged waits on the replica it is at: the
    /// answering replica hears nothing while the first attempt hangs.
    #[tokio::test]
    async fn an_unhedged_call_is_not_sent_to_a_second_replica() {
        let (_hung, hung_addr) = hung_replica();
        let heartbeats = Arc::new(AtomicU32::new(0));
        let answering_addr = answering_replica(heartbeats.clone()).await;
        let control = ControlPlane::new(&[hung_addr, answering_addr], &Security::Plaintext).expect("two endpoints");
        let unhedged = control
            .call("heartbeat", |mut c| async move { c.heartbeat(pb::HeartbeatRequest { node: "n1".into(), ..Default::default() }).await });
        // Ten hedge delays without an answer: a hedge would have gone out.
        let outcome = tokio::time::timeout(Duration::from_millis(HEDGE_AFTER_MS * 10), unhedged).await;
        assert!(outcome.is_err(), "still waiting on the hung replica");
        assert_eq!(heartbeats.load(Ordering::SeqCst), 0, "nothing was sent to the second replica");
    }
}
