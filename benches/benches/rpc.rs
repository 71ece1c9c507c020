//! GET round trips through the RPC path on loopback: an in-process server,
//! the SDK client, one connection, 1 and 16 requests in flight.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_server::{Config, Server};
use tokio::sync::oneshot;

const VALUE_LEN: usize = 1000;
const MEMORY: u64 = 64 << 20;
const SERVER_THREADS: usize = 1;
/// Requests in flight measured.
const DEPTHS: [u64; 2] = [1, 16];

fn rpc(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let cfg = Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        memory: MEMORY,
        buckets: (MEMORY / 1024).next_power_of_two(),
        threads: SERVER_THREADS,
        ..Config::default()
    };
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let client = rt.block_on(async {
        let server = Server::bind(&cfg).await.expect("bind");
        let addr = server.local_addr().to_string();
        tokio::spawn(server.serve(async {
            let _ = stop_rx.await;
        }));
        let cfg = ClientConfig::default().pool_size(1).read_path(ReadPath::Rpc);
        let client = Client::connect_with(addr, cfg).await.expect("connect");
        client.put("bench-key", vec![7u8; VALUE_LEN]).await.expect("put");
        client
    });

    let mut g = c.benchmark_group("rpc_get");
    g.throughput(Throughput::Elements(1));
    for depth in DEPTHS {
        g.bench_function(BenchmarkId::new("in_flight", depth), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    let tasks: Vec<_> = (0..depth)
                        .map(|t| {
                            let client = client.clone();
                            let n = iters / depth + u64::from(t < iters % depth);
                            tokio::spawn(async move {
                                for _ in 0..n {
                                    client.get("bench-key").await.expect("get").expect("stored");
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.expect("task");
                    }
                    start.elapsed()
                })
            })
        });
    }
    g.finish();
    let _ = stop_tx.send(());
    drop(client);
    rt.shutdown_timeout(Duration::from_secs(5));
}

criterion_group!(benches, rpc);
criterion_main!(benches);
