//! A dmkvd node's part in a cluster: its shards' raft groups, their logs,
//! their snapshots and the peer transport.
//! docs/replication.md has the design, the argument and the failure cases.

pub mod apply;
pub mod client_asks;
pub mod config;
pub mod desk;
pub mod dial;
pub mod driver;
pub mod engine_panic;
pub mod forward;
pub mod identity;
pub mod last_run;
pub mod lead;
pub mod leasing;
pub mod local;
pub mod local_replica;
pub mod log;
pub mod meta;
pub mod move_ask;
pub mod move_book;
pub mod move_claim;
pub mod move_resume;
pub mod mover;
pub mod moving;
pub mod node;
pub mod noted;
pub mod pace;
pub mod peer;
pub mod peer_tls;
pub mod placement;
pub mod rebalancer;
pub mod reconcile;
pub mod replica;
pub mod replica_move;
pub mod shard;
#[cfg(test)]
mod sim;
pub mod snapshot;
pub mod sync_policy;
pub mod thread_priority;
pub mod transfer;
pub mod wire;
