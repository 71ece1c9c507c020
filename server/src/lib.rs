//! dmkvd, the dmkv server: a memfd-backed region laid out per
//! `dmkv_common::layout`, the store that writes it, and the RPC service.
//!
//! Where a request goes: [`service`] decodes it, [`store`] runs it against
//! the [`region`], whose space [`alloc`] hands out.

pub mod alloc;
pub mod config;
pub mod region;
pub mod service;
pub mod store;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tracing::{info, warn};

pub use config::Config;
use region::Region;
use service::Shared;
use store::Store;

/// A bound, formatted server, ready to serve.
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
    max_connections: usize,
}

impl Server {
    /// Creates the region, formats it, and binds the RPC listener.
    pub async fn bind(cfg: &Config) -> std::io::Result<Server> {
        let region = Arc::new(Region::create("dmkv-region", cfg.memory as usize)?);
        let seed: u64 = rand::random();
        let rkey: u64 = rand::random::<u32>() as u64;
        // Epochs start at a random value so a restarted server never reuses one.
        let epoch: u64 = rand::random::<u32>() as u64 + 1;
        let store = Store::format(region, cfg.buckets, seed, epoch, cfg.grace)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let listener = TcpListener::bind(cfg.listen).await?;
        let shared = Arc::new(Shared { store, max_frame: cfg.max_frame, rkey, region_id: 0 });
        Ok(Server { listener, shared, max_connections: cfg.max_connections })
    }

    /// The RPC address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets every
    /// connection answer the requests it has read (bounded by a deadline).
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let permits = Arc::new(Semaphore::new(self.max_connections));
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                p = Arc::clone(&permits).acquire_owned() => p.expect("semaphore never closed"),
                _ = &mut shutdown => break,
            };
            tokio::select! {
                r = self.listener.accept() => match r {
                    Ok((stream, _)) => {
                        let shared = Arc::clone(&self.shared);
                        let rx = stop_rx.clone();
                        conns.spawn(async move {
                            service::serve_connection(stream, shared, rx).await;
                            drop(permit);
                        });
                    }
                    Err(e) => warn!("accept failed: {e}"),
                },
                _ = &mut shutdown => break,
            }
            while conns.try_join_next().is_some() {}
        }
        info!(connections = conns.len(), "shutting down: no longer accepting");
        drop(self.listener);
        let _ = stop_tx.send(true);
        let drain = async { while conns.join_next().await.is_some() {} };
        if tokio::time::timeout(config::SHUTDOWN_DRAIN, drain).await.is_err() {
            warn!("connections still open after the drain deadline; closing them");
        }
        info!("stopped");
    }
}
