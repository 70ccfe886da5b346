//! The container runtime in the agent: a view per reconcile, said once when
//! it comes and goes, stuck sandboxes reported, and the runtime's event
//! stream followed where it offers one.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, SystemTime},
};

use serde_json::json;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::{
    engine::{Observations, PodRef, RuntimeView, StuckSandbox, runtime::stuck_sandboxes},
    runtime::{RuntimeError, RuntimeWitness},
    telemetry::{metrics::Metrics, stream::EventStream},
};

/// The `source` label and event field of the runtime.
pub const SOURCE: &str = "cri";

/// After a failed attempt, reconciles go on without the runtime for this
/// long before asking again: a wedged runtime must not add its timeout to
/// every kernel-driven release.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

pub struct RuntimeSource {
    witness: RuntimeWitness,
    /// Whether the last attempt reached it (None: not tried yet).
    reachable: Option<bool>,
    /// Stuck sandboxes already reported, by ID.
    stuck: BTreeMap<String, StuckSandbox>,
    /// No attempt before this after a failure.
    retry_at: Option<tokio::time::Instant>,
}

/// The pod a container ID belongs (or belonged) to, when the runtime says.
pub fn pod_of<'a>(obs: &'a Observations, container_id: &str) -> Option<&'a PodRef> {
    obs.runtime.as_ref().and_then(|v| v.pod_of(container_id))
}

impl RuntimeSource {
    #[must_use]
    pub fn new(configured: Option<PathBuf>) -> Self {
        Self { witness: RuntimeWitness::new(configured), reachable: None, stuck: BTreeMap::new(), retry_at: None }
    }

    /// The runtime's view now, or None (not reachable: the engine decides on
    /// kernel evidence alone). A change of reachability is logged, emitted
    /// (`source_changed`) and set as a metric once, not at every reconcile.
    pub async fn view(&mut self, events: &mut EventStream, metrics: &Metrics) -> anyhow::Result<Option<RuntimeView>> {
        if self.witness.is_off() {
            if self.reachable.is_none() {
                info!("container runtime: {}", self.witness.choice());
                self.reachable = Some(false);
            }
            return Ok(None);
        }
        if self.retry_at.is_some_and(|at| tokio::time::Instant::now() < at) {
            return Ok(None);
        }
        let result = self.witness.view().await;
        let reachable = result.is_ok();
        self.retry_at = (!reachable).then(|| tokio::time::Instant::now() + RETRY_AFTER);
        if self.reachable != Some(reachable) {
            let detail = match &result {
                Ok(v) => format!("{} on {}", v.runtime, self.witness.choice()),
                Err(e) => e.to_string(),
            };
            match &result {
                Ok(_) => info!(source = SOURCE, "container runtime answers: {detail}; its sandbox list is evidence"),
                // Never reached and none configured or found: not a fault.
                Err(RuntimeError::NoSocket(_)) if self.reachable.is_none() => {
                    info!(source = SOURCE, "no container runtime: {detail}; deciding on kernel evidence alone");
                }
                Err(_) => {
                    warn!(
                        source = SOURCE,
                        "container runtime unavailable: {detail}; deciding on kernel evidence alone"
                    );
                }
            }
            events.emit(
                SystemTime::now(),
                "source_changed",
                &json!({ "source": SOURCE, "active": reachable, "detail": detail }),
            )?;
            metrics.set_source_active(SOURCE, reachable);
            self.reachable = Some(reachable);
        }
        Ok(result.ok())
    }

    /// Reports sandboxes that became stuck (NOTREADY with their netns alive)
    /// or stopped being stuck, and sets the gauge. When the runtime cannot be
    /// asked the last known set stands: nothing new is known about them.
    pub fn report_stuck(
        &mut self,
        obs: &Observations,
        events: &mut EventStream,
        metrics: &Metrics,
    ) -> anyhow::Result<()> {
        if obs.runtime.is_none() {
            return Ok(());
        }
        let now: BTreeMap<String, StuckSandbox> = stuck_sandboxes(obs).into_iter().map(|s| (s.id.clone(), s)).collect();
        for (id, s) in &now {
            if !self.stuck.contains_key(id) {
                warn!(sandbox = %id, pod = s.pod.as_ref().map(ToString::to_string), "{s}");
                events.emit(SystemTime::now(), "sandbox_stuck", &stuck_event(s))?;
            }
        }
        for (id, s) in &self.stuck {
            if !now.contains_key(id) {
                info!(sandbox = %id, pod = s.pod.as_ref().map(ToString::to_string), "sandbox no longer stuck");
                events.emit(SystemTime::now(), "sandbox_unstuck", &stuck_event(s))?;
            }
        }
        metrics.set_sandboxes_stuck(now.len() as u64);
        self.stuck = now;
        Ok(())
    }

    /// Follows `GetContainerEvents` where the runtime offers it: each event
    /// asks for a reconcile. Where it does not (containerd before 1.7), the
    /// channel stays silent and the sandbox list is polled on each reconcile.
    pub fn follow_events(&self) -> mpsc::Receiver<()> {
        let (tx, rx) = mpsc::channel(1);
        let Some(client) = self.witness.connected() else { return rx };
        tokio::spawn(async move {
            loop {
                match client.container_events().await {
                    Ok(mut stream) => {
                        info!(source = SOURCE, "following the runtime's container events");
                        while let Ok(Some(_event)) = stream.message().await {
                            // Full: a reconcile is already due.
                            let _ = tx.try_send(());
                        }
                    }
                    Err(e) if e.is_unimplemented() => {
                        info!(
                            source = SOURCE,
                            "the runtime offers no GetContainerEvents: its sandboxes are listed on each reconcile"
                        );
                        return;
                    }
                    Err(_) => {}
                }
                if tx.is_closed() {
                    return;
                }
                // Down or restarting: the reconciles say so; try again later.
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
        rx
    }
}

fn stuck_event(s: &StuckSandbox) -> serde_json::Value {
    json!({
        "sandbox_id": s.id,
        "pod": s.pod.as_ref().map(ToString::to_string),
        "pod_uid": s.pod.as_ref().map(|p| p.uid.clone()),
        "netns": s.netns,
        "netns_inode": s.live.and_then(|id| id.inode),
        "netns_closed_by_runtime": s.netns_closed,
        "detail": s.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{RuntimeSandbox, SandboxState};

    fn events_in(dir: &tempfile::TempDir) -> (EventStream, std::path::PathBuf) {
        let path = dir.path().join("events.jsonl");
        (EventStream::file(&path).unwrap(), path)
    }

    fn named(path: &std::path::Path, name: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["event"] == name)
            .collect()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_unreachable_runtime_is_said_once_and_then_asked_only_after_a_pause() {
        let dir = tempfile::tempdir().unwrap();
        let (mut events, path) = events_in(&dir);
        let metrics = Metrics::default();
        let mut source = RuntimeSource::new(Some(dir.path().join("no-such.sock")));
        for _ in 0..3 {
            assert!(source.view(&mut events, &metrics).await.unwrap().is_none());
        }
        events.sync().unwrap();
        let changes = named(&path, "source_changed");
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(changes[0]["active"], false);
        assert!(source.retry_at.is_some(), "backs off after a failure");
        assert!(metrics.encode().contains("netreap_source_active{source=\"cri\"} 0"));
    }

    #[test]
    fn stuck_sandboxes_are_reported_when_they_start_and_stop_being_stuck() {
        let dir = tempfile::tempdir().unwrap();
        let (mut events, path) = events_in(&dir);
        let metrics = Metrics::default();
        let mut source = RuntimeSource::new(None);
        let stuck = RuntimeSandbox {
            id: "c1".into(),
            state: SandboxState::NotReady,
            pod: Some(PodRef { namespace: "ns".into(), name: "web".into(), uid: String::new() }),
            netns: Some("/run/netns/cni-1".into()),
            netns_closed: Some(false),
        };
        let view = |sandboxes: Vec<RuntimeSandbox>| RuntimeView {
            runtime: "test".into(),
            listed_at: SystemTime::now(),
            sandboxes: sandboxes.into_iter().map(|s| (s.id.clone(), s)).collect(),
            networks: None,
            departed: BTreeMap::new(),
        };
        let mut obs = Observations::default();
        obs.set_runtime(Some(view(vec![stuck.clone()])));
        source.report_stuck(&obs, &mut events, &metrics).unwrap();
        source.report_stuck(&obs, &mut events, &metrics).unwrap();
        assert!(metrics.encode().contains("netreap_sandboxes_stuck 1"));
        // Unreachable: nothing new is known, nothing said.
        obs.set_runtime(None);
        source.report_stuck(&obs, &mut events, &metrics).unwrap();
        obs.set_runtime(Some(view(vec![RuntimeSandbox { netns_closed: Some(true), ..stuck }])));
        source.report_stuck(&obs, &mut events, &metrics).unwrap();
        events.sync().unwrap();
        let reported = named(&path, "sandbox_stuck");
        assert_eq!(reported.len(), 1, "{reported:?}");
        assert_eq!(reported[0]["pod"], "ns/web");
        assert_eq!(named(&path, "sandbox_unstuck").len(), 1);
        assert!(metrics.encode().contains("netreap_sandboxes_stuck 0"));
    }
}
