//! Length-prefixed framing: a u32 little-endian length, then that many
//! bytes of one protobuf message. Pure functions over byte buffers; the
//! caller owns the socket.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use thiserror::Error;

use crate::limits::FRAME_HEADER_LEN;

/// A frame that cannot be accepted. The connection that sent it is closed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Appends `msg` as one frame to `out`.
///
/// Fails only if the encoded message is larger than `max_frame`, in which
/// case `out` is left as it was.
pub fn encode<M: Message>(msg: &M, max_frame: usize, out: &mut BytesMut) -> Result<(), FrameError> {
    let len = msg.encoded_len();
    if len > max_frame || len > u32::MAX as usize {
        return Err(FrameError::TooLarge { len, max: max_frame });
    }
    out.reserve(FRAME_HEADER_LEN + len);
    out.put_u32_le(len as u32);
    msg.encode(out).expect("reserved enough capacity");
    Ok(())
}

/// Splits complete frames off the front of a receive buffer.
#[derive(Debug, Clone, Copy)]
pub struct Decoder {
    max_frame: usize,
}

impl Decoder {
    /// A decoder that rejects frames longer than `max_frame` bytes.
    pub fn new(max_frame: usize) -> Self {
        Decoder { max_frame }
    }

    /// The largest frame body accepted.
    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Takes the next complete frame body off `buf`, or `None` if more
    /// bytes are needed. A too-large length is rejected as soon as its
    /// prefix arrives, before any of the body is buffered.
    pub fn next_frame(&self, buf: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        let Some(len) = self.frame_len(buf)? else { return Ok(None) };
        buf.advance(FRAME_HEADER_LEN);
        Ok(Some(buf.split_to(len).freeze()))
    }

    /// The body length of the complete frame at the front of `buf`,
    /// taking nothing (the body is `buf[FRAME_HEADER_LEN..][..len]`), or
    /// `None` if more bytes are needed; checked as [`Decoder::next_frame`]
    /// checks it.
    pub fn frame_len(&self, buf: &mut BytesMut) -> Result<Option<usize>, FrameError> {
        if buf.len() < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes(buf[..FRAME_HEADER_LEN].try_into().expect("4 bytes")) as usize;
        if len > self.max_frame {
            return Err(FrameError::TooLarge { len, max: self.max_frame });
        }
        // Cannot overflow on 64 bits; a 32-bit usize with a frame limit
        // near u32::MAX could.
        let whole = FRAME_HEADER_LEN.checked_add(len).ok_or(FrameError::TooLarge { len, max: self.max_frame })?;
        if buf.len() < whole {
            buf.reserve(whole - buf.len());
            return Ok(None);
        }
        Ok(Some(len))
    }

    /// Like [`Decoder::next_frame`], and decodes the body as `M`.
    pub fn next_message<M: Message + Default>(&self, buf: &mut BytesMut) -> Result<Option<M>, FrameError> {
        match self.next_frame(buf)? {
            None => Ok(None),
            Some(body) => M::decode(body).map(Some).map_err(|e| FrameError::Malformed(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Get, Request, request::Op};
    use proptest::prelude::*;

    fn get(id: u64, key: Vec<u8>) -> Request {
        Request { id, op: Some(Op::Get(Get { key: key.into() })) }
    }

    proptest! {
        #[test]
        fn frames_round_trip_across_any_split(
            reqs in prop::collection::vec((any::<u64>(), prop::collection::vec(any::<u8>(), 0..300)), 1..20),
            chunk in 1usize..64,
        ) {
            let mut wire = BytesMut::new();
            for (id, key) in &reqs {
                encode(&get(*id, key.clone()), 1 << 20, &mut wire).unwrap();
            }
            let dec = Decoder::new(1 << 20);
            let mut rx = BytesMut::new();
            let mut got = Vec::new();
            for piece in wire.chunks(chunk) {
                rx.extend_from_slice(piece);
                while let Some(m) = dec.next_message::<Request>(&mut rx).unwrap() {
                    got.push(m);
                }
            }
            prop_assert!(rx.is_empty());
            let want: Vec<Request> = reqs.iter().map(|(id, k)| get(*id, k.clone())).collect();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let dec = Decoder::new(256);
            let mut rx = BytesMut::from(&bytes[..]);
            for _ in 0..bytes.len() + 1 {
                match dec.next_message::<Request>(&mut rx) {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }

    #[test]
    fn oversized_prefix_is_rejected_before_the_body_arrives() {
        let dec = Decoder::new(100);
        let mut rx = BytesMut::new();
        rx.put_u32_le(101);
        assert_eq!(dec.next_frame(&mut rx), Err(FrameError::TooLarge { len: 101, max: 100 }));
    }

    #[test]
    fn truncated_frame_waits_for_more() {
        let mut wire = BytesMut::new();
        encode(&get(7, b"abc".to_vec()), 100, &mut wire).unwrap();
        let dec = Decoder::new(100);
        let mut rx = BytesMut::from(&wire[..wire.len() - 1]);
        assert_eq!(dec.next_frame(&mut rx), Ok(None));
        rx.extend_from_slice(&wire[wire.len() - 1..]);
        assert!(dec.next_frame(&mut rx).unwrap().is_some());
    }

    #[test]
    fn encode_refuses_oversized_message() {
        let mut out = BytesMut::new();
        let err = encode(&get(1, vec![0; 200]), 100, &mut out).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }));
        assert!(out.is_empty());
    }
}
