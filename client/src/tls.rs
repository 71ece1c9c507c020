//! TLS for the client's RPC and engine connections (rustls): trust the CA
//! the operator gives, optionally present a client certificate.

use std::path::PathBuf;
use std::sync::Arc;

use dmkv_common::pem::read_certs;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// TLS settings of a client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// CA certificates (PEM) that sign the server's certificate.
    pub ca_file: PathBuf,
    /// Name to check the server's certificate against (default: the host
    /// part of the server address).
    pub server_name: Option<String>,
    /// Client certificate chain and key (PEM), for servers that require one.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

/// A ready TLS client configuration and the name servers must prove.
#[derive(Clone)]
pub struct Connector {
    inner: TlsConnector,
    name: ServerName<'static>,
}

impl Connector {
    /// Builds a connector for the server at `addr` (`host:port`).
    pub fn new(opts: &TlsOptions, addr: &str) -> Result<Connector, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in read_certs(&opts.ca_file)? {
            roots.add(c).map_err(|e| format!("TLS CA {}: {e}", opts.ca_file.display()))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots);
        let config = match (&opts.client_cert, &opts.client_key) {
            (Some(cert), Some(key)) => {
                let key =
                    PrivateKeyDer::from_pem_file(key).map_err(|e| format!("TLS client key {}: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(read_certs(cert)?, key)
                    .map_err(|e| format!("TLS client certificate: {e}"))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => return Err("a TLS client certificate needs its key, and the other way round".into()),
        };
        let host = match &opts.server_name {
            Some(n) => n.clone(),
            None => host_of(addr).to_string(),
        };
        let name =
            ServerName::try_from(host.clone()).map_err(|_| format!("{host:?} is not a valid TLS server name"))?;
        Ok(Connector { inner: TlsConnector::from(Arc::new(config)), name })
    }

    /// Runs the TLS handshake over `tcp`.
    pub async fn connect(&self, tcp: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
        self.inner.connect(self.name.clone(), tcp).await
    }
}

/// The host part of `host:port` or `[v6]:port`.
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    #[test]
    fn hosts() {
        assert_eq!(super::host_of("127.0.0.1:7070"), "127.0.0.1");
        assert_eq!(super::host_of("[::1]:7070"), "::1");
        assert_eq!(super::host_of("db.example:7070"), "db.example");
        assert_eq!(super::host_of("db.example"), "db.example");
    }
}
