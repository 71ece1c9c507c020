//! The memcached port's own counters (relaxed atomics: they are
//! statistics), with memcached's field names.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::backend::Error;

/// What the memcached port counts, per listener.
#[derive(Debug, Default)]
pub struct Counters {
    pub cmd_get: AtomicU64,
    pub cmd_set: AtomicU64,
    pub cmd_flush: AtomicU64,
    pub cmd_touch: AtomicU64,
    pub get_hits: AtomicU64,
    pub get_misses: AtomicU64,
    pub delete_hits: AtomicU64,
    pub delete_misses: AtomicU64,
    pub incr_hits: AtomicU64,
    pub incr_misses: AtomicU64,
    pub decr_hits: AtomicU64,
    pub decr_misses: AtomicU64,
    pub cas_hits: AtomicU64,
    pub cas_misses: AtomicU64,
    pub cas_badval: AtomicU64,
    pub touch_hits: AtomicU64,
    pub touch_misses: AtomicU64,
    /// Successful stores through this port.
    pub total_items: AtomicU64,
    pub store_too_large: AtomicU64,
    pub store_no_memory: AtomicU64,
    pub auth_cmds: AtomicU64,
    pub auth_errors: AtomicU64,
}

impl Counters {
    /// `stats reset`: the counters start over (the store's own do not).
    pub fn reset(&self) {
        for c in [
            &self.cmd_get,
            &self.cmd_set,
            &self.cmd_flush,
            &self.cmd_touch,
            &self.get_hits,
            &self.get_misses,
            &self.delete_hits,
            &self.delete_misses,
            &self.incr_hits,
            &self.incr_misses,
            &self.decr_hits,
            &self.decr_misses,
            &self.cas_hits,
            &self.cas_misses,
            &self.cas_badval,
            &self.touch_hits,
            &self.touch_misses,
            &self.total_items,
            &self.store_too_large,
            &self.store_no_memory,
            &self.auth_cmds,
            &self.auth_errors,
        ] {
            c.store(0, Relaxed);
        }
    }
}

/// Counts a store's outcome as memcached does.
pub fn count_store<T>(c: &Counters, is_cas: bool, r: &Result<T, Error>) {
    let counter = match r {
        Ok(_) => {
            if is_cas {
                c.cas_hits.fetch_add(1, Relaxed);
            }
            &c.total_items
        }
        Err(Error::Exists) => &c.cas_badval,
        Err(Error::NotFound) if is_cas => &c.cas_misses,
        Err(Error::ValueTooLarge(_)) => &c.store_too_large,
        Err(Error::OutOfMemory | Error::IndexFull) => &c.store_no_memory,
        Err(_) => return,
    };
    counter.fetch_add(1, Relaxed);
}
