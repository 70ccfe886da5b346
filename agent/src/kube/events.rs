//! Kubernetes Events (events.k8s.io/v1) people can see with `kubectl
//! describe`: on the Pod whose leaked IP was released (when the pod is
//! known), else on the Node; on conflicts; on stuck sandboxes.
//!
//! Like kubelet: the same event on the same object within minutes becomes a
//! series (one Event whose `series.count` grows, kube-runtime's `Recorder`),
//! and each object has a token bucket (burst 25, one more every 5 minutes,
//! kubelet's spam filter) so a storm cannot flood the API. Events are sent
//! from their own task through a bounded queue: a slow or absent API never
//! delays a reconcile, and a full queue drops (and counts) events.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;

/// kubelet's spam filter: 25 events at once per object, then one per 5 min.
pub const BURST: u32 = 25;
pub const REFILL_EVERY: Duration = Duration::from_mins(5);
/// Events waiting to be sent; past it they are dropped.
const QUEUE: usize = 256;
/// The reporting controller's name on every event.
pub const CONTROLLER: &str = "netreap.io/agent";

/// What the Event is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Regarding {
    Pod { namespace: String, name: String },
    Node { name: String },
}

impl Regarding {
    fn object_ref(&self) -> ObjectReference {
        match self {
            Self::Pod { namespace, name } => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(namespace.clone()),
                name: Some(name.clone()),
                ..ObjectReference::default()
            },
            Self::Node { name } => ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(name.clone()),
                ..ObjectReference::default()
            },
        }
    }
}

/// One Event to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub regarding: Regarding,
    pub warning: bool,
    /// CamelCase reason: `LeakedIPReleased`, `IPConflict`, `SandboxStuck`.
    pub reason: String,
    /// What netreap did: `Release`, `Report`.
    pub action: String,
    pub note: String,
}

/// Per-object token buckets (kubelet's `EventSourceObjectSpamFilter`).
#[derive(Debug)]
pub struct SpamFilter {
    burst: u32,
    refill_every: Duration,
    buckets: HashMap<Regarding, (u32, Instant)>,
}

impl SpamFilter {
    #[must_use]
    pub fn new(burst: u32, refill_every: Duration) -> Self {
        Self { burst, refill_every, buckets: HashMap::new() }
    }

    /// Whether an event on `object` may go out at `now` (takes a token).
    pub fn allow(&mut self, object: &Regarding, now: Instant) -> bool {
        let (burst, every) = (self.burst, self.refill_every);
        let (tokens, last) = self.buckets.entry(object.clone()).or_insert((burst, now));
        let earned = now.saturating_duration_since(*last).as_secs() / every.as_secs().max(1);
        if earned > 0 {
            *tokens = (*tokens).saturating_add(u32::try_from(earned).unwrap_or(u32::MAX)).min(burst);
            *last = now;
        }
        if *tokens == 0 {
            return false;
        }
        *tokens -= 1;
        // Buckets of objects quiet for long are full again: forget them.
        if self.buckets.len() > 4096 {
            let idle = every * burst;
            self.buckets.retain(|_, (t, l)| *t < burst || now.saturating_duration_since(*l) < idle);
        }
        true
    }
}

/// Counts of what happened to events, for metrics and tests.
#[derive(Debug, Default)]
pub struct EventCounts {
    pub sent: AtomicU64,
    pub rate_limited: AtomicU64,
    pub dropped: AtomicU64,
    pub failed: AtomicU64,
}

/// The sending side: cheap to call from a reconcile.
#[derive(Clone)]
pub struct EventSink {
    queue: mpsc::Sender<Notice>,
    pub counts: Arc<EventCounts>,
}

impl EventSink {
    /// Starts the sender task on the current runtime.
    #[must_use]
    pub fn start(client: Client, instance: Option<String>) -> Self {
        let (queue, mut rx) = mpsc::channel::<Notice>(QUEUE);
        let counts = Arc::new(EventCounts::default());
        let task_counts = Arc::clone(&counts);
        let recorder = Recorder::new(client, Reporter { controller: CONTROLLER.into(), instance });
        tokio::spawn(async move {
            let mut filter = SpamFilter::new(BURST, REFILL_EVERY);
            while let Some(notice) = rx.recv().await {
                if !filter.allow(&notice.regarding, Instant::now()) {
                    task_counts.rate_limited.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let event = Event {
                    type_: if notice.warning { EventType::Warning } else { EventType::Normal },
                    reason: notice.reason.clone(),
                    note: Some(truncate_note(&notice.note)),
                    action: notice.action.clone(),
                    secondary: None,
                };
                match super::timed(recorder.publish(&event, &notice.regarding.object_ref())).await {
                    Ok(()) => task_counts.sent.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        tracing::debug!(reason = %notice.reason, "Kubernetes event not recorded: {e}");
                        task_counts.failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        });
        Self { queue, counts }
    }

    /// Queues an event; never waits.
    pub fn send(&self, notice: Notice) {
        if self.queue.try_send(notice).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The API refuses notes over 1 kB.
fn truncate_note(note: &str) -> String {
    const MAX: usize = 1000;
    if note.len() <= MAX {
        return note.to_owned();
    }
    let mut end = MAX - 3;
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &note[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_gets_a_burst_then_one_event_per_refill() {
        let mut filter = SpamFilter::new(3, Duration::from_mins(5));
        let pod = Regarding::Pod { namespace: "ns".into(), name: "p".into() };
        let other = Regarding::Node { name: "n".into() };
        let t0 = Instant::now();
        assert!((0..3).all(|_| filter.allow(&pod, t0)));
        assert!(!filter.allow(&pod, t0), "burst spent");
        assert!(filter.allow(&other, t0), "buckets are per object");
        assert!(!filter.allow(&pod, t0 + Duration::from_secs(299)));
        assert!(filter.allow(&pod, t0 + Duration::from_mins(5)), "one token back after the refill period");
        assert!(!filter.allow(&pod, t0 + Duration::from_secs(301)));
    }

    #[test]
    fn long_notes_are_cut_on_a_char_boundary() {
        let note = "é".repeat(800);
        let cut = truncate_note(&note);
        assert!(cut.len() <= 1000 && cut.ends_with("..."));
    }
}
