//! Copies to and from memory that another thread or process may write at
//! the same time: a server's region.
//!
//! Such memory is never behind a Rust reference (that would be a data race,
//! undefined behaviour even when a checksum catches the tear). Like a
//! seqlock, every access is an atomic load or store of one whole, aligned
//! 8-byte word, and the caller verifies what it copied. Readers and the
//! writer must agree on word size: a byte load of a word stored as a `u64`
//! is a mixed-size race, which the Rust memory model leaves undefined.
//!
//! Readers may map the memory read-only. The standard library allows only
//! `Relaxed` atomic loads of at most pointer size there (stronger or wider
//! ones may be implemented with instructions that write, and fault), so
//! loads here are `Relaxed` `u64` loads followed by an acquire fence. This is the only module in
//! `dmkv-common` with `unsafe`.

use std::sync::atomic::{AtomicU64, Ordering, fence};

// A `u64` load wider than a pointer may be a compare-exchange, which faults
// on a read-only mapping.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("dmkv_common::racy needs 64-bit pointers: it loads u64 words from read-only mappings");

const WORD: usize = 8;

/// Copies the `dst.len()` bytes starting at `src` into `dst`, loading the
/// aligned words that cover them.
///
/// Bytes may be torn across words (never within one) if a writer runs
/// concurrently; callers verify (checksum, key) before trusting them. Ends
/// with an acquire fence so that anything the caller reads next is not
/// reordered before the copy. Works on read-only mappings.
///
/// # Safety
/// Unless `dst` is empty, every 8-aligned word that overlaps
/// `src..src + dst.len()` must be valid for reads for the whole call (part
/// of a live mapping), and every concurrent writer of those words must store
/// whole aligned `u64` words atomically (as [`copy_to_shared`] and
/// [`store_word`] do) or be another process doing the same.
pub unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
    if dst.is_empty() {
        fence(Ordering::Acquire);
        return;
    }
    let lead = src.addr() % WORD;
    // SAFETY: the word containing `src` is valid by the caller's contract,
    // so rounding down stays inside the same mapping.
    let words = unsafe { src.sub(lead) }.cast::<AtomicU64>();
    let mut next = 0;
    let mut rest = &mut dst[..];
    if lead != 0 {
        // SAFETY: word 0 overlaps the range, so it is valid; it is aligned.
        let w = unsafe { load_bytes(words, 0) };
        let n = (WORD - lead).min(rest.len());
        rest[..n].copy_from_slice(&w[lead..lead + n]);
        rest = &mut rest[n..];
        next = 1;
    }
    let mut chunks = rest.chunks_exact_mut(WORD);
    for c in &mut chunks {
        // SAFETY: word `next` lies wholly inside the range, so it is valid.
        c.copy_from_slice(&unsafe { load_bytes(words, next) });
        next += 1;
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        // SAFETY: word `next` overlaps the range's last bytes, so it is valid.
        let w = unsafe { load_bytes(words, next) };
        tail.copy_from_slice(&w[..tail.len()]);
    }
    fence(Ordering::Acquire);
}

/// The bytes of word `i` from `words`, in memory order.
///
/// # Safety
/// `words + i` must be aligned and valid for reads.
#[inline(always)]
unsafe fn load_bytes(words: *const AtomicU64, i: usize) -> [u8; WORD] {
    // SAFETY: by the caller's contract.
    unsafe { (*words.add(i)).load(Ordering::Relaxed) }.to_ne_bytes()
}

/// Copies `src` to `dst` as whole 8-byte words stored atomically, after a
/// release fence so that everything the caller wrote before is visible to
/// whoever observes these bytes and synchronises with them. The last word
/// is padded with zeros when `src.len()` is not a multiple of 8.
///
/// # Safety
/// `dst` must be 8-aligned (checked), `dst..dst + src.len().next_multiple_of(8)`
/// must be valid for writes for the whole call and hold nothing the caller
/// does not own (the padding overwrites it), and every concurrent reader of
/// it must use `u64` atomic loads (such as [`copy_from_shared`]) or be
/// another process doing the same.
pub unsafe fn copy_to_shared(dst: *mut u8, src: &[u8]) {
    assert!(dst.addr().is_multiple_of(WORD), "copy_to_shared to an unaligned address");
    fence(Ordering::Release);
    let words = dst.cast::<AtomicU64>();
    let mut chunks = src.chunks_exact(WORD);
    let mut next = 0;
    for c in &mut chunks {
        let v = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
        // SAFETY: aligned (checked above) and inside the range the caller
        // vouched for.
        unsafe { (*words.add(next)).store(v, Ordering::Relaxed) };
        next += 1;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut w = [0u8; WORD];
        w[..tail.len()].copy_from_slice(tail);
        // SAFETY: the padded last word is inside the caller's range.
        unsafe { (*words.add(next)).store(u64::from_ne_bytes(w), Ordering::Relaxed) };
    }
}

/// Most bytes of one range [`prefetch`] asks for: enough for the start of
/// a large value (the hardware prefetcher follows a stream once it began).
const PREFETCH_MAX: usize = 4096;
const LINE: usize = 64;

/// Asks the CPU to start loading the cache lines of `src..src + len` (at
/// most [`PREFETCH_MAX`] bytes), so that the copies of a batch of reads
/// wait for memory once, together, not once per read.
///
/// A prefetch is a hint, not a memory access: it never faults (any
/// address is allowed) and reads nothing that the program sees, so it
/// cannot race with a writer.
#[inline]
pub fn prefetch(src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let first = src.addr() & !(LINE - 1);
        let end = src.addr().saturating_add(len.min(PREFETCH_MAX));
        let mut line = first;
        while line < end {
            // SAFETY: `_mm_prefetch` is a hint; it does not dereference its
            // argument in the language's sense and never faults, whatever
            // the address. SSE is part of the x86_64 baseline.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(src.with_addr(line).cast::<i8>())
            };
            line += LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, len);
}

/// Loads the 8-byte word at `p` (a slot), ordered before anything the
/// caller reads next. Works on read-only mappings.
///
/// # Safety
/// `p` must be 8-aligned and valid for reads for the call, and concurrent
/// writers must store it as a whole `u64` atomically.
pub unsafe fn load_word(p: *const u8) -> u64 {
    debug_assert!(p.addr().is_multiple_of(WORD));
    // SAFETY: aligned and valid by the caller's contract. Relaxed, not
    // Acquire: only relaxed loads are sound on read-only memory.
    let v = unsafe { (*p.cast::<AtomicU64>()).load(Ordering::Relaxed) };
    fence(Ordering::Acquire);
    v
}

/// Stores the 8-byte word at `p` with release ordering: publishes a slot
/// after the item it points to was written.
///
/// # Safety
/// `p` must be 8-aligned and valid for writes for the call, and concurrent
/// readers must load it as a whole `u64` atomically.
pub unsafe fn store_word(p: *mut u8, v: u64) {
    debug_assert!(p.addr().is_multiple_of(WORD));
    // SAFETY: aligned and valid by the caller's contract.
    unsafe { (*p.cast::<AtomicU64>()).store(v, Ordering::Release) }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use memmap2::MmapOptions;

    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn reads_any_range_of_what_was_written() {
        let backing: Vec<AtomicU64> = (0..32).map(|_| AtomicU64::new(0)).collect();
        let base = backing.as_ptr().cast::<u8>().cast_mut();
        let src = pattern(256);
        // SAFETY: 256 bytes of `backing`, 8-aligned.
        unsafe { copy_to_shared(base, &src) };
        for off in 0..24 {
            for len in 0..=256 - off {
                let mut dst = vec![0u8; len];
                // SAFETY: off + len <= 256, so the covering words are in `backing`.
                unsafe { copy_from_shared(base.add(off), &mut dst) };
                assert_eq!(dst, src[off..off + len], "off {off} len {len}");
            }
        }
    }

    #[test]
    fn writes_whole_words_padded_with_zeros() {
        let backing: Vec<AtomicU64> = (0..32).map(|_| AtomicU64::new(0)).collect();
        let base = backing.as_ptr().cast::<u8>().cast_mut();
        for at in (0..64).step_by(8) {
            for len in 0..=128 {
                for w in &backing {
                    w.store(u64::MAX, Ordering::Relaxed);
                }
                let src = pattern(len);
                // SAFETY: at + len rounded up to 8 is at most 192 of 256 bytes.
                unsafe { copy_to_shared(base.add(at), &src) };
                let mut all = vec![0u8; 256];
                // SAFETY: all of `backing`.
                unsafe { copy_from_shared(base, &mut all) };
                let padded = len.next_multiple_of(8);
                assert!(all[..at].iter().all(|&b| b == 0xff), "at {at} len {len}: bytes before");
                assert_eq!(all[at..at + len], src, "at {at} len {len}");
                assert!(all[at + len..at + padded].iter().all(|&b| b == 0), "at {at} len {len}: padding");
                assert!(all[at + padded..].iter().all(|&b| b == 0xff), "at {at} len {len}: bytes after");
            }
        }
    }

    #[test]
    #[should_panic(expected = "unaligned")]
    fn refuses_unaligned_writes() {
        let backing = [AtomicU64::new(0), AtomicU64::new(0)];
        // SAFETY: 3 bytes from offset 1 (padded to 8) lie inside `backing`;
        // the call panics before storing anything.
        unsafe { copy_to_shared(backing.as_ptr().cast::<u8>().cast_mut().add(1), b"abc") };
    }

    /// A writer fills every word with eight copies of one byte, changing it
    /// each time; a reader copying any range must never see two different
    /// bytes within one aligned word. Loading the words at the range's edges
    /// byte by byte would tear them.
    #[test]
    fn words_never_tear_under_a_concurrent_writer() {
        const LEN: usize = 64;
        const MAX_READS: u64 = 2_000_000;
        let backing: Vec<AtomicU64> = (0..LEN / 8).map(|_| AtomicU64::new(0)).collect();
        let stop = AtomicBool::new(false);
        let base = || backing.as_ptr().cast::<u8>().cast_mut();
        let (reads, torn) = std::thread::scope(|s| {
            s.spawn(|| {
                let mut n = 0u8;
                while !stop.load(Ordering::Relaxed) {
                    n = n.wrapping_add(1);
                    // SAFETY: LEN bytes of `backing`, 8-aligned; the reader
                    // uses copy_from_shared.
                    unsafe { copy_to_shared(base(), &[n; LEN]) };
                }
            });
            // Reads before the writer's first store would prove nothing.
            while backing[LEN / 8 - 1].load(Ordering::Relaxed) == 0 {
                std::hint::spin_loop();
            }
            let deadline = Instant::now() + Duration::from_secs(1);
            let (mut reads, mut torn) = (0u64, None);
            let mut dst = [0u8; LEN];
            'outer: while reads < MAX_READS && Instant::now() < deadline {
                for off in 0..8 {
                    for len in [1, 2, 7, 8, 9, 15, 16, 17, LEN - off] {
                        let len = len.min(LEN - off);
                        // SAFETY: off + len <= LEN; the writer uses copy_to_shared.
                        unsafe { copy_from_shared(base().add(off), &mut dst[..len]) };
                        reads += 1;
                        let word_of = |j: usize| (off + j) / 8;
                        if let Some(j) = (1..len).find(|&j| word_of(j) == word_of(j - 1) && dst[j] != dst[j - 1]) {
                            torn = Some(format!("off {off} len {len}: byte {j} differs: {:?}", &dst[..len]));
                            break 'outer;
                        }
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
            (reads, torn)
        });
        assert!(torn.is_none(), "a word tore after {reads} reads: {}", torn.unwrap_or_default());
        assert!(reads > 0);
    }

    /// Reads of a read-only mapping near its end load only words inside
    /// it. The mapping extends one block past the end of its file, so a
    /// load past the end would not read zeros but die of SIGBUS.
    #[test]
    fn reads_a_read_only_mapping_up_to_its_end() {
        // A multiple of every common page size (4, 16 and 64 KiB).
        const LEN: usize = 64 << 10;
        let path = std::env::temp_dir().join(format!("dmkv-racy-{}", std::process::id()));
        let src = pattern(LEN);
        File::create(&path).and_then(|mut f| f.write_all(&src)).expect("write temp file");
        let file = File::open(&path).expect("reopen read-only");
        std::fs::remove_file(&path).expect("remove temp file");
        let map = MmapOptions::new().len(2 * LEN).map_raw_read_only(&file).expect("map read-only");
        let base = map.as_ptr();
        for start in LEN - 24..=LEN {
            for len in 0..=LEN - start {
                let mut dst = vec![0u8; len];
                // SAFETY: the covering words of start..start + len end at or
                // before LEN, inside the file; nothing writes the file.
                unsafe { copy_from_shared(base.add(start), &mut dst) };
                assert_eq!(dst, src[start..start + len], "start {start} len {len}");
            }
        }
        // SAFETY: the file's last word, aligned.
        let last = unsafe { load_word(base.add(LEN - 8)) };
        assert_eq!(last.to_ne_bytes(), src[LEN - 8..]);
    }
}
