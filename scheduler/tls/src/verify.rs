//! Certificate verification against the reloading CA bundle, and the check
//! that a server is who the dialer meant to reach: a certificate signed by
//! the cluster's CA proves only that its holder belongs to the cluster. A
//! stolen agent or user key must not let its holder pose as a replica to
//! clients, agents and other replicas (and collect their submits, their
//! assignments or their votes), so whoever dials a replica requires a
//! certificate naming a replica (`rota://replica/ID`), and `rota logs`
//! requires the named node's agent.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, SignatureScheme};

use crate::identity::{Identity, IdentityKind};
use crate::reload::ReloadingRoots;

/// Whom a dialer expects at the other end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerIdentity {
    /// Any replica of the cluster (clients, agents and replicas dialing replicas).
    AnyReplica,
    /// Exactly this identity (`rota logs` dialing a node's agent).
    Exactly(Identity),
}

impl ServerIdentity {
    /// Does a certificate naming `found` satisfy this expectation?
    pub fn check(&self, found: &Identity) -> Result<(), String> {
        match self {
            ServerIdentity::AnyReplica if found.kind == IdentityKind::Replica => Ok(()),
            ServerIdentity::AnyReplica => Err(format!("the server's certificate names {found}, not a replica (rota://replica/ID)")),
            ServerIdentity::Exactly(expected) if expected == found => Ok(()),
            ServerIdentity::Exactly(expected) => Err(format!("the server's certificate names {found}, not {expected}")),
        }
    }
}

#[derive(Debug)]
struct WrongIdentity(String);

impl fmt::Display for WrongIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongIdentity {}

fn refused(why: String) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(WrongIdentity(why)))))
}

/// Checks a server's certificate: the CA bundle as it is now (chain, time,
/// the address dialed), then the identity it names.
#[derive(Debug)]
pub struct ServerVerifier {
    pub roots: Arc<ReloadingRoots>,
    pub expected: ServerIdentity,
}

impl ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.roots.current().server.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        let identity = Identity::of_certificate(end_entity).map_err(|e| refused(format!("the server's certificate: {e}")))?;
        self.expected.check(&identity).map_err(refused)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.current().server.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.current().server.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.roots.current().server.supported_verify_schemes()
    }
}

/// Checks a client's certificate against the CA bundle as it is now.
/// Which identities may call which service is decided per request
/// (`auth`), not here.
#[derive(Debug)]
pub struct ClientVerifier {
    pub roots: Arc<ReloadingRoots>,
}

impl ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        // Clients without a certificate are refused per request, with a reason.
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints would have to follow the bundle; rota's clients present
        // their one certificate whatever the hints say.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.roots.current().client.verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.current().client.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.roots.current().client.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.roots.current().client.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::certs::{issue, new_ca};
    use crate::pem::certificates_from_pem;

    fn der_of(pem: &str) -> CertificateDer<'static> {
        certificates_from_pem(pem.as_bytes()).expect("pem").remove(0)
    }

    fn identity(kind: IdentityKind, name: &str) -> Identity {
        Identity::new(kind, name).expect("identity")
    }

    #[test]
    fn only_the_expected_identity_passes() {
        let replica = identity(IdentityKind::Replica, "1");
        let agent = identity(IdentityKind::Agent, "gpu-001");
        let user = identity(IdentityKind::User, "alice");
        ServerIdentity::AnyReplica.check(&replica).expect("a replica");
        for wrong in [&agent, &user] {
            let why = ServerIdentity::AnyReplica.check(wrong).expect_err("not a replica");
            assert!(why.contains(&wrong.to_string()) && why.contains("not a replica"), "{why}");
        }
        ServerIdentity::Exactly(agent.clone()).check(&agent).expect("the agent dialed");
        assert!(ServerIdentity::Exactly(agent).check(&identity(IdentityKind::Agent, "gpu-002")).is_err());
    }

    /// A CA rotated in the bundle: certificates of a CA appended to the file
    /// verify from the next check on, and those of a CA removed from it no
    /// longer do. Prevents a CA rotation from needing a restart of every
    /// process (the bundle was read once, at start), and a half-written
    /// bundle from being taken.
    #[test]
    fn a_ca_appended_to_the_bundle_is_trusted_and_a_removed_one_no_longer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ca.pem");
        let (old_ca, new_ca) = (new_ca(1).expect("old ca"), new_ca(1).expect("new ca"));
        std::fs::write(&path, &old_ca.cert_pem).expect("written");
        let roots = ReloadingRoots::open_checking_every(&path, crate::link::provider(), Duration::ZERO).expect("opened");
        let replica = identity(IdentityKind::Replica, "1");
        let of_old = der_of(&issue(&old_ca.key_pem, &replica, &[], 1).expect("issued").cert_pem);
        let of_new = der_of(&issue(&new_ca.key_pem, &replica, &[], 1).expect("issued").cert_pem);
        let verifier = ServerVerifier { roots: Arc::new(roots), expected: ServerIdentity::AnyReplica };
        let name = ServerName::try_from("127.0.0.1").expect("name");
        let verify = |der: &CertificateDer<'_>| verifier.verify_server_cert(der, &[], &name, &[], UnixTime::now());
        verify(&of_old).expect("the old CA's certificate verifies");
        assert!(verify(&of_new).is_err(), "the new CA is not trusted yet");

        std::fs::write(&path, format!("{}{}", old_ca.cert_pem, new_ca.cert_pem)).expect("appended");
        verify(&of_new).expect("a certificate of the appended CA verifies");
        verify(&of_old).expect("the old CA is still trusted");

        std::fs::write(&path, "-----BEGIN CERTIFICATE-----\n").expect("half written");
        verify(&of_old).expect("a half-written bundle is not taken");

        std::fs::write(&path, &new_ca.cert_pem).expect("old removed");
        verify(&of_new).expect("the new CA's certificate verifies");
        assert!(verify(&of_old).is_err(), "the removed CA is no longer trusted");
    }

    #[test]
    fn an_agent_certificate_of_the_same_ca_is_no_replica() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ca.pem");
        let ca = new_ca(1).expect("ca");
        std::fs::write(&path, &ca.cert_pem).expect("written");
        let roots = Arc::new(ReloadingRoots::open(&path, crate::link::provider()).expect("opened"));
        let verifier = ServerVerifier { roots, expected: ServerIdentity::AnyReplica };
        let name = ServerName::try_from("127.0.0.1").expect("name");
        let agent = der_of(&issue(&ca.key_pem, &identity(IdentityKind::Agent, "gpu-001"), &[], 1).expect("issued").cert_pem);
        let error = verifier.verify_server_cert(&agent, &[], &name, &[], UnixTime::now()).expect_err("not a replica");
        assert!(error.to_string().contains("rota://agent/gpu-001, not a replica"), "{error}");
        // A user's certificate is for clients only (no server purpose, no address).
        let user = der_of(&issue(&ca.key_pem, &identity(IdentityKind::User, "mallory"), &[], 1).expect("issued").cert_pem);
        assert!(verifier.verify_server_cert(&user, &[], &name, &[], UnixTime::now()).is_err());
        let replica = der_of(&issue(&ca.key_pem, &identity(IdentityKind::Replica, "3"), &[], 1).expect("issued").cert_pem);
        verifier.verify_server_cert(&replica, &[], &name, &[], UnixTime::now()).expect("a replica's certificate");
    }
}
