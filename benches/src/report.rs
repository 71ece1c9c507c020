//! Results of a run: per-operation statistics from HDR histograms, printed
//! as a table and written as JSON and CSV; and the comparison tables of
//! `docs/benchmarks.md`.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Largest latency recorded exactly; longer ones are recorded as this.
pub const MAX_LATENCY_NS: u64 = 60_000_000_000;
/// Significant decimal digits kept by the histograms.
pub const HISTOGRAM_DIGITS: u8 = 3;
/// Name of the row that covers every operation of a phase.
pub const ALL_OPS: &str = "ALL";
/// Label of a run YCSB itself could have made: one synchronous operation
/// per client thread and connection, YCSB's generators.
pub const YCSB_COMPARABLE: &str = "YCSB-comparable";
/// Ends the label of a run that YCSB could not have made.
pub const NOT_COMPARABLE: &str = "not YCSB-comparable";

/// A histogram of latencies in nanoseconds.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, HISTOGRAM_DIGITS).expect("valid histogram bounds")
}

/// Statistics of one operation type in one phase. Latencies are in
/// microseconds; failed operations are counted in `errors` only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpStats {
    pub op: String,
    pub count: u64,
    pub errors: u64,
    pub ops_per_sec: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl OpStats {
    /// Statistics of `h` (nanoseconds); `ops_per_sec` is given by the caller.
    pub fn from_histogram(op: &str, h: &Histogram<u64>, errors: u64, ops_per_sec: f64) -> OpStats {
        let us = |ns: u64| ns as f64 / 1000.0;
        let q = |q: f64| if h.is_empty() { 0.0 } else { us(h.value_at_quantile(q)) };
        OpStats {
            op: op.to_string(),
            count: h.len(),
            errors,
            ops_per_sec,
            mean_us: if h.is_empty() { 0.0 } else { h.mean() / 1000.0 },
            p50_us: q(0.5),
            p95_us: q(0.95),
            p99_us: q(0.99),
            p999_us: q(0.999),
            max_us: if h.is_empty() { 0.0 } else { us(h.max()) },
        }
    }
}

/// One phase (load or run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseStats {
    /// The measured wall window: from the first measured operation's
    /// (intended) start to the last one's reply, over all threads.
    pub seconds: f64,
    /// Operations measured (successful or not); a read-modify-write is one.
    pub operations: u64,
    /// `operations` over `seconds`.
    pub ops_per_sec: f64,
    /// Reads that found no value.
    pub not_found: u64,
    /// Reads whose value had the wrong length or key tag.
    pub bad_values: u64,
    /// The first failure seen, for the report.
    pub first_error: Option<String>,
    /// One row per operation type that ran, then [`ALL_OPS`]. Latency is
    /// service time: from sending the request (the key chosen, the value
    /// built) to the reply. The READ and UPDATE rows of workload F include
    /// the read and the update inside each read-modify-write, as YCSB
    /// counts them; [`ALL_OPS`] counts each read-modify-write once.
    pub ops: Vec<OpStats>,
    /// Open loop (`--target-rate`) only: the same rows with latency from
    /// each operation's intended start, so time spent behind the schedule
    /// counts (YCSB's "Intended-" measurements).
    #[serde(default)]
    pub intended: Vec<OpStats>,
}

impl PhaseStats {
    /// The row of `op`.
    pub fn op(&self, op: &str) -> Option<&OpStats> {
        self.ops.iter().find(|o| o.op == op)
    }

    /// Failed operations (a read-modify-write whose read failed is one).
    pub fn errors(&self) -> u64 {
        match self.op(ALL_OPS) {
            Some(all) => all.errors,
            None => self.ops.iter().map(|o| o.errors).sum(),
        }
    }
}

/// Everything about one invocation of the driver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub store: String,
    /// [`YCSB_COMPARABLE`], or why not, e.g. "pipelined, not
    /// YCSB-comparable" (see [`Report::comparability_label`]).
    #[serde(default)]
    pub comparability: String,
    pub server: String,
    pub workload: String,
    pub distribution: String,
    /// With the latest distribution: how its zipfian grew ("ycsb" or
    /// "corrected", see `EtaGrowth`).
    #[serde(default)]
    pub latest_eta: Option<String>,
    /// With the zipfian distribution: keys it draws from (the records, room
    /// for the inserts expected, and one more, as in YCSB).
    #[serde(default)]
    pub key_space: Option<u64>,
    pub records: u64,
    /// Bytes of a record.
    pub value_size: usize,
    /// Fields of a record (0 in reports from before the field model).
    #[serde(default)]
    pub fields: usize,
    /// Bytes an update writes: `value_size` (the whole record) or one
    /// field's (0 in reports from before the field model: the record).
    #[serde(default)]
    pub update_bytes: usize,
    pub threads: usize,
    pub in_flight: usize,
    pub target_rate: Option<f64>,
    pub seed: u64,
    /// dmkv only: read path and transport asked for.
    pub read_path: Option<String>,
    pub transport: Option<String>,
    pub load: Option<PhaseStats>,
    pub run: PhaseStats,
}

impl Report {
    /// "threads × in flight", the concurrency of the run.
    pub fn concurrency(&self) -> String {
        format!("{}×{}", self.threads, self.in_flight)
    }

    /// [`YCSB_COMPARABLE`] if YCSB could have made this run, else what
    /// differs followed by [`NOT_COMPARABLE`]: "pipelined" (more than one
    /// operation in flight per thread; YCSB's threads each wait for every
    /// reply), "corrected latest eta" (`--latest-eta corrected`).
    pub fn comparability_label(&self) -> String {
        let mut why = Vec::new();
        if self.in_flight > 1 {
            why.push("pipelined");
        }
        if self.latest_eta.as_deref() == Some("corrected") {
            why.push("corrected latest eta");
        }
        if why.is_empty() { YCSB_COMPARABLE.to_string() } else { format!("{}, {NOT_COMPARABLE}", why.join(", ")) }
    }

    /// Whether YCSB could have made this run.
    pub fn ycsb_comparable(&self) -> bool {
        self.comparability_label() == YCSB_COMPARABLE
    }

    /// The record layout and what an update writes, for reports.
    pub fn record_model(&self) -> String {
        let fields = match self.fields {
            0 => format!("{} B", self.value_size),
            n => format!("{n} fields × {} B", self.value_size / n),
        };
        if self.update_bytes == 0 || self.update_bytes == self.value_size {
            format!("records of {fields}; an update rewrites the whole record (YCSB writeallfields=true)")
        } else {
            format!(
                "records of {fields}; an update writes one {} B field, which replaces the record \
                 (YCSB's default writeallfields=false, as its memcached binding does it)",
                self.update_bytes
            )
        }
    }

    /// Failures of load and run together (errors, misses, bad values).
    pub fn failures(&self) -> u64 {
        let p = |s: &PhaseStats| s.errors();
        self.load.as_ref().map_or(0, p) + p(&self.run)
    }
}

fn table_rows(out: &mut String, phase: &PhaseStats) {
    let open_loop = !phase.intended.is_empty();
    if open_loop {
        let _ = writeln!(out, "  service time: from sending the request to its reply");
    }
    op_rows(out, &phase.ops);
    if open_loop {
        let _ = writeln!(out, "  latency from the intended start (open loop: includes waiting behind the schedule)");
        op_rows(out, &phase.intended);
    }
    if phase.not_found > 0 || phase.bad_values > 0 {
        let _ = writeln!(
            out,
            "  reads that found nothing: {}, reads with a bad value: {}",
            phase.not_found, phase.bad_values
        );
    }
    if let Some(e) = &phase.first_error {
        let _ = writeln!(out, "  first failure: {e}");
    }
}

fn op_rows(out: &mut String, ops: &[OpStats]) {
    let _ = writeln!(
        out,
        "  {:<18} {:>10} {:>7} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "op", "count", "errors", "ops/s", "mean µs", "p50 µs", "p95 µs", "p99 µs", "p99.9 µs", "max µs"
    );
    for o in ops {
        let _ = writeln!(
            out,
            "  {:<18} {:>10} {:>7} {:>11.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.1}",
            o.op, o.count, o.errors, o.ops_per_sec, o.mean_us, o.p50_us, o.p95_us, o.p99_us, o.p999_us, o.max_us
        );
    }
}

/// The human-readable table printed on stdout.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let path = r.read_path.as_deref().map(|p| format!(", path {p}")).unwrap_or_default();
    let rate = r.target_rate.map(|t| format!(", open loop at {t:.0} ops/s")).unwrap_or_default();
    let eta = r.latest_eta.as_deref().map(|e| format!(", {e} eta")).unwrap_or_default();
    let eta = eta + &r.key_space.map(|k| format!(" over {k} keys")).unwrap_or_default();
    let _ = writeln!(
        out,
        "dmkv-ycsb: workload {} ({}{eta}) on {} at {}{path}: {} threads × {} in flight ({}), {} records × {} B, seed {}{rate}",
        r.workload,
        r.distribution,
        r.store,
        r.server,
        r.threads,
        r.in_flight,
        r.comparability_label(),
        r.records,
        r.value_size,
        r.seed
    );
    let _ = writeln!(out, "{}", r.record_model());
    if let Some(l) = &r.load {
        let _ =
            writeln!(out, "load: {} inserts in {:.2} s (wall), {:.0} ops/s", l.operations, l.seconds, l.ops_per_sec);
        table_rows(&mut out, l);
    }
    let p = &r.run;
    let _ = writeln!(
        out,
        "run: {} operations in {:.2} s (wall), {:.0} ops/s{}",
        p.operations,
        p.seconds,
        p.ops_per_sec,
        if r.workload == "f" { "; READ and UPDATE include those inside READ-MODIFY-WRITE" } else { "" }
    );
    table_rows(&mut out, p);
    out
}

/// Header of the CSV file. `timing` is `service` (from sending the
/// request) or `intended` (open loop: from the intended start).
pub const CSV_HEADER: &str = "store,workload,distribution,threads,in_flight,comparability,records,value_size,\
     update_bytes,phase,op,timing,count,errors,ops_per_sec,mean_us,p50_us,p95_us,p99_us,p999_us,max_us";

/// `s` as one CSV field: quoted if it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

/// The CSV file: a header and one line per phase, operation type and timing.
pub fn csv(r: &Report) -> String {
    let mut out = String::from(CSV_HEADER);
    out.push('\n');
    let phases = r.load.iter().map(|l| ("load", l)).chain(std::iter::once(("run", &r.run)));
    for (name, p) in phases {
        let rows = p.ops.iter().map(|o| ("service", o)).chain(p.intended.iter().map(|o| ("intended", o)));
        for (timing, o) in rows {
            let _ = writeln!(
                out,
                "{},{},{},{},{},{},{},{},{},{name},{},{timing},{},{},{:.1},{:.2},{:.2},{:.2},{:.2},{:.2},{:.2}",
                csv_field(&r.store),
                r.workload,
                r.distribution,
                r.threads,
                r.in_flight,
                csv_field(&r.comparability_label()),
                r.records,
                r.value_size,
                r.update_bytes,
                o.op,
                o.count,
                o.errors,
                o.ops_per_sec,
                o.mean_us,
                o.p50_us,
                o.p95_us,
                o.p99_us,
                o.p999_us,
                o.max_us
            );
        }
    }
    out
}

/// Stores in the order tables and plots show them: dmkv's memcached port
/// beside memcached, the store speaking the same protocol.
pub const STORE_ORDER: [&str; 5] = ["dmkv", "dmkv-onesided", "memcached", "dmkv-memcached", "redis"];
/// dmkv's entries in reports: the RPC path, GETs over one-sided reads,
/// and the memcached protocol on dmkvd's second port.
pub const DMKV_STORES: [&str; 3] = ["dmkv", "dmkv-onesided", "dmkv-memcached"];

/// How a dmkv entry reaches dmkvd, for the target table.
fn dmkv_mode(store: &str) -> &'static str {
    match store {
        "dmkv" => "RPC",
        "dmkv-onesided" => "one-sided GETs",
        "dmkv-memcached" => "memcached protocol",
        _ => "other",
    }
}
/// Throughput dmkv's RPC path aims for, as a multiple of the better rival
/// (the target the README states).
pub const GOAL_RATIO: f64 = 1.5;

fn store_rank(s: &str) -> usize {
    STORE_ORDER.iter().position(|x| *x == s).unwrap_or(STORE_ORDER.len())
}

/// Repeated runs of one configuration, represented by the run of median
/// throughput (an actual run, so its latencies belong to it).
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub median: Report,
    /// Throughput of every run, ascending.
    pub runs: Vec<f64>,
}

/// Groups reports of the same store, workload, distribution, concurrency
/// and record model; sorted by workload, YCSB-comparable runs first, then
/// concurrency and store.
pub fn summarise(reports: &[Report]) -> Vec<Summary> {
    let key = |r: &Report| {
        (r.store.clone(), r.workload.clone(), r.distribution.clone(), r.threads, r.in_flight, r.comparability_label())
    };
    let same = |a: &Report, b: &Report| key(a) == key(b) && a.update_bytes == b.update_bytes;
    let mut groups: Vec<Vec<&Report>> = Vec::new();
    for r in reports {
        match groups.iter_mut().find(|g| same(g[0], r)) {
            Some(g) => g.push(r),
            None => groups.push(vec![r]),
        }
    }
    let mut out: Vec<Summary> = groups
        .into_iter()
        .map(|mut g| {
            g.sort_by(|a, b| a.run.ops_per_sec.total_cmp(&b.run.ops_per_sec));
            Summary { median: g[(g.len() - 1) / 2].clone(), runs: g.iter().map(|r| r.run.ops_per_sec).collect() }
        })
        .collect();
    out.sort_by_key(|s| {
        let r = &s.median;
        (r.workload.clone(), !r.ycsb_comparable(), r.threads * r.in_flight, r.threads, store_rank(&r.store))
    });
    out
}

fn us(o: Option<&OpStats>, f: impl Fn(&OpStats) -> f64) -> String {
    o.map_or("–".to_string(), |o| format!("{:.0}", f(o)))
}

/// Markdown: one table per workload, YCSB-comparable rows first and every
/// row labelled, then how dmkv compares with the better of the other
/// stores at each concurrency. Repeated runs are shown by their median (by
/// throughput) and the range of their throughputs.
pub fn markdown(reports: &[Report]) -> String {
    let mut out = String::new();
    let sums = summarise(reports);
    let rs: Vec<&Report> = sums.iter().map(|s| &s.median).collect();
    let runs = |r: &Report| {
        let s = sums.iter().find(|s| std::ptr::eq(&s.median, r)).expect("summary of its median");
        match s.runs.as_slice() {
            [_] => "1".to_string(),
            v => format!("{}: {:.0}–{:.0}", v.len(), v[0], v[v.len() - 1]),
        }
    };
    let mut models: Vec<String> = rs.iter().map(|r| r.record_model()).collect();
    models.sort();
    models.dedup();
    for m in models {
        let _ = writeln!(out, "Record model: {m}.\n");
    }
    let mut workloads: Vec<&str> = rs.iter().map(|r| r.workload.as_str()).collect();
    workloads.dedup();
    for w in &workloads {
        let _ = writeln!(out, "### Workload {}\n", w.to_uppercase());
        let _ = writeln!(
            out,
            "| store | threads × in flight | mode | ops/s | runs: ops/s range | READ p50 µs | READ p99 µs | UPDATE p50 µs | UPDATE p99 µs | all p99.9 µs | all max µs | failures |"
        );
        let _ = writeln!(out, "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in rs.iter().filter(|r| r.workload == *w) {
            let (read, update, all) = (r.run.op("READ"), r.run.op("UPDATE"), r.run.op(ALL_OPS));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.store,
                r.concurrency(),
                r.comparability_label(),
                r.run.ops_per_sec,
                runs(r),
                us(read, |o| o.p50_us),
                us(read, |o| o.p99_us),
                us(update, |o| o.p50_us),
                us(update, |o| o.p99_us),
                us(all, |o| o.p999_us),
                us(all, |o| o.max_us),
                r.run.errors()
            );
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "### dmkv against its target ({GOAL_RATIO}× the throughput of the better of memcached and Redis)\n"
    );
    let _ = writeln!(
        out,
        "| workload | threads × in flight | mode | dmkv | dmkv ops/s | best rival | rival ops/s | ratio | target met |"
    );
    let _ = writeln!(out, "|---|---|---|---|---:|---|---:|---:|---|");
    for w in &workloads {
        let mut configs: Vec<(usize, usize)> =
            rs.iter().filter(|r| r.workload == *w).map(|r| (r.threads, r.in_flight)).collect();
        configs.dedup();
        for (t, f) in configs {
            let at = |store: &str| {
                rs.iter().find(|r| r.workload == *w && r.threads == t && r.in_flight == f && r.store == store)
            };
            let rival = ["memcached", "redis"]
                .iter()
                .filter_map(|s| at(s))
                .max_by(|a, b| a.run.ops_per_sec.total_cmp(&b.run.ops_per_sec));
            let Some(rv) = rival else { continue };
            for d in DMKV_STORES.iter().filter_map(|s| at(s)) {
                let ratio = d.run.ops_per_sec / rv.run.ops_per_sec;
                let _ = writeln!(
                    out,
                    "| {} | {}×{} | {} | {} | {:.0} | {} | {:.0} | {:.2}× | {} |",
                    w.to_uppercase(),
                    t,
                    f,
                    d.comparability_label(),
                    dmkv_mode(&d.store),
                    d.run.ops_per_sec,
                    rv.store,
                    rv.run.ops_per_sec,
                    ratio,
                    if ratio >= GOAL_RATIO { "yes" } else { "no" }
                );
            }
        }
    }
    out
}

/// A report of one run whose READ and ALL rows are `h`, for tests.
#[cfg(test)]
pub(crate) fn test_report(
    store: &str,
    workload: &str,
    threads: usize,
    in_flight: usize,
    rate: f64,
    h: &Histogram<u64>,
) -> Report {
    Report {
        store: store.into(),
        comparability: String::new(),
        server: "x".into(),
        workload: workload.into(),
        distribution: "zipfian".into(),
        latest_eta: None,
        key_space: Some(11),
        records: 10,
        value_size: 100,
        fields: 10,
        update_bytes: 100,
        threads,
        in_flight,
        target_rate: None,
        seed: 1,
        read_path: None,
        transport: None,
        load: None,
        run: PhaseStats {
            seconds: 1.0,
            operations: h.len(),
            ops_per_sec: rate,
            not_found: 0,
            bad_values: 0,
            first_error: None,
            ops: vec![OpStats::from_histogram("READ", h, 0, rate), OpStats::from_histogram(ALL_OPS, h, 0, rate)],
            intended: Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(store: &str, workload: &str, threads: usize, in_flight: usize, rate: f64) -> Report {
        let mut h = new_histogram();
        for v in 1..=1000u64 {
            h.record(v * 1000).unwrap();
        }
        test_report(store, workload, threads, in_flight, rate, &h)
    }

    #[test]
    fn percentiles_come_from_the_histogram() {
        let r = report("dmkv", "a", 1, 1, 10.0);
        let o = r.run.op("READ").unwrap();
        assert_eq!(o.count, 1000);
        assert!((o.p50_us - 500.0).abs() < 1.0, "{}", o.p50_us);
        assert!((o.p99_us - 990.0).abs() < 1.0, "{}", o.p99_us);
        assert!((o.max_us - 1000.0).abs() < 1.0, "{}", o.max_us);
        assert!((o.mean_us - 500.5).abs() < 1.0, "{}", o.mean_us);
    }

    #[test]
    fn csv_and_json_carry_every_row() {
        let r = report("redis", "b", 2, 16, 1234.0);
        let c = csv(&r);
        assert_eq!(c.lines().count(), 3);
        let row = "redis,b,zipfian,2,16,\"pipelined, not YCSB-comparable\",10,100,100,run,READ,service,1000,0,1234.0,";
        assert!(c.lines().nth(1).unwrap().starts_with(row), "{c}");
        let ycsb = csv(&report("redis", "b", 2, 1, 1.0));
        assert!(ycsb.lines().nth(1).unwrap().starts_with("redis,b,zipfian,2,1,YCSB-comparable,10,"), "{ycsb}");
        assert!(table(&r).contains("2 threads × 16 in flight (pipelined, not YCSB-comparable)"));
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert!(table(&r).contains("READ"));
    }

    #[test]
    fn repeated_runs_are_shown_by_their_median() {
        let rs = vec![
            report("dmkv", "c", 1, 1, 300.0),
            report("dmkv", "c", 1, 1, 100.0),
            report("redis", "c", 1, 1, 50.0),
            report("dmkv", "c", 1, 1, 200.0),
        ];
        let s = summarise(&rs);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].median.store, "dmkv");
        assert_eq!(s[0].median.run.ops_per_sec, 200.0);
        assert_eq!(s[0].runs, vec![100.0, 200.0, 300.0]);
        let md = markdown(&rs);
        assert!(md.contains("| dmkv | 1×1 | YCSB-comparable | 200 | 3: 100–300 |"), "{md}");
        assert!(md.contains("| C | 1×1 | YCSB-comparable | RPC | 200 | redis | 50 | 4.00× | yes |"), "{md}");
    }

    #[test]
    fn markdown_compares_dmkv_with_the_better_rival() {
        let rs = vec![
            report("redis", "a", 1, 1, 100.0),
            report("dmkv", "a", 1, 1, 330.0),
            report("memcached", "a", 1, 1, 200.0),
            report("dmkv", "a", 2, 16, 100.0),
            report("dmkv-onesided", "a", 2, 16, 600.0),
            report("memcached", "a", 2, 16, 300.0),
        ];
        let md = markdown(&rs);
        assert!(md.contains("| A | 1×1 | YCSB-comparable | RPC | 330 | memcached | 200 | 1.65× | yes |"), "{md}");
        let pipelined = "| A | 2×16 | pipelined, not YCSB-comparable |";
        assert!(md.contains(&format!("{pipelined} RPC | 100 | memcached | 300 | 0.33× | no |")), "{md}");
        assert!(md.contains(&format!("{pipelined} one-sided GETs | 600 | memcached | 300 | 2.00× | yes |")), "{md}");
        assert!(md.contains("| dmkv | 1×1 | YCSB-comparable | 330 | 1 |"), "{md}");
        assert!(
            md.starts_with("Record model: records of 10 fields × 10 B; an update rewrites the whole record"),
            "{md}"
        );
        let dmkv_row = md.find("| dmkv | 1×1").unwrap();
        let redis_row = md.find("| redis | 1×1").unwrap();
        assert!(dmkv_row < redis_row);
    }

    #[test]
    fn dmkvs_memcached_port_sits_beside_memcached() {
        let rs = vec![
            report("redis", "a", 1, 1, 100.0),
            report("dmkv-memcached", "a", 1, 1, 250.0),
            report("dmkv", "a", 1, 1, 330.0),
            report("memcached", "a", 1, 1, 200.0),
        ];
        let md = markdown(&rs);
        let at = |row: &str| md.find(row).unwrap_or_else(|| panic!("{row} missing: {md}"));
        assert!(at("| memcached | 1×1") < at("| dmkv-memcached | 1×1"), "{md}");
        assert!(at("| dmkv-memcached | 1×1") < at("| redis | 1×1"), "{md}");
        // A dmkv entry with its own mode, never a rival.
        assert!(
            md.contains("| A | 1×1 | YCSB-comparable | memcached protocol | 250 | memcached | 200 | 1.25× | no |"),
            "{md}"
        );
        assert!(!md.contains("| dmkv-memcached | 250 | 1."), "{md}");
    }

    #[test]
    fn ycsb_comparable_rows_come_first() {
        // 32×1 keeps as many operations outstanding as 2×16, and sorts
        // after it by threads, but it is YCSB's way: it comes first.
        let rs =
            vec![report("dmkv", "a", 2, 16, 500.0), report("dmkv", "a", 32, 1, 400.0), report("dmkv", "a", 1, 1, 9.0)];
        let md = markdown(&rs);
        let at = |row: &str| md.find(row).unwrap_or_else(|| panic!("{row} missing: {md}"));
        assert!(at("| dmkv | 1×1 | YCSB-comparable |") < at("| dmkv | 32×1 | YCSB-comparable |"), "{md}");
        assert!(
            at("| dmkv | 32×1 | YCSB-comparable |") < at("| dmkv | 2×16 | pipelined, not YCSB-comparable |"),
            "{md}"
        );
        let mut d = report("dmkv", "d", 1, 1, 1.0);
        d.latest_eta = Some("corrected".into());
        assert_eq!(d.comparability_label(), "corrected latest eta, not YCSB-comparable");
        d.in_flight = 4;
        assert_eq!(d.comparability_label(), "pipelined, corrected latest eta, not YCSB-comparable");
    }
}
