//! Who may do what: the server's side of authentication, shared by every
//! listener. [`Gate`] hands out nonces, checks proofs against the
//! configured secrets (`dmkv_common::auth`), rate-limits failures per peer
//! address and logs them.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_common::auth::{Failure, FailureLimiter, Keys, NONCE_LEN, Purpose, Role};
use tracing::{debug, warn};

use crate::lock::lock;

/// How long a new connection has to finish its handshake (TLS or the
/// engine's greeting) before it is closed; never longer than the idle
/// timeout, since a stalled handshake is an idle connection.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The handshake deadline under `limits`.
pub fn handshake_timeout(limits: &crate::framed::Limits) -> Duration {
    HANDSHAKE_TIMEOUT.min(limits.idle_timeout)
}

/// Why a proof was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The proof matches no secret (or none whose role suffices).
    BadProof,
    /// Too many recent failures from this address; not checked at all.
    RateLimited,
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Denied::BadProof => "authentication failed: the proof matches no secret allowed here",
            Denied::RateLimited => "authentication refused: too many failures from this address; wait and retry",
        })
    }
}

/// The secrets and the failure limiter of one server.
pub struct Gate {
    keys: Arc<Keys>,
    /// Recovers from poisoning (`crate::lock`): every update leaves the
    /// map consistent, and at worst a failure goes uncounted.
    failures: Mutex<FailureLimiter>,
}

impl Gate {
    /// A gate for `keys`; empty keys mean authentication is off.
    pub fn new(keys: Arc<Keys>) -> Gate {
        Gate { keys, failures: Mutex::default() }
    }

    /// Whether clients must authenticate.
    pub fn enabled(&self) -> bool {
        self.keys.enabled()
    }

    /// The role a connection has before it authenticates: everything when
    /// authentication is off, nothing otherwise.
    pub fn initial_role(&self) -> Option<Role> {
        (!self.enabled()).then_some(Role::Admin)
    }

    /// A fresh challenge.
    pub fn nonce(&self) -> [u8; NONCE_LEN] {
        rand::random()
    }

    /// Whether `peer` may try now (not blocked after too many failures).
    pub fn allowed(&self, peer: IpAddr) -> bool {
        lock(&self.failures).allowed(peer, Instant::now())
    }

    /// Counts and logs a failed attempt by `peer`: a wrong proof, or (on
    /// the handoff socket) a guessed rkey.
    pub fn failed(&self, purpose: Purpose, peer: IpAddr, what: &str) {
        match lock(&self.failures).failed(peer, Instant::now()) {
            Failure::Log => warn!(peer = %peer, code = "unauthenticated", ?purpose, "{what}"),
            Failure::Blocked => warn!(
                peer = %peer,
                code = "unauthenticated",
                ?purpose,
                "{what}: {} failures; refusing this address for {:?}",
                dmkv_common::auth::MAX_FAILURES,
                dmkv_common::auth::FAILURE_WINDOW
            ),
            Failure::Quiet => debug!(peer = %peer, code = "unauthenticated", ?purpose, "{what} (address blocked)"),
        }
    }

    /// Checks a cluster node's `proof` for `nonce` from `peer` on the peer
    /// port: the node whose secret made it. Role secrets make no node.
    /// Failures are counted and logged, against the same address limit.
    pub fn check_node(&self, peer: Option<IpAddr>, nonce: &[u8; NONCE_LEN], proof: &[u8]) -> Result<u64, Denied> {
        let ip = peer.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        if !self.allowed(ip) {
            debug!(%ip, purpose = ?Purpose::Peer, "authentication attempt refused: rate-limited");
            return Err(Denied::RateLimited);
        }
        match self.keys.verify_node(Purpose::Peer, nonce, proof) {
            Some(node) => Ok(node),
            None => {
                self.failed(Purpose::Peer, ip, "peer authentication failed: the proof matches no node's secret");
                Err(Denied::BadProof)
            }
        }
    }

    /// Checks `proof` for `nonce` from `peer` on a `purpose` listener; the
    /// granted role must allow `needed`. Failures are counted and logged.
    pub fn check(
        &self,
        purpose: Purpose,
        peer: Option<IpAddr>,
        nonce: &[u8; NONCE_LEN],
        proof: &[u8],
        needed: Role,
    ) -> Result<Role, Denied> {
        let ip = peer.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        if !self.allowed(ip) {
            debug!(%ip, ?purpose, "authentication attempt refused: rate-limited");
            return Err(Denied::RateLimited);
        }
        match self.keys.verify(purpose, nonce, proof) {
            Some(role) if role.allows(needed) => Ok(role),
            _ => {
                self.failed(purpose, ip, "authentication failed");
                Err(Denied::BadProof)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_common::auth::{MAX_FAILURES, Token};

    #[test]
    fn roles_and_rate_limits() {
        let data = Token::new("data-0123456789abcdef").unwrap();
        let admin = Token::new("admin-0123456789abcdef").unwrap();
        let gate = Gate::new(Arc::new(Keys::new(vec![data.clone()], vec![admin.clone()]).unwrap()));
        assert!(gate.enabled() && gate.initial_role().is_none());
        let n = gate.nonce();
        assert_ne!(n, gate.nonce());
        let peer = Some(IpAddr::from([10, 1, 2, 3]));
        let d = data.prove(Purpose::Rpc, &n);
        assert_eq!(gate.check(Purpose::Rpc, peer, &n, &d, Role::Data), Ok(Role::Data));
        assert_eq!(gate.check(Purpose::Rpc, peer, &n, &d, Role::Admin), Err(Denied::BadProof));
        let a = admin.prove(Purpose::Rpc, &n);
        assert_eq!(gate.check(Purpose::Rpc, peer, &n, &a, Role::Admin), Ok(Role::Admin));
        for _ in 1..MAX_FAILURES {
            assert_eq!(gate.check(Purpose::Rpc, peer, &n, &[0; 32], Role::Data), Err(Denied::BadProof));
        }
        // Blocked now: even the right proof is not checked.
        assert_eq!(gate.check(Purpose::Rpc, peer, &n, &d, Role::Data), Err(Denied::RateLimited));
        let other = Some(IpAddr::from([10, 1, 2, 4]));
        assert_eq!(gate.check(Purpose::Rpc, other, &n, &d, Role::Data), Ok(Role::Data));

        let open = Gate::new(Arc::default());
        assert_eq!(open.initial_role(), Some(Role::Admin));
    }

    #[test]
    fn nodes_prove_their_own_secret_on_the_peer_port() {
        let admin = Token::new("admin-0123456789abcdef").unwrap();
        let node2 = Token::new("node-2-0123456789abcdef").unwrap();
        let keys = Keys::new(vec![], vec![admin.clone()])
            .unwrap()
            .with_nodes(std::collections::BTreeMap::from([(2, vec![node2.clone()])]))
            .unwrap();
        let gate = Gate::new(Arc::new(keys));
        let n = gate.nonce();
        let peer = Some(IpAddr::from([10, 9, 9, 9]));
        assert_eq!(gate.check_node(peer, &n, &node2.prove(Purpose::Peer, &n)), Ok(2));
        // The admin secret makes no node; a node secret makes no role.
        assert_eq!(gate.check_node(peer, &n, &admin.prove(Purpose::Peer, &n)), Err(Denied::BadProof));
        assert_eq!(gate.check_node(peer, &n, &node2.prove(Purpose::Rpc, &n)), Err(Denied::BadProof));
        let rpc = node2.prove(Purpose::Rpc, &n);
        assert_eq!(gate.check(Purpose::Rpc, peer, &n, &rpc, Role::Data), Err(Denied::BadProof));
    }
}
