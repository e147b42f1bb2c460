//! Who makes a REST request, and the gRPC request it becomes.
//!
//! A REST request is served by calling the gRPC service in this process,
//! with a `tonic::Request` that carries what a direct gRPC call of the same
//! caller would: its certificate's identity or its bearer token, and its
//! `rota-as`. Nothing else crosses over. In particular a REST caller can
//! never pass the headers replicas use among themselves (`rota-actor-*`,
//! believed from replicas only; `rota-forwarded`), and never counts as a
//! replica: the REST listener serves people and portals, so a replica's or
//! an agent's certificate is refused there.

use std::net::SocketAddr;

use http::HeaderMap;
use rota_tls::{Caller, ConnInfo, IdentityKind};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::server::TcpConnectInfo;
use tonic::{Extensions, Request, Status};

use crate::authz::ACT_AS_METADATA;

/// The only request headers handed on to the services.
pub const PASSED_HEADERS: &[&str] = &["authorization", ACT_AS_METADATA];
/// Who may call the REST API.
const REST_CALLERS: &[IdentityKind] = &[IdentityKind::User];

/// An authenticated REST caller, ready to make gRPC requests.
#[derive(Debug, Clone)]
pub struct Inbound {
    metadata: MetadataMap,
    pub caller: Caller,
    pub remote: Option<SocketAddr>,
}

impl Inbound {
    /// Authenticate a REST request from its connection and headers, as the
    /// gRPC services' interceptor does (`rota_tls::auth::authenticate`), for users only.
    pub fn authenticate(conn: &ConnInfo, headers: &HeaderMap) -> Result<Inbound, Status> {
        let mut metadata = MetadataMap::new();
        for name in PASSED_HEADERS {
            if let Some(value) = headers.get(*name) {
                let value =
                    MetadataValue::try_from(value.as_bytes()).map_err(|_| Status::invalid_argument(format!("{name}: not ASCII")))?;
                metadata.insert(*name, value);
            }
        }
        let mut probe = Request::from_parts(metadata.clone(), Extensions::new(), ());
        probe.extensions_mut().insert(conn.clone());
        rota_tls::auth::authenticate(&mut probe, REST_CALLERS)?;
        let caller = rota_tls::auth::caller(&probe)?.clone();
        Ok(Inbound { metadata, caller, remote: conn.remote })
    }

    /// The caller a board session was issued for (see `session`): no
    /// request header is handed on, so neither `rota-as` nor a token other
    /// than the session's reaches the services.
    pub fn for_session(caller: Caller, remote: Option<SocketAddr>) -> Inbound {
        Inbound { metadata: MetadataMap::new(), caller, remote }
    }

    /// `message` as a gRPC request of this caller.
    pub fn request<T>(&self, message: T) -> Request<T> {
        let mut extensions = Extensions::new();
        extensions.insert(self.caller.clone());
        extensions.insert(TcpConnectInfo { local_addr: None, remote_addr: self.remote });
        Request::from_parts(self.metadata.clone(), extensions, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_tls::{Identity, Peer};

    fn conn(peer: Peer) -> ConnInfo {
        ConnInfo { remote: Some("127.0.0.1:5000".parse().unwrap()), peer }
    }

    #[test]
    fn replica_only_headers_never_reach_the_services() {
        let mut headers = HeaderMap::new();
        for (name, value) in
            [("rota-actor-user", "harness"), ("rota-actor-from", "1.2.3.4"), ("rota-forwarded", "1"), ("rota-as", "bob"), ("x-other", "1")]
        {
            headers.insert(name, value.parse().unwrap());
        }
        let alice = Identity::new(IdentityKind::User, "alice").unwrap();
        let inbound = Inbound::authenticate(&conn(Peer::Verified(alice.clone())), &headers).expect("a user");
        let request = inbound.request(());
        let names: Vec<&str> = request
            .metadata()
            .iter()
            .map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, _) => k.as_str(),
                tonic::metadata::KeyAndValueRef::Binary(k, _) => k.as_str(),
            })
            .collect();
        assert_eq!(names, vec!["rota-as"]);
        assert_eq!(rota_tls::auth::caller(&request).unwrap(), &Caller::Verified(alice));
    }

    #[test]
    fn only_users_call_the_rest_api() {
        for kind in [IdentityKind::Replica, IdentityKind::Agent] {
            let identity = Identity::new(kind, if kind == IdentityKind::Replica { "1" } else { "n1" }).unwrap();
            let refused = Inbound::authenticate(&conn(Peer::Verified(identity)), &HeaderMap::new()).unwrap_err();
            assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        }
        let refused = Inbound::authenticate(&conn(Peer::Anonymous), &HeaderMap::new()).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer rota_abc_def".parse().unwrap());
        let inbound = Inbound::authenticate(&conn(Peer::Anonymous), &headers).expect("a bearer token");
        assert_eq!(inbound.caller, Caller::Bearer("rota_abc_def".into()));
        let plaintext = Inbound::authenticate(&conn(Peer::Plaintext), &HeaderMap::new()).expect("insecure");
        assert_eq!(plaintext.caller, Caller::Unchecked);
    }
}
