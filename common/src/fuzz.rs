//! Fuzz entry points: one function per decoder that bytes from the network
//! (or from a region a peer writes) reach. Each takes arbitrary bytes and
//! must never panic, except where a successful decode breaks a round-trip
//! property; such an assertion is a real bug, not a fuzzing artefact.
//!
//! They live here, not in the fuzz crate, so that `cargo test` replays the
//! committed corpus through exactly the code the coverage-guided fuzzer ran
//! (`common/tests/fuzz_corpus.rs`), with nothing but cargo installed.

use bytes::BytesMut;
use prost::Message;

use crate::frame::Decoder;
use crate::layout::{self, HEADER_ENCODED_LEN, ITEM_HEADER_LEN, RegionHeader, Slot};
use crate::limits::{BUCKET_LEN, FRAME_HEADER_LEN};
use crate::onesided::{self, ReadStatus, ReplyBuilder};
use crate::proto::{Request, Response};
use crate::read::{Hint, Lookup};
use crate::shm_handoff;

/// A fuzz target: arbitrary bytes in, nothing out, no panic.
pub type Target = fn(&[u8]);

/// Every target by name; the fuzz crate has one binary per name and the
/// corpus one directory per name.
pub const TARGETS: &[(&str, Target)] = &[
    ("frame_request", frame_request),
    ("frame_response", frame_response),
    ("proto_request", proto_request),
    ("proto_response", proto_response),
    ("engine_request", engine_request),
    ("engine_reply", engine_reply),
    ("engine_next_frame", engine_next_frame),
    ("item", item),
    ("region_header", region_header),
    ("read_lookup", read_lookup),
    ("shm_handoff", shm_handoff),
];

/// The first byte picks a parameter (a frame limit, a chunk size); the rest
/// is the input proper.
fn split_param(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&p, rest)) => (p, rest),
        None => (0, data),
    }
}

/// Runs the RPC frame decoder over `data` fed in chunks, as a socket would
/// deliver it, and checks every decoded message re-encodes to a frame that
/// decodes back to it.
fn frames<M: Message + Default + PartialEq + std::fmt::Debug>(data: &[u8]) {
    let (p, data) = split_param(data);
    // Small limits reach the too-large path; 0 means the server's default.
    let max_frame = if p & 0x80 != 0 { usize::from(p & 0x3f) * 16 } else { crate::limits::DEFAULT_MAX_FRAME_LEN };
    let chunk = usize::from(p & 0x0f) + 1;
    let dec = Decoder::new(max_frame);
    let mut rx = BytesMut::new();
    for piece in data.chunks(chunk) {
        rx.extend_from_slice(piece);
        loop {
            match dec.next_message::<M>(&mut rx) {
                Ok(Some(m)) => {
                    let mut wire = BytesMut::new();
                    crate::frame::encode(&m, usize::MAX, &mut wire).expect("no limit");
                    // Re-encoded canonically it may differ in length from
                    // what arrived, so it is decoded without a limit.
                    let again = Decoder::new(usize::MAX).next_message::<M>(&mut wire);
                    assert_eq!(again, Ok(Some(m)), "frame round trip");
                    assert!(wire.is_empty());
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
}

/// The RPC server's frame decoder (`Request`s off a socket).
pub fn frame_request(data: &[u8]) {
    frames::<Request>(data);
}

/// The client's frame decoder (`Response`s off a socket).
pub fn frame_response(data: &[u8]) {
    frames::<Response>(data);
}

fn proto_round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(data: &[u8]) {
    if let Ok(m) = M::decode(data) {
        let enc = m.encode_to_vec();
        assert_eq!(enc.len(), m.encoded_len(), "encoded_len");
        assert_eq!(M::decode(&enc[..]).as_ref(), Ok(&m), "message round trip");
    }
}

/// Every request message (a frame body the server decodes).
pub fn proto_request(data: &[u8]) {
    proto_round_trip::<Request>(data);
    // The server's plain-GET parser only ever agrees with prost.
    if let Some((id, key)) = crate::request::parse_get(data) {
        let req = Request::decode(data).expect("parse_get took bytes prost refuses");
        assert_eq!(req.id, id, "parse_get's id");
        match req.op {
            Some(crate::proto::request::Op::Get(g)) => assert_eq!(&g.key[..], key, "parse_get's key"),
            other => panic!("parse_get saw a GET where prost sees {other:?}"),
        }
    }
}

/// Every response message (a frame body the client decodes).
pub fn proto_response(data: &[u8]) {
    proto_round_trip::<Response>(data);
    // The client's direct read of GET replies only ever agrees with prost.
    let direct = crate::request::decode_response(bytes::Bytes::copy_from_slice(data)).ok();
    assert_eq!(direct, Response::decode(data).ok(), "decode_response and prost disagree");
}

/// The engine's read-batch decoder, then its checks of every read against
/// a region, as the engine runs them. A decoded batch re-encodes to the
/// same bytes (the format has no slack).
pub fn engine_request(data: &[u8]) {
    let mut wrs = Vec::new();
    let Ok(id) = onesided::decode_request(data, &mut wrs) else { return };
    let mut wire = BytesMut::new();
    onesided::encode_request(id, &wrs, &mut wire);
    assert_eq!(&wire[FRAME_HEADER_LEN..], data, "request round trip");
    // A region of any length, and of the largest: no check may overflow.
    for region_len in [0, 1 << 20, u64::MAX] {
        let mut bytes = 0u64;
        for w in &wrs {
            if onesided::check_read(w, w.rkey, region_len, bytes) == ReadStatus::Success {
                let end = w.offset.checked_add(u64::from(w.len)).expect("a served read does not overflow");
                assert!(end <= region_len);
                bytes += u64::from(w.len);
                assert!(bytes <= onesided::MAX_BATCH_BYTES);
            }
        }
    }
}

/// The client's decoder of engine replies. Every range it returns lies in
/// the body, in order; rebuilding the reply gives the same results.
pub fn engine_reply(data: &[u8]) {
    let Ok(reply) = onesided::decode_reply(data) else { return };
    let mut at = onesided::REPLY_HEADER_LEN + 5 * reply.results.len();
    for (_, r) in &reply.results {
        assert_eq!(r.start, at, "ranges are contiguous");
        assert!(r.end <= data.len());
        at = r.end;
    }
    assert_eq!(at, data.len());
    let mut out = BytesMut::new();
    let mut b = ReplyBuilder::new(&mut out, reply.batch_id, reply.results.len(), reply.started);
    for (i, (status, r)) in reply.results.iter().enumerate() {
        let len = u32::try_from(r.len()).expect("a frame body is shorter than 4 GiB");
        b.push(i, *status, len, |dst| dst.copy_from_slice(&data[r.clone()]));
    }
    b.finish(reply.ended);
    let again = onesided::decode_reply(&out[FRAME_HEADER_LEN..]).expect("a built reply decodes");
    assert_eq!(again, reply, "reply round trip");
}

/// The engine's (and its client's) frame splitter, fed in chunks.
pub fn engine_next_frame(data: &[u8]) {
    let (p, data) = split_param(data);
    let max = if p & 0x80 != 0 { usize::from(p & 0x7f) * 4 } else { onesided::MAX_REQUEST_FRAME };
    let chunk = usize::from(p & 0x0f) + 1;
    let mut rx = BytesMut::new();
    for piece in data.chunks(chunk) {
        rx.extend_from_slice(piece);
        loop {
            match onesided::next_frame(&mut rx, max) {
                Ok(Some(body)) => {
                    assert!(body.len() <= max);
                    let mut wrs = Vec::new();
                    let _ = onesided::decode_request(&body, &mut wrs);
                    let _ = onesided::decode_reply(&body);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
}

/// The item decoder (bytes a one-sided reader copied out of a region that
/// writers change under it), and the slot words of a bucket.
pub fn item(data: &[u8]) {
    if let Ok(it) = layout::decode_item(data) {
        let mut enc = Vec::new();
        layout::encode_item(it.key, it.value, it.version, it.flags, it.expires_at, &mut enc);
        let meaningful = ITEM_HEADER_LEN + it.key.len() + it.value.len();
        assert_eq!(&enc[..meaningful], &data[..meaningful], "item round trip");
        assert_eq!(enc.len(), layout::item_units(it.key.len(), it.value.len()) * crate::limits::UNIT);
    }
    for w in data.chunks_exact(8) {
        let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        if let Some(s) = Slot::unpack(v) {
            // Every bit of a slot word means something: unpack loses none.
            assert_eq!(s.pack(), v, "slot round trip");
            assert!(s.offset() > 0 && s.len() >= crate::limits::UNIT);
        }
    }
    for bucket in data.chunks_exact(BUCKET_LEN) {
        let fp = u16::from_le_bytes([bucket[0], bucket[1]]);
        assert!(layout::matching_slots(bucket, fp).all(|s| s.fingerprint == fp));
    }
}

/// The region header decoder (the first read of every one-sided client).
pub fn region_header(data: &[u8]) {
    if let Ok(h) = RegionHeader::decode(data) {
        assert_eq!(&h.encode()[..], &data[..HEADER_ENCODED_LEN], "header round trip");
        assert!(h.in_data_area(h.data_offset, 0) || h.data_len == 0);
        // Every directory entry lies before the data area.
        let last = h.dir_entry_offset(h.dir_entries() - 1);
        assert!(last + 8 <= h.data_offset);
    }
}

/// The one-sided GET's judgement of what it read: two buckets, a hinted
/// item and the items of matching slots, all bytes a peer controls (and,
/// over the engine, of any length the reply gave).
///
/// Layout of `data`: 1 byte key length, the key, 1 byte hint selector,
/// 2 bytes each for the lengths of the two buckets, then the buckets'
/// bytes and the items' bytes.
pub fn read_lookup(data: &[u8]) {
    let header = RegionHeader::plan(8 << 20, 1 << 4, 0x5eed, 1, 1_000_000).expect("a valid plan");
    let (klen, rest) = split_param(data);
    let Some((key, rest)) = rest.split_at_checked(usize::from(klen % 32) + 1) else { return };
    let Some((&hsel, rest)) = rest.split_first() else { return };
    let Some((lens, mut rest)) = rest.split_at_checked(4) else { return };
    let mut take = |n: usize| {
        let (a, b) = rest.split_at(n.min(rest.len()));
        rest = b;
        a
    };
    // Mostly whole buckets; sometimes a reply of another length.
    let blen = |b: [u8; 2]| if b[0] & 0x80 == 0 { BUCKET_LEN } else { usize::from(b[1]) };
    let b0 = take(blen([lens[0], lens[1]]));
    let b1 = take(blen([lens[2], lens[3]]));
    let hint = (hsel & 1 == 1)
        .then(|| {
            let slot = Slot::unpack(u64::from_le_bytes(b0.get(..8)?.try_into().ok()?))?;
            Some(Hint { which: (hsel >> 1) & 1, index: (hsel >> 2) % crate::limits::SLOTS_PER_BUCKET as u8, slot })
        })
        .flatten();
    // The directory entry is the region's word too: from the input, when
    // it makes one the reader accepts.
    let entry = crate::read::judge_dir_entry(b0.get(8..16).unwrap_or(&[]), &header)
        .unwrap_or(crate::layout::DirEntry { offset_units: header.data_offset / crate::limits::UNIT as u64, tag: 1 });
    let mut look = Lookup::new(key, &header, entry, hint, 0);
    let mut reads = Vec::new();
    look.first_reads(&mut reads);
    let hinted = hint.map(|_| take(usize::from(hsel)));
    // The server's clock: whatever the input says (torn, zero, any time).
    let clock = crate::read::judge_clock(take(8));
    match look.after_buckets(key, [b0, b1], hinted, 1, clock) {
        crate::read::AfterBuckets::Hit(h) => {
            let item = hinted.expect("a hit is the hinted item");
            assert_eq!(&item[ITEM_HEADER_LEN..ITEM_HEADER_LEN + key.len()], key);
            let _ = &item[h.value];
        }
        crate::read::AfterBuckets::ReadItems => {
            reads.clear();
            look.item_reads(&mut reads);
            let items: Vec<&[u8]> = reads.iter().map(|r| take(r.len as usize)).collect();
            if let crate::read::Outcome::Hit(h) = look.after_items(key, &items, 2, clock) {
                let _ = &items[h.item][h.value];
            }
        }
        crate::read::AfterBuckets::Miss | crate::read::AfterBuckets::Retry(_) => {}
    }
}

/// The shared-memory handoff's greeting, request and reply decoders, and
/// the engine's greeting (fixed-size messages: a short read is refused
/// before them, so only lengths that match are decoded).
pub fn shm_handoff(data: &[u8]) {
    if let Ok(g) = <&[u8; shm_handoff::GREETING_LEN]>::try_from(data)
        && let Ok((auth, nonce)) = shm_handoff::decode_greeting(g)
    {
        assert_eq!(&shm_handoff::encode_greeting(auth, &nonce), g);
    }
    if let Ok(g) = <&[u8; crate::onesided::GREETING_LEN]>::try_from(data)
        && let Ok((auth, nonce)) = crate::onesided::decode_greeting(g)
    {
        assert_eq!(&crate::onesided::encode_greeting(auth, &nonce), g);
    }
    if let Ok(req) = <&[u8; shm_handoff::REQUEST_LEN]>::try_from(data) {
        let (proof, rkey, epoch) = shm_handoff::decode_request(req);
        assert_eq!(&shm_handoff::encode_request(&proof, rkey, epoch), req);
    }
    if let Ok(reply) = <&[u8; shm_handoff::REPLY_LEN]>::try_from(data) {
        let (status, len) = shm_handoff::decode_reply(reply);
        assert_eq!(&shm_handoff::encode_reply(status, len), reply);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_survives_small_inputs() {
        for (name, t) in TARGETS {
            for len in 0..80 {
                for fill in [0u8, 0xff, 0x41] {
                    let v = vec![fill; len];
                    let r = std::panic::catch_unwind(|| t(&v));
                    assert!(r.is_ok(), "{name} panicked on {len} bytes of {fill:#x}");
                }
            }
        }
    }
}
