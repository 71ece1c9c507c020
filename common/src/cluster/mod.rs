//! The cluster's pure logic: which shard holds a key ([`map`]), and when a
//! shard leader's memory may be read one-sided ([`lease`]). No IO and no
//! clock: time is passed in, so both are tested deterministically.

pub mod lease;
pub mod map;
