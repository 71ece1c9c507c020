//! One end of a message link: a byte stream carried in fixed-size
//! messages (the verbs RPC's SEND/RECV slots), with the credits of
//! [`crate::credit`] deciding when a message may go.
//!
//! The RPC's requests and replies are the same frames as over TCP; a link
//! only moves their bytes. A sender cuts what it writes into messages of
//! at most a slot each (a frame larger than a slot simply spans several:
//! chunks, no rendezvous); a receiver hands arrived messages to its reader
//! in order and frees each slot once the reader has copied it out. So a
//! value of any size (up to the frame limit) crosses without the peer ever
//! reading or writing this side's memory, and the reader's pace is what
//! returns credits: a server that is behind stops granting new sends.
//!
//! The two ends differ in who is flow-controlled by credits:
//! - The server's end receives into a receive queue shared by all its
//!   connections ([`ServerCredits`]): each message arriving takes a
//!   credit, a credit is owed back once its slot is free again, and it
//!   goes back in the immediate data of the next message to the client
//!   (or in an empty message once idle, [`MsgLink::poll_return`]). A
//!   message past the credits is an overrun: the link fails, and nothing
//!   of it reaches the reader.
//! - The client's end sends only with a credit ([`ClientCredits`]) and
//!   receives into its own slots, where the NIC's receiver-not-ready retry
//!   paces the server as a TCP window would.
//!
//! Pure logic, generic over the slot type `S` and with time passed in: the
//! verbs drivers and the tests (`common/tests/msglink_sim.rs`, over a
//! simulated wire and over TCP) run the same code.

use std::collections::VecDeque;

use crate::credit::{ClientCredits, CreditError, ServerCredits};

/// Bytes one message carries at most, both ways: a GET's or PUT's frame of
/// a value up to a few KiB fits one; larger frames span several.
pub const SLOT_BYTES: u32 = 8192;

/// Most arrived messages one end holds unread: the slots it may hold
/// (a server end never more than its grant, a client end its slots).
pub const MAX_UNREAD: usize = 4096;

/// Why a link is no longer usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("peer broke the credit rules: {0}")]
    Credit(#[from] CreditError),
    #[error("a message of {len} bytes is larger than a {slot} byte slot")]
    TooLong { len: u32, slot: u32 },
    #[error("{0} messages unread: the peer sent past every slot")]
    Flooded(usize),
    #[error("an empty message without credits")]
    Empty,
}

/// Which end, with its credits.
#[derive(Debug)]
enum Credits {
    Server(ServerCredits),
    Client(ClientCredits),
}

/// One end of a link; see the module docs.
#[derive(Debug)]
pub struct MsgLink<S> {
    credits: Credits,
    slot_bytes: u32,
    /// Arrived messages not read to their end, oldest first.
    unread: VecDeque<(S, u32)>,
    /// How far the oldest unread message has been read.
    read_off: u32,
    /// Send slots free to fill.
    free_tx: Vec<S>,
}

/// A message to send now: copy `len` bytes into the slot, send with `imm`.
#[derive(Debug)]
pub struct Outgoing<S> {
    pub slot: S,
    pub imm: Option<u32>,
}

impl<S> MsgLink<S> {
    /// The server's end of a connection granted `credits` (what its
    /// [`crate::credit::SlotPool`] gave), sending from `tx` slots.
    pub fn server(credits: ServerCredits, slot_bytes: u32, tx: Vec<S>) -> MsgLink<S> {
        Self::new(Credits::Server(credits), slot_bytes, tx)
    }

    /// The client's end of a connection the server granted `credits`.
    pub fn client(credits: ClientCredits, slot_bytes: u32, tx: Vec<S>) -> MsgLink<S> {
        Self::new(Credits::Client(credits), slot_bytes, tx)
    }

    fn new(credits: Credits, slot_bytes: u32, free_tx: Vec<S>) -> MsgLink<S> {
        assert!(slot_bytes > 0, "a slot holds at least a byte");
        MsgLink { credits, slot_bytes, unread: VecDeque::new(), read_off: 0, free_tx }
    }

    /// Bytes one message carries at most.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// Messages arrived and not read to their end.
    pub fn unread(&self) -> usize {
        self.unread.len()
    }

    /// Whether a read would return bytes now.
    pub fn readable(&self) -> bool {
        !self.unread.is_empty()
    }

    /// The server end's credits (`None` on a client end).
    pub fn server_credits(&self) -> Option<&ServerCredits> {
        match &self.credits {
            Credits::Server(c) => Some(c),
            Credits::Client(_) => None,
        }
    }

    /// The client end's credits (`None` on a server end).
    pub fn client_credits(&self) -> Option<&ClientCredits> {
        match &self.credits {
            Credits::Client(c) => Some(c),
            Credits::Server(_) => None,
        }
    }

    /// A message of `len` bytes arrived in `slot`, with `imm`. On an error
    /// the link must be closed; the slot comes back with it (to be posted
    /// again), nothing of the message is kept.
    pub fn handle_arrival(&mut self, slot: S, len: u32, imm: Option<u32>) -> Result<Arrival<S>, (LinkError, S)> {
        if len > self.slot_bytes {
            return Err((LinkError::TooLong { len, slot: self.slot_bytes }, slot));
        }
        match &mut self.credits {
            Credits::Server(c) => {
                if len == 0 {
                    // A client returns no credits: an empty message is
                    // nothing a client sends. Refused before it takes a
                    // credit, which no read would ever free.
                    return Err((LinkError::Empty, slot));
                }
                if let Err(e) = c.handle_request() {
                    return Err((e.into(), slot));
                }
            }
            Credits::Client(c) => {
                if let Some(n) = imm
                    && let Err(e) = c.handle_returned(n)
                {
                    return Err((e.into(), slot));
                }
                if len == 0 {
                    // A credit return: nothing to read, the slot is free.
                    return if imm.is_some() { Ok(Arrival::Spent(slot)) } else { Err((LinkError::Empty, slot)) };
                }
            }
        }
        if self.unread.len() >= MAX_UNREAD {
            return Err((LinkError::Flooded(self.unread.len()), slot));
        }
        self.unread.push_back((slot, len));
        Ok(Arrival::Queued)
    }

    /// Reads arrived bytes into `dst` in order, copying with `copy(slot,
    /// offset, into)`; the slots read to their end are pushed to `freed`
    /// (to be posted again; on a server end their credits are owed from
    /// `now`). Returns the bytes read (0 when nothing has arrived).
    pub fn read(
        &mut self,
        dst: &mut [u8],
        now: u64,
        freed: &mut Vec<S>,
        mut copy: impl FnMut(&S, usize, &mut [u8]),
    ) -> usize {
        let mut n = 0;
        let mut done = 0u32;
        while n < dst.len() {
            let Some((slot, len)) = self.unread.front() else { break };
            let take = ((len - self.read_off) as usize).min(dst.len() - n);
            copy(slot, self.read_off as usize, &mut dst[n..n + take]);
            n += take;
            self.read_off += take as u32;
            if self.read_off == *len {
                let (slot, _) = self.unread.pop_front().expect("front exists");
                freed.push(slot);
                self.read_off = 0;
                done += 1;
            }
        }
        if let Credits::Server(c) = &mut self.credits {
            // Every slot read was taken by `handle_arrival`'s request.
            let freed = c.handle_freed(done, now);
            debug_assert!(freed.is_ok(), "read frees only slots that arrived");
        }
        n
    }

    /// A send slot for the next message of data, with the immediate data
    /// it carries (a server's owed credits); `None` while no slot is free
    /// or (client) no credit is held. Copy at most [`MsgLink::slot_bytes`]
    /// into the slot and send it; [`MsgLink::handle_sent`] when done.
    pub fn take_send(&mut self) -> Option<Outgoing<S>> {
        if self.free_tx.is_empty() {
            return None;
        }
        let imm = match &mut self.credits {
            Credits::Client(c) => {
                // The credit is spent with this message; it comes back
                // from the server.
                let _spent = c.try_take()?;
                None
            }
            Credits::Server(c) => Some(c.take_for_reply()),
        };
        let slot = self.free_tx.pop().expect("checked non-empty");
        Some(Outgoing { slot, imm })
    }

    /// A sent message's slot is free again.
    pub fn handle_sent(&mut self, slot: S) {
        self.free_tx.push(slot);
    }

    /// Send slots free now.
    pub fn free_send_slots(&self) -> usize {
        self.free_tx.len()
    }

    /// A server end's explicit credit return due at `now`: an empty
    /// message whose immediate data is the credits. `None` when nothing is
    /// due or no send slot is free (the next message carries them).
    pub fn poll_return(&mut self, now: u64) -> Option<Outgoing<S>> {
        let Credits::Server(c) = &mut self.credits else { return None };
        if self.free_tx.is_empty() {
            return None;
        }
        let n = c.poll_return(now)?;
        let slot = self.free_tx.pop().expect("checked non-empty");
        Some(Outgoing { slot, imm: Some(n) })
    }

    /// When [`MsgLink::poll_return`] may next have something to send.
    /// `None` while no send slot is free: a message is in flight, and the
    /// next one carries the credits (a timer now would fire uselessly).
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.free_tx.is_empty() {
            return None;
        }
        match &self.credits {
            Credits::Server(c) => c.poll_timeout(),
            Credits::Client(_) => None,
        }
    }

    /// Ends the link: the unread messages' slots (to be posted again) and,
    /// for a server end, its credits (for [`ServerCredits::close`]).
    pub fn close(self) -> (Vec<S>, Option<ServerCredits>) {
        let slots = self.unread.into_iter().map(|(s, _)| s).collect();
        match self.credits {
            Credits::Server(c) => (slots, Some(c)),
            Credits::Client(_) => (slots, None),
        }
    }
}

/// What became of an arrived message.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival<S> {
    /// Kept for the reader.
    Queued,
    /// An empty credit return: its slot is free again at once.
    Spent(S),
}
