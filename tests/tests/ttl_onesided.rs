//! Item expiry as one-sided readers see it, on a real dmkvd: a one-sided
//! GET never returns an item after its expiry by the server's clock (which
//! the reader reads from the region, beside the item), an expired item is
//! a miss without asking the server, touch moves the expiry, an item stored
//! without a TTL stays, and the RPC path agrees.
//!
//! The server runs on this host, so its clock is this host's wall clock
//! (published every 10 ms): a read that started at wall time `t` and
//! returned an item shows `t < expires_at + ALLOWANCE`.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dmkv_client::{Client, ClientConfig, PutOptions, ReadPath, Transport, Versioned};
use dmkv_tests::ServerProcess;

/// How late (by this host's wall clock) a read may still see an item: the
/// server publishes its clock every 10 ms; the rest is for a loaded CI
/// machine's scheduling of the clock thread. Still well inside the
/// shortest TTL: a reader that ignored expiry would see items for good.
const ALLOWANCE_MS: u64 = 400;
/// After its expiry plus this, every read must miss.
const GONE_AFTER_MS: u64 = 500;

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_millis() as u64
}

/// What the test knows of one key.
struct Key {
    name: String,
    value: Vec<u8>,
    /// The expiry the reads report (unix seconds; 0: never), once learnt.
    expires_at: Option<u32>,
    /// Host wall-clock range its expiry must fall in, from the put (or
    /// touch) and its TTL; None: no TTL.
    range: Option<(u32, u32)>,
    /// When a read first missed (wall ms, at the read's end).
    gone_at: Option<u64>,
    hits: u64,
}

impl Key {
    /// Checks one read of the key that ran from `t0` to `t1` (wall ms).
    fn check(&mut self, path: &str, got: Option<Versioned>, t0: u64, t1: u64) {
        let name = &self.name;
        match got {
            Some(v) => {
                assert_eq!(v.value, self.value, "{path} {name}: value");
                assert!(
                    self.gone_at.is_none(),
                    "{path} {name}: live at {t0} after a miss (by either path) at {:?}",
                    self.gone_at
                );
                match self.range {
                    None => assert_eq!(v.expires_at, 0, "{path} {name}: stored without a TTL"),
                    Some((lo, hi)) => assert!(
                        (lo..=hi).contains(&v.expires_at),
                        "{path} {name}: expires at {} not in {lo}..={hi}",
                        v.expires_at
                    ),
                }
                if let Some(at) = self.expires_at {
                    assert_eq!(v.expires_at, at, "{path} {name}: expiry changed without a write");
                }
                self.expires_at = Some(v.expires_at);
                let at_ms = u64::from(v.expires_at) * 1000;
                assert!(
                    v.expires_at == 0 || t0 < at_ms + ALLOWANCE_MS,
                    "{path} {name}: a read that started at {t0} returned an item that expired at {at_ms} ({} ms late)",
                    t0 - at_ms
                );
                self.hits += 1;
            }
            None => {
                let at = self.expires_at.or(self.range.map(|r| r.0));
                let at_ms = u64::from(at.unwrap_or(0)) * 1000;
                assert!(
                    self.range.is_some() && t1 >= at_ms,
                    "{path} {name}: missed in a read that ended at {t1}, before its expiry at {at_ms:?}"
                );
                self.gone_at.get_or_insert(t1);
            }
        }
    }

    /// Whether a read starting at `t0` must miss.
    fn must_be_gone(&self, t0: u64) -> bool {
        self.expires_at.is_some_and(|at| at != 0 && t0 >= u64::from(at) * 1000 + GONE_AFTER_MS)
    }
}

/// Expiry range for a TTL of `ttl` s given at wall times t0..t1 (ms): the
/// server's clock may lag the wall clock by its publishing interval.
fn range(ttl: u32, t0: u64, t1: u64) -> Option<(u32, u32)> {
    Some((((t0.saturating_sub(1000)) / 1000) as u32 + ttl, (t1 / 1000) as u32 + ttl))
}

async fn scenario(srv: &ServerProcess, transport: Transport) {
    let tag = transport.name();
    let cfg = |read_path| ClientConfig::default().read_path(read_path).transport(Some(transport)).pool_size(1);
    let one = Client::connect_with(&srv.rpc, cfg(ReadPath::OneSided)).await.unwrap();
    assert_eq!(one.one_sided_transport(), Some(transport));
    let rpc = Client::connect_with(&srv.rpc, ClientConfig::default().read_path(ReadPath::Rpc)).await.unwrap();

    let mut keys: HashMap<String, Key> = HashMap::new();
    let add = |keys: &mut HashMap<String, Key>, name: String, value: Vec<u8>, range| {
        keys.insert(name.clone(), Key { name, value, expires_at: None, range, gone_at: None, hits: 0 });
    };
    for ttl in [1u32, 2, 3] {
        for i in 0..3 {
            let (name, value) = (format!("{tag}-ttl{ttl}-{i}"), format!("v{ttl}-{i}").into_bytes());
            let t0 = wall_ms();
            let opts = PutOptions { ttl: Some(Duration::from_secs(ttl.into())), flags: ttl, ..Default::default() };
            rpc.put_with(&name, &value, opts).await.unwrap();
            add(&mut keys, name, value, range(ttl, t0, wall_ms()));
        }
    }
    let forever = format!("{tag}-forever");
    rpc.put(&forever, "stays").await.unwrap();
    add(&mut keys, forever.clone(), b"stays".to_vec(), None);
    // Stored with 1 s, then touched to 3 s: it must outlive its first
    // expiry and go at its second.
    let touched = format!("{tag}-touched");
    let t0 = wall_ms();
    rpc.put_with(&touched, "t", PutOptions { ttl: Some(Duration::from_secs(1)), ..Default::default() }).await.unwrap();
    let first = range(1, t0, wall_ms()).unwrap();
    let t0 = wall_ms();
    assert!(one.touch(&touched, Some(Duration::from_secs(3))).await.unwrap());
    add(&mut keys, touched.clone(), b"t".to_vec(), range(3, t0, wall_ms()));

    let server_gets = rpc.stats().await.unwrap()["gets"];
    let (rs0, rpc_rs0) = (one.read_stats(), rpc.read_stats());
    let mut one_reads = 0u64;
    let mut names: Vec<String> = keys.keys().cloned().collect();
    names.sort();
    // Read until every TTL key has been seen missing and the latest expiry
    // is well past (bounded: TTLs are at most 3 s).
    let deadline = wall_ms() + 30_000;
    loop {
        for (path, c) in [("one-sided", &one), ("rpc", &rpc)] {
            for name in &names {
                let k = keys.get_mut(name).unwrap();
                let t0 = wall_ms();
                let got = c.get_versioned(name).await.unwrap();
                let t1 = wall_ms();
                let must_miss = k.must_be_gone(t0);
                k.check(path, got.clone(), t0, t1);
                assert!(!(must_miss && got.is_some()), "{path} {name}: read at {t0}, past expiry + {GONE_AFTER_MS} ms");
                if path == "one-sided" {
                    one_reads += 1;
                }
            }
        }
        let done = keys.values().all(|k| k.range.is_none() || k.must_be_gone(wall_ms()) && k.gone_at.is_some());
        if done {
            break;
        }
        assert!(wall_ms() < deadline, "items did not expire within 30 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    for k in keys.values() {
        assert!(k.hits > 0, "{tag} {}: never read live", k.name);
    }
    // The touched item outlived its first expiry: it was read after it.
    let t = &keys[&touched];
    assert!(t.expires_at.unwrap() > first.1, "{tag}: touch did not move the expiry ({:?} vs {first:?})", t.expires_at);
    assert!(keys[&forever].gone_at.is_none());
    // The one-sided client's reads really were one-sided: counted there,
    // none answered over RPC, and the server's KV code ran only for the
    // RPC client's reads.
    let rs = one.read_stats();
    assert_eq!(rs.gets - rs0.gets, one_reads, "{tag}: {rs:?}");
    assert_eq!(rs.rpc_gets - rs0.rpc_gets, 0, "{tag}: {rs:?}");
    assert_eq!(rs.fallbacks - rs0.fallbacks, 0, "{tag}: {rs:?}");
    assert_eq!(rs.no_clock, 0, "{tag}: the region publishes a clock: {rs:?}");
    let rpc_reads = rpc.read_stats().rpc_gets - rpc_rs0.rpc_gets;
    let ran = rpc.stats().await.unwrap()["gets"] - server_gets;
    assert_eq!(ran, rpc_reads, "{tag}: the server ran {ran} GETs for {rpc_reads} RPC reads");
    println!("{tag}: {one_reads} one-sided and {rpc_reads} RPC reads; {rs:?}");
}

#[tokio::test]
async fn one_sided_reads_honour_ttls_touch_and_agree_with_rpc() {
    let srv = ServerProcess::start(&["--memory", "32MiB"]);
    for t in [Transport::Shm, Transport::Engine] {
        scenario(&srv, t).await;
    }
}
