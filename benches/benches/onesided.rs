//! The one-sided reader's hot path: bucket scan and item verification over
//! a real region (copied with the same racy reads the shared-memory backend
//! uses), with and without a cached item address; and whole GETs through
//! the SDK over shm (forced, auto, and the synchronous `get_local`), the
//! TCP engine and RPC, side by side in one run, and multi-gets over shm.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_common::read::{AfterBuckets, Hint, Lookup, Outcome, ReadSpec};
use dmkv_server::region::Region;
use dmkv_server::store::Store;
use dmkv_server::{Config, Server};
use tokio::sync::oneshot;

const KEYS: usize = 100_000;
const VALUE_LEN: usize = 1000;
const MEMORY: usize = 256 << 20;

fn key(i: usize) -> String {
    format!("user{i:012}")
}

/// One GET by the pure protocol over `region`; returns the value length and
/// where the item was found.
fn lookup(store: &Store, region: &Region, key: &[u8], hint: Option<Hint>, bufs: &mut Vec<Vec<u8>>) -> (usize, Hint) {
    let read = |specs: &[ReadSpec], bufs: &mut Vec<Vec<u8>>| {
        bufs.resize_with(specs.len(), Vec::new);
        for (s, b) in specs.iter().zip(bufs.iter_mut()) {
            b.resize(s.len as usize, 0);
            region.read(s.offset, b);
        }
    };
    // The directory entry, as a client that has it cached would: one word.
    let kh = dmkv_common::layout::key_hash(key, store.header().hash_seed);
    let mut entry = [0u8; 8];
    region.read(dmkv_common::read::dir_read(&kh, store.header()).offset, &mut entry);
    let segment = dmkv_common::read::judge_dir_entry(&entry, store.header()).expect("a directory entry");
    let mut look = Lookup::with_hash(kh, store.header(), segment, hint, 0);
    let mut specs = Vec::with_capacity(3);
    look.first_reads(&mut specs);
    read(&specs, bufs);
    let hinted = hint.map(|_| &bufs[2][..]);
    match look.after_buckets(key, [&bufs[0], &bufs[1]], hinted, 1, 0) {
        AfterBuckets::Hit(h) => (h.value.len(), h.hint),
        AfterBuckets::ReadItems => {
            specs.clear();
            look.item_reads(&mut specs);
            read(&specs, bufs);
            let items: Vec<&[u8]> = bufs[..specs.len()].iter().map(|b| &b[..]).collect();
            match look.after_items(key, &items, 2, 0) {
                Outcome::Hit(h) => (h.value.len(), h.hint),
                o => panic!("{o:?}"),
            }
        }
        o => panic!("{o:?}"),
    }
}

fn read_protocol(c: &mut Criterion) {
    let region = Arc::new(Region::create("bench", MEMORY).expect("region"));
    let store =
        Store::format(Arc::clone(&region), (MEMORY as u64 / 1024).next_power_of_two(), 7, 1, Duration::from_secs(1))
            .expect("format");
    for i in 0..KEYS {
        store.put(key(i).as_bytes(), &[b'v'; VALUE_LEN]).expect("put");
    }
    let mut bufs = Vec::new();
    let hints: Vec<Hint> = (0..KEYS).map(|i| lookup(&store, &region, key(i).as_bytes(), None, &mut bufs).1).collect();
    let mut g = c.benchmark_group("read_protocol_1KB");
    g.throughput(Throughput::Elements(1));
    let mut i = 0usize;
    g.bench_function("buckets_then_item", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            lookup(&store, &region, key(i).as_bytes(), None, &mut bufs).0
        })
    });
    g.bench_function("cached_address", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            lookup(&store, &region, key(i).as_bytes(), Some(hints[i]), &mut bufs).0
        })
    });
    g.finish();
}

fn sdk_get(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let cfg = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        memory: 64 << 20,
        buckets: 1 << 16,
        threads: 1,
        ..Config::default()
    };
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let keys = 10_000;
    let clients: Vec<(&str, Client)> = rt.block_on(async {
        let server = Server::bind(&cfg).await.expect("bind");
        let addr = server.local_addr().to_string();
        tokio::spawn(server.serve(async {
            let _ = stop_rx.await;
        }));
        let mk = |path, transport| ClientConfig::default().pool_size(1).read_path(path).transport(transport);
        let rpc = Client::connect_with(addr.clone(), mk(ReadPath::Rpc, None)).await.expect("connect");
        for i in 0..keys {
            rpc.put(key(i), vec![b'v'; VALUE_LEN]).await.expect("put");
        }
        vec![
            (
                "shm_auto",
                Client::connect_with(addr.clone(), mk(ReadPath::Auto, Some(Transport::Shm))).await.expect("auto"),
            ),
            (
                "shm",
                Client::connect_with(addr.clone(), mk(ReadPath::OneSided, Some(Transport::Shm))).await.expect("shm"),
            ),
            (
                "tcp",
                Client::connect_with(addr.clone(), mk(ReadPath::OneSided, Some(Transport::Engine))).await.expect("tcp"),
            ),
            ("rpc", rpc),
        ]
    });
    let mut g = c.benchmark_group("sdk_get_1KB");
    g.throughput(Throughput::Elements(1));
    for (name, client) in &clients {
        let mut i = 0usize;
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        i = (i + 7919) % keys;
                        client.get(key(i)).await.expect("get").expect("stored");
                    }
                    start.elapsed()
                })
            })
        });
    }
    // The synchronous API: on the calling thread, into one reused buffer.
    let shm = &clients.iter().find(|(n, _)| *n == "shm").expect("shm client").1;
    let mut i = 0usize;
    let mut value = Vec::new();
    let mut name = String::new();
    g.bench_function(BenchmarkId::from_parameter("shm_get_local"), |b| {
        b.iter(|| {
            use std::fmt::Write as _;
            i = (i + 7919) % keys;
            name.clear();
            let _ = write!(name, "user{i:012}");
            shm.get_local(name.as_bytes(), &mut value).expect("attached").expect("get").expect("stored")
        })
    });
    g.finish();
    // Multi-gets of 16 keys over shm: the cost per key.
    let mut g = c.benchmark_group("sdk_multi_get_16x1KB");
    g.throughput(Throughput::Elements(16));
    let mut i = 0usize;
    g.bench_function("shm", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let batch: Vec<String> = (0..16)
                        .map(|_| {
                            i = (i + 7919) % keys;
                            key(i)
                        })
                        .collect();
                    let got = shm.multi_get(&batch).await.expect("multi-get");
                    assert!(got.iter().all(Option::is_some));
                }
                start.elapsed()
            })
        })
    });
    g.finish();
    let _ = stop_tx.send(());
    drop(clients);
    rt.shutdown_timeout(Duration::from_secs(5));
}

criterion_group!(benches, read_protocol, sdk_get);
criterion_main!(benches);
