//! A tiny HTTP/1.1 server for /metrics, /healthz, /readyz and /state.
//!
//! Hand-written on tokio's `TcpListener` to keep the dependency tree lean:
//! the agent only ever answers small GETs from kubelet and Prometheus.
//! One request per connection (`Connection: close`); the request head is
//! bounded in size and time, connections are bounded in number, and nothing
//! a client sends can end the server.
//!
//! | path       | answer |
//! |------------|--------|
//! | `/metrics` | Prometheus text 0.0.4, or `OpenMetrics` when the `Accept` header asks for it |
//! | `/healthz` | 200 while the process runs |
//! | `/readyz`  | 503 until [`Readiness::mark_ready`] (after the first full reconcile), then 200 |
//! | `/state`   | 200 with the JSON of the [`StateProvider`] |
//!
//! Other paths are 404; methods other than GET and HEAD on these paths 405.

use std::{
    io,
    net::SocketAddr,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinSet,
    time::timeout,
};
use tracing::{debug, info, warn};

use super::metrics::{Metrics, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};

/// Default listen address: loopback, so a plain-host install exposes
/// nothing. The `DaemonSet`'s `ConfigMap` widens it for Prometheus scrapes.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9742";
/// Largest request head accepted (request line and headers); kubelet's and
/// Prometheus's requests are a few hundred bytes.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Time a client has to send its whole request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client has to take the whole response.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed at accept.
pub const MAX_CONNECTIONS: usize = 32;
/// After answering, unread request bytes are drained for at most this long
/// (and at most `LINGER_MAX_BYTES`) before closing: closing a socket with
/// unread input sends a RST that can destroy the response in flight.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_MAX_BYTES: usize = 64 * 1024;
/// Pause after a failed accept (e.g. EMFILE) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
}

/// Whether the agent is ready: false until the first full reconcile. Cheap
/// to clone; all clones share one flag.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Not ready.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// /readyz answers 200 from now on.
    pub fn mark_ready(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// /readyz answers 503 again (e.g. the agent lost its evidence and is
    /// resyncing from scratch).
    pub fn mark_not_ready(&self) {
        self.0.store(false, Ordering::Release);
    }

    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Produces the JSON served at /state; called once per request, on the
/// runtime's thread, so it must be quick (a snapshot of the model).
pub type StateProvider = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// What the server answers with.
#[derive(Clone)]
pub struct Endpoints {
    pub metrics: Metrics,
    pub readiness: Readiness,
    pub state: StateProvider,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints").field("readiness", &self.readiness).finish_non_exhaustive()
    }
}

/// Binds the listener. Separate from [`serve`] so a bad address fails at
/// start, and so tests can bind port 0 and learn the port.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, HttpError> {
    TcpListener::bind(addr).await.map_err(|source| HttpError::Bind { addr, source })
}

/// Serves until `shutdown` turns true (or its sender is dropped), then
/// stops accepting and aborts the connections still open. Runs on any
/// tokio runtime, `current_thread` included.
pub async fn serve(listener: TcpListener, endpoints: Endpoints, mut shutdown: watch::Receiver<bool>) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "http: serving /metrics /healthz /readyz /state");
    }
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stop_requested(&mut shutdown) => break,
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = done {
                    warn!("http: a connection task failed: {e}");
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if connections.len() >= MAX_CONNECTIONS {
                        debug!(%peer, "http: too many connections; closing this one");
                        continue;
                    }
                    let endpoints = endpoints.clone();
                    connections.spawn(async move { handle(stream, &endpoints).await });
                }
                Err(e) => {
                    warn!("http: accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
    }
    drop(listener);
    connections.shutdown().await;
    info!("http: stopped");
}

/// Resolves once `shutdown` holds true, or its sender is gone (nobody can
/// ever stop us then: stop now). Holds no borrow across the await, so the
/// server future stays `Send`.
async fn stop_requested(shutdown: &mut watch::Receiver<bool>) {
    loop {
        let stop = *shutdown.borrow_and_update();
        if stop || shutdown.changed().await.is_err() {
            return;
        }
    }
}

/// A parsed request head: only what routing needs.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    method: String,
    path: String,
    accept: Option<String>,
}

#[derive(Debug)]
enum HeadError {
    /// The peer closed before sending anything: nothing to answer.
    Empty,
    TooLarge,
    Malformed,
    Io,
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
    allow: bool,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Self { status, content_type: "text/plain; charset=utf-8", body: body.as_bytes().to_vec(), allow: false }
    }

    fn head_bytes(&self) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        if self.allow {
            head.push_str("Allow: GET, HEAD\r\n");
        }
        head.push_str("\r\n");
        head.into_bytes()
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

async fn handle(mut stream: TcpStream, endpoints: &Endpoints) {
    let (response, is_head) = match timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Err(_) => (Response::text(408, "request timeout\n"), false),
        Ok(Err(HeadError::Empty | HeadError::Io)) => return,
        Ok(Err(HeadError::TooLarge)) => (Response::text(431, "request head too large\n"), false),
        Ok(Err(HeadError::Malformed)) => (Response::text(400, "bad request\n"), false),
        Ok(Ok(request)) => (route(&request, endpoints), request.method == "HEAD"),
    };
    let mut bytes = response.head_bytes();
    if !is_head {
        bytes.extend_from_slice(&response.body);
    }
    let written = timeout(WRITE_TIMEOUT, async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        return;
    }
    let _ = timeout(LINGER, drain(&mut stream)).await;
}

/// Reads and discards input until EOF or `LINGER_MAX_BYTES`.
async fn drain(stream: &mut TcpStream) {
    let mut scratch = [0u8; 4096];
    let mut total = 0;
    while total < LINGER_MAX_BYTES {
        match stream.read(&mut scratch).await {
            Ok(0) | Err(_) => return,
            Ok(n) => total += n,
        }
    }
}

/// Reads up to the blank line that ends the head, never more than
/// `MAX_REQUEST_HEAD` bytes.
async fn read_head(stream: &mut TcpStream) -> Result<Request, HeadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await.map_err(|_| HeadError::Io)?;
        if n == 0 {
            return Err(if buf.is_empty() { HeadError::Empty } else { HeadError::Malformed });
        }
        // Only the new bytes (and 3 before them) can complete the terminator.
        let search_from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_head_end(&buf[search_from..]) {
            return parse_head(&buf[..search_from + end]);
        }
        if buf.len() >= MAX_REQUEST_HEAD {
            return Err(HeadError::TooLarge);
        }
    }
}

/// Index just past the terminating blank line (`\r\n\r\n`, or `\n\n` from a
/// lenient client).
fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
        .or_else(|| buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2))
}

fn parse_head(head: &[u8]) -> Result<Request, HeadError> {
    if head.len() > MAX_REQUEST_HEAD {
        return Err(HeadError::TooLarge);
    }
    let text = std::str::from_utf8(head).map_err(|_| HeadError::Malformed)?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let request_line = lines.next().ok_or(HeadError::Malformed)?;
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HeadError::Malformed);
    };
    let method_ok = !method.is_empty() && method.bytes().all(|b| b.is_ascii_uppercase());
    if !method_ok || !target.starts_with('/') || !version.starts_with("HTTP/1.") {
        return Err(HeadError::Malformed);
    }
    let mut accept = None;
    for line in lines.take_while(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':').ok_or(HeadError::Malformed)?;
        if name.eq_ignore_ascii_case("accept") {
            accept = Some(value.trim().to_owned());
        }
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    Ok(Request { method: method.to_owned(), path: path.to_owned(), accept })
}

fn route(request: &Request, endpoints: &Endpoints) -> Response {
    let known = matches!(request.path.as_str(), "/metrics" | "/healthz" | "/readyz" | "/state");
    if !known {
        return Response::text(404, "not found; try /metrics /healthz /readyz /state\n");
    }
    if request.method != "GET" && request.method != "HEAD" {
        return Response { allow: true, ..Response::text(405, "method not allowed; use GET\n") };
    }
    match request.path.as_str() {
        "/metrics" => {
            let wants_openmetrics =
                request.accept.as_deref().is_some_and(|a| a.contains("application/openmetrics-text"));
            let (content_type, body) = if wants_openmetrics {
                (OPENMETRICS_CONTENT_TYPE, endpoints.metrics.encode_openmetrics())
            } else {
                (PROMETHEUS_CONTENT_TYPE, endpoints.metrics.encode())
            };
            Response { status: 200, content_type, body: body.into_bytes(), allow: false }
        }
        "/healthz" => Response::text(200, "ok\n"),
        "/readyz" => {
            if endpoints.readiness.is_ready() {
                Response::text(200, "ready\n")
            } else {
                Response::text(503, "not ready: the first full reconcile has not finished\n")
            }
        }
        _ => state(endpoints),
    }
}

fn state(endpoints: &Endpoints) -> Response {
    // A panicking provider is a bug in the agent, but it must cost one 500,
    // not the connection task and a confusing empty reply.
    let Ok(value) = catch_unwind(AssertUnwindSafe(|| (endpoints.state)())) else {
        return Response::text(500, "the state provider panicked\n");
    };
    match serde_json::to_vec(&value) {
        Ok(mut body) => {
            body.push(b'\n');
            Response { status: 200, content_type: "application/json", body, allow: false }
        }
        Err(e) => Response::text(500, &format!("encoding the state: {e}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_request_head() {
        let head = b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\naccept: application/openmetrics-text\r\n\r\n";
        let end = find_head_end(head).expect("a well-formed head");
        assert_eq!(end, head.len());
        let req = parse_head(&head[..end]).expect("a well-formed head");
        assert_eq!(
            req,
            Request {
                method: "GET".into(),
                path: "/metrics".into(),
                accept: Some("application/openmetrics-text".into())
            }
        );
    }

    #[test]
    fn refuses_malformed_request_lines() {
        for bad in [
            &b"\r\n\r\n"[..],
            b"GET\r\n\r\n",
            b"get / HTTP/1.1\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET / SPDY/3\r\n\r\n",
            b"GET / HTTP/1.1 extra\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
        ] {
            assert!(matches!(parse_head(bad), Err(HeadError::Malformed)), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn readiness_is_shared_between_clones() {
        let r = Readiness::new();
        let seen = r.clone();
        assert!(!seen.is_ready());
        r.mark_ready();
        assert!(seen.is_ready());
        r.mark_not_ready();
        assert!(!seen.is_ready());
    }
}
