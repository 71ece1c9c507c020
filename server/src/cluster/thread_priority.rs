//! Background work (a snapshot's walk) yields the CPU to the shard
//! threads.

/// Lowers the calling thread's scheduling priority (on Linux a priority is
/// per thread), so a snapshot's walk takes the CPU the shard threads leave.
pub fn background() {
    let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 10);
}
