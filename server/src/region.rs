//! The server's remote-memory region: one shared mapping of a memfd, so it
//! can be handed to same-host readers, registered with an RDMA device, or
//! served by the software one-sided engine.
//!
//! All access goes through raw pointers and atomics ([`dmkv_common::racy`]),
//! never through Rust references, because other threads and processes read
//! it while the writer changes it. This module and `racy` hold the server's
//! `unsafe`.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use dmkv_common::racy;
use memmap2::{MmapOptions, MmapRaw};

/// A shared, memfd-backed memory region.
pub struct Region {
    map: MmapRaw,
    fd: OwnedFd,
    len: usize,
}

// Shared between the service, the engine and the handoff threads. That
// needs no `unsafe impl`: `MmapRaw` is Send + Sync, and sharing is sound
// because every access goes through `racy`. This fails to build if a field
// ever changes that.
const _: fn() = || {
    fn check<T: Send + Sync>() {}
    check::<Region>();
};

impl Region {
    /// Creates a zero-filled region of `len` bytes in a new memfd and maps it
    /// shared, read-write. Pages are allocated lazily by the kernel. `len`
    /// must be a multiple of 8.
    pub fn create(name: &str, len: usize) -> io::Result<Region> {
        // Reads load the whole words covering a range; with a whole number
        // of words (and a page-aligned base) those stay inside the region.
        if !len.is_multiple_of(8) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("region length {len} is not a multiple of 8"),
            ));
        }
        let cname = std::ffi::CString::new(name).map_err(|_| io::Error::other("region name has a NUL byte"))?;
        // SAFETY: `cname` is a valid C string; flags are valid for memfd_create.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor we own exclusively.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let file = File::from(fd);
        file.set_len(len as u64)?;
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        // Transparent huge pages cut TLB misses on random GETs; the kernel may
        // refuse for shmem (see shmem_enabled), which is fine.
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Region { map, fd: file.into(), len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is zero bytes long (never, once created).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, for handing the region to same-host readers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Base address of the mapping (for RDMA registration).
    pub fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn check(&self, offset: u64, len: usize) -> usize {
        let off = usize::try_from(offset).expect("offset fits usize");
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "region access {off}+{len} out of bounds");
        off
    }

    /// Whether `[offset, offset+len)` lies inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len as u64)
    }

    /// Copies bytes out of the region, from any offset; they may be torn by
    /// a concurrent writer and must be verified. Panics if out of bounds
    /// (callers check untrusted offsets with [`Region::contains`] first).
    pub fn read(&self, offset: u64, dst: &mut [u8]) {
        let off = self.check(offset, dst.len());
        // SAFETY: the words covering off..off + len lie inside the mapping:
        // its base is page-aligned and its length a multiple of 8 (checked
        // in `create`), so rounding an in-bounds range out to words stays in
        // bounds. The mapping lives as long as `self`; all writers store
        // whole aligned words atomically (`write`, `store_slot`).
        unsafe { racy::copy_from_shared(self.map.as_ptr().add(off), dst) }
    }

    /// Writes bytes into the region with atomic stores of whole words, at an
    /// 8-aligned offset. The last word is padded with zeros, so the bytes up
    /// to the next multiple of 8 must belong to the caller too.
    pub fn write(&self, offset: u64, src: &[u8]) {
        assert!(offset.is_multiple_of(8), "unaligned region write at {offset}");
        let off = self.check(offset, src.len().next_multiple_of(8));
        // SAFETY: 8-aligned (asserted; the base is page-aligned) and in
        // bounds including the padding; all readers load whole words
        // atomically.
        unsafe { racy::copy_to_shared(self.map.as_mut_ptr().add(off), src) }
    }

    /// Loads an 8-byte slot, ordered before the reads that follow it.
    pub fn load_slot(&self, offset: u64) -> u64 {
        let off = self.check(offset, 8);
        assert!(off.is_multiple_of(8), "unaligned slot");
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned).
        unsafe { racy::load_word(self.map.as_ptr().add(off)) }
    }

    /// Stores an 8-byte slot with release ordering (publishes an item).
    pub fn store_slot(&self, offset: u64, v: u64) {
        let off = self.check(offset, 8);
        assert!(off.is_multiple_of(8), "unaligned slot");
        // SAFETY: in bounds and 8-aligned.
        unsafe { racy::store_word(self.map.as_mut_ptr().add(off), v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_write_and_slots() {
        let r = Region::create("test", 1 << 20).unwrap();
        r.write(4096, b"hello world");
        let mut b = [0u8; 11];
        r.read(4096, &mut b);
        assert_eq!(&b, b"hello world");
        r.store_slot(8, 42);
        assert_eq!(r.load_slot(8), 42);
        assert!(r.contains(0, 1 << 20));
        assert!(!r.contains(1, 1 << 20));
        assert!(!r.contains(u64::MAX, 2));
    }

    #[test]
    fn reads_any_range_up_to_the_end() {
        let r = Region::create("test", 1 << 20).unwrap();
        let end = 1 << 20;
        r.write(end - 16, b"0123456789abcdef");
        for start in end - 16..=end {
            for len in 0..=(end - start) as usize {
                let mut b = vec![0u8; len];
                r.read(start, &mut b);
                let from = (start - (end - 16)) as usize;
                assert_eq!(b, b"0123456789abcdef"[from..from + len]);
            }
        }
    }

    #[test]
    fn rejects_lengths_that_are_not_whole_words() {
        assert!(Region::create("test", (1 << 20) + 4).is_err());
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_panics() {
        let r = Region::create("test", 1 << 20).unwrap();
        r.write((1 << 20) - 8, b"abcdefghi");
    }

    #[test]
    #[should_panic(expected = "unaligned")]
    fn unaligned_write_panics() {
        let r = Region::create("test", 1 << 20).unwrap();
        r.write(4097, b"abc");
    }
}
