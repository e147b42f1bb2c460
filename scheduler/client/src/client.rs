//! A client of the rota.v1 API that follows the leader: it tries the given
//! endpoints in turn, jumps to the leader named in an UNAVAILABLE answer, and
//! retries with backoff inside a deadline, so a user never sees "not leader"
//! and a failover looks like a short delay.

use std::future::Future;
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

use crate::retry::{self, Backoff};
use crate::wire::{self, LEADER_METADATA, MAX_MESSAGE_BYTES};

const FIRST_BACKOFF_MS: u64 = 25;
const MAX_BACKOFF_MS: u64 = 1_000;
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
        if let Some(id) = &self.request_id {
            request.metadata_mut().insert(wire::REQUEST_ID_METADATA, id.clone());
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
}

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

    /// Run `call` against endpoint indexes until it succeeds, fails for a
    /// reason a retry cannot fix, or the deadline passes.
    pub async fn retrying<T, F, Fut>(&self, mut call: F) -> Result<T, ClientError>
    where
        F: FnMut(usize) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let started = Instant::now();
        let mut target = 0usize;
        let mut backoff = Backoff::new(FIRST_BACKOFF_MS, MAX_BACKOFF_MS);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let outcome = tokio::time::timeout(self.attempt_timeout, call(target)).await;
            let status = match outcome {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(status)) => status,
                Err(_) => Status::deadline_exceeded("attempt timed out"),
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
                    target = (target + 1) % self.endpoints.len();
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    /// Submit through whichever replica answers, retrying through failovers
    /// (safe: the request id makes a retry return the first job).
    pub async fn submit_job(&self, request: &pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse, ClientError> {
        self.retrying(|i| {
            let mut jobs = self.jobs_at(i);
            let request = request.clone();
            async move { jobs.submit_job(request).await.map(|r| r.into_inner()) }
        })
        .await
    }

    pub async fn cancel_job(&self, job_id: u64) -> Result<pb::CancelJobResponse, ClientError> {
        self.retrying(|i| {
            let mut jobs = self.jobs_at(i);
            async move { jobs.cancel_job(pb::CancelJobRequest { job_id }).await.map(|r| r.into_inner()) }
        })
        .await
    }

    fn leader_hint(&self, status: &Status) -> Option<usize> {
        let leader = status.metadata().get(LEADER_METADATA)?.to_str().ok()?;
        self.endpoints.iter().position(|e| e == leader)
    }
}

fn channel(endpoint: &str, security: &Security) -> Result<Channel, ClientError> {
    wire::channel(endpoint, security).map_err(|e| ClientError::BadEndpoint(endpoint.to_string(), e.to_string()))
}
