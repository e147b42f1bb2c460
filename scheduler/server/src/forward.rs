//! Followers forward client requests to the leader: the forwarded request
//! carries `rota-forwarded`, and a replica that gets a forwarded request
//! while not leading answers UNAVAILABLE with the leader hint instead of
//! forwarding it again. A follower that knows no live leader holds the
//! request while an election runs and passes it to the winner; one whose
//! leader falls silent with the request does the same (a few copies at
//! most, all under the request's id, so the leader makes each change once).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
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

use rota_consensus::{failed_in_transport, ConsensusError, WriteError};

use crate::status::{write_error, FORWARDED_METADATA};

/// Deadline of one forwarded call; longer than an election, shorter than a client's patience.
const FORWARD_TIMEOUT_MS: u64 = 10_000;
/// How often a forwarded call looks whether the leader has fallen silent.
const SILENCE_POLL_MS: u64 = 20;
const CONNECT_TIMEOUT_MS: u64 = 1_000;
const MAX_CACHED_CHANNELS: usize = 16;
/// Attempts of one call to a peer replica (see `Forwarder::ask_peer`).
const PEER_ATTEMPTS: u32 = 3;
/// Copies of one request a follower forwards at most (see `forward_to_leader`).
const FORWARD_ROUNDS: u32 = 4;

/// Whether the leader this replica knows has gone unheard for longer than
/// an election timeout.
pub type LeaderSilent = Arc<dyn Fn() -> bool + Send + Sync>;

/// The address of a live leader, other than one this replica could not
/// reach (the argument), once one is known; None when the replica gives up
/// waiting (see `rota_consensus::Replica::await_leader`).
pub type AwaitLeader = Arc<dyn Fn(Option<String>) -> Pin<Box<dyn Future<Output = Option<String>> + Send>> + Send + Sync>;

pub struct Forwarder {
    security: Security,
    channels: Mutex<HashMap<String, Channel>>,
    leader_silent: LeaderSilent,
    await_leader: AwaitLeader,
}

impl Forwarder {
    /// Forwards under this replica's own certificate; a forwarded call is
    /// abandoned once `leader_silent` says the leader fell silent, and a
    /// call that finds no leader waits for one through `await_leader`.
    pub fn new(security: Security, leader_silent: LeaderSilent, await_leader: AwaitLeader) -> Self {
        Self { security, channels: Mutex::new(HashMap::new()), leader_silent, await_leader }
    }

    /// Wait for a forwarded call, or until the leader falls silent (None). A
    /// leader paused or cut off just after the call was forwarded says
    /// nothing, and the call would hang for its whole deadline while a new
    /// leader is elected; the request does better to go to the new leader,
    /// or back to its caller as "try another replica".
    async fn until_leader_falls_silent<T>(&self, call: impl Future<Output = Result<T, Status>>) -> Option<Result<T, Status>> {
        let silence = async {
            loop {
                tokio::time::sleep(Duration::from_millis(SILENCE_POLL_MS)).await;
                if (self.leader_silent)() {
                    return;
                }
            }
        };
        tokio::select! {
            outcome = call => Some(outcome),
            () = silence => {
                metrics::counter!("rota_forwards_abandoned_total").increment(1);
                None
            }
        }
    }

    /// Ask the replica at `addr` through `call`, within `timeout` in all.
    /// An attempt that fails in the transport is made again at once, on a
    /// new channel (at most `PEER_ATTEMPTS` in all): a cached connection
    /// that broke while the link was down reports a failure to the next
    /// call even after the link is back, and reconnects only then. A new
    /// leader's first question to a peer just back from a partition is
    /// such a call, and losing its answer cost the leader a check round.
    pub async fn ask_peer<T, F, Fut>(&self, addr: &str, timeout: Duration, mut call: F) -> Result<T, Status>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let attempts = async {
            let mut attempt = 1;
            loop {
                let outcome = call(self.channel(addr)?).await;
                match outcome {
                    Err(status) if attempt < PEER_ATTEMPTS && failed_in_transport(&status) => {
                        tracing::debug!(peer = addr, attempt, %status, "a peer call failed in the transport; once more on a new connection");
                        self.forget_channel(addr);
                        attempt += 1;
                    }
                    outcome => return outcome,
                }
            }
        };
        tokio::time::timeout(timeout, attempts)
            .await
            .unwrap_or_else(|_| Err(Status::deadline_exceeded(format!("{addr} did not answer within {} ms", timeout.as_millis()))))
    }

    fn forget_channel(&self, addr: &str) {
        self.channels.lock().expect("channel cache lock").remove(addr);
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
fn forwarded<T>(message: T, actor: Option<&crate::authz::ForwardIdentity>) -> Request<T> {
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

/// Where a request this replica could not serve goes next.
enum Next {
    /// Forward it to the leader at this address.
    Forward(String),
    /// No live leader is known: wait for one, then forward it there (the
    /// status is the answer if none comes).
    AwaitLeader(Status),
    Answer(Status),
}

/// Where a request goes that this replica could not serve: a request
/// forwarded here already is answered, never forwarded again.
fn next_step(was_forwarded: bool, failure: Failure) -> Next {
    match failure {
        Failure::Status(status) => Next::Answer(status),
        Failure::NotLeader(error) if was_forwarded => Next::Answer(write_error(&error)),
        Failure::NotLeader(WriteError::ForwardToLeader { leader_addr: Some(addr), .. }) => Next::Forward(addr),
        Failure::NotLeader(error @ WriteError::ForwardToLeader { leader_addr: None, .. }) => Next::AwaitLeader(write_error(&error)),
        Failure::NotLeader(error) => Next::Answer(write_error(&error)),
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
    forward: impl Fn(String, Request<Req>) -> FwdFut,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    HereFut: Future<Output = Result<Resp, Failure>>,
    FwdFut: Future<Output = Result<Response<Resp>, Status>>,
{
    let started = Instant::now();
    let was_forwarded = is_forwarded(&request);
    let actor = request.extensions().get::<crate::authz::ForwardIdentity>().cloned();
    let message = request.into_inner();
    // The rare paths (waiting for a leader, forwarding) are boxed: inline,
    // their futures made every call's future larger (a submit's 10.5 KiB
    // against 7 KiB boxed), bytes moved on each call that never forwards.
    let result = match here(message.clone()).await {
        Ok(response) => Ok(Response::new(response)),
        Err(failure) => {
            let target = match next_step(was_forwarded, failure) {
                Next::Forward(addr) => Ok(addr),
                Next::AwaitLeader(no_leader) => Box::pin((forwarder.await_leader)(None)).await.ok_or(no_leader),
                Next::Answer(status) => Err(status),
            };
            match target {
                Ok(addr) => Box::pin(forward_to_leader(forwarder, method, addr, &message, actor.as_ref(), &forward)).await,
                Err(status) => Err(status),
            }
        }
    };
    rota_consensus::labelled::record("rota_request_duration_seconds", "method", method, started.elapsed().as_secs_f64());
    result
}

/// Forward a request to the leader at `addr`, at most `FORWARD_ROUNDS`
/// times in all, each copy under the request's own id (so the leader
/// changes nothing twice): again at once on a new connection if the call
/// failed in the transport (see `Forwarder::ask_peer`), and to the next
/// leader, once one is elected, if this one fell silent with the call or
/// failed in the transport twice in a row (a killed leader refuses
/// connections before its followers' election timers run out).
async fn forward_to_leader<Req, Resp, FwdFut>(
    forwarder: &Forwarder,
    method: &'static str,
    mut addr: String,
    message: &Req,
    actor: Option<&crate::authz::ForwardIdentity>,
    forward: &impl Fn(String, Request<Req>) -> FwdFut,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    FwdFut: Future<Output = Result<Response<Resp>, Status>>,
{
    let mut transport_failures = 0;
    for round in 1..=FORWARD_ROUNDS {
        tracing::debug!(method, leader = %addr, round, "forwarded to the leader");
        let outcome = forwarder.until_leader_falls_silent(forward(addr.clone(), forwarded(message.clone(), actor))).await;
        let last_round = round == FORWARD_ROUNDS;
        let failure = match outcome {
            Some(Err(status)) if !last_round && failed_in_transport(&status) => {
                forwarder.forget_channel(&addr);
                transport_failures += 1;
                if transport_failures < 2 {
                    continue;
                }
                status
            }
            Some(outcome) => return outcome,
            None => leader_fell_silent(),
        };
        if last_round {
            return Err(failure);
        }
        match (forwarder.await_leader)(Some(addr.clone())).await {
            Some(next) => addr = next,
            None => return Err(failure),
        }
        transport_failures = 0;
    }
    unreachable!("the last round returns")
}

fn leader_fell_silent() -> Status {
    Status::unavailable("the leader fell silent while this request was forwarded to it; try another replica")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn forwarder(silent: Arc<AtomicBool>) -> Forwarder {
        Forwarder::new(Security::Plaintext, Arc::new(move || silent.load(Ordering::Relaxed)), Arc::new(|_| Box::pin(async { None })))
    }

    #[tokio::test]
    async fn a_call_forwarded_to_a_leader_that_falls_silent_is_given_up() {
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
            outcome = forwarder.until_leader_falls_silent(hung_leader) => outcome,
            () = falls_silent => unreachable!(),
        };
        assert!(outcome.is_none(), "a hung leader's call cannot succeed");
        assert!(started.elapsed() < Duration::from_secs(2), "ended {:?} after the call, not at its deadline", started.elapsed());
    }

    #[tokio::test]
    async fn a_leader_that_answers_is_waited_for() {
        let forwarder = forwarder(Arc::new(AtomicBool::new(false)));
        let slow_answer = async {
            tokio::time::sleep(Duration::from_millis(3 * SILENCE_POLL_MS)).await;
            Ok::<u32, Status>(7)
        };
        assert_eq!(forwarder.until_leader_falls_silent(slow_answer).await.map(|o| o.unwrap()), Some(7));
    }

    /// A request served by a follower that names the leader at `leader`.
    pub(super) async fn served_by_follower_of<FwdFut>(
        forwarder: &Forwarder,
        leader: &str,
        forward: impl Fn(String, Request<u32>) -> FwdFut,
    ) -> Result<Response<u32>, Status>
    where
        FwdFut: Future<Output = Result<Response<u32>, Status>>,
    {
        let named = Failure::NotLeader(WriteError::ForwardToLeader { leader_id: Some(2), leader_addr: Some(leader.to_string()) });
        serve_or_forward(forwarder, "test", Request::new(1u32), |_| async { Err::<u32, _>(named) }, forward).await
    }

    fn no_leader() -> Failure {
        Failure::NotLeader(WriteError::ForwardToLeader { leader_id: None, leader_addr: None })
    }

    /// A forwarder whose replica learns of a leader at `leader` (or never).
    fn awaiting(leader: Option<&'static str>, waits: Arc<std::sync::atomic::AtomicU32>) -> Forwarder {
        Forwarder::new(
            Security::Plaintext,
            Arc::new(|| false),
            Arc::new(move |_| {
                waits.fetch_add(1, Ordering::Relaxed);
                Box::pin(async move { leader.map(str::to_string) })
            }),
        )
    }

    #[tokio::test]
    async fn a_request_that_finds_no_leader_goes_to_the_one_elected_meanwhile() {
        let waits = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let forwarder = awaiting(Some("10.0.0.2:7000"), waits.clone());
        let outcome = serve_or_forward(
            &forwarder,
            "test",
            Request::new(1u32),
            |_| async { Err::<u32, _>(no_leader()) },
            |addr, request: Request<u32>| async move {
                assert!(is_forwarded(&request), "passed on as a forwarded request");
                Ok(Response::new(if addr == "10.0.0.2:7000" { 42 } else { 0 }))
            },
        )
        .await;
        assert_eq!(outcome.map(Response::into_inner).map_err(|s| s.to_string()), Ok(42));
        assert_eq!(waits.load(Ordering::Relaxed), 1);
    }

    /// The leader falls silent with a forwarded request; the replica hears
    /// of the next leader and passes the request on to it.
    #[tokio::test]
    async fn a_request_held_by_a_leader_that_falls_silent_goes_to_the_next_one() {
        let silent = Arc::new(AtomicBool::new(false));
        let forwarder = Forwarder::new(
            Security::Plaintext,
            Arc::new({
                let silent = silent.clone();
                move || silent.load(Ordering::Relaxed)
            }),
            Arc::new({
                let silent = silent.clone();
                move |unreachable: Option<String>| {
                    assert_eq!(unreachable.as_deref(), Some("10.0.0.2:7000"), "the silent leader is not waited for");
                    // The new leader's first heartbeat ends the silence.
                    silent.store(false, Ordering::Relaxed);
                    Box::pin(async { Some("10.0.0.3:7000".to_string()) })
                }
            }),
        );
        let sent = Mutex::new(Vec::new());
        let outcome = served_by_follower_of(&forwarder, "10.0.0.2:7000", |addr, _| {
            sent.lock().unwrap().push(addr.clone());
            let silent = silent.clone();
            async move {
                if addr == "10.0.0.2:7000" {
                    silent.store(true, Ordering::Relaxed);
                    std::future::pending::<()>().await;
                }
                Ok(Response::new(42))
            }
        })
        .await;
        assert_eq!(outcome.map(Response::into_inner).map_err(|s| s.to_string()), Ok(42));
        assert_eq!(*sent.lock().unwrap(), ["10.0.0.2:7000", "10.0.0.3:7000"]);
    }

    #[tokio::test]
    async fn no_leader_after_the_wait_is_the_answer_and_a_forwarded_request_never_waits() {
        let waits = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let forwarder = awaiting(None, waits.clone());
        let never_forwarded = |_: String, _: Request<u32>| async { panic!("no leader: nothing to forward to") };
        let outcome =
            serve_or_forward(&forwarder, "test", Request::new(1u32), |_| async { Err::<u32, _>(no_leader()) }, never_forwarded).await;
        let status = outcome.expect_err("no leader came");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
        assert_eq!(waits.load(Ordering::Relaxed), 1);

        let forwarder = awaiting(Some("10.0.0.2:7000"), waits.clone());
        let mut request = Request::new(1u32);
        request.metadata_mut().insert(FORWARDED_METADATA, "1".parse().unwrap());
        let outcome = serve_or_forward(&forwarder, "test", request, |_| async { Err::<u32, _>(no_leader()) }, never_forwarded).await;
        assert_eq!(outcome.expect_err("forwarded once already").code(), tonic::Code::Unavailable);
        assert_eq!(waits.load(Ordering::Relaxed), 1, "a forwarded request is answered, not held");
    }
}

#[cfg(test)]
mod broken_link_tests {
    //! A call to a peer right after a link comes back. A call abandoned
    //! while its channel was reconnecting over a broken link (a clock probe
    //! dropped once a majority had answered, say) leaves the channel's
    //! failure waiting for the next call, which gets it at once, however
    //! long after the link came back.
    use super::*;
    use tokio::net::{TcpListener, TcpStream};
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    #[derive(Clone, Copy, PartialEq)]
    enum LinkState {
        Up,
        /// New connections are accepted and held, unanswered.
        Holding,
    }

    /// A TCP relay to a server that can drop its connections and hold new ones.
    struct Link {
        addr: String,
        state: Arc<Mutex<LinkState>>,
        cuts: tokio::sync::watch::Sender<u64>,
        held: Arc<Mutex<Vec<TcpStream>>>,
        held_changed: Arc<tokio::sync::Notify>,
    }

    impl Link {
        async fn start(target: String) -> Link {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let link = Link {
                addr: listener.local_addr().unwrap().to_string(),
                state: Arc::new(Mutex::new(LinkState::Up)),
                cuts: tokio::sync::watch::channel(0u64).0,
                held: Arc::default(),
                held_changed: Arc::default(),
            };
            let (state, cuts, held, held_changed) = (link.state.clone(), link.cuts.clone(), link.held.clone(), link.held_changed.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else { continue };
                    if *state.lock().unwrap() == LinkState::Holding {
                        held.lock().unwrap().push(inbound);
                        held_changed.notify_one();
                        continue;
                    }
                    let mut cut = cuts.subscribe();
                    let target = target.clone();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(&target).await else { return };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            });
            link
        }

        /// Drop every live connection; hold the new ones.
        fn break_and_hold(&self) {
            *self.state.lock().unwrap() = LinkState::Holding;
            self.cuts.send_modify(|generation| *generation += 1);
        }

        async fn wait_held(&self) {
            while self.held.lock().unwrap().is_empty() {
                tokio::time::timeout(Duration::from_secs(10), self.held_changed.notified()).await.expect("a connection attempt");
            }
        }

        /// Relay new connections again, then close the held ones.
        fn heal(&self) {
            *self.state.lock().unwrap() = LinkState::Up;
            self.held.lock().unwrap().clear();
        }
    }

    async fn health_server(security: &Security) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let incoming = security.incoming(listener).unwrap();
        let (_reporter, service) = tonic_health::server::health_reporter();
        tokio::spawn(async move {
            tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await.unwrap();
        });
        addr
    }

    fn tls(dir: &std::path::Path) -> Security {
        let ca = rota_tls::certs::create_ca(dir, 30).unwrap();
        let identity = rota_tls::Identity::new(rota_tls::IdentityKind::Replica, "1").unwrap();
        let own = rota_tls::certs::create_cert(dir, &identity, &[], 30).unwrap();
        Security::tls(&ca.cert, Some((&own.cert, &own.key))).unwrap()
    }

    async fn check(channel: Channel) -> Result<(), Status> {
        HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await.map(|_| ())
    }

    async fn a_call_after_the_link_is_back_is_answered(security: Security) {
        let link = Link::start(health_server(&security).await).await;
        let forwarder = Forwarder::new(security, Arc::new(|| false), Arc::new(|_| Box::pin(async { None })));
        let timeout = Duration::from_secs(10);
        forwarder.ask_peer(&link.addr, timeout, check).await.expect("answered while the link is up");

        link.break_and_hold();
        // A call on the broken connection fails at once; the one after
        // reconnects, and is abandoned while its connection is held.
        let mut abandoned = None;
        for _ in 0..5 {
            let mut call = tokio::spawn(check(forwarder.channel(&link.addr).unwrap()));
            tokio::select! {
                failed = &mut call => assert!(failed.unwrap().is_err(), "the link is broken"),
                () = link.wait_held() => {
                    call.abort();
                    abandoned = Some(call);
                    break;
                }
            }
        }
        let abandoned = abandoned.expect("a call that reconnected");
        assert!(abandoned.await.unwrap_err().is_cancelled());
        link.heal();
        // The held connection's end reaches the channel as a failed connect.
        tokio::time::sleep(Duration::from_millis(50)).await;

        forwarder.ask_peer(&link.addr, timeout, check).await.expect("answered once the link is back");
    }

    /// A killed leader refuses connections while its followers still
    /// count it as heard: the request is tried on it twice, then goes to
    /// the next leader elected.
    #[tokio::test]
    async fn a_request_for_a_leader_that_refuses_connections_goes_to_the_next_one() {
        let dead = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().to_string()
        };
        let live = "10.0.0.3:7000".to_string();
        let forwarder = Forwarder::new(Security::Plaintext, Arc::new(|| false), {
            let (dead, live) = (dead.clone(), live.clone());
            Arc::new(move |unreachable: Option<String>| {
                assert_eq!(unreachable.as_ref(), Some(&dead), "the refusing leader is not waited for");
                let live = live.clone();
                Box::pin(async move { Some(live) })
            })
        });
        let sent = Mutex::new(Vec::new());
        let outcome = super::tests::served_by_follower_of(&forwarder, &dead, |addr, _| {
            sent.lock().unwrap().push(addr.clone());
            let channel = forwarder.channel(&addr);
            async move {
                if addr == "10.0.0.3:7000" {
                    return Ok(Response::new(42));
                }
                check(channel?).await.map(|()| Response::new(0))
            }
        })
        .await;
        assert_eq!(outcome.map(Response::into_inner).map_err(|s| s.to_string()), Ok(42));
        assert_eq!(*sent.lock().unwrap(), [dead.clone(), dead, live]);
    }

    /// Over TLS the abandoned reconnect's failure (the handshake cut off)
    /// is what the next call gets; without the second attempt this fails.
    #[tokio::test]
    async fn a_peer_call_after_a_link_came_back_gets_its_answer() {
        let dir = tempfile::tempdir().unwrap();
        a_call_after_the_link_is_back_is_answered(tls(dir.path())).await;
    }
}
