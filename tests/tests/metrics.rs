//! dmkvd's operating surface against real processes (docs/operations.md):
//! `/metrics` (checked by promtool, counters by exact amounts), the STATS
//! keys beside it, `/healthz` and `/readyz` (one node and a cluster), JSON
//! logs, and sd_notify readiness.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dmkv_client::{Client, ClientConfig, ReadPath, Token};
use dmkv_tests::cluster::TestCluster;
use dmkv_tests::prom::{promtool_check, samples};
use dmkv_tests::{ServerProcess, TempDir, find_bin, wait_until};

/// A plain HTTP/1.1 GET: (status, body). The server closes after one
/// request, so the body is whatever follows the head.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    dmkv_tests::prom::http_get(addr, path).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

fn sample(all: &HashMap<String, f64>, series: &str) -> f64 {
    *all.get(series).unwrap_or_else(|| panic!("no series {series} in the scrape"))
}

fn rpc_only() -> ClientConfig {
    // Every GET through the server, so that the server counts it.
    ClientConfig::default().read_path(ReadPath::Rpc).pool_size(1)
}

#[tokio::test]
async fn metrics_count_traffic_exactly_and_pass_promtool() {
    let srv = ServerProcess::start(&["--memory", "16MiB", "--metrics-listen", "127.0.0.1:0"]);
    let addr = srv.endpoint("metrics").expect("metrics= in the listening line").to_string();
    assert_eq!(http_get(&addr, "/healthz"), (200, "ok\n".into()));
    assert_eq!(http_get(&addr, "/readyz").0, 200);
    assert_eq!(http_get(&addr, "/nothing").0, 404);

    let c = Client::connect_with(&srv.rpc, rpc_only()).await.unwrap();
    let before = samples(&http_get(&addr, "/metrics").1);
    let stats_before = c.stats().await.unwrap();
    const PUTS: usize = 7;
    for i in 0..PUTS {
        c.put(format!("k{i}"), "v").await.unwrap();
    }
    for i in 0..3 {
        assert!(c.get(format!("k{i}")).await.unwrap().is_some());
    }
    for i in 0..2 {
        assert!(c.get(format!("missing{i}")).await.unwrap().is_none());
    }
    assert!(!c.delete("missing").await.unwrap());
    let stats_after = c.stats().await.unwrap();
    let text = http_get(&addr, "/metrics").1;
    promtool_check("metrics_count_traffic_exactly_and_pass_promtool", &text);
    let after = samples(&text);

    let delta = |series: &str| sample(&after, series) - before.get(series).copied().unwrap_or(0.0);
    assert_eq!(delta(r#"dmkv_requests_total{op="put",result="ok"}"#), PUTS as f64);
    assert_eq!(delta(r#"dmkv_requests_total{op="get",result="ok"}"#), 3.0);
    assert_eq!(delta(r#"dmkv_requests_total{op="get",result="not_found"}"#), 2.0);
    assert_eq!(delta(r#"dmkv_requests_total{op="delete",result="not_found"}"#), 1.0);
    assert_eq!(delta(r#"dmkv_request_duration_seconds_count{op="put"}"#), PUTS as f64);
    assert_eq!(delta(r#"dmkv_request_duration_seconds_bucket{op="get",le="+Inf"}"#), 5.0);
    assert!(delta(r#"dmkv_received_bytes_total{listener="rpc"}"#) > 0.0);
    assert!(delta(r#"dmkv_sent_bytes_total{listener="rpc"}"#) > 0.0);
    assert!(sample(&after, r#"dmkv_connections{listener="rpc"}"#) >= 1.0);
    assert!(sample(&after, r#"dmkv_connections_accepted_total{listener="rpc"}"#) >= 1.0);
    // This scrape's own connection is open while it is encoded.
    assert_eq!(sample(&after, r#"dmkv_connections{listener="metrics"}"#), 1.0);
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(sample(&after, &format!(r#"dmkv_build_info{{version="{version}"}}"#)), 1.0);
    assert_eq!(delta("dmkv_items"), PUTS as f64);
    assert_eq!(sample(&after, "dmkv_region_size_bytes"), (16u64 << 20) as f64);
    assert!(sample(&after, "dmkv_region_used_bytes") > 0.0);
    assert_eq!(sample(&after, "dmkv_region_registrations_total"), 1.0);
    for absent in ["dmkv_shard_leader", "dmkv_raft_log_bytes"] {
        assert!(!text.contains(absent), "{absent} on a single node");
    }

    // The same counts through STATS, for `dmkv top`; the STATS request
    // that reads them is counted once it is answered.
    let stat = |m: &HashMap<String, u64>, k: &str| *m.get(k).unwrap_or_else(|| panic!("no STATS key {k}"));
    let sd = |k: &str| stat(&stats_after, k) - stat(&stats_before, k);
    assert_eq!(sd("requests_put_ok"), PUTS as u64);
    assert_eq!(sd("requests_get_not_found"), 2);
    assert_eq!(sd("latency_us_put_count"), PUTS as u64);
    assert_eq!(stat(&stats_after, "latency_us_put_le_inf"), stat(&stats_after, "latency_us_put_count"));
    let mut last = 0;
    for i in 0..20 {
        let v = stat(&stats_after, &format!("latency_us_put_le_{}", 10u64 << i));
        assert!(v >= last, "buckets are cumulative");
        last = v;
    }
    assert!(stats_after.contains_key("latency_us_put_sum"));
    assert!(stats_after.contains_key("gets"), "existing keys stay");
}

#[test]
fn cluster_nodes_are_ready_once_leaders_are_known_with_one_leader_per_shard() {
    const SHARDS: u32 = 3;
    let c = TestCluster::start(3, SHARDS, 3, false, &["--metrics-listen", "127.0.0.1:0"]);
    let addrs: Vec<String> = (0..3).map(|i| c.endpoint(i, "metrics").expect("metrics=").to_string()).collect();
    for (i, a) in addrs.iter().enumerate() {
        assert!(
            wait_until(Duration::from_secs(20), || http_get(a, "/readyz").0 == 200),
            "node {} not ready: {:?}\n{}",
            i + 1,
            http_get(a, "/readyz"),
            c.log(i)
        );
    }
    let one_leader_each = || {
        let scrapes: Vec<_> = addrs.iter().map(|a| samples(&http_get(a, "/metrics").1)).collect();
        (0..SHARDS).all(|s| {
            let series = format!(r#"dmkv_shard_leader{{shard="{s}"}}"#);
            scrapes.iter().map(|m| m.get(&series).copied().unwrap_or(0.0)).sum::<f64>() == 1.0
        })
    };
    assert!(wait_until(Duration::from_secs(20), one_leader_each), "not one leader per shard");
    let text = http_get(&addrs[0], "/metrics").1;
    promtool_check("cluster_nodes_are_ready_once_leaders_are_known_with_one_leader_per_shard", &text);
    let m = samples(&text);
    for s in 0..SHARDS {
        for family in ["dmkv_shard_raft_term", "dmkv_shard_commit_index", "dmkv_shard_applied_index"] {
            assert!(sample(&m, &format!(r#"{family}{{shard="{s}"}}"#)) >= 1.0, "{family} shard {s}");
        }
        assert!(sample(&m, &format!(r#"dmkv_shard_leader_changes_total{{shard="{s}"}}"#)) >= 1.0);
    }
    // The leaders report their followers' lag.
    let lags: usize =
        addrs.iter().map(|a| http_get(a, "/metrics").1.matches("dmkv_shard_follower_lag_entries{").count()).sum();
    assert!(lags >= 2 * SHARDS as usize, "{lags} follower lag series");
}

#[tokio::test]
async fn json_logs_parse_and_a_failed_authentication_names_peer_and_code() {
    let dir = TempDir::new("json");
    let auth = dir.0.join("auth");
    std::fs::write(&auth, "data data-token-0123456789abcdef\n").unwrap();
    let log = dir.0.join("log");
    let args = ["--memory", "16MiB", "--auth-file", auth.to_str().unwrap(), "--log-format", "json"];
    let file = std::fs::File::create(&log).unwrap();
    let srv = ServerProcess::start_logged(&[], "127.0.0.1:0", &args, Some(file)).unwrap();
    let wrong = rpc_only().token(Some(Arc::new(Token::new("wrong-token-0123456789abcdef").unwrap())));
    assert!(Client::connect_with(&srv.rpc, wrong).await.is_err());
    let found = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&log).unwrap_or_default().contains("unauthenticated")
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(found, "no authentication failure logged:\n{text}");
    let lines: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    let failure = lines.iter().find(|v| v["code"] == "unauthenticated").expect("the failure line");
    assert_eq!(failure["level"], "WARN");
    assert_eq!(failure["peer"], "127.0.0.1", "{failure}");
    assert!(failure["message"].is_string() && failure["timestamp"].is_string(), "{failure}");
}

#[test]
fn sd_notify_says_ready_once_serving_and_stopping_at_shutdown() {
    use std::os::unix::net::UnixDatagram;
    let dir = TempDir::new("notify");
    let path = dir.0.join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut child = Command::new(find_bin("dmkvd").unwrap())
        .args(["--listen", "127.0.0.1:0", "--memory", "16MiB", "--log", "warn"])
        .env("NOTIFY_SOCKET", &path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf);
    let ready = n.as_ref().map(|&n| String::from_utf8_lossy(&buf[..n]).to_string());
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let stopping = sock.recv(&mut buf).map(|n| String::from_utf8_lossy(&buf[..n]).to_string());
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(ready.unwrap().trim(), "READY=1");
    assert_eq!(stopping.unwrap().trim(), "STOPPING=1");
}

/// Requests answered in line are counted per batch (one clock read for the
/// batch): every one of them, before a STATS later in the same batch, and
/// when the connection ends on a bad frame right after them.
#[test]
fn requests_of_one_batch_are_all_counted_before_a_stats_and_at_a_close() {
    use bytes::BytesMut;
    use dmkv_common::frame::{self, Decoder};
    use dmkv_common::proto::{self, Request, Response, request::Op, response::Result as R};
    use std::io::{Read, Write};

    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    const GETS: u64 = 1000;
    let get =
        |id: u64| Request { id, op: Some(Op::Get(proto::Get { key: format!("absent{id}").into_bytes().into() })) };
    let stats = |id: u64| Request { id, op: Some(Op::Stats(proto::Stats::default())) };
    // Sends `reqs` in one write, then `tail` raw; reads replies until the
    // one with id `until` (or the end); returns its STATS counters.
    let exchange = |reqs: &[Request], tail: &[u8], until: Option<u64>| -> Option<HashMap<String, u64>> {
        let mut s = std::net::TcpStream::connect(&srv.rpc).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut out = BytesMut::new();
        for r in reqs {
            frame::encode(r, 1 << 20, &mut out).unwrap();
        }
        out.extend_from_slice(tail);
        s.write_all(&out).unwrap();
        let until = until?;
        let (dec, mut buf, mut chunk) = (Decoder::new(16 << 20), BytesMut::new(), vec![0u8; 64 << 10]);
        loop {
            while let Some(resp) = dec.next_message::<Response>(&mut buf).unwrap() {
                if let (true, Some(R::Stats(st))) = (resp.id == until, resp.result) {
                    return Some(st.counters);
                }
            }
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "closed before the STATS reply");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    let not_found = |m: &HashMap<String, u64>| m["requests_get_not_found"];
    let base = not_found(&exchange(&[stats(1)], &[], Some(1)).unwrap());
    let mut batch: Vec<Request> = (1..=GETS).map(get).collect();
    batch.push(stats(GETS + 1));
    let seen = not_found(&exchange(&batch, &[], Some(GETS + 1)).unwrap());
    assert_eq!(seen - base, GETS, "a STATS counts every GET sent before it");

    // GETs, then a frame no request decodes from: the server closes, and
    // counts what it answered first.
    let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
    exchange(&batch[..GETS as usize], &garbage, None);
    let mut counted = 0;
    let done = wait_until(Duration::from_secs(20), || {
        counted = not_found(&exchange(&[stats(1)], &[], Some(1)).unwrap()) - seen;
        counted >= GETS
    });
    assert!(done, "the closed connection's GETs were not all counted: {counted}");
    assert_eq!(counted, GETS);
}
