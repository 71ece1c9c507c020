//! Requests as a client frames them: an owned [`Op`], or the two requests
//! of every workload (GET and PUT) encoded straight from the caller's
//! borrowed key and value. An owned `proto::Get`/`proto::Put` needs its key
//! and value copied into fresh `Bytes` first, and then copied again into
//! the send buffer; encoding from the borrowed slices copies once. The
//! bytes are exactly what prost writes for the owned request (the tests
//! compare them), so the server cannot tell the two apart.
//!
//! Read back the other way, the same two hot messages skip prost's
//! generic decode: a plain GET as the server takes it ([`parse_get`]) and
//! a GET's reply as the client takes it ([`decode_response`]). Each only
//! ever agrees with prost, and leaves anything unusual to it.

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

use crate::frame::FrameError;
use crate::limits::FRAME_HEADER_LEN;
use crate::proto::{GetReply, Response, WriteId, request::Op, response::Result as R};

/// `Request.id`'s field number.
const REQUEST_ID: u32 = 1;
/// `Request.op`'s `put` and `get` field numbers.
const REQUEST_PUT: u32 = 3;
const REQUEST_GET: u32 = 4;
/// `Get.key`; `Put.key`, `Put.value` and `Put.write_id`.
const GET_KEY: u32 = 1;
const PUT_KEY: u32 = 1;
const PUT_VALUE: u32 = 2;
const PUT_WRITE_ID: u32 = 3;
/// `Response.id` and `Response.result`'s `get`.
const RESPONSE_ID: u32 = 1;
const RESPONSE_GET: u32 = 5;

/// What a client sends: a request body without its id, which the
/// connection assigns when it frames it.
#[derive(Debug, Clone, Copy)]
pub enum Body<'a> {
    /// Any request, as prost encodes it.
    Op(&'a Op),
    /// `Op::Get` of `key`, without copying `key` first.
    Get { key: &'a [u8] },
    /// `Op::Put` of `key` and `value` with only `write_id` set (a plain
    /// SET), without copying them first.
    Put { key: &'a [u8], value: &'a [u8], write_id: Option<&'a WriteId> },
}

/// A length-delimited bytes field's length on the wire, omitted when
/// empty (proto3 leaves default values out, as prost does).
fn bytes_field_len(tag: u32, b: &[u8]) -> usize {
    if b.is_empty() { 0 } else { key_len(tag) + encoded_len_varint(b.len() as u64) + b.len() }
}

fn put_bytes_field(tag: u32, b: &[u8], out: &mut BytesMut) {
    if !b.is_empty() {
        encode_key(tag, WireType::LengthDelimited, out);
        encode_varint(b.len() as u64, out);
        out.put_slice(b);
    }
}

impl Body<'_> {
    /// The encoded length of the op's message (without the `Request` field
    /// around it, for the borrowed ones).
    fn inner_len(&self) -> usize {
        match self {
            Body::Op(op) => op.encoded_len(),
            Body::Get { key } => bytes_field_len(GET_KEY, key),
            Body::Put { key, value, write_id } => {
                bytes_field_len(PUT_KEY, key)
                    + bytes_field_len(PUT_VALUE, value)
                    + write_id.map_or(0, |w| prost::encoding::message::encoded_len(PUT_WRITE_ID, w))
            }
        }
    }

    /// The `Request` with `id` this body makes, as encoded bytes' length.
    pub fn encoded_len(&self, id: u64) -> usize {
        let id_len = if id == 0 { 0 } else { key_len(REQUEST_ID) + encoded_len_varint(id) };
        let inner = self.inner_len();
        let op_len = match self {
            Body::Op(_) => inner,
            Body::Get { .. } => key_len(REQUEST_GET) + encoded_len_varint(inner as u64) + inner,
            Body::Put { .. } => key_len(REQUEST_PUT) + encoded_len_varint(inner as u64) + inner,
        };
        id_len + op_len
    }

    /// Appends the `Request { id, op }` this body makes as one frame to
    /// `out`. Fails only if it is larger than `max_frame`, leaving `out`
    /// as it was.
    pub fn encode_frame(&self, id: u64, max_frame: usize, out: &mut BytesMut) -> Result<(), FrameError> {
        let len = self.encoded_len(id);
        if len > max_frame || len > u32::MAX as usize {
            return Err(FrameError::TooLarge { len, max: max_frame });
        }
        out.reserve(FRAME_HEADER_LEN + len);
        let start = out.len();
        out.put_u32_le(len as u32);
        if id != 0 {
            prost::encoding::uint64::encode(REQUEST_ID, &id, out);
        }
        match self {
            Body::Op(op) => op.encode(out),
            Body::Get { key } => {
                encode_key(REQUEST_GET, WireType::LengthDelimited, out);
                encode_varint(self.inner_len() as u64, out);
                put_bytes_field(GET_KEY, key, out);
            }
            Body::Put { key, value, write_id } => {
                encode_key(REQUEST_PUT, WireType::LengthDelimited, out);
                encode_varint(self.inner_len() as u64, out);
                put_bytes_field(PUT_KEY, key, out);
                put_bytes_field(PUT_VALUE, value, out);
                if let Some(w) = write_id {
                    prost::encoding::message::encode(PUT_WRITE_ID, *w, out);
                }
            }
        }
        debug_assert_eq!(out.len() - start, FRAME_HEADER_LEN + len, "the length said is the length written");
        Ok(())
    }
}

/// The id and key of a request body that is a GET and nothing else,
/// borrowed from the body, so a server answers the common request without
/// decoding it into owned `Bytes` first. `None` for anything else, and
/// for a GET prost would read differently from a plain one (a field twice,
/// an unknown field, a malformed field): the caller then decodes the body
/// with prost, so this only ever agrees with it (the tests check that).
pub fn parse_get(body: &[u8]) -> Option<(u64, &[u8])> {
    let (mut id, mut get) = (None, None);
    let mut rest = body;
    while !rest.is_empty() {
        match field(&mut rest)? {
            (REQUEST_ID, Field::Varint(v)) if id.is_none() => id = Some(v),
            (REQUEST_GET, Field::Bytes(b)) if get.is_none() => get = Some(b),
            _ => return None,
        }
    }
    let mut rest = get?;
    let mut key = None;
    while !rest.is_empty() {
        match field(&mut rest)? {
            (GET_KEY, Field::Bytes(b)) if key.is_none() => key = Some(b),
            _ => return None,
        }
    }
    Some((id.unwrap_or(0), key.unwrap_or(&[])))
}

/// A `Response` frame body as prost decodes it, read directly when it is
/// a GET's reply (the value a slice of `body`, as prost makes it).
pub fn decode_response(body: Bytes) -> Result<Response, prost::DecodeError> {
    match parse_get_reply(&body) {
        Some((id, reply, value)) => {
            let value = body.slice_ref(value);
            Ok(Response { id, result: Some(R::Get(GetReply { value, ..reply })) })
        }
        None => Response::decode(body),
    }
}

/// A GET reply's id, fields and value (borrowed), when `body` is one with
/// each field at most once and nothing else; `None` otherwise.
fn parse_get_reply(body: &[u8]) -> Option<(u64, GetReply, &[u8])> {
    let (mut id, mut get) = (None, None);
    let mut rest = body;
    while !rest.is_empty() {
        match field(&mut rest)? {
            (RESPONSE_ID, Field::Varint(v)) if id.is_none() => id = Some(v),
            (RESPONSE_GET, Field::Bytes(b)) if get.is_none() => get = Some(b),
            _ => return None,
        }
    }
    let mut rest = get?;
    let mut r = GetReply::default();
    let mut value: &[u8] = &[];
    let mut seen = 0u16;
    while !rest.is_empty() {
        let (tag, f) = field(&mut rest)?;
        let bit = 1u16.checked_shl(tag).filter(|b| seen & b == 0)?;
        seen |= bit;
        // Scalars as prost reads them: `bool` is any non-zero varint,
        // `uint32` the varint's low 32 bits.
        match (tag, f) {
            (1, Field::Varint(v)) => r.found = v != 0,
            (2, Field::Bytes(b)) => value = b,
            (3, Field::Varint(v)) => r.version = v,
            (4, Field::Fixed64(v)) => r.hint_slot = v,
            (5, Field::Varint(v)) => r.hint_bucket = v as u32,
            (6, Field::Varint(v)) => r.hint_index = v as u32,
            (7, Field::Varint(v)) => r.flags = v as u32,
            (8, Field::Varint(v)) => r.expires_at = v as u32,
            _ => return None,
        }
    }
    Some((id.unwrap_or(0), r, value))
}

/// A field's value: the wire types of a plain GET and its reply.
enum Field<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
}

/// Takes one field off `buf`: its number and value, or `None` for a
/// malformed field or another wire type.
fn field<'a>(buf: &mut &'a [u8]) -> Option<(u32, Field<'a>)> {
    let (tag, wire) = prost::encoding::decode_key(buf).ok()?;
    match wire {
        WireType::Varint => Some((tag, Field::Varint(prost::encoding::decode_varint(buf).ok()?))),
        WireType::SixtyFourBit => {
            let (word, rest) = buf.split_first_chunk::<8>()?;
            *buf = rest;
            Some((tag, Field::Fixed64(u64::from_le_bytes(*word))))
        }
        WireType::LengthDelimited => {
            let len = usize::try_from(prost::encoding::decode_varint(buf).ok()?).ok()?;
            if len > buf.len() {
                return None;
            }
            let (value, rest) = buf.split_at(len);
            *buf = rest;
            Some((tag, Field::Bytes(value)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{self, Decoder};
    use crate::proto::{self, Request};
    use bytes::Bytes;
    use proptest::prelude::*;

    fn framed(req: &Request) -> BytesMut {
        let mut out = BytesMut::new();
        frame::encode(req, usize::MAX, &mut out).unwrap();
        out
    }

    fn borrowed(body: Body<'_>, id: u64) -> BytesMut {
        let mut out = BytesMut::new();
        body.encode_frame(id, usize::MAX, &mut out).unwrap();
        out
    }

    proptest! {
        #[test]
        fn a_borrowed_get_or_put_is_the_bytes_prost_writes_for_the_owned_one(
            id in prop_oneof![Just(0u64), any::<u64>()],
            key in prop::collection::vec(any::<u8>(), 0..300),
            value in prop::collection::vec(any::<u8>(), 0..3000),
            write_id in prop::option::of((any::<u64>(), any::<u64>(), any::<u32>())),
        ) {
            let w = write_id.map(|(client, seq, retry_window_ms)| WriteId { client, seq, retry_window_ms });
            let get = Request { id, op: Some(Op::Get(proto::Get { key: Bytes::from(key.clone()) })) };
            prop_assert_eq!(borrowed(Body::Get { key: &key }, id), framed(&get));
            let put = Request {
                id,
                op: Some(Op::Put(proto::Put {
                    key: Bytes::from(key.clone()),
                    value: Bytes::from(value.clone()),
                    write_id: w,
                    ..Default::default()
                })),
            };
            let mut got = borrowed(Body::Put { key: &key, value: &value, write_id: w.as_ref() }, id);
            prop_assert_eq!(&got, &framed(&put));
            // And it reads back as the request it stands for.
            let back: Option<Request> = Decoder::new(usize::MAX).next_message(&mut got).unwrap();
            prop_assert_eq!(back, Some(put.clone()));
            let op = put.op.clone().unwrap();
            prop_assert_eq!(borrowed(Body::Op(&op), id), framed(&put));
        }
    }

    #[test]
    fn a_frame_over_the_limit_writes_nothing() {
        let mut out = BytesMut::from(&b"before"[..]);
        let value = vec![7u8; 100];
        let e = Body::Put { key: b"k", value: &value, write_id: None }.encode_frame(1, 50, &mut out).unwrap_err();
        assert!(matches!(e, FrameError::TooLarge { max: 50, .. }), "{e:?}");
        assert_eq!(&out[..], b"before");
    }

    fn body(framed: &BytesMut) -> &[u8] {
        &framed[FRAME_HEADER_LEN..]
    }

    proptest! {
        #[test]
        fn a_plain_get_parses_borrowed_as_prost_reads_it(
            id in prop_oneof![Just(0u64), any::<u64>()],
            key in prop::collection::vec(any::<u8>(), 0..300),
        ) {
            let wire = borrowed(Body::Get { key: &key }, id);
            prop_assert_eq!(parse_get(body(&wire)), Some((id, &key[..])));
        }

        /// Whatever bytes it is given, `parse_get` says what prost says or
        /// nothing: mutated GETs, other requests, noise.
        #[test]
        fn parse_get_never_disagrees_with_prost(
            id in any::<u64>(),
            key in prop::collection::vec(any::<u8>(), 0..40),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            extra in prop::collection::vec(any::<u8>(), 0..6),
            other in any::<bool>(),
        ) {
            let req = if other {
                Request { id, op: Some(Op::Delete(proto::Delete { key: Bytes::from(key.clone()), ..Default::default() })) }
            } else {
                Request { id, op: Some(Op::Get(proto::Get { key: Bytes::from(key.clone()) })) }
            };
            let mut b = body(&framed(&req)).to_vec();
            for (at, byte) in &edits {
                if !b.is_empty() {
                    let i = at.index(b.len());
                    b[i] = *byte;
                }
            }
            b.extend_from_slice(&extra);
            if let Some((pid, pkey)) = parse_get(&b) {
                let decoded = <Request as prost::Message>::decode(&b[..]);
                prop_assert!(decoded.is_ok(), "parse_get took bytes prost refuses: {:?}", b);
                let decoded = decoded.unwrap();
                prop_assert_eq!(decoded.id, pid);
                match decoded.op {
                    Some(Op::Get(g)) => prop_assert_eq!(&g.key[..], pkey),
                    other => prop_assert!(false, "parse_get saw a GET where prost sees {:?}", other),
                }
            }
        }
    }

    #[test]
    fn a_get_prost_would_merge_or_extend_is_left_to_prost() {
        let mut twice = borrowed(Body::Get { key: b"a" }, 7);
        let second = borrowed(Body::Get { key: b"b" }, 0);
        twice.extend_from_slice(body(&second));
        assert_eq!(parse_get(body(&twice)), None, "two op fields");
        let mut unknown = body(&borrowed(Body::Get { key: b"a" }, 7)).to_vec();
        unknown.extend_from_slice(&[0x78, 0x01]); // field 15, varint 1
        assert_eq!(parse_get(&unknown), None, "an unknown field");
        assert_eq!(parse_get(&[]), None, "no op at all");
        let empty_get = Request { id: 3, op: Some(Op::Get(proto::Get::default())) };
        assert_eq!(parse_get(body(&framed(&empty_get))), Some((3, &b""[..])), "an empty key is the store's to refuse");
        // Request { id: 7, get: Get { key: "a" } } is 08 07 22 03 0a 01 61.
        assert_eq!(parse_get(&[0x08, 0x07, 0x22, 0x03, 0x0a, 0x01, 0x61]), Some((7, &b"a"[..])));
        let refused: [&[u8]; 9] = [
            &[0x08, 0x07, 0x08, 0x07, 0x22, 0x03, 0x0a, 0x01, 0x61], // id twice
            &[0x08, 0x07, 0x22, 0x06, 0x0a, 0x01, 0x61, 0x0a, 0x01, 0x62], // key twice
            &[0x0a, 0x01, 0x07, 0x22, 0x03, 0x0a, 0x01, 0x61],       // id length-delimited
            &[0x08, 0x07, 0x20, 0x03],                               // get as a varint
            &[0x00, 0x07, 0x22, 0x03, 0x0a, 0x01, 0x61],             // field number 0
            &[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0x22, 0x00], // 11-byte varint
            &[0x08, 0x07, 0x22, 0x04, 0x0a, 0x01, 0x61],             // get's length past the end
            &[0x08, 0x07, 0x22, 0x03, 0x0a, 0x02, 0x61],             // key's length past the end
            &[0x08, 0x07, 0x22, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], // length u64::MAX
        ];
        for (i, b) in refused.iter().enumerate() {
            assert_eq!(parse_get(b), None, "case {i}: {b:02x?}");
        }
    }

    fn get_reply_strategy() -> impl Strategy<Value = Response> {
        let reply = (
            any::<bool>(),
            prop::collection::vec(any::<u8>(), 0..200),
            any::<u64>(),
            any::<u64>(),
            (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()),
        );
        (any::<u64>(), reply).prop_map(|(id, (found, value, version, hint_slot, (b, i, flags, exp)))| Response {
            id,
            result: Some(R::Get(GetReply {
                found,
                value: value.into(),
                version,
                hint_slot,
                hint_bucket: b,
                hint_index: i,
                flags,
                expires_at: exp,
            })),
        })
    }

    proptest! {
        #[test]
        fn a_get_reply_decodes_directly_as_prost_decodes_it(resp in get_reply_strategy()) {
            let body = resp.encode_to_vec();
            prop_assert!(parse_get_reply(&body).is_some(), "a plain reply took prost's way");
            prop_assert_eq!(decode_response(Bytes::from(body)).unwrap(), resp);
        }

        /// Mutated replies, other replies, noise: read directly only
        /// where prost reads the same.
        #[test]
        fn decode_response_never_disagrees_with_prost(
            resp in get_reply_strategy(),
            other in any::<bool>(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            extra in prop::collection::vec(any::<u8>(), 0..10),
        ) {
            let resp = if other {
                Response { id: resp.id, result: Some(R::Put(proto::PutReply { version: 9 })) }
            } else {
                resp
            };
            let mut b = resp.encode_to_vec();
            for (at, byte) in &edits {
                if !b.is_empty() {
                    let i = at.index(b.len());
                    b[i] = *byte;
                }
            }
            b.extend_from_slice(&extra);
            let prost = Response::decode(&b[..]);
            if parse_get_reply(&b).is_some() {
                prop_assert!(prost.is_ok(), "read directly bytes prost refuses: {:02x?}", b);
            }
            match (decode_response(Bytes::from(b.clone())), prost) {
                (Ok(a), Ok(p)) => prop_assert_eq!(a, p),
                (Err(_), Err(_)) => {}
                (a, p) => prop_assert!(false, "direct {:?} vs prost {:?} for {:02x?}", a, p, b),
            }
        }
    }

    #[test]
    fn a_get_reply_with_a_field_twice_or_unknown_is_left_to_prost() {
        // Response { id: 2, get: GetReply { found: true, version: 5 } }.
        let plain = [0x08, 0x02, 0x2a, 0x04, 0x08, 0x01, 0x18, 0x05];
        assert!(parse_get_reply(&plain).is_some());
        let refused: [&[u8]; 5] = [
            &[0x08, 0x02, 0x2a, 0x06, 0x08, 0x01, 0x18, 0x05, 0x18, 0x06], // version twice
            &[0x08, 0x02, 0x2a, 0x06, 0x08, 0x01, 0x18, 0x05, 0x48, 0x01], // field 9
            &[0x08, 0x02, 0x2a, 0x04, 0x08, 0x01, 0x19, 0x05],             // version as fixed64, truncated
            &[0x08, 0x02, 0x2a, 0x03, 0x21, 0x01, 0x02],                   // hint_slot short of 8 bytes
            &[0x08, 0x02, 0x2a, 0x02, 0x08, 0x01, 0x2a, 0x00],             // get twice
        ];
        for (i, b) in refused.iter().enumerate() {
            assert!(parse_get_reply(b).is_none(), "case {i}: {b:02x?}");
        }
        // Whatever prost makes of them, decode_response makes the same.
        for b in refused {
            assert_eq!(decode_response(Bytes::copy_from_slice(b)).ok(), Response::decode(b).ok());
        }
    }
}
