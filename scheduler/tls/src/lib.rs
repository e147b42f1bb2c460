//! rota-tls: transport security shared by replicas, agents and clients.
//!
//! - `certs`: make a CA and certificates (`rota tls ...`, the test harness);
//! - `identity`: the `rota://KIND/NAME` identity a certificate carries, and
//!   a pure parser for it (`der`: the few DER fields read);
//! - `link`: TLS channels and listeners over rustls (ring), or plaintext
//!   when a process is started `--insecure`;
//! - `reload`: a certificate, and the CA bundle, re-read when their files change;
//! - `verify`: certificates checked against the bundle as it is now, and
//!   a server's identity against the one the dialer meant to reach;
//! - `auth`: the one place a request's caller is established and checked.

pub mod auth;
mod batched;
pub mod certs;
pub mod der;
mod error;
pub mod identity;
pub mod link;
pub mod pem;
mod reload;
pub mod verify;

pub use auth::Caller;
pub use error::TlsError;
pub use identity::{Identity, IdentityKind};
pub use link::{endpoint, ConnInfo, Peer, Security, TlsFlags};
pub use reload::RELOAD_CHECK_MS;
pub use verify::ServerIdentity;
