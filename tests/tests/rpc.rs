//! End-to-end tests of the RPC path against real dmkvd processes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use dmkv_client::{Client, ClientConfig, ClientError, ErrorCode};
use dmkv_common::frame;
use dmkv_common::limits::{MAX_KEY_LEN, MAX_MULTI_GET_KEYS, MAX_VALUE_LEN};
use dmkv_common::proto::{self, Request, Response, request::Op, response::Result as R};
use dmkv_tests::{ServerProcess, bin_path};
use prost::Message;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn raw_conn(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s
}

fn send_raw(s: &mut TcpStream, req: &Request) {
    let mut buf = BytesMut::new();
    frame::encode(req, usize::MAX >> 1, &mut buf).unwrap();
    s.write_all(&buf).unwrap();
}

fn read_raw(s: &mut TcpStream) -> Option<Response> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(Response::decode(&body[..]).expect("server sends valid replies"))
}

/// Whether the server closed `s` (EOF or reset) rather than answering.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

fn error_code(r: &Response) -> Option<ErrorCode> {
    match &r.result {
        Some(R::Error(e)) => ErrorCode::try_from(e.code).ok(),
        _ => None,
    }
}

async fn still_serves(addr: &str) {
    let c = Client::connect(addr).await.unwrap();
    c.put("alive", "yes").await.unwrap();
    assert_eq!(c.get("alive").await.unwrap().as_deref(), Some(&b"yes"[..]));
}

#[tokio::test]
async fn put_get_delete_multi_get() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let c = Client::connect(&srv.rpc).await.unwrap();
    assert_eq!(c.get("missing").await.unwrap(), None);
    let v1 = c.put("a", "1").await.unwrap();
    let v2 = c.put("b", "22").await.unwrap();
    assert!(v2 > v1);
    assert_eq!(c.get("a").await.unwrap().as_deref(), Some(&b"1"[..]));
    let got = c.get_versioned("b").await.unwrap().unwrap();
    assert_eq!((got.value.as_ref(), got.version), (&b"22"[..], v2));
    assert_eq!(
        c.multi_get(&["a", "zz", "b"]).await.unwrap(),
        vec![Some(Bytes::from("1")), None, Some(Bytes::from("22"))]
    );
    assert!(c.delete("a").await.unwrap());
    assert!(!c.delete("a").await.unwrap());
    assert_eq!(c.get("a").await.unwrap(), None);
    // A multi-get larger than one request's key limit is split by the SDK.
    let keys: Vec<String> = (0..3000).map(|i| format!("mk{i}")).collect();
    for k in keys.iter().step_by(3) {
        c.put(k, k).await.unwrap();
    }
    let vals = c.multi_get(&keys).await.unwrap();
    for (i, (k, v)) in keys.iter().zip(&vals).enumerate() {
        assert_eq!(v.as_deref(), (i % 3 == 0).then_some(k.as_bytes()), "{k}");
    }
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["items"], 1001);
    assert!(stats["puts"] >= 1002);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let mut tasks = Vec::new();
    for t in 0..16 {
        let addr = srv.rpc.clone();
        tasks.push(tokio::spawn(async move {
            let c = Client::connect_with(addr, ClientConfig::default().pool_size(1)).await.unwrap();
            for i in 0..200 {
                let k = format!("c{t}-{i}");
                c.put(&k, format!("{t}:{i}:{}", "x".repeat(i))).await.unwrap();
            }
            for i in 0..200 {
                let k = format!("c{t}-{i}");
                assert_eq!(c.get(&k).await.unwrap().unwrap(), format!("{t}:{i}:{}", "x".repeat(i)).as_bytes());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn pipelined_requests_on_one_connection() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let c = Client::connect_with(&srv.rpc, ClientConfig::default().pool_size(1)).await.unwrap();
    let mut inflight = Vec::new();
    for i in 0..64u32 {
        let op = Op::Put(proto::Put { key: format!("p{i}").into(), value: i.to_string().into(), ..Default::default() });
        inflight.push(c.send(op).await.unwrap());
    }
    for f in inflight {
        assert!(matches!(f.wait(IO_TIMEOUT).await.unwrap().result, Some(R::Put(_))));
    }
    let mut gets = Vec::new();
    for i in 0..64u32 {
        gets.push((i, c.send(Op::Get(proto::Get { key: format!("p{i}").into() })).await.unwrap()));
    }
    for (i, f) in gets.into_iter().rev() {
        match f.wait(IO_TIMEOUT).await.unwrap().result {
            Some(R::Get(g)) => assert_eq!(g.value, i.to_string().as_bytes()),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn overwrites_with_changing_sizes_and_maximum_sizes() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let c = Client::connect(&srv.rpc).await.unwrap();
    let sizes = [0usize, 1, 63, 64, 100, 4000, 70_000, MAX_VALUE_LEN, 10, MAX_VALUE_LEN - 1, 0, 333];
    for round in 0..3 {
        for (i, &n) in sizes.iter().enumerate() {
            let v: Vec<u8> = (0..n).map(|j| (j + i + round) as u8).collect();
            c.put("k", &v).await.unwrap();
            assert_eq!(c.get("k").await.unwrap().unwrap(), v, "size {n}");
        }
    }
    let big_key = vec![b'k'; MAX_KEY_LEN];
    c.put(&big_key, vec![7u8; MAX_VALUE_LEN]).await.unwrap();
    assert_eq!(c.get(&big_key).await.unwrap().unwrap().len(), MAX_VALUE_LEN);
    // Too large: refused by the SDK before sending.
    assert!(matches!(c.put(vec![b'k'; MAX_KEY_LEN + 1], "v").await, Err(ClientError::Invalid(_))));
    assert!(matches!(c.put("k", vec![0u8; MAX_VALUE_LEN + 1]).await, Err(ClientError::Invalid(_))));
    assert!(matches!(c.put("", "v").await, Err(ClientError::Invalid(_))));
    // ... and by the server, for clients that skip the checks.
    let mut s = raw_conn(&srv.rpc);
    let put = |id, key: Vec<u8>, value: Vec<u8>| Request {
        id,
        op: Some(Op::Put(proto::Put { key: key.into(), value: value.into(), ..Default::default() })),
    };
    send_raw(&mut s, &put(1, vec![b'k'; MAX_KEY_LEN + 1], vec![]));
    send_raw(&mut s, &put(2, b"k".to_vec(), vec![0; MAX_VALUE_LEN + 1]));
    send_raw(&mut s, &put(3, vec![], b"v".to_vec()));
    let mut codes: Vec<_> = (0..3).map(|_| read_raw(&mut s).unwrap()).map(|r| (r.id, error_code(&r))).collect();
    codes.sort_by_key(|c| c.0);
    assert_eq!(
        codes,
        vec![(1, Some(ErrorCode::KeyTooLarge)), (2, Some(ErrorCode::ValueTooLarge)), (3, Some(ErrorCode::BadRequest))]
    );
    assert_eq!(c.get("k").await.unwrap().unwrap().len(), 333, "failed puts changed nothing");
}

#[tokio::test]
async fn full_store_keeps_every_acknowledged_value() {
    let srv = ServerProcess::start(&["--memory", "8MiB", "--grace-ms", "20"]);
    let c = Client::connect(&srv.rpc).await.unwrap();
    let value = |i: u32| format!("{i:08}").repeat(1000 / 8 + i as usize % 50).into_bytes();
    let mut acked = Vec::new();
    let mut errors = 0;
    for i in 0..20_000u32 {
        match c.put(format!("key{i}"), value(i)).await {
            Ok(_) => acked.push(i),
            Err(e) => {
                assert!(matches!(e.code(), Some(ErrorCode::OutOfMemory | ErrorCode::IndexFull)), "{e}");
                errors += 1;
                if errors > 50 {
                    break;
                }
            }
        }
    }
    assert!(errors > 50, "the store never filled up");
    assert!(acked.len() > 1000);
    // Overwrites that do not fit fail and leave the old value in place.
    for i in acked.iter().take(20) {
        let r = c.put(format!("key{i}"), vec![1u8; 500_000]).await;
        if r.is_err() {
            assert_eq!(c.get(format!("key{i}")).await.unwrap().unwrap(), value(*i));
        }
    }
    for i in &acked {
        let got = c.get(format!("key{i}")).await.unwrap().unwrap_or_else(|| panic!("acknowledged key{i} lost"));
        if got.len() != 500_000 {
            assert_eq!(got, value(*i), "key{i}");
        }
    }
    let stats = c.stats().await.unwrap();
    assert!(stats["out_of_memory_errors"] + stats["index_full_errors"] > 0);
    assert_eq!(stats["corrupt_reads"], 0);
}

#[tokio::test]
async fn bad_input_closes_only_that_connection() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let good = Client::connect_with(&srv.rpc, ClientConfig::default().pool_size(1)).await.unwrap();
    good.put("before", "1").await.unwrap();

    // Garbage: a length prefix followed by bytes that are not a message.
    let mut s = raw_conn(&srv.rpc);
    s.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff]).unwrap();
    assert!(closed_by_server(&mut s));

    // A frame larger than the maximum is refused on its prefix alone.
    let mut s = raw_conn(&srv.rpc);
    let mut b = BytesMut::new();
    b.put_u32_le(u32::MAX);
    s.write_all(&b).unwrap();
    assert!(closed_by_server(&mut s));

    // A truncated frame, then the client goes away.
    let mut s = raw_conn(&srv.rpc);
    s.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
    drop(s);

    // An unknown message type gets an error reply; the connection lives on.
    let mut s = raw_conn(&srv.rpc);
    let mut unknown = BytesMut::new();
    prost::encoding::uint64::encode(1, &42u64, &mut unknown);
    prost::encoding::bytes::encode(99, &Bytes::from_static(b"from the future"), &mut unknown);
    let mut b = BytesMut::new();
    b.put_u32_le(unknown.len() as u32);
    b.extend_from_slice(&unknown);
    s.write_all(&b).unwrap();
    let r = read_raw(&mut s).unwrap();
    assert_eq!((r.id, error_code(&r)), (42, Some(ErrorCode::UnknownOp)));
    send_raw(&mut s, &Request { id: 43, op: Some(Op::Get(proto::Get { key: "before".into() })) });
    let r = read_raw(&mut s).unwrap();
    assert!(matches!(r.result, Some(R::Get(g)) if g.value == "1"));

    // An unknown protocol version is refused clearly.
    send_raw(
        &mut s,
        &Request { id: 44, op: Some(Op::Hello(proto::Hello { protocol_version: 999, client_name: "x".into() })) },
    );
    assert_eq!(error_code(&read_raw(&mut s).unwrap()), Some(ErrorCode::UnsupportedVersion));

    // The long-lived client and new clients never noticed.
    assert_eq!(good.get("before").await.unwrap().as_deref(), Some(&b"1"[..]));
    still_serves(&srv.rpc).await;
}

#[tokio::test]
async fn graceful_shutdown_answers_in_flight_requests() {
    // The signal may land before the server has read any of the requests
    // (it did on a loaded CI machine), and then each rightly fails with a
    // closed connection; so a few rounds, of which one must see answers.
    const ROUNDS: usize = 5;
    for round in 0..ROUNDS {
        let answered = shutdown_round().await;
        eprintln!("round {round}: {answered} of 200 answered before the shutdown closed the connection");
        if answered > 0 {
            return;
        }
    }
    panic!("no in-flight request was answered in {ROUNDS} rounds");
}

/// Sends 200 pipelined PUTs, stops the server, and counts the answers.
async fn shutdown_round() -> usize {
    let mut srv = ServerProcess::start(&["--memory", "16MiB"]);
    let c = Client::connect_with(&srv.rpc, ClientConfig::default().pool_size(1)).await.unwrap();
    let mut inflight = Vec::new();
    for i in 0..200u32 {
        inflight.push(
            c.send(Op::Put(proto::Put { key: format!("s{i}").into(), value: "v".into(), ..Default::default() }))
                .await
                .unwrap(),
        );
    }
    let status = tokio::task::spawn_blocking(move || srv.stop()).await.unwrap().expect("server exited");
    assert!(status.success(), "{status:?}");
    // Each request was either answered or (if the server had not read it
    // yet) failed with a closed connection: never a wrong or partial reply.
    let mut answered = 0;
    for f in inflight {
        match f.wait(IO_TIMEOUT).await {
            Ok(r) => {
                assert!(matches!(r.result, Some(R::Put(_))));
                answered += 1;
            }
            Err(e) => assert!(matches!(e, ClientError::ConnectionClosed), "{e}"),
        }
    }
    answered
}

#[test]
fn cli_put_get_del_stats_and_exit_codes() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let dmkv = |args: &[&str], stdin: Option<&str>| {
        let mut cmd = Command::new(bin_path("dmkv"));
        cmd.args(["--server", &srv.rpc]).args(args);
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut sin = child.stdin.take().unwrap();
        if let Some(s) = stdin {
            sin.write_all(s.as_bytes()).unwrap();
        }
        drop(sin);
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_eq!(dmkv(&["put", "k", "v"], None).0, Some(0));
    assert_eq!(dmkv(&["get", "k"], None), (Some(0), "v\n".into(), String::new()));
    assert_eq!(dmkv(&["get", "--raw", "k"], None).1, "v");
    assert_eq!(dmkv(&["put", "k2"], Some("from stdin")).0, Some(0));
    assert_eq!(dmkv(&["get", "--raw", "k2"], None).1, "from stdin");
    let (code, _, err) = dmkv(&["get", "nope"], None);
    assert_eq!(code, Some(1));
    assert!(err.contains("not found"));
    assert_eq!(dmkv(&["del", "k"], None).0, Some(0));
    assert_eq!(dmkv(&["del", "k"], None).0, Some(1));
    let (code, out, _) = dmkv(&["stats"], None);
    assert_eq!(code, Some(0));
    assert!(out.lines().any(|l| l.starts_with("items ")), "{out}");
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    let (code, _, err) = dmkv(&["put", &long_key, "v"], None);
    assert_eq!(code, Some(2));
    assert_eq!(err.lines().count(), 1, "{err}");
    // A server that is not there: exit 2 with one line.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let out = Command::new(bin_path("dmkv")).args(["--server", &closed, "get", "k"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
}

/// A crude fuzzer: random byte streams (and random streams behind a valid
/// length prefix) on the RPC and engine ports never take the server down.
#[tokio::test]
async fn random_garbage_never_breaks_the_server() {
    use rand::{Rng, SeedableRng, rngs::SmallRng};
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let seed: u64 = rand::random();
    println!("garbage seed {seed}");
    let mut rng = SmallRng::seed_from_u64(seed);
    let engine = srv.endpoint("engine").expect("engine address").to_string();
    for i in 0..200 {
        let addr = if i % 2 == 0 { &srv.rpc } else { &engine };
        let mut s = raw_conn(addr);
        let len = rng.random_range(4..2000);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if i % 4 < 2 {
            let body = (len as u32).saturating_sub(4);
            bytes[..4].copy_from_slice(&body.to_le_bytes());
        }
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    still_serves(&srv.rpc).await;
}

/// Hundreds of small pipelined GETs of a 1 MiB value: the server writes
/// replies as they pile up instead of holding them all, and answers each.
#[tokio::test]
async fn pipelined_gets_of_large_values_are_all_answered() {
    let srv = ServerProcess::start(&["--memory", "32MiB"]);
    let c = Client::connect_with(&srv.rpc, ClientConfig::default().pool_size(1)).await.unwrap();
    c.put("big", vec![3u8; MAX_VALUE_LEN]).await.unwrap();
    let mut inflight = Vec::new();
    for _ in 0..200 {
        inflight.push(c.send(Op::Get(proto::Get { key: "big".into() })).await.unwrap());
    }
    for f in inflight {
        match f.wait(Duration::from_secs(60)).await.unwrap().result {
            Some(R::Get(g)) => assert!(g.value.len() == MAX_VALUE_LEN && g.value.iter().all(|&b| b == 3)),
            other => panic!("{other:?}"),
        }
    }
}

/// Peak resident memory of process `pid`, in bytes (Linux).
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// A multi-get of the same 1 MiB value under every one of its 1024 keys
/// asks for a gigabyte of reply: the server refuses it once the values pass
/// the frame limit, without first gathering them all (which it did).
#[tokio::test]
async fn multi_get_past_the_frame_limit_is_refused_before_gathering_its_values() {
    let srv = ServerProcess::start(&["--memory", "32MiB"]);
    let c = Client::connect(&srv.rpc).await.unwrap();
    c.put("big", vec![5u8; MAX_VALUE_LEN]).await.unwrap();
    let keys = vec![Bytes::from_static(b"big"); MAX_MULTI_GET_KEYS];
    let reply = c.send(Op::MultiGet(proto::MultiGet { keys })).await.unwrap();
    let reply = reply.wait(Duration::from_secs(60)).await.unwrap();
    assert_eq!(error_code(&reply), Some(ErrorCode::ResponseTooLarge));
    let peak = peak_rss(srv.pid());
    assert!(peak < 512 << 20, "dmkvd's peak RSS reached {} MiB", peak >> 20);
    // The client still gets every value, fetched one by one.
    let got = c.multi_get(&["big", "big", "none"]).await.unwrap();
    assert_eq!(got[0].as_deref().map(<[u8]>::len), Some(MAX_VALUE_LEN));
    assert_eq!(got[2], None);
}

/// A server that answers the first connection's HELLO, then hangs up, and
/// from then on accepts connections without ever answering: a stalled peer.
/// Returns its address and a counter of accepted connections.
async fn stalling_server() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&accepted);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = listener.accept().await {
            if count.fetch_add(1, Ordering::SeqCst) == 0 {
                let mut len = [0u8; 4];
                s.read_exact(&mut len).await.unwrap();
                let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
                s.read_exact(&mut body).await.unwrap();
                let id = Request::decode(&body[..]).unwrap().id;
                let hello = proto::HelloReply {
                    protocol_version: dmkv_common::PROTOCOL_VERSION,
                    server_version: "x".into(),
                    ..Default::default()
                };
                let mut out = BytesMut::new();
                frame::encode(&Response { id, result: Some(R::Hello(hello)) }, 1 << 20, &mut out).unwrap();
                s.write_all(&out).await.unwrap();
                // Hang up: the client's pooled connection is gone.
            } else {
                held.push(s);
            }
        }
    });
    (addr, accepted)
}

/// Many requests waiting for one pool slot whose server stalls: one
/// connects (single-flight), the others get its failure instead of each
/// trying again in turn, and every one ends within its own deadline (the
/// k-th waiter used to wait k connect timeouts).
#[tokio::test]
async fn concurrent_requests_share_one_connect_and_keep_their_deadline() {
    use std::sync::atomic::Ordering;
    let (addr, accepted) = stalling_server().await;
    let timeout = Duration::from_millis(400);
    let cfg = ClientConfig::default()
        .pool_size(1)
        .read_path(dmkv_client::ReadPath::Rpc)
        .request_timeout(timeout)
        .connect_timeout(timeout);
    let c = Client::connect_with(&addr, cfg).await.unwrap();
    // Let the client's reader see the hang-up.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let r = c.get(format!("k{i}")).await;
            (r, t0.elapsed())
        }));
    }
    let mut slowest = Duration::ZERO;
    for t in tasks {
        let (r, took) = t.await.unwrap();
        assert!(r.as_ref().is_err_and(ClientError::is_transport), "{r:?}");
        slowest = slowest.max(took);
    }
    let connects = accepted.load(Ordering::SeqCst) - 1;
    println!("8 requests on a stalled slot: {connects} connects, slowest {slowest:?}, all in {:?}", started.elapsed());
    assert_eq!(connects, 1, "connects must be single-flight with backoff");
    // A deadline, not a benchmark: the old behaviour took 8 x 400 ms.
    assert!(slowest < 3 * timeout, "a request waited {slowest:?}, past its {timeout:?} deadline");
}

/// The frame limit is learned in HELLO: a server run with a larger
/// `--max-frame` sends a multi-get reply larger than the default limit,
/// and a client left at its defaults takes it (it had to be configured to
/// match the server, or its connection failed on the reply).
#[tokio::test]
async fn the_frame_limit_is_learned_from_the_server() {
    let srv = ServerProcess::start(&["--memory", "64MiB", "--max-frame", "8MiB"]);
    let c =
        Client::connect_with(&srv.rpc, ClientConfig::default().read_path(dmkv_client::ReadPath::Rpc)).await.unwrap();
    let keys: Vec<String> = (0..4).map(|i| format!("big-{i}")).collect();
    let value = |i: usize| vec![b'a' + i as u8; MAX_VALUE_LEN];
    for (i, k) in keys.iter().enumerate() {
        c.put(k, value(i)).await.unwrap();
    }
    // About 4 MiB in one reply: more than the default 2 MiB, within the server's 8.
    let got = c.rpc_multi_get(&keys).await.expect("a reply within the server's limit");
    for (i, v) in got.iter().enumerate() {
        assert_eq!(v.as_deref(), Some(&value(i)[..]), "{}", keys[i]);
    }
}

/// A client given several seed addresses connects while any one answers,
/// and says what each failed seed did when none does.
#[tokio::test]
async fn connect_seeds_takes_the_first_seed_that_answers() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    // Nothing listens on port 1.
    let dead = "127.0.0.1:1";
    let c = Client::connect_seeds(&[dead, srv.rpc.as_str()], ClientConfig::default()).await.expect("the live seed");
    c.put("seeded", "yes").await.unwrap();
    assert_eq!(c.get("seeded").await.unwrap().as_deref(), Some(&b"yes"[..]));
    let err =
        Client::connect_seeds(&[dead, "127.0.0.1:2"], ClientConfig::default()).await.err().expect("no seed answers");
    let msg = err.to_string();
    assert!(msg.contains("127.0.0.1:1") && msg.contains("127.0.0.1:2"), "{msg}");
    let none: [&str; 0] = [];
    assert!(matches!(Client::connect_seeds(&none, ClientConfig::default()).await, Err(ClientError::Config(_))));
}

/// A blocking client made outside a runtime and then used and dropped
/// inside one (an application's async code holding it): the calls fail
/// with InsideRuntime, nothing was sent, and the drop does not panic
/// (dropping its runtime there was tokio's panic).
#[test]
fn a_blocking_client_used_and_dropped_inside_a_runtime_does_not_panic() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let c = dmkv_client::blocking::Client::connect(&srv.rpc).unwrap();
    c.put("b", "1").unwrap();
    let outer = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    outer.block_on(async move {
        let err = c.put("b", "2").expect_err("refused inside the runtime");
        assert!(matches!(err, ClientError::InsideRuntime) && !err.may_have_been_sent(), "{err}");
        drop(c);
    });
    let c = dmkv_client::blocking::Client::connect(&srv.rpc).unwrap();
    assert_eq!(c.get("b").unwrap().as_deref(), Some(&b"1"[..]), "the refused PUT was not sent");
}

/// Typed pipelining: many requests in flight on one node, each reply
/// parsed into what the matching call returns; a cluster refuses it (its
/// writes need the router's retries).
#[tokio::test]
async fn typed_pipelining_returns_what_the_calls_would() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let c = Client::connect_with(&srv.rpc, ClientConfig::default().pool_size(1)).await.unwrap();
    let mut puts = Vec::new();
    for i in 0..64 {
        puts.push(c.send_put(format!("tp{i}"), format!("v{i}")).await.unwrap());
    }
    let mut versions = Vec::new();
    for p in puts {
        versions.push(p.wait().await.unwrap());
    }
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "versions not increasing in send order: {versions:?}");
    let gets: Vec<_> = futures_join(&c, 64).await;
    for (i, v) in gets.into_iter().enumerate() {
        let v = v.expect("found");
        assert_eq!(v.value, format!("v{i}").as_bytes());
        assert_eq!(v.version, versions[i]);
    }
    assert_eq!(c.send_get("missing").await.unwrap().wait().await.unwrap(), None);
    assert!(c.send_delete("tp0").await.unwrap().wait().await.unwrap());
    assert!(!c.send_delete("tp0").await.unwrap().wait().await.unwrap());
    assert!(matches!(c.send_get("").await, Err(ClientError::Invalid(_))), "an empty key was sent");
}

async fn futures_join(c: &Client, n: usize) -> Vec<Option<dmkv_client::Versioned>> {
    let mut sent = Vec::new();
    for i in 0..n {
        sent.push(c.send_get(format!("tp{i}")).await.unwrap());
    }
    let mut out = Vec::new();
    for p in sent {
        out.push(p.wait().await.unwrap());
    }
    out
}

/// Where no verbs RPC can open (this build, or a node without an RDMA
/// device): a VERBS_RPC is answered with a clear refusal and the
/// connection serves on, a client that insists on verbs fails to connect
/// saying why, and one on `Auto` (the default) stays on TCP.
#[tokio::test]
async fn without_a_device_verbs_rpc_is_refused_and_auto_stays_on_tcp() {
    let srv = ServerProcess::start(&["--memory", "16MiB", "--no-rdma"]);
    let mut s = raw_conn(&srv.rpc);
    let op = Op::VerbsRpc(proto::VerbsRpc { endpoint: vec![0u8; 30].into(), credits: 8 });
    send_raw(&mut s, &Request { id: 7, op: Some(op) });
    let reply = read_raw(&mut s).expect("an answer");
    match reply.result {
        Some(R::Error(e)) => {
            assert_eq!(e.code, ErrorCode::BadRequest as i32, "{e:?}");
            assert!(e.message.contains("verbs RPC") || e.message.contains("RDMA"), "{e:?}");
        }
        other => panic!("VERBS_RPC without a device answered {other:?}"),
    }
    let verbs = ClientConfig::default().rpc_transport(dmkv_client::RpcTransport::Verbs);
    match Client::connect_with(&srv.rpc, verbs).await {
        Err(ClientError::TransportUnavailable { reason, .. }) => println!("verbs refused: {reason}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a verbs RPC client connected without a device"),
    }
    let auto = Client::connect(&srv.rpc).await.expect("Auto connects over TCP");
    auto.put("k", "v").await.unwrap();
    assert_eq!(auto.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
    let [tcp, verbs] = auto.rpc_price().taken();
    assert_eq!(verbs, 0, "no request can have gone over verbs (tcp {tcp})");
    still_serves(&srv.rpc).await;
}
