//! Opening a device: port and GID selection, and the protection domain everything else is
//! created in.

use std::ffi::{CStr, c_int};
use std::sync::Arc;

use ibverbs_sys as sys;

use crate::error::{VerbsError, check, last_errno};
use crate::limits::MAX_RD_ATOMIC;

fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// An opened RDMA device: the chosen port, its GID index and a protection domain.
///
/// Shared through `Arc`: memory regions and queue pairs keep their context alive, because the
/// protection domain and device must outlive everything created from them.
pub struct Context {
    pub(crate) ctx: *mut sys::ibv_context,
    pub(crate) pd: *mut sys::ibv_pd,
    name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) gid: [u8; 16],
    pub(crate) lid: u16,
    pub(crate) active_mtu: u32,
    link_layer: u8,
    pub(crate) max_msg_sz: u32,
    pub(crate) max_qp_wr: u32,
    pub(crate) max_cqe: u32,
    pub(crate) rd_atomic: u8,
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

    /// The port's active MTU as an `ibv_mtu` value (1 = 256 B … 5 = 4096 B; see [`mtu_bytes`](crate::mtu_bytes)).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_helper() {
        let mut mapped = [0u8; 16];
        mapped[10] = 0xff;
        mapped[11] = 0xff;
        mapped[12..].copy_from_slice(&[10, 0, 2, 15]);
        assert!(is_ipv4_mapped(&mapped));
        assert!(!is_ipv4_mapped(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]));
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
