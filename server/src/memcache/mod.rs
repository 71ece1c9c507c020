//! memcached's text and meta protocols on a port of their own
//! (`--memcached-listen`), so unmodified memcached clients and tools work
//! against dmkv (docs/memcached.md).
//!
//! [`text`] parses requests (and [`meta`] the meta commands' flags), pure
//! code, from [`token`]s; [`reply`] encodes the answers; [`exec`] and
//! [`meta::execute`] run them against the store through
//! [`crate::kv::Kv`]; [`counters`] counts and [`stats`] reports. What the
//! connections share is a [`Service`]. A connection is driven by the same
//! loop as the native port ([`crate::framed`]): every request a read
//! brought is answered in order, and the replies go out in one write.
//!
//! What a connection holds is bounded: the input by the longest line plus
//! the largest value ([`text::MAX_LINE_LEN`], `MAX_VALUE_LEN`; a refused
//! data block is skipped as it arrives, never buffered), replies by
//! `framed::MAX_PENDING_REPLY_BYTES` (a get of many large values is
//! written out part by part), time by the server's idle and frame timeouts.

pub mod backend;
pub mod counters;
pub mod exec;
pub mod meta;
pub mod reply;
pub mod service;
pub mod stats;
pub mod text;
pub mod token;

#[cfg(test)]
mod tests;

use std::net::IpAddr;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use dmkv_common::auth::{Purpose, Role, Token};
use dmkv_common::limits::MAX_VALUE_LEN;
use tokio::net::TcpStream;
use tokio::sync::watch;

pub use crate::config::MAX_MEMCACHED_CONNECTIONS;
pub use exec::Close;
pub use service::{Service, VERSION};

use crate::service::Shared;
use exec::Step;
use text::{Parsed, Request, err, line};

/// Largest `user password` block of the authenticating `set`
/// (memcached's bound).
pub const MAX_AUTH_LEN: usize = 16 * 1024;
/// One connection's state.
struct Conn {
    svc: Arc<Service>,
    peer: Option<IpAddr>,
    authenticated: bool,
    /// Bytes of a refused data block still to skip.
    swallow: usize,
    /// The key a partly answered get at the front of the input goes on at.
    resume: usize,
}

impl crate::framed::Handler for Conn {
    type Error = Close;

    async fn handle_next(&mut self, inbuf: &mut BytesMut, out: &mut BytesMut) -> Result<bool, Close> {
        if self.swallow > 0 {
            let n = self.swallow.min(inbuf.len());
            inbuf.advance(n);
            self.swallow -= n;
            return Ok(n > 0);
        }
        let max_value = if self.authenticated { MAX_VALUE_LEN } else { MAX_AUTH_LEN };
        let (len, step) = match text::parse(inbuf, max_value) {
            Parsed::Incomplete => return Ok(false),
            Parsed::Request { len, req } if !self.authenticated => (len, self.authenticate(&req, out)),
            Parsed::Request { len, req } => (len, exec::execute(&req, &self.svc, out, self.resume).await),
        };
        match step {
            Step::Partial(next) => {
                self.resume = next;
                return Ok(true);
            }
            Step::Done => {}
            Step::Swallow(n) => self.swallow = n,
            Step::Close(why) => {
                inbuf.advance(len);
                return Err(why);
            }
        }
        self.resume = 0;
        inbuf.advance(len);
        Ok(true)
    }

    fn logged(e: &Close) -> bool {
        // Quitting is normal; failed authentications are logged by the
        // gate; what memcached hangs up on (HTTP, long lines) anyone can
        // send, so a warning each time would let them flood the log.
        matches!(e, Close::Quit | Close::Unauthenticated | Close::Protocol(_))
    }
}

impl Conn {
    /// memcached's `-Y` authentication: before anything else, a `set` of
    /// any key whose data is `user password`. dmkv's users are its roles
    /// (`data`, `admin`), the passwords their secrets.
    fn authenticate(&mut self, req: &Request, out: &mut BytesMut) -> Step {
        let store = match req {
            Request::Quit => return Step::Close(Close::Quit),
            Request::Store(s) if s.mode == crate::kv::Mode::Set && s.cas.is_none() => s,
            _ => {
                line(out, err::UNAUTHENTICATED);
                return Step::Close(Close::Unauthenticated);
            }
        };
        let c = &self.svc.counters;
        c.auth_cmds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if check_password(&self.svc.shared, self.peer, store.value) {
            self.authenticated = true;
            line(out, "STORED");
            Step::Done
        } else {
            c.auth_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            line(out, err::AUTH_FAILED);
            Step::Close(Close::Unauthenticated)
        }
    }
}

/// Whether `creds` (`user password`) names a role and one of its secrets.
/// The secret is checked as the other listeners check theirs: through a
/// proof for a fresh nonce, compared in constant time against every
/// secret, with the gate's per-address failure limit.
fn check_password(shared: &Shared, peer: Option<IpAddr>, creds: &[u8]) -> bool {
    let gate = &shared.gate;
    let ip = peer.unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let text = std::str::from_utf8(creds).unwrap_or("");
    let (user, password) = text.split_once(' ').unwrap_or((text, ""));
    let Ok(token) = Token::new(password) else {
        if gate.allowed(ip) {
            gate.failed(Purpose::Rpc, ip, "memcached authentication failed");
        }
        return false;
    };
    let nonce = gate.nonce();
    let proof = token.prove(Purpose::Rpc, &nonce);
    match gate.check(Purpose::Rpc, peer, &nonce, &proof, Role::Data) {
        Ok(role) if role.name() == user => true,
        Ok(_) => {
            gate.failed(Purpose::Rpc, ip, "memcached authentication failed: the secret is not the named user's");
            false
        }
        Err(_) => false,
    }
}

/// Serves one memcached connection until the client quits or closes, sends
/// what memcached closes on, overstays the limits, or the server stops.
pub async fn serve_connection(stream: TcpStream, svc: Arc<Service>, shutdown: watch::Receiver<bool>) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let shared = Arc::clone(&svc.shared);
    let conn = Conn { authenticated: !shared.gate.enabled(), peer: peer.map(|p| p.ip()), svc, swallow: 0, resume: 0 };
    let stats = Arc::clone(&shared.metrics.memcached);
    crate::framed::serve_connection(stream, peer, stats, conn, shared.limits, shutdown).await
}
