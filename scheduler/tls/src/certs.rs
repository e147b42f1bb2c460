//! `rota tls ca create` / `rota tls cert create`: a CA and certificates
//! signed by it, as PEM files in one directory. Every certificate names its
//! identity in a `rota://KIND/NAME` SAN URI; replicas and agents also serve
//! TLS, so theirs are valid for 127.0.0.1 and localhost plus any extra SANs.
//! A replica's also carries the DNS form of its identity, `ID.replica.rota`
//! ([`replica_dns_name`]), for clients whose TLS checks DNS names only
//! (gRPC's Python: `grpc.ssl_target_name_override`); no other certificate
//! may carry a name under `replica.rota`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType, SerialNumber,
};
use time::{Duration, OffsetDateTime};

use crate::identity::{Identity, IdentityKind};
use crate::TlsError;

pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca-key.pem";
/// Default lifetime of a CA, days.
pub const DEFAULT_CA_DAYS: u32 = 3_650;
/// Default lifetime of a certificate, days.
pub const DEFAULT_CERT_DAYS: u32 = 365;
/// Longest lifetime accepted, days (about 30 years).
pub const MAX_DAYS: u32 = 11_000;
/// Extra SANs one certificate may carry.
pub const MAX_EXTRA_SANS: usize = 64;
const CA_COMMON_NAME: &str = "rota cluster CA";
/// The DNS domain of replicas' names (`ID.replica.rota`).
pub const REPLICA_DNS_DOMAIN: &str = "replica.rota";

/// The DNS name a replica's certificate carries beside `rota://replica/ID`.
pub fn replica_dns_name(id: &str) -> String {
    format!("{id}.{REPLICA_DNS_DOMAIN}")
}

/// Is `name` a DNS name under [`REPLICA_DNS_DOMAIN`] (any case, with or without the root dot)?
fn under_replica_domain(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == REPLICA_DNS_DOMAIN || name.ends_with(&format!(".{REPLICA_DNS_DOMAIN}"))
}

/// Where a certificate and its key were written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A certificate and its private key, PEM encoded.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The CA's subject, the same every time, so a leaf signed later names it
/// exactly as the CA certificate does.
fn ca_params(days: u32) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    set_validity(&mut params, days);
    params
}

fn set_validity(params: &mut CertificateParams, days: u32) {
    let now = OffsetDateTime::now_utc();
    // An hour of slack for clocks slightly behind the issuer's.
    params.not_before = now - Duration::hours(1);
    params.not_after = now + Duration::days(i64::from(days));
    let mut serial: [u8; 16] = rand::random();
    serial[0] &= 0x7f;
    params.serial_number = Some(SerialNumber::from_slice(&serial));
}

fn check_days(days: u32, flag: &'static str) -> Result<(), TlsError> {
    if days == 0 || days > MAX_DAYS {
        return Err(TlsError::Flags { flag, why: format!("must be 1..={MAX_DAYS}") });
    }
    Ok(())
}

/// A new CA (certificate and key), PEM.
pub fn new_ca(days: u32) -> Result<IssuedCert, TlsError> {
    check_days(days, "--days")?;
    let key = KeyPair::generate().map_err(|e| TlsError::Generate(e.to_string()))?;
    let cert = ca_params(days).self_signed(&key).map_err(|e| TlsError::Generate(e.to_string()))?;
    Ok(IssuedCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// A certificate for `identity`, signed by the CA whose key is `ca_key_pem`.
pub fn issue(ca_key_pem: &str, identity: &Identity, extra_sans: &[String], days: u32) -> Result<IssuedCert, TlsError> {
    check_days(days, "--days")?;
    if extra_sans.len() > MAX_EXTRA_SANS {
        return Err(TlsError::Flags { flag: "--san", why: format!("at most {MAX_EXTRA_SANS}") });
    }
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(|e| TlsError::Generate(format!("the CA key: {e}")))?;
    let issuer = Issuer::new(ca_params(DEFAULT_CA_DAYS), ca_key);
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, identity.uri());
    params.distinguished_name = name;
    let uri = identity.uri().try_into().map_err(|e: rcgen::Error| TlsError::Generate(e.to_string()))?;
    params.subject_alt_names.push(SanType::URI(uri));
    let serves = identity.kind != IdentityKind::User;
    if serves {
        params.subject_alt_names.push(SanType::IpAddress(IpAddr::from([127, 0, 0, 1])));
        params.subject_alt_names.push(SanType::DnsName("localhost".try_into().expect("a valid DNS name")));
        if identity.kind == IdentityKind::Replica {
            let own = replica_dns_name(&identity.name);
            let own = own.clone().try_into().map_err(|e| TlsError::Flags { flag: "--server", why: format!("{own:?}: {e}") })?;
            params.subject_alt_names.push(SanType::DnsName(own));
        }
        for san in extra_sans {
            // Only the replica itself is named under the replicas' domain:
            // a client checking that name must not accept anyone else.
            if under_replica_domain(san) {
                return Err(TlsError::Flags {
                    flag: "--san",
                    why: format!("{san:?}: names under {REPLICA_DNS_DOMAIN} are the replicas' own (added to each replica's certificate)"),
                });
            }
            let entry = match san.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => {
                    SanType::DnsName(san.clone().try_into().map_err(|e| TlsError::Flags { flag: "--san", why: format!("{san:?}: {e}") })?)
                }
            };
            params.subject_alt_names.push(entry);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    } else {
        if !extra_sans.is_empty() {
            return Err(TlsError::Flags { flag: "--san", why: "only replica and agent certificates serve TLS".into() });
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, days);
    let key = KeyPair::generate().map_err(|e| TlsError::Generate(e.to_string()))?;
    let cert = params.signed_by(&key, &issuer).map_err(|e| TlsError::Generate(e.to_string()))?;
    Ok(IssuedCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// The file names of an identity's certificate in a directory:
/// `KIND-NAME.pem` and `KIND-NAME-key.pem`.
pub fn cert_files(dir: &Path, identity: &Identity) -> CertFiles {
    let stem = format!("{}-{}", identity.kind.as_str(), identity.name);
    CertFiles { cert: dir.join(format!("{stem}.pem")), key: dir.join(format!("{stem}-key.pem")) }
}

/// Write a new CA into `dir` (`ca.pem`, `ca-key.pem`); refuses to replace one.
pub fn create_ca(dir: &Path, days: u32) -> Result<CertFiles, TlsError> {
    let files = CertFiles { cert: dir.join(CA_CERT_FILE), key: dir.join(CA_KEY_FILE) };
    if files.cert.exists() || files.key.exists() {
        return Err(TlsError::bad_file(&files.cert, "a CA is already there; remove it first to make a new one"));
    }
    let ca = new_ca(days)?;
    write_pair(&files, &ca)?;
    Ok(files)
}

/// Sign a certificate for `identity` with the CA in `dir` and write it there
/// (replacing an older one of the same identity: that is how it is rotated).
pub fn create_cert(dir: &Path, identity: &Identity, extra_sans: &[String], days: u32) -> Result<CertFiles, TlsError> {
    let ca_key_path = dir.join(CA_KEY_FILE);
    let ca_key = std::fs::read_to_string(&ca_key_path).map_err(|e| TlsError::io(&ca_key_path, e))?;
    let issued = issue(&ca_key, identity, extra_sans, days)?;
    let files = cert_files(dir, identity);
    write_pair(&files, &issued)?;
    Ok(files)
}

/// Write the key first (mode 0600), then the certificate, each through a
/// temporary file renamed into place, so a reader sees whole files.
pub fn write_pair(files: &CertFiles, issued: &IssuedCert) -> Result<(), TlsError> {
    if let Some(dir) = files.cert.parent() {
        std::fs::create_dir_all(dir).map_err(|e| TlsError::io(dir, e))?;
    }
    write_atomically(&files.key, issued.key_pem.as_bytes(), 0o600)?;
    write_atomically(&files.cert, issued.cert_pem.as_bytes(), 0o644)
}

fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let temporary = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&temporary)
        .map_err(|e| TlsError::io(&temporary, e))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|e| TlsError::io(&temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| TlsError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::serial_hex;
    use crate::pem::certificates_from_pem;

    #[test]
    fn a_certificate_names_its_identity_and_serves_localhost() {
        let ca = new_ca(10).expect("ca");
        let agent = Identity::new(IdentityKind::Agent, "gpu-001").expect("identity");
        let issued = issue(&ca.key_pem, &agent, &["10.0.0.7".into(), "gpu-001.example".into()], 30).expect("issued");
        let der = &certificates_from_pem(issued.cert_pem.as_bytes()).expect("pem")[0];
        assert_eq!(Identity::of_certificate(der).expect("identity"), agent);
        let facts = crate::der::certificate_facts(der).expect("facts");
        assert_eq!(facts.uris, vec!["rota://agent/gpu-001".to_string()]);
        // Signed by the CA: a rustls verifier accepts it for 127.0.0.1 and the extra names.
        for name in ["127.0.0.1", "localhost", "10.0.0.7", "gpu-001.example"] {
            crate::link::verify_server_cert(ca.cert_pem.as_bytes(), der, name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert!(crate::link::verify_server_cert(ca.cert_pem.as_bytes(), der, "10.0.0.8").is_err());
    }

    /// A client that can check DNS names only (gRPC's Python) tells a
    /// replica from an agent by `ID.replica.rota`, which only that
    /// replica's certificate carries.
    #[test]
    fn a_replica_certificate_carries_its_dns_name_and_no_other_does() {
        let ca = new_ca(10).expect("ca");
        let replica = issue(&ca.key_pem, &Identity::new(IdentityKind::Replica, "3").expect("identity"), &[], 30).expect("issued");
        let der = &certificates_from_pem(replica.cert_pem.as_bytes()).expect("pem")[0];
        crate::link::verify_server_cert(ca.cert_pem.as_bytes(), der, "3.replica.rota").expect("its own name");
        assert!(crate::link::verify_server_cert(ca.cert_pem.as_bytes(), der, "2.replica.rota").is_err(), "another replica's name");
        let agent = Identity::new(IdentityKind::Agent, "gpu-001").expect("identity");
        let der = &certificates_from_pem(issue(&ca.key_pem, &agent, &[], 30).expect("issued").cert_pem.as_bytes()).expect("pem")[0];
        assert!(crate::link::verify_server_cert(ca.cert_pem.as_bytes(), der, "3.replica.rota").is_err(), "an agent is no replica");
        for san in ["3.replica.rota", "3.Replica.Rota.", "replica.rota"] {
            assert!(issue(&ca.key_pem, &agent, &[san.into()], 30).is_err(), "{san} on an agent");
        }
        assert!(issue(&ca.key_pem, &agent, &["notreplica.rota".into()], 30).is_ok());
    }

    #[test]
    fn each_certificate_gets_a_new_serial_and_users_serve_nothing() {
        let ca = new_ca(10).expect("ca");
        let user = Identity::new(IdentityKind::User, "alice").expect("identity");
        let one = issue(&ca.key_pem, &user, &[], 1).expect("one");
        let two = issue(&ca.key_pem, &user, &[], 1).expect("two");
        let serial = |pem: &str| serial_hex(&certificates_from_pem(pem.as_bytes()).expect("pem")[0]).expect("serial");
        assert_ne!(serial(&one.cert_pem), serial(&two.cert_pem));
        assert!(issue(&ca.key_pem, &user, &["10.0.0.1".into()], 1).is_err());
        assert!(issue(&ca.key_pem, &user, &[], 0).is_err());
    }

    #[test]
    fn files_are_written_and_a_ca_is_never_replaced() {
        let dir = tempfile::tempdir().expect("tempdir");
        create_ca(dir.path(), 10).expect("ca");
        assert!(create_ca(dir.path(), 10).is_err());
        let replica = Identity::new(IdentityKind::Replica, "1").expect("identity");
        let files = create_cert(dir.path(), &replica, &[], 10).expect("cert");
        assert_eq!(files.cert, dir.path().join("replica-1.pem"));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&files.key).expect("key").permissions().mode() & 0o777, 0o600);
    }
}
