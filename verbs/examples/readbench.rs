//! RDMA READ latency/throughput loop over one RC connection on the local device (loopback).
//!
//! Usage: readbench [ITERATIONS] [DEVICE]     (default 10000 iterations, first active device)
//!
//! Runs, for each shape, ITERATIONS batches with `read_batch` (post one batch, busy-poll its
//! completion) and prints batches/s, reads/s, MB/s and the mean batch latency in µs:
//! - 1 read of 64 B per batch (index-entry sized; pure latency),
//! - 16 reads of 1 KiB per batch (one doorbell, one signaled completion).

use std::time::{Duration, Instant};

use dmkv_verbs::{Context, MemoryRegion, QueuePair, ReadRequest};
use memmap2::MmapMut;

const REGION_LEN: usize = 64 << 20;
const WARMUP: usize = 100;
const BATCH_TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let iterations: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(10_000);
    let device = args.next();
    let ctx = Context::open(device.as_deref())?;
    println!("device {} port {} gid index {}", ctx.device_name(), ctx.port(), ctx.gid_index());

    let mut map = MmapMut::map_anon(REGION_LEN)?;
    for (i, b) in map.iter_mut().enumerate() {
        *b = i as u8;
    }
    // SAFETY: `map` is declared before `region`, so it is dropped after the registration.
    let region = unsafe { MemoryRegion::register_remote_read(&ctx, map.as_mut_ptr(), map.len())? };
    let mut local = MemoryRegion::register_local(&ctx, 1 << 20)?;
    let mut server = QueuePair::create(&ctx, 64)?;
    let mut client = QueuePair::create(&ctx, 64)?;
    server.connect(&client.endpoint())?;
    client.connect(&server.endpoint())?;

    for (reads_per_batch, len) in [(1usize, 64u32), (16, 1024)] {
        // A fixed pseudo-random walk over the region, so the NIC does not read the same page.
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut batch = |i: usize| -> Vec<ReadRequest> {
            (0..reads_per_batch)
                .map(|j| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let off = (x % (REGION_LEN as u64 - len as u64)) & !63;
                    ReadRequest {
                        wr_id: (i * reads_per_batch + j) as u64,
                        remote_addr: region.addr() + off,
                        rkey: region.rkey(),
                        len,
                        local_offset: j * len as usize,
                    }
                })
                .collect()
        };
        for i in 0..WARMUP {
            client.read_batch(&batch(i), &mut local, Instant::now() + BATCH_TIMEOUT)?;
        }
        let batches: Vec<Vec<ReadRequest>> = (0..iterations).map(&mut batch).collect();
        let start = Instant::now();
        for b in &batches {
            client.read_batch(b, &mut local, Instant::now() + BATCH_TIMEOUT)?;
        }
        let secs = start.elapsed().as_secs_f64();
        let reads = (iterations * reads_per_batch) as f64;
        println!(
            "{reads_per_batch:>2} x {len:>4} B: {iterations} batches in {secs:.3} s: {:.0} batches/s, {:.0} reads/s, \
             {:.2} MB/s, mean {:.1} us/batch",
            iterations as f64 / secs,
            reads / secs,
            reads * len as f64 / secs / 1e6,
            secs * 1e6 / iterations as f64,
        );
        // Spot-check the last batch against the region.
        let last = batches.last().expect("iterations > 0");
        for r in last {
            let off = (r.remote_addr - region.addr()) as usize;
            assert!(local.slice(r.local_offset, len as usize)? == &map[off..off + len as usize]);
        }
    }
    Ok(())
}
