//! The container runtime in the agent: a view per reconcile, a change when
//! it comes and goes, stuck sandboxes as they start and stop being stuck
//! (told by `publish`), and the runtime's event stream followed where it
//! offers one.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use tokio::sync::mpsc;
use tracing::info;

use crate::{
    engine::{Observations, PodRef, RuntimeView, StuckSandbox, runtime::stuck_sandboxes},
    runtime::{RuntimeError, RuntimeWitness},
};

/// The `source` label and event field of the runtime.
pub const SOURCE: &str = "cri";

/// After a failed attempt, reconciles go on without the runtime for this
/// long before asking again: a wedged runtime must not add its timeout to
/// every kernel-driven release.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// The runtime started or stopped answering.
#[derive(Debug)]
pub struct SourceChange {
    pub active: bool,
    /// The runtime and socket, or why it is not used.
    pub detail: String,
    pub kind: ChangeKind,
}

/// How a change of the runtime's reachability is told (its log level).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// Configured off.
    Off,
    Answers,
    /// None configured or found: not a fault.
    Absent,
    /// It answered before, or was configured, and does not now.
    Lost,
}

/// Stuck sandboxes that started or stopped being stuck.
#[derive(Debug, Default)]
pub struct StuckChanges {
    pub started: Vec<StuckSandbox>,
    pub ended: Vec<StuckSandbox>,
    /// Stuck now.
    pub count: usize,
}

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
    /// kernel evidence alone), and a change of reachability when there is
    /// one (said once, not at every reconcile).
    pub async fn view(&mut self) -> (Option<RuntimeView>, Option<SourceChange>) {
        if self.witness.is_off() {
            let change = self.reachable.is_none().then(|| SourceChange {
                active: false,
                detail: format!("container runtime: {}", self.witness.choice()),
                kind: ChangeKind::Off,
            });
            self.reachable = Some(false);
            return (None, change);
        }
        if self.retry_at.is_some_and(|at| tokio::time::Instant::now() < at) {
            return (None, None);
        }
        let result = self.witness.view().await;
        let reachable = result.is_ok();
        self.retry_at = (!reachable).then(|| tokio::time::Instant::now() + RETRY_AFTER);
        let mut change = None;
        if self.reachable != Some(reachable) {
            let (detail, kind) = match &result {
                Ok(v) => (format!("{} on {}", v.runtime, self.witness.choice()), ChangeKind::Answers),
                // Never reached and none configured or found: not a fault.
                Err(e @ RuntimeError::NoSocket(_)) if self.reachable.is_none() => (e.to_string(), ChangeKind::Absent),
                Err(e) => (e.to_string(), ChangeKind::Lost),
            };
            change = Some(SourceChange { active: reachable, detail, kind });
            self.reachable = Some(reachable);
        }
        (result.ok(), change)
    }

    /// Sandboxes that became stuck (NOTREADY with their netns alive) or
    /// stopped being stuck. None when the runtime cannot be asked: the last
    /// known set stands, nothing new is known about them.
    pub fn stuck_changes(&mut self, obs: &Observations) -> Option<StuckChanges> {
        obs.runtime.as_ref()?;
        let now: BTreeMap<String, StuckSandbox> = stuck_sandboxes(obs).into_iter().map(|s| (s.id.clone(), s)).collect();
        let started = now.iter().filter(|(id, _)| !self.stuck.contains_key(*id)).map(|(_, s)| s.clone()).collect();
        let ended = self.stuck.iter().filter(|(id, _)| !now.contains_key(*id)).map(|(_, s)| s.clone()).collect();
        let count = now.len();
        self.stuck = now;
        Some(StuckChanges { started, ended, count })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    use crate::engine::{RuntimeSandbox, SandboxState};

    #[tokio::test(flavor = "current_thread")]
    async fn an_unreachable_runtime_is_said_once_and_then_asked_only_after_a_pause() {
        let dir = tempfile::tempdir().unwrap();
        let mut source = RuntimeSource::new(Some(dir.path().join("no-such.sock")));
        let mut changes = Vec::new();
        for _ in 0..3 {
            let (view, change) = source.view().await;
            assert!(view.is_none());
            changes.extend(change);
        }
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert!(!changes[0].active);
        assert!(source.retry_at.is_some(), "backs off after a failure");
    }

    #[test]
    fn stuck_sandboxes_are_reported_when_they_start_and_stop_being_stuck() {
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
        let first = source.stuck_changes(&obs).expect("the runtime answered");
        assert_eq!((first.started.len(), first.ended.len(), first.count), (1, 0, 1));
        assert_eq!(first.started[0].pod.as_ref().map(ToString::to_string).as_deref(), Some("ns/web"));
        let again = source.stuck_changes(&obs).expect("the runtime answered");
        assert_eq!((again.started.len(), again.ended.len(), again.count), (0, 0, 1));
        // Unreachable: nothing new is known, nothing said.
        obs.set_runtime(None);
        assert!(source.stuck_changes(&obs).is_none());
        obs.set_runtime(Some(view(vec![RuntimeSandbox { netns_closed: Some(true), ..stuck }])));
        let over = source.stuck_changes(&obs).expect("the runtime answered");
        assert_eq!((over.started.len(), over.ended.len(), over.count), (0, 1, 0));
    }
}
