//! PEM files to DER: certificates, keys and the trusted CA.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

use crate::TlsError;

/// Every certificate in a PEM text, in order.
pub fn certificates_from_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    if certs.is_empty() {
        return Err("no certificate in it".into());
    }
    Ok(certs)
}

pub fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::io(path, e))
}

pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    certificates_from_pem(&read(path)?).map_err(|why| TlsError::bad_file(path, why))
}

pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(&read(path)?).map_err(|e| TlsError::bad_file(path, format!("no private key in it: {e}")))
}

/// The trust roots: every certificate in the CA file.
pub fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path)? {
        store.add(cert).map_err(|e| TlsError::bad_file(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(store)
}
