//! TLS links: how a process connects (a tonic `Channel` over rustls) and
//! accepts (a stream of connections for `serve_with_incoming`, each carrying
//! the peer's verified identity), or plaintext when started `--insecure`.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint};

use crate::batched::Batched;
use crate::identity::Identity;
use crate::reload::{ClientResolver, ReloadingKey, ReloadingRoots, ServerResolver};
use crate::verify::{ClientVerifier, ServerIdentity, ServerVerifier};
use crate::TlsError;

/// A TLS handshake that takes longer than this is dropped.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Handshakes in progress at once, per listener; more wait to be accepted.
pub const MAX_CONCURRENT_HANDSHAKES: usize = 256;
/// Accepted connections waiting for the server to take them.
const ACCEPTED_QUEUE: usize = 64;
/// Pause after a failed accept (e.g. out of file descriptors).
const ACCEPT_ERROR_PAUSE_MS: u64 = 50;

pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate flags every rota process takes.
#[derive(Debug, Clone, Default)]
pub struct TlsFlags {
    /// `--tls-ca`: the CA that signs every certificate of the cluster.
    pub ca: Option<PathBuf>,
    /// `--tls-cert`: this process's certificate.
    pub cert: Option<PathBuf>,
    /// `--tls-key`: its private key.
    pub key: Option<PathBuf>,
    /// `--insecure`: plaintext, nothing verified.
    pub insecure: bool,
}

impl TlsFlags {
    fn check_insecure(&self) -> Result<bool, TlsError> {
        if self.insecure {
            if self.ca.is_some() || self.cert.is_some() || self.key.is_some() {
                return Err(TlsError::Flags { flag: "--insecure", why: "cannot be combined with --tls-ca/--tls-cert/--tls-key".into() });
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// A replica or an agent: CA, certificate and key, or `--insecure`.
    pub fn for_machine(&self) -> Result<Security, TlsError> {
        if self.check_insecure()? {
            return Ok(Security::Plaintext);
        }
        let missing = |flag| TlsError::Flags { flag, why: "is required (or --insecure for plaintext, not for production)".into() };
        let ca = self.ca.as_deref().ok_or_else(|| missing("--tls-ca"))?;
        let cert = self.cert.as_deref().ok_or_else(|| missing("--tls-cert"))?;
        let key = self.key.as_deref().ok_or_else(|| missing("--tls-key"))?;
        Security::tls(ca, Some((cert, key)))
    }

    /// A client: the CA, and a certificate with its key (or neither, which
    /// replicas refuse for now), or `--insecure`.
    pub fn for_client(&self) -> Result<Security, TlsError> {
        if self.check_insecure()? {
            return Ok(Security::Plaintext);
        }
        let ca = self.ca.as_deref().ok_or_else(|| TlsError::Flags {
            flag: "--tls-ca",
            why: "is required (or ROTA_CA; --insecure for a plaintext cluster)".into(),
        })?;
        match (self.cert.as_deref(), self.key.as_deref()) {
            (Some(cert), Some(key)) => Security::tls(ca, Some((cert, key))),
            (None, None) => Security::tls(ca, None),
            (Some(_), None) => Err(TlsError::Flags { flag: "--tls-key", why: "is required with --tls-cert".into() }),
            (None, Some(_)) => Err(TlsError::Flags { flag: "--tls-cert", why: "is required with --tls-key".into() }),
        }
    }
}

/// How a process talks to others: TLS with its certificate, or plaintext.
#[derive(Clone)]
pub enum Security {
    Tls(Arc<TlsSetup>),
    Plaintext,
}

pub struct TlsSetup {
    /// Dials replicas (the server must show a replica's certificate).
    client: Arc<ClientConfig>,
    /// Only with a certificate of our own.
    server: Option<Arc<ServerConfig>>,
    /// What another dialing configuration is made from.
    roots: Arc<ReloadingRoots>,
    own: Option<Arc<ReloadingKey>>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Security::Tls(_) => "Security::Tls",
            Security::Plaintext => "Security::Plaintext",
        })
    }
}

/// A dialing configuration: the CA bundle as it is at each handshake, the
/// server's identity as `expected`, our certificate if we have one.
fn client_config(roots: &Arc<ReloadingRoots>, own: Option<&Arc<ReloadingKey>>, expected: ServerIdentity) -> Result<ClientConfig, TlsError> {
    let verifier = Arc::new(ServerVerifier { roots: roots.clone(), expected });
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut client = match own {
        None => builder.with_no_client_auth(),
        Some(own) => builder.with_client_cert_resolver(Arc::new(ClientResolver(own.clone()))),
    };
    client.alpn_protocols = vec![b"h2".to_vec()];
    // A resumed session skips certificate verification: a certificate of a
    // CA removed from the bundle would go on working through it.
    client.resumption = rustls::client::Resumption::disabled();
    Ok(client)
}

impl Security {
    /// TLS trusting the CA bundle in `ca`, presenting `(cert, key)` if
    /// given; every file is re-read when it changes. Dials replicas only
    /// (see [`Security::expecting`] for another server).
    pub fn tls(ca: &Path, cert_and_key: Option<(&Path, &Path)>) -> Result<Security, TlsError> {
        let provider = provider();
        let roots = Arc::new(ReloadingRoots::open(ca, provider.clone())?);
        let own = match cert_and_key {
            None => None,
            Some((cert, key)) => Some(Arc::new(ReloadingKey::open(cert, key, provider.clone())?)),
        };
        let client = client_config(&roots, own.as_ref(), ServerIdentity::AnyReplica)?;
        let server = match &own {
            None => None,
            Some(own) => {
                let mut server = ServerConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| TlsError::Setup(e.to_string()))?
                    .with_client_cert_verifier(Arc::new(ClientVerifier { roots: roots.clone() }))
                    .with_cert_resolver(Arc::new(ServerResolver(own.clone())));
                server.alpn_protocols = vec![b"h2".to_vec()];
                // No resumption: every connection's certificate is checked
                // against the bundle as it is now (connections are long-lived).
                server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
                server.send_tls13_tickets = 0;
                Some(Arc::new(server))
            }
        };
        Ok(Security::Tls(Arc::new(TlsSetup { client: Arc::new(client), server, roots, own })))
    }

    /// The same certificates, dialing a server that must show `expected`
    /// (an agent's log service: `ServerIdentity::Exactly(rota://agent/NODE)`).
    pub fn expecting(&self, expected: ServerIdentity) -> Result<Security, TlsError> {
        match self {
            Security::Plaintext => Ok(Security::Plaintext),
            Security::Tls(setup) => {
                let client = client_config(&setup.roots, setup.own.as_ref(), expected)?;
                Ok(Security::Tls(Arc::new(TlsSetup {
                    client: Arc::new(client),
                    server: setup.server.clone(),
                    roots: setup.roots.clone(),
                    own: setup.own.clone(),
                })))
            }
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Security::Tls(_))
    }

    /// A lazily connected channel over `endpoint` (made by [`endpoint`]).
    /// rota's own connector dials it (see `Connector`): the endpoint's TCP
    /// settings are tonic's dialler's and do not apply; its timeouts and
    /// HTTP/2 settings do.
    pub fn channel(&self, endpoint: Endpoint) -> Channel {
        match self {
            Security::Plaintext => endpoint.connect_with_connector_lazy(Connector { tls: None }),
            Security::Tls(setup) => endpoint.connect_with_connector_lazy(Connector { tls: Some(setup.client.clone()) }),
        }
    }

    /// A channel connected now (fails if the peer cannot be reached).
    pub async fn connect(&self, endpoint: Endpoint) -> Result<Channel, tonic::transport::Error> {
        match self {
            Security::Plaintext => endpoint.connect_with_connector(Connector { tls: None }).await,
            Security::Tls(setup) => endpoint.connect_with_connector(Connector { tls: Some(setup.client.clone()) }).await,
        }
    }

    /// Accept connections on `listener`: TLS handshakes run in their own
    /// tasks (bounded, with a timeout), so a slow peer delays no other.
    /// Plaintext connections carry [`Peer::Plaintext`].
    pub fn incoming(&self, listener: TcpListener) -> Result<ReceiverStream<io::Result<Conn>>, TlsError> {
        self.incoming_with(listener, None)
    }

    /// Like [`Security::incoming`], for an HTTP listener (the REST API):
    /// the same certificates and client checks, offering HTTP/1.1 besides
    /// HTTP/2 (a client that offers only `http/1.1`, as plain `curl` may,
    /// would otherwise fail its handshake).
    pub fn incoming_http(&self, listener: TcpListener) -> Result<ReceiverStream<io::Result<Conn>>, TlsError> {
        self.incoming_with(listener, Some(vec![b"h2".to_vec(), b"http/1.1".to_vec()]))
    }

    fn incoming_with(&self, listener: TcpListener, alpn: Option<Vec<Vec<u8>>>) -> Result<ReceiverStream<io::Result<Conn>>, TlsError> {
        let acceptor = match self {
            Security::Plaintext => None,
            Security::Tls(setup) => {
                let server = setup.server.clone().ok_or_else(|| TlsError::Setup("serving TLS needs a certificate and key".into()))?;
                let server = match alpn {
                    None => server,
                    Some(protocols) => {
                        let mut config = (*server).clone();
                        config.alpn_protocols = protocols;
                        Arc::new(config)
                    }
                };
                Some(tokio_rustls::TlsAcceptor::from(server))
            }
        };
        let (sender, receiver) = mpsc::channel(ACCEPTED_QUEUE);
        tokio::spawn(accept_loop(listener, acceptor, sender));
        Ok(ReceiverStream::new(receiver))
    }

    /// The certificate a TLS server at `addr` presents now (a fresh
    /// connection each call, checked as any dial is): how an operator or a
    /// test sees a rotation.
    pub async fn server_certificate(&self, addr: &str) -> Result<CertificateDer<'static>, TlsError> {
        let Security::Tls(setup) = self else {
            return Err(TlsError::Setup("plaintext has no certificates".into()));
        };
        let uri: Uri =
            format!("http://{addr}").parse().map_err(|e| TlsError::BadEndpoint { endpoint: addr.into(), why: format!("{e}") })?;
        let stream = connect_tls(setup.client.clone(), &uri).await.map_err(|e| TlsError::Setup(format!("{addr}: {e}")))?;
        let (_, connection) = stream.into_inner();
        let certs = connection.peer_certificates().ok_or_else(|| TlsError::Setup(format!("{addr} presented no certificate")))?;
        Ok(certs[0].clone().into_owned())
    }
}

/// The endpoint of `host:port` (no scheme; the scheme says nothing here:
/// whether it is TLS is the `Security`'s business).
pub fn endpoint(addr: &str) -> Result<Endpoint, TlsError> {
    let addr = addr.trim();
    let without_scheme = addr.strip_prefix("http://").or_else(|| addr.strip_prefix("https://")).unwrap_or(addr);
    Endpoint::from_shared(format!("http://{without_scheme}"))
        .map_err(|e| TlsError::BadEndpoint { endpoint: addr.to_string(), why: e.to_string() })
}

async fn accept_loop(listener: TcpListener, acceptor: Option<tokio_rustls::TlsAcceptor>, sender: mpsc::Sender<io::Result<Conn>>) {
    let handshakes = Arc::new(Semaphore::new(MAX_CONCURRENT_HANDSHAKES));
    loop {
        let Ok(permit) = handshakes.clone().acquire_owned().await else { return };
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(ACCEPT_ERROR_PAUSE_MS)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Some(acceptor) = acceptor.clone() else {
            drop(permit);
            let info = ConnInfo { remote: Some(remote), peer: Peer::Plaintext };
            if sender.send(Ok(Conn::new(Stream::Plain(stream), info))).await.is_err() {
                return;
            }
            continue;
        };
        let sender = sender.clone();
        tokio::spawn(async move {
            let handshake = tokio::time::timeout(Duration::from_millis(HANDSHAKE_TIMEOUT_MS), acceptor.accept(stream)).await;
            drop(permit);
            let tls = match handshake {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    tracing::debug!(%remote, %error, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%remote, "TLS handshake timed out");
                    return;
                }
            };
            let peer = match tls.get_ref().1.peer_certificates().and_then(|certs| certs.first()) {
                None => Peer::Anonymous,
                Some(cert) => match Identity::of_certificate(cert) {
                    Ok(identity) => Peer::Verified(identity),
                    Err(error) => Peer::Unrecognized(error.to_string()),
                },
            };
            let info = ConnInfo { remote: Some(remote), peer };
            let _ = sender.send(Ok(Conn::new(Stream::Tls(Box::new(tls)), info))).await;
        });
    }
}

/// Who is on the other end of an accepted connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A plaintext connection (the process runs `--insecure`).
    Plaintext,
    /// TLS without a client certificate.
    Anonymous,
    /// TLS with a certificate the CA signed, naming this identity.
    Verified(Identity),
    /// A certificate the CA signed that names no usable identity.
    Unrecognized(String),
}

/// What tonic puts into every request's extensions for a connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub remote: Option<SocketAddr>,
    pub peer: Peer,
}

/// A TCP connection, in the clear or inside TLS (`T`: rustls' server or
/// client stream).
enum Stream<T> {
    Plain(TcpStream),
    Tls(Box<T>),
}

impl<T: AsyncRead + Unpin> AsyncRead for Stream<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stream<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

type ServerStream = Stream<tokio_rustls::server::TlsStream<TcpStream>>;

/// An accepted connection, plaintext or TLS. Its responses leave together
/// (see [`Batched`]).
pub struct Conn {
    io: Batched<ServerStream>,
    info: ConnInfo,
}

impl Conn {
    /// Who is on the other end.
    pub fn info(&self) -> &ConnInfo {
        &self.info
    }

    fn new(stream: ServerStream, info: ConnInfo) -> Conn {
        Conn { io: Batched::new(stream), info }
    }
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Connects a tonic channel over TCP, and over rustls when `tls` is set
/// (verifying the server's certificate against the CA for the host of the
/// URI, an IP or a name). Its requests leave together (see [`Batched`]).
#[derive(Clone)]
struct Connector {
    tls: Option<Arc<ClientConfig>>,
}

type ClientIo = TokioIo<Batched<Stream<tokio_rustls::client::TlsStream<TcpStream>>>>;

impl tower::Service<Uri> for Connector {
    type Response = ClientIo;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<ClientIo>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let stream = match tls {
                None => Stream::Plain(connect_tcp(&uri).await?.0),
                Some(config) => Stream::Tls(Box::new(connect_tls(config, &uri).await?)),
            };
            Ok(TokioIo::new(Batched::new(stream)))
        })
    }
}

/// A TCP connection to the host and port of `uri`, without Nagle's delay,
/// and the host's name as a TLS server name.
async fn connect_tcp(uri: &Uri) -> io::Result<(TcpStream, String)> {
    let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
    let host = uri.host().ok_or_else(|| invalid(format!("{uri}: no host")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    let port = uri.port_u16().ok_or_else(|| invalid(format!("{uri}: no port")))?;
    let tcp = TcpStream::connect((host.as_str(), port)).await?;
    tcp.set_nodelay(true)?;
    Ok((tcp, host))
}

async fn connect_tls(config: Arc<ClientConfig>, uri: &Uri) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let (tcp, host) = connect_tcp(uri).await?;
    let server_name =
        ServerName::try_from(host.clone()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{host}: {e}")))?;
    tokio_rustls::TlsConnector::from(config).connect(server_name, tcp).await
}

/// Does `der` verify against the CA in `ca_pem` for server name `name`?
#[cfg(test)]
pub(crate) fn verify_server_cert(ca_pem: &[u8], der: &CertificateDer<'_>, name: &str) -> Result<(), String> {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::client::WebPkiServerVerifier;
    let mut roots = rustls::RootCertStore::empty();
    for cert in crate::pem::certificates_from_pem(ca_pem)? {
        roots.add(cert).map_err(|e| e.to_string())?;
    }
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider()).build().map_err(|e| e.to_string())?;
    let name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    let now = rustls::pki_types::UnixTime::now();
    verifier.verify_server_cert(der, &[], &name, &[], now).map(|_| ()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(ca: bool, cert: bool, key: bool, insecure: bool) -> TlsFlags {
        let path = |on: bool, name: &str| on.then(|| PathBuf::from(name));
        TlsFlags {
            ca: path(ca, "/nonexistent/ca.pem"),
            cert: path(cert, "/nonexistent/c.pem"),
            key: path(key, "/nonexistent/k.pem"),
            insecure,
        }
    }

    fn error_of(result: Result<Security, TlsError>) -> String {
        result.expect_err("refused").to_string()
    }

    #[test]
    fn missing_or_conflicting_flags_are_named() {
        assert!(error_of(flags(false, true, true, false).for_machine()).starts_with("--tls-ca: is required"));
        assert!(error_of(flags(true, false, true, false).for_machine()).starts_with("--tls-cert: is required"));
        assert!(error_of(flags(true, true, false, false).for_machine()).starts_with("--tls-key: is required"));
        assert!(error_of(flags(true, false, false, true).for_machine()).starts_with("--insecure: cannot be combined"));
        assert!(error_of(flags(false, false, false, false).for_client()).starts_with("--tls-ca: is required"));
        assert!(error_of(flags(true, true, false, false).for_client()).starts_with("--tls-key: is required with --tls-cert"));
        assert!(error_of(flags(true, false, false, false).for_client()).contains("/nonexistent/ca.pem"));
        assert!(!flags(false, false, false, true).for_machine().expect("plaintext").is_tls());
    }

    /// Whether the first write of a batch on `io` gives way (the rule
    /// itself is tested in `batched`).
    fn gives_way(io: &mut (impl AsyncWrite + Unpin)) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let first = Pin::new(&mut *io).poll_write(&mut cx, b"x").is_pending();
        first && Pin::new(&mut *io).poll_write(&mut cx, b"x").is_ready()
    }

    #[tokio::test]
    async fn accepted_and_dialled_connections_write_in_batches() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let uri: Uri = format!("http://{}", listener.local_addr().expect("bound")).parse().expect("a uri");
        let (dialled, accepted) = tokio::join!(tower::Service::call(&mut Connector { tls: None }, uri), listener.accept());
        let mut dialled = dialled.expect("connected");
        let mut accepted = Conn::new(Stream::Plain(accepted.expect("accepted").0), ConnInfo { remote: None, peer: Peer::Plaintext });
        assert!(gives_way(&mut accepted), "a server's responses leave together");
        assert!(gives_way(dialled.inner_mut()), "a client's requests leave together");
    }

    #[test]
    fn endpoints_take_host_port_with_or_without_a_scheme() {
        assert_eq!(endpoint("127.0.0.1:7001").expect("valid").uri().to_string(), "http://127.0.0.1:7001/");
        assert_eq!(endpoint("https://127.0.0.1:7001").expect("valid").uri().to_string(), "http://127.0.0.1:7001/");
        assert!(endpoint("not a host").is_err());
    }
}
