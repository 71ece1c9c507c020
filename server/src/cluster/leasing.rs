//! The leader's side of a shard's lease, driven by the shard core: when to
//! ask a quorum to renew it (a ReadIndex round, as TiKV renews its lease),
//! when it may be published for one-sided readers, and when to fence.
//! Pure: time is passed in (the replica's monotonic clock, in ns).
//!
//! A lease granted by a round sent at `sent` runs to `sent + lease`
//! ([`LeaseConfig::lease_ns`] says why no other leader can be elected
//! before then). It is published only once the store has applied up to the
//! index the round confirmed, so the region holds every write acknowledged
//! before the lease began, by this leader or an earlier one.

use dmkv_common::cluster::lease::{LeaderLease, LeaseAction, LeaseConfig, NoLease};

/// Read-index contexts of lease rounds carry this bit (reads' do not).
pub const LEASE_CTX: u64 = 1 << 63;

/// The lease state of one replica.
#[derive(Debug)]
pub struct LeaseKeeper {
    cfg: LeaseConfig,
    lease_ns: u64,
    /// Held while leading.
    lease: Option<LeaderLease>,
    /// The store must have applied this index before the lease is used.
    ready_index: u64,
    /// A renewal round in flight: (context, sent at).
    renewing: Option<(u64, u64)>,
    next_ctx: u64,
    /// The term in which this replica began handing leadership over
    /// ([`LeaseKeeper::hand_over`]): no lease for the rest of it.
    handed_over_in: Option<u64>,
}

impl LeaseKeeper {
    pub fn new(cfg: LeaseConfig) -> Result<LeaseKeeper, NoLease> {
        Ok(LeaseKeeper {
            lease_ns: cfg.lease_ns()?,
            cfg,
            lease: None,
            ready_index: 0,
            renewing: None,
            next_ctx: 0,
            handed_over_in: None,
        })
    }

    /// The lease length on this replica's clock.
    pub fn lease_ns(&self) -> u64 {
        self.lease_ns
    }

    /// Tells the keeper whether this replica leads in `term`. Losing
    /// leadership while a lease was held means fencing.
    pub fn on_role(&mut self, leader: bool, term: u64) -> LeaseAction {
        if leader && self.handed_over_in == Some(term) {
            return LeaseAction::None;
        }
        match (&self.lease, leader) {
            (Some(l), true) if l.term() == term => LeaseAction::None,
            (None, false) => LeaseAction::None,
            (held, true) => {
                let fence = held.as_ref().is_some_and(|l| l.expiry().is_some());
                self.lease = Some(LeaderLease::new(&self.cfg, term).expect("checked in new"));
                self.renewing = None;
                if fence { LeaseAction::Fence } else { LeaseAction::None }
            }
            (Some(l), false) => {
                let fence = l.expiry().is_some();
                self.lease = None;
                self.renewing = None;
                if fence { LeaseAction::Fence } else { LeaseAction::None }
            }
        }
    }

    /// Gives the lease up for the rest of `term`, before leadership is
    /// handed to another replica. A transfer lets the other replica
    /// campaign at once (raft's TimeoutNow), and its voters grant a
    /// transfer's votes however recently they heard from this leader, so
    /// the rule a lease rests on (no rival elected before it ends) no
    /// longer holds. Not taken again in this term even if the transfer is
    /// aborted: its TimeoutNow may still be on its way. Fence if a lease
    /// was held.
    pub fn hand_over(&mut self, term: u64) -> LeaseAction {
        self.handed_over_in = Some(term);
        self.renewing = None;
        match self.lease.take() {
            Some(l) if l.expiry().is_some() => LeaseAction::Fence,
            _ => LeaseAction::None,
        }
    }

    /// The simulation's rule without [`LeaseKeeper::hand_over`]'s hold on
    /// the rest of the term.
    #[cfg(test)]
    pub fn forget_hand_over(&mut self) {
        self.handed_over_in = None;
    }

    /// The context of a renewal round to send now, if one is due: when
    /// less than half the lease is left, and none is in flight (one lost
    /// for a whole lease is given up).
    pub fn due(&mut self, now: u64) -> Option<u64> {
        let lease = self.lease.as_ref()?;
        if let Some((_, sent)) = self.renewing
            && now.saturating_sub(sent) < self.lease_ns
        {
            return None;
        }
        let left = lease.expiry().map_or(0, |e| e.saturating_sub(now));
        if left > self.lease_ns / 2 {
            return None;
        }
        let ctx = LEASE_CTX | self.next_ctx;
        self.next_ctx += 1;
        self.renewing = Some((ctx, now));
        Some(ctx)
    }

    /// A read state came back: if it was a lease round, a quorum granted
    /// the lease from the time it was sent, valid once `index` is applied.
    pub fn on_read_state(&mut self, ctx: u64, index: u64) -> bool {
        if ctx & LEASE_CTX == 0 {
            return false;
        }
        if let (Some((want, sent)), Some(lease)) = (self.renewing, self.lease.as_mut())
            && want == ctx
        {
            lease.on_quorum_ack(sent);
            self.ready_index = self.ready_index.max(index);
            self.renewing = None;
        }
        true
    }

    /// Checks the lease at `now`.
    pub fn poll(&mut self, now: u64) -> LeaseAction {
        self.lease.as_mut().map_or(LeaseAction::None, |l| l.poll(now))
    }

    /// The lease to publish at `now` with the store applied to `applied`:
    /// (term, end on this replica's clock).
    pub fn published(&self, now: u64, applied: u64) -> Option<(u64, u64)> {
        let l = self.lease.as_ref()?;
        (l.valid(now) && applied >= self.ready_index).then(|| (l.term(), l.expiry().expect("valid")))
    }

    /// The lease held, whatever the clock says: (term, end on this
    /// replica's clock). For checks that hold the clock themselves.
    pub fn held(&self) -> Option<(u64, u64)> {
        let l = self.lease.as_ref()?;
        Some((l.term(), l.expiry()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn keeper() -> LeaseKeeper {
        LeaseKeeper::new(LeaseConfig { election_timeout_ns: 150 * MS, max_drift_ppm: 1000, margin_ns: 20 * MS })
            .unwrap()
    }

    #[test]
    fn a_lease_comes_from_a_confirmed_round_and_is_used_after_its_apply() {
        let mut k = keeper();
        assert_eq!(k.due(0), None, "not leading");
        assert_eq!(k.on_role(true, 4), LeaseAction::None);
        let ctx = k.due(10 * MS).expect("a first round");
        assert_eq!(k.due(11 * MS), None, "one round at a time");
        assert!(!k.on_read_state(7, 3), "a read's context is not a lease round");
        assert!(k.on_read_state(ctx, 12));
        assert_eq!(k.published(20 * MS, 11), None, "not before index 12 is applied");
        let (term, end) = k.published(20 * MS, 12).unwrap();
        assert_eq!((term, end), (4, 10 * MS + k.lease_ns()));
        assert_eq!(k.due(20 * MS), None, "renewed at half the lease");
        assert!(k.due(end - k.lease_ns() / 2).is_some());
        assert_eq!(k.published(end, 12), None, "over at its end");
        assert_eq!(k.poll(end), LeaseAction::Fence);
    }

    #[test]
    fn a_lease_handed_over_is_gone_for_the_rest_of_the_term() {
        let mut k = keeper();
        k.on_role(true, 5);
        let ctx = k.due(0).unwrap();
        k.on_read_state(ctx, 1);
        assert!(k.published(MS, 1).is_some());
        assert_eq!(k.hand_over(5), LeaseAction::Fence);
        assert_eq!((k.published(MS, 1), k.held()), (None, None));
        // Still leading in that term (the transfer was aborted): no round,
        // no lease.
        assert_eq!(k.on_role(true, 5), LeaseAction::None);
        assert_eq!(k.due(10 * MS), None);
        assert!(!k.on_read_state(ctx, 1) || k.published(10 * MS, 1).is_none());
        // Leading in a later term, leases again.
        assert_eq!(k.on_role(true, 7), LeaseAction::None);
        let ctx = k.due(20 * MS).expect("a round in the new term");
        k.on_read_state(ctx, 2);
        assert!(k.published(21 * MS, 2).is_some());
    }

    #[test]
    fn losing_leadership_with_a_lease_fences() {
        let mut k = keeper();
        k.on_role(true, 1);
        let ctx = k.due(0).unwrap();
        k.on_read_state(ctx, 1);
        assert_eq!(k.on_role(false, 2), LeaseAction::Fence);
        assert_eq!(k.published(MS, 5), None);
        assert_eq!(k.on_role(false, 2), LeaseAction::None);
        // Leading again in a later term starts without a lease.
        assert_eq!(k.on_role(true, 3), LeaseAction::None);
        assert_eq!(k.published(MS, 5), None);
    }
}
