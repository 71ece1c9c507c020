//! End-to-end tests of the RDMA backend against a real verbs device (Linux
//! Soft-RoCE in the test VM: tests/rdma-vm/run-tests.sh). Built only with
//! the `rdma` feature. Without a device they are skipped, unless
//! DMKV_RDMA_TESTS=1 (as in the VM), where a missing device fails them.
#![cfg(feature = "rdma")]

use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_common::proto::{RdmaConnect, RdmaConnectReply, request::Op, response::Result as R};
use dmkv_tests::ServerProcess;
use dmkv_tests::rdma::device_or_skip;
use dmkv_verbs::{Context, Endpoint, MemoryRegion, QueuePair, ReadRequest, VerbsError};

fn rdma_cfg() -> ClientConfig {
    ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Rdma)).pool_size(1)
}

#[tokio::test]
async fn gets_over_rdma_read_never_reach_kv_code() {
    if !device_or_skip("gets_over_rdma_read_never_reach_kv_code") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    assert!(srv.endpoint("rdma").is_some(), "dmkvd did not register its region for RDMA");
    let rpc = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();
    let value = |i: usize| format!("v{i}-").repeat(1 + (i * 37) % 400).into_bytes();
    for i in 0..300 {
        rpc.put(format!("k{i}"), value(i)).await.unwrap();
    }
    rpc.put("big", vec![7u8; 300_000]).await.unwrap();
    let auto = Client::connect(&srv.rpc).await.unwrap();
    assert_eq!(auto.one_sided_transport(), Some(Transport::Rdma), "auto picks RDMA where the server offers it");
    let c = Client::connect_with(&srv.rpc, rdma_cfg()).await.unwrap();
    let before = rpc.stats().await.unwrap();
    for round in 0..2 {
        for i in 0..300 {
            assert_eq!(c.get(format!("k{i}")).await.unwrap().unwrap(), value(i), "round {round} k{i}");
        }
    }
    assert_eq!(c.get("big").await.unwrap().unwrap(), vec![7u8; 300_000]);
    assert_eq!(c.get("absent").await.unwrap(), None);
    let keys: Vec<String> = (0..400).map(|i| format!("k{i}")).collect();
    for (i, v) in c.multi_get(&keys).await.unwrap().into_iter().enumerate() {
        assert_eq!(v.map(|b| b.to_vec()), (i < 300).then(|| value(i)), "multi-get k{i}");
    }
    rpc.put("k1", "changed").await.unwrap();
    assert_eq!(c.get("k1").await.unwrap().unwrap(), "changed".as_bytes());
    rpc.delete("k2").await.unwrap();
    assert_eq!(c.get("k2").await.unwrap(), None);
    let after = rpc.stats().await.unwrap();
    // Printed before any assertion, so a failure shows which GETs left the
    // one-sided path and why (retries by cause, fallbacks).
    let rs = c.read_stats();
    println!("rdma read stats: {rs:?}; server GETs {}", after["gets"] - before["gets"]);
    assert_eq!(after["gets"], before["gets"], "the server's KV code ran for an RDMA GET: {rs:?}");
    assert_eq!(after["engine_reads"], before["engine_reads"], "GETs went through the TCP engine, not RDMA");
    assert!(rs.gets >= 600 + 400 + 4 && rs.fallbacks == 0, "{rs:?}");
}

/// A raw queue pair connected to the server through `rpc`.
async fn raw_qp(ctx: &std::sync::Arc<Context>, rpc: &Client) -> (QueuePair, RdmaConnectReply) {
    let mut qp = QueuePair::create(ctx, 64).unwrap();
    let op = Op::RdmaConnect(RdmaConnect { endpoint: qp.endpoint().to_bytes().to_vec().into() });
    let sent = rpc.send(op).await.unwrap();
    let reply = match dmkv_client::error::unwrap(sent.wait(Duration::from_secs(5)).await.unwrap()).unwrap() {
        R::RdmaConnect(r) => r,
        other => panic!("RDMA connect: unexpected reply {other:?}"),
    };
    qp.connect(&Endpoint::from_bytes(&reply.endpoint).unwrap()).unwrap();
    (qp, reply)
}

#[tokio::test]
async fn wrong_rkey_and_out_of_bounds_fail_with_completion_errors() {
    if !device_or_skip("wrong_rkey_and_out_of_bounds_fail_with_completion_errors") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let rpc =
        Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc).pool_size(1)).await.unwrap();
    rpc.put("k", "v").await.unwrap();
    let ctx = Context::open(None).unwrap();
    let mut buf = MemoryRegion::register_local(&ctx, 4096).unwrap();
    let deadline = || Instant::now() + Duration::from_secs(30);
    let read = |r: &RdmaConnectReply, rkey: u32, offset: u64, len: u32| ReadRequest {
        wr_id: 1,
        remote_addr: r.addr + offset,
        rkey,
        len,
        local_offset: 0,
    };

    let (mut qp, r) = raw_qp(&ctx, &rpc).await;
    qp.read_batch(&[read(&r, r.rkey, 0, 64)], &mut buf, deadline()).unwrap();
    assert_eq!(buf.slice(0, 8).unwrap(), b"DMKVREG1");
    let err = qp.read_batch(&[read(&r, r.rkey ^ 0x5a5a, 0, 64)], &mut buf, deadline()).unwrap_err();
    assert!(matches!(err, VerbsError::Completion { .. }), "wrong rkey: {err}");

    let (mut qp, r) = raw_qp(&ctx, &rpc).await;
    let err = qp.read_batch(&[read(&r, r.rkey, r.length - 8, 64)], &mut buf, deadline()).unwrap_err();
    assert!(matches!(err, VerbsError::Completion { .. }), "read past the region's end: {err}");

    // Nothing else broke: a fresh queue pair, one-sided clients and RPC all work.
    let (mut qp, r) = raw_qp(&ctx, &rpc).await;
    qp.read_batch(&[read(&r, r.rkey, r.length - 64, 64)], &mut buf, deadline()).unwrap();
    let c = Client::connect_with(&srv.rpc, rdma_cfg()).await.unwrap();
    assert_eq!(c.get("k").await.unwrap().unwrap(), "v".as_bytes());
    assert_eq!(rpc.get("k").await.unwrap().unwrap(), "v".as_bytes());
}

#[tokio::test]
async fn reregistration_revokes_the_rdma_rkey() {
    if !device_or_skip("reregistration_revokes_the_rdma_rkey") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let rpc =
        Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc).pool_size(1)).await.unwrap();
    rpc.put("k", "v1").await.unwrap();
    let c = Client::connect_with(&srv.rpc, rdma_cfg()).await.unwrap();
    assert_eq!(c.get("k").await.unwrap().unwrap(), "v1".as_bytes());
    let ctx = Context::open(None).unwrap();
    let mut buf = MemoryRegion::register_local(&ctx, 4096).unwrap();
    let (mut qp, old) = raw_qp(&ctx, &rpc).await;
    rpc.reregister().await.unwrap();
    let req = ReadRequest { wr_id: 1, remote_addr: old.addr, rkey: old.rkey, len: 64, local_offset: 0 };
    let err = qp.read_batch(&[req], &mut buf, Instant::now() + Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err, VerbsError::Completion { .. }), "old rkey still works: {err}");
    rpc.put("k", "v2").await.unwrap();
    let gets = rpc.stats().await.unwrap()["gets"];
    assert_eq!(c.get("k").await.unwrap().unwrap(), "v2".as_bytes(), "client follows the new registration");
    assert_eq!(rpc.stats().await.unwrap()["gets"], gets);
}

/// The server's queue pairs live as long as the connection that set them
/// up. The RDMA path has a control connection of its own, so replacing the
/// client's pooled RPC connections (as the path controller does to congested
/// ones) must not touch it: GETs go on over RDMA with no failure.
#[tokio::test]
async fn replacing_rpc_connections_keeps_the_rdma_path() {
    if !device_or_skip("replacing_rpc_connections_keeps_the_rdma_path") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let c = Client::connect_with(&srv.rpc, rdma_cfg()).await.unwrap();
    for i in 0..20 {
        c.put(format!("k{i}"), format!("v{i}")).await.unwrap();
    }
    assert_eq!(c.get("k0").await.unwrap().unwrap(), "v0".as_bytes());
    let gets = c.stats().await.unwrap()["gets"];
    c.replace_rpc_connections().await;
    // A request on a fresh pooled connection; the old one is closed.
    assert_eq!(c.stats().await.unwrap()["gets"], gets);
    tokio::time::sleep(Duration::from_millis(200)).await;
    for i in 0..20 {
        assert_eq!(c.get(format!("k{i}")).await.unwrap().unwrap(), format!("v{i}").as_bytes());
    }
    let ps = c.path_stats().controller;
    println!("after replacing the RPC connections: {ps:?}, {:?}", c.read_stats());
    assert_eq!(ps.one_sided.failures, 0, "the RDMA path broke with the pooled connection");
    assert_eq!(c.stats().await.unwrap()["gets"], gets, "GETs left the RDMA path");
    assert_eq!(c.one_sided_transport(), Some(Transport::Rdma));
}

/// More callers than lanes on one RDMA path: reads wait for a free lane
/// (queue pair) and every GET is still answered one-sided and right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_rdma_gets_share_lanes() {
    if !device_or_skip("concurrent_rdma_gets_share_lanes") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let c = Client::connect_with(&srv.rpc, rdma_cfg()).await.unwrap();
    for i in 0..100 {
        c.put(format!("k{i}"), vec![i as u8; 1000]).await.unwrap();
    }
    let gets = c.stats().await.unwrap()["gets"];
    let mut tasks = Vec::new();
    for t in 0..8usize {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..50usize {
                let i = (t * 13 + n * 7) % 100;
                assert_eq!(c.get(format!("k{i}")).await.unwrap().unwrap(), vec![i as u8; 1000]);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let rs = c.read_stats();
    println!("8 callers x 50 GETs over RDMA: {rs:?}");
    assert!(rs.gets >= 400 && rs.fallbacks == 0, "{rs:?}");
    assert_eq!(c.stats().await.unwrap()["gets"], gets, "GETs left the RDMA path");
}

#[tokio::test]
async fn rdma_needs_authentication_and_follows_rotated_rkeys() {
    if !device_or_skip("rdma_needs_authentication_and_follows_rotated_rkeys") {
        return;
    }
    let auth = std::env::temp_dir().join(format!("dmkv-rdma-auth-{}", std::process::id()));
    std::fs::write(&auth, "data data-token-0123456789abcdef\n").unwrap();
    let srv =
        ServerProcess::start(&["--memory", "16MiB", "--auth-file", auth.to_str().unwrap(), "--rkey-rotate-secs", "1"]);
    let token = Some(std::sync::Arc::new(dmkv_client::Token::new("data-token-0123456789abcdef").unwrap()));
    // No token: not even the RPC connection that would set up queue pairs.
    let err = Client::connect_with(&srv.rpc, rdma_cfg()).await.err().expect("RDMA without a token");
    assert_eq!(err.code(), Some(dmkv_client::ErrorCode::Unauthenticated), "{err}");
    let rpc = Client::connect_with(
        &srv.rpc,
        ClientConfig::default().read_path(ReadPath::Rpc).pool_size(1).token(token.clone()),
    )
    .await
    .unwrap();
    rpc.put("k", "v").await.unwrap();
    let c = Client::connect_with(&srv.rpc, rdma_cfg().token(token)).await.unwrap();
    let epoch = rpc.stats().await.unwrap()["region_epoch"];
    let gets = rpc.stats().await.unwrap()["gets"];
    // Across rotations (one a second) every GET is right and one-sided.
    let end = Instant::now() + Duration::from_secs(4);
    while Instant::now() < end {
        assert_eq!(c.get("k").await.unwrap().unwrap(), "v".as_bytes());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = rpc.stats().await.unwrap();
    assert!(stats["region_epoch"] >= epoch + 2, "rkeys were not rotated");
    assert_eq!(stats["gets"], gets, "GETs left RDMA during rotations: {:?}", c.read_stats());
    let _ = std::fs::remove_file(auth);
}
