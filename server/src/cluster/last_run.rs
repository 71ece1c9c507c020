//! How a durable node's last run ended, and whether its log can still be
//! trusted to hold everything its replicas acknowledged.
//!
//! Under `--sync batch` or `none`, a write reaches the log file at once
//! but the disk later: a process that crashes loses nothing (the kernel
//! still holds the pages), a machine that loses power or panics may lose
//! the last unsynced entries and votes. A replica that comes back after
//! that as the same member could have acknowledged an entry (counted
//! towards a commit) or voted, and forgotten it: one machine's power loss,
//! not a majority's, could then lose an acknowledged write. So a node
//! records its kernel's boot id and sync policy when it starts, and that
//! it stopped cleanly when it stops. At the next start, a log written
//! without `--sync always`, whose run did not stop cleanly and whose
//! kernel has since restarted, is distrusted: the node's replicas rejoin
//! their shards as new incarnations (as a node without `--data-dir` does)
//! wherever the shard has other replicas.

use std::path::Path;

use super::sync_policy::SyncPolicy;

/// The file, in the data directory.
pub const FILE: &str = "last-run";
/// Written (synced) before anything acts on a distrusted log, removed only
/// once every replica has dropped it: a start that stops midway leaves it,
/// and the next start distrusts the log again rather than trust what is
/// left of it.
pub const DISTRUST_FILE: &str = "distrusted";
/// Overrides the kernel's boot id, for tests that play a machine restart.
pub const BOOT_ID_ENV: &str = "DMKV_TEST_BOOT_ID";

/// Whether the log holds everything this node's replicas acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    Trusted,
    /// It may not; why.
    Distrusted(String),
}

/// What the file says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    boot_id: String,
    sync: String,
    clean: bool,
}

impl Run {
    fn encode(&self) -> String {
        format!("boot_id={}\nsync={}\nclean={}\n", self.boot_id, self.sync, u8::from(self.clean))
    }

    /// `None` for anything that is not a file this module wrote.
    fn decode(text: &str) -> Option<Run> {
        let mut run = Run { boot_id: String::new(), sync: String::new(), clean: false };
        for line in text.lines() {
            let (k, v) = line.split_once('=')?;
            match k {
                "boot_id" => run.boot_id = v.to_string(),
                "sync" => run.sync = v.to_string(),
                "clean" => run.clean = v == "1",
                _ => return None,
            }
        }
        (!run.boot_id.is_empty() && !run.sync.is_empty()).then_some(run)
    }
}

fn policy_name(p: SyncPolicy) -> &'static str {
    match p {
        SyncPolicy::Always => "always",
        SyncPolicy::Batch => "batch",
        SyncPolicy::None => "none",
    }
}

/// This kernel's boot id (a new one at every boot); empty if unknown.
pub fn boot_id() -> String {
    if let Ok(v) = std::env::var(BOOT_ID_ENV) {
        return v;
    }
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Judges the last run recorded in `dir` and records this one (running,
/// under `sync`), durably, before the node takes part in anything.
pub fn begin(dir: &Path, sync: SyncPolicy) -> Result<Trust, String> {
    let file = dir.join(FILE);
    let boot = boot_id();
    if let Ok(why) = std::fs::read_to_string(dir.join(DISTRUST_FILE)) {
        write(&file, &Run { boot_id: boot, sync: policy_name(sync).into(), clean: false })?;
        return Ok(Trust::Distrusted(format!("{} (from an earlier start that did not finish)", why.trim())));
    }
    let trust = match std::fs::read_to_string(&file) {
        // A first start, or a data directory from before this file: the
        // log is what it is (it was never judged).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Trust::Trusted,
        Err(e) => return Err(format!("{}: {e}", file.display())),
        Ok(text) => match Run::decode(&text) {
            None => Trust::Distrusted(format!("{} is not what dmkvd writes", file.display())),
            Some(last) => judge(&last, &boot),
        },
    };
    if let Trust::Distrusted(why) = &trust {
        distrust(dir, why)?;
    }
    write(&file, &Run { boot_id: boot, sync: policy_name(sync).into(), clean: false })?;
    Ok(trust)
}

/// Records, durably, that the log in `dir` is not to be trusted (`why`),
/// before anything acts on that: until [`settled`] says every replica has
/// dropped it, every start distrusts it.
pub fn distrust(dir: &Path, why: &str) -> Result<(), String> {
    write_text(&dir.join(DISTRUST_FILE), why)
}

/// Every replica has dropped the distrusted log (its new incarnation's
/// state is durable): the mark goes.
pub fn settled(dir: &Path) -> Result<(), String> {
    let file = dir.join(DISTRUST_FILE);
    match std::fs::remove_file(&file) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", file.display())),
    }
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| format!("{}: {e}", dir.display()))
}

fn judge(last: &Run, boot: &str) -> Trust {
    if last.clean || last.sync == "always" {
        return Trust::Trusted;
    }
    if !boot.is_empty() && last.boot_id == boot {
        // The process stopped, the kernel did not: it wrote back or will
        // write back everything the process wrote.
        return Trust::Trusted;
    }
    Trust::Distrusted(format!(
        "the last run (--sync {}) did not stop cleanly and the machine restarted since: entries and votes not yet \
         on disk may be lost",
        last.sync
    ))
}

/// Records that this run stopped cleanly (after the log was synced).
pub fn end(dir: &Path, sync: SyncPolicy) -> Result<(), String> {
    write(&dir.join(FILE), &Run { boot_id: boot_id(), sync: policy_name(sync).into(), clean: true })
}

/// Writes `run` whole or not at all.
fn write(file: &Path, run: &Run) -> Result<(), String> {
    write_text(file, &run.encode())
}

/// Writes `text` whole or not at all: beside, synced, renamed, directory
/// synced.
fn write_text(file: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    let err = |e: std::io::Error| format!("{}: {e}", file.display());
    let tmp = file.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(text.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, file).map_err(err)?;
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(boot: &str, sync: &str, clean: bool) -> Run {
        Run { boot_id: boot.into(), sync: sync.into(), clean }
    }

    #[test]
    fn a_log_is_distrusted_only_after_an_unclean_stop_a_reboot_and_no_sync() {
        assert_eq!(judge(&run("a", "batch", true), "b"), Trust::Trusted, "stopped cleanly");
        assert_eq!(judge(&run("a", "always", false), "b"), Trust::Trusted, "everything was synced");
        assert_eq!(judge(&run("a", "none", false), "a"), Trust::Trusted, "a process crash: the kernel has it");
        assert!(matches!(judge(&run("a", "batch", false), "b"), Trust::Distrusted(_)), "power loss");
        assert!(matches!(judge(&run("a", "none", false), ""), Trust::Distrusted(_)), "boot id unknown");
    }

    #[test]
    fn runs_are_recorded_and_judged_at_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(begin(dir.path(), SyncPolicy::None).unwrap(), Trust::Trusted, "first start");
        // Same kernel: a crash of the process alone.
        assert_eq!(begin(dir.path(), SyncPolicy::None).unwrap(), Trust::Trusted);
        end(dir.path(), SyncPolicy::None).unwrap();
        assert_eq!(begin(dir.path(), SyncPolicy::None).unwrap(), Trust::Trusted);
        std::fs::write(dir.path().join(FILE), "boot_id=another\nsync=none\nclean=0\n").unwrap();
        assert!(matches!(begin(dir.path(), SyncPolicy::Always).unwrap(), Trust::Distrusted(_)));
        // The mark stays until every replica dropped the log: a start that
        // stopped midway (here: no `settled`) leaves the next distrusting.
        assert!(matches!(begin(dir.path(), SyncPolicy::Always).unwrap(), Trust::Distrusted(_)), "still marked");
        settled(dir.path()).unwrap();
        assert_eq!(begin(dir.path(), SyncPolicy::Always).unwrap(), Trust::Trusted, "settled");
        std::fs::write(dir.path().join(FILE), "garbage").unwrap();
        assert!(matches!(begin(dir.path(), SyncPolicy::Always).unwrap(), Trust::Distrusted(_)));
        assert_eq!(Run::decode(&run("x", "batch", true).encode()), Some(run("x", "batch", true)));
    }
}
