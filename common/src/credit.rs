//! Flow-control credits of a pipelined RPC connection, as eRPC does it.
//!
//! A server grants each connection some receive slots out of one shared
//! pool (an RDMA shared receive queue; over TCP, the requests it keeps in
//! flight per connection), and refuses a connection whose grant would not
//! fit, so a receiver is never without a slot in normal operation. A client
//! sends a request only while it holds a credit. The server hands a credit
//! back once the request's slot is free again: on its next reply (RDMA:
//! in the immediate data), or, when the connection goes quiet with credits
//! owed, in an explicit return message.
//!
//! Pure logic with time passed in (nanoseconds on the caller's clock) and
//! no IO, so the verbs RPC and the TCP RPC drive the same code and one
//! seeded simulation (`common/tests/credit_sim.rs`) tests it without a NIC.
//! Everything a peer says is checked: a request that would hold more
//! slots than the connection's grant is an [`CreditError::Overrun`] (the
//! server closes that connection before serving it), a return of credits
//! that are not out is a [`CreditError::BadReturn`]; neither panics nor
//! changes any count. (A client that spends credits still on their way
//! back to it cannot be told from an honest one, and stays within its
//! grant.)

use crate::path::MICROS;

/// Most credits one connection is granted: bounds a client's share of the
/// pool and the slots one connection can hold.
pub const MAX_CREDITS_PER_CONN: u32 = 256;
/// Credits a client asks for unless configured otherwise.
pub const DEFAULT_CREDITS: u32 = 32;
/// How long freed slots wait for a reply to carry their credits before the
/// server sends them in an explicit return: far below a request timeout,
/// above a batch of re-posted slots.
pub const IDLE_RETURN_NS: u64 = 200 * MICROS;

/// What a peer did wrong, or why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CreditError {
    /// The pool's room is taken by other connections' grants.
    #[error("no receive slots left for another connection ({granted} of {capacity} granted, {want} asked)")]
    PoolFull { granted: u32, capacity: u32, want: u32 },
    /// A pool whose slack leaves no room, or a grant of nothing.
    #[error("bad credit configuration: {0}")]
    Config(&'static str),
    /// A request arrived while the client held no credit for it.
    #[error("request past the connection's {granted} credits")]
    Overrun { granted: u32 },
    /// The server returned more credits than the client had out.
    #[error("{returned} credits returned with only {out} out")]
    BadReturn { returned: u32, out: u32 },
    /// The caller freed more slots than the connection holds (a slot of a
    /// request refused as an overrun is no slot the connection holds: it
    /// is handed to [`ServerCredits::close`]).
    #[error("{freed} slots freed with only {held} held")]
    NotHeld { freed: u32, held: u32 },
}

/// The server's receive slots shared by its connections, and how many of
/// them are promised. `slack` slots are never granted: they absorb what a
/// misbehaving client sends past its credits before its connection is
/// closed.
#[derive(Debug)]
pub struct SlotPool {
    depth: u32,
    slack: u32,
    granted: u32,
}

/// Credits granted to one connection out of a [`SlotPool`]. Not `Clone`:
/// the one grant goes back with [`SlotPool::release`] when the connection
/// ends, or the pool's room shrinks for good.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a grant not released keeps its slots from every later connection"]
pub struct Grant {
    credits: u32,
}

impl Grant {
    /// The credits this grant holds.
    pub fn credits(&self) -> u32 {
        self.credits
    }
}

impl SlotPool {
    /// A pool of `depth` receive slots of which `slack` are kept back.
    pub fn new(depth: u32, slack: u32) -> Result<SlotPool, CreditError> {
        if slack >= depth {
            return Err(CreditError::Config("the slack must leave some of the receive queue to grant"));
        }
        Ok(SlotPool { depth, slack, granted: 0 })
    }

    /// Slots that may be granted.
    pub fn capacity(&self) -> u32 {
        self.depth - self.slack
    }

    /// Slots granted now.
    pub fn granted(&self) -> u32 {
        self.granted
    }

    /// Grants a new connection `want` credits (at most
    /// [`MAX_CREDITS_PER_CONN`]), or refuses it when they do not fit.
    pub fn grant(&mut self, want: u32) -> Result<Grant, CreditError> {
        if want == 0 {
            return Err(CreditError::Config("a connection needs at least one credit"));
        }
        let want = want.min(MAX_CREDITS_PER_CONN);
        if want > self.capacity() - self.granted {
            return Err(CreditError::PoolFull { granted: self.granted, capacity: self.capacity(), want });
        }
        self.granted += want;
        assert!(self.granted <= self.capacity(), "grants exceed the pool");
        Ok(Grant { credits: want })
    }

    /// Takes back the grant of a connection that ended and whose slots
    /// are all posted again ([`Draining::finish`]).
    pub fn release(&mut self, grant: Grant) {
        assert!(grant.credits <= self.granted, "a grant released twice or from another pool");
        self.granted -= grant.credits;
    }
}

/// The server's side of one connection's credits.
#[derive(Debug)]
pub struct ServerCredits {
    grant: Grant,
    /// Requests received whose slot is not free yet.
    in_slots: u32,
    /// Freed slots whose credit the client has not been sent back.
    owed: u32,
    /// When the oldest owed credit was freed.
    owed_since: Option<u64>,
}

impl ServerCredits {
    /// Credits of a connection granted `grant`.
    pub fn new(grant: Grant) -> ServerCredits {
        ServerCredits { grant, in_slots: 0, owed: 0, owed_since: None }
    }

    /// The connection's grant, in credits.
    pub fn granted(&self) -> u32 {
        self.grant.credits
    }

    /// Requests holding a slot now.
    pub fn in_slots(&self) -> u32 {
        self.in_slots
    }

    /// Freed slots whose credits have not been sent back.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// A request arrived. [`CreditError::Overrun`] when the client had no
    /// credit for it: it must not be served, and the connection should be
    /// closed (its later requests are past their credits too).
    pub fn handle_request(&mut self) -> Result<(), CreditError> {
        if self.in_slots + self.owed >= self.grant.credits {
            return Err(CreditError::Overrun { granted: self.grant.credits });
        }
        self.in_slots += 1;
        Ok(())
    }

    /// `n` requests' slots are free again (re-posted; over TCP, the
    /// request is answered) at `now`: their credits are owed to the client.
    /// Freeing more than are held is refused and changes nothing.
    pub fn handle_freed(&mut self, n: u32, now: u64) -> Result<(), CreditError> {
        if n > self.in_slots {
            return Err(CreditError::NotHeld { freed: n, held: self.in_slots });
        }
        self.in_slots -= n;
        self.owed += n;
        if n > 0 {
            self.owed_since.get_or_insert(now);
        }
        self.check();
        Ok(())
    }

    /// The credits a reply sent now carries back (all that are owed).
    pub fn take_for_reply(&mut self) -> u32 {
        self.owed_since = None;
        std::mem::take(&mut self.owed)
    }

    /// Credits to send back in an explicit message now: those owed for
    /// [`IDLE_RETURN_NS`] with no reply to carry them, or as soon as half
    /// the grant is owed (the client is running dry).
    pub fn poll_return(&mut self, now: u64) -> Option<u32> {
        let since = self.owed_since?;
        let due = now.saturating_sub(since) >= IDLE_RETURN_NS || self.owed * 2 >= self.grant.credits;
        due.then(|| self.take_for_reply())
    }

    /// When [`ServerCredits::poll_return`] has something to send, if
    /// nothing else happens first.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.owed_since.map(|t| t.saturating_add(IDLE_RETURN_NS))
    }

    /// The connection ended. Its grant goes back to the pool only once the
    /// slots its requests hold are posted again (RDMA: after the queue
    /// pair is flushed): granted earlier to a new connection, those credits
    /// would be spent on slots that are not there yet. `unadmitted`: slots
    /// taken by its messages that were refused as overruns.
    pub fn close(self, unadmitted: u32) -> Draining {
        Draining { held: self.in_slots.saturating_add(unadmitted), grant: self.grant }
    }

    fn check(&self) {
        assert!(self.in_slots + self.owed <= self.grant.credits, "more slots held and owed than granted");
        assert_eq!(self.owed_since.is_some(), self.owed > 0, "owed credits and their age disagree");
    }
}

/// A closed connection whose slots are not all posted again yet.
#[derive(Debug)]
#[must_use = "a draining grant not finished keeps its slots from every later connection"]
pub struct Draining {
    grant: Grant,
    held: u32,
}

impl Draining {
    /// Slots still to be posted again.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// `n` of its slots are posted again; freeing more than are held is
    /// refused and changes nothing.
    pub fn handle_freed(&mut self, n: u32) -> Result<(), CreditError> {
        if n > self.held {
            return Err(CreditError::NotHeld { freed: n, held: self.held });
        }
        self.held -= n;
        Ok(())
    }

    /// The grant, for [`SlotPool::release`], once every slot is posted
    /// again; otherwise the connection is still draining.
    pub fn finish(self) -> Result<Grant, Draining> {
        if self.held == 0 { Ok(self.grant) } else { Err(self) }
    }
}

/// The client's side of one connection's credits.
#[derive(Debug, Clone)]
pub struct ClientCredits {
    granted: u32,
    available: u32,
}

/// One credit taken to send one request. Not `Clone`: each request spends
/// its own.
#[derive(Debug)]
#[must_use = "a credit taken and not spent is lost until the connection ends"]
pub struct Credit(());

impl ClientCredits {
    /// A connection granted `granted` credits (from the server's answer to
    /// its connect; never more than [`MAX_CREDITS_PER_CONN`]).
    pub fn new(granted: u32) -> Result<ClientCredits, CreditError> {
        if granted == 0 || granted > MAX_CREDITS_PER_CONN {
            return Err(CreditError::Config("a grant must be 1 to MAX_CREDITS_PER_CONN credits"));
        }
        Ok(ClientCredits { granted, available: granted })
    }

    /// Credits held now.
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Credits spent on requests and not returned yet.
    pub fn out(&self) -> u32 {
        self.granted - self.available
    }

    /// A credit for the next request, if one is held; otherwise the
    /// request waits for a return.
    pub fn try_take(&mut self) -> Option<Credit> {
        let left = self.available.checked_sub(1)?;
        self.available = left;
        Some(Credit(()))
    }

    /// A credit taken for a request that was not sent after all.
    pub fn give_back(&mut self, credit: Credit) {
        let Credit(()) = credit;
        debug_assert!(self.available < self.granted, "a credit given back that was not out");
        self.available = (self.available + 1).min(self.granted);
    }

    /// The server returned `n` credits (on a reply or in a return message).
    pub fn handle_returned(&mut self, n: u32) -> Result<(), CreditError> {
        if n > self.out() {
            return Err(CreditError::BadReturn { returned: n, out: self.out() });
        }
        self.available += n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_refuses_a_grant_that_does_not_fit_and_takes_releases_back() {
        let mut pool = SlotPool::new(100, 10).unwrap();
        let a = pool.grant(60).unwrap();
        assert_eq!(pool.grant(31), Err(CreditError::PoolFull { granted: 60, capacity: 90, want: 31 }));
        let b = pool.grant(30).unwrap();
        assert_eq!(pool.granted(), 90);
        pool.release(a);
        // An ask above the per-connection bound is cut to it first.
        let refused = pool.grant(1000).unwrap_err();
        assert_eq!(refused, CreditError::PoolFull { granted: 30, capacity: 90, want: MAX_CREDITS_PER_CONN });
        let c = pool.grant(60).unwrap();
        assert_eq!(c.credits(), 60);
        pool.release(c);
        pool.release(b);
        assert_eq!(pool.granted(), 0);
        assert!(SlotPool::new(8, 8).is_err());
        assert!(pool.grant(0).is_err());
    }

    #[test]
    fn a_request_past_the_credits_is_an_overrun_and_changes_nothing() {
        let mut s = ServerCredits::new(SlotPool::new(8, 0).unwrap().grant(2).unwrap());
        s.handle_request().unwrap();
        s.handle_request().unwrap();
        assert_eq!(s.handle_request(), Err(CreditError::Overrun { granted: 2 }));
        assert_eq!(s.in_slots(), 2);
        // A freed slot whose credit is not back yet still is the client's
        // to wait for: another request is an overrun too.
        s.handle_freed(1, 0).unwrap();
        assert_eq!(s.handle_request(), Err(CreditError::Overrun { granted: 2 }));
        assert_eq!((s.in_slots(), s.owed()), (1, 1), "an overrun changed the counts");
        assert_eq!(s.take_for_reply(), 1);
        s.handle_request().unwrap();
    }

    #[test]
    fn owed_credits_go_back_on_a_reply_or_once_idle_or_half_the_grant() {
        let mut s = ServerCredits::new(SlotPool::new(64, 0).unwrap().grant(8).unwrap());
        for _ in 0..3 {
            s.handle_request().unwrap();
        }
        s.handle_freed(1, 1_000).unwrap();
        assert_eq!(s.handle_freed(3, 1_000), Err(CreditError::NotHeld { freed: 3, held: 2 }));
        assert_eq!(s.poll_return(1_000), None);
        assert_eq!(s.poll_timeout(), Some(1_000 + IDLE_RETURN_NS));
        assert_eq!(s.poll_return(1_000 + IDLE_RETURN_NS), Some(1));
        assert_eq!(s.poll_timeout(), None);
        s.handle_freed(2, 5_000).unwrap();
        assert_eq!(s.take_for_reply(), 2);
        assert_eq!(s.poll_return(u64::MAX), None);
        for _ in 0..4 {
            s.handle_request().unwrap();
        }
        s.handle_freed(4, 9_000).unwrap();
        assert_eq!(s.poll_return(9_000), Some(4), "half the grant owed waits for no timer");
    }

    #[test]
    fn a_client_spends_only_credits_it_holds_and_refuses_a_bad_return() {
        let mut c = ClientCredits::new(2).unwrap();
        let _a = c.try_take().unwrap();
        let b = c.try_take().unwrap();
        assert!(c.try_take().is_none());
        c.give_back(b);
        let _b = c.try_take().unwrap();
        assert_eq!(c.handle_returned(3), Err(CreditError::BadReturn { returned: 3, out: 2 }));
        assert_eq!(c.available(), 0);
        c.handle_returned(2).unwrap();
        assert_eq!(c.available(), 2);
        assert!(ClientCredits::new(0).is_err());
        assert!(ClientCredits::new(MAX_CREDITS_PER_CONN + 1).is_err());
    }

    /// A closed connection's grant comes back only with its last slot, the
    /// ones refused as overruns included.
    #[test]
    fn a_closed_connections_grant_waits_for_its_slots() {
        let mut pool = SlotPool::new(8, 1).unwrap();
        let mut s = ServerCredits::new(pool.grant(7).unwrap());
        s.handle_request().unwrap();
        s.handle_request().unwrap();
        let mut d = s.close(1);
        assert_eq!(d.held(), 3);
        assert!(pool.grant(1).is_err(), "the draining grant was given away");
        d.handle_freed(2).unwrap();
        assert_eq!(d.handle_freed(2), Err(CreditError::NotHeld { freed: 2, held: 1 }));
        let d = d.finish().unwrap_err();
        let mut d = d;
        d.handle_freed(1).unwrap();
        pool.release(d.finish().unwrap());
        assert_eq!(pool.granted(), 0);
    }
}
