//! A panic inside the raft log engine is fatal to the node. raft-engine
//! panics when a sync fails; the writers grouped with the one that
//! panicked are then told their writes are done, though they were never
//! synced, and would acknowledge entries and votes. The process records
//! that its logs are not to be trusted (`last_run::distrust`) and aborts
//! before they can; at the next start its replicas rejoin as new
//! incarnations.
//!
//! One hook for the process, installed once, for every data directory a
//! node of the process opened (one in a daemon; several in tests). A panic
//! the caller expects and catches (the engine's recovery, see
//! [`caught`]) is left to unwind: while one runs, in any thread, because
//! the engine recovers on a pool of its own threads. Recovery runs while a
//! log is opened, before any replica of it acknowledges anything.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

use super::last_run;

/// Data directories whose logs a panic in the engine marks.
static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

/// Calls running whose engine panics are caught, in the whole process.
static CATCHING: AtomicUsize = AtomicUsize::new(0);

/// From now on, a panic in the log engine marks `dir`'s log distrusted and
/// aborts the process.
pub fn abort_on_engine_panic(dir: &Path) {
    {
        let mut dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
        if !dirs.iter().any(|d| d == dir) {
            dirs.push(dir.to_path_buf());
        }
    }
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            let in_engine = info.location().is_some_and(|l| l.file().contains("raft-engine"));
            if in_engine && CATCHING.load(Ordering::SeqCst) == 0 {
                let dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
                for d in dirs.iter() {
                    let _ = last_run::distrust(d, &format!("the raft log engine failed ({info})"));
                }
                std::process::abort();
            }
        }));
    });
}

/// Runs `f`, catching a panic (the engine's, while it recovers a log).
pub fn caught<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    CATCHING.fetch_add(1, Ordering::SeqCst);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.fetch_sub(1, Ordering::SeqCst);
    r
}
