//! Messages over verbs: RC SEND/RECV into [`Slots`], for dmkv's verbs RPC.
//!
//! - [`MsgCq`]: a completion queue with its completion channel, shared by
//!   the queue pairs of one server worker (or owned by one client queue
//!   pair), reaped by one task that sleeps on [`MsgCq::event_fd`].
//! - [`Srq`]: a shared receive queue owning its slab of receive slots;
//!   every client queue pair of a server worker receives into it.
//! - [`MsgQp`]: an RC queue pair that SENDs from its own slab of send
//!   slots and receives into an [`Srq`] or into its own slab.
//!
//! Slots travel as [`Slot`] tokens: a post takes the token, the completion
//! ([`MsgCompletion`]) hands it back, so a slot's bytes are only copied
//! while nobody else can touch them. Everything here is `Send + Sync`:
//! libibverbs serializes posts and polls on one queue itself.

use std::ffi::c_int;
use std::ptr;
use std::sync::Arc;

use ibverbs_sys as sys;

use crate::channel::{create_channel, destroy_channel};
use crate::context::Context;
use crate::endpoint::Endpoint;
use crate::error::{VerbsError, check, last_errno, wc_status_str};
use crate::limits::{MAX_SEND_QUEUE_DEPTH, POLL_BATCH};
use crate::queue_pair::{PollCqFn, PostSendFn, ReqNotifyCqFn, connect_rc, random_psn};
use crate::slots::{Slot, Slots};

/// RNR retries of a message queue pair: 7 means "retry for ever". The
/// verbs RPC's credits keep a server's shared receive queue from running
/// dry; this is the backstop should it, and the flow control of a
/// client's own receive slots (a reply waits in the NIC until the client
/// reads and re-posts, as a TCP sender waits for the window).
pub const MSG_RNR_RETRY: u8 = 7;

const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;

type PostRecvFn = unsafe extern "C" fn(*mut sys::ibv_qp, *mut sys::ibv_recv_wr, *mut *mut sys::ibv_recv_wr) -> c_int;
type PostSrqRecvFn =
    unsafe extern "C" fn(*mut sys::ibv_srq, *mut sys::ibv_recv_wr, *mut *mut sys::ibv_recv_wr) -> c_int;

/// What finished: a message received into a slot, or a send from one.
#[derive(Debug)]
pub enum MsgOp {
    /// `len` bytes arrived in the slot, with the sender's immediate data.
    Recv { len: u32, imm: Option<u32> },
    /// The slot's message was sent (acknowledged by the peer's NIC).
    Send,
}

/// One completion, with the slot it gives back.
#[derive(Debug)]
pub struct MsgCompletion {
    /// The local queue pair it belongs to.
    pub qp_num: u32,
    pub op: MsgOp,
    pub slot: Slot,
    /// `Err((status, text))`: the queue pair is in the error state (the
    /// slot is back, its content is not valid).
    pub status: Result<(), (u32, String)>,
}

/// A completion queue with a completion channel.
pub struct MsgCq {
    ctx: Arc<Context>,
    cq: *mut sys::ibv_cq,
    channel: *mut sys::ibv_comp_channel,
    poll_cq: PollCqFn,
    req_notify: ReqNotifyCqFn,
}

// SAFETY: the CQ and channel handles are used only through libibverbs
// calls, which lock per CQ; the handles are destroyed once, in Drop.
unsafe impl Send for MsgCq {}
// SAFETY: as above.
unsafe impl Sync for MsgCq {}

impl MsgCq {
    /// A queue of `cqe` entries (lowered to the device's limit).
    pub fn create(ctx: &Arc<Context>, cqe: u32) -> Result<Arc<MsgCq>, VerbsError> {
        let channel = create_channel(ctx)?;
        let cqe = cqe.clamp(1, ctx.max_cqe);
        // SAFETY: the context and the channel are live.
        let cq = unsafe { sys::ibv_create_cq(ctx.ctx, cqe as c_int, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let errno = last_errno();
            destroy_channel(channel);
            return Err(VerbsError::Verb { verb: "ibv_create_cq", errno });
        }
        // SAFETY: the context is live; `ops` is the provider's table.
        let ops = unsafe { &(*ctx.ctx).ops };
        let (Some(poll_cq), Some(req_notify)) = (ops.poll_cq, ops.req_notify_cq) else {
            // SAFETY: created above, no queue pair uses it.
            unsafe { sys::ibv_destroy_cq(cq) };
            destroy_channel(channel);
            return Err(VerbsError::Verb { verb: "ibv_poll_cq", errno: libc::ENOSYS });
        };
        Ok(Arc::new(MsgCq { ctx: Arc::clone(ctx), cq, channel, poll_cq, req_notify }))
    }

    /// Appends the finished completions (at most `max`) to `out`; returns
    /// how many.
    pub fn poll(&self, out: &mut Vec<MsgCompletion>, max: usize) -> Result<usize, VerbsError> {
        let mut wcs = [sys::ibv_wc::default(); POLL_BATCH];
        let mut n = 0;
        while n < max {
            let want = POLL_BATCH.min(max - n);
            // SAFETY: the CQ is live and `wcs` has room for `want` entries.
            let got = unsafe { (self.poll_cq)(self.cq, want as c_int, wcs.as_mut_ptr()) };
            if got < 0 {
                let errno = if got == -1 { last_errno() } else { -got };
                return Err(VerbsError::Verb { verb: "ibv_poll_cq", errno });
            }
            for wc in &wcs[..got as usize] {
                let (kind, slot) = Slot::from_wr_id(wc.wr_id());
                let status = match wc.error() {
                    None => Ok(()),
                    Some((s, _)) => Err((s, wc_status_str(s))),
                };
                // A failed completion's opcode is not defined: the kind
                // comes from the work request id.
                let op = if kind == KIND_RECV {
                    MsgOp::Recv { len: wc.len() as u32, imm: wc.imm_data().map(u32::from_be) }
                } else {
                    MsgOp::Send
                };
                out.push(MsgCompletion { qp_num: wc.qp_num, op, slot, status });
            }
            n += got as usize;
            if (got as usize) < want {
                break;
            }
        }
        Ok(n)
    }

    /// The completion channel's descriptor (non-blocking): readable once an
    /// armed queue has a new completion.
    pub fn event_fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the channel is live until Drop; `fd` never changes.
        unsafe { (*self.channel).fd }
    }

    /// A duplicate of [`MsgCq::event_fd`] that the caller owns (e.g. to
    /// register with an async reactor), valid however long it is kept.
    pub fn dup_event_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        // SAFETY: the channel's descriptor is open while `self` lives; the
        // borrow ends before this returns, the duplicate is the caller's.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.event_fd()) }.try_clone_to_owned()
    }

    /// Asks for an event at the next completion. Poll once more after
    /// arming: completions before it raise none.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is live and bound to our channel.
        let rc = unsafe { (self.req_notify)(self.cq, 0) };
        if rc != 0 {
            return Err(VerbsError::Verb { verb: "ibv_req_notify_cq", errno: if rc > 0 { rc } else { last_errno() } });
        }
        Ok(())
    }

    /// Takes and acknowledges the channel's pending events without
    /// blocking; returns how many.
    pub fn take_events(&self) -> Result<usize, VerbsError> {
        let mut n = 0u32;
        let mut result = Ok(());
        for _ in 0..POLL_BATCH {
            let (mut cq, mut cq_ctx) = (ptr::null_mut(), ptr::null_mut());
            // SAFETY: the channel is live and non-blocking; both out-pointers are valid.
            if unsafe { sys::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                let errno = last_errno();
                if errno != libc::EAGAIN && errno != libc::EWOULDBLOCK {
                    result = Err(VerbsError::Verb { verb: "ibv_get_cq_event", errno });
                }
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: the CQ is live and these events came from it (the
            // channel's only CQ).
            unsafe { sys::ibv_ack_cq_events(self.cq, n) };
        }
        result.map(|()| n as usize)
    }
}

impl Drop for MsgCq {
    fn drop(&mut self) {
        // SAFETY: every queue pair using this CQ holds an Arc of it, so none
        // is left; every event was acknowledged by `take_events`.
        unsafe { sys::ibv_destroy_cq(self.cq) };
        destroy_channel(self.channel);
        let _ = &self.ctx;
    }
}

/// A shared receive queue and the slab its receives land in.
pub struct Srq {
    srq: *mut sys::ibv_srq,
    post: PostSrqRecvFn,
    slots: Slots,
    _ctx: Arc<Context>,
}

// SAFETY: the SRQ handle is used only through libibverbs calls (which lock
// per SRQ) and destroyed once in Drop; `Slots` is Send + Sync.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    /// A shared receive queue of `depth` slots of `slot_bytes`, all posted.
    pub fn create(ctx: &Arc<Context>, depth: u32, slot_bytes: u32) -> Result<Arc<Srq>, VerbsError> {
        let (slots, tokens) = Slots::new(ctx, depth, slot_bytes)?;
        let mut init = sys::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: sys::ibv_srq_attr { max_wr: depth, max_sge: 1, srq_limit: 0 },
        };
        // SAFETY: the PD is live; `init` is a valid attribute block.
        let srq = unsafe { sys::ibv_create_srq(ctx.pd, &mut init) };
        if srq.is_null() {
            return Err(VerbsError::Verb { verb: "ibv_create_srq", errno: last_errno() });
        }
        // SAFETY: the context is live.
        let Some(post) = (unsafe { (*ctx.ctx).ops.post_srq_recv }) else {
            // SAFETY: created above, unused.
            unsafe { sys::ibv_destroy_srq(srq) };
            return Err(VerbsError::Verb { verb: "ibv_post_srq_recv", errno: libc::ENOSYS });
        };
        let this = Arc::new(Srq { srq, post, slots, _ctx: Arc::clone(ctx) });
        this.post(tokens).map_err(|(e, _)| e)?;
        Ok(this)
    }

    /// The slab receives land in.
    pub fn slots(&self) -> &Slots {
        &self.slots
    }

    /// Posts `slots` (of this queue's slab) for receives, one doorbell. On
    /// failure the slots not posted come back with the error.
    pub fn post(&self, slots: Vec<Slot>) -> Result<(), (VerbsError, Vec<Slot>)> {
        post_recvs(&self.slots, slots, |head, bad| {
            // SAFETY: the SRQ is live; `head` is a valid chain (see post_recvs).
            unsafe { (self.post)(self.srq, head, bad) }
        })
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: every queue pair attached holds an Arc of this SRQ, so none
        // is left; destroyed once, before `slots` is freed (field drop).
        unsafe { sys::ibv_destroy_srq(self.srq) };
    }
}

/// Posts receive slots as one chain through `post`; the slots whose post
/// failed come back.
fn post_recvs(
    slab: &Slots,
    slots: Vec<Slot>,
    post: impl FnOnce(*mut sys::ibv_recv_wr, *mut *mut sys::ibv_recv_wr) -> c_int,
) -> Result<(), (VerbsError, Vec<Slot>)> {
    if slots.is_empty() {
        return Ok(());
    }
    let mut sges = Vec::with_capacity(slots.len());
    for s in &slots {
        match slab.addr(s) {
            Ok(addr) => sges.push(sys::ibv_sge { addr, length: slab.slot_bytes(), lkey: slab.lkey() }),
            Err(e) => return Err((e, slots)),
        }
    }
    let mut wrs: Vec<sys::ibv_recv_wr> = slots
        .iter()
        .zip(sges.iter_mut())
        .map(|(s, sge)| sys::ibv_recv_wr { wr_id: s.wr_id(KIND_RECV), next: ptr::null_mut(), sg_list: sge, num_sge: 1 })
        .collect();
    let head = wrs.as_mut_ptr();
    for i in 0..wrs.len() - 1 {
        // SAFETY: both indexes are inside `wrs`, which outlives the post.
        unsafe { (*head.add(i)).next = head.add(i + 1) };
    }
    let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
    let rc = post(head, &mut bad);
    if rc == 0 {
        // The tokens now belong to the posted receives; completions rebuild them.
        return Ok(());
    }
    let errno = if rc > 0 { rc } else { last_errno() };
    // Work requests before `bad` were posted; `bad` and after were not.
    let first_bad = if bad.is_null() {
        0
    } else {
        // SAFETY: `bad` points into `wrs` (the provider returns one of ours).
        (unsafe { bad.offset_from(head) }).clamp(0, wrs.len() as isize) as usize
    };
    let mut slots = slots;
    let unposted = slots.split_off(first_bad);
    Err((VerbsError::Verb { verb: "ibv_post_recv", errno }, unposted))
}

/// An RC queue pair for messages.
pub struct MsgQp {
    qp: *mut sys::ibv_qp,
    post_send: PostSendFn,
    post_recv: PostRecvFn,
    psn: u32,
    send: Slots,
    recv: Option<Slots>,
    _srq: Option<Arc<Srq>>,
    _cq: Arc<MsgCq>,
    ctx: Arc<Context>,
}

// SAFETY: the QP handle is used only through libibverbs calls, which lock
// per queue; it is destroyed once in Drop before the slabs and queues it
// uses (fields dropped after).
unsafe impl Send for MsgQp {}
// SAFETY: as above.
unsafe impl Sync for MsgQp {}

/// What a new [`MsgQp`] receives into.
pub enum RecvInto<'a> {
    /// A server worker's shared receive queue.
    Shared(&'a Arc<Srq>),
    /// Its own `count` slots of `slot_bytes` (a client).
    Own { count: u32, slot_bytes: u32 },
}

impl MsgQp {
    /// A queue pair on `cq` with `send_slots` send slots of `slot_bytes`,
    /// receiving as `recv` says. Returns it with its send slots' tokens
    /// and, for [`RecvInto::Own`], its receive slots' (not posted yet:
    /// post them with [`MsgQp::post_recv`] before connecting).
    pub fn create(
        ctx: &Arc<Context>,
        cq: &Arc<MsgCq>,
        recv: RecvInto<'_>,
        send_slots: u32,
        slot_bytes: u32,
    ) -> Result<(MsgQp, Vec<Slot>, Vec<Slot>), VerbsError> {
        if !(1..=MAX_SEND_QUEUE_DEPTH).contains(&send_slots) {
            return Err(VerbsError::InvalidRequest(format!(
                "{send_slots} send slots, allowed 1..={MAX_SEND_QUEUE_DEPTH}"
            )));
        }
        let (send, send_tokens) = Slots::new(ctx, send_slots, slot_bytes)?;
        let (srq, own) = match recv {
            RecvInto::Shared(srq) => (Some(Arc::clone(srq)), None),
            RecvInto::Own { count, slot_bytes } => (None, Some(Slots::new(ctx, count, slot_bytes)?)),
        };
        let mut init = sys::ibv_qp_init_attr {
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: srq.as_ref().map_or(ptr::null_mut(), |s| s.srq),
            cap: sys::ibv_qp_cap {
                max_send_wr: send_slots,
                max_recv_wr: own.as_ref().map_or(0, |(s, _)| s.count()),
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: sys::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 1,
            ..Default::default()
        };
        // SAFETY: the PD, CQ and SRQ are live; `init` is valid.
        let qp = unsafe { sys::ibv_create_qp(ctx.pd, &mut init) };
        if qp.is_null() {
            return Err(VerbsError::Verb { verb: "ibv_create_qp", errno: last_errno() });
        }
        // SAFETY: the QP's context is live.
        let ops = unsafe { &(*(*qp).context).ops };
        let (Some(post_send), Some(post_recv)) = (ops.post_send, ops.post_recv) else {
            // SAFETY: created above, nothing posted.
            unsafe { sys::ibv_destroy_qp(qp) };
            return Err(VerbsError::Verb { verb: "ibv_post_send", errno: libc::ENOSYS });
        };
        let (recv, recv_tokens) = match own {
            Some((s, t)) => (Some(s), t),
            None => (None, Vec::new()),
        };
        let this = MsgQp {
            qp,
            post_send,
            post_recv,
            psn: random_psn(),
            send,
            recv,
            _srq: srq,
            _cq: Arc::clone(cq),
            ctx: Arc::clone(ctx),
        };
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: ctx.port,
            qp_access_flags: 0,
            ..Default::default()
        };
        use sys::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE.0 | M::IBV_QP_PKEY_INDEX.0 | M::IBV_QP_PORT.0 | M::IBV_QP_ACCESS_FLAGS.0;
        // SAFETY: the QP is live; `attr` is valid for the mask.
        check("ibv_modify_qp(INIT)", unsafe { sys::ibv_modify_qp(this.qp, &mut attr, mask as c_int) })?;
        Ok((this, send_tokens, recv_tokens))
    }

    /// Its number, as completions name it.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is live; qp_num never changes.
        unsafe { (*self.qp).qp_num }
    }

    /// What the peer needs to connect to it.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint { qpn: self.qp_num(), psn: self.psn, gid: self.ctx.gid, lid: self.ctx.lid, mtu: self.ctx.active_mtu }
    }

    /// Connects it to `remote` (INIT → RTR → RTS).
    pub fn connect(&self, remote: &Endpoint) -> Result<(), VerbsError> {
        connect_rc(self.qp, &self.ctx, self.psn, remote, MSG_RNR_RETRY)
    }

    /// Moves it to the error state: outstanding work is flushed (its slots
    /// come back in failed completions) and the peer's next message fails.
    pub fn fail(&self) -> Result<(), VerbsError> {
        let mut attr = sys::ibv_qp_attr { qp_state: sys::ibv_qp_state::IBV_QPS_ERR, ..Default::default() };
        let mask = sys::ibv_qp_attr_mask::IBV_QP_STATE.0;
        // SAFETY: the QP is live; `attr` is valid for the mask.
        check("ibv_modify_qp(ERR)", unsafe { sys::ibv_modify_qp(self.qp, &mut attr, mask as c_int) })
    }

    /// Its send slab (copy a message in before [`MsgQp::send`]).
    pub fn send_slots(&self) -> &Slots {
        &self.send
    }

    /// Its own receive slab, if it has one.
    pub fn recv_slots(&self) -> Option<&Slots> {
        self.recv.as_ref()
    }

    /// Posts its own receive slots (one doorbell).
    pub fn post_recv(&self, slots: Vec<Slot>) -> Result<(), (VerbsError, Vec<Slot>)> {
        let Some(slab) = &self.recv else {
            return Err((VerbsError::InvalidState("this queue pair receives into a shared queue"), slots));
        };
        post_recvs(slab, slots, |head, bad| {
            // SAFETY: the QP is live; `head` is a valid chain (see post_recvs).
            unsafe { (self.post_recv)(self.qp, head, bad) }
        })
    }

    /// Sends the first `len` bytes of send slot `slot`, with `imm` as
    /// immediate data if given. Signaled: the slot comes back in a
    /// [`MsgOp::Send`] completion. On failure the slot comes back at once.
    pub fn send(&self, slot: Slot, len: u32, imm: Option<u32>) -> Result<(), (VerbsError, Slot)> {
        if len > self.send.slot_bytes() {
            let e = VerbsError::InvalidRequest(format!("{len} bytes from a {} byte slot", self.send.slot_bytes()));
            return Err((e, slot));
        }
        let addr = match self.send.addr(&slot) {
            Ok(a) => a,
            Err(e) => return Err((e, slot)),
        };
        let mut sge = sys::ibv_sge { addr, length: len, lkey: self.send.lkey() };
        // SAFETY: a zeroed work request is a valid empty one.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = slot.wr_id(KIND_SEND);
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        match imm {
            Some(imm) => {
                wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                wr.__bindgen_anon_1.imm_data = imm.to_be();
            }
            None => wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND,
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live; `wr` and `sge` outlive the call (the
        // provider copies them into the send queue).
        let rc = unsafe { (self.post_send)(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            let errno = if rc > 0 { rc } else { last_errno() };
            return Err((VerbsError::Verb { verb: "ibv_post_send", errno }, slot));
        }
        // The token now belongs to the posted send; its completion rebuilds it.
        let Slot { .. } = slot;
        Ok(())
    }
}

impl Drop for MsgQp {
    fn drop(&mut self) {
        // SAFETY: destroyed once; its slabs, SRQ and CQ are dropped after
        // (fields), so nothing posted outlives the memory it names.
        unsafe { sys::ibv_destroy_qp(self.qp) };
    }
}
