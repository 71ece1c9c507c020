//! The state of the asks of the metadata group a node makes for clients
//! whose map was found stale (`ClusterNode::refresh_past`, in `meta`).

/// The asks of the group a node makes for clients (`ClusterNode::refresh_past`).
#[derive(Default)]
pub struct ClientAsks {
    pub(super) asking: std::sync::atomic::AtomicBool,
    pub(super) done: tokio::sync::Notify,
    /// When the last ask ended, and whether it brought a map.
    pub(super) last: std::sync::Mutex<Option<(std::time::Instant, bool)>>,
}
