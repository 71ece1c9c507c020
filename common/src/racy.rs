//! Copies to and from memory that another thread or process may write at
//! the same time: a server's region.
//!
//! Such memory is never behind a Rust reference (that would be a data race,
//! undefined behaviour even when a checksum catches the tear). Like a
//! seqlock, every access is an atomic load or store of a word (8 bytes where
//! aligned, single bytes at unaligned edges), and the caller verifies what
//! it copied. This is the only module in `dmkv-common` with `unsafe`.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};

/// Copies `dst.len()` bytes starting at `src` into `dst`.
///
/// Bytes may be torn across words if a writer runs concurrently; callers
/// verify (checksum, key) before trusting them. Ends with an acquire fence
/// so that anything the caller reads next is not reordered before the copy.
///
/// # Safety
/// `src..src + dst.len()` must be valid for reads for the whole call (a live
/// mapping) and every concurrent writer of it must use atomic stores (such
/// as [`copy_to_shared`]) or be another process.
pub unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
    let len = dst.len();
    let head = src.align_offset(8).min(len);
    for (i, d) in dst[..head].iter_mut().enumerate() {
        // SAFETY: in bounds by the caller's contract; AtomicU8 has alignment 1.
        *d = unsafe { (*src.add(i).cast::<AtomicU8>()).load(Ordering::Relaxed) };
    }
    let words = (len - head) / 8;
    for w in 0..words {
        let at = head + 8 * w;
        // SAFETY: `src + at` is 8-aligned (head aligned it) and `at + 8 <= len`.
        let v = unsafe { (*src.add(at).cast::<AtomicU64>()).load(Ordering::Relaxed) };
        dst[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }
    let tail = head + 8 * words;
    for (i, d) in dst[tail..].iter_mut().enumerate() {
        // SAFETY: in bounds by the caller's contract.
        *d = unsafe { (*src.add(tail + i).cast::<AtomicU8>()).load(Ordering::Relaxed) };
    }
    fence(Ordering::Acquire);
}

/// Copies `src` to `dst` with atomic stores, after a release fence so that
/// everything the caller wrote before is visible to whoever observes these
/// bytes and synchronises with them.
///
/// # Safety
/// `dst..dst + src.len()` must be valid for writes for the whole call, and
/// every concurrent reader of it must use atomic loads (such as
/// [`copy_from_shared`]) or be another process.
pub unsafe fn copy_to_shared(dst: *mut u8, src: &[u8]) {
    fence(Ordering::Release);
    let len = src.len();
    let head = dst.align_offset(8).min(len);
    for (i, s) in src[..head].iter().enumerate() {
        // SAFETY: in bounds by the caller's contract.
        unsafe { (*dst.add(i).cast::<AtomicU8>()).store(*s, Ordering::Relaxed) };
    }
    let words = (len - head) / 8;
    for w in 0..words {
        let at = head + 8 * w;
        let v = u64::from_ne_bytes(src[at..at + 8].try_into().expect("8 bytes"));
        // SAFETY: `dst + at` is 8-aligned and `at + 8 <= len`.
        unsafe { (*dst.add(at).cast::<AtomicU64>()).store(v, Ordering::Relaxed) };
    }
    let tail = head + 8 * words;
    for (i, s) in src[tail..].iter().enumerate() {
        // SAFETY: in bounds by the caller's contract.
        unsafe { (*dst.add(tail + i).cast::<AtomicU8>()).store(*s, Ordering::Relaxed) };
    }
}

/// Loads the 8-byte word at `p` with acquire ordering (a slot).
///
/// # Safety
/// `p` must be 8-aligned and valid for reads for the call.
pub unsafe fn load_word(p: *const u8) -> u64 {
    debug_assert!(p.align_offset(8) == 0);
    // SAFETY: aligned and valid by the caller's contract.
    unsafe { (*p.cast::<AtomicU64>()).load(Ordering::Acquire) }
}

/// Stores the 8-byte word at `p` with release ordering: publishes a slot
/// after the item it points to was written.
///
/// # Safety
/// `p` must be 8-aligned and valid for writes for the call.
pub unsafe fn store_word(p: *mut u8, v: u64) {
    debug_assert!(p.align_offset(8) == 0);
    // SAFETY: aligned and valid by the caller's contract.
    unsafe { (*p.cast::<AtomicU64>()).store(v, Ordering::Release) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_round_trip_at_any_alignment() {
        let mut backing = vec![0u64; 64];
        let base = backing.as_mut_ptr().cast::<u8>();
        for off in 0..9 {
            for len in 0..100 {
                let src: Vec<u8> = (0..len).map(|i| (i * 7 + off) as u8).collect();
                // SAFETY: off + len <= 109 < 512 bytes of `backing`, owned here.
                unsafe { copy_to_shared(base.add(off), &src) };
                let mut dst = vec![0u8; len];
                // SAFETY: as above.
                unsafe { copy_from_shared(base.add(off), &mut dst) };
                assert_eq!(dst, src);
            }
        }
    }
}
