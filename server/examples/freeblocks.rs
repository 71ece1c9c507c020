//! How long the compactor's free-block snapshot holds the writer lock in a
//! large, fragmented store: the whole list at once, and one piece of
//! 16,384 blocks (what `Store::free_blocks` takes per hold).
use std::time::Instant;

use dmkv_server::alloc::Allocator;

fn main() {
    // 1 GiB of 64-byte units, in 3-unit items (100 B values), every other freed.
    let units = (1u64 << 30) / 64;
    let mut a = Allocator::new(1, 1 + units);
    let mut blocks = Vec::new();
    while let Some(at) = a.alloc(3) {
        blocks.push(at);
    }
    for &b in blocks.iter().step_by(2) {
        a.free(b, 3);
    }
    for _ in 0..3 {
        let t = Instant::now();
        let all = a.free_blocks_from(0, usize::MAX);
        let whole = t.elapsed();
        let mut worst = std::time::Duration::ZERO;
        let mut from = 0;
        loop {
            let t = Instant::now();
            let piece = a.free_blocks_from(from, 16_384);
            worst = worst.max(t.elapsed());
            let Some(&(at, len)) = piece.last() else { break };
            from = at + len;
            if piece.len() < 16_384 {
                break;
            }
        }
        println!("{} free blocks: all at once {whole:?}, slowest piece of 16,384 {worst:?}", all.len());
    }
}
