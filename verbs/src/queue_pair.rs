//! The RC queue pair and its completion queue: creation, connection and teardown. Posting
//! lives in post.rs and completion handling in completions.rs, as further `impl` blocks.

use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::ffi::c_int;
use std::hash::{BuildHasher, Hasher};
use std::ptr;
use std::sync::Arc;

use ibverbs_sys as sys;

use crate::batch::{Finished, InFlight};
use crate::channel::{create_channel, destroy_channel};
use crate::context::Context;
use crate::endpoint::{Endpoint, PSN_MASK, mtu_bytes};
use crate::error::{VerbsError, check, last_errno};
use crate::limits::{
    ACK_TIMEOUT, HOP_LIMIT, MAX_READS_PER_BATCH, MAX_SEND_QUEUE_DEPTH, MIN_RNR_TIMER, POLL_BATCH, RETRY_COUNT,
    RNR_RETRY,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QpState {
    Init,
    Ready,
    Failed,
}

pub(crate) type PostSendFn =
    unsafe extern "C" fn(*mut sys::ibv_qp, *mut sys::ibv_send_wr, *mut *mut sys::ibv_send_wr) -> c_int;
pub(crate) type PollCqFn = unsafe extern "C" fn(*mut sys::ibv_cq, c_int, *mut sys::ibv_wc) -> c_int;
pub(crate) type ReqNotifyCqFn = unsafe extern "C" fn(*mut sys::ibv_cq, c_int) -> c_int;

/// A reliable-connected queue pair with its own completion queue, for RDMA READs.
///
/// Created in INIT with remote-read access (so the same type serves the server side), then
/// [`connect`](QueuePair::connect)ed once. After any failed completion the QP is in the error
/// state: outstanding batches fail (flushed) and new posts return [`VerbsError::QpFailed`];
/// create a new QP and exchange endpoints again.
pub struct QueuePair {
    pub(crate) ctx: Arc<Context>,
    pub(crate) qp: *mut sys::ibv_qp,
    pub(crate) cq: *mut sys::ibv_cq,
    /// Completion channel of `cq` (null unless made by [`QueuePair::create_with_events`]).
    pub(crate) channel: *mut sys::ibv_comp_channel,
    pub(crate) post_send: PostSendFn,
    pub(crate) poll_cq: PollCqFn,
    pub(crate) req_notify_cq: Option<ReqNotifyCqFn>,
    pub(crate) psn: u32,
    pub(crate) state: QpState,
    pub(crate) sq_capacity: u32,
    pub(crate) outstanding_wrs: u32,
    pub(crate) next_seq: u64,
    pub(crate) in_flight: VecDeque<InFlight>,
    pub(crate) finished: VecDeque<Finished>,
    pub(crate) wr_scratch: Vec<sys::ibv_send_wr>,
    pub(crate) sge_scratch: Vec<sys::ibv_sge>,
    pub(crate) wc_scratch: [sys::ibv_wc; POLL_BATCH],
}

// SAFETY: a QP and its CQ may be used from any thread as long as calls are not concurrent; all
// methods that touch them take &mut self (QueuePair is deliberately not Sync).
unsafe impl Send for QueuePair {}

pub(crate) fn random_psn() -> u32 {
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
        connect_rc(self.qp, &self.ctx, self.psn, remote, RNR_RETRY)?;
        self.state = QpState::Ready;
        Ok(())
    }
}

/// Moves a fresh RC queue pair `qp` of `ctx` (in INIT, with send PSN `psn`)
/// through RTR to RTS, connected to `remote`. Shared by the READ queue
/// pairs and the message queue pairs, which differ in `rnr_retry` only.
pub(crate) fn connect_rc(
    qp: *mut sys::ibv_qp,
    ctx: &Context,
    psn: u32,
    remote: &Endpoint,
    rnr_retry: u8,
) -> Result<(), VerbsError> {
    if mtu_bytes(remote.mtu).is_none() || remote.psn & !PSN_MASK != 0 {
        return Err(VerbsError::BadEndpoint(format!("{remote:?}")));
    }
    let roce = ctx.is_roce();
    let mut ah = sys::ibv_ah_attr {
        dlid: if roce { 0 } else { remote.lid },
        sl: 0,
        src_path_bits: 0,
        is_global: u8::from(roce),
        port_num: ctx.port,
        ..Default::default()
    };
    if roce {
        ah.grh.dgid.raw = remote.gid;
        ah.grh.sgid_index = ctx.gid_index;
        ah.grh.hop_limit = HOP_LIMIT;
    }
    let mut attr = sys::ibv_qp_attr {
        qp_state: sys::ibv_qp_state::IBV_QPS_RTR,
        path_mtu: ctx.active_mtu.min(remote.mtu),
        dest_qp_num: remote.qpn,
        rq_psn: remote.psn,
        max_dest_rd_atomic: ctx.rd_atomic,
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
    // SAFETY: `qp` is a live queue pair of `ctx` (the caller's); `attr` is
    // a valid attribute block for the mask.
    check("ibv_modify_qp(RTR)", unsafe { sys::ibv_modify_qp(qp, &mut attr, rtr as c_int) })?;
    let mut attr = sys::ibv_qp_attr {
        qp_state: sys::ibv_qp_state::IBV_QPS_RTS,
        timeout: ACK_TIMEOUT,
        retry_cnt: RETRY_COUNT,
        rnr_retry,
        sq_psn: psn,
        max_rd_atomic: ctx.rd_atomic,
        ..Default::default()
    };
    let rts = M::IBV_QP_STATE.0
        | M::IBV_QP_TIMEOUT.0
        | M::IBV_QP_RETRY_CNT.0
        | M::IBV_QP_RNR_RETRY.0
        | M::IBV_QP_SQ_PSN.0
        | M::IBV_QP_MAX_QP_RD_ATOMIC.0;
    // SAFETY: as above.
    check("ibv_modify_qp(RTS)", unsafe { sys::ibv_modify_qp(qp, &mut attr, rts as c_int) })
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
