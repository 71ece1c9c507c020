//! TLS between cluster nodes (rustls, mutual): every connection between
//! peer ports, raft batches and snapshot transfers alike, is encrypted, and
//! each end proves which node it is with a certificate of its own, signed
//! by the cluster's CA, whose subject alternative name is the node's TLS
//! name ([`tls_name`]: `node-N` for node N of the cluster file). A dialing
//! node checks that the peer's certificate names the node it meant to
//! reach; an accepting node takes the connection as the one node of the
//! cluster file its client certificate names, so a certificate binds a
//! connection to a node id as a node secret does (`identity`). With
//! secrets as well, both must name the same node.
//!
//! The files are read again when they change (checked at most every
//! [`RELOAD_CHECK`], at a dial or an accept), so certificates are rotated
//! without a restart: connections made later use the new ones. Files that
//! do not load keep the last good ones in use, with a warning.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use dmkv_common::cluster::map::NodeId;
use dmkv_common::pem::read_certs;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

/// How often at most the files are looked at for a change.
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// The PEM files of a node's peer TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTlsFiles {
    /// This node's certificate chain: its leaf names [`tls_name`] of it.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA that signs every node's certificate.
    pub ca: PathBuf,
}

/// The name a node's certificate carries (as a DNS subject alternative
/// name).
pub fn tls_name(node: NodeId) -> String {
    format!("node-{node}")
}

/// The connection types: a dialed one, an accepted one.
pub type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;
pub type ServerStream = tokio_rustls::server::TlsStream<TcpStream>;

/// A node's peer TLS: its configurations, reloaded when the files change.
pub struct PeerTls {
    files: PeerTlsFiles,
    me: NodeId,
    /// Every node of the cluster file: whom a client certificate may name.
    nodes: Vec<NodeId>,
    loaded: Mutex<Loaded>,
}

struct Loaded {
    /// The files' times when they last loaded...
    stamps: [Option<SystemTime>; 3],
    /// ...and when they last failed to (warned once per change).
    failed: Option<[Option<SystemTime>; 3]>,
    checked: Instant,
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

impl PeerTls {
    /// Loads the files; an error names the file and what is wrong with it,
    /// including a certificate that does not name node `me`.
    pub fn load(files: PeerTlsFiles, me: NodeId, nodes: Vec<NodeId>) -> Result<PeerTls, String> {
        let stamped = stamps(&files);
        let (server, client) = configs(&files, me, &nodes)?;
        let loaded = Loaded { stamps: stamped, failed: None, checked: Instant::now(), server, client };
        Ok(PeerTls { files, me, nodes, loaded: Mutex::new(loaded) })
    }

    /// The configurations to use now, reloaded first if a file changed.
    fn current(&self) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        // A panic while holding this lock is not reachable (no code in it
        // panics), and the state is replaced whole: a poisoned lock is
        // still good.
        let mut l = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if l.checked.elapsed() >= RELOAD_CHECK {
            l.checked = Instant::now();
            // Stamped before reading: a file written meanwhile changes its
            // time again, and is read at the next check. Files that fail
            // to load are tried again every check (a pair written one
            // after the other may be read between the two writes).
            let now = stamps(&self.files);
            if now != l.stamps {
                match configs(&self.files, self.me, &self.nodes) {
                    Ok((server, client)) => {
                        (l.server, l.client, l.stamps, l.failed) = (server, client, now, None);
                        tracing::info!("peer TLS certificates reloaded");
                    }
                    Err(e) if l.failed != Some(now) => {
                        l.failed = Some(now);
                        tracing::warn!("peer TLS files changed but do not load (the last good ones stay): {e}");
                    }
                    Err(_) => {}
                }
            }
        }
        (Arc::clone(&l.server), Arc::clone(&l.client))
    }

    /// TLS over `tcp` to node `to`, whose certificate must name it.
    pub async fn connect(&self, to: NodeId, tcp: TcpStream) -> Result<ClientStream, String> {
        let name = ServerName::try_from(tls_name(to)).map_err(|e| format!("node {to}'s TLS name: {e}"))?;
        let connector = tokio_rustls::TlsConnector::from(self.current().1);
        connector.connect(name, tcp).await.map_err(|e| format!("TLS to node {to}: {e}"))
    }

    /// TLS over an accepted `tcp`; the node its certificate names.
    pub async fn accept(&self, tcp: TcpStream) -> Result<(ServerStream, NodeId), String> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.current().0);
        let s = acceptor.accept(tcp).await.map_err(|e| format!("TLS handshake: {e}"))?;
        let leaf = s.get_ref().1.peer_certificates().and_then(|c| c.first()).ok_or("no client certificate")?;
        let node = node_named(leaf, &self.nodes)?;
        Ok((s, node))
    }
}

/// The one node of `nodes` that certificate `leaf` names. A certificate
/// that names none, or several, speaks for no node.
pub fn node_named(leaf: &CertificateDer<'_>, nodes: &[NodeId]) -> Result<NodeId, String> {
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("client certificate: {e:?}"))?;
    let mut named = nodes.iter().filter(|&&n| {
        ServerName::try_from(tls_name(n)).is_ok_and(|name| cert.verify_is_valid_for_subject_name(&name).is_ok())
    });
    match (named.next(), named.next()) {
        (Some(&n), None) => Ok(n),
        (None, _) => Err("the certificate names no node of the cluster file (node-N)".into()),
        (Some(_), Some(_)) => Err("the certificate names more than one node".into()),
    }
}

fn stamps(f: &PeerTlsFiles) -> [Option<SystemTime>; 3] {
    [&f.cert, &f.key, &f.ca].map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
}

/// Both ends' configurations: this node's certificate presented either
/// way, the CA required of the other end either way, and the other end's
/// certificate naming exactly the node meant ([`NodeVerifier`] when
/// dialing, [`PeerTls::accept`] when accepting).
fn configs(
    f: &PeerTlsFiles,
    me: NodeId,
    nodes: &[NodeId],
) -> Result<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>), String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = read_certs(&f.cert)?;
    let key = || PrivateKeyDer::from_pem_file(&f.key).map_err(|e| format!("peer TLS key {}: {e}", f.key.display()));
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(&f.ca)? {
        roots.add(c).map_err(|e| format!("peer TLS CA {}: {e}", f.ca.display()))?;
    }
    let roots = Arc::new(roots);
    // A node that starts with another node's certificate (or one naming
    // several) would be refused by every peer: say so at start.
    if node_named(&certs[0], nodes) != Ok(me) {
        return Err(format!(
            "peer TLS certificate {} does not name this node ({}, as a DNS subject alternative name) and no \
             other node of the cluster file",
            f.cert.display(),
            tls_name(me)
        ));
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
        .build()
        .map_err(|e| format!("peer TLS CA {}: {e}", f.ca.display()))?;
    let server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("peer TLS: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs.clone(), key()?)
        .map_err(|e| format!("peer TLS certificate {} does not fit its key: {e}", f.cert.display()))?;
    let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
        .build()
        .map_err(|e| format!("peer TLS CA {}: {e}", f.ca.display()))?;
    let verifier = Arc::new(NodeVerifier { inner, nodes: nodes.to_vec() });
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("peer TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(certs, key()?)
        .map_err(|e| format!("peer TLS certificate {} does not fit its key: {e}", f.cert.display()))?;
    Ok((Arc::new(server), Arc::new(client)))
}

/// The dialing end's check: the CA's (webpki, as rustls does it), and
/// that the certificate names the node dialed and no other node of the
/// cluster (a certificate naming two nodes would pass the plain name
/// check for either).
#[derive(Debug)]
struct NodeVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    nodes: Vec<NodeId>,
}

impl rustls::client::danger::ServerCertVerifier for NodeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(end_entity, intermediates, server_name, ocsp, now)?;
        let meant = match server_name {
            ServerName::DnsName(d) => d.as_ref().strip_prefix("node-").and_then(|n| n.parse::<NodeId>().ok()),
            _ => None,
        };
        match (meant, node_named(end_entity, &self.nodes)) {
            (Some(m), Ok(n)) if m == n => Ok(verified),
            (_, Err(e)) => Err(rustls::Error::General(e)),
            _ => Err(rustls::Error::General("the certificate names another node".into())),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

    fn ca() -> (rcgen::Certificate, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        (p.self_signed(&key).unwrap(), key)
    }

    fn leaf(names: &[&str], ca: &(rcgen::Certificate, KeyPair)) -> (rcgen::Certificate, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        (CertificateParams::new(names).unwrap().signed_by(&key, &ca.0, &ca.1).unwrap(), key)
    }

    #[test]
    fn a_certificate_names_exactly_one_node_of_the_cluster() {
        let ca = ca();
        let nodes = [1, 2, 3, 12];
        let one = |names: &[&str]| node_named(leaf(names, &ca).0.der(), &nodes);
        assert_eq!(one(&["node-2"]), Ok(2));
        assert_eq!(one(&["node-12"]), Ok(12), "no prefix match");
        assert!(one(&["node-4"]).is_err(), "a node the file does not list");
        assert!(one(&["node-1", "node-3"]).is_err(), "two nodes");
        assert!(one(&["client"]).is_err());
        assert!(one(&["node-1.example.com"]).is_err());
        assert!(node_named(&CertificateDer::from(vec![1u8, 2, 3]), &nodes).is_err(), "garbage");
    }

    fn files(dir: &std::path::Path, node: &str, ca: &(rcgen::Certificate, KeyPair)) -> PeerTlsFiles {
        let (c, k) = leaf(&[node], ca);
        let f = PeerTlsFiles {
            cert: dir.join(format!("{node}.pem")),
            key: dir.join(format!("{node}.key")),
            ca: dir.join("ca.pem"),
        };
        std::fs::write(&f.cert, c.pem()).unwrap();
        std::fs::write(&f.key, k.serialize_pem()).unwrap();
        std::fs::write(&f.ca, ca.0.pem()).unwrap();
        f
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("dmkv-peer-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_node_refuses_to_start_with_a_certificate_of_another_node() {
        let d = tmp("start");
        let ca = ca();
        let f = files(&d, "node-2", &ca);
        let err = PeerTls::load(f.clone(), 1, vec![1, 2]).err().expect("node 1 with node 2's certificate");
        assert!(err.contains("does not name this node (node-1"), "{err}");
        assert!(PeerTls::load(f, 2, vec![1, 2]).is_ok());
        let _ = std::fs::remove_dir_all(d);
    }

    #[tokio::test]
    async fn dials_check_the_node_reached_and_accepts_learn_the_node_dialing() {
        let d = tmp("dial");
        let ca = ca();
        let a = PeerTls::load(files(&d, "node-1", &ca), 1, vec![1, 2, 3]).unwrap();
        let b = Arc::new(PeerTls::load(files(&d, "node-2", &ca), 2, vec![1, 2, 3]).unwrap());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = {
            let b = Arc::clone(&b);
            tokio::spawn(async move {
                let mut out = Vec::new();
                for _ in 0..2 {
                    let (s, _) = l.accept().await.unwrap();
                    out.push(b.accept(s).await.map(|(_, n)| n));
                }
                out
            })
        };
        // Node 1 reaching node 2: both ends agree.
        let ok = a.connect(2, TcpStream::connect(addr).await.unwrap()).await;
        // Node 1 meaning to reach node 3 finds node 2's certificate.
        let wrong = a.connect(3, TcpStream::connect(addr).await.unwrap()).await;
        let accepted = server.await.unwrap();
        assert!(ok.is_ok(), "{:?}", ok.err());
        assert!(wrong.is_err(), "node 2's certificate taken for node 3");
        assert_eq!(accepted[0], Ok(1), "the accepting end learns the dialer is node 1");
        let _ = std::fs::remove_dir_all(d);
    }

    /// A certificate naming two nodes (its holder started from a cluster
    /// file that lists only one of them) passes the CA and the name check
    /// for either, but a dialer that knows both refuses it.
    #[tokio::test]
    async fn a_dialer_refuses_a_certificate_that_names_two_nodes() {
        let d = tmp("two");
        let ca = ca();
        let a = PeerTls::load(files(&d, "node-1", &ca), 1, vec![1, 2, 3]).unwrap();
        let (c, k) = leaf(&["node-2", "node-3"], &ca);
        let two = PeerTlsFiles { cert: d.join("two.pem"), key: d.join("two.key"), ca: d.join("ca.pem") };
        std::fs::write(&two.cert, c.pem()).unwrap();
        std::fs::write(&two.key, k.serialize_pem()).unwrap();
        assert!(PeerTls::load(two.clone(), 2, vec![1, 2, 3]).is_err(), "started naming two nodes");
        let b = Arc::new(PeerTls::load(two, 2, vec![2]).unwrap());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            for _ in 0..2 {
                let (s, _) = l.accept().await.unwrap();
                let _ = b.accept(s).await;
            }
        });
        for to in [2, 3] {
            let r = a.connect(to, TcpStream::connect(addr).await.unwrap()).await;
            assert!(r.is_err(), "a certificate naming nodes 2 and 3 taken for node {to}");
        }
        server.await.unwrap();
        let _ = std::fs::remove_dir_all(d);
    }
}
