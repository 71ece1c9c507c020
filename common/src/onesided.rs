//! The verbs-shaped one-sided interface and the wire format of the software
//! one-sided engine ("RDMA over TCP", in the spirit of Soft-iWARP).
//!
//! Shaped after ibverbs so RDMA is one more backend, not a redesign:
//! a client posts a batch of read work requests (rkey, remote offset,
//! length) on a connection to a region — one doorbell, one frame — and gets
//! one completion per request with a status. The engine only checks rkey
//! and bounds and copies bytes; it never runs key-value code.
//!
//! Frames (little-endian), after a u32 body length:
//!
//! ```text
//! request: u64 batch_id | u16 count | count × (u64 rkey | u64 offset | u32 len)
//! reply:   u64 batch_id | u64 started | u64 ended | u16 count | count × (u8 status | u32 len) | the bytes of every successful read, in order
//! ```
//!
//! `started` and `ended` are the engine's `CLOCK_MONOTONIC` (ns) read before
//! the batch's first read and after its last: the clock a shard leader's
//! lease is published on, so a reader of a cluster region can tell whether
//! the whole batch lay inside the lease (`cluster::lease::judge`) with no
//! bound on clock differences at all.
//!
//! Before any frame, a handshake (after TLS, if the engine speaks it): the
//! engine sends a greeting (`"DMKVENG2" | u8 flags | nonce`), the client
//! answers with a proof of its secret for that nonce (`dmkv_common::auth`;
//! zeros when the greeting says no authentication is needed), and the
//! engine answers one status byte. Only then does it serve reads.

use bytes::{Buf, BufMut, BytesMut};
use subtle::ConstantTimeEq;
use thiserror::Error;

use crate::auth::{NONCE_LEN, PROOF_LEN};
use crate::limits::FRAME_HEADER_LEN;

/// Most reads in one batch.
pub const MAX_READS_PER_BATCH: usize = 1024;
/// Longest single read: one maximum item, rounded up.
pub const MAX_READ_LEN: u32 = 2 * 1024 * 1024;
/// Most bytes one batch may read in total.
pub const MAX_BATCH_BYTES: u64 = 16 * 1024 * 1024;
/// Bytes of one read request on the wire.
pub const READ_REQ_LEN: usize = 20;
/// Largest request frame body.
pub const MAX_REQUEST_FRAME: usize = 10 + MAX_READS_PER_BATCH * READ_REQ_LEN;
/// Bytes of a reply's header: batch id, the two clock stamps, count.
pub const REPLY_HEADER_LEN: usize = 26;
/// Largest reply frame body.
pub const MAX_REPLY_FRAME: usize = REPLY_HEADER_LEN + MAX_READS_PER_BATCH * 5 + MAX_BATCH_BYTES as usize;

/// One read work request (like an `IBV_WR_RDMA_READ`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadWr {
    pub rkey: u64,
    pub offset: u64,
    pub len: u32,
}

/// Completion status of one read (like `ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReadStatus {
    Success = 0,
    /// The rkey is not the region's current one (wrong, or from an old
    /// registration/epoch).
    BadRkey = 1,
    /// The read goes past the end of the region (or its end overflows).
    OutOfBounds = 2,
    /// The read is longer than [`MAX_READ_LEN`], or the batch reads more
    /// than [`MAX_BATCH_BYTES`].
    TooLong = 3,
}

impl ReadStatus {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => ReadStatus::Success,
            1 => ReadStatus::BadRkey,
            2 => ReadStatus::OutOfBounds,
            3 => ReadStatus::TooLong,
            _ => return None,
        })
    }
}

/// A frame the engine or client cannot accept; the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("batch of {0} reads exceeds the maximum of {MAX_READS_PER_BATCH}")]
    TooManyReads(usize),
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
}

/// Opens every engine greeting.
pub const ENGINE_MAGIC: [u8; 8] = *b"DMKVENG2";
/// Bytes of the engine's greeting.
pub const GREETING_LEN: usize = crate::auth::GREETING_LEN;
/// Bytes of the client's answer to the greeting.
pub const HANDSHAKE_PROOF_LEN: usize = PROOF_LEN;
/// Handshake status: reads may follow.
pub const HANDSHAKE_OK: u8 = 0;
/// Handshake status: the proof was wrong or its role may not read; the
/// engine closes the connection.
pub const HANDSHAKE_REFUSED: u8 = 1;
/// Handshake status: too many failures from this address; not checked.
pub const HANDSHAKE_RATE_LIMITED: u8 = 2;

/// The greeting an engine sends on a new connection.
pub fn encode_greeting(auth_required: bool, nonce: &[u8; NONCE_LEN]) -> [u8; GREETING_LEN] {
    crate::auth::encode_greeting(&ENGINE_MAGIC, auth_required, nonce)
}

/// Whether an engine's greeting asks for authentication, and its nonce.
pub fn decode_greeting(g: &[u8; GREETING_LEN]) -> Result<(bool, [u8; NONCE_LEN]), WireError> {
    crate::auth::decode_greeting(&ENGINE_MAGIC, g).map_err(|e| match e {
        crate::auth::BadGreeting::Magic => WireError::Malformed("not a dmkv engine (bad greeting)"),
        crate::auth::BadGreeting::Flags => WireError::Malformed("greeting has unknown flags"),
    })
}

/// Checks one read against a region of `region_len` bytes and the bytes the
/// batch has read so far; the engine serves it only on `Success`.
pub fn check_read(wr: &ReadWr, rkey: u64, region_len: u64, batch_bytes: u64) -> ReadStatus {
    // Constant time: how long a rejection takes says nothing about how
    // many bits of a guessed rkey were right.
    if !bool::from(wr.rkey.ct_eq(&rkey)) {
        return ReadStatus::BadRkey;
    }
    if wr.len > MAX_READ_LEN || batch_bytes + wr.len as u64 > MAX_BATCH_BYTES {
        return ReadStatus::TooLong;
    }
    match wr.offset.checked_add(wr.len as u64) {
        Some(end) if end <= region_len => ReadStatus::Success,
        _ => ReadStatus::OutOfBounds,
    }
}

/// Appends a request frame.
pub fn encode_request(batch_id: u64, wrs: &[ReadWr], out: &mut BytesMut) {
    assert!(wrs.len() <= MAX_READS_PER_BATCH, "batch too large");
    out.reserve(FRAME_HEADER_LEN + 10 + wrs.len() * READ_REQ_LEN);
    out.put_u32_le((10 + wrs.len() * READ_REQ_LEN) as u32);
    out.put_u64_le(batch_id);
    out.put_u16_le(wrs.len() as u16);
    for w in wrs {
        out.put_u64_le(w.rkey);
        out.put_u64_le(w.offset);
        out.put_u32_le(w.len);
    }
}

/// Takes the next complete frame body (without its length) off `buf`.
pub fn next_frame(buf: &mut BytesMut, max: usize) -> Result<Option<BytesMut>, WireError> {
    if buf.len() < FRAME_HEADER_LEN {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    if buf.len() < FRAME_HEADER_LEN + len {
        buf.reserve(FRAME_HEADER_LEN + len - buf.len());
        return Ok(None);
    }
    buf.advance(FRAME_HEADER_LEN);
    Ok(Some(buf.split_to(len)))
}

/// Decodes a request frame body into its batch id and reads.
pub fn decode_request(mut body: &[u8], wrs: &mut Vec<ReadWr>) -> Result<u64, WireError> {
    if body.len() < 10 {
        return Err(WireError::Malformed("request shorter than its header"));
    }
    let batch_id = body.get_u64_le();
    let count = body.get_u16_le() as usize;
    if count > MAX_READS_PER_BATCH {
        return Err(WireError::TooManyReads(count));
    }
    if body.len() != count * READ_REQ_LEN {
        return Err(WireError::Malformed("request length does not match its count"));
    }
    wrs.clear();
    for _ in 0..count {
        wrs.push(ReadWr { rkey: body.get_u64_le(), offset: body.get_u64_le(), len: body.get_u32_le() });
    }
    Ok(batch_id)
}

/// Builds a reply frame in place: statuses first, then data.
pub struct ReplyBuilder<'a> {
    out: &'a mut BytesMut,
    start: usize,
    status_at: usize,
    count: usize,
}

impl<'a> ReplyBuilder<'a> {
    /// Starts a reply for `count` reads at the end of `out`, whose first
    /// read starts after the engine's clock read `started`.
    pub fn new(out: &'a mut BytesMut, batch_id: u64, count: usize, started: u64) -> Self {
        assert!(count <= MAX_READS_PER_BATCH);
        let start = out.len();
        out.put_u32_le(0);
        out.put_u64_le(batch_id);
        out.put_u64_le(started);
        out.put_u64_le(0);
        out.put_u16_le(count as u16);
        let status_at = out.len();
        out.put_bytes(0, count * 5);
        ReplyBuilder { out, start, status_at, count }
    }

    /// Records read `i`'s status; on success, `fill` writes its `len` bytes.
    pub fn push(&mut self, i: usize, status: ReadStatus, len: u32, fill: impl FnOnce(&mut [u8])) {
        assert!(i < self.count);
        let at = self.status_at + 5 * i;
        self.out[at] = status as u8;
        if status == ReadStatus::Success {
            self.out[at + 1..at + 5].copy_from_slice(&len.to_le_bytes());
            let data = self.out.len();
            self.out.put_bytes(0, len as usize);
            fill(&mut self.out[data..]);
        }
    }

    /// Writes the frame length and the clock as read after the batch's
    /// last read (`ended`); the reply is complete.
    pub fn finish(self, ended: u64) {
        let body = (self.out.len() - self.start - FRAME_HEADER_LEN) as u32;
        self.out[self.start..self.start + 4].copy_from_slice(&body.to_le_bytes());
        let at = self.start + FRAME_HEADER_LEN + 16;
        self.out[at..at + 8].copy_from_slice(&ended.to_le_bytes());
    }
}

/// A decoded reply: per-read status and the byte range of each successful
/// read within the frame body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub batch_id: u64,
    /// The engine's monotonic clock before the first read and after the
    /// last (ns).
    pub started: u64,
    pub ended: u64,
    pub results: Vec<(ReadStatus, std::ops::Range<usize>)>,
}

/// Decodes a reply frame body; ranges index into `body`.
pub fn decode_reply(body: &[u8]) -> Result<Reply, WireError> {
    const H: usize = REPLY_HEADER_LEN;
    if body.len() < H {
        return Err(WireError::Malformed("reply shorter than its header"));
    }
    let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let (batch_id, started, ended) = (word(0), word(8), word(16));
    if ended < started {
        return Err(WireError::Malformed("reply ended before it started"));
    }
    let count = u16::from_le_bytes(body[24..H].try_into().expect("2 bytes")) as usize;
    if count > MAX_READS_PER_BATCH || body.len() < H + 5 * count {
        return Err(WireError::Malformed("reply statuses truncated"));
    }
    let mut data = H + 5 * count;
    let mut results = Vec::with_capacity(count);
    for i in 0..count {
        let at = H + 5 * i;
        let status = ReadStatus::from_u8(body[at]).ok_or(WireError::Malformed("unknown read status"))?;
        let len = u32::from_le_bytes(body[at + 1..at + 5].try_into().expect("4 bytes")) as usize;
        let range = if status == ReadStatus::Success {
            let end = data
                .checked_add(len)
                .filter(|&e| e <= body.len())
                .ok_or(WireError::Malformed("reply data truncated"))?;
            let r = data..end;
            data = end;
            r
        } else {
            data..data
        };
        results.push((status, range));
    }
    if data != body.len() {
        return Err(WireError::Malformed("reply has trailing bytes"));
    }
    Ok(Reply { batch_id, started, ended, results })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_wr() -> impl Strategy<Value = ReadWr> {
        (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(rkey, offset, len)| ReadWr { rkey, offset, len })
    }

    proptest! {
        #[test]
        fn requests_round_trip(id in any::<u64>(), wrs in prop::collection::vec(arb_wr(), 0..50)) {
            let mut buf = BytesMut::new();
            encode_request(id, &wrs, &mut buf);
            let body = next_frame(&mut buf, MAX_REQUEST_FRAME).unwrap().unwrap();
            let mut got = Vec::new();
            prop_assert_eq!(decode_request(&body, &mut got), Ok(id));
            prop_assert_eq!(got, wrs);
        }

        #[test]
        fn replies_round_trip(id in any::<u64>(), started in any::<u64>(), took in 0u64..1_000_000, reads in prop::collection::vec((0u8..4, prop::collection::vec(any::<u8>(), 0..100)), 0..20)) {
            let mut buf = BytesMut::new();
            let mut b = ReplyBuilder::new(&mut buf, id, reads.len(), started);
            for (i, (s, data)) in reads.iter().enumerate() {
                let status = ReadStatus::from_u8(*s).unwrap();
                b.push(i, status, data.len() as u32, |d| d.copy_from_slice(data));
            }
            let ended = started.saturating_add(took);
            b.finish(ended);
            let body = next_frame(&mut buf, MAX_REPLY_FRAME).unwrap().unwrap();
            let r = decode_reply(&body).unwrap();
            prop_assert_eq!((r.batch_id, r.started, r.ended), (id, started, ended));
            for ((s, data), (status, range)) in reads.iter().zip(&r.results) {
                prop_assert_eq!(*status as u8, *s);
                if *status == ReadStatus::Success {
                    prop_assert_eq!(&body[range.clone()], &data[..]);
                }
            }
        }

        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut wrs = Vec::new();
            let _ = decode_request(&bytes, &mut wrs);
            let _ = decode_reply(&bytes);
            let mut buf = BytesMut::from(&bytes[..]);
            let _ = next_frame(&mut buf, 64);
        }
    }

    #[test]
    fn read_checks() {
        let ok = ReadWr { rkey: 7, offset: 100, len: 28 };
        assert_eq!(check_read(&ok, 7, 128, 0), ReadStatus::Success);
        assert_eq!(check_read(&ok, 8, 128, 0), ReadStatus::BadRkey);
        assert_eq!(check_read(&ReadWr { len: 29, ..ok }, 7, 128, 0), ReadStatus::OutOfBounds);
        assert_eq!(check_read(&ReadWr { offset: u64::MAX, ..ok }, 7, 128, 0), ReadStatus::OutOfBounds);
        assert_eq!(check_read(&ReadWr { len: MAX_READ_LEN + 1, ..ok }, 7, u64::MAX, 0), ReadStatus::TooLong);
        assert_eq!(check_read(&ok, 7, 128, MAX_BATCH_BYTES), ReadStatus::TooLong);
    }

    #[test]
    fn greetings_round_trip_and_reject_strangers() {
        let nonce = [3u8; NONCE_LEN];
        assert_eq!(decode_greeting(&encode_greeting(true, &nonce)), Ok((true, nonce)));
        assert_eq!(decode_greeting(&encode_greeting(false, &nonce)), Ok((false, nonce)));
        let mut bad = encode_greeting(true, &nonce);
        bad[0] = b'X';
        assert!(decode_greeting(&bad).is_err());
        let mut flags = encode_greeting(true, &nonce);
        flags[8] = 0x80;
        assert!(decode_greeting(&flags).is_err());
    }

    #[test]
    fn count_mismatch_is_malformed() {
        let mut buf = BytesMut::new();
        encode_request(1, &[ReadWr { rkey: 1, offset: 2, len: 3 }], &mut buf);
        let body = next_frame(&mut buf, MAX_REQUEST_FRAME).unwrap().unwrap();
        let mut wrs = Vec::new();
        assert!(decode_request(&body[..body.len() - 1], &mut wrs).is_err());
        let mut bad = body.to_vec();
        bad[8] = 2;
        assert!(decode_request(&bad, &mut wrs).is_err());
    }
}
