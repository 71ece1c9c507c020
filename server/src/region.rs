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
use rustix::fs::SealFlags;

/// The seals every region carries once the server has mapped it: its size
/// is fixed, and no one can open a new way to write it (`write(2)`, a new
/// writable mapping) while the server's own mapping keeps working; nor can
/// anyone change the seals again. Clients check for exactly these
/// (`dmkv_client::onesided::shm`) before they map a handed-over region.
pub const REGION_SEALS: SealFlags =
    SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::FUTURE_WRITE).union(SealFlags::SEAL);

/// An access outside the region (an offset from untrusted input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBounds {
    pub offset: u64,
    pub len: usize,
}

impl std::fmt::Display for OutOfBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "region access {}+{} out of bounds", self.offset, self.len)
    }
}

impl std::error::Error for OutOfBounds {}

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
        // Sealed only now: the server's own writable mapping exists, and
        // FUTURE_WRITE refuses every later one (and write(2)) for everyone,
        // however the descriptor was reopened — memfd inodes are mode 0777,
        // so a read-only descriptor alone does not stop a client that
        // reopens it through /proc/self/fd.
        rustix::fs::fcntl_add_seals(&file, REGION_SEALS).map_err(io::Error::from)?;
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

    /// The offset as an index if `[offset, offset+len)` is inside.
    fn check(&self, offset: u64, len: usize) -> Result<usize, OutOfBounds> {
        usize::try_from(offset)
            .ok()
            .filter(|off| off.checked_add(len).is_some_and(|end| end <= self.len))
            .ok_or(OutOfBounds { offset, len })
    }

    /// Like `check`, for accesses whose bounds the server itself computed
    /// (its own allocations, the header): failing is a bug in the server.
    fn check_own(&self, offset: u64, len: usize) -> usize {
        self.check(offset, len).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Whether `[offset, offset+len)` lies inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len as u64)
    }

    /// Copies bytes out of the region, from any offset; they may be torn by
    /// a concurrent writer and must be verified. Panics if out of bounds
    /// (callers check untrusted offsets with [`Region::contains`] first, or
    /// use [`Region::try_read`]).
    pub fn read(&self, offset: u64, dst: &mut [u8]) {
        if let Err(e) = self.try_read(offset, dst) {
            panic!("{e}");
        }
    }

    /// [`Region::read`], refusing an out-of-bounds range instead.
    pub fn try_read(&self, offset: u64, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        let off = self.check(offset, dst.len())?;
        // SAFETY: the words covering off..off + len lie inside the mapping:
        // its base is page-aligned and its length a multiple of 8 (checked
        // in `create`), so rounding an in-bounds range out to words stays in
        // bounds. The mapping lives as long as `self`; all writers store
        // whole aligned words atomically (`write`, `store_slot`).
        unsafe { racy::copy_from_shared(self.map.as_ptr().add(off), dst) }
        Ok(())
    }

    /// Writes bytes into the region with atomic stores of whole words, at an
    /// 8-aligned offset. The last word is padded with zeros, so the bytes up
    /// to the next multiple of 8 must belong to the caller too.
    pub fn write(&self, offset: u64, src: &[u8]) {
        assert!(offset.is_multiple_of(8), "unaligned region write at {offset}");
        let off = self.check_own(offset, src.len().next_multiple_of(8));
        // SAFETY: 8-aligned (asserted; the base is page-aligned) and in
        // bounds including the padding; all readers load whole words
        // atomically.
        unsafe { racy::copy_to_shared(self.map.as_mut_ptr().add(off), src) }
    }

    /// Loads an 8-byte word, ordered before the reads that follow it.
    /// What it returns is whatever is in shared memory: never trust it for
    /// the server's own decisions (the store keeps its own copy of the
    /// index for that).
    pub fn load_slot(&self, offset: u64) -> u64 {
        let off = self.check_own(offset, 8);
        assert!(off.is_multiple_of(8), "unaligned slot");
        // SAFETY: in bounds and 8-aligned (the mapping is page-aligned).
        unsafe { racy::load_word(self.map.as_ptr().add(off)) }
    }

    /// Stores an 8-byte slot with release ordering (publishes an item).
    pub fn store_slot(&self, offset: u64, v: u64) {
        let off = self.check_own(offset, 8);
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
    fn try_read_refuses_what_read_would_panic_on() {
        let r = Region::create("test", 1 << 20).unwrap();
        let mut b = [0u8; 16];
        assert!(r.try_read((1 << 20) - 16, &mut b).is_ok());
        assert_eq!(r.try_read((1 << 20) - 8, &mut b), Err(OutOfBounds { offset: (1 << 20) - 8, len: 16 }));
        assert!(r.try_read(u64::MAX, &mut b).is_err());
        assert!(r.try_read(u64::MAX - 4, &mut b[..0]).is_err());
    }

    /// What a client is handed must be unwritable however it reopens it,
    /// and the server's own mapping must stay writable.
    #[test]
    fn the_memfd_is_sealed_and_the_servers_mapping_still_writes() {
        let r = Region::create("test", 1 << 20).unwrap();
        assert_eq!(rustix::fs::fcntl_get_seals(r.fd()).unwrap(), REGION_SEALS);
        let rw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&r.fd())))
            .unwrap();
        let err = std::io::Write::write(&mut &rw, b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        let err = MmapOptions::new().len(4096).map_raw(&rw).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        assert!(rw.set_len(2 << 20).is_err() && rw.set_len(4096).is_err());
        r.write(8192, b"still mine");
        let mut b = [0u8; 10];
        r.read(8192, &mut b);
        assert_eq!(&b, b"still mine");
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
