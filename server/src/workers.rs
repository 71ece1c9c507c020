//! Threads that serve client connections, each on a single-threaded
//! runtime of its own: a connection's reads, its requests and its writes
//! stay on the thread it was handed to, as on memcached's worker threads.
//! On the multi-threaded runtime the same connection paid for the
//! scheduler's cross-thread wake-ups and work stealing on every request
//! (docs/performance.md, issue 31).
//!
//! Accept loops stay on the main runtime; an accepted socket is taken off
//! that runtime's reactor and registered with its worker's (see
//! [`crate::listen::Rehomed`]), so its readiness is reported on the thread
//! that serves it.

use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// Most worker threads one set starts.
pub const MAX_WORKERS: usize = 1024;

/// A fixed set of connection threads, picked round-robin.
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
    /// Dropping a sender ends its thread's runtime (and the tasks on it).
    stops: Mutex<Vec<oneshot::Sender<()>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Workers {
    /// Starts `n` threads named `name-<i>`.
    pub fn start(n: usize, name: &str) -> io::Result<Workers> {
        if !(1..=MAX_WORKERS).contains(&n) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{n} worker threads: 1 to {MAX_WORKERS}")));
        }
        let (mut handles, mut stops, mut threads) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let rt = Builder::new_current_thread().enable_all().build()?;
            handles.push(rt.handle().clone());
            let (tx, rx) = oneshot::channel::<()>();
            stops.push(tx);
            let thread = std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || {
                // Spawned tasks run while this waits; a dropped sender ends it.
                rt.block_on(async {
                    let _ = rx.await;
                });
            })?;
            threads.push(thread);
        }
        assert_eq!(handles.len(), n);
        Ok(Workers { handles, next: AtomicUsize::new(0), stops: Mutex::new(stops), threads: Mutex::new(threads) })
    }

    /// The runtime the next connection goes to.
    pub fn pick(&self) -> &Handle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        &self.handles[i]
    }

    /// Ends every thread's runtime, dropping the tasks still on it, and
    /// waits for the threads. Blocks: call it off the async workers.
    pub fn stop(&self) {
        self.stops.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Without a join: a drop may happen on an async worker.
        self.stops.get_mut().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_run_on_the_workers_round_robin_and_stop_ends_them() {
        let w = Workers::start(2, "test-worker").expect("workers");
        let names: Vec<String> = (0..4)
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::channel();
                w.pick().spawn(async move {
                    let _ = tx.send(std::thread::current().name().unwrap_or("").to_string());
                });
                rx.recv().expect("the task ran")
            })
            .collect();
        assert_eq!(names, ["test-worker-0", "test-worker-1", "test-worker-0", "test-worker-1"]);
        // A task that never ends is dropped with its runtime.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        w.pick().spawn(async move {
            let _keep = tx;
            std::future::pending::<()>().await;
        });
        w.stop();
        assert!(rx.recv().is_err(), "the pending task outlived its worker");
    }

    #[test]
    fn a_bad_count_is_an_error() {
        assert!(Workers::start(0, "w").is_err());
        assert!(Workers::start(MAX_WORKERS + 1, "w").is_err());
    }
}
