//! Limits per caller identity: a request rate (a token bucket), open
//! streams and requests in flight, so that nothing one identity does can
//! starve the others.
//!
//! Where it sits: a tower service wrapped inside each service's
//! authentication interceptor ([`Limited`]), so it sees the caller the
//! interceptor established and runs before the handler decodes the message,
//! reads the state or queues a proposal. A refused request costs a table
//! lookup and comes back RESOURCE_EXHAUSTED with a hint (`retry-after-ms`
//! metadata, and the same figure in the text).
//!
//! Who is limited: users (`rota://user/NAME`) by the user limits, agents by
//! the agent limits, each identity on its own bucket (keyed on the
//! identity's URI). Replicas never are: a follower forwards its clients'
//! requests to the leader under its own certificate, and those were counted
//! against their callers on the follower. A plaintext caller (a replica
//! started `--insecure`) is keyed on its remote IP address, except requests
//! marked as forwarded.
//!
//! Why in flight too: a bucket bounds the rate, but a caller whose requests
//! wait (a slow commit, a failover) could still pile up behind the shared
//! proposer queue; at most `max_in_flight` requests of one identity are
//! being served at once, so one identity holds at most that many of the
//! proposer's slots.
//!
//! Why refusals are answered slowly: a client that ignores the hint and
//! calls again at once (a script's tight loop, a flooder) is refused
//! cheaply, but each refusal still costs the replica the connection's
//! decryption and framing, thousands a second on the cores the other
//! callers share. So a refusal's answer is held back for as many
//! milliseconds as the identity was refused in about the last second (at
//! most `MAX_ANSWER_DELAY_MS`): a caller refused now and then hardly
//! notices, a closed loop of refused calls slows to a few hundred a second.
//! At most `MAX_HELD_ANSWERS` answers are held at once (a timer each); past
//! that they go out at once.
//!
//! Memory: the table holds at most `max_identities` entries. An idle entry
//! (bucket full again, nothing open) is the same as a fresh one and is swept
//! away; when every entry is busy, new identities share one overflow entry
//! rather than push out a busy one (whose fresh bucket would hand a flooder
//! a new burst).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use rota_client::wire::{FORWARDED_METADATA, RETRY_AFTER_METADATA};
use rota_tls::{Caller, ConnInfo, IdentityKind};
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::Status;

/// Default request rate of one user identity, per second.
pub const DEFAULT_USER_REQUESTS_PER_S: u32 = 500;
/// Default burst of one user identity: requests above the rate at once.
pub const DEFAULT_USER_BURST: u32 = 1_000;
/// Default open streams (WatchJobs) of one user identity.
pub const DEFAULT_USER_MAX_STREAMS: u32 = 64;
/// Default requests of one user identity being served at once.
pub const DEFAULT_USER_MAX_IN_FLIGHT: u32 = 1_024;
/// Agents: a heartbeat a second and a report per rank event is their normal
/// load; these leave a wide margin for restarts and catch-up.
pub const DEFAULT_AGENT_REQUESTS_PER_S: u32 = 500;
pub const DEFAULT_AGENT_BURST: u32 = 1_000;
pub const DEFAULT_AGENT_MAX_STREAMS: u32 = 16;
pub const DEFAULT_AGENT_MAX_IN_FLIGHT: u32 = 256;
/// Identities tracked at once.
pub const DEFAULT_MAX_IDENTITIES: usize = 65_536;
/// Idle entries are swept at least this often.
const SWEEP_EVERY_MS: u64 = 60_000;
/// The hint given when a stream or in-flight cap refuses: something must
/// end first, which no arithmetic predicts.
const BUSY_RETRY_AFTER_MS: u64 = 1_000;
/// The key of the entry new identities share while the table is full.
const OVERFLOW_KEY: &str = "(overflow)";
/// Longest hold of a refusal's answer.
const MAX_ANSWER_DELAY_MS: u64 = 1_000;
/// Refusals held back at once, over every identity.
const MAX_HELD_ANSWERS: usize = 4_096;
/// How fast an identity's count of recent refusals fades (time constant).
const REFUSALS_FADE_S: f64 = 1.0;

/// The limits of one kind of caller. A rate of 0 means no rate limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassLimits {
    pub requests_per_s: u32,
    pub burst: u32,
    pub max_streams: u32,
    pub max_in_flight: u32,
}

/// The limits a replica enforces (`rota server --user-requests-per-s ...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitsConfig {
    pub user: ClassLimits,
    pub agent: ClassLimits,
    pub max_identities: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            user: ClassLimits {
                requests_per_s: DEFAULT_USER_REQUESTS_PER_S,
                burst: DEFAULT_USER_BURST,
                max_streams: DEFAULT_USER_MAX_STREAMS,
                max_in_flight: DEFAULT_USER_MAX_IN_FLIGHT,
            },
            agent: ClassLimits {
                requests_per_s: DEFAULT_AGENT_REQUESTS_PER_S,
                burst: DEFAULT_AGENT_BURST,
                max_streams: DEFAULT_AGENT_MAX_STREAMS,
                max_in_flight: DEFAULT_AGENT_MAX_IN_FLIGHT,
            },
            max_identities: DEFAULT_MAX_IDENTITIES,
        }
    }
}

impl LimitsConfig {
    /// Check the flags' values; the error names the flag.
    pub fn check(&self) -> Result<(), String> {
        for (class, limits) in [("user", &self.user), ("agent", &self.agent)] {
            if limits.requests_per_s > 0 && limits.burst == 0 {
                return Err(format!("--{class}-burst: must be at least 1 when --{class}-requests-per-s is set"));
            }
            if limits.max_streams == 0 {
                return Err(format!("--{class}-max-streams: must be at least 1"));
            }
            if limits.max_in_flight == 0 {
                return Err(format!("--{class}-max-in-flight: must be at least 1"));
            }
        }
        if self.max_identities < 2 {
            return Err("--max-limited-identities: must be at least 2".into());
        }
        Ok(())
    }

    fn of(&self, class: Class) -> &ClassLimits {
        match class {
            Class::User => &self.user,
            Class::Agent => &self.agent,
        }
    }
}

/// Which limits apply to a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    User,
    Agent,
}

/// Why a request was refused, with how long to wait before trying again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    Rate { retry_after_ms: u64, requests_per_s: u32 },
    Streams { limit: u32 },
    InFlight { limit: u32 },
}

impl Refusal {
    pub fn retry_after_ms(&self) -> u64 {
        match self {
            Refusal::Rate { retry_after_ms, .. } => *retry_after_ms,
            Refusal::Streams { .. } | Refusal::InFlight { .. } => BUSY_RETRY_AFTER_MS,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Refusal::Rate { .. } => "rate",
            Refusal::Streams { .. } => "streams",
            Refusal::InFlight { .. } => "in_flight",
        }
    }

    /// The RESOURCE_EXHAUSTED answer, naming the caller and the hint.
    pub fn to_status(&self, key: &str) -> Status {
        let retry_after_ms = self.retry_after_ms();
        let what = match self {
            Refusal::Rate { requests_per_s, .. } => format!("more than {requests_per_s} requests/s"),
            Refusal::Streams { limit } => format!("{limit} streams open already"),
            Refusal::InFlight { limit } => format!("{limit} requests being served already"),
        };
        let mut status = Status::resource_exhausted(format!("{key}: {what}; retry after {retry_after_ms} ms"));
        if let Ok(value) = retry_after_ms.to_string().parse() {
            status.metadata_mut().insert(RETRY_AFTER_METADATA, value);
        }
        status
    }
}

#[derive(Debug, Clone)]
struct Entry {
    class: Class,
    tokens: f64,
    refilled: Instant,
    streams: u32,
    in_flight: u32,
    touched: Instant,
    /// Refusals lately: one added per refusal, fading with `REFUSALS_FADE_S`
    /// (so about the refusals of the last second under a steady stream).
    refused: f64,
    refused_at: Instant,
}

impl Entry {
    fn new(class: Class, limits: &ClassLimits, now: Instant) -> Entry {
        let tokens = f64::from(limits.burst);
        Entry { class, tokens, refilled: now, streams: 0, in_flight: 0, touched: now, refused: 0.0, refused_at: now }
    }

    /// Count a refusal; how long to hold its answer, ms.
    fn note_refusal(&mut self, now: Instant) -> u64 {
        let faded_s = now.saturating_duration_since(self.refused_at).as_secs_f64();
        self.refused = self.refused * (-faded_s / REFUSALS_FADE_S).exp() + 1.0;
        self.refused_at = now;
        debug_assert!(self.refused >= 1.0);
        (self.refused as u64).min(MAX_ANSWER_DELAY_MS)
    }

    fn refill(&mut self, limits: &ClassLimits, now: Instant) {
        let elapsed_s = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed_s * f64::from(limits.requests_per_s)).min(f64::from(limits.burst));
        self.refilled = now;
    }

    fn is_idle(&self, limits: &ClassLimits, now: Instant) -> bool {
        let mut refilled = self.clone();
        refilled.refill(limits, now);
        self.streams == 0 && self.in_flight == 0 && (limits.requests_per_s == 0 || refilled.tokens >= f64::from(limits.burst))
    }
}

/// The per-identity table: pure (the time comes in), one lock around it.
#[derive(Debug)]
pub struct Table {
    config: LimitsConfig,
    entries: HashMap<String, Entry>,
    last_sweep: Instant,
}

impl Table {
    pub fn new(config: LimitsConfig, now: Instant) -> Table {
        Table { config, entries: HashMap::new(), last_sweep: now }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Take one request (and a stream slot if `stream`) for `key`. Returns
    /// the key the request was counted under (the overflow entry's when the
    /// table is full), to give back to [`Table::release`].
    pub fn admit(&mut self, key: &str, class: Class, stream: bool, now: Instant) -> Result<String, (String, Refusal)> {
        self.admit_or_hold(key, class, stream, now).map_err(|(key, refusal, _)| (key, refusal))
    }

    /// `admit`; a refusal also says how long to hold its answer, ms (see
    /// the module doc).
    pub fn admit_or_hold(&mut self, key: &str, class: Class, stream: bool, now: Instant) -> Result<String, (String, Refusal, u64)> {
        match self.take(key, class, stream, now) {
            Ok(key) => Ok(key),
            Err((key, refusal)) => {
                let hold_ms = self.entries.get_mut(&key).map_or(0, |entry| entry.note_refusal(now));
                Err((key, refusal, hold_ms))
            }
        }
    }

    fn take(&mut self, key: &str, class: Class, stream: bool, now: Instant) -> Result<String, (String, Refusal)> {
        let limits = *self.config.of(class);
        if now.saturating_duration_since(self.last_sweep) >= Duration::from_millis(SWEEP_EVERY_MS) {
            self.sweep(now);
        }
        let key = if self.entries.contains_key(key) {
            key.to_string()
        } else {
            // One place is kept for the overflow entry.
            if self.entries.len() + 1 >= self.config.max_identities {
                self.sweep(now);
            }
            if self.entries.len() + 1 >= self.config.max_identities {
                OVERFLOW_KEY.to_string()
            } else {
                key.to_string()
            }
        };
        let entry = self.entries.entry(key.clone()).or_insert_with(|| Entry::new(class, &limits, now));
        // An identity keeps the class it was first seen with; a key names one identity.
        let limits = *self.config.of(entry.class);
        entry.touched = now;
        if stream && entry.streams >= limits.max_streams {
            return Err((key, Refusal::Streams { limit: limits.max_streams }));
        }
        if !stream && entry.in_flight >= limits.max_in_flight {
            return Err((key, Refusal::InFlight { limit: limits.max_in_flight }));
        }
        if limits.requests_per_s > 0 {
            entry.refill(&limits, now);
            if entry.tokens < 1.0 {
                let missing = 1.0 - entry.tokens;
                let retry_after_ms = ((missing / f64::from(limits.requests_per_s)) * 1_000.0).ceil().max(1.0) as u64;
                return Err((key, Refusal::Rate { retry_after_ms, requests_per_s: limits.requests_per_s }));
            }
            entry.tokens -= 1.0;
        }
        if stream {
            entry.streams += 1;
        } else {
            entry.in_flight += 1;
        }
        Ok(key)
    }

    /// A stream or request admitted under `key` ended.
    pub fn release(&mut self, key: &str, stream: bool) {
        if let Some(entry) = self.entries.get_mut(key) {
            let count = if stream { &mut entry.streams } else { &mut entry.in_flight };
            *count = count.saturating_sub(1);
        }
    }

    /// Drop every idle entry (one that a fresh entry would equal).
    fn sweep(&mut self, now: Instant) {
        let config = self.config;
        self.entries.retain(|_, entry| !entry.is_idle(config.of(entry.class), now));
        self.last_sweep = now;
    }

    #[cfg(test)]
    fn streams_of(&self, key: &str) -> u32 {
        self.entries.get(key).map_or(0, |e| e.streams)
    }
}

/// The table shared by every service of a replica.
#[derive(Debug)]
pub struct Limiter {
    table: Mutex<Table>,
    /// Refusals whose answers are being held back now.
    held: AtomicUsize,
}

/// A refusal whose answer waits `delay`; counted in `Limiter::held` until dropped.
#[derive(Debug)]
pub struct HeldAnswer {
    limiter: Arc<Limiter>,
    pub delay: Duration,
}

impl Drop for HeldAnswer {
    fn drop(&mut self) {
        self.limiter.held.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Limiter {
    pub fn new(config: LimitsConfig) -> Arc<Limiter> {
        Arc::new(Limiter { table: Mutex::new(Table::new(config, Instant::now())), held: AtomicUsize::new(0) })
    }

    /// `admit`, with the refusal's answer to be held back for a while
    /// (`None`: answer at once: no delay due, or too many held already).
    pub fn admit_or_hold(self: &Arc<Self>, key: &str, class: Class, stream: bool) -> Result<Permit, (Status, Option<HeldAnswer>)> {
        let outcome = self.table().admit_or_hold(key, class, stream, Instant::now());
        match outcome {
            Ok(key) => Ok(Permit { limiter: self.clone(), key, stream }),
            Err((counted_as, refusal, hold_ms)) => {
                metrics::counter!("rota_limited_total", "reason" => refusal.reason()).increment(1);
                tracing::debug!(caller = key, counted_as, ?refusal, hold_ms, "request refused by its identity's limits");
                let held = (hold_ms > 0 && self.held.fetch_add(1, Ordering::Relaxed) < MAX_HELD_ANSWERS)
                    .then(|| HeldAnswer { limiter: self.clone(), delay: Duration::from_millis(hold_ms) });
                if held.is_none() && hold_ms > 0 {
                    // The add above counted one that is not held.
                    self.held.fetch_sub(1, Ordering::Relaxed);
                }
                Err((refusal.to_status(key), held))
            }
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        match self.table.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Admit a request of `key`; the permit gives its place back when dropped.
    pub fn admit(self: &Arc<Self>, key: &str, class: Class, stream: bool) -> Result<Permit, Status> {
        match self.table().admit(key, class, stream, Instant::now()) {
            Ok(key) => Ok(Permit { limiter: self.clone(), key, stream }),
            Err((counted_as, refusal)) => {
                metrics::counter!("rota_limited_total", "reason" => refusal.reason()).increment(1);
                tracing::debug!(caller = key, counted_as, ?refusal, "request refused by its identity's limits");
                Err(refusal.to_status(key))
            }
        }
    }
}

/// A request or stream being served; its place is given back on drop.
#[derive(Debug)]
pub struct Permit {
    limiter: Arc<Limiter>,
    key: String,
    stream: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limiter.table().release(&self.key, self.stream);
    }
}

/// Which caller a request is counted against, and by which limits; None for
/// callers that are not limited (replicas, forwarded plaintext requests).
pub fn limited_caller(caller: &Caller, remote: Option<IpAddr>, forwarded: bool, plaintext_class: Class) -> Option<(String, Class)> {
    match caller {
        Caller::Verified(identity) => match identity.kind {
            IdentityKind::Replica => None,
            IdentityKind::User => Some((identity.to_string(), Class::User)),
            IdentityKind::Agent => Some((identity.to_string(), Class::Agent)),
        },
        // Counted by the token's public id, before the token is checked: a
        // caller inventing ids gets new buckets only until the table is
        // full, and then shares one.
        Caller::Bearer(token) => {
            let id: String = token.strip_prefix("rota_").unwrap_or("").chars().take_while(|c| *c != '_').take(16).collect();
            Some((format!("token://{id}"), Class::User))
        }
        Caller::Unchecked if forwarded => None,
        Caller::Unchecked => {
            let address = remote.map_or_else(|| "unknown".to_string(), |ip| ip.to_string());
            Some((format!("plaintext://{address}"), plaintext_class))
        }
    }
}

/// A gRPC service whose requests pass the limiter first. Wrap it inside
/// the authentication interceptor: it reads the [`Caller`] that put there.
#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    limiter: Arc<Limiter>,
    /// The class of plaintext callers of this service.
    plaintext_class: Class,
    /// Paths (`/package.Service/Method`) of the methods that answer with a stream.
    stream_paths: &'static [&'static str],
}

impl<S> Limited<S> {
    /// `how`: the shared limiter, the class of plaintext callers, the
    /// paths of the methods that answer with a stream.
    pub fn new(inner: S, how: (Arc<Limiter>, Class, &'static [&'static str])) -> Limited<S> {
        let (limiter, plaintext_class, stream_paths) = how;
        Limited { inner, limiter, plaintext_class, stream_paths }
    }

    fn admit<B>(&self, request: &http::Request<B>) -> Result<Option<Permit>, (Status, Option<HeldAnswer>)> {
        let Some(caller) = request.extensions().get::<Caller>() else { return Ok(None) };
        let remote = request.extensions().get::<ConnInfo>().and_then(|info| info.remote).map(|addr| addr.ip());
        let forwarded = request.headers().contains_key(FORWARDED_METADATA);
        let Some((key, class)) = limited_caller(caller, remote, forwarded, self.plaintext_class) else { return Ok(None) };
        let stream = self.stream_paths.contains(&request.uri().path());
        self.limiter.admit_or_hold(&key, class, stream).map(Some)
    }
}

impl<S: NamedService> NamedService for Limited<S> {
    const NAME: &'static str = S::NAME;
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Limited<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> ResponseFuture {
        match self.admit(&request) {
            Err((status, None)) => Box::pin(async move { Ok(status.into_http()) }),
            // The request is dropped here; only the answer and a timer wait.
            Err((status, Some(held))) => Box::pin(async move {
                tokio::time::sleep(held.delay).await;
                drop(held);
                Ok(status.into_http())
            }),
            Ok(None) => Box::pin(self.inner.call(request)),
            Ok(Some(permit)) => {
                let answer = self.inner.call(request);
                Box::pin(async move {
                    let response = answer.await?;
                    // The permit lives as long as the response body: to the
                    // end of a stream, or until a unary answer is sent.
                    Ok(response.map(|body| {
                        Body::new(body.map_frame(move |frame| {
                            let _held = &permit;
                            frame
                        }))
                    }))
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(requests_per_s: u32, burst: u32, max_streams: u32) -> LimitsConfig {
        let class = ClassLimits { requests_per_s, burst, max_streams, max_in_flight: 4 };
        LimitsConfig { user: class, agent: class, max_identities: 4 }
    }

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate_with_a_hint() {
        let start = Instant::now();
        let mut table = Table::new(config(10, 3, 2), start);
        for _ in 0..3 {
            let key = table.admit("rota://user/a", Class::User, false, start).expect("within the burst");
            table.release(&key, false);
        }
        let (_, refusal) = table.admit("rota://user/a", Class::User, false, start).expect_err("over the burst");
        assert_eq!(refusal, Refusal::Rate { retry_after_ms: 100, requests_per_s: 10 });
        // Another identity has its own bucket.
        table.admit("rota://user/b", Class::User, false, start).expect("b is not limited by a");
        // A tenth of a second later one token is back.
        let later = start + Duration::from_millis(100);
        table.admit("rota://user/a", Class::User, false, later).expect("refilled");
        let status = Refusal::Rate { retry_after_ms: 37, requests_per_s: 10 }.to_status("rota://user/a");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(status.metadata().get(RETRY_AFTER_METADATA).and_then(|v| v.to_str().ok()), Some("37"));
        assert!(status.message().contains("retry after 37 ms") && status.message().contains("rota://user/a"), "{}", status.message());
    }

    #[test]
    fn refusals_in_a_row_are_answered_more_slowly_and_the_hold_fades() {
        let start = Instant::now();
        let mut table = Table::new(config(10, 1, 2), start);
        table.admit_or_hold("a", Class::User, false, start).expect("the burst");
        let holds: Vec<u64> = (0..5).map(|_| table.admit_or_hold("a", Class::User, false, start).expect_err("over").2).collect();
        assert_eq!(holds, vec![1, 2, 3, 4, 5], "one ms more per recent refusal");
        for _ in 0..5_000 {
            table.admit_or_hold("a", Class::User, false, start).expect_err("a tight loop");
        }
        assert_eq!(table.admit_or_hold("a", Class::User, false, start).expect_err("over").2, MAX_ANSWER_DELAY_MS, "bounded");
        let quiet = start + Duration::from_secs(10);
        table.admit("a", Class::User, false, quiet).expect("refilled");
        let (_, _, hold_ms) = table.admit_or_hold("a", Class::User, false, quiet).expect_err("over again");
        assert_eq!(hold_ms, 1, "after a quiet spell a refusal is answered at once again");
        assert_eq!(table.admit_or_hold("b", Class::User, false, start).map(|_| ()), Ok(()), "others are not held");
    }

    #[test]
    fn streams_and_requests_in_flight_are_capped_and_given_back() {
        let now = Instant::now();
        let mut table = Table::new(config(0, 0, 2), now);
        let first = table.admit("u", Class::User, true, now).expect("first stream");
        table.admit("u", Class::User, true, now).expect("second stream");
        assert_eq!(table.admit("u", Class::User, true, now).expect_err("third").1, Refusal::Streams { limit: 2 });
        table.release(&first, true);
        assert_eq!(table.streams_of("u"), 1);
        table.admit("u", Class::User, true, now).expect("a stream ended: room again");
        for _ in 0..4 {
            table.admit("u", Class::User, false, now).expect("in flight");
        }
        assert_eq!(table.admit("u", Class::User, false, now).expect_err("fifth").1, Refusal::InFlight { limit: 4 });
    }

    #[test]
    fn the_table_is_bounded_and_sheds_idle_entries_first() {
        let now = Instant::now();
        let mut table = Table::new(config(10, 2, 1), now);
        // Three busy identities fill it (one place stays for the overflow entry).
        for key in ["a", "b", "c"] {
            table.admit(key, Class::User, true, now).expect("admitted");
        }
        let counted = table.admit("d", Class::User, false, now).expect("admitted");
        assert_eq!(counted, OVERFLOW_KEY, "a busy identity is not pushed out");
        assert!(table.len() <= 4);
        // Once a's stream ends and its bucket is full again it can be swept.
        table.release("a", true);
        let later = now + Duration::from_secs(1);
        table.release(OVERFLOW_KEY, false);
        assert_eq!(table.admit("e", Class::User, false, later).expect("admitted"), "e");
        assert!(table.len() <= 4, "{}", table.len());
    }

    #[test]
    fn replicas_and_forwarded_plaintext_requests_are_not_limited() {
        use rota_tls::Identity;
        let replica = Caller::Verified(Identity::new(IdentityKind::Replica, "2").expect("identity"));
        assert_eq!(limited_caller(&replica, None, false, Class::User), None);
        let user = Caller::Verified(Identity::new(IdentityKind::User, "alice").expect("identity"));
        assert_eq!(limited_caller(&user, None, true, Class::User), Some(("rota://user/alice".into(), Class::User)));
        let agent = Caller::Verified(Identity::new(IdentityKind::Agent, "n1").expect("identity"));
        assert_eq!(limited_caller(&agent, None, false, Class::User), Some(("rota://agent/n1".into(), Class::Agent)));
        let ip: IpAddr = "10.0.0.7".parse().expect("ip");
        assert_eq!(limited_caller(&Caller::Unchecked, Some(ip), false, Class::Agent), Some(("plaintext://10.0.0.7".into(), Class::Agent)));
        assert_eq!(limited_caller(&Caller::Unchecked, Some(ip), true, Class::Agent), None);
    }

    #[test]
    fn flags_are_checked_by_name() {
        let mut config = LimitsConfig::default();
        config.check().expect("defaults are valid");
        config.user.burst = 0;
        assert!(config.check().expect_err("refused").starts_with("--user-burst"));
        config.user.requests_per_s = 0;
        config.check().expect("no rate, no burst needed");
        config.agent.max_streams = 0;
        assert!(config.check().expect_err("refused").starts_with("--agent-max-streams"));
    }
}
