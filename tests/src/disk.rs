//! A full disk under a node's `--data-dir`, for tests: the directory is a
//! small tmpfs of its own, which a ballast file fills to the last page
//! (writes then fail with ENOSPC) and leaves again when it is deleted.
//!
//! A tmpfs, not a loop device: it needs nothing but root and `mount`, its
//! size is exact, and it is gone when unmounted. It is memory, so fsync
//! costs nothing; a process crash (kill -9) keeps what was written, which
//! is what the tests ask of a node (not surviving power loss).
//!
//! Needs root and `mount`/`umount` (util-linux). Tests skip where they are
//! unavailable, or fail under [`crate::skip::REQUIRE_ENV`] (see
//! [`crate::skip`]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long the space of a deleted ballast may take to come back.
const FREED_WITHIN: Duration = Duration::from_secs(1);
/// The ballast file's name, in the mount's root.
const BALLAST: &str = "dmkv-test-ballast";
/// How often a full disk is topped up: the node may free space (delete a
/// log file, a snapshot it replaced) and must find none.
const TOP_UP_EVERY: Duration = Duration::from_millis(20);

/// A tmpfs mounted on a directory, unmounted (lazily) when dropped.
#[derive(Debug)]
pub struct Tmpfs {
    dir: PathBuf,
    ballast: Option<Ballast>,
}

/// Keeps a tmpfs full: a thread that appends to the ballast file until
/// told to stop.
#[derive(Debug)]
struct Ballast {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

impl Tmpfs {
    /// Whether tmpfs mounts can be made here (root, `mount`): a 1 MiB one
    /// is mounted and unmounted once per process.
    pub fn available() -> Result<(), String> {
        static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
        ANSWER.get_or_init(probe).clone()
    }

    /// Makes `dir` (if need be) and mounts a tmpfs of `bytes` on it.
    pub fn mount(dir: &Path, bytes: u64) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("make {}: {e}", dir.display()))?;
        let opts = format!("size={bytes},mode=0700");
        run("mount", &["-t", "tmpfs", "-o", &opts, "dmkv-test", &dir.to_string_lossy()])?;
        Ok(Tmpfs { dir: dir.to_path_buf(), ballast: None })
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Fills the file system and keeps it full (topping the ballast up as
    /// the node frees space) until [`Tmpfs::drain`]; the bytes left free
    /// once it first filled (0 on tmpfs: it allocates whole pages).
    pub fn fill(&mut self) -> Result<u64, String> {
        if self.ballast.is_some() {
            return Ok(self.free_bytes());
        }
        let path = self.dir.join(BALLAST);
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("open {}: {e}", path.display()))?;
        top_up(&mut f);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("ballast".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(TOP_UP_EVERY);
                    top_up(&mut f);
                }
            })
            .map_err(|e| format!("cannot start the ballast thread: {e}"))?;
        self.ballast = Some(Ballast { stop, handle });
        Ok(self.free_bytes())
    }

    /// Deletes the ballast: the space is free again.
    pub fn drain(&mut self) -> Result<(), String> {
        let Some(b) = self.ballast.take() else { return Ok(()) };
        b.stop.store(true, Ordering::Relaxed);
        let _ = b.handle.join();
        let path = self.dir.join(BALLAST);
        std::fs::remove_file(&path).map_err(|e| format!("remove {}: {e}", path.display()))?;
        // A child being spawned (by any thread) holds a copy of the file's
        // descriptor until it execs: the space comes back a moment later.
        let deadline = std::time::Instant::now() + FREED_WITHIN;
        while self.free_bytes() == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Whether the ballast is in place.
    pub fn is_full(&self) -> bool {
        self.ballast.is_some()
    }

    /// Bytes free for an unprivileged writer (what `df` shows).
    pub fn free_bytes(&self) -> u64 {
        rustix::fs::statvfs(&self.dir).map_or(0, |s| s.f_bavail * s.f_frsize)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = self.drain();
        // Lazily: a process that still has a file open there (a node not
        // yet reaped) would make a plain umount fail.
        if let Err(e) = run("umount", &["-l", &self.dir.to_string_lossy()]) {
            eprintln!("disk: {e}");
        }
        // The mount point was made by `mount` (if need be): gone with it,
        // when empty.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Appends to the ballast until the file system refuses a single page.
fn top_up(f: &mut std::fs::File) {
    let big = vec![0u8; 1 << 20];
    for chunk in [&big[..], &big[..4096]] {
        while f.write_all(chunk).is_ok() {}
    }
}

fn probe() -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("dmkv-tmpfs-probe-{}", std::process::id()));
    let result = Tmpfs::mount(&dir, 1 << 20).and_then(|mut t| {
        t.fill()?;
        let full = t.free_bytes();
        t.drain()?;
        match (full, t.free_bytes()) {
            (0, free) if free > 0 => Ok(()),
            (full, free) => Err(format!("filling a tmpfs left {full} bytes free, draining it {free}")),
        }
    });
    let _ = std::fs::remove_dir(&dir);
    result
}

/// Runs `prog args`; an error naming the command and its stderr.
fn run(prog: &str, args: &[&str]) -> Result<(), String> {
    let cmd = format!("{prog} {}", args.join(" "));
    let out = Command::new(prog).args(args).output().map_err(|e| format!("`{cmd}`: cannot run {prog}: {e}"))?;
    if !out.status.success() {
        return Err(format!("`{cmd}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_tmpfs_refuses_writes_until_drained() {
        // As `needs::available_or_skip(.., &[Need::Tmpfs])` would, without
        // the layer above this module.
        if let Err(e) = Tmpfs::available()
            && !crate::skip::skip("a_full_tmpfs_refuses_writes_until_drained", &format!("tmpfs mounts: {e}"))
        {
            return;
        }
        let dir = std::env::temp_dir().join(format!("dmkv-tmpfs-test-{}", std::process::id()));
        let mut t = Tmpfs::mount(&dir, 4 << 20).expect("mount");
        std::fs::write(dir.join("before"), b"fits").expect("a write before the ballast");
        assert_eq!(t.fill().expect("fill"), 0);
        assert!(std::fs::write(dir.join("after"), vec![1u8; 8192]).is_err(), "a full tmpfs took 8 KiB");
        // Space freed by the writer is taken again.
        std::fs::remove_file(dir.join("before")).unwrap();
        std::thread::sleep(TOP_UP_EVERY * 5);
        assert_eq!(t.free_bytes(), 0);
        t.drain().expect("drain");
        std::fs::write(dir.join("after"), vec![1u8; 8192]).expect("a write after draining");
        drop(t);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}
