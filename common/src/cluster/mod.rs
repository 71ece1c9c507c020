//! The cluster's pure logic: which shard holds a key ([`map`]), and when a
//! shard leader's memory may be read one-sided ([`lease`] for the leader's
//! side and the rule, [`lease_check`] for a reader's). No IO and no
//! clock: time is passed in, so both are tested deterministically.

pub mod lease;
pub mod lease_check;
pub mod map;
pub mod rebalance;
pub mod replica_plan;
