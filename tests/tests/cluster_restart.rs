//! A rolling restart, as an operator does one: each node in turn stopped
//! with SIGTERM and started again. A stopping node hands the leadership of
//! the shards it leads to another voter before it exits (no election
//! timeout, no stretch of RPC-only GETs), giving its lease up first, while
//! YCSB-B-like load keeps going through the SDK (a writer and a one-sided
//! reader) and through a memcached port (95 % gets, 5 % sets): no
//! operation fails, no read returns a value older than one acknowledged
//! before the read began, and every acknowledged write is readable at the
//! end. The longest stretches without a one-sided GET of a key, without an
//! acknowledged PUT of a key and without a memcached answer are printed (they are
//! measurements, reported in docs/replication.md, not limits).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_tests::cluster::TestCluster;

const KEYS: usize = 8;
/// A memcached client's wait for one answer before it counts a failure.
const MC_TIMEOUT: Duration = Duration::from_secs(5);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn value_of(v: &[u8]) -> u64 {
    std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("not a number: {v:?}"))
}

/// The longest time between two events of one kind, over the rounds.
#[derive(Default)]
struct Gap {
    last: Mutex<Option<Instant>>,
    longest: Mutex<Duration>,
}

impl Gap {
    fn start(&self) {
        *self.last.lock().unwrap() = Some(Instant::now());
    }

    fn event(&self) {
        let now = Instant::now();
        if let Some(last) = self.last.lock().unwrap().replace(now) {
            let mut longest = self.longest.lock().unwrap();
            *longest = (*longest).max(now - last);
        }
    }

    fn longest(&self) -> Duration {
        *self.longest.lock().unwrap()
    }
}

#[derive(Default)]
struct Seen {
    acked: Vec<AtomicU64>,
    mc_acked: Vec<AtomicU64>,
    reads: AtomicU64,
    stale: AtomicU64,
    write_errors: AtomicU64,
    mc_ops: AtomicU64,
    mc_errors: AtomicU64,
    /// Per key: a shard whose leader is moving shows in its own keys.
    one_sided: Vec<Gap>,
    puts: Vec<Gap>,
    mc: Gap,
}

/// A memcached text-protocol client over one connection, 95 % gets and
/// 5 % sets of counters, until `stop`; every answer is checked.
fn memcached_load(port: u16, seen: &Seen, next: &AtomicU64, stop: &AtomicBool) {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the memcached port");
    s.set_read_timeout(Some(MC_TIMEOUT)).unwrap();
    let mut s = BufReader::new(s);
    let line = |s: &mut BufReader<TcpStream>| {
        let mut l = String::new();
        s.read_line(&mut l).map(|_| l).unwrap_or_else(|e| format!("no answer: {e}"))
    };
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let k = (i as usize * 7) % KEYS;
        let ok = if i.is_multiple_of(20) {
            let n = next.fetch_add(1, Ordering::Relaxed).to_string();
            s.get_mut().write_all(format!("set mc-{k} 0 0 {}\r\n{n}\r\n", n.len()).as_bytes()).unwrap();
            let got = line(&mut s);
            let ok = got == "STORED\r\n";
            if ok {
                seen.mc_acked[k].fetch_max(n.parse().unwrap(), Ordering::Relaxed);
            } else {
                eprintln!("set mc-{k}: {got:?}");
            }
            ok
        } else {
            let before = seen.mc_acked[k].load(Ordering::Relaxed);
            s.get_mut().write_all(format!("get mc-{k}\r\n").as_bytes()).unwrap();
            let first = line(&mut s);
            if first.starts_with("VALUE ") {
                let v = line(&mut s);
                let end = line(&mut s);
                let n = value_of(v.trim_end().as_bytes());
                if n < before {
                    eprintln!("stale memcached get of mc-{k}: {n}, after {before} was acknowledged");
                    seen.stale.fetch_add(1, Ordering::Relaxed);
                }
                end == "END\r\n"
            } else {
                first == "END\r\n" || {
                    eprintln!("get mc-{k}: {first:?}");
                    false
                }
            }
        };
        seen.mc_ops.fetch_add(1, Ordering::Relaxed);
        if ok {
            seen.mc.event();
        } else {
            seen.mc_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
}

#[test]
fn a_rolling_restart_under_load_fails_nothing_and_serves_no_stale_read() {
    let mut c =
        TestCluster::start(3, 2, 3, true, &["--log", "warn,dmkv_server=info", "--memcached-listen", "127.0.0.1:0"]);
    let rt = rt();
    rt.block_on(c.leaders_known(0));
    let counters = || (0..KEYS).map(|_| AtomicU64::new(0)).collect();
    let gaps = || (0..KEYS).map(|_| Gap::default()).collect();
    let seen = Arc::new(Seen {
        acked: counters(),
        mc_acked: counters(),
        one_sided: gaps(),
        puts: gaps(),
        ..Default::default()
    });
    let next = Arc::new(AtomicU64::new(1));
    let mut handed = 0;
    for i in 0..3 {
        let seed = (i + 1) % 3;
        let id = i as u64 + 1;
        let map = rt.block_on(c.leaders_known(seed));
        let led: Vec<u32> = map.shards().iter().filter(|s| s.leader == Some(id)).map(|s| s.id).collect();
        let stop = Arc::new(AtomicBool::new(false));
        for gap in seen.one_sided.iter().chain(&seen.puts).chain([&seen.mc]) {
            gap.start();
        }
        let writer = {
            let (seen, next, stop, addr) =
                (Arc::clone(&seen), Arc::clone(&next), Arc::clone(&stop), c.rpc(seed).to_string());
            rt.spawn(async move {
                let client = Client::connect(&addr).await.expect("connect");
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let k = n as usize % KEYS;
                    match client.put(format!("roll-{k}"), n.to_string()).await {
                        Ok(_) => {
                            seen.acked[k].fetch_max(n, Ordering::Relaxed);
                            seen.puts[k].event();
                        }
                        Err(e) => {
                            eprintln!("put roll-{k}: {e}");
                            seen.write_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        };
        let reader = {
            let (seen, stop, addr) = (Arc::clone(&seen), Arc::clone(&stop), c.rpc(seed).to_string());
            rt.spawn(async move {
                let cfg = ClientConfig::default().read_path(ReadPath::OneSided);
                let client = Client::connect_with(&addr, cfg).await.expect("connect");
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    k = (k + 1) % KEYS;
                    let before = seen.acked[k].load(Ordering::Relaxed);
                    let one_sided_before = client.read_stats().gets;
                    match client.get(format!("roll-{k}")).await {
                        Ok(got) => {
                            seen.reads.fetch_add(1, Ordering::Relaxed);
                            if client.read_stats().gets > one_sided_before {
                                seen.one_sided[k].event();
                            }
                            let n = got.as_deref().map_or(0, value_of);
                            if n < before {
                                eprintln!("stale read of roll-{k}: {n}, after {before} was acknowledged");
                                seen.stale.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) => {
                            eprintln!("get roll-{k}: {e}");
                            seen.write_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                client.read_stats().gets
            })
        };
        // The memcached client talks to a node that stays up this round,
        // as one behind a load balancer that drains the node being
        // restarted: the node passes keys on to their leaders.
        let mc = {
            let port: u16 = c
                .endpoint(seed, "memcached")
                .and_then(|a| a.rsplit(':').next()?.parse().ok())
                .expect("the memcached port");
            let (seen, next, stop) = (Arc::clone(&seen), Arc::clone(&next), Arc::clone(&stop));
            std::thread::spawn(move || memcached_load(port, &seen, &next, &stop))
        };
        std::thread::sleep(Duration::from_millis(500));
        let errors_before = seen.write_errors.load(Ordering::Relaxed);
        let stopping = Instant::now();
        let status = c.stop(i).expect("the node ran");
        let stopped = stopping.elapsed();
        assert!(status.success(), "node {id} exited with {status}");
        let log = c.log(i);
        if !led.is_empty() {
            assert!(
                log.contains("leadership handed over"),
                "node {id} led shards {led:?} and did not hand them over:\n{log}"
            );
            handed += led.len();
        }
        let moved = rt.block_on(c.leaders_known(seed));
        assert!(moved.shards().iter().all(|s| s.leader != Some(id)), "node {id} still named leader: {moved:?}");
        println!(
            "node {id}: led {led:?}; SIGTERM to exit {stopped:.0?}, leaders known {:.0?} after SIGTERM; {} failed SDK operations meanwhile",
            stopping.elapsed(),
            seen.write_errors.load(Ordering::Relaxed) - errors_before
        );
        c.restart(i);
        rt.block_on(c.leaders_known(i));
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        rt.block_on(writer).expect("writer");
        let one_sided = rt.block_on(reader).expect("reader");
        mc.join().expect("memcached client");
        assert!(one_sided > 0, "no GET was one-sided");
    }
    assert!(handed > 0, "no node led a shard when it stopped");
    let (reads, stale) = (seen.reads.load(Ordering::Relaxed), seen.stale.load(Ordering::Relaxed));
    println!(
        "SDK: {reads} reads, {stale} stale; {} writes (SDK and memcached), {} failed SDK operations; memcached: {} operations, {} failed",
        next.load(Ordering::Relaxed) - 1,
        seen.write_errors.load(Ordering::Relaxed),
        seen.mc_ops.load(Ordering::Relaxed),
        seen.mc_errors.load(Ordering::Relaxed),
    );
    println!(
        "longest stretch without a one-sided GET of a key {:.0?}, without an acknowledged PUT of a key {:.0?}, without a memcached answer {:.0?}",
        seen.one_sided.iter().map(Gap::longest).max().unwrap_or_default(),
        seen.puts.iter().map(Gap::longest).max().unwrap_or_default(),
        seen.mc.longest()
    );
    assert_eq!(stale, 0, "reads older than an acknowledged write");
    assert_eq!(seen.write_errors.load(Ordering::Relaxed), 0, "SDK operations failed during the restarts");
    assert_eq!(seen.mc_errors.load(Ordering::Relaxed), 0, "memcached operations failed during the restarts");
    rt.block_on(async {
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for (k, acked) in seen.acked.iter().enumerate() {
            let got = client.get(format!("roll-{k}")).await.expect("get").map_or(0, |v| value_of(&v));
            let acked = acked.load(Ordering::Relaxed);
            assert!(got >= acked, "roll-{k}: {got} after {acked} was acknowledged");
        }
        for (k, acked) in seen.mc_acked.iter().enumerate() {
            let got = client.get(format!("mc-{k}")).await.expect("get").map_or(0, |v| value_of(&v));
            let acked = acked.load(Ordering::Relaxed);
            assert!(got >= acked, "mc-{k}: {got} after {acked} was acknowledged through memcached");
        }
    });
}
