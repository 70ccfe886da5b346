//! The HTTP server under the load an operator worried about: idle
//! connections cannot starve a health probe, /metrics and /state answer
//! beyond loopback only when configured, and promtool accepts /metrics in
//! both expositions. The server runs on its own `current_thread` runtime,
//! like the agent's; clients are plain blocking sockets.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]

use netreap_testkit as support;

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::fd::AsRawFd as _,
    process::{Command, Stdio},
    sync::Arc,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use netreap::telemetry::{
    http::{self, Endpoints, Exposure, Readiness},
    metrics::Metrics,
};
use support::net::ip;
use tokio::sync::watch;

struct Server {
    addr: SocketAddr,
    metrics: Metrics,
    readiness: Readiness,
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// Serves on `bind` from a thread of its own (in the caller's netns).
    fn start(bind: SocketAddr, exposure: Exposure) -> Self {
        let metrics = Metrics::new("9.9.9-test");
        let readiness = Readiness::new();
        let endpoints = Endpoints {
            metrics: metrics.clone(),
            readiness: readiness.clone(),
            state: Arc::new(|w| {
                serde_json::to_writer(w, &serde_json::json!({ "reservations": [{ "ip": "10.22.0.5" }] }))
            }),
            exposure,
        };
        let (stop, stopped) = watch::channel(false);
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = support::runtime();
            rt.block_on(async move {
                let listener = http::bind(bind).await.expect("bind");
                bound_tx.send(listener.local_addr().expect("bound address")).expect("test waits");
                http::serve(listener, endpoints, stopped).await;
            });
        });
        let addr = bound_rx.recv_timeout(Duration::from_secs(5)).expect("server bound");
        Self { addr, metrics, readiness, stop, thread: Some(thread) }
    }

    fn to(&self, ip: Ipv4Addr) -> SocketAddr {
        SocketAddr::from((ip, self.addr.port()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One GET on a fresh connection: (status, body).
fn get(addr: SocketAddr, path: &str, accept: Option<&str>) -> (u16, String) {
    let headers: Vec<(&str, &str)> = accept.map(|a| ("Accept", a)).into_iter().collect();
    support::agent::http_get_with(addr, path, &headers, Duration::from_secs(5)).expect("a reply")
}

/// Whether the server has closed `conn` (EOF or reset), without blocking.
fn closed_by_server(conn: &TcpStream) -> bool {
    conn.set_nonblocking(true).expect("socket option");
    let mut byte = [0u8; 1];
    let closed = match (&*conn).read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != ErrorKind::WouldBlock,
    };
    conn.set_nonblocking(false).expect("socket option");
    closed
}

/// A timed /healthz on a fresh connection.
fn timed_healthz(addr: SocketAddr) -> Duration {
    let started = Instant::now();
    let (status, body) = get(addr, "/healthz", None);
    let took = started.elapsed();
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    took
}

#[test]
fn idle_connections_never_starve_a_health_probe() {
    let server = Server::start("127.0.0.1:0".parse().expect("address"), Exposure::default());
    let mut idle: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(server.addr).expect("connect")).collect();
    // Let the server accept them all (each is then an open, idle connection).
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        let took = timed_healthz(server.addr);
        assert!(took < Duration::from_millis(100), "/healthz took {took:?} with 200 idle connections held");
    }
    assert!(idle.iter().all(|c| !closed_by_server(c)), "200 is under the limit: every idle connection is still held");

    // Past the table's size, the oldest idle connections make room.
    idle.extend((0..100).map(|_| TcpStream::connect(server.addr).expect("connect")));
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        let took = timed_healthz(server.addr);
        assert!(took < Duration::from_millis(100), "/healthz took {took:?} with 300 idle connections opened");
    }
    let closed: Vec<usize> = idle.iter().enumerate().filter(|(_, c)| closed_by_server(c)).map(|(i, _)| i).collect();
    let over = idle.len() + 10 - http::MAX_CONNECTIONS;
    assert!(closed.len() >= idle.len() - http::MAX_CONNECTIONS, "closed {} of {}", closed.len(), idle.len());
    assert!(closed.len() <= over, "closed {} of {}: more than needed", closed.len(), idle.len());
    assert!(closed.iter().all(|i| *i < over), "the oldest were evicted, not the newest: {closed:?}");

    // An idle connection is closed once the head timeout passes.
    let lone = TcpStream::connect(server.addr).expect("connect");
    let took = support::agent::wait_until(http::HEADER_TIMEOUT + Duration::from_secs(3), || closed_by_server(&lone))
        .expect("an idle connection is closed after the head timeout");
    assert!(took + Duration::from_millis(500) >= http::HEADER_TIMEOUT, "closed after {took:?}");
    drop(idle);
}

/// A netns whose `lo` also holds a non-loopback address, so a client there
/// reaches the server from beyond loopback without touching the host.
struct TestNetns {
    name: String,
}

const REMOTE: Ipv4Addr = Ipv4Addr::new(198, 18, 77, 1);

impl TestNetns {
    fn new() -> Self {
        let name = support::unique("nrShttp");
        ip(&["netns", "add", &name]);
        let ns = Self { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ip(&["-n", &ns.name, "addr", "add", &format!("{REMOTE}/32"), "dev", "lo"]);
        ns
    }

    /// Runs `f` on a thread that has entered this netns.
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("open the test netns");
            // SAFETY: a valid nsfs descriptor; only this thread moves.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("thread in the test netns")
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

#[test]
fn metrics_and_state_answer_beyond_loopback_only_when_exposed() {
    assert!(support::kernel_tests_possible(), "needs root to make a network namespace");
    let ns = TestNetns::new();
    let statuses = |exposure: Exposure| {
        ns.run(move || {
            let server = Server::start("0.0.0.0:0".parse().expect("address"), exposure);
            server.readiness.mark_ready();
            let remote = server.to(REMOTE);
            let local = server.to(Ipv4Addr::LOCALHOST);
            let paths = ["/healthz", "/readyz", "/metrics", "/state"];
            let from_remote: Vec<u16> = paths.iter().map(|p| get(remote, p, None).0).collect();
            let from_local: Vec<u16> = paths.iter().map(|p| get(local, p, None).0).collect();
            let refusal = get(remote, "/state", None).1;
            (from_remote, from_local, refusal)
        })
    };
    let (remote, local, refusal) = statuses(Exposure::default());
    assert_eq!(remote, [200, 200, 403, 403], "by default only the probes answer beyond loopback");
    assert_eq!(local, [200, 200, 200, 200], "loopback gets everything");
    assert!(refusal.contains("expose_state"), "the refusal names the key: {refusal}");
    let (remote, _, _) = statuses(Exposure { metrics: true, state: false });
    assert_eq!(remote, [200, 200, 200, 403], "expose_metrics opens /metrics only");
    let (remote, _, _) = statuses(Exposure { metrics: true, state: true });
    assert_eq!(remote, [200, 200, 200, 200]);
}

/// What Prometheus 2.x sends when it scrapes.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

fn promtool() -> &'static str {
    ["/usr/bin/promtool", "/usr/local/bin/promtool"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| panic!("promtool not found: apt-get install prometheus (cargo xtask test installs it)"))
}

/// Runs promtool with `args`, `input` on stdin; panics with its output on failure.
fn run_promtool(args: &[&str], input: &str, what: &str) {
    let mut child = Command::new(promtool())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("feed promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool {} ({what}) failed:\n{}{}\n--- input:\n{input}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// promtool's `check metrics` reads (and lints) the text format 0.0.4, and
/// is run on every exposition a client that prefers text negotiates.
/// `check metrics` cannot read OpenMetrics (in OpenMetrics a counter's
/// family has no `_total`, which its text parser reports as "no help text"),
/// so the OpenMetrics exposition goes through promtool's OpenMetrics parser
/// (Prometheus's own, used for backfilling) instead: `tsdb
/// create-blocks-from openmetrics`, which needs a timestamp on each sample,
/// so the test appends one and changes nothing else.
#[test]
fn promtool_accepts_metrics_with_and_without_openmetrics() {
    let server = Server::start("127.0.0.1:0".parse().expect("address"), Exposure::default());
    let m = &server.metrics;
    m.set_reservations("podnet", "in_use", 12);
    m.set_reservations("podnet", "orphaned", 2);
    m.release("netns_died", "released");
    m.release("orphan_grace", "dry_run");
    m.conflict();
    m.set_netns_alive(40);
    m.netns_destroyed();
    m.cni_operation("ADD", "ok");
    m.ringbuf_drops(1);
    m.resync("netlink");
    m.observe_death_to_release(Duration::from_millis(3));
    let text_accepts =
        [None, Some("text/plain;version=0.0.4"), Some("text/plain;q=0.9,application/openmetrics-text;q=0.5")];
    for accept in text_accepts {
        let (status, body) = get(server.addr, "/metrics", accept);
        assert_eq!(status, 200);
        assert!(!body.contains("# EOF"), "text format for Accept {accept:?}");
        run_promtool(&["check", "metrics"], &body, &format!("Accept: {accept:?}"));
    }
    let dir = tempfile::tempdir().expect("temp dir");
    for accept in [PROMETHEUS_ACCEPT, "application/openmetrics-text"] {
        let (status, body) = get(server.addr, "/metrics", Some(accept));
        assert_eq!(status, 200);
        assert!(body.ends_with("# EOF\n"), "OpenMetrics for Accept {accept:?}");
        let stamped: String = body
            .lines()
            .map(|l| if l.starts_with('#') { format!("{l}\n") } else { format!("{l} 1700000000\n") })
            .collect();
        let input = dir.path().join("metrics.om");
        std::fs::write(&input, &stamped).expect("write the exposition");
        let blocks = dir.path().join(format!("blocks-{}", accept.len()));
        let (input, blocks) = (input.to_string_lossy().into_owned(), blocks.to_string_lossy().into_owned());
        run_promtool(&["tsdb", "create-blocks-from", "openmetrics", &input, &blocks], &stamped, accept);
    }
}
