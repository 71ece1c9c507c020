//! Scraping and checking Prometheus text, for the tests of both sides'
//! metrics: a plain HTTP GET, the samples of a text, `promtool check
//! metrics`.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::needs::{Need, available_or_skip};

/// `GET path` from `addr` over HTTP/1.1, one request per connection, as a
/// scraper or a probe does: (status, body), or why it could not be had.
pub fn http_get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| format!("read from {addr}: {e}"))?;
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("no HTTP head in {text:?}"))?;
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or("no status code")?;
    Ok((status, body.to_string()))
}

/// The samples of a text, by series (`name{labels}` as written).
pub fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_string(), v)))
        .collect()
}

/// `text` (OpenMetrics, as prometheus-client writes it and Prometheus
/// scrapes it) in the classic text format, the only one `promtool check
/// metrics` reads: there a counter family is named with its `_total`
/// suffix, and there are no UNIT or EOF lines. Names, labels, values, help
/// and types are untouched, so the lint still sees everything it checks.
pub fn classic_text(text: &str) -> String {
    let counters: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find(|p| line.starts_with(p));
        match meta.map(|p| (p, line[p.len()..].split_once(' ').unwrap_or((&line[p.len()..], "")))) {
            Some((p, (name, rest))) if counters.contains(&name) && !name.ends_with("_total") => {
                out.push_str(&format!("{p}{name}_total {rest}"))
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Runs `promtool check metrics` on `text` (classic or OpenMetrics) for
/// `test`. Without promtool the check is skipped with one SKIPPED line,
/// and fails where tools are required (`.ci/run` installs it); the rest of
/// the test still runs.
pub fn promtool_check(test: &str, text: &str) {
    let promtool = Need::Tool { name: "promtool", install: "apt-get install prometheus" };
    if !available_or_skip(test, &[promtool]) {
        return;
    }
    let text = &classic_text(text);
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- text ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
