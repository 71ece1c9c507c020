//! Wire format of the shared-memory handoff: a same-host client asks the
//! server's Unix socket for the region's descriptor.
//!
//! ```text
//! request: u64 rkey | u64 epoch                       (little-endian)
//! reply:   u8 status | u64 region length              (+ the descriptor, SCM_RIGHTS, if OK)
//! ```
//!
//! Both sides use these so that neither can drift from the other.

/// Bytes of a handoff request.
pub const REQUEST_LEN: usize = 16;
/// Bytes of a handoff reply.
pub const REPLY_LEN: usize = 9;
/// Reply status: the descriptor is attached.
pub const STATUS_OK: u8 = 0;
/// Reply status: rkey or epoch is not current; nothing attached.
pub const STATUS_REFUSED: u8 = 1;

/// A request presenting `rkey` and `epoch`.
pub fn encode_request(rkey: u64, epoch: u64) -> [u8; REQUEST_LEN] {
    let mut req = [0u8; REQUEST_LEN];
    req[..8].copy_from_slice(&rkey.to_le_bytes());
    req[8..].copy_from_slice(&epoch.to_le_bytes());
    req
}

/// The rkey and epoch a request presents.
pub fn decode_request(req: &[u8; REQUEST_LEN]) -> (u64, u64) {
    let rkey = u64::from_le_bytes(req[..8].try_into().expect("8 bytes"));
    let epoch = u64::from_le_bytes(req[8..].try_into().expect("8 bytes"));
    (rkey, epoch)
}

/// A reply of `status` for a region of `region_len` bytes.
pub fn encode_reply(status: u8, region_len: u64) -> [u8; REPLY_LEN] {
    let mut reply = [0u8; REPLY_LEN];
    reply[0] = status;
    reply[1..].copy_from_slice(&region_len.to_le_bytes());
    reply
}

/// The status and region length a reply carries.
pub fn decode_reply(reply: &[u8; REPLY_LEN]) -> (u8, u64) {
    (reply[0], u64::from_le_bytes(reply[1..].try_into().expect("8 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        assert_eq!(decode_request(&encode_request(7, u64::MAX)), (7, u64::MAX));
        assert_eq!(decode_reply(&encode_reply(STATUS_REFUSED, 1 << 40)), (STATUS_REFUSED, 1 << 40));
    }
}
