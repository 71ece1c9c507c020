//! `dmkv-verbs`: the small, safe subset of libibverbs that dmkv needs for one-sided RDMA READs.
//!
//! dmkv's server exposes its remote-memory region for RDMA READ; clients fetch index entries and
//! values with batches of READs over reliable-connected (RC) queue pairs. This crate is the only
//! place in dmkv that touches the verbs API, and every `unsafe` block of that path lives here.
//!
//! The building blocks:
//! - [`Context`]: an opened device, the chosen port and GID, and a protection domain.
//! - [`MemoryRegion`]: memory registered for remote reads (the server's region), and
//!   [`LocalBuffer`]: an owned, registered buffer the NIC writes READ results into.
//! - [`QueuePair`]: an RC queue pair with its own completion queue; connect it with the peer's
//!   [`Endpoint`] (exchanged out of band, e.g. over dmkv's TCP control connection), then
//!   [`QueuePair::post_reads`] / [`QueuePair::poll`] or [`QueuePair::read_batch`].
//!
//! The raw bindings come from `ibverbs-sys`: the safe `ibverbs` crate cannot post RDMA READs nor
//! register memory it did not allocate. `ibv_post_send` and `ibv_poll_cq` are `static inline`
//! functions in `<infiniband/verbs.h>` that bindgen does not bind; like them, this crate calls
//! the provider's function pointers in `ibv_context.ops`.
//!
//! On a machine without RDMA support [`Context::open`] returns [`VerbsError::NoDevice`]; callers
//! fall back to another transport.

use std::alloc::{self, Layout};
use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::ffi::{CStr, c_int, c_void};
use std::hash::{BuildHasher, Hasher};
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use ibverbs_sys as sys;

/// Most READs one [`QueuePair::post_reads`] call accepts (one doorbell for the whole batch).
pub const MAX_READS_PER_BATCH: usize = 256;
/// Largest send queue (outstanding READ work requests) a [`QueuePair`] may ask for.
pub const MAX_SEND_QUEUE_DEPTH: u32 = 4096;
/// Largest single READ. The verbs limit is 2^31 bytes; dmkv's reads are far smaller, so anything
/// near the limit is a caller bug worth rejecting early.
pub const MAX_READ_LEN: u32 = 1 << 30;
/// Outstanding RDMA READs / atomics per QP on the wire, both as requester (`max_rd_atomic`) and
/// responder (`max_dest_rd_atomic`); lowered to the device's limits. Both peers use the same
/// rule, so with the same device model they agree.
pub const MAX_RD_ATOMIC: u8 = 16;
/// Local ACK timeout exponent: 4.096 µs * 2^14 ≈ 67 ms before a request is retransmitted.
pub const ACK_TIMEOUT: u8 = 14;
/// Transport retries before a lost peer turns into `IBV_WC_RETRY_EXC_ERR` (7 is the maximum;
/// 7 * 67 ms ≈ 0.5 s to detect a dead server).
pub const RETRY_COUNT: u8 = 7;
/// RNR retries. Only SENDs can hit receiver-not-ready and dmkv never sends, but 7 would mean
/// "retry forever", so keep it finite.
pub const RNR_RETRY: u8 = 3;
/// Minimal RNR NAK timer advertised by the responder (12 = 0.64 ms), unused by READs.
pub const MIN_RNR_TIMER: u8 = 12;
/// GRH hop limit for RoCE v2 packets (routable; 64 is the usual default).
pub const HOP_LIMIT: u8 = 64;
/// Work completions fetched per `ibv_poll_cq` call.
pub const POLL_BATCH: usize = 16;
/// Alignment of [`LocalBuffer`] allocations (a page: the NIC pins whole pages anyway).
pub const LOCAL_BUFFER_ALIGN: usize = 4096;
/// Busy-poll iterations between `yield_now` calls in [`QueuePair::read_batch`], so a spinning
/// client does not starve the kernel threads that drive Soft-RoCE on a small machine.
const SPINS_PER_YIELD: u32 = 256;
/// PSNs are 24-bit.
const PSN_MASK: u32 = 0x00ff_ffff;
/// Low bits of the NIC-level wr_id that hold a read's index in its batch (above: batch number).
const BATCH_INDEX_BITS: u32 = 16;
const _: () = assert!(MAX_READS_PER_BATCH <= 1 << BATCH_INDEX_BITS);

/// `ibv_wc_status` of a remote protection error (wrong rkey, out-of-bounds, no remote-read access).
pub const WC_STATUS_REM_ACCESS_ERR: u32 = sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
/// `ibv_wc_status` of a work request flushed because its QP went to the error state.
pub const WC_STATUS_WR_FLUSH_ERR: u32 = sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
/// `ibv_wc_status` of a transport retry timeout (peer gone or unreachable).
pub const WC_STATUS_RETRY_EXC_ERR: u32 = sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR;

/// Errors of this crate. Verb failures name the verb and errno; completion failures carry the
/// work-completion status and its `ibv_wc_status_str` text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA support: libibverbs reports ENOSYS (no kernel support) or an empty device list.
    #[error("no RDMA device available")]
    NoDevice,
    /// Devices exist, but none has this name.
    #[error("RDMA device {0:?} not found")]
    DeviceNotFound(String),
    /// The chosen device (or every device) has no port in the ACTIVE state.
    #[error("no ACTIVE port on the RDMA device(s)")]
    NoActivePort,
    /// A verb failed.
    #[error("{verb} failed: {} (errno {errno})", std::io::Error::from_raw_os_error(*errno))]
    Verb {
        /// The libibverbs function that failed.
        verb: &'static str,
        /// Its errno.
        errno: i32,
    },
    /// A work request completed with an error status. The QP is now in the error state: every
    /// other outstanding request is flushed and the QP must be recreated and reconnected.
    #[error("work request {wr_id} failed: {status_str} (ibv_wc_status {status})")]
    Completion {
        /// Caller's `wr_id` of the failed read.
        wr_id: u64,
        /// `ibv_wc_status` value (see the `WC_STATUS_*` constants).
        status: u32,
        /// `ibv_wc_status_str(status)`.
        status_str: String,
    },
    /// The send queue has no room for the batch; poll completions first.
    #[error("send queue full")]
    QueueFull,
    /// The queue pair is in the error state after a failed completion (or a partial post);
    /// create and connect a new one.
    #[error("queue pair is in the error state; recreate it")]
    QpFailed,
    /// The call does not fit the queue pair's state (e.g. posting before `connect`).
    #[error("invalid queue pair state: {0}")]
    InvalidState(&'static str),
    /// A request violates a documented limit (batch size, read length, buffer bounds).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// An encoded [`Endpoint`] is malformed.
    #[error("bad endpoint encoding: {0}")]
    BadEndpoint(String),
    /// The deadline passed before the batch completed. The batch is still outstanding: its
    /// buffer stays busy until a later [`QueuePair::poll`] sees it complete.
    #[error("deadline passed before the batch completed")]
    Timeout,
    /// The [`LocalBuffer`] is the target of reads that have not completed yet.
    #[error("local buffer still has reads in flight")]
    BufferBusy,
}

/// The errno of the last failed libc/libibverbs call.
fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Maps a verb's int return to a result. libibverbs verbs return 0 on success and, depending on
/// the verb and version, either a positive errno or -1 with `errno` set.
fn check(verb: &'static str, rc: c_int) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::Verb { verb, errno: rc }),
        _ => Err(VerbsError::Verb { verb, errno: last_errno() }),
    }
}

fn wc_status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str accepts any value and returns a pointer to a static string.
    let p = unsafe { sys::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("unknown status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static lifetime (a string literal table in libibverbs).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Converts an `ibv_mtu` enum value (1..=5) to bytes.
pub fn mtu_bytes(mtu: u32) -> Option<u32> {
    (1..=5).contains(&mtu).then(|| 128 << mtu)
}

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// An opened RDMA device: the chosen port, its GID index and a protection domain.
///
/// Shared through `Arc`: memory regions and queue pairs keep their context alive, because the
/// protection domain and device must outlive everything created from them.
pub struct Context {
    ctx: *mut sys::ibv_context,
    pd: *mut sys::ibv_pd,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    active_mtu: u32,
    link_layer: u8,
    max_msg_sz: u32,
    max_qp_wr: u32,
    max_cqe: u32,
    rd_atomic: u8,
}

// SAFETY: libibverbs contexts and PDs are thread-safe (the library locks internally); Context
// never hands out its raw pointers and its own fields are immutable after open.
unsafe impl Send for Context {}
// SAFETY: see Send; all methods take &self and only read immutable fields or call thread-safe verbs.
unsafe impl Sync for Context {}

/// Closes a device list on every path out of `Context::open`.
struct DeviceList(*mut *mut sys::ibv_device, usize);

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the pointer came from ibv_get_device_list and is freed exactly once; contexts
        // opened from it stay valid after the list is freed (documented by libibverbs).
        unsafe { sys::ibv_free_device_list(self.0) };
    }
}

impl Context {
    /// Opens `device` (by name, e.g. `rxe0`) or, with `None`, the first device that has an
    /// ACTIVE port. The GID index prefers a RoCE v2 IPv4-mapped GID (`::ffff:a.b.c.d`, routable
    /// and what Soft-RoCE peers expect), else 0.
    ///
    /// Without RDMA support this returns [`VerbsError::NoDevice`]; it never panics.
    pub fn open(device: Option<&str>) -> Result<Arc<Context>, VerbsError> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer; a null return is handled below.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let errno = last_errno();
            return Err(if errno == libc::ENOSYS || errno == libc::ENOENT {
                VerbsError::NoDevice
            } else {
                VerbsError::Verb { verb: "ibv_get_device_list", errno }
            });
        }
        let list = DeviceList(list, n.max(0) as usize);
        if list.1 == 0 {
            return Err(VerbsError::NoDevice);
        }
        let mut found_name = false;
        for i in 0..list.1 {
            // SAFETY: i < n entries of the array returned by ibv_get_device_list.
            let dev = unsafe { *list.0.add(i) };
            // SAFETY: dev is a valid device of the live list; the name is a NUL-terminated
            // string owned by the device.
            let name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
            if device.is_some_and(|want| want != name) {
                continue;
            }
            found_name = true;
            match Self::open_device(dev, name) {
                Ok(ctx) => return Ok(Arc::new(ctx)),
                // A named device must work; without a name, try the next one.
                Err(e) if device.is_some() => return Err(e),
                Err(_) => continue,
            }
        }
        match device {
            Some(want) if !found_name => Err(VerbsError::DeviceNotFound(want.to_string())),
            _ => Err(VerbsError::NoActivePort),
        }
    }

    fn open_device(dev: *mut sys::ibv_device, name: String) -> Result<Context, VerbsError> {
        // SAFETY: dev comes from the live device list.
        let ctx = unsafe { sys::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(VerbsError::Verb { verb: "ibv_open_device", errno: last_errno() });
        }
        // From here the context is owned; close it on every error path.
        let close = |e: VerbsError| {
            // SAFETY: ctx was opened above and nothing else references it yet.
            unsafe { sys::ibv_close_device(ctx) };
            e
        };
        let mut dattr = sys::ibv_device_attr::default();
        // SAFETY: ctx is open; dattr is a valid, writable ibv_device_attr.
        check("ibv_query_device", unsafe { sys::ibv_query_device(ctx, &mut dattr) }).map_err(close)?;

        let mut chosen = None;
        for port in 1..=dattr.phys_port_cnt {
            let mut pattr = sys::ibv_port_attr::default();
            // SAFETY: the exported ibv_query_port fills the leading "compat" part of
            // ibv_port_attr (every field up to link_layer); we pass the full, zeroed struct, so
            // the write stays in bounds and the newer trailing fields stay zero.
            let rc = unsafe { sys::ibv_query_port(ctx, port, (&mut pattr as *mut sys::ibv_port_attr).cast()) };
            check("ibv_query_port", rc).map_err(close)?;
            if pattr.state == sys::ibv_port_state::IBV_PORT_ACTIVE {
                chosen = Some((port, pattr));
                break;
            }
        }
        let Some((port, pattr)) = chosen else {
            return Err(close(VerbsError::NoActivePort));
        };
        let (gid_index, gid) = Self::choose_gid(ctx, port, pattr.gid_tbl_len).map_err(close)?;

        // SAFETY: ctx is open.
        let pd = unsafe { sys::ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(close(VerbsError::Verb { verb: "ibv_alloc_pd", errno: last_errno() }));
        }
        let rd_atomic = MAX_RD_ATOMIC
            .min(dattr.max_qp_rd_atom.clamp(1, 255) as u8)
            .min(dattr.max_qp_init_rd_atom.clamp(1, 255) as u8);
        Ok(Context {
            ctx,
            pd,
            name,
            port,
            gid_index,
            gid,
            lid: pattr.lid,
            active_mtu: pattr.active_mtu,
            link_layer: pattr.link_layer,
            max_msg_sz: pattr.max_msg_sz,
            max_qp_wr: dattr.max_qp_wr.max(1) as u32,
            max_cqe: dattr.max_cqe.max(1) as u32,
            rd_atomic,
        })
    }

    /// Picks the first RoCE v2 IPv4-mapped GID, else index 0.
    fn choose_gid(ctx: *mut sys::ibv_context, port: u8, tbl_len: c_int) -> Result<(u8, [u8; 16]), VerbsError> {
        // GID indexes travel in a u8 (ibv_global_route.sgid_index).
        for idx in 0..tbl_len.clamp(0, 256) as u32 {
            let mut entry = sys::ibv_gid_entry::default();
            // SAFETY: ctx is open; entry is a valid out-struct of the size we pass.
            let rc = unsafe {
                sys::_ibv_query_gid_ex(ctx, port.into(), idx, &mut entry, 0, size_of::<sys::ibv_gid_entry>())
            };
            if rc != 0 {
                // Empty table slots report ENODATA; older providers lack the call. Either way
                // this slot is not a usable RoCE v2 GID.
                continue;
            }
            // SAFETY: every bit pattern of the 16-byte union is a valid [u8; 16].
            let raw = unsafe { entry.gid.raw };
            if entry.gid_type == sys::IBV_GID_TYPE_ROCE_V2 && is_ipv4_mapped(&raw) {
                return Ok((idx as u8, raw));
            }
        }
        let mut gid = sys::ibv_gid::default();
        // SAFETY: ctx is open; gid is a valid out-union.
        check("ibv_query_gid", unsafe { sys::ibv_query_gid(ctx, port, 0, &mut gid) })?;
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok((0, unsafe { gid.raw }))
    }

    /// The device name, e.g. `rxe0` or `mlx5_0`.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The chosen (ACTIVE) port number.
    pub fn port(&self) -> u8 {
        self.port
    }

    /// The GID index used as source GID.
    pub fn gid_index(&self) -> u8 {
        self.gid_index
    }

    /// The source GID (network byte order, as in the GID table).
    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }

    /// The port's active MTU as an `ibv_mtu` value (1 = 256 B … 5 = 4096 B; see [`mtu_bytes`]).
    pub fn active_mtu(&self) -> u32 {
        self.active_mtu
    }

    /// Whether the port runs over Ethernet (RoCE), which makes every QP use a GRH.
    pub fn is_roce(&self) -> bool {
        u32::from(self.link_layer) == sys::IBV_LINK_LAYER_ETHERNET
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc<Context>, so none is alive here; pd and ctx are
        // released exactly once, the PD first because it belongs to the context.
        unsafe {
            sys::ibv_dealloc_pd(self.pd);
            sys::ibv_close_device(self.ctx);
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("active_mtu", &self.active_mtu)
            .finish_non_exhaustive()
    }
}

/// A registered memory region; deregistered on drop.
pub struct MemoryRegion {
    mr: *mut sys::ibv_mr,
    ctx: Arc<Context>,
}

// SAFETY: the MR handle is only read (keys, address) or deregistered once in Drop; libibverbs
// allows deregistration from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: all &self methods only read immutable fields of the ibv_mr.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    fn register(ctx: &Arc<Context>, ptr: *mut u8, len: usize, access: u32) -> Result<MemoryRegion, VerbsError> {
        if ptr.is_null() || len == 0 {
            return Err(VerbsError::InvalidRequest("cannot register an empty or null region".into()));
        }
        // SAFETY: the PD is alive (ctx is borrowed); the callers guarantee [ptr, ptr+len) is
        // mapped memory that outlives the returned MR.
        let mr = unsafe { sys::ibv_reg_mr(ctx.pd, ptr.cast::<c_void>(), len, access as c_int) };
        if mr.is_null() {
            return Err(VerbsError::Verb { verb: "ibv_reg_mr", errno: last_errno() });
        }
        Ok(MemoryRegion { mr, ctx: Arc::clone(ctx) })
    }

    /// Registers memory the caller owns (e.g. a `memmap2` mapping) for remote READs.
    ///
    /// Access is `IBV_ACCESS_REMOTE_READ` only: peers holding the rkey can read any byte of the
    /// region at any time, and nobody can write it through the NIC.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid, mapped memory for as long as the returned region lives
    /// (drop the region before unmapping), and its contents are exposed to every peer with the
    /// rkey.
    pub unsafe fn register_remote_read(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<MemoryRegion, VerbsError> {
        Self::register(ctx, ptr, len, sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0)
    }

    /// Allocates and registers a zeroed, page-aligned local buffer of `len` bytes that the NIC
    /// writes READ results into (`IBV_ACCESS_LOCAL_WRITE` only).
    pub fn register_local(ctx: &Arc<Context>, len: usize) -> Result<LocalBuffer, VerbsError> {
        LocalBuffer::new(ctx, len)
    }

    /// The key peers put into their READ work requests.
    pub fn rkey(&self) -> u32 {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).rkey }
    }

    /// The key local work requests use in their scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).lkey }
    }

    /// Start address of the region (virtual address, what peers use as `remote_addr`).
    pub fn addr(&self) -> u64 {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).addr as u64 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).length }
    }

    /// Always false: registering an empty region is rejected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device context this region belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Deregisters now and reports a failure that `Drop` would have to ignore.
    pub fn deregister(self) -> Result<(), VerbsError> {
        let this = ManuallyDrop::new(self);
        // SAFETY: mr is live and, with Drop suppressed, deregistered exactly once.
        let rc = unsafe { sys::ibv_dereg_mr(this.mr) };
        // SAFETY: the Arc is moved out exactly once from a value whose Drop never runs.
        drop(unsafe { ptr::read(&this.ctx) });
        check("ibv_dereg_mr", rc)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: mr is live and deregistered exactly once. A failure (EBUSY when a memory
        // window is still bound; dmkv binds none) cannot be reported from Drop.
        unsafe { sys::ibv_dereg_mr(self.mr) };
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

/// The allocation and registration behind a [`LocalBuffer`]; also held by in-flight batches so
/// the memory the NIC writes into outlives the batch even if the buffer handle is dropped.
struct LocalInner {
    mr: ManuallyDrop<MemoryRegion>,
    ptr: *mut u8,
    layout: Layout,
    /// Posted batches targeting this buffer that have not completed (or been torn down) yet.
    in_flight: AtomicUsize,
}

// SAFETY: the raw pointer is an exclusively owned heap allocation; access to its bytes is
// guarded by `in_flight` and the borrow rules of LocalBuffer (see LocalBuffer docs).
unsafe impl Send for LocalInner {}
// SAFETY: as above; shared access only creates shared views while no NIC write is in flight.
unsafe impl Sync for LocalInner {}

impl Drop for LocalInner {
    fn drop(&mut self) {
        // SAFETY: deregister before freeing so the NIC can no longer reach the memory; the MR is
        // taken exactly once, here.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
        // SAFETY: ptr was allocated with exactly this layout in LocalBuffer::new.
        unsafe { alloc::dealloc(self.ptr, self.layout) };
    }
}

/// A registered, owned buffer that RDMA READs land in.
///
/// Soundness rule: the NIC writes into the buffer while a batch is in flight, so
/// [`QueuePair::post_reads`] takes `&mut LocalBuffer` (no byte view can be alive while posting)
/// and [`LocalBuffer::as_slice`] fails with [`VerbsError::BufferBusy`] until every batch that
/// targets the buffer has completed.
pub struct LocalBuffer {
    inner: Arc<LocalInner>,
}

impl LocalBuffer {
    /// Same as [`MemoryRegion::register_local`].
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<LocalBuffer, VerbsError> {
        let layout = Layout::from_size_align(len.max(1), LOCAL_BUFFER_ALIGN)
            .map_err(|e| VerbsError::InvalidRequest(format!("local buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(VerbsError::Verb { verb: "alloc", errno: libc::ENOMEM });
        }
        match MemoryRegion::register(ctx, ptr, layout.size(), sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0) {
            Ok(mr) => Ok(LocalBuffer {
                inner: Arc::new(LocalInner { mr: ManuallyDrop::new(mr), ptr, layout, in_flight: AtomicUsize::new(0) }),
            }),
            Err(e) => {
                // SAFETY: allocated above with this layout, never registered.
                unsafe { alloc::dealloc(ptr, layout) };
                Err(e)
            }
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.layout.size()
    }

    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Local key of the registration.
    pub fn lkey(&self) -> u32 {
        self.inner.mr.lkey()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.inner.ptr as u64
    }

    /// Whether reads into this buffer are still outstanding.
    pub fn is_busy(&self) -> bool {
        self.inner.in_flight.load(Ordering::Acquire) != 0
    }

    /// The whole buffer, once no read into it is outstanding.
    pub fn as_slice(&self) -> Result<&[u8], VerbsError> {
        if self.is_busy() {
            return Err(VerbsError::BufferBusy);
        }
        // SAFETY: the allocation is live (we hold the Arc) and initialized (zeroed, then
        // written only by completed DMA); no write is in flight (checked above) and none can
        // start while this shared borrow lives, because posting needs &mut self.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.ptr, self.len()) })
    }

    /// `len` bytes at `offset`, once no read into the buffer is outstanding.
    pub fn slice(&self, offset: usize, len: usize) -> Result<&[u8], VerbsError> {
        let all = self.as_slice()?;
        offset.checked_add(len).and_then(|end| all.get(offset..end)).ok_or_else(|| {
            VerbsError::InvalidRequest(format!("{offset}+{len} is outside the {} byte buffer", all.len()))
        })
    }

    /// Mutable view (e.g. to clear it between reads), once no read into it is outstanding.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], VerbsError> {
        if self.is_busy() {
            return Err(VerbsError::BufferBusy);
        }
        // SAFETY: as in as_slice; &mut self additionally excludes every other view.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr, self.len()) })
    }
}

impl std::fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("busy", &self.is_busy())
            .finish()
    }
}

/// What a peer needs to connect an RC queue pair to ours. Exchanged out of band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number of our send queue (24 bits).
    pub psn: u32,
    /// Our source GID (network byte order).
    pub gid: [u8; 16],
    /// Our port's LID (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Our port's active MTU as an `ibv_mtu` enum value (1 = 256 B … 5 = 4096 B), not bytes.
    pub mtu: u32,
}

impl Endpoint {
    /// Size of the wire encoding.
    pub const WIRE_LEN: usize = 30;

    /// Fixed little-endian layout: qpn u32 | psn u32 | gid [16] | lid u16 | mtu u32.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..24].copy_from_slice(&self.gid);
        b[24..26].copy_from_slice(&self.lid.to_le_bytes());
        b[26..30].copy_from_slice(&self.mtu.to_le_bytes());
        b
    }

    /// Decodes [`Endpoint::to_bytes`]; rejects a wrong length, a PSN wider than 24 bits and an
    /// MTU outside the `ibv_mtu` range.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint, VerbsError> {
        let b: &[u8; Self::WIRE_LEN] = b
            .try_into()
            .map_err(|_| VerbsError::BadEndpoint(format!("{} bytes, expected {}", b.len(), Self::WIRE_LEN)))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let ep =
            Endpoint { qpn: u32_at(0), psn: u32_at(4), gid, lid: u16::from_le_bytes([b[24], b[25]]), mtu: u32_at(26) };
        if ep.psn & !PSN_MASK != 0 {
            return Err(VerbsError::BadEndpoint(format!("psn {:#x} exceeds 24 bits", ep.psn)));
        }
        if mtu_bytes(ep.mtu).is_none() {
            return Err(VerbsError::BadEndpoint(format!("mtu {} is not an ibv_mtu value", ep.mtu)));
        }
        Ok(ep)
    }
}

/// One RDMA READ: `len` bytes at `remote_addr` (covered by `rkey`) into the local buffer at
/// `local_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    /// Caller's id, reported back in [`Completion::wr_id`].
    pub wr_id: u64,
    /// Remote virtual address.
    pub remote_addr: u64,
    /// Remote key of the region that contains the range.
    pub rkey: u32,
    /// Bytes to read (1..=[`MAX_READ_LEN`]).
    pub len: u32,
    /// Where the bytes land in the [`LocalBuffer`].
    pub local_offset: usize,
}

/// The outcome of one read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The read's [`ReadRequest::wr_id`].
    pub wr_id: u64,
    /// `Ok` when the bytes are in the local buffer.
    pub result: Result<(), VerbsError>,
}

/// A posted batch; the NIC reports it with one completion tagged `seq`.
struct InFlight {
    seq: u64,
    wr_ids: Vec<u64>,
    local: Arc<LocalInner>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Runs once the batch completed or its QP was destroyed: either way the NIC is done.
        self.local.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A finished batch waiting to be handed out by `poll`.
struct Finished {
    seq: u64,
    wr_ids: Vec<u64>,
    /// Index (in the batch) of the first failed read, its status and status text.
    error: Option<(usize, u32, String)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    Init,
    Ready,
    Failed,
}

type PostSendFn = unsafe extern "C" fn(*mut sys::ibv_qp, *mut sys::ibv_send_wr, *mut *mut sys::ibv_send_wr) -> c_int;
type PollCqFn = unsafe extern "C" fn(*mut sys::ibv_cq, c_int, *mut sys::ibv_wc) -> c_int;
type ReqNotifyCqFn = unsafe extern "C" fn(*mut sys::ibv_cq, c_int) -> c_int;

/// A reliable-connected queue pair with its own completion queue, for RDMA READs.
///
/// Created in INIT with remote-read access (so the same type serves the server side), then
/// [`connect`](QueuePair::connect)ed once. After any failed completion the QP is in the error
/// state: outstanding batches fail (flushed) and new posts return [`VerbsError::QpFailed`];
/// create a new QP and exchange endpoints again.
pub struct QueuePair {
    ctx: Arc<Context>,
    qp: *mut sys::ibv_qp,
    cq: *mut sys::ibv_cq,
    /// Completion channel of `cq` (null unless made by [`QueuePair::create_with_events`]).
    channel: *mut sys::ibv_comp_channel,
    post_send: PostSendFn,
    poll_cq: PollCqFn,
    req_notify_cq: Option<ReqNotifyCqFn>,
    psn: u32,
    state: QpState,
    sq_capacity: u32,
    outstanding_wrs: u32,
    next_seq: u64,
    in_flight: VecDeque<InFlight>,
    finished: VecDeque<Finished>,
    wr_scratch: Vec<sys::ibv_send_wr>,
    sge_scratch: Vec<sys::ibv_sge>,
    wc_scratch: [sys::ibv_wc; POLL_BATCH],
}

// SAFETY: a QP and its CQ may be used from any thread as long as calls are not concurrent; all
// methods that touch them take &mut self (QueuePair is deliberately not Sync).
unsafe impl Send for QueuePair {}

fn random_psn() -> u32 {
    // RandomState is seeded from OS randomness; a fresh PSN per QP keeps stale packets of an
    // earlier QP with the same number from being accepted.
    (RandomState::new().build_hasher().finish() as u32) & PSN_MASK
}

impl QueuePair {
    /// Creates an RC QP whose send queue holds `max_outstanding` READ work requests
    /// (1..=[`MAX_SEND_QUEUE_DEPTH`], lowered to the device limit) and moves it to INIT.
    pub fn create(ctx: &Arc<Context>, max_outstanding: u32) -> Result<QueuePair, VerbsError> {
        Self::create_inner(ctx, max_outstanding, false)
    }

    /// Like [`QueuePair::create`], with a completion channel: a caller can sleep on
    /// [`QueuePair::event_fd`] (non-blocking, e.g. in an async reactor) instead of busy-polling.
    /// The protocol: [`arm_events`](QueuePair::arm_events), poll once more (a completion that
    /// came before arming raises no event), wait until the fd is readable, then
    /// [`take_events`](QueuePair::take_events) and poll.
    pub fn create_with_events(ctx: &Arc<Context>, max_outstanding: u32) -> Result<QueuePair, VerbsError> {
        Self::create_inner(ctx, max_outstanding, true)
    }

    fn create_inner(ctx: &Arc<Context>, max_outstanding: u32, events: bool) -> Result<QueuePair, VerbsError> {
        if !(1..=MAX_SEND_QUEUE_DEPTH).contains(&max_outstanding) {
            return Err(VerbsError::InvalidRequest(format!(
                "max_outstanding {max_outstanding} outside 1..={MAX_SEND_QUEUE_DEPTH}"
            )));
        }
        let depth = max_outstanding.min(ctx.max_qp_wr);
        // Every WR can produce a completion when the QP fails (flushes are reported even for
        // unsignaled WRs), so the CQ holds the whole send queue to never overflow.
        let cqe = depth.min(ctx.max_cqe);
        let channel = if events { create_channel(ctx)? } else { ptr::null_mut() };
        // SAFETY: the context is open; `channel` is null or a live channel of this context.
        let cq = unsafe { sys::ibv_create_cq(ctx.ctx, cqe as c_int, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let errno = last_errno();
            destroy_channel(channel);
            return Err(VerbsError::Verb { verb: "ibv_create_cq", errno });
        }
        let mut init = sys::ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            cap: sys::ibv_qp_cap {
                max_send_wr: depth,
                // Providers insist on a receive queue; dmkv never posts receives.
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: sys::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: pd and cq are live; init is a valid attribute struct (updated with the real caps).
        let qp = unsafe { sys::ibv_create_qp(ctx.pd, &mut init) };
        if qp.is_null() {
            let errno = last_errno();
            // SAFETY: cq was created above and is not used by any QP.
            unsafe { sys::ibv_destroy_cq(cq) };
            destroy_channel(channel);
            return Err(VerbsError::Verb { verb: "ibv_create_qp", errno });
        }
        // SAFETY: qp is live; its context pointer is our open context.
        let ops = unsafe { &(*(*qp).context).ops };
        let (Some(post_send), Some(poll_cq)) = (ops.post_send, ops.poll_cq) else {
            // SAFETY: destroy what was created above, QP first.
            unsafe {
                sys::ibv_destroy_qp(qp);
                sys::ibv_destroy_cq(cq);
            }
            destroy_channel(channel);
            return Err(VerbsError::Verb { verb: "ibv_post_send", errno: libc::ENOSYS });
        };
        // From here `this` owns qp, cq and channel: its Drop releases them on every error path.
        let mut this = QueuePair {
            ctx: Arc::clone(ctx),
            qp,
            cq,
            channel,
            post_send,
            poll_cq,
            req_notify_cq: ops.req_notify_cq,
            psn: random_psn(),
            state: QpState::Init,
            // The provider may round the queue up; never plan with more than we asked for.
            sq_capacity: init.cap.max_send_wr.min(depth),
            outstanding_wrs: 0,
            next_seq: 0,
            in_flight: VecDeque::new(),
            finished: VecDeque::new(),
            wr_scratch: Vec::with_capacity(MAX_READS_PER_BATCH),
            sge_scratch: Vec::with_capacity(MAX_READS_PER_BATCH),
            wc_scratch: [sys::ibv_wc::default(); POLL_BATCH],
        };
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: ctx.port,
            // The responder side of READs needs REMOTE_READ; no write or atomic access ever.
            qp_access_flags: sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            ..Default::default()
        };
        use sys::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE.0 | M::IBV_QP_PKEY_INDEX.0 | M::IBV_QP_PORT.0 | M::IBV_QP_ACCESS_FLAGS.0;
        this.modify("ibv_modify_qp(INIT)", &mut attr, mask)?;
        Ok(this)
    }

    fn modify(&mut self, verb: &'static str, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<(), VerbsError> {
        // SAFETY: qp is live; attr is a valid attribute struct for the fields named in mask.
        check(verb, unsafe { sys::ibv_modify_qp(self.qp, attr, mask as c_int) })
    }

    /// What the peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            // SAFETY: qp is live; qp_num is immutable after creation.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            gid: self.ctx.gid,
            lid: self.ctx.lid,
            mtu: self.ctx.active_mtu,
        }
    }

    /// Number of READ work requests the send queue holds.
    pub fn capacity(&self) -> u32 {
        self.sq_capacity
    }

    /// Work requests posted and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.outstanding_wrs
    }

    /// Whether the QP is in the error state and must be recreated.
    pub fn is_failed(&self) -> bool {
        self.state == QpState::Failed
    }

    /// Connects to `remote`: INIT → RTR → RTS. Path MTU = min(local active, remote). On RoCE
    /// every packet carries a GRH (`is_global`, `dgid`, our `sgid_index`); on InfiniBand the
    /// peer's LID addresses it. Callable once.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<(), VerbsError> {
        if self.state != QpState::Init {
            return Err(VerbsError::InvalidState("connect needs a fresh QP in INIT"));
        }
        if mtu_bytes(remote.mtu).is_none() || remote.psn & !PSN_MASK != 0 {
            return Err(VerbsError::BadEndpoint(format!("{remote:?}")));
        }
        let roce = self.ctx.is_roce();
        let mut ah = sys::ibv_ah_attr {
            dlid: if roce { 0 } else { remote.lid },
            sl: 0,
            src_path_bits: 0,
            is_global: u8::from(roce),
            port_num: self.ctx.port,
            ..Default::default()
        };
        if roce {
            ah.grh.dgid.raw = remote.gid;
            ah.grh.sgid_index = self.ctx.gid_index;
            ah.grh.hop_limit = HOP_LIMIT;
        }
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: self.ctx.active_mtu.min(remote.mtu),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: self.ctx.rd_atomic,
            min_rnr_timer: MIN_RNR_TIMER,
            ah_attr: ah,
            ..Default::default()
        };
        use sys::ibv_qp_attr_mask as M;
        let rtr = M::IBV_QP_STATE.0
            | M::IBV_QP_AV.0
            | M::IBV_QP_PATH_MTU.0
            | M::IBV_QP_DEST_QPN.0
            | M::IBV_QP_RQ_PSN.0
            | M::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | M::IBV_QP_MIN_RNR_TIMER.0;
        self.modify("ibv_modify_qp(RTR)", &mut attr, rtr)?;
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::ibv_qp_state::IBV_QPS_RTS,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            rnr_retry: RNR_RETRY,
            sq_psn: self.psn,
            max_rd_atomic: self.ctx.rd_atomic,
            ..Default::default()
        };
        let rts = M::IBV_QP_STATE.0
            | M::IBV_QP_TIMEOUT.0
            | M::IBV_QP_RETRY_CNT.0
            | M::IBV_QP_RNR_RETRY.0
            | M::IBV_QP_SQ_PSN.0
            | M::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify("ibv_modify_qp(RTS)", &mut attr, rts)?;
        self.state = QpState::Ready;
        Ok(())
    }

    /// Posts `reads` as one linked list of work requests in a single `ibv_post_send` call (one
    /// doorbell). Only the last one is signaled: RC completes work requests in order, so its
    /// completion covers the whole batch, and an error on any of them is always reported.
    ///
    /// `local` is borrowed mutably so no byte view of it can be alive while the NIC writes;
    /// until the batch completes, [`LocalBuffer::as_slice`] returns [`VerbsError::BufferBusy`].
    /// Returns the batch's id, also used by [`QueuePair::read_batch`].
    pub fn post_reads(&mut self, reads: &[ReadRequest], local: &mut LocalBuffer) -> Result<u64, VerbsError> {
        match self.state {
            QpState::Init => return Err(VerbsError::InvalidState("post_reads before connect")),
            QpState::Failed => return Err(VerbsError::QpFailed),
            QpState::Ready => {}
        }
        if reads.is_empty() || reads.len() > MAX_READS_PER_BATCH {
            return Err(VerbsError::InvalidRequest(format!(
                "batch of {} reads, allowed 1..={MAX_READS_PER_BATCH}",
                reads.len()
            )));
        }
        let max_len = MAX_READ_LEN.min(self.ctx.max_msg_sz.max(1));
        for r in reads {
            let in_bounds = r.local_offset.checked_add(r.len as usize).is_some_and(|end| end <= local.len());
            if r.len == 0 || r.len > max_len || !in_bounds {
                return Err(VerbsError::InvalidRequest(format!(
                    "read {}: {} bytes at local offset {} (buffer {} bytes, max read {max_len})",
                    r.wr_id,
                    r.len,
                    r.local_offset,
                    local.len()
                )));
            }
        }
        let n = reads.len() as u32;
        if self.outstanding_wrs + n > self.sq_capacity {
            return Err(VerbsError::QueueFull);
        }

        let seq = self.next_seq;
        let (lkey, base) = (local.lkey(), local.addr());
        self.sge_scratch.clear();
        self.sge_scratch.extend(reads.iter().map(|r| sys::ibv_sge {
            addr: base + r.local_offset as u64,
            length: r.len,
            lkey,
        }));
        self.wr_scratch.clear();
        for (i, r) in reads.iter().enumerate() {
            // SAFETY: ibv_send_wr is plain C data for which all-zero is a valid (empty) value.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            // The index lets an error completion (reported even for unsignaled WRs) name the read.
            wr.wr_id = (seq << BATCH_INDEX_BITS) | i as u64;
            wr.sg_list = &mut self.sge_scratch[i];
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
            wr.send_flags = if i + 1 == reads.len() { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: r.remote_addr, rkey: r.rkey };
            self.wr_scratch.push(wr);
        }
        // Link only after the Vec is complete: pushing could have moved the elements.
        let head = self.wr_scratch.as_mut_ptr();
        for i in 0..reads.len() - 1 {
            // SAFETY: i and i + 1 are in bounds of wr_scratch, which is not resized below.
            unsafe { (*head.add(i)).next = head.add(i + 1) };
        }

        // Count the batch before posting: the NIC may write into the buffer as soon as the
        // doorbell rings.
        local.inner.in_flight.fetch_add(1, Ordering::AcqRel);
        let batch = InFlight { seq, wr_ids: reads.iter().map(|r| r.wr_id).collect(), local: Arc::clone(&local.inner) };
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: qp is live and connected; the WR list and its SGEs live in scratch vectors
        // that are not touched until the call returns (providers copy WRs into the queue); every
        // SGE lies within the registered local buffer (checked above), which stays allocated
        // via the Arc in `batch` until the completion is seen or the QP is destroyed.
        let rc = unsafe { (self.post_send)(self.qp, head, &mut bad) };
        if rc != 0 {
            let errno = if rc > 0 { rc } else { last_errno() };
            if !bad.is_null() && bad != head {
                // Some WRs went out, but not the signaled last one: their completion could
                // never be matched, so this QP can no longer be accounted for.
                self.state = QpState::Failed;
                // Keep the buffer pinned until the QP is torn down.
                self.in_flight.push_back(batch);
                self.next_seq += 1;
                self.outstanding_wrs += n;
            }
            return Err(VerbsError::Verb { verb: "ibv_post_send", errno });
        }
        self.next_seq += 1;
        self.outstanding_wrs += n;
        self.in_flight.push_back(batch);
        Ok(seq)
    }

    /// Moves completions from the CQ into `self.finished`. Bounded: at most one CQ's worth.
    fn drain_cq(&mut self) -> Result<(), VerbsError> {
        let mut budget = self.sq_capacity as usize + POLL_BATCH;
        while budget > 0 {
            // SAFETY: cq is live; wc_scratch has room for POLL_BATCH entries.
            let got = unsafe { (self.poll_cq)(self.cq, POLL_BATCH as c_int, self.wc_scratch.as_mut_ptr()) };
            if got < 0 {
                // Providers return -1 with errno set, or a negative errno.
                let errno = if got == -1 { last_errno() } else { -got };
                return Err(VerbsError::Verb { verb: "ibv_poll_cq", errno });
            }
            for i in 0..got as usize {
                let wc = self.wc_scratch[i];
                self.complete(wc.wr_id(), wc.error().map(|(status, _vendor)| status));
            }
            if (got as usize) < POLL_BATCH {
                break;
            }
            budget = budget.saturating_sub(got as usize);
        }
        Ok(())
    }

    fn complete(&mut self, nic_wr_id: u64, error: Option<u32>) {
        let (seq, index) = (nic_wr_id >> BATCH_INDEX_BITS, (nic_wr_id & ((1 << BATCH_INDEX_BITS) - 1)) as usize);
        // A failed batch reports several completions (the error, then flushes of its unsignaled
        // WRs); only the first one finds the batch.
        let Some(pos) = self.in_flight.iter().position(|b| b.seq == seq) else { return };
        let Some(mut batch) = self.in_flight.remove(pos) else { return };
        self.outstanding_wrs -= batch.wr_ids.len() as u32;
        let error = error.map(|status| {
            self.state = QpState::Failed;
            (index.min(batch.wr_ids.len() - 1), status, wc_status_str(status))
        });
        let wr_ids = std::mem::take(&mut batch.wr_ids);
        // Dropping `batch` releases the buffer: the NIC is done with it.
        drop(batch);
        self.finished.push_back(Finished { seq, wr_ids, error });
    }

    fn expand(f: Finished, out: &mut Vec<Completion>) -> usize {
        let n = f.wr_ids.len();
        out.extend(f.wr_ids.into_iter().map(|wr_id| Completion {
            wr_id,
            result: match &f.error {
                None => Ok(()),
                Some((_, status, status_str)) => {
                    Err(VerbsError::Completion { wr_id, status: *status, status_str: status_str.clone() })
                }
            },
        }));
        n
    }

    /// Polls the CQ without blocking and appends one [`Completion`] per read of every finished
    /// batch (a batch's single signaled completion is mapped back to all of its reads). A
    /// failed batch reports [`VerbsError::Completion`] for each of its reads, all carrying the
    /// status of its first failed read (reads before it may have landed, but the batch is
    /// treated as one unit), and leaves the QP failed: recreate it. Returns the number of
    /// completions appended.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        self.drain_cq()?;
        let mut n = 0;
        while let Some(f) = self.finished.pop_front() {
            n += Self::expand(f, out);
        }
        Ok(n)
    }

    /// Says, without blocking, whether batch `seq` (from [`QueuePair::post_reads`]) has
    /// finished: `None` while it is in flight, `Some(Ok(()))` when its data is in the local
    /// buffer, `Some(Err(Completion))` for its first failed read. Completions of other batches
    /// seen meanwhile are kept for the next [`QueuePair::poll`].
    pub fn try_finish(&mut self, seq: u64) -> Result<Option<Result<(), VerbsError>>, VerbsError> {
        self.drain_cq()?;
        let Some(pos) = self.finished.iter().position(|f| f.seq == seq) else { return Ok(None) };
        let f = self.finished.remove(pos).expect("position is in bounds");
        Ok(Some(match f.error {
            None => Ok(()),
            Some((idx, status, status_str)) => Err(VerbsError::Completion { wr_id: f.wr_ids[idx], status, status_str }),
        }))
    }

    /// The completion channel's descriptor, non-blocking; `None` without a channel. It is
    /// readable once an armed CQ has a new completion. Valid as long as this QP.
    pub fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        // SAFETY: a non-null channel is live until Drop; `fd` is immutable after creation.
        (!self.channel.is_null()).then(|| unsafe { (*self.channel).fd })
    }

    /// Asks for one event on [`QueuePair::event_fd`] at the CQ's next completion
    /// (`ibv_req_notify_cq`). Poll once more after arming: earlier completions raise none.
    pub fn arm_events(&mut self) -> Result<(), VerbsError> {
        let Some(notify) = self.req_notify_cq.filter(|_| !self.channel.is_null()) else {
            return Err(VerbsError::InvalidState("arm_events needs a QP made by create_with_events"));
        };
        // SAFETY: cq is live and bound to our channel; `notify` is the provider's own op.
        let rc = unsafe { notify(self.cq, 0) };
        if rc != 0 {
            return Err(VerbsError::Verb { verb: "ibv_req_notify_cq", errno: if rc > 0 { rc } else { last_errno() } });
        }
        Ok(())
    }

    /// Takes every pending event off the channel without blocking and acknowledges them
    /// (events must all be acknowledged before the CQ is destroyed). Returns how many.
    pub fn take_events(&mut self) -> Result<usize, VerbsError> {
        if self.channel.is_null() {
            return Err(VerbsError::InvalidState("take_events needs a QP made by create_with_events"));
        }
        let mut n = 0u32;
        // One armed CQ raises at most one event per arming; the bound only guards the loop.
        for _ in 0..POLL_BATCH {
            let (mut cq, mut cq_ctx) = (ptr::null_mut(), ptr::null_mut());
            // SAFETY: the channel is live and non-blocking; both out-pointers are valid.
            if unsafe { sys::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                let errno = last_errno();
                if errno == libc::EAGAIN || errno == libc::EWOULDBLOCK {
                    break;
                }
                self.ack(n);
                return Err(VerbsError::Verb { verb: "ibv_get_cq_event", errno });
            }
            n += 1;
        }
        self.ack(n);
        Ok(n as usize)
    }

    fn ack(&mut self, n: u32) {
        if n > 0 {
            // SAFETY: cq is live and these n events came from it (it is the channel's only CQ).
            unsafe { sys::ibv_ack_cq_events(self.cq, n) };
        }
    }

    /// Posts `reads` and busy-polls until that batch completes or `deadline` passes. Completions
    /// of other batches seen meanwhile are kept for the next [`QueuePair::poll`]. This blocks
    /// the calling thread: async code should use [`QueuePair::create_with_events`] and sleep on
    /// [`QueuePair::event_fd`] instead.
    ///
    /// On success the data is in `local`. A failed read returns its [`VerbsError::Completion`]
    /// (the batch's first failed read); on [`VerbsError::Timeout`] the batch stays outstanding.
    pub fn read_batch(
        &mut self,
        reads: &[ReadRequest],
        local: &mut LocalBuffer,
        deadline: Instant,
    ) -> Result<(), VerbsError> {
        let seq = self.post_reads(reads, local)?;
        let mut spins_left = SPINS_PER_YIELD;
        loop {
            if let Some(done) = self.try_finish(seq)? {
                return done;
            }
            if Instant::now() >= deadline {
                return Err(VerbsError::Timeout);
            }
            spins_left -= 1;
            if spins_left == 0 {
                spins_left = SPINS_PER_YIELD;
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// A non-blocking completion channel of `ctx`.
fn create_channel(ctx: &Context) -> Result<*mut sys::ibv_comp_channel, VerbsError> {
    // SAFETY: the context is open.
    let ch = unsafe { sys::ibv_create_comp_channel(ctx.ctx) };
    if ch.is_null() {
        return Err(VerbsError::Verb { verb: "ibv_create_comp_channel", errno: last_errno() });
    }
    // SAFETY: `fd` of a live channel is an open descriptor owned by the channel.
    let fd = unsafe { (*ch).fd };
    // SAFETY: fcntl on an open descriptor with valid commands.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    if !ok {
        let errno = last_errno();
        destroy_channel(ch);
        return Err(VerbsError::Verb { verb: "fcntl(O_NONBLOCK)", errno });
    }
    Ok(ch)
}

/// Destroys a channel (no-op for null). Its CQ must be gone first.
fn destroy_channel(ch: *mut sys::ibv_comp_channel) {
    if !ch.is_null() {
        // SAFETY: the channel is live, no CQ uses it any more, and it is destroyed once.
        unsafe { sys::ibv_destroy_comp_channel(ch) };
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: QP before CQ (a CQ cannot be destroyed while a QP uses it); after
        // ibv_destroy_qp the NIC no longer touches the local buffers of outstanding batches, so
        // releasing them afterwards is safe.
        unsafe { sys::ibv_destroy_qp(self.qp) };
        self.in_flight.clear();
        // SAFETY: no QP uses the CQ any more; take_events acknowledged every event it took.
        unsafe { sys::ibv_destroy_cq(self.cq) };
        destroy_channel(self.channel);
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("endpoint", &self.endpoint())
            .field("state", &self.state)
            .field("outstanding", &self.outstanding_wrs)
            .field("capacity", &self.sq_capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Endpoint {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 2, 15]);
        Endpoint { qpn: 0x11, psn: 0xab_cdef, gid, lid: 7, mtu: 3 }
    }

    #[test]
    fn endpoint_roundtrip_and_layout() {
        let ep = sample();
        let b = ep.to_bytes();
        assert_eq!(&b[0..4], &[0x11, 0, 0, 0]);
        assert_eq!(&b[4..8], &[0xef, 0xcd, 0xab, 0]);
        assert_eq!(&b[24..26], &[7, 0]);
        assert_eq!(&b[26..30], &[3, 0, 0, 0]);
        assert_eq!(Endpoint::from_bytes(&b), Ok(ep));
    }

    #[test]
    fn endpoint_rejects_bad_input() {
        let b = sample().to_bytes();
        assert!(matches!(Endpoint::from_bytes(&b[..29]), Err(VerbsError::BadEndpoint(_))));
        let mut long = b.to_vec();
        long.push(0);
        assert!(matches!(Endpoint::from_bytes(&long), Err(VerbsError::BadEndpoint(_))));
        let mut bad_mtu = b;
        bad_mtu[26] = 9;
        assert!(matches!(Endpoint::from_bytes(&bad_mtu), Err(VerbsError::BadEndpoint(_))));
        let mut bad_psn = b;
        bad_psn[7] = 1;
        assert!(matches!(Endpoint::from_bytes(&bad_psn), Err(VerbsError::BadEndpoint(_))));
    }

    #[test]
    fn mtu_and_gid_helpers() {
        assert_eq!(mtu_bytes(1), Some(256));
        assert_eq!(mtu_bytes(3), Some(1024));
        assert_eq!(mtu_bytes(5), Some(4096));
        assert_eq!(mtu_bytes(0), None);
        assert!(is_ipv4_mapped(&sample().gid));
        assert!(!is_ipv4_mapped(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]));
    }

    #[test]
    fn errors_name_verb_and_status() {
        let e = VerbsError::Verb { verb: "ibv_reg_mr", errno: libc::ENOMEM };
        assert!(e.to_string().starts_with("ibv_reg_mr failed"), "{e}");
        assert_eq!(wc_status_str(WC_STATUS_REM_ACCESS_ERR), "remote access error");
    }

    /// Without RDMA in the kernel, opening must be a typed error, never a panic.
    #[test]
    fn open_without_rdma_is_a_typed_error() {
        let no_rdma = !std::path::Path::new("/sys/class/infiniband").exists();
        match Context::open(None) {
            Err(VerbsError::NoDevice) => {}
            Ok(ctx) => assert!(!no_rdma, "opened {} without RDMA support", ctx.device_name()),
            Err(VerbsError::NoActivePort) if !no_rdma => {}
            Err(e) => panic!("unexpected error: {e}"),
        }
        match Context::open(Some("no-such-device")) {
            Err(VerbsError::NoDevice) => {}
            Err(VerbsError::DeviceNotFound(name)) => assert_eq!(name, "no-such-device"),
            other => panic!("unexpected result: {other:?}"),
        }
    }
}
