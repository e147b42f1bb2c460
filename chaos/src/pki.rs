//! The certificates of a local cluster: one CA per cluster directory
//! (`ROOT/tls`), and a certificate per replica, agent and user, made on
//! first use through rota-tls (no shelling out).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rota_tls::certs::{self, CertFiles};
use rota_tls::{Identity, IdentityKind, Security};

/// The user every harness client acts as.
pub const HARNESS_USER: &str = "harness";
/// Lifetime of the harness's certificates, days.
const CERT_DAYS: u32 = 2;

#[derive(Debug, Clone)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// The PKI under `root/tls`, with a CA made now if there is none.
    pub fn at(root: &Path) -> Result<Pki> {
        let dir = root.join("tls");
        if !dir.join(certs::CA_CERT_FILE).exists() {
            certs::create_ca(&dir, CERT_DAYS).with_context(|| format!("creating a CA in {}", dir.display()))?;
        }
        Ok(Pki { dir })
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join(certs::CA_CERT_FILE)
    }

    /// The certificate files of `kind`/`name`, made if missing.
    pub fn files(&self, kind: IdentityKind, name: &str) -> Result<CertFiles> {
        let identity = Identity::new(kind, name)?;
        let files = certs::cert_files(&self.dir, &identity);
        if !files.cert.exists() || !files.key.exists() {
            return Ok(certs::create_cert(&self.dir, &identity, &[], CERT_DAYS)?);
        }
        Ok(files)
    }

    /// Issue a new certificate for `kind`/`name` in place (a rotation).
    pub fn rotate(&self, kind: IdentityKind, name: &str) -> Result<CertFiles> {
        Ok(certs::create_cert(&self.dir, &Identity::new(kind, name)?, &[], CERT_DAYS)?)
    }

    /// `--tls-ca CA --tls-cert CERT --tls-key KEY` for a process acting as `kind`/`name`.
    pub fn flags(&self, kind: IdentityKind, name: &str) -> Result<Vec<String>> {
        let files = self.files(kind, name)?;
        Ok(vec![
            "--tls-ca".into(),
            self.ca().display().to_string(),
            "--tls-cert".into(),
            files.cert.display().to_string(),
            "--tls-key".into(),
            files.key.display().to_string(),
        ])
    }

    /// How an in-process client acting as `kind`/`name` connects.
    pub fn security(&self, kind: IdentityKind, name: &str) -> Result<Security> {
        let files = self.files(kind, name)?;
        Ok(Security::tls(&self.ca(), Some((&files.cert, &files.key)))?)
    }

    /// TLS trusting the CA, without a certificate of its own.
    pub fn anonymous(&self) -> Result<Security> {
        Ok(Security::tls(&self.ca(), None)?)
    }
}
