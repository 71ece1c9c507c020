//! Wire format of the shared-memory handoff: a same-host client asks the
//! server's Unix socket for the region's descriptor.
//!
//! ```text
//! server:  "DMKVSHM1" | u8 flags (bit 0: auth required) | 32-byte nonce
//! client:  32-byte proof (zeros if no auth) | u64 rkey | u64 epoch
//! server:  u8 status | u64 region length   (+ the descriptor, SCM_RIGHTS, if OK)
//! ```
//!
//! All integers little-endian. The proof is `auth::Token::prove` for
//! [`Purpose::Shm`](crate::auth::Purpose::Shm) and the greeting's nonce.
//! Both sides use these so that neither can drift from the other.

use subtle::ConstantTimeEq;

use crate::auth::{NONCE_LEN, PROOF_LEN};
use crate::onesided::WireError;

/// Opens every handoff greeting.
pub const SHM_MAGIC: [u8; 8] = *b"DMKVSHM1";
/// Bytes of the server's greeting.
pub const GREETING_LEN: usize = crate::auth::GREETING_LEN;
/// Bytes of a handoff request.
pub const REQUEST_LEN: usize = PROOF_LEN + 16;
/// Bytes of a handoff reply.
pub const REPLY_LEN: usize = 9;
/// Reply status: the descriptor is attached.
pub const STATUS_OK: u8 = 0;
/// Reply status: rkey or epoch is not current; nothing attached.
pub const STATUS_REFUSED: u8 = 1;
/// Reply status: authentication is required and the proof is wrong or
/// missing, or its role may not read; nothing attached.
pub const STATUS_UNAUTHENTICATED: u8 = 2;
/// Reply status: too many failed attempts lately; not checked.
pub const STATUS_RATE_LIMITED: u8 = 3;

/// The greeting a server sends on a new handoff connection.
pub fn encode_greeting(auth_required: bool, nonce: &[u8; NONCE_LEN]) -> [u8; GREETING_LEN] {
    crate::auth::encode_greeting(&SHM_MAGIC, auth_required, nonce)
}

/// Whether a greeting asks for authentication, and its nonce.
pub fn decode_greeting(g: &[u8; GREETING_LEN]) -> Result<(bool, [u8; NONCE_LEN]), WireError> {
    crate::auth::decode_greeting(&SHM_MAGIC, g).map_err(|e| match e {
        crate::auth::BadGreeting::Magic => WireError::Malformed("not a dmkv handoff socket (bad greeting)"),
        crate::auth::BadGreeting::Flags => WireError::Malformed("greeting has unknown flags"),
    })
}

/// A request presenting `proof`, `rkey` and `epoch`.
pub fn encode_request(proof: &[u8; PROOF_LEN], rkey: u64, epoch: u64) -> [u8; REQUEST_LEN] {
    let mut req = [0u8; REQUEST_LEN];
    req[..PROOF_LEN].copy_from_slice(proof);
    req[PROOF_LEN..PROOF_LEN + 8].copy_from_slice(&rkey.to_le_bytes());
    req[PROOF_LEN + 8..].copy_from_slice(&epoch.to_le_bytes());
    req
}

/// The proof, rkey and epoch a request presents.
pub fn decode_request(req: &[u8; REQUEST_LEN]) -> ([u8; PROOF_LEN], u64, u64) {
    let mut proof = [0u8; PROOF_LEN];
    proof.copy_from_slice(&req[..PROOF_LEN]);
    let rkey = u64::from_le_bytes(req[PROOF_LEN..PROOF_LEN + 8].try_into().expect("8 bytes"));
    let epoch = u64::from_le_bytes(req[PROOF_LEN + 8..].try_into().expect("8 bytes"));
    (proof, rkey, epoch)
}

/// Whether a presented rkey is the current one, in constant time: how
/// long a refusal takes says nothing about how close a guess came.
pub fn rkey_matches(presented: u64, current: u64) -> bool {
    bool::from(presented.to_le_bytes().ct_eq(&current.to_le_bytes()))
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

/// What a non-OK status means, for error messages.
pub fn status_text(status: u8) -> &'static str {
    match status {
        STATUS_OK => "ok",
        STATUS_REFUSED => "rkey or epoch not current",
        STATUS_UNAUTHENTICATED => "authentication failed (wrong or missing token, or a role that may not read)",
        STATUS_RATE_LIMITED => "too many failed attempts; try again later",
        _ => "unknown status",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let proof = [9u8; PROOF_LEN];
        assert_eq!(decode_request(&encode_request(&proof, 7, u64::MAX)), (proof, 7, u64::MAX));
        assert_eq!(decode_reply(&encode_reply(STATUS_REFUSED, 1 << 40)), (STATUS_REFUSED, 1 << 40));
        let nonce = [3u8; NONCE_LEN];
        assert_eq!(decode_greeting(&encode_greeting(true, &nonce)), Ok((true, nonce)));
        assert_eq!(decode_greeting(&encode_greeting(false, &nonce)), Ok((false, nonce)));
    }

    #[test]
    fn strangers_and_unknown_flags_are_rejected() {
        let nonce = [3u8; NONCE_LEN];
        let mut engine = encode_greeting(true, &nonce);
        engine[..8].copy_from_slice(b"DMKVENG2");
        assert!(decode_greeting(&engine).is_err());
        let mut flags = encode_greeting(false, &nonce);
        flags[8] = 2;
        assert!(decode_greeting(&flags).is_err());
    }

    #[test]
    fn rkeys_match_only_exactly() {
        assert!(rkey_matches(0xdead_beef, 0xdead_beef));
        assert!(!rkey_matches(0xdead_beef, 0xdead_beee));
        assert!(!rkey_matches(1 << 63, 0));
        for s in [STATUS_REFUSED, STATUS_UNAUTHENTICATED, STATUS_RATE_LIMITED, 200] {
            assert_ne!(status_text(s), "ok");
        }
    }
}
