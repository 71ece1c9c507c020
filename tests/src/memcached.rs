//! A real memcached, the reference the memcached-port tests compare dmkv
//! with, and the memcached port of a dmkvd under test.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::ServerProcess;

/// How long memcached gets to listen.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// memcached on a free loopback port, stopped on drop.
pub struct Memcached {
    child: Child,
    pub port: u16,
}

impl Memcached {
    /// `None` if memcached is not installed (CI installs it: callers fail
    /// there). Panics if it does not listen within 10 s.
    pub fn start() -> Option<Memcached> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let child = Command::new("memcached")
            .args(["-l", "127.0.0.1", "-p", &port.to_string(), "-U", "0", "-u", "nobody"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let m = Memcached { child, port };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "memcached did not listen on {port} within {START_TIMEOUT:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(m)
    }
}

impl Drop for Memcached {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port of `srv`'s memcached listener (from `memcached=` in its
/// listening line).
pub fn port_of(srv: &ServerProcess) -> u16 {
    let addr = srv.endpoint("memcached").expect("memcached= in the listening line");
    addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port")
}
