//! HTTPS served by the gateway itself: the certificate chain and key of `tls_cert` /
//! `tls_key` loaded into a rustls server configuration, and a listener that completes each
//! TLS handshake before axum sees the connection.
//!
//! Why in the gateway: API keys and the console's credentials travel in request headers,
//! so a gateway reachable beyond its own host must not speak plain HTTP, and a separate
//! TLS proxy is one more process to provision and keep patched. rustls with the *ring*
//! provider is already in the build through the NATS and Redis clients.
//!
//! Invariants: a slow or silent client cannot hold up other connections: handshakes run
//! concurrently, each bounded by [`HANDSHAKE_TIMEOUT`], at most [`MAX_HANDSHAKES`] at once
//! (beyond it new connections wait in the kernel's backlog). A failed handshake (a plain
//! HTTP request on the TLS port, an untrusted client) ends that connection only. Graceful
//! shutdown is axum's own: the listener is just another [`Listener`].

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
use metronome_runtime::tls::{read_certificates, read_private_key, TlsFileError};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Longest a client may take to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most handshakes in progress at once.
pub const MAX_HANDSHAKES: usize = 1024;

/// Why the certificate and key cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// A file is missing, unreadable or holds no PEM certificate / key.
    #[error(transparent)]
    File(#[from] TlsFileError),
    /// rustls refused the pair (the key is not the certificate's, an unsupported key).
    #[error("tls_key {key} with tls_cert {cert}: {source}")]
    Refused {
        cert: String,
        key: String,
        source: rustls::Error,
    },
}

/// The rustls configuration serving the chain in `cert` (leaf first) with the key in
/// `key`, offering HTTP/1.1. Reads and checks both files now.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsConfigError> {
    let cert_pem = read_certificates("tls_cert", cert)?;
    let key_pem = read_private_key("tls_key", key)?;
    // Both parsed already by the reads above; these cannot fail on the same bytes.
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsFileError::Content {
            setting: "tls_cert",
            path: cert.to_path_buf(),
            expected: "certificate",
            reason: e.to_string(),
        })?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsFileError::Content {
        setting: "tls_key",
        path: key.to_path_buf(),
        expected: "private key",
        reason: e.to_string(),
    })?;
    let refused = |source| TlsConfigError::Refused {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        source,
    };
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(refused)?
            .with_no_client_auth()
            .with_single_cert(chain, key_der)
            .map_err(refused)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A TCP listener whose connections come out of a finished TLS handshake.
pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshakes: JoinSet<Option<(TlsStream<TcpStream>, SocketAddr)>>,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> TlsListener {
        TlsListener {
            tcp,
            acceptor: TlsAcceptor::from(config),
            handshakes: JoinSet::new(),
        }
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            tokio::select! {
                // axum's own accept loop: it logs and pauses on errors such as EMFILE.
                (tcp, addr) = Listener::accept(&mut self.tcp), if self.handshakes.len() < MAX_HANDSHAKES => {
                    // Without TCP_NODELAY small SSE writes wait for the client's delayed ACK.
                    let _ = tcp.set_nodelay(true);
                    let acceptor = self.acceptor.clone();
                    self.handshakes.spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => Some((stream, addr)),
                            Ok(Err(error)) => {
                                tracing::debug!(%addr, %error, "TLS handshake failed");
                                None
                            }
                            Err(_) => {
                                tracing::debug!(%addr, "TLS handshake timed out");
                                None
                            }
                        }
                    });
                }
                Some(done) = self.handshakes.join_next() => {
                    if let Ok(Some(connection)) = done {
                        return connection;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}
