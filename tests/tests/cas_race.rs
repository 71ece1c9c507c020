//! The compare-and-swap race on a real dmkvd: clients increment one
//! counter by read-version → CAS(value + 1, version), retrying when the CAS
//! loses (EXISTS). CAS is right when every old version was won by exactly
//! one CAS, the wins chain from the first version to the last, and the
//! counter ends at the number of wins. Through the SDK (RPC, one-sided and
//! auto reads of the version) and through the memcached port (text `gets`
//! and `cas` on separate connections, racing an SDK client on the same key).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dmkv_client::{Client, ClientConfig, ErrorCode, ReadPath};
use dmkv_tests::ServerProcess;

/// One winning CAS: who, the version it replaced, what it wrote.
#[derive(Debug, Clone)]
struct Win {
    who: String,
    old_version: u64,
    /// The new version (0 when the protocol does not return it).
    new_version: u64,
    value: u64,
}

/// Checks the wins against the counter's final value and version: no old
/// version won twice, values 1..=n each written once, and (where new
/// versions are known) the wins chain from `first` to `last`.
fn check(wins: &[Win], first: u64, last: u64, final_value: u64) {
    let mut by_old: HashMap<u64, &Win> = HashMap::new();
    for w in wins {
        if let Some(prev) = by_old.insert(w.old_version, w) {
            panic!("version {} won twice: {prev:?} and {w:?}", w.old_version);
        }
    }
    assert_eq!(final_value, wins.len() as u64, "the counter ends at the number of winning CASes");
    let mut per: HashMap<&str, usize> = HashMap::new();
    for w in wins {
        *per.entry(&w.who).or_default() += 1;
    }
    println!("wins per client: {per:?}");
    let mut values: Vec<u64> = wins.iter().map(|w| w.value).collect();
    values.sort_unstable();
    assert!(values.iter().copied().eq(1..=wins.len() as u64), "each value 1..=n written once: {values:?}");
    if wins.iter().all(|w| w.new_version != 0) {
        let (mut v, mut n) = (first, 0u64);
        while let Some(w) = by_old.get(&v) {
            n += 1;
            assert_eq!(w.value, n, "win {n} in version order wrote {}", w.value);
            v = w.new_version;
        }
        assert_eq!(n, wins.len() as u64, "the chain from version {first} covers every win");
        assert_eq!(v, last, "the chain ends at the counter's version");
    }
}

/// Increments `key` by CAS until it has won `wins` times; returns its
/// wins and how many CASes it lost.
async fn sdk_worker(c: Client, who: String, key: &'static str, wins: usize) -> (Vec<Win>, u64) {
    let (mut won, mut lost) = (Vec::new(), 0u64);
    while won.len() < wins {
        let cur = c.get_versioned(key).await.unwrap().expect("the counter exists");
        let n: u64 = std::str::from_utf8(&cur.value).unwrap().parse().unwrap();
        match c.cas(key, (n + 1).to_string(), cur.version).await {
            Ok(v) => won.push(Win { who: who.clone(), old_version: cur.version, new_version: v, value: n + 1 }),
            Err(e) if e.code() == Some(ErrorCode::Exists) => lost += 1,
            Err(e) => panic!("{who}: cas: {e}"),
        }
    }
    (won, lost)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_cas_race_has_one_winner_per_version() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let setup = Client::connect(&srv.rpc).await.unwrap();
    let first = setup.put("counter", "0").await.unwrap();
    let mut tasks = Vec::new();
    for (i, path) in [ReadPath::Rpc, ReadPath::OneSided, ReadPath::Auto, ReadPath::Rpc].into_iter().enumerate() {
        let cfg = ClientConfig::default().read_path(path).pool_size(1);
        let c = Client::connect_with(&srv.rpc, cfg).await.unwrap();
        tasks.push(tokio::spawn(sdk_worker(c, format!("client{i}-{}", path.name()), "counter", 150)));
    }
    let (mut wins, mut lost) = (Vec::new(), 0);
    for t in tasks {
        let (w, l) = tokio::time::timeout(Duration::from_secs(120), t).await.expect("workers finish").unwrap();
        wins.extend(w);
        lost += l;
    }
    let end = setup.get_versioned("counter").await.unwrap().unwrap();
    let final_value = std::str::from_utf8(&end.value).unwrap().parse().unwrap();
    check(&wins, first, end.version, final_value);
    println!("{} winning CASes, {lost} lost", wins.len());
}

/// A memcached text-protocol connection.
struct Text(BufReader<TcpStream>);

impl Text {
    fn connect(port: u16) -> Text {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Text(BufReader::new(s))
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.0.read_line(&mut l).expect("read a line");
        assert!(l.ends_with("\r\n"), "connection closed or bad line {l:?}");
        l.truncate(l.len() - 2);
        l
    }

    /// `gets key`: (value, cas unique).
    fn gets(&mut self, key: &str) -> (u64, u64) {
        self.0.get_mut().write_all(format!("gets {key}\r\n").as_bytes()).unwrap();
        let head = self.line();
        let f: Vec<&str> = head.split(' ').collect();
        assert!(f.len() == 5 && f[0] == "VALUE" && f[1] == key, "gets: {head:?}");
        let (value, unique) = (self.line(), f[4].parse().unwrap());
        assert_eq!(self.line(), "END");
        (value.trim().parse().unwrap(), unique)
    }

    /// `cas key 0 0 len unique`: the reply line.
    fn cas(&mut self, key: &str, value: u64, unique: u64) -> String {
        let v = value.to_string();
        self.0.get_mut().write_all(format!("cas {key} 0 0 {} {unique}\r\n{v}\r\n", v.len()).as_bytes()).unwrap();
        self.line()
    }
}

#[test]
fn memcached_port_cas_race_has_one_winner_per_version() {
    let srv = ServerProcess::start(&["--memory", "16MiB", "--memcached-listen", "127.0.0.1:0"]);
    let port: u16 = srv.endpoint("memcached").unwrap().rsplit(':').next().unwrap().parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sdk = rt.block_on(Client::connect(&srv.rpc)).unwrap();
    let first = rt.block_on(sdk.put("mc-counter", "0")).unwrap();
    const WINS: usize = 150;
    let all = Arc::new(Mutex::new((Vec::new(), 0u64)));
    std::thread::scope(|s| {
        for i in 0..2 {
            let all = Arc::clone(&all);
            s.spawn(move || {
                let mut c = Text::connect(port);
                let (mut won, mut lost) = (Vec::new(), 0);
                while won.len() < WINS {
                    let (n, unique) = c.gets("mc-counter");
                    match c.cas("mc-counter", n + 1, unique).as_str() {
                        "STORED" => {
                            won.push(Win { who: format!("text{i}"), old_version: unique, new_version: 0, value: n + 1 })
                        }
                        "EXISTS" => lost += 1,
                        other => panic!("text{i}: cas answered {other:?}"),
                    }
                }
                let mut a = all.lock().unwrap();
                a.0.extend(won);
                a.1 += lost;
            });
        }
        // An SDK client races them on the same item: its versions are
        // the port's CAS uniques.
        let (won, lost) = rt.block_on(sdk_worker(sdk.clone(), "sdk".into(), "mc-counter", WINS));
        let mut a = all.lock().unwrap();
        a.0.extend(won);
        a.1 += lost;
    });
    let (wins, lost) = std::mem::take(&mut *all.lock().unwrap());
    let end = rt.block_on(sdk.get_versioned("mc-counter")).unwrap().unwrap();
    let final_value = std::str::from_utf8(&end.value).unwrap().parse().unwrap();
    check(&wins, first, end.version, final_value);
    // Also as memcached reports it: the last CAS unique is the version.
    let (n, unique) = Text::connect(port).gets("mc-counter");
    assert_eq!((n, unique), (final_value, end.version));
    println!("{} winning CASes ({} over the memcached port), {lost} lost", wins.len(), 2 * WINS);
}
