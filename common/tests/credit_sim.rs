//! A deterministic simulation of `dmkv_common::credit` on a virtual clock:
//! one server with a shared receive queue, clients that connect, send,
//! die and reconnect, replies and explicit returns carrying credits back,
//! slots re-posted in batches, and rogue clients that send past their
//! credits. Every run is a function of its seed; a failing assertion
//! prints the seed, and `CREDIT_SIM_SEED=<n>` reruns with that seed alone.
//!
//! What it checks, after every step: no message ever finds the receive
//! queue empty (receiver-not-ready), a request sent with a credit is never
//! refused, a request past its credits is refused before it is served,
//! grants never exceed the pool, and slots and credits are conserved; at
//! the end, once traffic stops, every credit is back with its client and
//! every slot is posted again.

use std::collections::VecDeque;

use dmkv_common::credit::{ClientCredits, CreditError, Draining, IDLE_RETURN_NS, ServerCredits, SlotPool};
use dmkv_common::path::MICROS;

/// splitmix64, as in path_sim.rs.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

fn seeds() -> Vec<u64> {
    match std::env::var("CREDIT_SIM_SEED") {
        Ok(s) => vec![s.trim().parse().expect("CREDIT_SIM_SEED must be an integer")],
        Err(_) => (1..=40).collect(),
    }
}

/// A request on the wire: whether its client held a credit for it.
struct Request {
    legit: bool,
}

struct Conn {
    client: ClientCredits,
    server: ServerCredits,
    granted: u32,
    rogue: bool,
    /// A rogue that has sent past its credits.
    cheated: bool,
    /// Requests in flight to the server (a reliable connection keeps order).
    to_server: VecDeque<Request>,
    /// Replies and return messages in flight to the client, by credits.
    to_client: VecDeque<u32>,
    /// Requests being served (each holds a slot).
    serving: u32,
}

struct Sim {
    rng: Rng,
    now: u64,
    depth: u32,
    pool: SlotPool,
    /// Slots posted and free for the next message.
    posted: u32,
    /// Freed slots waiting to be re-posted in one batch, by connection
    /// (`None`: its connection has ended).
    batch: Vec<Option<usize>>,
    batch_since: Option<u64>,
    conns: Vec<Option<Conn>>,
    /// Closed connections whose slots are not all posted again, by index.
    draining: Vec<Option<Draining>>,
    /// Grants of the draining connections, for the pool's check.
    draining_granted: Vec<u32>,
    /// Fewest slots posted at any delivery.
    min_posted: u32,
    /// A phase that fills the queue: clients spend their whole grants,
    /// slots are re-posted late, connections close often.
    pressure: bool,
    refusals: u64,
    overruns: u64,
    served: u64,
}

const DEPTH: u32 = 512;
/// Most rogue connections alive at once; each may hold one slot past its
/// grant (the message found to be an overrun), so the slack covers them.
const MAX_ROGUES: usize = 4;
const SLACK: u32 = MAX_ROGUES as u32;
const MAX_CONNS: usize = 40;
const REPOST_BATCH: usize = 16;
const REPOST_WAIT_NS: u64 = 50 * MICROS;

impl Sim {
    fn new(seed: u64) -> Sim {
        Sim {
            rng: Rng(seed),
            now: 0,
            depth: DEPTH,
            pool: SlotPool::new(DEPTH, SLACK).unwrap(),
            posted: DEPTH,
            batch: Vec::new(),
            batch_since: None,
            conns: Vec::new(),
            draining: Vec::new(),
            draining_granted: Vec::new(),
            min_posted: DEPTH,
            pressure: false,
            refusals: 0,
            overruns: 0,
            served: 0,
        }
    }

    fn live(&self) -> impl Iterator<Item = (usize, &Conn)> {
        self.conns.iter().enumerate().filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
    }

    fn connect(&mut self) {
        if self.live().count() >= MAX_CONNS {
            return;
        }
        let rogue = self.live().filter(|(_, c)| c.rogue).count() < MAX_ROGUES && self.rng.chance(150);
        let want = 1 + self.rng.below(64) as u32;
        let before = self.pool.granted();
        match self.pool.grant(want) {
            Ok(grant) => {
                let granted = grant.credits();
                let client = ClientCredits::new(granted).unwrap();
                self.draining.push(None);
                self.draining_granted.push(0);
                self.conns.push(Some(Conn {
                    client,
                    server: ServerCredits::new(grant),
                    granted,
                    rogue,
                    cheated: false,
                    to_server: VecDeque::new(),
                    to_client: VecDeque::new(),
                    serving: 0,
                }));
            }
            Err(CreditError::PoolFull { .. }) => {
                assert!(before + want > self.pool.capacity(), "refused a grant that fit");
                self.refusals += 1;
            }
            Err(e) => panic!("unexpected refusal {e}"),
        }
    }

    /// Ends connection `i`: the slots its requests hold (and `unadmitted`
    /// ones of overruns) are freed with the next re-post, and its grant
    /// goes back once they are; what was in flight is flushed and never
    /// reaches a slot.
    fn close(&mut self, i: usize, unadmitted: u32) {
        let c = self.conns[i].take().expect("closing a live connection");
        for _ in 0..c.serving + unadmitted {
            self.push_freed(Some(i));
        }
        self.draining_granted[i] = c.granted;
        match c.server.close(unadmitted).finish() {
            Ok(grant) => {
                self.pool.release(grant);
                self.draining_granted[i] = 0;
            }
            Err(d) => self.draining[i] = Some(d),
        }
    }

    fn push_freed(&mut self, conn: Option<usize>) {
        self.batch.push(conn);
        self.batch_since.get_or_insert(self.now);
    }

    fn send(&mut self, i: usize) {
        let over = self.rng.chance(300);
        let c = self.conns[i].as_mut().unwrap();
        if let Some(credit) = c.client.try_take() {
            drop(credit);
            c.to_server.push_back(Request { legit: true });
        } else if c.rogue && over {
            c.cheated = true;
            c.to_server.push_back(Request { legit: false });
        }
    }

    fn deliver_request(&mut self, i: usize) {
        let c = self.conns[i].as_mut().unwrap();
        let Some(req) = c.to_server.pop_front() else { return };
        assert!(self.posted > 0, "receiver not ready: a message found no posted slot");
        self.posted -= 1;
        self.min_posted = self.min_posted.min(self.posted);
        match c.server.handle_request() {
            Ok(()) => c.serving += 1,
            Err(CreditError::Overrun { .. }) => {
                // A rogue that sent past its credits may be caught on a
                // later request of its own: it spent credits still on their
                // way back to it. An honest client is never refused.
                assert!(c.rogue && (!req.legit || c.cheated), "a request sent with a credit was refused");
                self.overruns += 1;
                // The message's own slot is freed with the connection's.
                self.close(i, 1);
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }

    fn finish_one(&mut self, i: usize) {
        let c = self.conns[i].as_mut().unwrap();
        if c.serving == 0 {
            return;
        }
        c.serving -= 1;
        self.served += 1;
        // The reply goes out now and carries what is owed so far; this
        // request's own slot is freed with the next re-post.
        let n = c.server.take_for_reply();
        c.to_client.push_back(n);
        self.push_freed(Some(i));
    }

    fn repost(&mut self, force: bool) {
        let Some(since) = self.batch_since else { return };
        let (size, wait) =
            if self.pressure { (DEPTH as usize, 100 * REPOST_WAIT_NS) } else { (REPOST_BATCH, REPOST_WAIT_NS) };
        if !force && self.batch.len() < size && self.now - since < wait {
            return;
        }
        let now = self.now;
        self.posted += self.batch.len() as u32;
        let mut freed = vec![0u32; self.conns.len()];
        for i in self.batch.drain(..).flatten() {
            freed[i] += 1;
        }
        self.batch_since = None;
        for (i, n) in freed.into_iter().enumerate() {
            if let Some(c) = self.conns[i].as_mut() {
                c.server.handle_freed(n, now).unwrap();
            } else if let Some(mut d) = self.draining[i].take() {
                d.handle_freed(n).unwrap();
                match d.finish() {
                    Ok(grant) => {
                        self.pool.release(grant);
                        self.draining_granted[i] = 0;
                    }
                    Err(d) => self.draining[i] = Some(d),
                }
            } else {
                assert_eq!(n, 0, "conn {i}: slots freed for a connection neither live nor draining");
            }
        }
    }

    fn idle_returns(&mut self) {
        let now = self.now;
        for c in self.conns.iter_mut().flatten() {
            if let Some(n) = c.server.poll_return(now) {
                c.to_client.push_back(n);
            }
        }
    }

    fn deliver_return(&mut self, i: usize) {
        let c = self.conns[i].as_mut().unwrap();
        let Some(n) = c.to_client.pop_front() else { return };
        let r = c.client.handle_returned(n);
        // A rogue's own count is its problem; an honest client's is exact.
        assert!(c.rogue || r.is_ok(), "an honest client was returned credits it did not have out: {r:?}");
    }

    fn check(&self) {
        let grants: u32 = self.live().map(|(_, c)| c.granted).sum::<u32>() + self.draining_granted.iter().sum::<u32>();
        assert_eq!(grants, self.pool.granted(), "the pool's grants and the connections' differ");
        for (i, d) in self.draining.iter().enumerate() {
            let in_batch = self.batch.iter().filter(|s| **s == Some(i)).count() as u32;
            match d {
                Some(d) => assert_eq!(d.held(), in_batch, "draining conn {i}: slots held disagree"),
                None if self.conns[i].is_none() => assert_eq!(in_batch, 0, "closed conn {i} holds slots"),
                None => {}
            }
        }
        assert!(self.pool.granted() <= self.pool.capacity());
        let held: u32 = self.live().map(|(_, c)| c.serving).sum::<u32>() + self.batch.len() as u32;
        assert_eq!(self.posted + held, self.depth, "a slot was lost or made up");
        for (i, c) in self.live() {
            let in_batch = self.batch.iter().filter(|s| **s == Some(i)).count() as u32;
            assert_eq!(c.server.in_slots(), c.serving + in_batch, "conn {i}: slots held disagree");
            assert!(c.server.in_slots() <= c.granted, "conn {i} holds more slots than its grant");
            if c.rogue {
                continue;
            }
            // Every credit is in one place: with the client, on a request
            // in flight, in a slot, owed by the server, or on its way back.
            let wire: u32 = c.to_server.len() as u32 + c.to_client.iter().sum::<u32>();
            let total = c.client.available() + wire + c.server.in_slots() + c.server.owed();
            assert_eq!(total, c.granted, "conn {i}: credits lost or made up");
        }
    }

    fn step(&mut self, traffic: bool) {
        self.now += self.rng.below(10 * MICROS);
        let n = self.conns.len().max(1) as u64;
        let i = self.rng.below(n) as usize;
        let live = self.conns.get(i).is_some_and(Option::is_some);
        match self.rng.below(100) {
            0..=2 if traffic => {
                // Under pressure the pool is kept full.
                for _ in 0..if self.pressure { 8 } else { 1 } {
                    self.connect();
                }
            }
            3 if traffic && live && self.rng.chance(if self.pressure { 600 } else { 100 }) => self.close(i, 0),
            4..=34 if traffic && live => {
                // Under pressure a client spends its whole grant at once.
                let burst = if self.pressure { 64 } else { 1 };
                for _ in 0..burst {
                    self.send(i);
                }
            }
            35..=59 if live => {
                let burst = if self.pressure { 64 } else { 1 };
                for _ in 0..burst {
                    if self.conns[i].is_none() {
                        break;
                    }
                    self.deliver_request(i);
                }
            }
            60..=79 if live => self.finish_one(i),
            80..=84 => self.repost(false),
            85..=89 => self.idle_returns(),
            90..=99 if live => {
                let burst = if self.pressure { 64 } else { 1 };
                for _ in 0..burst {
                    self.deliver_return(i);
                }
            }
            _ => {}
        }
        self.check();
    }

    /// No new traffic: deliver, serve, re-post and return until nothing is
    /// in flight.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            for i in 0..self.conns.len() {
                while self.conns[i].as_ref().is_some_and(|c| !c.to_server.is_empty()) {
                    self.deliver_request(i);
                }
                while self.conns[i].as_ref().is_some_and(|c| c.serving > 0) {
                    self.finish_one(i);
                }
            }
            self.repost(true);
            self.now += IDLE_RETURN_NS;
            self.idle_returns();
            for i in 0..self.conns.len() {
                while self.conns[i].as_ref().is_some_and(|c| !c.to_client.is_empty()) {
                    self.deliver_return(i);
                }
            }
            self.check();
            let quiet = self.live().all(|(_, c)| c.to_server.is_empty() && c.to_client.is_empty() && c.serving == 0);
            if quiet && self.batch.is_empty() {
                return;
            }
        }
        panic!("the simulation did not drain");
    }
}

#[test]
fn credits_keep_the_shared_receive_queue_from_running_dry() {
    for seed in seeds() {
        let run = std::panic::catch_unwind(|| {
            let mut sim = Sim::new(seed);
            for round in 0..20_000 {
                // Phases of 2,000 steps, every other one under pressure.
                sim.pressure = (round / 2_000) % 2 == 1;
                sim.step(true);
            }
            sim.pressure = false;
            sim.drain();
            for (i, c) in sim.live().filter(|(_, c)| !c.rogue) {
                assert_eq!(c.client.available(), c.granted, "conn {i}: credits not all back once idle");
            }
            assert_eq!(sim.posted, DEPTH, "slots not all posted again once idle");
            assert!(sim.served > 1_000, "too little traffic to judge: {}", sim.served);
        });
        match run {
            Ok(_) => {}
            Err(e) => {
                eprintln!("credit simulation failed with CREDIT_SIM_SEED={seed}");
                std::panic::resume_unwind(e);
            }
        }
    }
}

/// The runs must reach the cases they exist for: pools that fill and
/// refuse, rogues caught past their grants, and a receive queue that comes
/// within the slack of running dry (or its check proves nothing).
#[test]
fn the_simulation_meets_refusals_overruns_and_a_full_queue() {
    let (mut refusals, mut overruns, mut min_posted) = (0, 0, DEPTH);
    for seed in 1..=10 {
        let mut sim = Sim::new(seed);
        for round in 0..20_000 {
            sim.pressure = (round / 2_000) % 2 == 1;
            sim.step(true);
        }
        refusals += sim.refusals;
        overruns += sim.overruns;
        min_posted = min_posted.min(sim.min_posted);
    }
    assert!(refusals > 0, "no connection was ever refused");
    assert!(overruns > 0, "no rogue was ever caught");
    assert!(min_posted <= 2 * SLACK, "the queue never came near running dry: {min_posted} posted at least");
}
