//! End-to-end tests of authentication, roles, protected mode, TLS and rkey
//! rotation, against real dmkvd processes (docs/security.md).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use dmkv_client::{Client, ClientConfig, ClientError, ErrorCode, ReadPath, TlsOptions, Token, Transport};
use dmkv_common::frame::{self, Decoder};
use dmkv_common::onesided::{self, HANDSHAKE_OK, HANDSHAKE_RATE_LIMITED, HANDSHAKE_REFUSED, ReadStatus, ReadWr};
use dmkv_common::proto::{self, Request, Response, request::Op, response::Result as R};
use dmkv_server::cluster::peer_tls::{PeerTls, PeerTlsFiles};
use dmkv_tests::{ServerProcess, TempDir, engine_connect};

const DATA: &str = "data-token-0123456789abcdef";
const ADMIN: &str = "admin-token-0123456789abcdef";

fn token(s: &str) -> Option<Arc<Token>> {
    Some(Arc::new(Token::new(s).unwrap()))
}

fn cfg(tok: Option<&str>) -> ClientConfig {
    ClientConfig::default().read_path(ReadPath::Rpc).pool_size(1).token(tok.and_then(token))
}

fn authed_server(dir: &TempDir, extra: &[&str]) -> ServerProcess {
    let auth = dir.file("auth", &format!("data {DATA}\nadmin {ADMIN}\n"));
    let mut args = vec!["--memory", "16MiB", "--auth-file", &auth];
    args.extend_from_slice(extra);
    ServerProcess::start(&args)
}

/// Sends raw requests on a fresh connection and collects the replies until
/// the server closes it or `n` replies came.
fn raw_rpc(addr: &str, reqs: &[Request], n: usize) -> (Vec<Response>, bool) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = BytesMut::new();
    for r in reqs {
        frame::encode(r, 1 << 20, &mut out).unwrap();
    }
    s.write_all(&out).unwrap();
    let dec = Decoder::new(4 << 20);
    let (mut got, mut buf, mut closed) = (Vec::new(), BytesMut::new(), false);
    while got.len() < n {
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => {
                closed = true;
                break;
            }
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
        }
        while let Some(r) = dec.next_message::<Response>(&mut buf).unwrap() {
            got.push(r);
        }
    }
    if !closed {
        let mut b = [0u8; 1];
        closed = matches!(s.read(&mut b), Ok(0) | Err(_));
    }
    (got, closed)
}

fn code_of(r: &Response) -> Option<ErrorCode> {
    match &r.result {
        Some(R::Error(e)) => ErrorCode::try_from(e.code).ok(),
        _ => None,
    }
}

fn put(id: u64, k: &str, v: &str) -> Request {
    Request {
        id,
        op: Some(Op::Put(proto::Put {
            key: k.as_bytes().to_vec().into(),
            value: v.as_bytes().to_vec().into(),
            ..Default::default()
        })),
    }
}

#[tokio::test]
async fn only_authenticated_clients_with_the_right_role_get_in() {
    let dir = TempDir::new("roles");
    let srv = authed_server(&dir, &[]);

    // No token, a wrong token: refused with a clear code.
    let err = Client::connect_with(&srv.rpc, cfg(None)).await.err().expect("no token must be refused");
    assert_eq!(err.code(), Some(ErrorCode::Unauthenticated), "{err}");
    assert!(err.to_string().contains("requires authentication"), "{err}");
    let err = Client::connect_with(&srv.rpc, cfg(Some("wrong-token-0123456789abcdef"))).await.err().unwrap();
    assert_eq!(err.code(), Some(ErrorCode::Unauthenticated), "{err}");

    // Requests before authenticating are refused, change nothing, and end
    // the connection; so does a forged proof.
    let (replies, closed) = raw_rpc(&srv.rpc, &[put(1, "k", "forged"), put(2, "k2", "forged")], 2);
    assert_eq!(replies.len(), 1);
    assert_eq!(code_of(&replies[0]), Some(ErrorCode::Unauthenticated));
    assert!(closed, "connection left open after an unauthenticated request");
    let (replies, closed) = raw_rpc(&srv.rpc, &[Request { id: 1, op: None }, put(2, "k", "forged")], 2);
    assert_eq!(replies.len(), 1);
    assert_eq!(code_of(&replies[0]), Some(ErrorCode::Unauthenticated), "an unknown op before authenticating");
    assert!(closed);
    let hello = Request { id: 1, op: Some(Op::Hello(proto::Hello { protocol_version: 1, client_name: "t".into() })) };
    let forged = Request { id: 2, op: Some(Op::Authenticate(proto::Authenticate { proof: vec![0u8; 32].into() })) };
    let (replies, closed) = raw_rpc(&srv.rpc, &[hello.clone(), forged, put(3, "k", "forged")], 3);
    match &replies[0].result {
        Some(R::Hello(h)) => assert_eq!(h.auth_nonce.len(), 32, "the HELLO reply carries the challenge"),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(code_of(&replies[1]), Some(ErrorCode::Unauthenticated));
    assert_eq!(replies.len(), 2, "nothing after a failed AUTHENTICATE is served");
    assert!(closed);

    // The data role reads and writes, but may not re-register.
    let data = Client::connect_with(&srv.rpc, cfg(Some(DATA))).await.unwrap();
    assert_eq!(data.get("k").await.unwrap(), None, "a refused PUT changed nothing");
    data.put("k", "v").await.unwrap();
    assert_eq!(data.get("k").await.unwrap().unwrap(), "v".as_bytes());
    // A GET before authenticating reads nothing, on the server's plain-GET
    // path as on any other.
    let get = Request { id: 1, op: Some(Op::Get(proto::Get { key: "k".as_bytes().to_vec().into() })) };
    let (replies, closed) = raw_rpc(&srv.rpc, &[get], 1);
    assert_eq!(replies.len(), 1);
    assert_eq!(code_of(&replies[0]), Some(ErrorCode::Unauthenticated), "{:?}", replies[0]);
    assert!(closed, "connection left open after an unauthenticated GET");
    let epoch = data.stats().await.unwrap()["region_epoch"];
    let err = data.reregister().await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::PermissionDenied), "{err}");
    assert_eq!(data.get("k").await.unwrap().unwrap(), "v".as_bytes(), "the connection stays usable");
    assert_eq!(data.stats().await.unwrap()["region_epoch"], epoch);

    // Nor send raft traffic: that goes to a cluster node's peer port only.
    let raft = || Op::Raft(proto::RaftBatch { from_node: 2, messages: vec![] });
    let err = data.send(raft()).await.unwrap().wait(Duration::from_secs(5)).await.unwrap();
    assert_eq!(code_of(&err), Some(ErrorCode::PermissionDenied));

    // The admin role may re-register.
    let admin = Client::connect_with(&srv.rpc, cfg(Some(ADMIN))).await.unwrap();
    admin.reregister().await.unwrap();
    assert_eq!(admin.stats().await.unwrap()["region_epoch"], epoch + 1);
    // But not send raft traffic either (cluster_raft_is_bound_to_the_node_that_proved_its_secret
    // has the cluster's side).
    let r = admin.send(raft()).await.unwrap().wait(Duration::from_secs(5)).await.unwrap();
    assert_eq!(code_of(&r), Some(ErrorCode::PermissionDenied));

    // One-sided reads over the engine need the token too.
    let os = cfg(Some(DATA)).read_path(ReadPath::OneSided).transport(Some(Transport::Engine));
    let reader = Client::connect_with(&srv.rpc, os).await.unwrap();
    let gets = admin.stats().await.unwrap()["gets"];
    assert_eq!(reader.get("k").await.unwrap().unwrap(), "v".as_bytes());
    assert_eq!(admin.stats().await.unwrap()["gets"], gets, "the GET went one-sided");

    // A raw engine connection without a valid proof gets nothing.
    let info = admin.region_info_full().await.unwrap();
    let (mut s, status) = engine_connect(&info.engine_addr, None);
    assert_eq!(status, HANDSHAKE_REFUSED);
    let mut req = BytesMut::new();
    onesided::encode_request(1, &[ReadWr { rkey: info.regions[0].rkey, offset: 0, len: 64 }], &mut req);
    let _ = s.write_all(&req);
    let mut b = [0u8; 1];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "a refused engine connection is closed");
    let (_, status) = engine_connect(&info.engine_addr, Token::new(DATA).ok().as_ref());
    assert_eq!(status, HANDSHAKE_OK);
}

#[tokio::test]
async fn repeated_failures_are_rate_limited() {
    let dir = TempDir::new("ratelimit");
    let srv = authed_server(&dir, &[]);
    for _ in 0..dmkv_common::auth::MAX_FAILURES {
        let err = Client::connect_with(&srv.rpc, cfg(Some("wrong-token-0123456789abcdef"))).await.err().unwrap();
        assert_eq!(err.code(), Some(ErrorCode::Unauthenticated));
    }
    // Now even the right token is refused from this address, on every port.
    let err = Client::connect_with(&srv.rpc, cfg(Some(DATA))).await.err().expect("rate limit");
    assert!(err.to_string().contains("too many failures"), "{err}");
    let engine = srv.endpoint("engine").unwrap().to_string();
    let (_, status) = engine_connect(&engine, Token::new(DATA).ok().as_ref());
    assert_eq!(status, HANDSHAKE_RATE_LIMITED);
}

#[test]
fn a_public_address_without_auth_is_refused_unless_insecure() {
    let out = std::process::Command::new(dmkv_tests::bin_path("dmkvd"))
        .args(["--listen", "0.0.0.0:0", "--memory", "16MiB"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without authentication") && err.contains("--insecure"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    let srv = ServerProcess::start_with(&[], "0.0.0.0:0", &["--memory", "16MiB", "--insecure"]).unwrap();
    assert!(srv.rpc.starts_with("0.0.0.0:"));
}

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
    other_ca: String,
}

fn pki(dir: &TempDir) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let srv_key = KeyPair::generate().unwrap();
    let srv = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&srv_key, &ca, &ca_key)
        .unwrap();
    let cli_key = KeyPair::generate().unwrap();
    let cli = CertificateParams::new(vec!["client".to_string()]).unwrap().signed_by(&cli_key, &ca, &ca_key).unwrap();
    let other_key = KeyPair::generate().unwrap();
    let mut other_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    other_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let other = other_params.self_signed(&other_key).unwrap();
    Pki {
        ca: dir.file("ca.pem", &ca.pem()),
        server_cert: dir.file("server.pem", &srv.pem()),
        server_key: dir.file("server.key", &srv_key.serialize_pem()),
        client_cert: dir.file("client.pem", &cli.pem()),
        client_key: dir.file("client.key", &cli_key.serialize_pem()),
        other_ca: dir.file("other-ca.pem", &other.pem()),
    }
}

fn tls(ca: &str) -> Option<TlsOptions> {
    Some(TlsOptions { ca_file: Path::new(ca).into(), ..Default::default() })
}

#[tokio::test]
async fn tls_carries_rpc_and_engine_reads() {
    let dir = TempDir::new("tls");
    let p = pki(&dir);
    let srv = authed_server(&dir, &["--tls-cert", &p.server_cert, "--tls-key", &p.server_key]);
    let c = Client::connect_with(&srv.rpc, cfg(Some(DATA)).tls(tls(&p.ca))).await.unwrap();
    c.put("k", vec![7u8; 100_000]).await.unwrap();
    assert_eq!(c.get("k").await.unwrap().unwrap().len(), 100_000);
    assert!(c.region_info_full().await.unwrap().engine_tls);

    let os = cfg(Some(DATA)).read_path(ReadPath::OneSided).transport(Some(Transport::Engine)).tls(tls(&p.ca));
    let reader = Client::connect_with(&srv.rpc, os).await.unwrap();
    let gets = c.stats().await.unwrap()["gets"];
    assert_eq!(reader.get("k").await.unwrap().unwrap(), vec![7u8; 100_000]);
    assert_eq!(c.stats().await.unwrap()["gets"], gets, "the GET went one-sided over the TLS engine");

    // Plaintext clients, and clients that do not trust the server's CA, fail.
    let err = Client::connect_with(&srv.rpc, cfg(Some(DATA)).connect_timeout(Duration::from_secs(2)))
        .await
        .err()
        .expect("plaintext against TLS");
    // The server's TLS alert tells a TLS mismatch from a peer that is no
    // dmkv server.
    assert!(matches!(err, ClientError::Connect { .. }) && err.to_string().contains("the server speaks TLS"), "{err}");
    let err = Client::connect_with(&srv.rpc, cfg(Some(DATA)).tls(tls(&p.other_ca)))
        .await
        .err()
        .expect("untrusted server certificate");
    assert!(err.to_string().contains("TLS"), "{err}");
    let engine = srv.endpoint("engine").unwrap().to_string();
    let mut raw = TcpStream::connect(&engine).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 8];
    assert!(raw.read_exact(&mut greeting).is_err() || greeting != onesided::ENGINE_MAGIC, "engine spoke plaintext");
}

#[tokio::test]
async fn client_certificates_are_required_when_configured() {
    let dir = TempDir::new("mtls");
    let p = pki(&dir);
    let srv =
        authed_server(&dir, &["--tls-cert", &p.server_cert, "--tls-key", &p.server_key, "--tls-client-ca", &p.ca]);
    let anon = cfg(Some(DATA)).tls(tls(&p.ca));
    let ok = match Client::connect_with(&srv.rpc, anon).await {
        // TLS 1.3 reports a refused client certificate after the handshake,
        // at the first request.
        Ok(c) => c.put("k", "v").await.is_ok(),
        Err(_) => false,
    };
    assert!(!ok, "a client without a certificate was served");
    let tls = Some(TlsOptions {
        ca_file: p.ca.clone().into(),
        client_cert: Some(p.client_cert.clone().into()),
        client_key: Some(p.client_key.clone().into()),
        ..Default::default()
    });
    let c = Client::connect_with(&srv.rpc, cfg(Some(DATA)).tls(tls)).await.unwrap();
    c.put("k", "v").await.unwrap();
    assert_eq!(c.get("k").await.unwrap().unwrap(), "v".as_bytes());
}

#[tokio::test]
async fn rotated_rkeys_retire_the_old_ones_and_clients_follow() {
    let srv = ServerProcess::start(&["--memory", "16MiB", "--rkey-rotate-secs", "1"]);
    let c = Client::connect_with(&srv.rpc, cfg(None)).await.unwrap();
    c.put("k", "v").await.unwrap();
    let first = c.region_info_full().await.unwrap();
    let old = first.regions[0].rkey;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.stats().await.unwrap()["region_epoch"] < first.regions[0].epoch + 2 {
        assert!(std::time::Instant::now() < deadline, "the rkey was not rotated");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (mut s, _) = engine_connect(&first.engine_addr, None);
    let mut req = BytesMut::new();
    onesided::encode_request(1, &[ReadWr { rkey: old, offset: 0, len: 64 }], &mut req);
    s.write_all(&req).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    assert_eq!(onesided::decode_reply(&body).unwrap().results[0].0, ReadStatus::BadRkey, "old rkey still works");
    // Clients re-attach with the current rkey and keep reading right.
    for t in [Transport::Engine, Transport::Shm] {
        let os = cfg(None).read_path(ReadPath::OneSided).transport(Some(t));
        let r = Client::connect_with(&srv.rpc, os).await.unwrap();
        for _ in 0..30 {
            assert_eq!(r.get("k").await.unwrap().unwrap(), "v".as_bytes(), "{t:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[test]
fn guessed_engine_rkeys_fail() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let engine = srv.endpoint("engine").unwrap().to_string();
    let (mut s, status) = engine_connect(&engine, None);
    assert_eq!(status, HANDSHAKE_OK);
    let guesses: Vec<ReadWr> =
        (0..1000u64).map(|i| ReadWr { rkey: i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1, offset: 0, len: 64 }).collect();
    let mut req = BytesMut::new();
    onesided::encode_request(9, &guesses, &mut req);
    s.write_all(&req).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    let r = onesided::decode_reply(&body).unwrap();
    assert!(r.results.iter().all(|(st, _)| *st == ReadStatus::BadRkey), "a guessed rkey read the region");
}

/// A cluster whose nodes serve TLS: clients reach every shard over TLS
/// (RPC and one-sided engine reads), and the nodes' raft traffic flows.
#[test]
fn a_cluster_with_tls_serves_every_shard() {
    let dir = TempDir::new("cluster-tls");
    let p = pki(&dir);
    let c = dmkv_tests::cluster::TestCluster::start(
        3,
        3,
        3,
        false,
        &["--tls-cert", &p.server_cert, "--tls-key", &p.server_key],
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let cfg = |path| ClientConfig::default().tls(tls(&p.ca)).read_path(path).transport(Some(Transport::Engine));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let client = loop {
            if let Ok(client) = Client::connect_with(c.rpc(0), cfg(ReadPath::Rpc)).await
                && let Ok(m) = client.cluster_map().await
                && m.shards().iter().all(|s| s.leader.is_some())
            {
                break client;
            }
            assert!(std::time::Instant::now() < deadline, "no leaders over TLS: node log:\n{}", c.log(0));
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for i in 0..60 {
            client.put(format!("t{i}"), format!("v{i}")).await.expect("put over TLS");
        }
        let reader = Client::connect_with(c.rpc(1), cfg(ReadPath::OneSided)).await.unwrap();
        for i in 0..60 {
            assert_eq!(reader.get(format!("t{i}")).await.unwrap().as_deref(), Some(format!("v{i}").as_bytes()));
        }
        assert!(reader.read_stats().gets > 0, "no GET went one-sided over the TLS engine");
    });
}

/// A connection speaking the framed protocol by hand, from a chosen
/// loopback address (every 127/8 address is local on Linux): to the peer
/// port, which no client SDK speaks to, and to keep one test's failed
/// proofs from rate-limiting another's address.
struct Raw<S = tokio::net::TcpStream> {
    s: S,
    buf: BytesMut,
    id: u64,
}

impl Raw {
    async fn connect(addr: &str, from: std::net::Ipv4Addr) -> Raw {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind((from, 0).into()).unwrap();
        let s = socket.connect(addr.parse().unwrap()).await.unwrap();
        Raw { s, buf: BytesMut::new(), id: 0 }
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Raw<S> {
    /// Sends `op` and returns its reply, or `None` once the peer closed.
    async fn call(&mut self, op: Op) -> Option<Response> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.id += 1;
        let mut out = BytesMut::new();
        frame::encode(&Request { id: self.id, op: Some(op) }, 1 << 20, &mut out).unwrap();
        self.s.write_all(&out).await.ok()?;
        let dec = Decoder::new(4 << 20);
        loop {
            if let Some(r) = dec.next_message::<Response>(&mut self.buf).unwrap() {
                return Some(r);
            }
            let n = tokio::time::timeout(Duration::from_secs(10), self.s.read_buf(&mut self.buf))
                .await
                .expect("a reply or a close within 10 s");
            if n.unwrap_or(0) == 0 {
                return None;
            }
        }
    }

    /// HELLO, then AUTHENTICATE with `secret`'s proof for `purpose`.
    async fn authenticate(&mut self, secret: &str, purpose: dmkv_common::auth::Purpose) -> Option<Response> {
        let hello = Op::Hello(proto::Hello { protocol_version: 1, client_name: "raw".into() });
        let nonce = match self.call(hello).await?.result {
            Some(R::Hello(h)) => h.auth_nonce,
            other => panic!("unexpected reply to HELLO: {other:?}"),
        };
        assert_eq!(nonce.len(), 32, "the peer port asks for a proof");
        let proof = Token::new(secret).unwrap().prove(purpose, &nonce).to_vec().into();
        self.call(Op::Authenticate(proto::Authenticate { proof })).await
    }
}

/// A raft message from replica `from` (a node's id << 32 | incarnation)
/// that no shard acts on: a heartbeat response from an incarnation that is
/// no member. Encoded by hand (raft-rs's `Message`: msg_type 1, from 3).
fn harmless_raft_message(from: u64) -> bytes::Bytes {
    let mut b = Vec::new();
    prost::encoding::int32::encode(1, &9, &mut b); // MsgHeartbeatResponse
    prost::encoding::uint64::encode(3, &from, &mut b);
    b.into()
}

/// A batch claiming to come from node `from_node`, of one message from a
/// replica of node `replica_node` to shard 0.
fn raft_batch(from_node: u64, replica_node: u64) -> Op {
    let env = proto::RaftEnvelope {
        shard: 0,
        message: harmless_raft_message((replica_node << 32) | 0xdead_beef),
        part: 0,
        parts: 1,
    };
    Op::Raft(proto::RaftBatch { from_node, messages: vec![env] })
}

/// How many of a batch's messages were handed to shards, or the refusal.
fn accepted(r: &Option<Response>) -> Result<u32, (Option<ErrorCode>, String)> {
    match r.as_ref().and_then(|r| r.result.as_ref()) {
        Some(R::Raft(r)) => Ok(r.accepted),
        Some(R::Error(e)) => Err((ErrorCode::try_from(e.code).ok(), e.message.clone())),
        other => Err((None, format!("{other:?}"))),
    }
}

fn node_secret(n: u64) -> String {
    format!("node-{n}-secret-0123456789abcdef")
}

/// A 3-node cluster with secrets: every node proves its own node secret to
/// its peers, and its raft traffic flows (the cluster elects and serves).
/// The admin secret gets nothing on the peer port, and the client port
/// takes raft traffic from no one. Node 2's secret makes a connection node
/// 2: its batches from node 2 are taken, one claiming node 3 is refused,
/// and so is a join for node 3's replica.
#[test]
fn cluster_raft_is_bound_to_the_node_that_proved_its_secret() {
    use dmkv_common::auth::Purpose;
    let dir = TempDir::new("peer-identity");
    let nodes: String = (1..=3).map(|n| format!("node:{n} {}\n", node_secret(n))).collect();
    let auth = dir.file("auth", &format!("data {DATA}\nadmin {ADMIN}\n{nodes}"));
    let c = dmkv_tests::cluster::TestCluster::start(3, 3, 3, false, &["--auth-file", &auth]);
    let peer = c.endpoint(0, "peer").expect("node 1's peer port").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let client = loop {
            if let Ok(client) = Client::connect_with(c.rpc(0), cfg(Some(DATA))).await
                && let Ok(m) = client.cluster_map().await
                && m.shards().iter().all(|s| s.leader.is_some())
            {
                break client;
            }
            assert!(std::time::Instant::now() < deadline, "no leaders with node secrets: node log:\n{}", c.log(0));
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for i in 0..30 {
            client.put(format!("p{i}"), format!("v{i}")).await.expect("a replicated put");
        }
        let other = Client::connect_with(c.rpc(2), cfg(Some(DATA))).await.unwrap();
        assert_eq!(other.get("p7").await.unwrap().as_deref(), Some(&b"v7"[..]));

        // The admin secret, proved for the peer port or the client port,
        // is no node's: refused, and the connection closed.
        let hostile = std::net::Ipv4Addr::new(127, 0, 0, 91);
        for purpose in [Purpose::Peer, Purpose::Rpc] {
            let mut raw = Raw::connect(&peer, hostile).await;
            let r = raw.authenticate(ADMIN, purpose).await;
            assert_eq!(r.as_ref().and_then(code_of), Some(ErrorCode::Unauthenticated), "{purpose:?}: {r:?}");
            assert!(raw.call(raft_batch(2, 2)).await.is_none(), "served after a refused proof");
        }
        // Nor is a batch taken before any proof.
        let mut raw = Raw::connect(&peer, std::net::Ipv4Addr::new(127, 0, 0, 92)).await;
        let r = raw.call(raft_batch(2, 2)).await;
        // Refused, or (seen once in CI, under load) the connection reset
        // before the refusal was read: either way not taken.
        if r.is_some() {
            assert_eq!(accepted(&r).unwrap_err().0, Some(ErrorCode::Unauthenticated), "{r:?}");
        }
        // A node's secret is no role on the client port.
        let err = Client::connect_with(c.rpc(0), cfg(Some(&node_secret(2)))).await.err().expect("a node secret");
        // Refused, or (seen once in CI, under load) the connection closed
        // before the refusal was read: either way no connection.
        if err.code().is_some() || !err.to_string().contains("closed") {
            assert_eq!(err.code(), Some(ErrorCode::Unauthenticated), "{err}");
        }

        // The client port takes no raft traffic and no join, not even
        // from the admin role.
        let admin = Client::connect_with(c.rpc(0), cfg(Some(ADMIN))).await.unwrap();
        let join = |node: u64| {
            Op::JoinShard(proto::JoinShard { shard: 0, replica_id: (node << 32) | 0xdead_beef, leave: false })
        };
        for op in [raft_batch(2, 2), join(2)] {
            let r = admin.send(op).await.unwrap().wait(Duration::from_secs(5)).await.unwrap();
            let (code, message) = accepted(&Some(r)).unwrap_err();
            assert_eq!(code, Some(ErrorCode::PermissionDenied));
            assert!(message.contains("peer port"), "{message}");
        }

        // Node 2's secret: node 2, and only node 2.
        let mut raw = Raw::connect(&peer, std::net::Ipv4Addr::new(127, 0, 0, 93)).await;
        match raw.authenticate(&node_secret(2), Purpose::Peer).await.and_then(|r| r.result) {
            Some(R::Authenticate(a)) => assert_eq!(a.role, "node:2"),
            other => panic!("node 2's secret refused: {other:?}"),
        }
        let r = raw.call(raft_batch(3, 3)).await;
        let (code, message) = accepted(&r).expect_err("node 2 passed a batch off as node 3's");
        assert_eq!(code, Some(ErrorCode::PermissionDenied));
        assert!(message.contains("node 2") && message.contains("node 3"), "{message}");
        let r = raw.call(join(3)).await;
        assert_eq!(accepted(&r).unwrap_err().0, Some(ErrorCode::PermissionDenied), "a join for node 3: {r:?}");
        // The connection stays node 2's: its own batch is taken (and the
        // message handed to shard 0), its map served.
        assert_eq!(accepted(&raw.call(raft_batch(2, 2)).await), Ok(1));
        let r = raw.call(Op::GetMap(proto::GetMap::default())).await;
        assert!(matches!(r.and_then(|r| r.result), Some(R::Map(_))), "the map for node 2");
        // Still, a message of node 3's replica in node 2's batch is dropped.
        assert_eq!(accepted(&raw.call(raft_batch(2, 3)).await), Ok(0));

        // The cluster is unharmed.
        client.put("after", "ok").await.expect("a put after the refusals");
    });
}

/// Without secrets, a test cluster's nodes each have a peer IP of their
/// own, and the peer port takes a batch only as from the node whose IP the
/// connection comes from; an address that is no node's gets nothing.
#[test]
fn without_secrets_distinct_peer_ips_bind_raft_to_their_node() {
    let c = dmkv_tests::cluster::TestCluster::start(3, 3, 3, false, &[]);
    let peer = c.endpoint(0, "peer").expect("node 1's peer port").to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut raw = Raw::connect(&peer, std::net::Ipv4Addr::LOCALHOST).await;
        let (code, message) = accepted(&raw.call(raft_batch(2, 2)).await).unwrap_err();
        assert_eq!(code, Some(ErrorCode::PermissionDenied));
        assert!(message.contains("127.0.0.1 is none of them"), "{message}");
        let mut raw = Raw::connect(&peer, c.peer_ip(1)).await;
        let (code, message) = accepted(&raw.call(raft_batch(3, 3)).await).unwrap_err();
        assert_eq!(code, Some(ErrorCode::PermissionDenied), "{message}");
        assert_eq!(accepted(&raw.call(raft_batch(2, 2)).await), Ok(1));
        // The client port takes no raft traffic here either.
        let client = Client::connect_with(c.rpc(0), cfg(None)).await.unwrap();
        let r = client.send(raft_batch(2, 2)).await.unwrap().wait(Duration::from_secs(5)).await.unwrap();
        assert_eq!(code_of(&r), Some(ErrorCode::PermissionDenied));
    });
}

/// A cluster node with secrets needs one of its own, from the auth file or
/// DMKVD_NODE_TOKEN: the admin secret no longer stands in for it.
#[test]
fn a_cluster_node_without_its_own_secret_refuses_to_start() {
    let dir = TempDir::new("node-secret");
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (rpc, peer) = (port(), port());
    let cluster = dir.file(
        "cluster.toml",
        &format!("shards = 1\nreplicas = 1\n[[node]]\nid = 1\nrpc = \"{rpc}\"\npeer = \"{peer}\"\n"),
    );
    let auth = dir.file("auth", &format!("data {DATA}\nadmin {ADMIN}\n"));
    let args = ["--memory", "16MiB", "--cluster", &cluster, "--node-id", "1", "--auth-file", &auth];
    let mut child = std::process::Command::new(dmkv_tests::bin_path("dmkvd"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A node that starts instead would never exit: wait a while only.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a cluster node without its own secret started");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(2));
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("--auth-file") && err.contains("no secret for node 1"), "{err}");
    assert!(err.contains("`node:1 SECRET`") && err.contains("DMKVD_NODE_TOKEN"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    // Its secret from the environment will do.
    let env = [std::ffi::OsString::from("env"), format!("DMKVD_NODE_TOKEN={}", node_secret(1)).into()];
    let srv = ServerProcess::start_with(&env, &rpc.to_string(), &args).expect("a node with DMKVD_NODE_TOKEN");
    assert!(srv.endpoint("peer").is_some());
}

/// A CA's certificate and key, and certificates it signs naming nodes.
fn node_pki(dir: &TempDir, prefix: &str, nodes: &[u64]) -> String {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    for &n in nodes {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![format!("node-{n}")]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
        dir.file(&format!("{prefix}node{n}.pem"), &cert.pem());
        dir.file(&format!("{prefix}node{n}.key"), &key.serialize_pem());
    }
    dir.file(&format!("{prefix}ca.pem"), &ca.pem())
}

/// Peer TLS: nodes replicate over mutual TLS; the peer port speaks
/// nothing else; a node whose certificate another CA signed is refused by
/// its peers (and says so in their logs) while the others go on; once its
/// files are replaced, it is taken again without a restart (reload) and
/// catches up. A node given another node's certificate does not start; a
/// holder of node 2's certificate is refused as node 3, on either end.
#[test]
fn cluster_nodes_replicate_over_mutual_tls_bound_to_their_ids() {
    let dir = TempDir::new("peer-tls");
    let ca = node_pki(&dir, "", &[1, 2, 3]);
    node_pki(&dir, "rogue-", &[3]);
    let path = |f: &str| dir.0.join(f).to_string_lossy().to_string();
    let (cert, key) = (path("node{id}.pem"), path("node{id}.key"));
    let mut c = dmkv_tests::cluster::TestCluster::start(
        3,
        3,
        3,
        false,
        &[
            "--peer-tls-cert",
            &cert,
            "--peer-tls-key",
            &key,
            "--peer-tls-ca",
            &ca,
            "--log",
            "warn,dmkv_server::cluster::peer_tls=info",
        ],
    );
    let peer = c.endpoint(0, "peer").expect("node 1's peer port").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let client = Client::connect(c.rpc(0)).await.unwrap();
        for i in 0..20 {
            client.put(format!("t{i}"), format!("v{i}")).await.expect("a put replicated over TLS");
        }
        // Plaintext on the peer port: not served.
        let mut raw = Raw::connect(&peer, std::net::Ipv4Addr::new(127, 0, 0, 93)).await;
        assert!(raw.call(raft_batch(2, 2)).await.is_none(), "the peer port answered plaintext");
        // Node 2's certificate speaking for node 3: refused, while the
        // same connection is taken for what it says as node 2.
        let files = |n: u32| PeerTlsFiles {
            cert: dir.0.join(format!("node{n}.pem")),
            key: dir.0.join(format!("node{n}.key")),
            ca: dir.0.join("ca.pem"),
        };
        let as_node2 = PeerTls::load(files(2), 2, vec![1, 2, 3]).unwrap();
        let tcp = tokio::net::TcpStream::connect(&peer).await.unwrap();
        let s = as_node2.connect(1, tcp).await.expect("node 2's certificate is good");
        let mut raw = Raw { s, buf: BytesMut::new(), id: 0 };
        let (code, msg) = accepted(&raw.call(raft_batch(3, 3)).await).expect_err("node 2 taken as node 3");
        assert_eq!(code, Some(ErrorCode::PermissionDenied), "{msg}");
        assert_eq!(accepted(&raw.call(raft_batch(2, 2)).await), Ok(1), "node 2 as itself");
        // Dialing node 1 but reaching a holder of node 2's certificate
        // (an address taken over): the dialer refuses it.
        let tcp = tokio::net::TcpStream::connect(&peer).await.unwrap();
        let as_node1 = PeerTls::load(files(1), 1, vec![1, 2, 3]).unwrap();
        assert!(as_node1.connect(2, tcp).await.is_err(), "node 1's certificate taken for node 2");
    });

    // Node 3 with a certificate of another CA: refused by its peers.
    c.kill(2);
    for ext in ["pem", "key"] {
        std::fs::copy(path(&format!("node3.{ext}")), path(&format!("good-node3.{ext}"))).unwrap();
        std::fs::copy(path(&format!("rogue-node3.{ext}")), path(&format!("node3.{ext}"))).unwrap();
    }
    c.restart(2);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !c.log(0).contains("peer TLS refused") {
        assert!(std::time::Instant::now() < deadline, "node 1 did not refuse node 3:\n{}", c.log(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    let target = rt.block_on(async {
        let client = Client::connect(c.rpc(0)).await.unwrap();
        for i in 0..20 {
            client.put(format!("u{i}"), format!("w{i}")).await.expect("nodes 1 and 2 go on");
        }
        applied_by_leaders(&c).await
    });
    std::thread::sleep(Duration::from_secs(1));
    assert!(!caught_up(&rt, &c, &target), "node 3 caught up with a certificate of another CA");
    // Its own files back, no restart: taken again, and it catches up.
    for ext in ["pem", "key"] {
        std::fs::copy(path(&format!("good-node3.{ext}")), path(&format!("node3.{ext}"))).unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !caught_up(&rt, &c, &target) {
        assert!(
            std::time::Instant::now() < deadline,
            "node 3 did not catch up after its files were fixed:\n{}",
            c.log(2)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(c.log(2).contains("peer TLS certificates reloaded"), "{}", c.log(2));

    // Node 3 started with node 2's certificate: refuses to start.
    c.kill(2);
    for ext in ["pem", "key"] {
        std::fs::copy(path(&format!("node2.{ext}")), path(&format!("node3.{ext}"))).unwrap();
    }
    let err = c.try_restart(2).expect_err("node 3 started with node 2's certificate");
    assert!(err.contains("does not name this node (node-3"), "{err}");
}

/// Each shard's applied index on its leader (nodes 1 and 2).
async fn applied_by_leaders(c: &dmkv_tests::cluster::TestCluster) -> std::collections::BTreeMap<u32, u64> {
    let mut out = std::collections::BTreeMap::new();
    for i in 0..2 {
        let s = Client::connect(c.rpc(i)).await.unwrap().cluster_status().await.unwrap();
        out.extend(s.local.iter().filter(|r| r.role == "leader").map(|r| (r.shard, r.applied)));
    }
    out
}

/// Whether node 3's replicas applied what the leaders had in `target`.
fn caught_up(
    rt: &tokio::runtime::Runtime,
    c: &dmkv_tests::cluster::TestCluster,
    target: &std::collections::BTreeMap<u32, u64>,
) -> bool {
    rt.block_on(async {
        let Ok(client) = Client::connect(c.rpc(2)).await else { return false };
        let Ok(s) = client.cluster_status().await else { return false };
        target.iter().all(|(shard, a)| s.local.iter().any(|r| r.shard == *shard && r.applied >= *a))
    })
}
