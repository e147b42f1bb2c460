//! A certificate and key that follow their files: re-read when either
//! file's modification time or size changes, checked at most once per
//! `RELOAD_CHECK_MS` on a new handshake. New connections get the new
//! certificate; open ones keep theirs. A half-written or mismatched pair is
//! not taken: the previous one is served until the files agree again.
//!
//! The CA bundle follows its file the same way ([`ReloadingRoots`]), so a
//! CA is rotated without a restart: append the new CA to the bundle on
//! every machine, move every certificate to the new CA, then remove the old
//! one from the bundle.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;

use crate::{pem, TlsError};

/// How often the files are looked at, at most.
pub const RELOAD_CHECK_MS: u64 = 1_000;

/// What identifies a version of a file without reading it.
type Stamp = Option<(SystemTime, u64)>;

pub(crate) fn stamp(path: &Path) -> Stamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    stamps: (Stamp, Stamp),
    checked: Instant,
}

#[derive(Debug)]
pub struct ReloadingKey {
    cert_path: PathBuf,
    key_path: PathBuf,
    provider: Arc<CryptoProvider>,
    /// How often the files are looked at, at most (RELOAD_CHECK_MS).
    check_every: Duration,
    loaded: Mutex<Loaded>,
}

impl ReloadingKey {
    /// Load the pair now; an error here names the file.
    pub fn open(cert_path: &Path, key_path: &Path, provider: Arc<CryptoProvider>) -> Result<ReloadingKey, TlsError> {
        Self::open_checking_every(cert_path, key_path, provider, Duration::from_millis(RELOAD_CHECK_MS))
    }

    fn open_checking_every(
        cert_path: &Path,
        key_path: &Path,
        provider: Arc<CryptoProvider>,
        check_every: Duration,
    ) -> Result<ReloadingKey, TlsError> {
        let stamps = (stamp(cert_path), stamp(key_path));
        let key = load(cert_path, key_path, &provider)?;
        Ok(ReloadingKey {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            provider,
            check_every,
            loaded: Mutex::new(Loaded { key, stamps, checked: Instant::now() }),
        })
    }

    /// The pair to present on a new connection.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let mut loaded = match self.loaded.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if loaded.checked.elapsed() >= self.check_every {
            loaded.checked = Instant::now();
            let stamps = (stamp(&self.cert_path), stamp(&self.key_path));
            if stamps != loaded.stamps {
                match load(&self.cert_path, &self.key_path, &self.provider) {
                    Ok(key) => {
                        tracing::info!(cert = %self.cert_path.display(), "certificate files changed; serving the new certificate");
                        loaded.key = key;
                        loaded.stamps = stamps;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "certificate files changed but cannot be used (yet); keeping the previous certificate")
                    }
                }
            }
        }
        loaded.key.clone()
    }
}

fn load(cert_path: &Path, key_path: &Path, provider: &CryptoProvider) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = pem::certificates(cert_path)?;
    crate::Identity::of_certificate(&chain[0]).map_err(|e| TlsError::bad_file(cert_path, e))?;
    let key = pem::private_key(key_path)?;
    let certified = CertifiedKey::from_der(chain, key, provider)
        .map_err(|e| TlsError::bad_file(key_path, format!("does not match {}: {e}", cert_path.display())))?;
    Ok(Arc::new(certified))
}

/// The verifiers built from one version of the CA bundle.
#[derive(Debug, Clone)]
pub struct Verifiers {
    /// Checks servers' certificates (this process dialing).
    pub server: Arc<WebPkiServerVerifier>,
    /// Checks clients' certificates (this process serving); clients without
    /// one get through the handshake and are refused per request.
    pub client: Arc<dyn ClientCertVerifier>,
}

#[derive(Debug)]
struct LoadedRoots {
    verifiers: Verifiers,
    stamp: Stamp,
    checked: Instant,
}

/// The trusted CA bundle, re-read when its file changes (checked at most
/// once per `RELOAD_CHECK_MS`, on a handshake). A file that cannot be used
/// (half written, no certificate in it) is not taken: the previous bundle
/// stays trusted until the file is whole again.
#[derive(Debug)]
pub struct ReloadingRoots {
    path: PathBuf,
    provider: Arc<CryptoProvider>,
    check_every: Duration,
    loaded: Mutex<LoadedRoots>,
}

impl ReloadingRoots {
    /// Load the bundle now; an error here names the file.
    pub fn open(path: &Path, provider: Arc<CryptoProvider>) -> Result<ReloadingRoots, TlsError> {
        Self::open_checking_every(path, provider, Duration::from_millis(RELOAD_CHECK_MS))
    }

    pub(crate) fn open_checking_every(
        path: &Path,
        provider: Arc<CryptoProvider>,
        check_every: Duration,
    ) -> Result<ReloadingRoots, TlsError> {
        let stamp = stamp(path);
        let verifiers = load_roots(path, &provider)?;
        Ok(ReloadingRoots {
            path: path.to_path_buf(),
            provider,
            check_every,
            loaded: Mutex::new(LoadedRoots { verifiers, stamp, checked: Instant::now() }),
        })
    }

    /// The verifiers of the bundle as it is now.
    pub fn current(&self) -> Verifiers {
        let mut loaded = match self.loaded.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        if loaded.checked.elapsed() >= self.check_every {
            loaded.checked = Instant::now();
            let stamp = stamp(&self.path);
            if stamp != loaded.stamp {
                match load_roots(&self.path, &self.provider) {
                    Ok(verifiers) => {
                        tracing::info!(ca = %self.path.display(), "CA bundle changed; trusting the new bundle");
                        loaded.verifiers = verifiers;
                        loaded.stamp = stamp;
                    }
                    Err(error) => tracing::warn!(%error, "CA bundle changed but cannot be used (yet); keeping the previous one"),
                }
            }
        }
        loaded.verifiers.clone()
    }
}

fn load_roots(path: &Path, provider: &Arc<CryptoProvider>) -> Result<Verifiers, TlsError> {
    let roots = Arc::new(pem::roots(path)?);
    let setup = |e: rustls::server::VerifierBuilderError| TlsError::bad_file(path, format!("not a usable CA bundle: {e}"));
    let server = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone()).build().map_err(setup)?;
    let client = WebPkiClientVerifier::builder_with_provider(roots, provider.clone()).allow_unauthenticated().build().map_err(setup)?;
    Ok(Verifiers { server, client })
}

#[derive(Debug)]
pub struct ServerResolver(pub Arc<ReloadingKey>);

impl rustls::server::ResolvesServerCert for ServerResolver {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current())
    }
}

#[derive(Debug)]
pub struct ClientResolver(pub Arc<ReloadingKey>);

impl rustls::client::ResolvesClientCert for ClientResolver {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::{cert_files, issue, new_ca, write_pair};
    use crate::identity::{serial_hex, Identity, IdentityKind};

    fn serial_of(key: &CertifiedKey) -> String {
        serial_hex(&key.cert[0]).expect("serial")
    }

    #[test]
    fn new_files_are_served_and_a_half_written_pair_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = new_ca(1).expect("ca");
        let replica = Identity::new(IdentityKind::Replica, "1").expect("identity");
        let files = cert_files(dir.path(), &replica);
        let first = issue(&ca.key_pem, &replica, &[], 1).expect("first");
        write_pair(&files, &first).expect("written");
        let key = ReloadingKey::open_checking_every(&files.cert, &files.key, crate::link::provider(), Duration::ZERO).expect("opened");
        let first_serial = serial_of(&key.current());

        // Only the certificate replaced: it does not match the key yet.
        let second = issue(&ca.key_pem, &replica, &[], 1).expect("second");
        std::fs::write(&files.cert, &second.cert_pem).expect("cert written");
        assert_eq!(serial_of(&key.current()), first_serial, "a mismatched pair is not taken");

        std::fs::write(&files.key, &second.key_pem).expect("key written");
        let second_serial = serial_of(&key.current());
        assert_ne!(second_serial, first_serial, "the new pair is served");
        assert_eq!(second_serial, serial_hex(&crate::pem::certificates(&files.cert).expect("cert")[0]).expect("serial"));
    }
}
