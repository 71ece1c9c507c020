//! TLS for the RPC and engine listeners (rustls): the certificate and key
//! from `--tls-cert`/`--tls-key`, and client certificates required when
//! `--tls-client-ca` is given. One-sided reads over RDMA or shared memory
//! do not pass through here: they are plaintext by nature.

use std::sync::Arc;

use dmkv_common::pem::read_certs;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use tokio_rustls::TlsAcceptor;

use crate::config::TlsFiles;

/// Builds the acceptor both TLS listeners share.
pub fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| format!("TLS key {}: {e}", files.key.display()))?;
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in read_certs(ca)? {
                roots.add(c).map_err(|e| format!("TLS client CA {}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("TLS client CA {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("TLS certificate {} does not fit its key: {e}", files.cert.display()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}
