//! The HTTP server for /metrics, /healthz, /readyz and /state, on hyper 1
//! (HTTP/1.1, keep-alive) and the agent's tokio runtime.
//!
//! | path       | answer |
//! |------------|--------|
//! | `/metrics` | Prometheus text 0.0.4, or `OpenMetrics` when the `Accept` header asks for it |
//! | `/healthz` | 200 while the process runs |
//! | `/readyz`  | 503 until [`Readiness::mark_ready`] (after the first full reconcile), then 200 |
//! | `/state`   | 200 with the JSON of the [`StateProvider`] |
//!
//! Other paths are 404; methods other than GET and HEAD on these paths 405.
//!
//! Who may ask what: /healthz and /readyz answer anyone (kubelet probes the
//! node's address when the pod has hostNetwork). /metrics and /state answer
//! loopback clients only, unless [`Exposure`] opens them: /state lists every
//! pod IP and container of the node, /metrics is for a configured scraper.
//!
//! What a client can hold: a request head is bounded in size
//! ([`MAX_REQUEST_HEAD`]) and time ([`HEADER_TIMEOUT`], which also closes
//! keep-alive connections idle that long); a connection lives at most
//! [`MAX_CONNECTION_AGE`]; at most [`MAX_CONNECTIONS`] are open. When the
//! table is full, a new connection evicts the oldest one that has no request
//! being answered, so idle connections can never starve a health probe.
//! /metrics is bounded by [`MAX_RESPONSE_BYTES`]; /state is rendered on the
//! blocking pool, never on the thread that serves events, and streamed in
//! chunks as it is rendered ([`super::state_stream`]), at most
//! [`MAX_STATE_RENDERS`] at once.

use std::{
    collections::HashMap,
    convert::Infallible,
    io,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::{
    Method, Request, Response, StatusCode,
    body::Incoming,
    header::{self, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{Semaphore, watch},
    task::{AbortHandle, JoinSet},
};
use tracing::{debug, info, warn};

use super::{
    metrics::{Metrics, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE},
    state_stream::{self, Started, StateBody},
};

/// Default listen address: loopback, so a plain-host install exposes
/// nothing. The `DaemonSet`'s `ConfigMap` widens it for kubelet and Prometheus.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9742";
/// Largest request head accepted (request line and headers); kubelet's and
/// Prometheus's requests are a few hundred bytes. hyper answers 431 beyond.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Time a client has to send a whole request head, counted from the
/// connection's start or the end of the previous response: a keep-alive
/// connection idle this long is closed.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection is asked to close after this long (the response in flight
/// is finished, within [`CLOSE_GRACE`]); a keep-alive scraper reconnects.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_mins(1);
/// Time a connection asked to close has to finish its response.
pub const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// Connections open at once. When full, the oldest connection not being
/// answered is closed to make room; if all are being answered, the new one is.
pub const MAX_CONNECTIONS: usize = 256;
/// Largest /metrics exposition; past it, 503. (/state is streamed: its
/// size costs no memory.)
pub const MAX_RESPONSE_BYTES: usize = 32 * 1024 * 1024;
/// /state renderings at once (each on the blocking pool, for as long as its
/// response is being sent); more get 503.
pub const MAX_STATE_RENDERS: usize = 2;
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

/// Writes the JSON served at /state into the writer it is given; called
/// once per request on tokio's blocking pool (so it may take a lock and
/// copy), never on the event thread. It serializes straight into the
/// response, which is sent in chunks as they are written: a
/// `serde_json::Value` of the whole state first, then the whole document in
/// one buffer, were the agent's peak memory (issue 13).
pub type StateProvider = Arc<dyn Fn(&mut dyn io::Write) -> serde_json::Result<()> + Send + Sync>;

/// Which endpoints answer clients beyond loopback (config keys
/// `expose_metrics`, `expose_state`). /healthz and /readyz always do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exposure {
    pub metrics: bool,
    pub state: bool,
}

/// What the server answers with.
#[derive(Clone)]
pub struct Endpoints {
    pub metrics: Metrics,
    pub readiness: Readiness,
    pub state: StateProvider,
    pub exposure: Exposure,
}

impl std::fmt::Debug for Endpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoints")
            .field("readiness", &self.readiness)
            .field("exposure", &self.exposure)
            .finish_non_exhaustive()
    }
}

/// Binds the listener. Separate from [`serve`] so a bad address fails at
/// start, and so tests can bind port 0 and learn the port.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, HttpError> {
    TcpListener::bind(addr).await.map_err(|source| HttpError::Bind { addr, source })
}

/// Shared by every connection.
struct Shared {
    endpoints: Endpoints,
    state_renders: Arc<Semaphore>,
}

/// An open connection in the table.
struct Open {
    since: Instant,
    /// A request of it is being answered (the service is running).
    busy: Arc<AtomicBool>,
    abort: AbortHandle,
}

/// Serves until `shutdown` turns true (or its sender is dropped), then
/// stops accepting and aborts the connections still open. Runs on any
/// tokio runtime, `current_thread` included.
pub async fn serve(listener: TcpListener, endpoints: Endpoints, mut shutdown: watch::Receiver<bool>) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, exposure = ?endpoints.exposure, "http: serving /metrics /healthz /readyz /state");
    }
    let shared = Arc::new(Shared { endpoints, state_renders: Arc::new(Semaphore::new(MAX_STATE_RENDERS)) });
    let mut connections = JoinSet::new();
    let mut open: HashMap<tokio::task::Id, Open> = HashMap::new();
    loop {
        tokio::select! {
            () = stop_requested(&mut shutdown) => break,
            Some(done) = connections.join_next_with_id(), if !connections.is_empty() => match done {
                Ok((id, ())) => { open.remove(&id); }
                Err(e) => {
                    open.remove(&e.id());
                    if e.is_panic() {
                        warn!("http: a connection task panicked: {e}");
                    }
                }
            },
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if open.len() >= MAX_CONNECTIONS && !evict_oldest_idle(&mut open) {
                        debug!(%peer, "http: every connection is being answered; closing this one");
                        continue;
                    }
                    let busy = Arc::new(AtomicBool::new(false));
                    let task = connection(stream, peer, Arc::clone(&shared), Arc::clone(&busy));
                    let abort = connections.spawn(task);
                    open.insert(abort.id(), Open { since: Instant::now(), busy, abort });
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

/// Closes the oldest connection with no request being answered (idle
/// keep-alive, or a head still arriving). False when every one is busy.
fn evict_oldest_idle(open: &mut HashMap<tokio::task::Id, Open>) -> bool {
    let oldest =
        open.iter().filter(|(_, c)| !c.busy.load(Ordering::Acquire)).min_by_key(|(_, c)| c.since).map(|(id, _)| *id);
    let Some(id) = oldest else { return false };
    if let Some(conn) = open.remove(&id) {
        conn.abort.abort();
        debug!("http: connection table full; closed the oldest idle connection");
    }
    true
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

/// One connection: HTTP/1.1 with keep-alive, under the head timeout and the
/// connection's age limit.
async fn connection(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>, busy: Arc<AtomicBool>) {
    let service = service_fn(move |request| {
        let (shared, busy) = (Arc::clone(&shared), Arc::clone(&busy));
        async move {
            busy.store(true, Ordering::Release);
            let mut response = respond(&request, peer, &shared).await;
            match response.body_mut() {
                // Busy until the whole document is sent.
                Either::Right(streamed) => streamed.hold_busy(Arc::clone(&busy)),
                Either::Left(_) => busy.store(false, Ordering::Release),
            }
            Ok::<_, Infallible>(response)
        }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_REQUEST_HEAD)
        .max_header_size(MAX_REQUEST_HEAD);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                debug!(%peer, "http: connection ended: {e}");
            }
            return;
        }
        () = tokio::time::sleep(MAX_CONNECTION_AGE) => conn.as_mut().graceful_shutdown(),
    }
    let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
}

/// Content negotiation for /metrics: `OpenMetrics` when the `Accept`
/// headers rank it at least as high as the text format (`text/plain`, or a
/// wildcard), by their q-values. No header, or only types we do not serve,
/// gets the text format (a 200 is more useful to a scraper than a 406).
fn prefers_openmetrics<'a>(accept: impl Iterator<Item = &'a str>) -> bool {
    let (mut openmetrics, mut text) = (0.0_f32, 0.0_f32);
    for range in accept.flat_map(|h| h.split(',')) {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("").to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(1.0, |(_, v)| v.trim().parse::<f32>().unwrap_or(0.0));
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

fn is_local(peer: IpAddr) -> bool {
    match peer {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    body_response(status, "text/plain; charset=utf-8", Bytes::from(body.into()))
}

fn body_response(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A whole body, or /state's streamed one.
type ResponseBody = Either<Full<Bytes>, StateBody>;

async fn respond(request: &Request<Incoming>, peer: SocketAddr, shared: &Shared) -> Response<ResponseBody> {
    match answer(request, peer, &shared.endpoints) {
        Some(plain) => plain.map(Either::Left),
        None => state(shared).await,
    }
}

/// The answer to anything but a /state that is allowed (None).
fn answer(request: &Request<Incoming>, peer: SocketAddr, endpoints: &Endpoints) -> Option<Response<Full<Bytes>>> {
    // Absolute-form targets are for proxies; this is not one.
    if request.uri().scheme().is_some() || request.uri().authority().is_some() {
        return Some(text(StatusCode::BAD_REQUEST, "bad request: absolute-form target\n"));
    }
    let path = request.uri().path();
    if !matches!(path, "/metrics" | "/healthz" | "/readyz" | "/state") {
        return Some(text(StatusCode::NOT_FOUND, "not found; try /metrics /healthz /readyz /state\n"));
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed; use GET\n");
        response.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Some(response);
    }
    let local = is_local(peer.ip());
    Some(match path {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" if endpoints.readiness.is_ready() => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready: the first full reconcile has not finished\n"),
        "/metrics" if !local && !endpoints.exposure.metrics => text(
            StatusCode::FORBIDDEN,
            "/metrics answers loopback clients only; set expose_metrics = true to serve it beyond\n",
        ),
        "/metrics" => {
            let wants_openmetrics =
                prefers_openmetrics(request.headers().get_all(header::ACCEPT).iter().filter_map(|v| v.to_str().ok()));
            let (content_type, body) = if wants_openmetrics {
                (OPENMETRICS_CONTENT_TYPE, endpoints.metrics.encode_openmetrics())
            } else {
                (PROMETHEUS_CONTENT_TYPE, endpoints.metrics.encode())
            };
            if body.len() > MAX_RESPONSE_BYTES {
                return Some(text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "metrics exposition over the response size limit\n",
                ));
            }
            body_response(StatusCode::OK, content_type, Bytes::from(body))
        }
        _ if !local && !endpoints.exposure.state => text(
            StatusCode::FORBIDDEN,
            "/state lists every pod IP of the node and answers loopback clients only; set expose_state = true to serve it beyond\n",
        ),
        _ => return None,
    })
}

/// /state: rendered on the blocking pool and streamed, at most
/// [`MAX_STATE_RENDERS`] at once.
async fn state(shared: &Shared) -> Response<ResponseBody> {
    let Ok(permit) = Arc::clone(&shared.state_renders).try_acquire_owned() else {
        return text(StatusCode::SERVICE_UNAVAILABLE, "busy rendering /state; retry\n").map(Either::Left);
    };
    match state_stream::start(Arc::clone(&shared.endpoints.state), permit).await {
        Started::Whole(doc) => body_response(StatusCode::OK, "application/json", doc).map(Either::Left),
        Started::Streaming(body) => {
            let mut response = Response::new(Either::Right(body));
            let headers = response.headers_mut();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        Started::Failed(reason) => text(StatusCode::INTERNAL_SERVER_ERROR, reason).map(Either::Left),
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

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

    #[test]
    fn loopback_peers_are_local_and_others_are_not() {
        assert!(is_local(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        assert!(is_local(IpAddr::V4(Ipv4Addr::new(127, 9, 9, 9))));
        assert!(is_local(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        assert!(is_local(IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())));
        assert!(!is_local(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))));
        assert!(!is_local(IpAddr::V6(Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped())));
    }

    #[test]
    fn negotiation_follows_q_values() {
        let prefers = |headers: &[&str]| prefers_openmetrics(headers.iter().copied());
        assert!(!prefers(&[]), "no Accept: text");
        assert!(!prefers(&["*/*"]));
        assert!(!prefers(&["text/plain"]));
        assert!(prefers(&["application/openmetrics-text"]));
        // Prometheus 2.x's own header.
        assert!(prefers(&[
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ]));
        assert!(!prefers(&["text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5"]));
        assert!(!prefers(&["application/openmetrics-text;q=0"]), "q=0 means not acceptable");
        assert!(prefers(&["text/plain;q=0.2", "Application/OpenMetrics-Text; q=0.3"]), "several headers, any case");
        assert!(!prefers(&["application/json"]), "unknown only: text");
    }
}
