//! The cache-aside replay of `dmkv-hitratio`: its trace follows from the
//! seed, its hit counting agrees with an LRU's hits computed another way
//! (stack distances), and the binary meets bad flags with exit code 2.

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};

use dmkv_benches::generator::key_name;
use dmkv_benches::hitratio::{Cache, PARTS, Settings, Trace, replay};

const HITRATIO: &str = env!("CARGO_BIN_EXE_dmkv-hitratio");

/// An LRU of `capacity` items, in process.
struct Lru {
    capacity: usize,
    clock: u64,
    items: HashMap<Vec<u8>, (u64, Vec<u8>)>,
    by_age: BTreeMap<u64, Vec<u8>>,
}

impl Lru {
    fn new(capacity: usize) -> Lru {
        Lru { capacity, clock: 0, items: HashMap::new(), by_age: BTreeMap::new() }
    }

    fn touch(&mut self, key: &[u8]) {
        self.clock += 1;
        if let Some((stamp, _)) = self.items.get_mut(key) {
            self.by_age.remove(stamp);
            *stamp = self.clock;
            self.by_age.insert(self.clock, key.to_vec());
        }
    }
}

impl Cache for Lru {
    fn get(&mut self, key: &[u8]) -> Result<Option<(u8, usize)>, String> {
        self.touch(key);
        Ok(self.items.get(key).map(|(_, v)| (v[0], v.len())))
    }

    fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        if !self.items.contains_key(key) && self.items.len() == self.capacity {
            let (_, oldest) = self.by_age.pop_first().expect("a full cache has an oldest item");
            self.items.remove(&oldest);
        }
        self.clock += 1;
        if let Some((old, _)) = self.items.insert(key.to_vec(), (self.clock, value.to_vec())) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, key.to_vec());
        Ok(())
    }
}

fn settings() -> Settings {
    Settings { warmup: 1_000, ..Settings::new(1_000, 8_000, 16, 7) }
}

#[test]
fn the_trace_follows_from_the_seed() {
    let s = settings();
    let a: Vec<u64> = Trace::new(&s).collect();
    assert_eq!(a.len() as u64, s.ops);
    assert_eq!(a, Trace::new(&s).collect::<Vec<_>>());
    assert!(a.iter().all(|&k| k < s.keys));
    let other: Vec<u64> = Trace::new(&Settings { seed: 8, ..s.clone() }).collect();
    assert_ne!(a, other, "another seed, another trace");
    // Skewed: the most popular key is drawn far more often than 1 / keys.
    let mut counts = HashMap::new();
    a.iter().for_each(|k| *counts.entry(*k).or_insert(0u64) += 1);
    assert!(*counts.values().max().unwrap() > 20 * s.ops / s.keys, "{counts:?}");
    // Another constant: the same bounds, still deterministic.
    let flat = Settings { zipf: 0.5, ..s.clone() };
    let f: Vec<u64> = Trace::new(&flat).collect();
    assert_eq!(f, Trace::new(&flat).collect::<Vec<_>>());
    assert!(f.iter().all(|&k| k < s.keys) && f != a);
}

/// Hits of an LRU of `capacity` items fed `trace`, from stack distances: an
/// access hits when the key was accessed before and fewer than `capacity`
/// other keys were accessed since (every access leaves the key cached).
fn lru_hits(trace: &[u64], capacity: usize) -> Vec<bool> {
    let mut last: HashMap<u64, usize> = HashMap::new();
    let mut out = Vec::with_capacity(trace.len());
    for (i, k) in trace.iter().enumerate() {
        let hit = last.get(k).is_some_and(|&j| {
            let between: std::collections::HashSet<u64> = trace[j + 1..i].iter().copied().collect();
            between.len() < capacity
        });
        out.push(hit);
        last.insert(*k, i);
    }
    out
}

#[test]
fn hits_agree_with_an_lru_computed_another_way() {
    let s = settings();
    let trace: Vec<u64> = Trace::new(&s).collect();
    for capacity in [1, 50, 400, s.keys as usize] {
        let o = replay(&mut Lru::new(capacity), &s).unwrap();
        let want = lru_hits(&trace, capacity);
        let measured = want[s.warmup as usize..].iter().filter(|h| **h).count() as u64;
        assert_eq!(o.measured.gets, s.ops - s.warmup);
        assert_eq!(o.measured.hits, measured, "capacity {capacity}");
        assert_eq!(o.sets, want.iter().filter(|h| !**h).count() as u64, "a SET per miss");
        assert_eq!(o.parts.len() as u64, PARTS);
        for p in &o.parts {
            let hits = want[p.first as usize..p.end as usize].iter().filter(|h| **h).count() as u64;
            assert_eq!((p.gets, p.hits), (p.end - p.first, hits), "capacity {capacity}, part {p:?}");
        }
    }
    // Room for every key: only each key's first access misses.
    let o = replay(&mut Lru::new(s.keys as usize), &s).unwrap();
    let mut seen = std::collections::HashSet::new();
    let first_after_warmup =
        trace.iter().enumerate().filter(|(i, k)| seen.insert(**k) && *i as u64 >= s.warmup).count();
    assert_eq!(o.measured.hits, s.ops - s.warmup - first_after_warmup as u64);
    let r = o.hit_ratio.unwrap();
    assert!(r > 0.9 && r < 1.0, "{r}");
}

/// Answers every GET with a value of the wrong length.
struct Liar;

impl Cache for Liar {
    fn get(&mut self, _: &[u8]) -> Result<Option<(u8, usize)>, String> {
        Ok(Some((b'a', 3)))
    }

    fn set(&mut self, _: &[u8], _: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn wrong_values_and_bad_settings_are_errors() {
    let s = settings();
    let e = replay(&mut Liar, &s).unwrap_err();
    assert!(e.contains("operation 0") && e.contains("wrong value") && e.contains(&key_name(0)[..4]), "{e}");
    for (bad, flag) in [
        (Settings { keys: 0, ..s.clone() }, "--keys"),
        (Settings { ops: 0, ..s.clone() }, "--ops"),
        (Settings { value_size: (1 << 20) + 1, ..s.clone() }, "--value-size"),
        (Settings { zipf: 1.0, ..s.clone() }, "--zipf"),
        (Settings { zipf: f64::NAN, ..s.clone() }, "--zipf"),
        (Settings { warmup: s.ops, ..s.clone() }, "--warmup"),
    ] {
        assert!(replay(&mut Lru::new(1), &bad).unwrap_err().contains(flag), "{flag}");
    }
}

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(HITRATIO)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .output()
        .expect("run dmkv-hitratio");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn the_binary_explains_itself_and_refuses_bad_flags() {
    let (code, out, _) = run(&["--help"]);
    assert_eq!(code, Some(0));
    for flag in
        ["--backend", "--server", "--path", "--keys", "--ops", "--value-size", "--zipf", "--warmup", "--seed", "--json"]
    {
        assert!(out.contains(flag), "--help lacks {flag}");
    }
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    for (args, says) in [
        (vec!["--ops", "0"], "--ops"),
        (vec!["--ops", "x"], "--ops"),
        (vec!["--zipf", "1.2"], "--zipf"),
        (vec!["--value-size", "2000000"], "--value-size"),
        (vec!["--ops", "10", "--warmup", "10"], "--warmup"),
        (vec!["--keys", "0"], "--keys"),
        (vec!["--backend", "redis"], "redis"),
        (vec!["--path", "sideways", "--backend", "dmkv"], "sideways"),
        (vec!["--path", "rpc"], "--path"),
        (vec!["--nonsense"], "--nonsense"),
        (vec!["--server", dead.as_str(), "--ops", "10"], "cannot connect"),
        (vec!["--backend", "dmkv", "--server", dead.as_str(), "--ops", "10"], "cannot connect"),
    ] {
        let (code, _, err) = run(&args);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err:?} lacks {says:?}");
    }
}
