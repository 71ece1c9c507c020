//! A dmkvd node's part in a cluster: its shards' raft groups, their logs,
//! and (to come) the peer transport and the metadata group.
//! docs/replication-plan.md has the shape and the order of work.

pub mod apply;
pub mod config;
pub mod driver;
#[cfg(test)]
mod lease_sim;
pub mod leasing;
pub mod local;
pub mod log;
pub mod node;
pub mod peer;
pub mod replica;
pub mod shard;
pub mod wire;
