//! End-to-end checks of `ReadPath::Auto`'s path selection over a real
//! network path (`dmkv_benches::scenario`: dmkvd in a network namespace
//! behind a veth pair, `--no-shm`, one-sided reads over its TCP engine).
//!
//! Each test runs a short version of one scenario and polls windows of the
//! probe's GETs until the share that went RPC, added up over the last
//! [`JUDGED`] windows, meets the expectation by the probe's path controller
//! (exact) and by the server's STATS (which checks the client's word), see
//! `Window::splits`, or fails at a deadline:
//!
//! 1. the engine's link congested by a bulk reader: most GETs go RPC; once
//!    the bulk stops, most go one-sided again;
//! 2. the RPC workers saturated by PUTs: most GETs go one-sided;
//! 3. the probe's key rewritten continuously: most of its GETs go RPC;
//! 4. the engine's replies dropped: every GET is still answered, most go
//!    RPC; once replies flow again, most go one-sided again.
//!
//! They need root, `ip` and `tc`; where namespaces cannot be made they
//! print why and pass without checking anything, or fail if
//! `DMKV_NETNS_TESTS=1` (as in CI). They run one at a time
//! (a lock), since each scenario loads both cores of a small machine.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dmkv_benches::scenario::{Load, Params, Scenario, Setup, Split};
use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_tests::netns::Netns;
use tokio::runtime::Runtime;

/// Length of one polled window.
const WINDOW: Duration = Duration::from_millis(500);
/// Windows a condition is judged over: their GETs are added up, so one
/// window's wobble neither makes nor breaks it.
const JUDGED: usize = 3;
/// How long the selector gets to meet a condition.
const DEADLINE: Duration = Duration::from_secs(10);

static SERIAL: Mutex<()> = Mutex::new(());

/// Parameters of the short scenarios. The engine link must be fast enough
/// that the probe alone leaves room (otherwise RPC is rightly better even
/// without the bulk) and slow enough that the bulk readers fill it: a
/// debug build's probe makes about 15 k one-sided GETs/s (about 150 Mbit/s
/// of replies) and its bulk readers fill 300 Mbit/s; release builds use the
/// driver's defaults (2 Gbit/s).
fn params() -> Params {
    if cfg!(debug_assertions) {
        Params { rate: "300mbit".into(), hot_in_flight: 4, ..Params::default() }
    } else {
        Params::default()
    }
}

/// The scenario's server, a probe in `Auto` and an admin client; `None`
/// (after saying why) where network namespaces cannot be made and need not
/// be (see `Netns::available_or_skip`).
/// (Fields drop in order: clients, then the server and namespace, then the
/// runtime the clients' connections belong to.)
struct Run {
    probe: Client,
    admin: Client,
    keys: Arc<Vec<Bytes>>,
    setup: Setup,
    rt: Runtime,
}

fn start(name: &str, scenario: Scenario) -> Option<Run> {
    start_with(name, scenario, ClientConfig::default().read_path(ReadPath::Auto))
}

/// [`start`] with the probe's settings given.
fn start_with(name: &str, scenario: Scenario, probe: ClientConfig) -> Option<Run> {
    if !Netns::available_or_skip(name) {
        return None;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let setup = Setup::start(scenario, params()).unwrap_or_else(|e| panic!("{name}: setup: {e}"));
    rt.block_on(setup.preload()).unwrap_or_else(|e| panic!("{name}: preload: {e}"));
    let admin = rt.block_on(setup.client(ReadPath::Rpc)).expect("admin client");
    let probe = rt.block_on(setup.client_with(probe)).expect("probe client");
    let keys = setup.probe_keys();
    rt.block_on(setup.warm(&probe, &keys)).expect("warm-up");
    Some(Run { probe, admin, keys, setup, rt })
}

impl Run {
    /// Polls windows until the last [`JUDGED`] windows together meet
    /// `cond` by the controller's split and by the server's (which also
    /// counts the controller's background RPC probes); panics with every
    /// window's numbers at the deadline.
    fn expect(&self, what: &str, load: Option<&Load>, cond: impl Fn(&Split) -> bool) {
        let deadline = Instant::now() + DEADLINE;
        let mut seen: Vec<(String, Vec<Split>)> = Vec::new();
        while Instant::now() < deadline {
            let w = self
                .rt
                .block_on(self.setup.window(&self.probe, &self.admin, &self.keys, WINDOW, load))
                .unwrap_or_else(|e| panic!("{what}: window: {e}"));
            let line = w.summary();
            eprintln!("  {what}: {line}");
            assert!(w.errors == 0 && w.wrong == 0, "{what}: probe GETs failed: {line} ({:?})", w.first_error);
            seen.push((line, w.splits()));
            if seen.len() >= JUDGED {
                let last = &seen[seen.len() - JUDGED..];
                // The controller's own split is exact; the server's count
                // checks it. (The probe's read_stats count one-sided probes
                // as GETs: printed, not judged.)
                let met = [0, 2].into_iter().all(|i| {
                    let (rpc, one_sided) =
                        last.iter().fold((0, 0), |(r, o), (_, s)| (r + s[i].rpc, o + s[i].one_sided));
                    rpc + one_sided > 0 && cond(&Split { source: last[0].1[i].source, rpc, one_sided })
                });
                if met {
                    return;
                }
            }
        }
        let lines: Vec<&str> = seen.iter().map(|(l, _)| l.as_str()).collect();
        panic!(
            "{what}: not met over {JUDGED} consecutive windows of {WINDOW:?} within {DEADLINE:?}; windows:\n  {}",
            lines.join("\n  ")
        );
    }
}

fn most_rpc(s: &Split) -> bool {
    s.rpc_share() > 0.5
}

fn most_one_sided(s: &Split) -> bool {
    s.rpc_share() < 0.5
}

#[test]
fn engine_congested_auto_moves_to_rpc_and_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(run) = start("engine_congested_auto_moves_to_rpc_and_back", Scenario::EngineCongested) else { return };
    let repaths = run.probe.path_stats().engine_repaths;
    let mut bulk = run.setup.start_load().expect("bulk reader");
    run.expect("bulk on: most GETs go RPC", Some(&bulk), most_rpc);
    // The probe's engine connections (probed in the background) sat
    // behind the full queue for many rounds: PLB replaced at least one.
    let deadline = Instant::now() + DEADLINE;
    while run.probe.path_stats().engine_repaths == repaths && Instant::now() < deadline {
        run.rt.block_on(run.setup.window(&run.probe, &run.admin, &run.keys, WINDOW, Some(&bulk))).expect("window");
    }
    assert!(run.probe.path_stats().engine_repaths > repaths, "no congested engine connection was replaced");
    bulk.stop().expect("bulk reader");
    run.expect("bulk off: most GETs go one-sided again", None, most_one_sided);
}

#[test]
fn rpc_saturated_auto_prefers_one_sided() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(run) = start("rpc_saturated_auto_prefers_one_sided", Scenario::RpcSaturated) else { return };
    let puts = run.setup.start_load().expect("PUT load");
    run.expect("PUT load: most GETs go one-sided", Some(&puts), most_one_sided);
}

#[test]
fn hot_key_auto_prefers_rpc() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(run) = start("hot_key_auto_prefers_rpc", Scenario::HotKey) else { return };
    let writer = run.setup.start_load().expect("hot-key writer");
    run.expect("hot key rewritten: most of its GETs go RPC", Some(&writer), most_rpc);
}

/// The engine's replies are dropped (a bfifo of one byte lets nothing
/// through): its reads time out, every GET is still answered (the ones
/// caught on the engine over RPC), traffic moves to RPC, and once the
/// engine's replies flow again the client attaches anew and goes back.
#[test]
fn a_failed_one_sided_path_moves_gets_to_rpc_and_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Short timeouts, so a dead engine is noticed within the test.
    let cfg = ClientConfig::default()
        .read_path(ReadPath::Auto)
        .connect_timeout(Duration::from_millis(300))
        .request_timeout(Duration::from_secs(2));
    let name = "a_failed_one_sided_path_moves_gets_to_rpc_and_back";
    let Some(run) = start_with(name, Scenario::RpcSaturated, cfg) else { return };
    run.expect("engine up: most GETs go one-sided", None, most_one_sided);

    let port = run.setup.engine_port().expect("engine port");
    run.setup.netns().shape_sport(port, "8bit", Some(1)).expect("drop the engine's replies");
    let before = run.probe.path_stats().controller.one_sided.failures;
    run.expect("engine down: GETs go RPC", None, most_rpc);
    let failures = run.probe.path_stats().controller.one_sided.failures - before;
    assert!(failures >= 1, "no one-sided failure was recorded");

    run.setup.netns().unshape().expect("let the engine's replies through");
    run.expect("engine up again: most GETs go one-sided", None, most_one_sided);
}
