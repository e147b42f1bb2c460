//! A client of the rota.v1 API that follows the leader: it tries the given
//! endpoints in turn, jumps to the leader named in an UNAVAILABLE answer, and
//! retries with backoff inside a deadline, so a user never sees "not leader"
//! and a failover looks like a short delay.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rota_proto::v1 as pb;
use rota_proto::v1::auth_service_client::AuthServiceClient;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_proto::v1::event_service_client::EventServiceClient;
use rota_proto::v1::job_service_client::JobServiceClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Code, Status};

use rota_tls::Security;

use crate::hedge::Hedging;
use crate::retry::{self, Backoff};
use crate::wire::{self, LEADER_METADATA, MAX_MESSAGE_BYTES};

const FIRST_BACKOFF_MS: u64 = 25;
/// An idempotent call unanswered this long is also sent to the next
/// replica: a replica that is paused or cut off accepts connections and
/// then says nothing, and waiting out a whole attempt on it is what makes a
/// failover slow for a client.
const HEDGE_AFTER_MS: u64 = 250;
/// Longest wait between a hedged round's retries (its attempt cap follows
/// from it and the round's timeout: `Hedging::within`).
const HEDGED_BACKOFF_MAX_MS: u64 = 200;
/// Longest wait between rounds (jittered down to half). The replicas
/// answering "no leader" while an election runs answer at once and
/// cheaply; a client that had backed off to a second would find the new
/// leader (elected a few hundred ms after the old one went) up to a second
/// late, and the wait is most of a failover as a client sees it.
const MAX_BACKOFF_MS: u64 = 100;
/// Most endpoints a client is given; a cluster has at most 7 replicas.
const MAX_ENDPOINTS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no endpoints given (use --endpoints or ROTA_ENDPOINTS)")]
    NoEndpoints,
    #[error("too many endpoints ({0}); at most {MAX_ENDPOINTS}")]
    TooManyEndpoints(usize),
    #[error("bad endpoint {0:?}: {1}")]
    BadEndpoint(String, String),
    #[error("bad credentials: {0}")]
    BadCredentials(String),
    #[error("{}: {}", code_name(.0.code()), .0.message())]
    Status(Status),
    #[error("gave up after {elapsed_ms} ms and {attempts} attempts; last error: {last}")]
    GaveUp { elapsed_ms: u64, attempts: u32, last: Status },
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "invalid argument",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::ResourceExhausted => "resource exhausted",
        Code::FailedPrecondition => "failed precondition",
        Code::Unavailable => "unavailable",
        Code::DeadlineExceeded => "deadline exceeded",
        Code::Unauthenticated => "unauthenticated",
        Code::PermissionDenied => "permission denied",
        _ => "error",
    }
}

impl ClientError {
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Status(status) | ClientError::GaveUp { last: status, .. } => Some(status.code()),
            _ => None,
        }
    }
}

tokio::task_local! {
    /// The request id of the call this task makes (see `Client::attempts`):
    /// every attempt of one call carries it, hedged ones included.
    static CALL_ID: MetadataValue<Ascii>;
}

/// What a client adds to every request beyond its certificate: a bearer
/// token (for a client without a certificate) and the user it acts for
/// (`rota-as`, for portals holding the impersonate permission).
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    bearer: Option<MetadataValue<Ascii>>,
    act_as: Option<MetadataValue<Ascii>>,
    /// One id for every call this client makes (see `wire::REQUEST_ID_METADATA`).
    request_id: Option<MetadataValue<Ascii>>,
}

impl Credentials {
    pub fn new(token: Option<&str>, act_as: Option<&str>) -> Result<Credentials, ClientError> {
        let value = |what: &str, text: String| {
            MetadataValue::try_from(text).map_err(|_| ClientError::BadCredentials(format!("{what}: must be printable ASCII")))
        };
        Ok(Credentials {
            bearer: token.map(|t| value("token", format!("Bearer {}", t.trim()))).transpose()?,
            act_as: act_as.map(|u| value("as", u.to_string())).transpose()?,
            request_id: Some(value("request id", wire::new_request_id())?),
        })
    }
}

impl Credentials {
    /// Carry `id` (a caller's own, e.g. a portal's) instead of a fresh one.
    pub fn with_request_id(mut self, id: &str) -> Result<Credentials, ClientError> {
        if !wire::is_request_id(id) {
            let limit = wire::MAX_REQUEST_ID_BYTES;
            return Err(ClientError::BadCredentials(format!("request id: 1 to {limit} letters, digits, '-', '_' or '.'; got {id:?}")));
        }
        self.request_id = Some(MetadataValue::try_from(id).map_err(|_| ClientError::BadCredentials("request id: not ASCII".into()))?);
        Ok(self)
    }

    /// The id every call of this client carries, for finding them in the replicas' logs.
    pub fn request_id(&self) -> &str {
        self.request_id.as_ref().and_then(|id| id.to_str().ok()).unwrap_or_default()
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(bearer) = &self.bearer {
            request.metadata_mut().insert("authorization", bearer.clone());
        }
        if let Some(act_as) = &self.act_as {
            request.metadata_mut().insert(wire::ACT_AS_METADATA, act_as.clone());
        }
        if let Some(id) = CALL_ID.try_with(Clone::clone).ok().or_else(|| self.request_id.clone()) {
            request.metadata_mut().insert(wire::REQUEST_ID_METADATA, id);
        }
        Ok(request)
    }
}

/// A channel whose requests carry the client's credentials.
pub type Authed = InterceptedService<Channel, Credentials>;

#[derive(Clone)]
pub struct Client {
    endpoints: Vec<String>,
    security: Security,
    channels: Vec<Channel>,
    credentials: Credentials,
    /// How long one call may keep retrying.
    pub deadline: Duration,
    /// Timeout of one attempt.
    pub attempt_timeout: Duration,
    /// When an idempotent call is also sent to a second replica.
    pub hedge_after: Duration,
    /// The endpoint that answered last: the next call starts there.
    answered: Arc<AtomicUsize>,
    /// Calls made so far (clones share it), numbering their request ids.
    calls: Arc<AtomicU64>,
}

/// No endpoint has answered yet.
const NONE_ANSWERED: usize = usize::MAX;

impl Client {
    /// `endpoints`: host:port of replicas, comma separated or listed.
    /// `security`: TLS with the CA (and a client certificate), or plaintext
    /// for a cluster started `--insecure`.
    pub fn new(endpoints: &[String], security: &Security) -> Result<Client, ClientError> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .flat_map(|e| e.split(','))
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| e.trim_start_matches("http://").to_string())
            .collect();
        if endpoints.is_empty() {
            return Err(ClientError::NoEndpoints);
        }
        if endpoints.len() > MAX_ENDPOINTS {
            return Err(ClientError::TooManyEndpoints(endpoints.len()));
        }
        let channels = endpoints.iter().map(|e| channel(e, security)).collect::<Result<Vec<_>, _>>()?;
        Ok(Client {
            endpoints,
            security: security.clone(),
            channels,
            credentials: Credentials::default(),
            deadline: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(3),
            hedge_after: Duration::from_millis(HEDGE_AFTER_MS),
            answered: Arc::new(AtomicUsize::new(NONE_ANSWERED)),
            calls: Arc::new(AtomicU64::new(0)),
        })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// How this client connects, for connections of its own (an agent's
    /// log service, a benchmark's channels).
    pub fn security(&self) -> &Security {
        &self.security
    }

    /// Send `credentials` with every request.
    pub fn with_credentials(mut self, credentials: Credentials) -> Client {
        self.credentials = credentials;
        self
    }

    fn authed(&self, i: usize) -> Authed {
        InterceptedService::new(self.channels[i].clone(), self.credentials.clone())
    }

    pub fn jobs_at(&self, i: usize) -> JobServiceClient<Authed> {
        JobServiceClient::new(self.authed(i)).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn cluster_at(&self, i: usize) -> ClusterServiceClient<Authed> {
        ClusterServiceClient::new(self.authed(i))
    }

    pub fn events_at(&self, i: usize) -> EventServiceClient<Authed> {
        EventServiceClient::new(self.authed(i)).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    pub fn auth_at(&self, i: usize) -> AuthServiceClient<Authed> {
        AuthServiceClient::new(self.authed(i))
    }

    /// The endpoint that answered last, if any (the CLI keeps it between runs).
    pub fn last_answered(&self) -> Option<&str> {
        self.endpoints.get(self.answered.load(Ordering::Relaxed)).map(String::as_str)
    }

    /// Start the next call at `endpoint` (one of this client's).
    pub fn prefer(&self, endpoint: &str) {
        if let Some(i) = self.endpoints.iter().position(|e| e == endpoint) {
            self.answered.store(i, Ordering::Relaxed);
        }
    }

    fn first_target(&self) -> usize {
        let answered = self.answered.load(Ordering::Relaxed);
        if answered < self.endpoints.len() {
            answered
        } else {
            0
        }
    }

    /// Run `call` against endpoint indexes until it succeeds, fails for a
    /// reason a retry cannot fix, or the deadline passes. One attempt at a
    /// time: for calls that must not run twice.
    pub async fn retrying<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        self.attempts(call, false).await
    }

    /// As `retrying`, for calls that may run twice with one effect (reads,
    /// and submits, which the request id makes exactly-once): an attempt
    /// unanswered after `hedge_after` is also sent to the next replica, and
    /// the first success wins.
    pub async fn idempotent<T, F, Fut>(&self, call: F) -> Result<T, ClientError>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        self.attempts(call, self.endpoints.len() > 1).await
    }

    /// One call: its attempts all carry the call's own request id, so a
    /// replica applies the change it asks for once however many attempts
    /// reach the log.
    async fn attempts<T, F, Fut>(&self, call: F, hedge: bool) -> Result<T, ClientError>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let id = match self.credentials.request_id.as_ref().and_then(|base| base.to_str().ok()) {
            Some(base) => wire::call_request_id(base, n),
            None => wire::new_request_id(),
        };
        match MetadataValue::try_from(id) {
            Ok(id) => CALL_ID.scope(id, self.attempts_of_one_call(call, hedge)).await,
            Err(_) => self.attempts_of_one_call(call, hedge).await,
        }
    }

    async fn attempts_of_one_call<T, F, Fut>(&self, mut call: F, hedge: bool) -> Result<T, ClientError>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let started = Instant::now();
        let mut target = self.first_target();
        let mut backoff = Backoff::new(FIRST_BACKOFF_MS, MAX_BACKOFF_MS);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let (answered_by, outcome) = if hedge {
                self.hedged_attempt(&mut call, target).await
            } else {
                let outcome = tokio::time::timeout(self.attempt_timeout, call(target)).await;
                (target, outcome.unwrap_or_else(|_| Err(Status::deadline_exceeded("attempt timed out"))))
            };
            let status = match outcome {
                Ok(value) => {
                    self.answered.store(answered_by, Ordering::Relaxed);
                    return Ok(value);
                }
                Err(status) => status,
            };
            // Refused by this caller's limits: the same replica takes it
            // after the wait it named (a full cluster names none).
            let wait = wire::retry_after(&status).filter(|_| status.code() == Code::ResourceExhausted);
            if !retry::worth_retrying_now(status.code()) && wait.is_none() {
                return Err(ClientError::Status(status));
            }
            if started.elapsed() >= self.deadline {
                let elapsed_ms = started.elapsed().as_millis() as u64;
                return Err(ClientError::GaveUp { elapsed_ms, attempts, last: status });
            }
            if let Some(wait) = wait {
                tokio::time::sleep(wait.min(self.deadline.saturating_sub(started.elapsed()))).await;
                continue;
            }
            match self.leader_hint(&status) {
                Some(leader) if leader != target => target = leader,
                _ => {
                    target = (answered_by + 1) % self.endpoints.len();
                    tokio::time::sleep(retry::jittered(backoff.next_delay())).await;
                }
            }
        }
    }

    /// One hedged round of an idempotent call, starting at `target` (see
    /// `hedge`). Returns the endpoint whose answer it is.
    async fn hedged_attempt<T, F, Fut>(&self, call: &mut F, target: usize) -> (usize, Result<T, Status>)
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let hedging = Hedging::within(self.endpoints.len(), self.hedge_after, self.attempt_timeout, HEDGED_BACKOFF_MAX_MS);
        crate::hedge::round(&hedging, call, target, |status| self.leader_hint(status)).await
    }

    /// Submit through whichever replica answers, retrying through failovers
    /// (safe: the request id makes a retry return the first job). Hedged
    /// only with a request id: without one, two attempts make two jobs.
    pub async fn submit_job(&self, request: &pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse, ClientError> {
        let call = |i| {
            let mut jobs = self.jobs_at(i);
            let request = request.clone();
            async move { jobs.submit_job(request).await.map(|r| r.into_inner()) }
        };
        if request.request_id.is_empty() {
            self.retrying(call).await
        } else {
            self.idempotent(call).await
        }
    }

    pub async fn cancel_job(&self, job_id: u64) -> Result<pb::CancelJobResponse, ClientError> {
        self.retrying(|i| {
            let mut jobs = self.jobs_at(i);
            async move { jobs.cancel_job(pb::CancelJobRequest { job_id }).await.map(|r| r.into_inner()) }
        })
        .await
    }

    /// Change a job's priority (not hedged: one attempt at a time, the
    /// call's request id making a retry apply it once).
    pub async fn set_job_priority(&self, job_id: u64, priority: pb::Priority) -> Result<pb::Job, ClientError> {
        self.retrying(|i| {
            let mut jobs = self.jobs_at(i);
            let request = pb::SetJobPriorityRequest { job_id, priority: priority as i32 };
            async move { jobs.set_job_priority(request).await.map(|r| r.into_inner()) }
        })
        .await
    }

    fn leader_hint(&self, status: &Status) -> Option<usize> {
        let leader = status.metadata().get(LEADER_METADATA)?.to_str().ok()?;
        self.endpoints.iter().position(|e| e == leader)
    }
}

/// The outcome of the attempt in `slot`, tagged with its endpoint; never
/// ready while the slot is empty.
fn channel(endpoint: &str, security: &Security) -> Result<Channel, ClientError> {
    wire::channel(endpoint, security).map_err(|e| ClientError::BadEndpoint(endpoint.to_string(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A client of three endpoints nothing listens on (channels connect
    /// lazily; the calls below never use them).
    fn client() -> Client {
        let endpoints: Vec<String> = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"].iter().map(|e| e.to_string()).collect();
        let mut client = Client::new(&endpoints, &Security::Plaintext).unwrap();
        client.deadline = Duration::from_secs(5);
        client
    }

    /// Endpoint 0 hangs, 1 answers "try another" at once, 2 answers.
    async fn hung_refusing_answering(i: usize, sent: &Mutex<Vec<usize>>) -> Result<usize, Status> {
        sent.lock().unwrap().push(i);
        match i {
            0 => std::future::pending().await,
            1 => Err(Status::unavailable("not in contact with a quorum; try another replica")),
            _ => Ok(i),
        }
    }

    #[tokio::test]
    async fn an_idempotent_call_gets_past_a_hung_replica_and_one_that_refuses() {
        let client = client();
        let sent = Mutex::new(Vec::new());
        let answer = client.idempotent(|i| hung_refusing_answering(i, &sent)).await.unwrap();
        assert_eq!(answer, 2);
        assert_eq!(*sent.lock().unwrap(), [0, 1, 2], "hedged to 1, then to 2 while 0 still hangs");
        assert_eq!(client.last_answered(), Some("127.0.0.1:3"));
        sent.lock().unwrap().clear();
        client.idempotent(|i| hung_refusing_answering(i, &sent)).await.unwrap();
        assert_eq!(*sent.lock().unwrap(), [2], "the next call starts where the last was answered");
    }

    #[tokio::test]
    async fn a_call_that_must_not_run_twice_is_never_hedged() {
        let mut client = client();
        client.attempt_timeout = Duration::from_millis(400);
        client.deadline = Duration::from_millis(300);
        let sent = Mutex::new(Vec::new());
        let outcome = client.retrying(|i| hung_refusing_answering(i, &sent)).await;
        assert!(matches!(outcome, Err(ClientError::GaveUp { .. })), "{outcome:?} {:?}", sent.lock().unwrap());
        assert_eq!(*sent.lock().unwrap(), [0], "one attempt at a time: the hung one ran out the deadline");
    }

    #[tokio::test]
    async fn a_final_answer_ends_a_hedged_call_at_once() {
        let client = client();
        let calls = Mutex::new(0u32);
        let outcome: Result<(), _> = client
            .idempotent(|_| {
                *calls.lock().unwrap() += 1;
                async { Err(Status::invalid_argument("spec.command: must not be empty")) }
            })
            .await;
        assert!(matches!(outcome, Err(ClientError::Status(ref s)) if s.code() == Code::InvalidArgument), "{outcome:?}");
        assert_eq!(*calls.lock().unwrap(), 1);
    }
}
