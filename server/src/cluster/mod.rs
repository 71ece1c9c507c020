//! A dmkvd node's part in a cluster: its shards' raft groups, their logs,
//! their snapshots and the peer transport.
//! docs/replication.md has the design, the argument and the failure cases.

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
pub mod snapshot;
pub mod wire;
