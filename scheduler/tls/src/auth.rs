//! Who made a request, decided once per request by [`authenticate`] (run as
//! a tonic interceptor in front of each service) and read by handlers
//! through [`caller`]. A client without a certificate may present a bearer
//! token instead ([`Caller::Bearer`]); the replica checks it against the
//! hashes in its replicated state, which this crate does not see.

use tonic::{Request, Status};

use crate::identity::{Identity, IdentityKind};
use crate::link::{ConnInfo, Peer};

/// The caller of a request, in its extensions once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Its certificate (signed by the cluster's CA) names this identity.
    Verified(Identity),
    /// A plaintext link of a process started `--insecure`: nothing is known
    /// and nothing is checked.
    Unchecked,
    /// A TLS client without a certificate that sent `authorization: Bearer
    /// TOKEN`; not yet checked (see the replica's authorization).
    Bearer(String),
}

/// Longest bearer token accepted, bytes (rota's are 82).
const MAX_BEARER_BYTES: usize = 256;

/// The token of an `authorization: Bearer TOKEN` header, if well formed.
fn bearer<T>(request: &Request<T>) -> Option<String> {
    let value = request.metadata().get("authorization")?.to_str().ok()?;
    let token = value.strip_prefix("Bearer ")?.trim();
    (!token.is_empty() && token.len() <= MAX_BEARER_BYTES).then(|| token.to_string())
}

impl Caller {
    /// May this caller speak for node `node` (heartbeat, report, watch)?
    /// Its own agent may; a replica may (it forwards what an agent sent it
    /// and checked); nobody else.
    pub fn may_act_for_node(&self, node: &str) -> Result<(), Status> {
        match self {
            Caller::Unchecked => Ok(()),
            Caller::Verified(Identity { kind: IdentityKind::Replica, .. }) => Ok(()),
            Caller::Verified(Identity { kind: IdentityKind::Agent, name }) if name == node => Ok(()),
            Caller::Verified(identity) => Err(Status::permission_denied(format!("{identity} may not act for node {node:?}"))),
            Caller::Bearer(_) => Err(Status::permission_denied(format!("a bearer token may not act for node {node:?}"))),
        }
    }
}

/// Establish the caller of `request` from its connection and check that it
/// is one of `allowed`: UNAUTHENTICATED without a usable certificate,
/// PERMISSION_DENIED for another kind of caller.
pub fn authenticate<T>(request: &mut Request<T>, allowed: &[IdentityKind]) -> Result<(), Status> {
    let peer = request.extensions().get::<ConnInfo>().map(|info| info.peer.clone());
    let caller = match peer {
        Some(Peer::Plaintext) => Caller::Unchecked,
        Some(Peer::Verified(identity)) => {
            if !allowed.contains(&identity.kind) {
                return Err(Status::permission_denied(format!("{identity} may not call this service")));
            }
            Caller::Verified(identity)
        }
        Some(Peer::Anonymous) => match bearer(request) {
            Some(token) if allowed.contains(&IdentityKind::User) => Caller::Bearer(token),
            Some(_) => return Err(Status::permission_denied("bearer tokens are for people and portals, not this service")),
            None => return Err(Status::unauthenticated("a client certificate signed by the cluster's CA, or a bearer token, is required")),
        },
        Some(Peer::Unrecognized(why)) => return Err(Status::unauthenticated(format!("the client certificate names no identity: {why}"))),
        None => return Err(Status::unauthenticated("the connection carries no identity")),
    };
    request.extensions_mut().insert(caller);
    Ok(())
}

/// A tonic interceptor that runs [`authenticate`] for `allowed` callers.
pub fn interceptor(allowed: &'static [IdentityKind]) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone + Send + 'static {
    move |mut request: Request<()>| {
        authenticate(&mut request, allowed)?;
        Ok(request)
    }
}

/// The caller [`authenticate`] established for this request.
pub fn caller<T>(request: &Request<T>) -> Result<&Caller, Status> {
    request.extensions().get::<Caller>().ok_or_else(|| Status::unauthenticated("the request was not authenticated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_from(peer: Peer) -> Request<()> {
        let mut request = Request::new(());
        request.extensions_mut().insert(ConnInfo { remote: None, peer });
        request
    }

    fn agent(name: &str) -> Identity {
        Identity::new(IdentityKind::Agent, name).expect("identity")
    }

    #[test]
    fn a_request_without_a_certificate_is_unauthenticated() {
        for peer in [Peer::Anonymous, Peer::Unrecognized("no rota:// URI".into())] {
            let error = authenticate(&mut request_from(peer), &[IdentityKind::User]).expect_err("refused");
            assert_eq!(error.code(), tonic::Code::Unauthenticated);
        }
        assert_eq!(authenticate(&mut Request::new(()), &[IdentityKind::User]).expect_err("refused").code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn only_the_allowed_kinds_get_through() {
        let mut request = request_from(Peer::Verified(agent("n1")));
        let error = authenticate(&mut request, &[IdentityKind::Replica]).expect_err("refused");
        assert_eq!(error.code(), tonic::Code::PermissionDenied);
        let mut request = request_from(Peer::Verified(agent("n1")));
        authenticate(&mut request, &[IdentityKind::Agent]).expect("allowed");
        assert_eq!(caller(&request).expect("caller"), &Caller::Verified(agent("n1")));
        let mut plaintext = request_from(Peer::Plaintext);
        authenticate(&mut plaintext, &[]).expect("plaintext is unchecked");
        assert_eq!(caller(&plaintext).expect("caller"), &Caller::Unchecked);
    }

    #[test]
    fn an_agent_acts_for_its_own_node_only() {
        let caller = Caller::Verified(agent("n1"));
        caller.may_act_for_node("n1").expect("its own node");
        assert_eq!(caller.may_act_for_node("n2").expect_err("another node").code(), tonic::Code::PermissionDenied);
        let user = Caller::Verified(Identity::new(IdentityKind::User, "alice").expect("identity"));
        assert!(user.may_act_for_node("n1").is_err());
        let replica = Caller::Verified(Identity::new(IdentityKind::Replica, "2").expect("identity"));
        replica.may_act_for_node("n1").expect("replicas forward agents' calls");
    }
}
