//! An HTTPS server for tests: a certificate for `127.0.0.1` and `localhost` signed by an
//! authority of its own (made with the `openssl` command), ALPN offering HTTP/2 and HTTP/1.1.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// What [`serve`] started: where, and the authority's certificate (PEM) a client must trust.
#[derive(Debug)]
pub struct Served {
    pub addr: SocketAddr,
    pub ca_file: PathBuf,
}

/// Serves `app` over TLS on a port of its own.
///
/// # Panics
/// `openssl` fails, or the port cannot be bound.
pub async fn serve(app: axum::Router) -> Served {
    let dir = std::env::temp_dir().join(format!("jobfold-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir);
    let chain = vec![CertificateDer::from_pem_file(dir.join("server.pem")).unwrap()];
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = TlsListener { listener, acceptor: TlsAcceptor::from(Arc::new(config)) };
    tokio::spawn(async move { axum::serve(tls, app).await });
    Served { addr, ca_file: dir.join("ca.pem") }
}

/// Writes `ca.pem`, and `server.pem` with `server.key`, signed by it, into `dir`.
fn certificates(dir: &Path) {
    let openssl = |args: &str| {
        let out = Command::new("openssl")
            .args(args.split_whitespace())
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "openssl {args}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    openssl(&format!(
        "req -x509 {key} -keyout ca.key -out ca.pem -days 2 -subj /CN=jobfold-test-authority \
         -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign"
    ));
    openssl(&format!("req {key} -keyout server.key -out server.csr -subj /CN=localhost"));
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
         extendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem \
         -days 2 -extfile server.ext",
    );
}

/// Accepts TCP connections and completes each TLS handshake (one at a time: enough here).
struct TlsListener {
    listener: TcpListener,
    acceptor: TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((stream, addr)) = self.listener.accept().await else { continue };
            match self.acceptor.accept(stream).await {
                Ok(tls) => return (tls, addr),
                Err(e) => tracing::warn!("a TLS handshake failed: {e}"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}
