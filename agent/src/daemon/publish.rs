//! What the agent tells the world, from one place: logs, the event stream,
//! metrics and `/state`. Each fact is said once here, by whoever learned it
//! (ingest, a reconcile, a release batch).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::{
    Agent, evidence,
    knowledge::Restored,
    reconcile::{Change, Observed, Reconciled},
    runtime::{self, ChangeKind, SourceChange, StuckChanges},
};
use crate::{
    config::Config,
    engine::{PodRef, Status, Verdict},
    kernel::{
        cni_runs::CniRunAnomaly,
        events::{DecodeError, KernelEvent},
        probes::{ProbeState, Probes},
    },
    model::snapshot::NetnsDeath,
    release::{Outcome, ReleaseRecord},
    telemetry::{
        event::{
            Conflict, Event, NetnsDied, Release, ReleaseReason, Sandbox, VerdictChanged, death_time, status_label,
        },
        http::{self, Endpoints, Exposure, Readiness},
        metrics::Metrics,
    },
};

/// Distinct CNI-run anomalies logged at warn; later ones go to debug.
const MAX_LOGGED_CNI_ANOMALIES: usize = 256;

/// What the state endpoint shows. Kept typed and serialized only when
/// someone asks: a reconcile must not pay for JSON nobody reads.
/// Cloning is cheap (shared parts), so /state copies it under the lock and
/// renders outside it.
#[derive(Default, Clone)]
pub(super) struct StateDoc {
    pub probes: Vec<crate::kernel::probes::ProbeStatus>,
    pub model: Option<Arc<crate::model::snapshot::ModelSnapshot>>,
    /// The ledger's attachments, in no order (sorted when written).
    pub attachments: Arc<Vec<Arc<crate::ledger::Attachment>>>,
    pub verdicts: Arc<Vec<Verdict>>,
    pub runtime: Option<crate::engine::RuntimeView>,
}

/// How a [`StateDoc`] is serialized: streamed field by field, never built
/// as a `serde_json::Value` first (that copy of the whole state, as maps of
/// strings, was the agent's peak memory). Keys in the order the `Value`
/// gave them (sorted).
#[derive(Serialize)]
struct StateJson<'a> {
    attachments: &'a [&'a Arc<crate::ledger::Attachment>],
    model: Option<&'a crate::model::snapshot::ModelSnapshot>,
    probes: &'a [crate::kernel::probes::ProbeStatus],
    runtime: Option<&'a crate::engine::RuntimeView>,
    verdicts: &'a [Verdict],
}

impl StateDoc {
    fn write_json(&self, out: &mut dyn std::io::Write) -> serde_json::Result<()> {
        // Sorted here, when someone asks, not at each change of the ledger.
        let mut attachments: Vec<&Arc<crate::ledger::Attachment>> = self.attachments.iter().collect();
        attachments.sort_unstable_by(|a, b| a.container_id.cmp(&b.container_id));
        serde_json::to_writer(
            out,
            &StateJson {
                attachments: &attachments,
                model: self.model.as_deref(),
                probes: &self.probes,
                runtime: self.runtime.as_ref(),
                verdicts: &self.verdicts,
            },
        )
    }
}

/// The HTTP endpoint task and how to stop it.
pub(super) struct Endpoint {
    pub readiness: Readiness,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Endpoint {
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Serves /metrics, /healthz, /readyz and /state from the start, so a
/// liveness probe answers while the probes load.
pub(super) async fn serve_endpoint(
    config: &Config,
    metrics: &Metrics,
    state: &Arc<Mutex<StateDoc>>,
) -> anyhow::Result<Endpoint> {
    use anyhow::Context as _;
    let readiness = Readiness::new();
    let (stop, stop_rx) = watch::channel(false);
    let listener = http::bind(config.metrics_addr).await.context("binding the metrics/state endpoint")?;
    info!("serving /metrics, /healthz, /readyz, /state on http://{}", config.metrics_addr);
    let state = Arc::clone(state);
    let endpoints = Endpoints {
        metrics: metrics.clone(),
        readiness: readiness.clone(),
        // Runs on the blocking pool: copy the (shared) parts under the lock,
        // render without it, so a reconcile never waits for a slow reader.
        state: Arc::new(move |out| match state.lock().map(|s| s.clone()) {
            Ok(doc) => doc.write_json(out),
            Err(_) => serde_json::to_writer(out, &Value::Null),
        }),
        exposure: Exposure { metrics: config.expose_metrics, state: config.expose_state },
    };
    let task = tokio::spawn(http::serve(listener, endpoints, stop_rx));
    Ok(Endpoint { readiness, stop, task })
}

pub fn log_probe_status(probes: &Probes) {
    for s in &probes.status {
        match &s.state {
            ProbeState::Active => {
                if let Some(i) = &s.implementation {
                    info!(
                        probe = s.spec.program,
                        attach = %s.spec.attach,
                        implementation = i.active,
                        primary_refused = i.primary_refused.as_deref(),
                        limits = i.note,
                        "probe active"
                    );
                } else {
                    info!(probe = s.spec.program, attach = %s.spec.attach, "probe active");
                }
            }
            ProbeState::Unavailable(reason) => warn!(
                probe = s.spec.program,
                attach = %s.spec.attach,
                fallback = s.spec.fallback,
                "probe unavailable on this kernel: {reason}"
            ),
        }
    }
}

/// Reservations per (network, verdict).
fn counts(verdicts: &[Verdict]) -> BTreeMap<(&str, &'static str), u64> {
    let mut out = BTreeMap::new();
    for v in verdicts {
        *out.entry((v.reservation.network.as_str(), status_label(v.status))).or_insert(0) += 1;
    }
    out
}

impl Agent {
    /// Everything a reconcile found and did.
    pub(super) fn publish_reconciled(&mut self, r: Reconciled) -> anyhow::Result<()> {
        let Reconciled { reason, started, verdicts, changed, new_anomalies, whereabouts, observed, requeue: _ } = r;
        for a in &new_anomalies {
            warn!(path = %a.path, kind = ?a.kind, "not a reservation, left untouched: {}", a.detail);
            self.events.emit(SystemTime::now(), &Event::Anomaly(a))?;
        }
        self.publish_changes(&verdicts, &changed)?;
        for record in &whereabouts {
            let cid = &record.verdict.reservation.container_id;
            let pod = observed.runtime.as_ref().and_then(|v| v.pod_of(cid));
            self.publish_release(record, ReleaseReason::of(&record.verdict), pod)?;
        }
        if let Some(k) = self.kube.as_mut() {
            // Kubernetes Events on the pods (or the node).
            k.notify(&verdicts, &whereabouts, &self.ledger);
        }
        self.metrics.replace_reservations(counts(&verdicts).iter().map(|((n, s), c)| (*n, *s, *c)));
        let count = verdicts.len();
        if let Ok(mut s) = self.state.lock() {
            s.verdicts = Arc::new(verdicts);
        }
        self.publish_observed(observed)?;
        debug!(
            reason = reason.as_str(),
            reservations = count,
            took_ms = started.elapsed().as_millis() as u64,
            "reconciled"
        );
        Ok(())
    }

    /// What a targeted pass (the death path) found: the verdicts that
    /// changed. `/state` and the reservation counts wait for the full
    /// reconcile that follows it.
    pub(super) fn publish_targeted(
        &mut self,
        took: std::time::Duration,
        verdicts: &[Verdict],
        changed: &[Change],
    ) -> anyhow::Result<()> {
        self.publish_changes(verdicts, changed)?;
        debug!(
            reason = "netns_died",
            targeted = true,
            reservations = verdicts.len(),
            took_us = took.as_micros() as u64,
            "reconciled"
        );
        Ok(())
    }

    /// One event per verdict that changed, and a conflict's own.
    fn publish_changes(&mut self, verdicts: &[Verdict], changed: &[Change]) -> anyhow::Result<()> {
        for c in changed {
            let v = &verdicts[c.index];
            let pod = c.pod.as_ref();
            self.events.emit(SystemTime::now(), &Event::VerdictChanged(VerdictChanged::new(v, c.before, pod)))?;
            if v.status == Status::Conflict {
                self.metrics.conflict();
                warn!(ip = %v.reservation.ip, network = %v.reservation.network, "conflict: {v}");
                self.events.emit(SystemTime::now(), &Event::Conflict(Conflict::verdict(v, pod)))?;
            }
        }
        Ok(())
    }

    /// The model and the runtime as a reconcile saw them.
    pub(super) fn publish_observed(&mut self, observed: Observed) -> anyhow::Result<()> {
        let Observed { snapshot, runtime, source_changed, stuck } = observed;
        if let Some(change) = source_changed {
            self.publish_source_changed(&change)?;
        }
        if let Some(stuck) = stuck {
            self.publish_stuck(&stuck)?;
        }
        self.metrics.set_netns_alive(snapshot.alive().count() as u64);
        if let Ok(mut s) = self.state.lock() {
            s.model = Some(snapshot);
            s.runtime = runtime;
        }
        self.publish_attachments();
        Ok(())
    }

    fn publish_source_changed(&mut self, change: &SourceChange) -> anyhow::Result<()> {
        let (source, detail) = (runtime::SOURCE, &change.detail);
        match change.kind {
            ChangeKind::Off => {
                info!("{detail}");
                return Ok(());
            }
            ChangeKind::Answers => info!(source, "container runtime answers: {detail}; its sandbox list is evidence"),
            ChangeKind::Absent => info!(source, "no container runtime: {detail}; deciding on kernel evidence alone"),
            ChangeKind::Lost => {
                warn!(source, "container runtime unavailable: {detail}; deciding on kernel evidence alone");
            }
        }
        self.events.emit(SystemTime::now(), &Event::SourceChanged { source, active: change.active, detail })?;
        self.metrics.set_source_active(source, change.active);
        Ok(())
    }

    fn publish_stuck(&mut self, stuck: &StuckChanges) -> anyhow::Result<()> {
        for s in &stuck.started {
            warn!(sandbox = %s.id, pod = s.pod.as_ref().map(ToString::to_string), "{s}");
            self.events.emit(SystemTime::now(), &Event::SandboxStuck(s.into()))?;
        }
        for s in &stuck.ended {
            info!(sandbox = %s.id, pod = s.pod.as_ref().map(ToString::to_string), "sandbox no longer stuck");
            self.events.emit(SystemTime::now(), &Event::SandboxUnstuck(Sandbox::from(s)))?;
        }
        self.metrics.set_sandboxes_stuck(stuck.count as u64);
        Ok(())
    }

    /// One release attempt: its log line, event, metrics, and a conflict
    /// when the last look found the IP configured.
    pub(super) fn publish_release(
        &mut self,
        record: &ReleaseRecord,
        reason: ReleaseReason,
        pod: Option<&PodRef>,
    ) -> anyhow::Result<()> {
        let now = SystemTime::now();
        let latency = death_time(&record.verdict).and_then(|d| now.duration_since(d).ok());
        self.metrics.release(reason.as_str(), record.outcome.label());
        if record.outcome.released()
            && let Some(latency) = latency
        {
            self.metrics.observe_death_to_release(latency);
        }
        let r = &record.verdict.reservation;
        let pod_name = pod.map(ToString::to_string);
        let reason_label = reason.as_str();
        if matches!(record.outcome, Outcome::LockBusy { .. }) {
            warn!(ip = %r.ip, network = %r.network, container = %r.container_id, pod = pod_name, reason = reason_label, "release: {}", record.outcome);
        } else {
            info!(ip = %r.ip, network = %r.network, container = %r.container_id, pod = pod_name, reason = reason_label, "release: {}", record.outcome);
        }
        self.events.emit(now, &Event::Release(Release::new(record, reason, latency, pod)))?;
        if let Outcome::LastLookKept { found, ip_configured: true } = &record.outcome {
            // The model said no live netns holds the IP; the kernel, asked
            // under the lock, said one does: both views, one event.
            self.metrics.conflict();
            warn!(ip = %r.ip, network = %r.network, "conflict at the last look: {found}");
            self.events.emit(now, &Event::Conflict(Conflict::last_look(&record.verdict, found)))?;
        }
        Ok(())
    }

    /// A netns death the model reported: the ledger's bookkeeping, done at
    /// once. Returns the containers bound to it, and whether a CNI run of
    /// one of them (or of an unknown container) is in flight. The death is
    /// logged and streamed by [`Self::publish_death`], once its release has
    /// been handed off (the death path does not wait for the writes).
    pub(super) fn on_death(&mut self, death: &NetnsDeath) -> (Vec<String>, bool) {
        self.metrics.netns_destroyed();
        let containers = evidence::containers_of_death(&self.ledger, &[], death);
        // Marked on the bindings (issue 13.3), so that housekeeping can
        // forget them after the age limit, and a binding still names the
        // netns it resolved to once the model has forgotten that netns.
        self.ledger.netns_died(&containers, (death.id(), death.at), |a| evidence::binding_resolved_to(death, a));
        // The saved knowledge names the bindings whose netns died.
        self.memory.dirty = true;
        let runs_concerned = self.ledger.unattributed_runs().next().is_some()
            || containers.iter().any(|c| self.ledger.get(c).is_some_and(crate::ledger::Attachment::in_flight));
        (containers, runs_concerned)
    }

    /// Logs and streams a death [`Self::on_death`] took in.
    pub(super) fn publish_death(&mut self, death: &NetnsDeath, containers: &[String]) -> anyhow::Result<()> {
        // Debug, not info: the event says it all, and a busy node's pod
        // deaths (one per pod) would double every line in the pod's log
        // (1.8 % of the agent's CPU in pod cycles, session 14).
        debug!(
            inode = ?death.inode,
            nsid = ?death.nsid,
            source = ?death.source,
            addresses = ?death.addresses.iter().map(|a| a.ip).collect::<Vec<_>>(),
            "netns died"
        );
        self.events.emit(death.at, &Event::NetnsDied(NetnsDied::seen(death, containers)))?;
        Ok(())
    }

    /// What an earlier run's knowledge came to.
    pub(super) fn publish_restored(&mut self, counts: &Restored, dead: &[crate::engine::observations::DeadNetns]) {
        for d in dead {
            // Best effort: knowledge restored is not worth failing the start.
            let _ = self.events.emit(SystemTime::now(), &Event::NetnsDied(NetnsDied::while_down(d, counts.same_boot)));
        }
        let Restored { alive, dead, unknown, same_boot } = counts;
        info!(alive, dead, unknown, same_boot, "restored the bindings an earlier run saved");
    }

    pub(super) fn publish_kernel_event(&mut self, event: &KernelEvent) -> anyhow::Result<()> {
        self.events.emit(self.clock.wall(event.task().ktime_ns), &Event::from(event))?;
        Ok(())
    }

    pub(super) fn publish_malformed(&mut self, e: &DecodeError) -> anyhow::Result<()> {
        warn!("malformed kernel record skipped: {e}");
        self.events.emit(SystemTime::now(), &Event::MalformedRecord { error: e.to_string() })?;
        Ok(())
    }

    /// An exec record that is not a CNI run.
    pub(super) fn publish_cni_anomaly(&mut self, event: &KernelEvent, anomaly: &CniRunAnomaly) -> anyhow::Result<()> {
        let KernelEvent::CniExec { task, exec } = event else { return Ok(()) };
        self.metrics.cni_exec_anomaly(anomaly.reason());
        // Logged once per (reason, binary): plugins' helper processes
        // (iptables, sh) inherit CNI_COMMAND and would flood the log.
        let first = self.cni_anomalies_logged.len() < MAX_LOGGED_CNI_ANOMALIES
            && self.cni_anomalies_logged.insert((anomaly.reason(), anomaly.binary().to_owned()));
        if first {
            warn!(pid = task.tgid, comm = %task.comm, "not a CNI run, ignored: {anomaly}");
        } else {
            debug!(pid = task.tgid, comm = %task.comm, "not a CNI run, ignored: {anomaly}");
        }
        let event = Event::CniExecAnomaly {
            pid: task.tgid,
            comm: &task.comm,
            anomaly,
            command: &exec.command.value,
            container_id: exec.container_id.as_ref().map(|v| v.value.as_str()),
            uid: exec.uid,
        };
        self.events.emit(self.clock.wall(task.ktime_ns), &event)?;
        Ok(())
    }

    pub(super) fn publish_env_scan_limited(&mut self, event: &KernelEvent) {
        let KernelEvent::CniExec { task, exec } = event else { return };
        self.metrics.cni_env_scan_limited();
        warn!(
            pid = task.tgid,
            binary = %exec.binary.value,
            scanned = exec.env_scanned,
            "the kernel read only part of this CNI run's environment: kept as unknown, in flight"
        );
    }

    pub(super) fn publish_records_dropped(&mut self, dropped: u64) -> anyhow::Result<()> {
        warn!(dropped, "ring buffer full: kernel records lost; resyncing");
        self.metrics.ringbuf_drops(dropped);
        self.metrics.resync("ringbuf_drop");
        self.events.emit(SystemTime::now(), &Event::RecordsDropped { dropped })?;
        Ok(())
    }

    /// Renders the ledger for /state when it changed.
    pub(super) fn publish_attachments(&mut self) {
        if std::mem::take(&mut self.attachments_dirty)
            && let Ok(mut s) = self.state.lock()
        {
            // Shared with the ledger: a pointer per attachment.
            s.attachments = Arc::new(self.ledger.shared_attachments().cloned().collect());
        }
    }
}
