//! dmkvd, the dmkv server: a memfd-backed region laid out per
//! `dmkv_common::layout`, the store that writes it, and the RPC service.
//!
//! Where a request goes: [`framed`] reads it off its connection, [`service`]
//! decodes it, [`store`] runs it against the [`region`], whose space
//! [`alloc`] hands out. One-sided GETs never reach the service or the
//! store: same-host clients map the region after a [`shm`] handoff, others
//! read it through the [`engine`] (served by the same [`framed`] loop);
//! both check the [`registration`].

pub mod alloc;
pub mod config;
pub mod counters;
pub mod engine;
pub mod framed;
pub mod lock;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod region;
pub mod registration;
pub mod service;
pub mod shm;
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
    engine: Option<TcpListener>,
    shm: Option<shm::ShmListener>,
    shared: Arc<Shared>,
    max_connections: usize,
    auth: Arc<dmkv_common::auth::Keys>,
}

impl Server {
    /// Creates the region, formats it, and binds the RPC listener.
    pub async fn bind(cfg: &Config) -> std::io::Result<Server> {
        let region = Arc::new(Region::create("dmkv-region", cfg.memory as usize)?);
        let seed: u64 = rand::random();
        // Epochs start at a random value so a restarted server never reuses one.
        let epoch: u64 = rand::random::<u32>() as u64 + 1;
        let store = Store::format(region, cfg.buckets, seed, epoch, cfg.grace)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let listener = TcpListener::bind(cfg.listen).await?;
        let engine = match cfg.engine_listen {
            Some(addr) => Some(TcpListener::bind(addr).await?),
            None => None,
        };
        let shm = match &cfg.shm_socket {
            Some(path) => Some(shm::ShmListener::bind(path)?),
            None => None,
        };
        let registration = Arc::new(registration::Registration::new(*store.header()));
        #[cfg(feature = "rdma")]
        let rdma = open_rdma(cfg, store.region())?;
        let shared = Arc::new(Shared {
            store,
            max_frame: cfg.max_frame,
            registration,
            region_id: 0,
            engine_addr: engine.as_ref().map(|l| l.local_addr()).transpose()?,
            shm_socket: shm.as_ref().map(|s| s.path().to_path_buf()),
            host_id: dmkv_common::host::host_id(),
            engine_counters: Arc::default(),
            #[cfg(feature = "rdma")]
            rdma,
        });
        Ok(Server { listener, engine, shm, shared, max_connections: cfg.max_connections, auth: Arc::clone(&cfg.auth) })
    }

    /// The one-sided engine's address, if it is on.
    pub fn engine_addr(&self) -> Option<SocketAddr> {
        self.shared.engine_addr
    }

    /// The shared-memory handoff socket, if it is on.
    pub fn shm_socket(&self) -> Option<&std::path::Path> {
        self.shared.shm_socket.as_deref()
    }

    /// Test hook: the state the service shares, to reach the store while
    /// the server runs (e.g. [`Store::scribble_for_tests`]).
    #[doc(hidden)]
    pub fn shared_for_tests(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    /// The line `dmkvd` prints once it serves: every endpoint as key=value.
    pub fn endpoints_line(&self) -> String {
        let mut line = format!("dmkvd listening rpc={}", self.local_addr());
        if let Some(a) = self.engine_addr() {
            line += &format!(" engine={a}");
        }
        if let Some(p) = self.shm_socket() {
            line += &format!(" shm={}", p.display());
        }
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.shared.rdma {
            line += &format!(" rdma={}", r.device_name());
        }
        line
    }

    /// The RPC address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// Serves until `shutdown` resolves, then stops accepting and lets every
    /// connection answer the requests it has read (bounded by a deadline).
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut side = JoinSet::new();
        let region = Arc::clone(self.shared.store.region());
        if let Some(l) = self.engine {
            let (r, reg, c) =
                (Arc::clone(&region), Arc::clone(&self.shared.registration), Arc::clone(&self.shared.engine_counters));
            match engine::spawn_thread(l, r, reg, c, stop_rx.clone()) {
                Ok(done) => {
                    side.spawn(async move {
                        let _ = done.await;
                    });
                }
                Err(e) => warn!("one-sided engine not started: {e}"),
            }
        }
        if let Some(l) = self.shm {
            let (r, reg, rx) = (Arc::clone(&region), Arc::clone(&self.shared.registration), stop_rx.clone());
            let keys = Arc::clone(&self.auth);
            side.spawn(async move {
                if let Err(e) = shm::serve(l, r, reg, keys, rx).await {
                    warn!("shared-memory handoff stopped: {e}");
                }
            });
        }
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
        while side.join_next().await.is_some() {}
        info!("stopped");
    }
}

#[cfg(feature = "rdma")]
fn open_rdma(cfg: &Config, region: &Arc<Region>) -> std::io::Result<Option<rdma::RdmaRegion>> {
    if !cfg.rdma {
        return Ok(None);
    }
    match rdma::RdmaRegion::open(cfg.rdma_device.as_deref(), Arc::clone(region)) {
        Ok(r) => {
            info!(device = r.device_name(), "region registered for RDMA reads");
            Ok(Some(r))
        }
        Err(e) if cfg.rdma_device.is_some() => Err(std::io::Error::other(format!("RDMA: {e}"))),
        Err(dmkv_verbs::VerbsError::NoDevice) => {
            info!("no RDMA device: one-sided reads over shared memory and TCP only");
            Ok(None)
        }
        Err(e) => {
            warn!("RDMA unavailable: {e}");
            Ok(None)
        }
    }
}
