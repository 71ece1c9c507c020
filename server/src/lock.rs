//! Locking that survives a panic elsewhere.
//!
//! A panic while a `std::sync::Mutex` is held poisons it, and every later
//! `lock().expect(..)` panics too: one bug in one request would stop the
//! store taking writes for good. The server's locks recover instead. That
//! is sound only because each guarded state stays consistent at every
//! point a panic could occur; each lock's owner says why at its
//! definition.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking the guard over even if a panic poisoned it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_locks() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = std::sync::Arc::clone(&m);
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
