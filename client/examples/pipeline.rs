//! Measures PUT and GET throughput with a fixed number of requests in
//! flight on one connection, with the SDK's typed pipelining.
//!
//! `cargo run --release -p dmkv-client --example pipeline -- ADDR [OPS] [DEPTH] [VALUE_BYTES]`

use std::collections::VecDeque;
use std::time::Instant;

use dmkv_client::{Client, ClientConfig};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let addr = args.get(1).cloned().unwrap_or_else(|| "127.0.0.1:7070".into());
    let ops: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let depth: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    let size: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(100);
    let c = Client::connect_with(addr, ClientConfig::default().pool_size(1)).await.expect("connect");
    let value = vec![b'x'; size];
    let keys: Vec<String> = (0..10_000).map(|i| format!("key{i:08}")).collect();
    let start = Instant::now();
    let mut window = VecDeque::with_capacity(depth);
    for i in 0..ops {
        if window.len() == depth {
            let p: dmkv_client::pipeline::Pending<u64> = window.pop_front().unwrap();
            p.wait().await.expect("reply");
        }
        window.push_back(c.send_put(&keys[i % keys.len()], &value).await.expect("send"));
    }
    for p in window {
        p.wait().await.expect("reply");
    }
    report("PUT", ops, depth, size, start);
    let start = Instant::now();
    let mut window = VecDeque::with_capacity(depth);
    for i in 0..ops {
        if window.len() == depth {
            let p: dmkv_client::pipeline::Pending<_> = window.pop_front().unwrap();
            p.wait().await.expect("reply");
        }
        window.push_back(c.send_get(&keys[i % keys.len()]).await.expect("send"));
    }
    for p in window {
        p.wait().await.expect("reply");
    }
    report("GET", ops, depth, size, start);
}

fn report(name: &str, ops: usize, depth: usize, size: usize, start: Instant) {
    let secs = start.elapsed().as_secs_f64();
    println!("{name}: {ops} ops, {depth} in flight, {size} B values: {:.0} ops/s", ops as f64 / secs);
}
