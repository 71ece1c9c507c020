//! The server's index: PUT (insert, then overwrite) and GET on a store in
//! memory, without the network.

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dmkv_server::region::Region;
use dmkv_server::store::Store;
use std::hint::black_box;

/// Keys in the store; overwrites cycle over them.
const KEYS: usize = 10_000;
const VALUE_LEN: usize = 100;
/// Region size: room for every key many times over while retired items wait
/// out their grace period.
const REGION_LEN: usize = 256 << 20;
const BUCKETS: u64 = 1 << 16;
/// Short, so overwritten items are reused quickly during the benchmark.
const GRACE: Duration = Duration::from_millis(1);

fn store() -> Store {
    let region = Arc::new(Region::create("dmkv-bench", REGION_LEN).expect("create region"));
    Store::format(region, BUCKETS, 0x5EED, 1, GRACE).expect("format store")
}

fn index(c: &mut Criterion) {
    let keys: Vec<Vec<u8>> = (0..KEYS).map(|i| format!("user{i:012}").into_bytes()).collect();
    let value = vec![0x5Au8; VALUE_LEN];
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(1));

    // Fresh stores, so every put is an insert into an empty slot.
    g.bench_function("put_insert", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let s = store();
                let n = left.min(KEYS as u64);
                let t = std::time::Instant::now();
                for k in &keys[..n as usize] {
                    s.put(black_box(k), black_box(&value)).expect("put");
                }
                total += t.elapsed();
                left -= n;
            }
            total
        })
    });

    let s = store();
    for k in &keys {
        s.put(k, &value).expect("put");
    }
    let mut i = 0;
    g.bench_function("put_overwrite", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            s.put(black_box(&keys[i]), black_box(&value)).expect("put")
        })
    });
    g.bench_function("get_hit", |b| {
        b.iter(|| {
            i = (i + 1) % KEYS;
            s.get(black_box(&keys[i])).expect("get").expect("stored")
        })
    });
    g.bench_function("get_miss", |b| b.iter(|| s.get(black_box(b"absent-key")).expect("get")));
    g.finish();
}

criterion_group!(benches, index);
criterion_main!(benches);
