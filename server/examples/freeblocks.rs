//! How long the compactor's free-block snapshot holds the writer lock in a
//! large, fragmented store (a measurement for a follow-up).
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmkv_server::region::Region;
use dmkv_server::store::Store;

fn main() {
    let region = Arc::new(Region::create("fb", 1 << 30).unwrap());
    let s = Store::format(region, 1 << 21, 1, 1, Duration::ZERO).unwrap();
    let mut n = 0u64;
    while s.put(format!("k{n}").as_bytes(), &[1; 100]).is_ok() {
        n += 1;
    }
    for i in (0..n).step_by(2) {
        s.delete(format!("k{i}").as_bytes()).unwrap();
    }
    s.reclaim_now();
    for _ in 0..3 {
        let t = Instant::now();
        let b = s.free_blocks();
        println!("{} free blocks copied in {:?}", b.len(), t.elapsed());
    }
}
