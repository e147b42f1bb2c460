use std::path::PathBuf;

/// Everything that can go wrong with certificates and TLS links.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {why}")]
    BadFile { path: PathBuf, why: String },
    #[error("certificate: {0}")]
    BadCertificate(String),
    #[error("identity {uri:?}: {why}")]
    BadIdentity { uri: String, why: String },
    #[error("generating a certificate: {0}")]
    Generate(String),
    #[error("TLS setup: {0}")]
    Setup(String),
    #[error("{flag}: {why}")]
    Flags { flag: &'static str, why: String },
    #[error("endpoint {endpoint:?}: {why}")]
    BadEndpoint { endpoint: String, why: String },
}

impl TlsError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        TlsError::Io { path: path.to_path_buf(), source }
    }

    pub(crate) fn bad_file(path: &std::path::Path, why: impl ToString) -> Self {
        TlsError::BadFile { path: path.to_path_buf(), why: why.to_string() }
    }
}
