//! Who is on the other end of a link, as its certificate says: one SAN URI
//! `rota://KIND/NAME` (`rota://replica/3`, `rota://agent/gpu-001`,
//! `rota://user/alice`). The parser is pure; the CA vouches for the rest.

use std::fmt;

use crate::der::certificate_facts;
use crate::TlsError;

const SCHEME: &str = "rota://";
/// Longest name in an identity (a node name, a replica id, a user name).
pub const MAX_NAME_LEN: usize = 128;

/// What kind of party holds a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IdentityKind {
    /// A scheduler replica (name: its replica id).
    Replica,
    /// A node agent (name: its node name).
    Agent,
    /// A person or program using the API (name: the user name).
    User,
}

impl IdentityKind {
    pub fn as_str(self) -> &'static str {
        match self {
            IdentityKind::Replica => "replica",
            IdentityKind::Agent => "agent",
            IdentityKind::User => "user",
        }
    }

    fn parse(text: &str) -> Option<IdentityKind> {
        match text {
            "replica" => Some(IdentityKind::Replica),
            "agent" => Some(IdentityKind::Agent),
            "user" => Some(IdentityKind::User),
            _ => None,
        }
    }
}

/// A verified caller: the kind and name its certificate carries. Bearer
/// tokens and roles, when they come, produce the same type.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub kind: IdentityKind,
    pub name: String,
}

impl Identity {
    /// Check the name and build the identity.
    pub fn new(kind: IdentityKind, name: &str) -> Result<Identity, TlsError> {
        let uri = format!("{SCHEME}{}/{name}", kind.as_str());
        check_name(&uri, name)?;
        Ok(Identity { kind, name: name.to_string() })
    }

    /// The SAN URI that names this identity in a certificate.
    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/{}", self.kind.as_str(), self.name)
    }

    /// Parse `rota://KIND/NAME`.
    pub fn parse_uri(uri: &str) -> Result<Identity, TlsError> {
        let bad = |why: &str| TlsError::BadIdentity { uri: uri.to_string(), why: why.to_string() };
        let rest = uri.strip_prefix(SCHEME).ok_or_else(|| bad("expected rota://KIND/NAME"))?;
        let (kind, name) = rest.split_once('/').ok_or_else(|| bad("expected rota://KIND/NAME"))?;
        let kind = IdentityKind::parse(kind).ok_or_else(|| bad("kind must be replica, agent or user"))?;
        check_name(uri, name)?;
        Ok(Identity { kind, name: name.to_string() })
    }

    /// The identity a DER certificate names: exactly one `rota://` SAN URI.
    pub fn of_certificate(der: &[u8]) -> Result<Identity, TlsError> {
        let facts = certificate_facts(der).map_err(|e| TlsError::BadCertificate(e.to_string()))?;
        let mut ours = facts.uris.iter().filter(|uri| uri.starts_with(SCHEME));
        let first = ours.next().ok_or_else(|| TlsError::BadCertificate("no rota:// identity among its names".into()))?;
        if ours.next().is_some() {
            return Err(TlsError::BadCertificate("more than one rota:// identity".into()));
        }
        Identity::parse_uri(first)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.uri())
    }
}

fn check_name(uri: &str, name: &str) -> Result<(), TlsError> {
    let bad = |why: String| TlsError::BadIdentity { uri: uri.to_string(), why };
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(bad(format!("the name must be 1 to {MAX_NAME_LEN} characters")));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        return Err(bad(format!("the name may hold letters, digits, '-', '_' and '.', not {c:?}")));
    }
    Ok(())
}

/// The serial number of a DER certificate, as lowercase hex (what
/// `openssl x509 -serial` shows, without a leading zero byte).
pub fn serial_hex(der: &[u8]) -> Result<String, TlsError> {
    let facts = certificate_facts(der).map_err(|e| TlsError::BadCertificate(e.to_string()))?;
    let bytes = match facts.serial.as_slice() {
        [0, rest @ ..] if !rest.is_empty() => rest,
        all => all,
    };
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_parse_from_their_uris() {
        let agent = Identity::parse_uri("rota://agent/gpu-001").expect("valid");
        assert_eq!(agent, Identity { kind: IdentityKind::Agent, name: "gpu-001".into() });
        assert_eq!(agent.uri(), "rota://agent/gpu-001");
        assert_eq!(Identity::parse_uri("rota://replica/3").expect("valid").kind, IdentityKind::Replica);
        assert_eq!(Identity::parse_uri("rota://user/alice.b_c").expect("valid").name, "alice.b_c");
    }

    #[test]
    fn malformed_identities_are_refused_with_the_reason() {
        for (uri, why) in [
            ("https://agent/x", "expected rota://KIND/NAME"),
            ("rota://agent", "expected rota://KIND/NAME"),
            ("rota://admin/x", "kind must be"),
            ("rota://agent/", "1 to 128"),
            ("rota://agent/a/b", "not '/'"),
            ("rota://user/al ice", "not ' '"),
        ] {
            let error = Identity::parse_uri(uri).expect_err(uri).to_string();
            assert!(error.contains(why), "{uri}: {error}");
        }
        assert!(Identity::parse_uri(&format!("rota://user/{}", "a".repeat(129))).is_err());
        assert!(Identity::new(IdentityKind::Agent, "node 1").is_err());
    }
}
