//! The arithmetic of `dmkv top`: rows of rates, quantiles and gauges from
//! two STATS snapshots of a node taken some time apart. Pure (no sockets,
//! no clock), so it is tested on hand-made snapshots; the CLI does the
//! polling and the drawing.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

/// A node's STATS answer.
pub type Snapshot = HashMap<String, u64>;

/// Operations with latency histograms in STATS, in column order.
pub const OPS: [&str; 4] = ["get", "put", "delete", "multi_get"];

/// The store's counter of each op, for servers without request histograms.
/// It is only a stand-in: `puts` also counts a follower's applies and
/// snapshot restores, `deletes` only deletes of present keys, and `gets`
/// each key of a multi-get, so a histogram's count comes first.
fn op_counter(op: &str) -> Option<&'static str> {
    match op {
        "get" => Some("gets"),
        "put" => Some("puts"),
        "delete" => Some("deletes"),
        _ => None,
    }
}

/// What `dmkv top` shows of one node over one interval.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// How the node is named on screen (its id, or its address).
    pub node: String,
    /// Requests per second of each op of [`OPS`], when the node counts it.
    pub rates: [Option<f64>; 4],
    /// Median and 99th percentile latency of each op of [`OPS`], in µs,
    /// when the node has latency histograms and the op ran this interval.
    pub p50_us: [Option<f64>; 4],
    pub p99_us: [Option<f64>; 4],
    /// Hits per GET this interval (`None` without GETs).
    pub hit_ratio: Option<f64>,
    /// Bytes of the region allocated to items and free now.
    pub used_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// Items stored now.
    pub items: Option<u64>,
    /// Reads the server's one-sided engine served per second (one-sided
    /// GETs over TCP; shared-memory and RDMA reads do not reach the
    /// server at all).
    pub engine_reads: Option<f64>,
    /// The largest replication lag, in log entries, of the shards this
    /// node leads (cluster nodes only).
    pub lag: Option<u64>,
}

/// How much a counter grew between two snapshots. A counter that went
/// down belongs to a restarted server: it grew from zero (and [`row`]
/// then treats every counter of the node so, see [`restarted`]).
fn delta(before: &Snapshot, after: &Snapshot, key: &str) -> Option<u64> {
    let a = *after.get(key)?;
    let b = before.get(key).copied().unwrap_or(0);
    Some(if a >= b { a - b } else { a })
}

/// Whether the node restarted between the snapshots: a counter that only
/// grows went down. Decided once per node, so that counters read as a
/// set (hits of gets, buckets of a histogram) all restart from zero,
/// not just those that happened to shrink.
fn restarted(before: &Snapshot, after: &Snapshot) -> bool {
    let monotonic = |k: &str| k.starts_with("latency_us_") || k.starts_with("requests_");
    ["gets", "get_hits", "puts", "deletes"]
        .into_iter()
        .map(str::to_string)
        .chain(after.keys().filter(|k| monotonic(k)).cloned())
        .any(|k| matches!((before.get(&k), after.get(&k)), (Some(b), Some(a)) if a < b))
}

/// The `q` quantile (0..=1) of `op`'s latency over the interval, in µs,
/// from the growth of its cumulative buckets (`latency_us_<op>_le_<bound>`
/// and `_le_inf`), interpolated linearly inside the bucket it falls in
/// (the first bucket starts at 0). A quantile in the open-ended bucket is
/// the largest finite bound, as Prometheus's `histogram_quantile` says.
/// `None` when the node has no histogram for `op` or nothing was counted.
pub fn quantile(before: &Snapshot, after: &Snapshot, op: &str, q: f64) -> Option<f64> {
    let prefix = format!("latency_us_{op}_le_");
    let mut buckets: Vec<(u64, u64)> = after
        .keys()
        .filter_map(|k| k.strip_prefix(&prefix)?.parse::<u64>().ok())
        .filter_map(|bound| Some((bound, delta(before, after, &format!("{prefix}{bound}"))?)))
        .collect();
    buckets.sort_unstable();
    let total = delta(before, after, &format!("{prefix}inf"))?;
    if total == 0 || buckets.is_empty() {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let (mut lower, mut below) = (0u64, 0u64);
    for (bound, cum) in buckets {
        // Cumulative counts never shrink with the bound; a snapshot torn
        // between two counter reads could say so, and is clamped.
        let cum = cum.max(below);
        if cum as f64 >= rank && cum > below {
            let within = (rank - below as f64) / (cum - below) as f64;
            return Some(lower as f64 + (bound - lower) as f64 * within.clamp(0.0, 1.0));
        }
        (lower, below) = (bound, cum);
    }
    Some(lower as f64)
}

/// The row of node `node` from snapshots `before` and `after`, taken
/// `elapsed` apart; `lag` is what the node's cluster status reports.
pub fn row(node: &str, before: &Snapshot, after: &Snapshot, elapsed: Duration, lag: Option<u64>) -> Row {
    let empty = Snapshot::new();
    let before = if restarted(before, after) { &empty } else { before };
    let secs = elapsed.as_secs_f64().max(1e-9);
    let rate = |key: &str| delta(before, after, key).map(|d| d as f64 / secs);
    let each = |f: &dyn Fn(&str) -> Option<f64>| [f(OPS[0]), f(OPS[1]), f(OPS[2]), f(OPS[3])];
    let rates = each(&|op| rate(&format!("latency_us_{op}_count")).or_else(|| rate(op_counter(op)?)));
    let hit_ratio = match (delta(before, after, "gets"), delta(before, after, "get_hits")) {
        (Some(gets), Some(hits)) if gets > 0 => Some(hits.min(gets) as f64 / gets as f64),
        _ => None,
    };
    Row {
        node: node.to_string(),
        rates,
        p50_us: each(&|op| quantile(before, after, op, 0.5)),
        p99_us: each(&|op| quantile(before, after, op, 0.99)),
        hit_ratio,
        used_bytes: after.get("allocated_bytes").copied(),
        free_bytes: after.get("free_bytes").copied(),
        items: after.get("items").copied(),
        engine_reads: rate("engine_reads"),
        lag,
    }
}

fn or_dash<T>(v: Option<T>, f: impl FnOnce(T) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

/// A rate, shortened past 10k (`12.3k/s` style, without the unit).
fn rate(v: f64) -> String {
    if v >= 10_000.0 { format!("{:.1}k", v / 1000.0) } else { format!("{v:.0}") }
}

/// A byte count in binary units.
pub fn bytes(v: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = v as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{v}B") } else { format!("{x:.1}{}", UNITS[u]) }
}

/// A latency in µs, shortened past 10 ms.
fn micros(v: f64) -> String {
    if v >= 10_000.0 { format!("{:.1}ms", v / 1000.0) } else { format!("{v:.0}") }
}

/// The column heads, in the order [`render`] writes them.
pub const COLUMNS: [&str; 15] = [
    "NODE", "GET/s", "PUT/s", "DEL/s", "MGET/s", "GET_P50", "GET_P99", "PUT_P50", "PUT_P99", "HIT%", "USED", "FREE",
    "ITEMS", "ENGINE/s", "LAG",
];

/// `rows` as a table, one line per node under a line of [`COLUMNS`];
/// latencies in µs, `-` where a node does not say.
pub fn render(rows: &[Row]) -> String {
    // The node column fits the longest name (an address, off a cluster).
    let first = rows.iter().map(|r| r.node.len()).max().unwrap_or(0).max(4);
    let widths = [first, 9, 9, 8, 8, 8, 8, 8, 8, 6, 10, 10, 10, 9, 6];
    debug_assert_eq!(widths.len(), COLUMNS.len());
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
            if i == 0 {
                let _ = write!(out, "{c:<w$}");
            } else {
                let _ = write!(out, " {c:>w$}");
            }
        }
        out.push('\n');
    };
    line(&COLUMNS.map(String::from));
    for r in rows {
        let cells = [
            r.node.clone(),
            or_dash(r.rates[0], rate),
            or_dash(r.rates[1], rate),
            or_dash(r.rates[2], rate),
            or_dash(r.rates[3], rate),
            or_dash(r.p50_us[0], micros),
            or_dash(r.p99_us[0], micros),
            or_dash(r.p50_us[1], micros),
            or_dash(r.p99_us[1], micros),
            or_dash(r.hit_ratio, |h| format!("{:.1}", h * 100.0)),
            or_dash(r.used_bytes, bytes),
            or_dash(r.free_bytes, bytes),
            or_dash(r.items, |i| i.to_string()),
            or_dash(r.engine_reads, rate),
            or_dash(r.lag, |l| l.to_string()),
        ];
        line(&cells);
    }
    out
}

/// Parses an interval such as `1s`, `200ms`, `2m` or a bare number of
/// seconds; zero is refused (it would spin).
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad interval {s:?}: expected e.g. 1s, 200ms or 2m"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        _ => return Err(format!("bad interval {s:?}: units are ms, s and m")),
    };
    if !(0.001..=86_400.0).contains(&secs) {
        return Err(format!("bad interval {s:?}: between 1ms and a day"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `got` is `want` within float rounding.
    fn near(got: Option<f64>, want: f64) -> bool {
        got.is_some_and(|g| (g - want).abs() < 1e-9)
    }

    fn snap(pairs: &[(&str, u64)]) -> Snapshot {
        pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
    }

    /// A get histogram with cumulative counts `cum` at bounds 10, 20,
    /// 40, ... and `inf` in all.
    fn hist(cum: &[u64], inf: u64) -> Snapshot {
        let mut s: Snapshot =
            cum.iter().enumerate().map(|(i, &c)| (format!("latency_us_get_le_{}", 10u64 << i), c)).collect();
        s.insert("latency_us_get_le_inf".into(), inf);
        s.insert("latency_us_get_count".into(), inf);
        s
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        let before = Snapshot::new();
        // 100 requests: 50 at <=10us, 30 in (10,20], 20 in (20,40].
        let after = hist(&[50, 80, 100, 100], 100);
        // The 50th of 100 is the last of the first bucket: its top.
        assert!(near(quantile(&before, &after, "get", 0.5), 10.0));
        // The 25th is half way through the first bucket, from 0.
        assert!(near(quantile(&before, &after, "get", 0.25), 5.0));
        // The 65th is half way through (10,20].
        assert!(near(quantile(&before, &after, "get", 0.65), 15.0));
        // The 99th: 19 of the 20 in (20,40] -> 20 + 20*19/20.
        assert!(near(quantile(&before, &after, "get", 0.99), 39.0));
        assert!(near(quantile(&before, &after, "get", 1.0), 40.0));
    }

    #[test]
    fn quantiles_use_only_the_interval() {
        // Before: 1000 slow requests (all in (20,40]); this interval: 10
        // fast ones, all under 10us.
        let before = hist(&[0, 0, 1000, 1000], 1000);
        let after = hist(&[10, 10, 1010, 1010], 1010);
        assert!(near(quantile(&before, &after, "get", 0.99), 9.9));
        // Nothing this interval, or no histogram at all: no quantile.
        assert_eq!(quantile(&after, &after, "get", 0.5), None);
        assert_eq!(quantile(&before, &after, "put", 0.5), None);
        assert_eq!(quantile(&Snapshot::new(), &snap(&[("gets", 5)]), "get", 0.5), None);
    }

    #[test]
    fn a_quantile_past_the_last_bound_is_that_bound() {
        let after = hist(&[1, 2], 10);
        assert!(near(quantile(&Snapshot::new(), &after, "get", 0.99), 20.0));
    }

    #[test]
    fn a_torn_snapshot_does_not_make_quantiles_go_backwards() {
        // A bucket read before its neighbour grew: 5 then 4 cumulative.
        let after = hist(&[5, 4, 10], 10);
        let q = quantile(&Snapshot::new(), &after, "get", 0.7).unwrap();
        assert!((20.0..=40.0).contains(&q), "{q}");
    }

    #[test]
    fn rows_have_rates_ratios_and_gauges() {
        let before = snap(&[("gets", 100), ("get_hits", 50), ("puts", 10), ("deletes", 0), ("engine_reads", 0)]);
        let mut after = snap(&[
            ("gets", 300),
            ("get_hits", 200),
            ("puts", 410),
            ("deletes", 4),
            ("engine_reads", 1000),
            ("items", 7),
            ("allocated_bytes", 2048),
            ("free_bytes", 3 << 20),
        ]);
        let r = row("n1", &before, &after, Duration::from_millis(500), Some(3));
        assert_eq!(r.rates, [Some(400.0), Some(800.0), Some(8.0), None]);
        assert_eq!(r.hit_ratio, Some(0.75));
        assert_eq!(r.engine_reads, Some(2000.0));
        assert_eq!((r.items, r.used_bytes, r.free_bytes, r.lag), (Some(7), Some(2048), Some(3 << 20), Some(3)));
        assert_eq!(r.p50_us, [None; 4]);
        let text = render(&[r]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), COLUMNS);
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            ["n1", "400", "800", "8", "-", "-", "-", "-", "-", "75.0", "2.0KiB", "3.0MiB", "7", "2000", "3"]
        );
        // A restarted server's counters start again from zero.
        after.insert("puts".into(), 5);
        assert_eq!(row("n1", &before, &after, Duration::from_secs(1), None).rates[1], Some(5.0));
    }

    #[test]
    fn multi_get_rate_comes_from_its_histogram() {
        let before = snap(&[("latency_us_multi_get_count", 10)]);
        let after = snap(&[("latency_us_multi_get_count", 30)]);
        assert_eq!(row("n", &before, &after, Duration::from_secs(2), None).rates[3], Some(10.0));
    }

    #[test]
    fn intervals_parse() {
        assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_interval("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_interval("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_interval("1m"), Ok(Duration::from_secs(60)));
        for bad in ["", "0s", "s", "1h", "-1s", "1e9", "1..2s"] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rates_prefer_request_counts_and_restart_as_a_whole() {
        let snap = |pairs: &[(&str, u64)]| -> Snapshot { pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect() };
        let second = Duration::from_secs(1);
        // The store's `puts` also counts a follower's applies: requests
        // come from the histogram's count where the server has one.
        let before = snap(&[("puts", 0), ("latency_us_put_count", 0)]);
        let after = snap(&[("puts", 1000), ("latency_us_put_count", 10)]);
        assert_eq!(row("n", &before, &after, second, None).rates[1], Some(10.0));
        assert_eq!(row("n", &snap(&[("puts", 0)]), &snap(&[("puts", 7)]), second, None).rates[1], Some(7.0));
        // A restart: `gets` went down, so every counter restarted, even
        // the put count that happens to be larger than before.
        let before = snap(&[("gets", 500), ("latency_us_put_count", 1000)]);
        let after = snap(&[("gets", 100), ("latency_us_put_count", 1200)]);
        assert_eq!(row("n", &before, &after, second, None).rates[1], Some(1200.0));
    }
}
