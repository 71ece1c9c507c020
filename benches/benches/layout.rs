//! Encoding and verifying items of the remote-memory layout: the checksum
//! every writer computes and every one-sided reader checks.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dmkv_common::layout::{decode_item, encode_item};
use std::hint::black_box;

/// Value sizes measured: small, YCSB's 1 KB, large.
const SIZES: [usize; 3] = [100, 1000, 64 * 1024];
const KEY: &[u8] = b"user6284781860667377211";

fn layout(c: &mut Criterion) {
    let mut g = c.benchmark_group("layout");
    for size in SIZES {
        let value = vec![0xA5u8; size];
        g.throughput(Throughput::Bytes(size as u64));
        let mut out = Vec::with_capacity(size + 128);
        g.bench_with_input(BenchmarkId::new("encode_item", size), &value, |b, v| {
            b.iter(|| {
                out.clear();
                encode_item(black_box(KEY), black_box(v), 7, 0, 0, &mut out);
            })
        });
        let mut item = Vec::new();
        encode_item(KEY, &value, 7, 0, 0, &mut item);
        g.bench_with_input(BenchmarkId::new("decode_item", size), &item, |b, item| {
            b.iter(|| decode_item(black_box(item)).expect("valid item").value.len())
        });
    }
    g.finish();
}

criterion_group!(benches, layout);
criterion_main!(benches);
