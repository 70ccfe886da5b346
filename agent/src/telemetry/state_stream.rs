//! /state, streamed: the document is rendered on tokio's blocking pool into
//! chunks of [`CHUNK_BYTES`] that go out as they are made, so the node's
//! whole state (about 8 MB at 1,000 pods) is never held at once. Held as one
//! buffer, it was the agent's peak memory in the 1,000-netns burst (issue 13).
//!
//! A response is never cut silently: a document that stops before its end
//! (the provider failed, the client stalled) ends the body with an error, so
//! hyper aborts the connection instead of sending the final empty chunk that
//! would make a truncated document look whole. A document that fits in one
//! chunk is sent whole, with its length, as before; a failure before the
//! second chunk is still an ordinary 500 with its reason.

use std::{
    collections::VecDeque,
    io,
    panic::{AssertUnwindSafe, catch_unwind},
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::{
    runtime::Handle,
    sync::{OwnedSemaphorePermit, mpsc},
};

use super::http::StateProvider;

/// Bytes per chunk sent. A single write of the provider larger than this
/// (one huge string) is buffered whole before it is split.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// Chunks rendered ahead of the client.
const CHUNKS_AHEAD: usize = 2;
/// A client that takes no chunk for this long ends the rendering (and its
/// response, with an error): a stalled reader must not hold a render slot
/// and a copy of the state for ever.
pub const STALL_LIMIT: Duration = Duration::from_secs(30);

/// What the rendering thread sends to the body.
#[derive(Debug)]
enum Piece {
    Chunk(Bytes),
    /// The document ended after the chunks sent.
    End,
    /// The document cannot be finished (before any chunk: a 500).
    Failed(String),
}

/// How a rendering began.
#[derive(Debug)]
pub enum Started {
    /// The whole document, in one chunk: answer 200 with it.
    Whole(Bytes),
    /// Two chunks are ready: answer 200 with this body.
    Streaming(StateBody),
    /// It failed before its second chunk: answer 500 with this reason.
    Failed(String),
}

/// Starts rendering the document on the blocking pool; `permit` is held
/// until the rendering ends (a bound on renderings at once).
pub async fn start(provider: StateProvider, permit: OwnedSemaphorePermit) -> Started {
    let (tx, mut rx) = mpsc::channel(CHUNKS_AHEAD);
    let runtime = Handle::current();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        render(&provider, ChunkWriter { buf: Vec::new(), tx, runtime });
    });
    let stopped = || Started::Failed("the state rendering stopped before the end of the document\n".to_owned());
    let first = match rx.recv().await {
        Some(Piece::Chunk(first)) => first,
        Some(Piece::End) => return Started::Whole(Bytes::new()),
        Some(Piece::Failed(reason)) => return Started::Failed(reason),
        None => return stopped(),
    };
    match rx.recv().await {
        Some(Piece::Chunk(second)) => {
            Started::Streaming(StateBody { queued: VecDeque::from([first, second]), rx, busy: None, ended: false })
        }
        Some(Piece::End) => Started::Whole(first),
        Some(Piece::Failed(reason)) => Started::Failed(reason),
        None => stopped(),
    }
}

/// Runs the provider into `out`, then sends how it ended.
fn render(provider: &StateProvider, mut out: ChunkWriter) {
    // A panicking provider is a bug in the agent, but it must cost one 500
    // (or one aborted response), not the process.
    let end = match catch_unwind(AssertUnwindSafe(|| provider(&mut out))) {
        Err(_) => Piece::Failed("the state provider panicked\n".to_owned()),
        // The client went away or stalled: nobody to tell.
        Ok(Err(e)) if e.is_io() => return,
        Ok(Err(e)) => Piece::Failed(format!("encoding the state: {e}\n")),
        Ok(Ok(())) => {
            out.buf.push(b'\n');
            let rest = std::mem::take(&mut out.buf);
            if out.send(Piece::Chunk(Bytes::from(rest))).is_err() {
                return;
            }
            Piece::End
        }
    };
    let _ = out.send(end);
}

/// Collects the provider's writes and sends them in chunks.
struct ChunkWriter {
    buf: Vec<u8>,
    tx: mpsc::Sender<Piece>,
    runtime: Handle,
}

impl ChunkWriter {
    /// Sends one piece, waiting at most [`STALL_LIMIT`] for room.
    fn send(&self, piece: Piece) -> io::Result<()> {
        // On the blocking pool, so waiting on the runtime here is allowed.
        self.runtime.block_on(async {
            match tokio::time::timeout(STALL_LIMIT, self.tx.send(piece)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(io::Error::new(io::ErrorKind::BrokenPipe, "the client went away")),
                Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "the client took no data for 30 s")),
            }
        })
    }
}

impl io::Write for ChunkWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        while self.buf.len() >= CHUNK_BYTES {
            let rest = self.buf.split_off(CHUNK_BYTES);
            let chunk = std::mem::replace(&mut self.buf, rest);
            self.send(Piece::Chunk(Bytes::from(chunk)))?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The body of a streamed /state response.
#[derive(Debug)]
pub struct StateBody {
    /// Chunks received before the response began.
    queued: VecDeque<Bytes>,
    rx: mpsc::Receiver<Piece>,
    /// The connection's "a request is being answered" flag, cleared when the
    /// body is done or dropped (so a streaming response is never evicted as
    /// an idle connection).
    busy: Option<Arc<AtomicBool>>,
    ended: bool,
}

impl StateBody {
    /// Keeps `busy` set until this body is done.
    pub fn hold_busy(&mut self, busy: Arc<AtomicBool>) {
        self.busy = Some(busy);
    }

    fn release_busy(&mut self) {
        if let Some(busy) = self.busy.take() {
            busy.store(false, Ordering::Release);
        }
    }
}

impl Drop for StateBody {
    fn drop(&mut self) {
        self.release_busy();
    }
}

impl Body for StateBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if let Some(chunk) = self.queued.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if self.ended {
            self.release_busy();
            return Poll::Ready(None);
        }
        let next = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(next) => next,
        };
        Poll::Ready(match next {
            Some(Piece::Chunk(chunk)) => Some(Ok(Frame::data(chunk))),
            Some(Piece::End) => {
                self.ended = true;
                self.release_busy();
                None
            }
            Some(Piece::Failed(reason)) => {
                self.release_busy();
                Some(Err(io::Error::other(reason.trim_end().to_owned())))
            }
            None => {
                self.release_busy();
                Some(Err(io::Error::other("the state rendering stopped before the end of the document")))
            }
        })
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.queued.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body_util::BodyExt as _;
    use tokio::sync::Semaphore;

    use super::*;

    async fn begin(provider: StateProvider) -> (Started, Arc<Semaphore>) {
        let slots = Arc::new(Semaphore::new(1));
        let permit = Arc::clone(&slots).try_acquire_owned().expect("a slot");
        (start(provider, permit).await, slots)
    }

    /// Every frame of the body, or the error that ended it.
    async fn frames(mut body: StateBody) -> (Vec<Bytes>, Option<io::Error>) {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => out.extend(f.into_data().ok()),
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    #[tokio::test]
    async fn a_large_document_goes_out_whole_in_bounded_chunks() {
        let doc = serde_json::json!({ "verdicts": (0..40_000).map(|i| format!("10.0.{i}")).collect::<Vec<_>>() });
        let expected = format!("{doc}\n");
        assert!(expected.len() > 4 * CHUNK_BYTES);
        let (started, slots) = begin(Arc::new(move |w| serde_json::to_writer(w, &doc))).await;
        let Started::Streaming(body) = started else { panic!("not streaming") };
        let (chunks, error) = frames(body).await;
        assert!(error.is_none(), "{error:?}");
        assert!(chunks.len() > 4 && chunks.iter().all(|c| c.len() <= CHUNK_BYTES), "chunk sizes");
        assert_eq!(chunks.concat(), expected.as_bytes());
        // The slot comes back when the rendering ends.
        assert!(tokio::time::timeout(Duration::from_secs(5), slots.acquire()).await.is_ok());
    }

    #[tokio::test]
    async fn a_small_document_is_sent_whole() {
        let (started, _) = begin(Arc::new(|w| serde_json::to_writer(w, &serde_json::json!({ "ok": true })))).await;
        let Started::Whole(doc) = started else { panic!("not whole: {started:?}") };
        assert_eq!(doc, &b"{\"ok\":true}\n"[..]);
    }

    #[tokio::test]
    async fn a_failure_before_the_first_chunk_is_a_reason_not_a_body() {
        let (started, _) = begin(Arc::new(|_| panic!("bug"))).await;
        assert!(matches!(started, Started::Failed(ref r) if r.contains("panicked")), "{started:?}");
    }

    /// A provider that writes `chunks` full chunks, then fails.
    fn failing_after(chunks: usize) -> StateProvider {
        Arc::new(move |w| {
            for _ in 0..chunks {
                w.write_all(&vec![b' '; CHUNK_BYTES]).map_err(serde_json::Error::io)?;
            }
            Err(serde::ser::Error::custom("a value that cannot be encoded"))
        })
    }

    #[tokio::test]
    async fn a_document_cut_short_ends_in_an_error_never_a_clean_end() {
        let (started, _) = begin(failing_after(1)).await;
        assert!(matches!(started, Started::Failed(ref r) if r.contains("cannot be encoded")), "{started:?}");
        let (started, _) = begin(failing_after(3)).await;
        let Started::Streaming(body) = started else { panic!("not streaming") };
        let (chunks, error) = frames(body).await;
        assert_eq!(chunks.len(), 3);
        let error = error.expect("the body ends in an error");
        assert!(error.to_string().contains("cannot be encoded"), "{error}");
    }

    #[tokio::test]
    async fn a_client_that_goes_away_stops_the_rendering_and_frees_its_slot() {
        let (started, slots) = begin(Arc::new(|w| {
            // Endless: only the client's departure ends it.
            loop {
                w.write_all(&[b' '; 4096]).map_err(serde_json::Error::io)?;
            }
        }))
        .await;
        let Started::Streaming(body) = started else { panic!("not streaming") };
        drop(body);
        assert!(
            tokio::time::timeout(Duration::from_secs(5), slots.acquire()).await.is_ok(),
            "the rendering did not stop"
        );
    }

    #[tokio::test]
    async fn the_busy_flag_is_held_until_the_body_is_done() {
        let (started, _) =
            begin(Arc::new(|w| w.write_all(&vec![b' '; 3 * CHUNK_BYTES]).map_err(serde_json::Error::io))).await;
        let Started::Streaming(mut body) = started else { panic!("not streaming") };
        let busy = Arc::new(AtomicBool::new(true));
        body.hold_busy(Arc::clone(&busy));
        for _ in 0..4 {
            assert!(body.frame().await.is_some_and(|f| f.is_ok()));
            assert!(busy.load(Ordering::Acquire), "still streaming");
        }
        assert!(body.frame().await.is_none(), "three chunks and the newline");
        assert!(!busy.load(Ordering::Acquire));
    }
}
