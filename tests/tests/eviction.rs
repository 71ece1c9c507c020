//! Eviction on a real dmkvd (`--evict lru`): a stream of distinct keys ten
//! times the memory, through the SDK and the memcached port, never fails a
//! write; the store stays bounded and counts evictions; a small hot set
//! read all the while survives: when read over RPC (the server sees the
//! reads) and when read only one-sidedly, which the server cannot see, so
//! only the clients' access reports keep the hot set young. With the
//! default `--evict none` the same stream runs out of memory instead, and
//! every acknowledged write stays.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use dmkv_client::{Client, ClientConfig, ErrorCode, ReadPath, Transport};
use dmkv_tests::ServerProcess;

const MEMORY: &str = "8MiB";
const MEMORY_BYTES: usize = 8 << 20;
const VALUE_LEN: usize = 4096;
/// Distinct keys to write: ten times the memory.
const STREAM: usize = 10 * MEMORY_BYTES / VALUE_LEN;
const HOT: usize = 20;

fn value(i: usize) -> Vec<u8> {
    let mut v = format!("value-{i}-").into_bytes();
    v.resize(VALUE_LEN, b'x');
    v
}

/// A memcached text connection that stores values and reads the reply.
struct Text(BufReader<TcpStream>);

impl Text {
    fn connect(srv: &ServerProcess) -> Text {
        let addr = srv.endpoint("memcached").expect("memcached= in the listening line");
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.set_nodelay(true).unwrap();
        Text(BufReader::new(s))
    }

    /// `set`: the reply line.
    fn set(&mut self, key: &str, v: &[u8]) -> String {
        // One write per command: split writes meet Nagle and delayed ACKs
        // (40 ms a command).
        let mut req = format!("set {key} 0 0 {}\r\n", v.len()).into_bytes();
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
        self.0.get_mut().write_all(&req).unwrap();
        let mut l = String::new();
        self.0.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    }
}

/// Writes the stream (even keys through the SDK, odd ones through the
/// memcached port), reading one key of `hot` through `reader` after each
/// write; panics at the first failed write. Returns how many hot keys are
/// still stored at the end.
async fn stream_with_hot_set(srv: &ServerProcess, tag: &str, reader: &Client) -> usize {
    let writer = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();
    let hot: Vec<String> = (0..HOT).map(|i| format!("{tag}-hot-{i}")).collect();
    for (i, k) in hot.iter().enumerate() {
        writer.put(k, value(i)).await.unwrap();
    }
    let mut text = Text::connect(srv);
    let mut hot_misses = 0;
    for i in 0..STREAM {
        let key = format!("{tag}-cold-{i}");
        if i % 2 == 0 {
            writer.put(&key, value(i)).await.unwrap_or_else(|e| panic!("{tag}: SDK put {i}: {e}"));
        } else {
            let r = text.set(&key, &value(i));
            assert_eq!(r, "STORED", "{tag}: memcached set {i}");
        }
        if reader.get(&hot[i % HOT]).await.unwrap().is_none() {
            hot_misses += 1;
        }
    }
    // Counted over RPC: reading now changes nothing that matters.
    let got = writer.multi_get(&hot).await.unwrap();
    let survived = got.iter().filter(|v| v.is_some()).count();
    println!("{tag}: {survived} of {HOT} hot keys survived ({hot_misses} hot reads missed along the way)");
    survived
}

async fn check_bounded(c: &Client, tag: &str) -> u64 {
    let stats = c.stats().await.unwrap();
    let (evictions, items) = (stats["evictions"], stats["items"]);
    println!("{tag}: evictions {evictions}, items {items}");
    assert!(evictions > 0, "{tag}: no evictions after writing ten times the memory");
    assert!((items as usize) * VALUE_LEN <= MEMORY_BYTES, "{tag}: {items} items of {VALUE_LEN} bytes in {MEMORY}");
    evictions
}

#[tokio::test]
async fn lru_evicts_the_cold_and_keeps_a_hot_set_read_over_rpc_or_one_sided() {
    let srv = ServerProcess::start(&["--memory", MEMORY, "--evict", "lru", "--memcached-listen", "127.0.0.1:0"]);
    let rpc = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();
    let survived = stream_with_hot_set(&srv, "rpc", &rpc).await;
    let before = check_bounded(&rpc, "rpc").await;
    assert!(survived * 10 >= HOT * 9, "rpc: only {survived} of {HOT} hot keys survived");

    // Now the hot set is read only one-sidedly: the server sees none of
    // those reads but through the client's access reports.
    let cfg = ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Shm)).pool_size(1);
    let one = Client::connect_with(&srv.rpc, cfg).await.unwrap();
    let server_gets = rpc.stats().await.unwrap()["gets"];
    let survived = stream_with_hot_set(&srv, "one-sided", &one).await;
    let rs = one.read_stats();
    assert_eq!(rs.rpc_gets, 0, "the hot set was read one-sided only: {rs:?}");
    assert!(rs.gets >= STREAM as u64, "{rs:?}");
    // The writer's final multi-get of the hot set is the only GET work the
    // server did.
    let ran = rpc.stats().await.unwrap()["gets"] - server_gets;
    assert!(ran <= HOT as u64, "the server ran {ran} GETs during the one-sided phase");
    assert!(check_bounded(&rpc, "one-sided").await > before);
    assert!(survived * 10 >= HOT * 9, "one-sided: only {survived} of {HOT} hot keys survived");
}

#[tokio::test]
async fn without_eviction_a_full_store_refuses_writes_and_keeps_what_it_acknowledged() {
    let srv = ServerProcess::start(&["--memory", MEMORY, "--memcached-listen", "127.0.0.1:0"]);
    let c = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();
    let mut stored = Vec::new();
    let mut sdk_refused = None;
    for i in 0..STREAM {
        let key = format!("k-{i}");
        match c.put(&key, value(i)).await {
            Ok(_) => stored.push(key),
            Err(e) => {
                assert_eq!(e.code(), Some(ErrorCode::OutOfMemory), "put {i}: {e}");
                sdk_refused = Some(i);
                break;
            }
        }
    }
    let refused = sdk_refused.expect("ten times the memory stored without --evict");
    assert!(refused * VALUE_LEN >= MEMORY_BYTES / 4, "refused after only {refused} writes");
    // The memcached port refuses as memcached does.
    let mut text = Text::connect(&srv);
    assert_eq!(text.set("mc-more", &value(0)), "SERVER_ERROR out of memory storing object");
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["evictions"], 0);
    // Every acknowledged write is still there.
    for chunk in stored.chunks(100) {
        let got = c.multi_get(chunk).await.unwrap();
        for (k, v) in chunk.iter().zip(got) {
            let i: usize = k[2..].parse().unwrap();
            assert_eq!(v.as_deref(), Some(&value(i)[..]), "{k} was acknowledged, then lost");
        }
    }
    println!("out of memory after {refused} writes; all {} kept", stored.len());
}
