//! Measures PUT and GET throughput with a fixed number of requests in
//! flight on one connection.
//!
//! `cargo run --release -p dmkv-client --example pipeline -- ADDR [OPS] [DEPTH] [VALUE_BYTES]`

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig};
use dmkv_common::proto::{self, request::Op};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let addr = args.get(1).cloned().unwrap_or_else(|| "127.0.0.1:7070".into());
    let ops: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let depth: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    let size: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(100);
    let c = Client::connect_with(addr, ClientConfig::default().pool_size(1)).await.expect("connect");
    let value = bytes::Bytes::from(vec![b'x'; size]);
    let keys: Vec<bytes::Bytes> = (0..10_000).map(|i| format!("key{i:08}").into()).collect();
    for (name, make) in [
        (
            "PUT",
            Box::new(|k: bytes::Bytes| Op::Put(proto::Put { key: k, value: value.clone(), ..Default::default() }))
                as Box<dyn Fn(bytes::Bytes) -> Op>,
        ),
        ("GET", Box::new(|k: bytes::Bytes| Op::Get(proto::Get { key: k }))),
    ] {
        let start = Instant::now();
        let mut window = VecDeque::with_capacity(depth);
        for i in 0..ops {
            if window.len() == depth {
                let f: dmkv_client::conn::InFlight = window.pop_front().unwrap();
                f.wait(Duration::from_secs(10)).await.expect("reply");
            }
            window.push_back(c.send(make(keys[i % keys.len()].clone())).await.expect("send"));
        }
        for f in window {
            f.wait(Duration::from_secs(10)).await.expect("reply");
        }
        let secs = start.elapsed().as_secs_f64();
        println!("{name}: {ops} ops, {depth} in flight, {size} B values: {:.0} ops/s", ops as f64 / secs);
    }
}
