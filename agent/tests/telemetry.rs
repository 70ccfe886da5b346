//! The HTTP endpoints for real, over loopback TCP: /metrics is scraped and
//! parsed as a Prometheus client would, /readyz flips, /state serves the
//! provider's JSON, and hostile requests do not take the server down.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]

use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use netreap::telemetry::{
    http::{self, Endpoints, Exposure, Readiness, StateProvider},
    metrics::Metrics,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
    sync::watch,
    task::JoinHandle,
};

const WAIT: Duration = Duration::from_secs(5);

struct Server {
    addr: SocketAddr,
    metrics: Metrics,
    readiness: Readiness,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

async fn start_with(state: StateProvider) -> Server {
    let listener = http::bind("127.0.0.1:0".parse().expect("an address")).await.expect("bind loopback");
    let addr = listener.local_addr().expect("bound address");
    let metrics = Metrics::new("9.9.9-test");
    let readiness = Readiness::new();
    let endpoints =
        Endpoints { metrics: metrics.clone(), readiness: readiness.clone(), state, exposure: Exposure::default() };
    let (stop, stopped) = watch::channel(false);
    let task = tokio::spawn(http::serve(listener, endpoints, stopped));
    Server { addr, metrics, readiness, stop, task }
}

async fn start() -> Server {
    start_with(Arc::new(|w| serde_json::to_writer(w, &serde_json::json!({})))).await
}

impl Server {
    async fn shutdown(self) {
        self.stop.send(true).expect("server still listening for stop");
        tokio::time::timeout(WAIT, self.task).await.expect("server stops promptly").expect("server task");
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: HashMap<String, String>,
    body: String,
}

/// Sends raw bytes and reads one reply: its head, then Content-Length bytes
/// (the connection may stay open: HTTP/1.1 keep-alive).
async fn exchange(addr: SocketAddr, request: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("send request");
    let raw = tokio::time::timeout(WAIT, read_one_reply(&mut stream, request.starts_with(b"HEAD ")))
        .await
        .expect("reply within the timeout");
    parse_reply(&raw, request.starts_with(b"HEAD "))
}

/// The bytes of one reply on `stream`.
async fn read_one_reply(stream: &mut TcpStream, to_head: bool) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4) {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().expect("numeric Content-Length"));
            if to_head || raw.len() >= end + length {
                return raw;
            }
        }
        let n = stream.read(&mut chunk).await.expect("read reply");
        assert!(n > 0, "connection closed mid-reply after {:?}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&chunk[..n]);
    }
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    exchange(addr, format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes()).await
}

/// A reply to HEAD announces the length of the GET body but carries none.
fn parse_reply(raw: &[u8], to_head: bool) -> Reply {
    let text = String::from_utf8(raw.to_vec()).expect("utf-8 reply");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no end of head in {text:?}"));
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("a status line");
    let mut parts = status_line.splitn(3, ' ');
    assert!(parts.next().is_some_and(|v| v == "HTTP/1.1" || v == "HTTP/1.0"), "{status_line}");
    let status = parts.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("status in {status_line}"));
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap_or_else(|| panic!("header {l:?}"));
            (k.to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect::<HashMap<_, _>>();
    let length: usize = headers["content-length"].parse().expect("numeric Content-Length");
    assert_eq!(body.len(), if to_head { 0 } else { length }, "Content-Length matches the body");
    Reply { status, headers, body: body.to_owned() }
}

/// One sample of the exposition.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Families (name -> (help, type)) and samples of a text exposition,
/// checked line by line against the Prometheus text format.
#[derive(Debug, Default)]
struct Exposition {
    families: HashMap<String, (String, String)>,
    samples: Vec<Sample>,
}

impl Exposition {
    fn parse(text: &str) -> Self {
        let mut out = Self::default();
        let mut helps = HashMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or_else(|| panic!("HELP {line}"));
                assert!(helps.insert(name.to_owned(), help.to_owned()).is_none(), "duplicate HELP {name}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("TYPE {line}"));
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                    "classic type for {name}: {kind}"
                );
                let help = helps.get(name).unwrap_or_else(|| panic!("TYPE {name} without HELP before it")).clone();
                out.families.insert(name.to_owned(), (help, kind.to_owned()));
            } else if line.starts_with('#') {
                panic!("unexpected comment line {line:?}");
            } else {
                out.samples.push(parse_sample(line));
            }
        }
        for s in &out.samples {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| s.name.strip_suffix(suffix).filter(|base| out.families.contains_key(*base)))
                .unwrap_or(&s.name);
            assert!(out.families.contains_key(family), "sample {} has no TYPE line", s.name);
        }
        out
    }

    fn kind(&self, family: &str) -> &str {
        &self.families.get(family).unwrap_or_else(|| panic!("no family {family} in {:?}", self.families.keys())).1
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        self.samples
            .iter()
            .find(|s| s.name == name && s.labels == want)
            .unwrap_or_else(|| panic!("no sample {name}{want:?} in {:#?}", self.samples))
            .value
    }
}

fn parse_sample(line: &str) -> Sample {
    let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("sample {line:?}"));
    let value = match value {
        "+Inf" => f64::INFINITY,
        v => v.parse().unwrap_or_else(|_| panic!("value in {line:?}")),
    };
    let (name, labels) = match series.split_once('{') {
        None => (series, BTreeMap::new()),
        Some((name, rest)) => {
            let inner = rest.strip_suffix('}').unwrap_or_else(|| panic!("labels in {line:?}"));
            let labels = inner
                .split(',')
                .filter(|p| !p.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("label {pair:?}"));
                    let v =
                        v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or_else(|| panic!("quoted {v}"));
                    (k.to_owned(), v.to_owned())
                })
                .collect();
            (name, labels)
        }
    };
    assert!(
        name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') && name.starts_with("netreap_"),
        "metric name {name:?}"
    );
    Sample { name: name.to_owned(), labels, value }
}

#[tokio::test(flavor = "current_thread")]
async fn metrics_are_scraped_and_parse_after_updates() {
    let server = start().await;
    // Unlabelled metrics are there from the start; labelled families appear
    // with their first series.
    let before = Exposition::parse(&get(server.addr, "/metrics").await.body);
    let unlabelled = [
        ("netreap_conflicts_total", "counter"),
        ("netreap_netns_alive", "gauge"),
        ("netreap_netns_destroyed_total", "counter"),
        ("netreap_ringbuf_drops_total", "counter"),
        ("netreap_netns_death_to_release_seconds", "histogram"),
        ("netreap_build_info", "gauge"),
    ];
    let labelled = [
        ("netreap_reservations", "gauge"),
        ("netreap_releases_total", "counter"),
        ("netreap_cni_operations_total", "counter"),
        ("netreap_resyncs_total", "counter"),
    ];
    for (family, kind) in unlabelled {
        assert_eq!(before.kind(family), kind, "{family}");
    }
    assert!((before.value("netreap_build_info", &[("version", "9.9.9-test")]) - 1.0).abs() < f64::EPSILON);
    assert!(before.value("netreap_conflicts_total", &[]).abs() < f64::EPSILON);

    let m = &server.metrics;
    m.set_reservations("podnet", "in_use", 12);
    m.set_reservations("podnet", "orphaned", 2);
    m.release("netns_died", "released");
    m.release("netns_died", "released");
    m.release("orphan_grace", "dry_run");
    m.conflict();
    m.set_netns_alive(40);
    m.netns_destroyed();
    m.cni_operation("ADD", "ok");
    m.cni_operation("DEL", "error");
    m.ringbuf_drops(7);
    m.resync("netlink");
    for ms in [2, 40, 90_000] {
        m.observe_death_to_release(Duration::from_millis(ms));
    }

    let reply = get(server.addr, "/metrics").await;
    assert_eq!(reply.status, 200);
    assert!(reply.headers["content-type"].starts_with("text/plain; version=0.0.4"), "{:?}", reply.headers);
    let after = Exposition::parse(&reply.body);
    for (family, kind) in unlabelled.into_iter().chain(labelled) {
        assert_eq!(after.kind(family), kind, "{family}");
        assert!(!after.families[family].0.is_empty(), "{family} has help text");
    }
    let eq = |name: &str, labels: &[(&str, &str)], want: f64| {
        let got = after.value(name, labels);
        assert!((got - want).abs() < 1e-9, "{name}{labels:?} = {got}, want {want}");
    };
    eq("netreap_reservations", &[("network", "podnet"), ("verdict", "in_use")], 12.0);
    eq("netreap_reservations", &[("network", "podnet"), ("verdict", "orphaned")], 2.0);
    eq("netreap_releases_total", &[("reason", "netns_died"), ("outcome", "released")], 2.0);
    eq("netreap_releases_total", &[("reason", "orphan_grace"), ("outcome", "dry_run")], 1.0);
    eq("netreap_conflicts_total", &[], 1.0);
    eq("netreap_netns_alive", &[], 40.0);
    eq("netreap_netns_destroyed_total", &[], 1.0);
    eq("netreap_cni_operations_total", &[("command", "ADD"), ("result", "ok")], 1.0);
    eq("netreap_cni_operations_total", &[("command", "DEL"), ("result", "error")], 1.0);
    eq("netreap_ringbuf_drops_total", &[], 7.0);
    eq("netreap_resyncs_total", &[("source", "netlink")], 1.0);

    // Histogram: cumulative buckets, +Inf equals the count, sum in seconds.
    let h = "netreap_netns_death_to_release_seconds";
    eq(&format!("{h}_count"), &[], 3.0);
    eq(&format!("{h}_sum"), &[], 90.042);
    eq(&format!("{h}_bucket"), &[("le", "0.001")], 0.0);
    eq(&format!("{h}_bucket"), &[("le", "0.0025")], 1.0);
    eq(&format!("{h}_bucket"), &[("le", "0.05")], 2.0);
    eq(&format!("{h}_bucket"), &[("le", "60.0")], 2.0);
    eq(&format!("{h}_bucket"), &[("le", "+Inf")], 3.0);
    let buckets: Vec<f64> = after.samples.iter().filter(|s| s.name == format!("{h}_bucket")).map(|s| s.value).collect();
    assert_eq!(buckets.len(), 16, "15 bounds and +Inf");
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "cumulative: {buckets:?}");

    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn openmetrics_is_served_when_asked_for() {
    let server = start().await;
    server.metrics.release("netns_died", "released");
    let reply = exchange(
        server.addr,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
    )
    .await;
    assert_eq!(reply.status, 200);
    assert!(reply.headers["content-type"].starts_with("application/openmetrics-text"), "{:?}", reply.headers);
    assert!(reply.body.ends_with("# EOF\n"));
    assert!(reply.body.contains("# TYPE netreap_releases counter\n"), "{}", reply.body);
    assert!(reply.body.contains("netreap_releases_total{reason=\"netns_died\",outcome=\"released\"} 1\n"));
    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn readyz_turns_ready_after_the_first_reconcile_and_healthz_is_always_up() {
    let server = start().await;
    assert_eq!(get(server.addr, "/healthz").await.status, 200);
    let not_ready = get(server.addr, "/readyz").await;
    assert_eq!(not_ready.status, 503);
    assert!(not_ready.body.contains("not ready"), "{}", not_ready.body);
    server.readiness.mark_ready();
    let ready = get(server.addr, "/readyz").await;
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));
    assert_eq!(get(server.addr, "/healthz?verbose=1").await.status, 200, "query strings are ignored");
    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn state_serves_the_providers_json_fresh_on_each_request() {
    let calls = Arc::new(AtomicU64::new(0));
    let seen = calls.clone();
    let server = start_with(Arc::new(move |w| {
        let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
        let state = serde_json::json!({
            "netns_alive": 3, "reservations": [{ "ip": "10.22.0.5", "verdict": "in_use" }], "call": n
        });
        serde_json::to_writer(w, &state)
    }))
    .await;
    for want in 1..=2 {
        let reply = get(server.addr, "/state").await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.headers["content-type"], "application/json");
        let value: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON body");
        assert_eq!(value["reservations"][0]["ip"], "10.22.0.5");
        assert_eq!(value["call"], want);
    }
    server.shutdown().await;
}

/// /state through a client that decodes chunked bodies (the testkit's, as
/// the agent's tests read it).
async fn get_decoded(addr: SocketAddr) -> Option<(u16, String)> {
    tokio::task::spawn_blocking(move || netreap_testkit::agent::http_get_with(addr, "/state", &[], WAIT))
        .await
        .expect("the client thread")
}

#[tokio::test(flavor = "current_thread")]
async fn a_large_state_is_streamed_whole_and_one_cut_short_is_never_taken_for_whole() {
    let verdicts: Vec<String> =
        (0..50_000).map(|i| format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256)).collect();
    let doc = serde_json::json!({ "verdicts": verdicts });
    let expected = doc.clone();
    let server = start_with(Arc::new(move |w| serde_json::to_writer(w, &doc))).await;
    let (status, body) = get_decoded(server.addr).await.expect("a reply");
    assert_eq!(status, 200);
    assert!(body.len() > 4 * netreap::telemetry::state_stream::CHUNK_BYTES, "several chunks: {}", body.len());
    let value: serde_json::Value = serde_json::from_str(&body).expect("JSON body");
    assert_eq!(value, expected);
    server.shutdown().await;

    // Three chunks, then a failure: the connection is cut, no final chunk.
    let server = start_with(Arc::new(|w| {
        w.write_all(&vec![b' '; 3 * netreap::telemetry::state_stream::CHUNK_BYTES]).map_err(serde_json::Error::io)?;
        Err(serde::ser::Error::custom("cannot be encoded"))
    }))
    .await;
    assert_eq!(get_decoded(server.addr).await, None, "a document cut short reads as no answer");
    assert_eq!(get(server.addr, "/healthz").await.status, 200);
    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_panicking_state_provider_costs_one_500() {
    let server = start_with(Arc::new(|_| panic!("provider bug (expected by this test)"))).await;
    assert_eq!(get(server.addr, "/state").await.status, 500);
    assert_eq!(get(server.addr, "/healthz").await.status, 200);
    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn unknown_paths_are_404_and_other_methods_405() {
    let server = start().await;
    assert_eq!(get(server.addr, "/").await.status, 404);
    assert_eq!(get(server.addr, "/metrics/extra").await.status, 404);
    let post = exchange(server.addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc").await;
    assert_eq!(post.status, 405);
    assert_eq!(post.headers["allow"], "GET, HEAD");
    assert_eq!(exchange(server.addr, b"DELETE /state HTTP/1.1\r\n\r\n").await.status, 405);
    let head = exchange(server.addr, b"HEAD /healthz HTTP/1.0\r\n\r\n").await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "HEAD has no body");
    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn oversized_and_garbage_requests_do_not_hurt_the_server() {
    let server = start().await;

    // A head well over the limit: refused, answered, and the server lives.
    let mut huge = b"GET /metrics HTTP/1.1\r\n".to_vec();
    for i in 0..400 {
        huge.extend_from_slice(format!("X-Filler-{i}: {}\r\n", "a".repeat(40)).as_bytes());
    }
    huge.extend_from_slice(b"\r\n");
    assert!(huge.len() > 2 * http::MAX_REQUEST_HEAD);
    assert_eq!(exchange(server.addr, &huge).await.status, 431);

    for garbage in [
        &b"\x00\x01\x02\xff\xfe garbage\r\n\r\n"[..],
        b"hello\n\n",
        b"GET\r\n\r\n",
        b"GET http://example.com/metrics HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nbroken header line\r\n\r\n",
    ] {
        assert_eq!(exchange(server.addr, garbage).await.status, 400, "{:?}", String::from_utf8_lossy(garbage));
    }

    // Clients that vanish mid-request, or without a word.
    for partial in [&b""[..], b"GET /metr"] {
        let mut s = TcpStream::connect(server.addr).await.expect("loopback I/O");
        s.write_all(partial).await.expect("loopback I/O");
        drop(s);
    }
    // A client that half-closes after a partial head is closed, not left
    // hanging (hyper closes without a reply: the head never ended).
    let mut s = TcpStream::connect(server.addr).await.expect("loopback I/O");
    s.write_all(b"GET /healthz HTTP/1.1\r\n").await.expect("loopback I/O");
    s.shutdown().await.expect("loopback I/O");
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut raw)).await.expect("closed within the timeout").expect("read reply");
    assert!(raw.is_empty() || parse_reply(&raw, false).status == 400, "{:?}", String::from_utf8_lossy(&raw));

    assert_eq!(get(server.addr, "/healthz").await.status, 200, "still serving");
    server.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn shutdown_stops_accepting_even_with_idle_connections_open() {
    let server = start().await;
    let addr = server.addr;
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(addr).await.expect("loopback I/O"));
    }
    // Let the server accept them before stopping it.
    assert_eq!(get(addr, "/healthz").await.status, 200);
    server.shutdown().await;
    assert!(TcpStream::connect(addr).await.is_err(), "listener closed after shutdown");
    // The idle connections were closed by the server, not left hanging.
    for mut conn in idle {
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(WAIT, conn.read_to_end(&mut buf)).await.expect("closed promptly");
        assert!(buf.is_empty(), "no reply to a request never sent");
    }
}
