//! `promtool check metrics`, for the tests of both sides' metrics.

use std::io::Write;
use std::process::{Command, Stdio};

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

/// Runs `promtool check metrics` on `text` (classic or OpenMetrics);
/// promtool is part of the tests' contract (.ci/run installs it), so a
/// machine without it fails rather than skips.
pub fn promtool_check(text: &str) {
    let text = &classic_text(text);
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool not found: install the `prometheus` package (apt-get install prometheus)");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{}{}\n--- text ---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
