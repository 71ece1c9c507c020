//! End-to-end tests of the RDMA backend against a real verbs device (Linux
//! Soft-RoCE in the test VM: tests/rdma-vm/run-tests.sh). Built only with
//! the `rdma` feature. Without a device they are skipped, unless
//! DMKV_RDMA_TESTS=1 (as in the VM), where a missing device fails them.
#![cfg(feature = "rdma")]

use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ReadPath, RpcTransport, Transport};
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

/// The emulated VM moves a few MB/s over Soft-RoCE (the ICRC of every
/// packet is computed by emulated instructions): timeouts sized for it.
fn verbs_rpc() -> ClientConfig {
    ClientConfig::default()
        .read_path(ReadPath::Rpc)
        .rpc_transport(RpcTransport::Verbs)
        .pool_size(1)
        .request_timeout(Duration::from_secs(30))
}

/// PUTs, GETs, DELETEs and multi-gets as verbs messages, values from a few
/// bytes to several slots (a frame spans messages), from 16 clients at
/// once with 16 requests in flight each: every answer right, and counted on
/// both sides (the client's verbs messages, the server's verbs bytes), so
/// a silent fallback to TCP fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_rpc_serves_every_request_from_many_clients_at_once() {
    if !device_or_skip("verbs_rpc_serves_every_request_from_many_clients_at_once") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "128MiB"]);
    let tcp = Client::connect_with(&srv.rpc, ClientConfig::default().rpc_transport(RpcTransport::Tcp)).await.unwrap();
    let before = tcp.stats().await.unwrap();
    let (sent_before, links_before) = dmkv_client::verbs_rpc::counts();
    let value = |c: usize, i: usize| {
        let len = [1, 100, 3000, 8100, 8200, 20_000][(c + i) % 6];
        let mut v = format!("{c}/{i}:").into_bytes();
        v.resize(len.max(v.len()), b'a' + (i % 26) as u8);
        v
    };
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..16 {
        let addr = srv.rpc.clone();
        tasks.spawn(async move {
            let client = Client::connect_with(&addr, verbs_rpc()).await.expect("verbs RPC connect");
            let mut rounds = tokio::task::JoinSet::new();
            for i in 0..16 {
                let client = client.clone();
                rounds.spawn(async move {
                    let key = format!("vr-{c}-{i}");
                    client.put(&key, value(c, i)).await.expect("put");
                    assert_eq!(client.get(&key).await.expect("get").as_deref(), Some(&value(c, i)[..]), "{key}");
                });
            }
            while let Some(r) = rounds.join_next().await {
                r.expect("request task");
            }
            let keys: Vec<String> = (0..16).map(|i| format!("vr-{c}-{i}")).collect();
            let got = client.multi_get(&keys).await.expect("multi-get");
            for (i, v) in got.into_iter().enumerate() {
                assert_eq!(v.as_deref(), Some(&value(c, i)[..]), "multi-get vr-{c}-{i}");
            }
            assert!(client.delete(format!("vr-{c}-0")).await.expect("delete"));
            assert_eq!(client.get(format!("vr-{c}-0")).await.expect("get"), None);
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("client task");
    }
    let after = tcp.stats().await.unwrap();
    let (sent, links) = dmkv_client::verbs_rpc::counts();
    println!(
        "verbs RPC: {:.1?}, {} messages, {} links; server received {} bytes over verbs",
        started.elapsed(),
        sent - sent_before,
        links - links_before,
        after["verbs_rpc_bytes_received"] - before["verbs_rpc_bytes_received"]
    );
    assert!(links - links_before >= 16, "not every client opened a verbs link");
    // A link is a byte stream: requests written while others wait for a
    // credit share a message, so the count is bounded below by the bytes
    // (every value in slots of SLOT_BYTES), not by the requests.
    let total: usize = (0..16).flat_map(|c| (0..16).map(move |i| value(c, i).len())).sum();
    assert!(
        sent - sent_before >= (total as u64).div_ceil(u64::from(dmkv_common::msglink::SLOT_BYTES)),
        "fewer verbs messages than the values need"
    );
    assert!(
        after["verbs_rpc_bytes_received"] - before["verbs_rpc_bytes_received"] >= total as u64,
        "the server did not receive the values over verbs"
    );

    // `Auto` prices the two ways per node: both get measured, and all
    // but the probes take one of them.
    let auto = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();
    for i in 0..2000 {
        auto.put(format!("auto-{}", i % 100), "v").await.unwrap();
    }
    let price = auto.rpc_price();
    println!("auto: {price:?}");
    let [tcp, verbs] = price.taken();
    assert!(price.srtt_ns().iter().all(Option::is_some), "a way was never measured: {price:?}");
    assert!(tcp.min(verbs) <= 2000 / 8, "neither way took most requests: {price:?}");
}

/// Credits bound the links a node takes: each asks the default credits, a
/// worker grants them out of its shared receive queue less the slack, and
/// the link past that is refused (BUSY, so a client on `Auto` stays on
/// TCP). Clients that die with requests in flight give their slots back:
/// as many links as before fit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_rpc_links_past_the_receive_queue_are_refused_and_dead_clients_give_slots_back() {
    if !device_or_skip("verbs_rpc_links_past_the_receive_queue_are_refused_and_dead_clients_give_slots_back") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    // Two workers of 1024 slots less 64 of slack, 32 credits a link.
    let fit = 2 * ((1024 - 64) / 32);
    let mut clients = Vec::new();
    for i in 0..fit {
        let c = Client::connect_with(&srv.rpc, verbs_rpc()).await.unwrap_or_else(|e| panic!("link {i}: {e}"));
        c.put(format!("link-{i}"), "x").await.unwrap();
        clients.push(c);
    }
    let refused = Client::connect_with(&srv.rpc, verbs_rpc()).await.err().expect("a link past the credits");
    assert!(refused.to_string().contains("no room"), "{refused}");
    let auto = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();
    auto.put("auto", "on tcp").await.expect("an Auto client stays on TCP when verbs is full");
    // Half the clients die with requests in flight.
    let dying: Vec<Client> = clients.drain(..fit / 2).collect();
    for c in &dying {
        for j in 0..8 {
            let c = c.clone();
            tokio::spawn(async move {
                let _ = c.put(format!("dying-{j}"), vec![1u8; 20_000]).await;
            });
        }
    }
    drop(dying);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut again = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while again.len() < fit / 2 {
        match Client::connect_with(&srv.rpc, verbs_rpc()).await {
            Ok(c) => {
                c.put("again", "y").await.unwrap();
                again.push(c);
            }
            Err(e) if Instant::now() < deadline => {
                // The dead clients' links close with their TCP connections.
                println!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("after {} of {} links: {e}", again.len(), fit / 2),
        }
    }
    for c in clients.iter().chain(&again) {
        c.put("still", "z").await.unwrap();
    }
}

/// A client that sends past its credits: it asks for 2, then sends 10
/// PUTs at once on a raw queue pair. The node closes its link at the first
/// message past the credits, before reading it: no PUT past the second is
/// applied, nothing is served out of order, and the shared receive queue
/// stays whole for everyone else (a verbs client after it is served).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_past_its_credits_loses_its_link_and_nothing_past_them_is_served() {
    use dmkv_common::proto::{Put, Request, VerbsRpc};
    use dmkv_verbs::{MsgCq, MsgOp, MsgQp, RecvInto};
    use std::io::{Read, Write};
    if !device_or_skip("a_client_past_its_credits_loses_its_link_and_nothing_past_them_is_served") {
        return;
    }
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let ctx = Context::open(None).unwrap();
    let cq = MsgCq::create(&ctx, 64).unwrap();
    let slot = dmkv_common::msglink::SLOT_BYTES;
    let (qp, mut tx, rx) = MsgQp::create(&ctx, &cq, RecvInto::Own { count: 16, slot_bytes: slot }, 16, slot).unwrap();
    qp.post_recv(rx).unwrap();
    // The link is asked for on a raw connection (no authentication here).
    let mut control = std::net::TcpStream::connect(&srv.rpc).unwrap();
    let op = Op::VerbsRpc(VerbsRpc { endpoint: qp.endpoint().to_bytes().to_vec().into(), credits: 2 });
    let mut frame = bytes::BytesMut::new();
    dmkv_common::frame::encode(&Request { id: 1, op: Some(op) }, 1 << 20, &mut frame).unwrap();
    control.write_all(&frame).unwrap();
    let mut len = [0u8; 4];
    control.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    control.read_exact(&mut body).unwrap();
    let reply = <dmkv_common::proto::Response as prost::Message>::decode(&body[..]).unwrap();
    let Some(R::VerbsRpc(reply)) = reply.result else { panic!("VERBS_RPC answered {reply:?}") };
    assert_eq!(reply.credits, 2);
    qp.connect(&Endpoint::from_bytes(&reply.endpoint).unwrap()).unwrap();
    for i in 0..10u64 {
        let put = Op::Put(Put {
            key: format!("rogue-{i}").into_bytes().into(),
            value: b"x".to_vec().into(),
            ..Default::default()
        });
        let mut f = bytes::BytesMut::new();
        dmkv_common::frame::encode(&Request { id: 100 + i, op: Some(put) }, 1 << 20, &mut f).unwrap();
        let s = tx.pop().expect("a send slot");
        qp.send_slots().copy_in(&s, &f).unwrap();
        qp.send(s, f.len() as u32, None).map_err(|(e, _)| e).unwrap();
    }
    // Reap until every send finished one way or the other.
    let (mut sent_ok, mut sent_failed, mut replies) = (0, 0, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    while sent_ok + sent_failed < 10 && Instant::now() < deadline {
        done.clear();
        cq.poll(&mut done, 64).unwrap();
        for c in done.drain(..) {
            match (&c.op, &c.status) {
                (MsgOp::Send, Ok(())) => sent_ok += 1,
                (MsgOp::Send, Err(_)) => sent_failed += 1,
                (MsgOp::Recv { len, .. }, Ok(())) if *len > 0 => replies += 1,
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("rogue: {sent_ok} sends acknowledged, {sent_failed} failed, {replies} replies");
    let check = Client::connect_with(
        &srv.rpc,
        ClientConfig::default().read_path(ReadPath::Rpc).rpc_transport(RpcTransport::Tcp),
    )
    .await
    .unwrap();
    let mut applied = Vec::new();
    for i in 0..10 {
        applied.push(check.get(format!("rogue-{i}")).await.unwrap().is_some());
    }
    println!("rogue PUTs applied: {applied:?}");
    // Messages past the credits as the node counts them are never read:
    // what was applied is a prefix of what was sent, and not all of it (a
    // reader fast enough to return credits between two messages of one
    // burst could admit a few more than two, never all ten).
    let n = applied.iter().take_while(|a| **a).count();
    assert!(applied[n..].iter().all(|a| !a), "a PUT after a refused one was applied: {applied:?}");
    assert!(n < 10, "every PUT past the credits was applied: {applied:?}");
    // Everyone else is served, over verbs too.
    let good = Client::connect_with(
        &srv.rpc,
        ClientConfig::default().read_path(ReadPath::Rpc).rpc_transport(RpcTransport::Verbs),
    )
    .await
    .unwrap();
    good.put("after-rogue", "fine").await.unwrap();
    assert_eq!(good.get("after-rogue").await.unwrap().as_deref(), Some(&b"fine"[..]));
    drop(control);
}
