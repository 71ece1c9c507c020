//! What the RDMA tests share (feature `rdma`): whether a verbs device is
//! here. Without one they skip, unless DMKV_RDMA_TESTS=1 (as in the test
//! VM, tests/rdma-vm), where a missing device fails them.

/// Whether `test` can run: true with a device; false (one SKIPPED line)
/// without one outside the VM; a panic without one inside it.
pub fn device_or_skip(test: &str) -> bool {
    match dmkv_verbs::Context::open(None) {
        Ok(_) => true,
        Err(e) if std::env::var("DMKV_RDMA_TESTS").as_deref() != Ok("1") => {
            eprintln!("{test}: SKIPPED, no RDMA device ({e}); set DMKV_RDMA_TESTS=1 to make this fail");
            false
        }
        Err(e) => panic!("{test}: DMKV_RDMA_TESTS=1 but no RDMA device: {e}"),
    }
}
