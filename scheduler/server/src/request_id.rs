//! One id per client action, in every log line it causes. A request keeps
//! the id its client sent (`rota-request-id`, see `rota_client::wire`) or
//! gets a fresh one; the replica answers with it in the same header, serves
//! the request inside a `request` span that names it, and hands it on: to
//! the leader when a follower forwards, and to the proposer, which puts it
//! into the log entry so that apply on every replica names it too.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderValue;
use rota_client::wire::{is_request_id, new_request_id, REQUEST_ID_METADATA};
use tonic::body::Body;
use tonic::server::NamedService;
use tracing::Instrument;

tokio::task_local! {
    /// The id of the request the current task serves.
    static CURRENT: String;
}

/// The id of the request this task serves, if it serves one.
pub fn current() -> Option<String> {
    CURRENT.try_with(Clone::clone).ok()
}

/// The id a request carries if well formed, else a fresh one: a header is
/// the caller's to choose, so a malformed one (too long, odd characters
/// that would garble a log line) is replaced rather than refused.
pub fn choose(header: Option<&HeaderValue>) -> String {
    match header.and_then(|value| value.to_str().ok()) {
        Some(id) if is_request_id(id) => id.to_string(),
        _ => new_request_id(),
    }
}

/// A gRPC service whose requests each run with their id (see the module).
#[derive(Clone)]
pub struct Traced<S> {
    inner: S,
}

impl<S> Traced<S> {
    pub fn new(inner: S) -> Traced<S> {
        Traced { inner }
    }
}

impl<S: NamedService> NamedService for Traced<S> {
    const NAME: &'static str = S::NAME;
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Traced<S>
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

    fn call(&mut self, mut request: http::Request<B>) -> ResponseFuture {
        let id = choose(request.headers().get(REQUEST_ID_METADATA));
        let header = HeaderValue::from_str(&id).expect("a request id is a valid header value");
        request.headers_mut().insert(REQUEST_ID_METADATA, header.clone());
        let span = tracing::info_span!("request", request_id = %id, method = %request.uri().path());
        let answer = self.inner.call(request);
        let served = CURRENT.scope(id, answer).instrument(span);
        Box::pin(async move {
            let mut response = served.await?;
            response.headers_mut().insert(REQUEST_ID_METADATA, header);
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_id_is_kept_and_any_other_replaced() {
        assert_eq!(choose(Some(&HeaderValue::from_static("cli-42"))), "cli-42");
        let long = "a".repeat(rota_client::wire::MAX_REQUEST_ID_BYTES + 1);
        for bad in [None, Some(HeaderValue::from_static("a b")), Some(HeaderValue::from_str(&long).expect("ascii"))] {
            let chosen = choose(bad.as_ref());
            assert!(is_request_id(&chosen) && chosen.len() == 16, "{bad:?} -> {chosen}");
        }
    }

    #[tokio::test]
    async fn the_id_is_the_current_one_inside_its_request_only() {
        assert_eq!(current(), None);
        let seen = CURRENT.scope("r-1".to_string(), async { current() }).await;
        assert_eq!(seen.as_deref(), Some("r-1"));
    }
}
