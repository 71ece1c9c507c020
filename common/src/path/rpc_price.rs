//! Which way a node's RPCs go where both are open: verbs messages or TCP,
//! priced by the round trips each has shown lately.
//!
//! Each way keeps a smoothed round trip (EWMA, 1/8 per sample, as TCP's
//! SRTT) of the requests sampled on it; requests take the cheaper way, a
//! switch needs the other to be clearly cheaper ([`SWITCH_BELOW`]), and one
//! request in [`PROBE_EVERY`] takes the other way so its price stays
//! current. A way not measured yet is tried first. Pure: the client's pool
//! feeds it round trips and asks it per request.

/// A way an RPC travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RpcWay {
    Tcp = 0,
    Verbs = 1,
}

impl RpcWay {
    fn other(self) -> RpcWay {
        match self {
            RpcWay::Tcp => RpcWay::Verbs,
            RpcWay::Verbs => RpcWay::Tcp,
        }
    }
}

/// One request in this many goes the other way, measured.
pub const PROBE_EVERY: u64 = 64;
/// One request in this many on the chosen way is measured.
pub const SAMPLE_EVERY: u64 = 8;
/// The other way must cost below this share of the current one (in
/// percent) to take over: round trips jitter, and flapping costs both.
pub const SWITCH_BELOW: u64 = 90;

/// The prices of a node's two ways and which one is taken.
#[derive(Debug, Clone)]
pub struct RpcPrice {
    srtt_ns: [Option<u64>; 2],
    current: RpcWay,
    sent: u64,
    taken: [u64; 2],
}

impl Default for RpcPrice {
    fn default() -> Self {
        RpcPrice { srtt_ns: [None; 2], current: RpcWay::Verbs, sent: 0, taken: [0; 2] }
    }
}

/// The way for one request, and whether to measure its round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub way: RpcWay,
    pub sample: bool,
}

impl RpcPrice {
    /// The way the next request takes.
    pub fn pick(&mut self) -> Pick {
        self.sent = self.sent.wrapping_add(1);
        let pick = match self.srtt_ns.map(|s| s.is_none()) {
            [_, true] => Pick { way: RpcWay::Verbs, sample: true },
            [true, _] => Pick { way: RpcWay::Tcp, sample: true },
            _ if self.sent.is_multiple_of(PROBE_EVERY) => Pick { way: self.current.other(), sample: true },
            _ => Pick { way: self.current, sample: self.sent.is_multiple_of(SAMPLE_EVERY) },
        };
        self.taken[pick.way as usize] += 1;
        pick
    }

    /// A request that went `way` took `rtt_ns` from send to reply.
    pub fn handle_rtt(&mut self, way: RpcWay, rtt_ns: u64) {
        let s = &mut self.srtt_ns[way as usize];
        *s = Some(match *s {
            None => rtt_ns,
            Some(old) => old - old / 8 + rtt_ns / 8,
        });
        if let [Some(tcp), Some(verbs)] = self.srtt_ns {
            let (mine, other) = match self.current {
                RpcWay::Tcp => (tcp, verbs),
                RpcWay::Verbs => (verbs, tcp),
            };
            if other.saturating_mul(100) < mine.saturating_mul(SWITCH_BELOW) {
                self.current = self.current.other();
            }
        }
    }

    /// The way most requests take now.
    pub fn current(&self) -> RpcWay {
        self.current
    }

    /// Each way's smoothed round trip, TCP then verbs.
    pub fn srtt_ns(&self) -> [Option<u64>; 2] {
        self.srtt_ns
    }

    /// Requests sent each way, TCP then verbs.
    pub fn taken(&self) -> [u64; 2] {
        self.taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(price: &mut RpcPrice, n: usize, tcp_ns: u64, verbs_ns: u64) -> [u64; 2] {
        let before = price.taken();
        for _ in 0..n {
            let p = price.pick();
            if p.sample {
                price.handle_rtt(p.way, if p.way == RpcWay::Tcp { tcp_ns } else { verbs_ns });
            }
        }
        let after = price.taken();
        [after[0] - before[0], after[1] - before[1]]
    }

    #[test]
    fn each_way_is_tried_then_the_cheaper_one_takes_nearly_everything() {
        let mut p = RpcPrice::default();
        assert_eq!(p.pick().way, RpcWay::Verbs, "an unmeasured way is tried first");
        p.handle_rtt(RpcWay::Verbs, 50_000);
        assert_eq!(p.pick().way, RpcWay::Tcp);
        p.handle_rtt(RpcWay::Tcp, 100_000);
        let [tcp, verbs] = run(&mut p, 6400, 100_000, 50_000);
        assert_eq!(tcp, 100, "only probes go the dearer way");
        assert_eq!(verbs, 6300);
    }

    #[test]
    fn a_way_that_gets_dearer_loses_the_traffic_and_a_small_gap_moves_nothing() {
        let mut p = RpcPrice::default();
        run(&mut p, 640, 100_000, 50_000);
        assert_eq!(p.current(), RpcWay::Verbs);
        // Verbs 5 % dearer than TCP: inside the margin, nothing moves.
        run(&mut p, 6400, 100_000, 105_000);
        assert_eq!(p.current(), RpcWay::Verbs, "switched on a gap inside the margin");
        // Three times dearer: the probes find TCP cheaper and it takes over.
        run(&mut p, 6400, 100_000, 300_000);
        assert_eq!(p.current(), RpcWay::Tcp);
        let [tcp, verbs] = run(&mut p, 6400, 100_000, 300_000);
        assert!(tcp > 6000 && verbs <= 100, "tcp {tcp} verbs {verbs}");
    }
}
