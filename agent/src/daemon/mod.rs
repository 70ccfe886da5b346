//! `netreap run`: the agent. Kernel events feed the ledger and the model;
//! each netns death (and every resync interval) runs the pure engine over
//! fresh observations and releases what is orphaned, journaled, with its
//! evidence in the event stream and the metrics.

pub mod evidence;
pub mod oneshot;
mod report;
pub mod restore;
mod runtime;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use serde_json::{Value, json};
use tokio::{signal::unix::SignalKind, sync::watch};
use tracing::{info, warn};

use crate::{
    config::Config,
    engine::{Policy, Status, Verdict, decide, decide_one},
    ipam::{ReservationStore, cnicache::CniCache, hostlocal::HostLocalStore, scan_all},
    kernel::cni_runs::CniRunFilter,
    kernel::{
        events::KernelEvent,
        probes::{ProbeState, Probes},
        stream::KernelStream,
    },
    ledger::{
        Ledger, StatResolver,
        persist::{self, Window},
    },
    model::{DeathSource, ModelHandle, Watcher, WatcherConfig, snapshot::NetnsDeath},
    release::{ReleaseError, ReleaseRecord, Releaser, ReleaserConfig, retry::RetryGate},
    telemetry::{
        clock::Clock,
        http::{self, Endpoints, Exposure, Readiness},
        metrics::Metrics,
        stream::EventStream,
    },
};

/// Test-only failure injection (scenario: agent killed between intent and
/// unlink): when set to 1 the process aborts right after the first intent
/// is fsync'd.
pub const CRASH_AFTER_INTENT_ENV: &str = "NETREAP_TEST_CRASH_AFTER_INTENT";

/// What the state endpoint shows. Kept typed and serialized only when
/// someone asks: a reconcile must not pay for JSON nobody reads.
/// Cloning is cheap (shared parts), so /state copies it under the lock and
/// renders outside it.
#[derive(Default, Clone)]
struct StateDoc {
    probes: Vec<crate::kernel::probes::ProbeStatus>,
    model: Option<Arc<crate::model::snapshot::ModelSnapshot>>,
    attachments: Arc<Vec<crate::ledger::Attachment>>,
    verdicts: Arc<Vec<Verdict>>,
    runtime: Option<crate::engine::RuntimeView>,
}

impl StateDoc {
    fn to_json(&self) -> Value {
        json!({
            "probes": self.probes,
            "model": self.model.as_deref(),
            "attachments": *self.attachments,
            "verdicts": *self.verdicts,
            "runtime": self.runtime,
        })
    }
}

/// Distinct CNI-run anomalies logged at warn; later ones go to debug.
const MAX_LOGGED_CNI_ANOMALIES: usize = 256;

/// Key of a reservation across reconciles: its file.
type ReservationKey = PathBuf;

struct Agent {
    config: Config,
    policy: Policy,
    clock: Clock,
    events: EventStream,
    metrics: Metrics,
    ledger: Ledger,
    model: ModelHandle,
    stores: Vec<HostLocalStore>,
    cache: CniCache,
    /// None while a release batch runs on the blocking pool (it owns it).
    releaser: Option<Releaser>,
    /// Which orphans to attempt now: once per verdict change, failures
    /// with back-off.
    gate: RetryGate,
    /// Where a finished release batch reports.
    release_done: tokio::sync::mpsc::Sender<ReleaseDone>,
    /// Orphans were found while a batch ran: reconcile again when it ends.
    release_waiting: bool,
    /// The probes have recorded every CNI run since then (reset by a loss).
    watching_since: SystemTime,
    verdicts: HashMap<ReservationKey, Status>,
    /// When this agent first saw each CNI cache entry.
    cache_first_seen: evidence::FirstSeen,
    /// The ledger changed since /state last showed it.
    attachments_dirty: bool,
    /// Only CNI runs it admits reach the ledger.
    cni_filter: CniRunFilter,
    /// (reason, binary) of CNI-run anomalies already logged at warn.
    cni_anomalies_logged: std::collections::HashSet<(&'static str, String)>,
    /// What survives a restart (see `restore`).
    memory: Memory,
    /// Resolves CNI_NETNS paths (through the host's root in a container).
    resolver: StatResolver,
    /// Anomalies already reported (path), so each is reported once.
    anomalies: std::collections::HashSet<String>,
    state: Arc<Mutex<StateDoc>>,
    /// The Kubernetes API (pods, whereabouts, Events), when configured.
    kube: Option<crate::kube::agent::KubeAgent>,
    /// The container runtime as a witness (daemon/runtime.rs).
    runtime: runtime::RuntimeSource,
}

/// A release batch that ran on the blocking pool, with the releaser back.
struct ReleaseDone {
    releaser: Releaser,
    admitted: Vec<Verdict>,
    /// The runtime's pod of each admitted container, when it names one.
    pods: HashMap<String, crate::engine::PodRef>,
    result: Result<Vec<ReleaseRecord>, ReleaseError>,
}

/// The HTTP endpoint task and how to stop it.
struct Endpoint {
    readiness: Readiness,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

/// Serves /metrics, /healthz, /readyz and /state from the start, so a
/// liveness probe answers while the probes load.
async fn serve_endpoint(config: &Config, metrics: &Metrics, state: &Arc<Mutex<StateDoc>>) -> anyhow::Result<Endpoint> {
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
        state: Arc::new(move || state.lock().map(|s| s.clone()).map_or(Value::Null, |s| s.to_json())),
        exposure: Exposure { metrics: config.expose_metrics, state: config.expose_state },
    };
    let task = tokio::spawn(http::serve(listener, endpoints, stop_rx));
    Ok(Endpoint { readiness, stop, task })
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    use anyhow::Context as _;

    let metrics = Metrics::new(env!("CARGO_PKG_VERSION"));
    let events = EventStream::open_rotating(&config.events, config.events_max_bytes, config.events_keep)
        .context("opening the event stream")?;
    let state = Arc::new(Mutex::new(StateDoc::default()));
    let endpoint = serve_endpoint(&config, &metrics, &state).await?;

    let probe_options = crate::kernel::probes::ProbeOptions { attribution: config.probes.attribution };
    let mut probes = Probes::load_configured(probe_options).context("loading the eBPF probes")?;
    log_probe_status(&probes);
    if let Ok(mut s) = state.lock() {
        s.probes.clone_from(&probes.status);
    }
    let watching_since = SystemTime::now();
    let mut kernel = KernelStream::new(&mut probes).context("reading the probes' ring buffer")?;

    let watcher_config = WatcherConfig {
        resync_interval: config.resync_interval,
        discovery: crate::discovery::DiscoveryPaths::with_mountinfo(config.mountinfo.clone()),
        ..WatcherConfig::default()
    };
    let (watcher, mut deaths) = Watcher::start(watcher_config).await.context("starting the netns model")?;

    let releaser_config = ReleaserConfig {
        dry_run: config.dry_run,
        host_local_dirs: config.host_local_dirs.clone(),
        cni_cache_dir: Some(config.cni_cache_dir.clone()),
        abort_after_intent: std::env::var(CRASH_AFTER_INTENT_ENV).is_ok_and(|v| v == "1"),
        lock_timeout: Some(config.release_lock_timeout),
    };
    let journal = crate::release::Journal::open_with_limit(&config.state_dir, config.journal_max_bytes)
        .context("opening the release journal")?;
    let releaser = Releaser::new(journal, releaser_config);
    let (release_done, mut release_results) = tokio::sync::mpsc::channel(1);
    let kube = crate::kube::agent::KubeAgent::start(&config, &metrics).await?;

    let mut agent = Agent {
        policy: Policy { in_flight_grace: config.in_flight_grace, orphan_grace: config.orphan_grace },
        clock: Clock::new(),
        events,
        metrics,
        ledger: Ledger::new(),
        model: watcher.handle(),
        stores: config.host_local_dirs.iter().map(HostLocalStore::new).collect(),
        cache: CniCache::new(config.cni_cache_dir.clone()),
        releaser: Some(releaser),
        gate: RetryGate::new(),
        release_done,
        release_waiting: false,
        watching_since,
        verdicts: HashMap::new(),
        cache_first_seen: evidence::FirstSeen::new(),
        anomalies: std::collections::HashSet::new(),
        cni_filter: CniRunFilter::new(&config.cni_bin_dirs),
        cni_anomalies_logged: std::collections::HashSet::new(),
        attachments_dirty: false,
        memory: Memory::default(),
        resolver: StatResolver::new(crate::discovery::host_root(std::path::Path::new("/proc"), &config.mountinfo)),
        state,
        runtime: runtime::RuntimeSource::new(config.cri_socket.clone()),
        config,
        kube,
    };

    agent.remember().await;
    agent.recover().await?;
    agent.reconcile("startup").await?;
    endpoint.readiness.mark_ready();
    info!(dry_run = agent.config.dry_run, "netreap ready");

    let mut runtime_events = agent.runtime.follow_events();
    agent.event_loop(&mut kernel, &mut deaths, &mut runtime_events, &mut release_results).await?;

    // Detach the probes first so no more work arrives, then flush.
    drop(kernel);
    drop(probes);
    agent.save_knowledge().await;
    let _ = watcher.stop().await;
    agent.events.sync()?;
    if let Some(releaser) = agent.releaser.as_mut() {
        // Nothing pending: the next start reads only the journal's last line.
        releaser.journal_mut().close_clean()?;
    }
    let _ = endpoint.stop.send(true);
    let _ = endpoint.task.await;
    info!("probes detached, journal and event stream flushed; bye");
    Ok(())
}

/// How long CNI exits are gathered before the reconcile they trigger.
const CNI_EXIT_COALESCE: Duration = Duration::from_millis(20);

async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
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

/// What this run carries over from earlier ones, and saves for later ones.
#[derive(Default)]
struct Memory {
    boot_id: String,
    /// Closed windows of complete watching (earlier runs, and this run's
    /// before a ring-buffer loss).
    windows: Vec<Window>,
    /// Netns of saved bindings that the kernel says died while netreap was
    /// down.
    dead_while_down: Vec<crate::engine::observations::DeadNetns>,
    /// The ledger changed since the last save.
    dirty: bool,
}

impl Agent {
    /// Loads what an earlier run saved and asks the kernel what became of
    /// each netns it knew (after the model's first full sync).
    async fn remember(&mut self) {
        self.memory.boot_id = persist::boot_id();
        let knowledge = match persist::load(&self.config.state_dir) {
            Ok(Some(k)) => k,
            Ok(None) => return,
            Err(e) => {
                warn!("earlier knowledge not used: {e}");
                return;
            }
        };
        let snapshot = match self.model.snapshot().await {
            Ok(s) => s,
            Err(e) => {
                warn!("earlier knowledge not used: no model snapshot: {e}");
                return;
            }
        };
        let same_boot = !knowledge.boot_id.is_empty() && knowledge.boot_id == self.memory.boot_id;
        let known_good = snapshot.alive().find(|v| !v.host).and_then(|v| v.nsid);
        let mut querier = crate::netlink::query::Querier::open().ok();
        let mut nsid_exists = |nsid: i32| querier.as_mut().and_then(|q| q.nsid_exists(nsid, known_good).ok().flatten());
        let (mut alive, mut dead, mut unknown) = (0usize, 0usize, 0usize);
        let mut restored_attachments = Vec::with_capacity(knowledge.bindings.len());
        for saved in knowledge.bindings {
            let fate = restore::fate(&saved, knowledge.saved_at, same_boot, &snapshot, &mut nsid_exists);
            match &fate {
                Some(restore::Fate::Alive(_)) => alive += 1,
                Some(restore::Fate::Dead { .. }) => dead += 1,
                Some(restore::Fate::Unknown(_)) | None => unknown += 1,
            }
            let (attachment, died) = restore::restored(saved, fate.as_ref());
            if let Some(d) = died {
                if !self.memory.dead_while_down.iter().any(|x| x.id == d.id) {
                    let _ = self.events.emit(
                        SystemTime::now(),
                        "netns_died",
                        &json!({
                            "netns": d.id,
                            "netns_inode": d.id.inode,
                            "nsid": d.id.nsid,
                            "source": DeathSource::WhileDown,
                            "died_after": crate::telemetry::clock::rfc3339(d.died_at),
                            "bind_mounts": d.paths,
                            "container_ids": d.container_ids,
                            "same_boot": same_boot,
                        }),
                    );
                    self.memory.dead_while_down.push(d);
                } else if let Some(x) = self.memory.dead_while_down.iter_mut().find(|x| x.id == d.id) {
                    x.container_ids.extend(d.container_ids);
                }
            }
            restored_attachments.push(attachment);
        }
        self.ledger.restore(restored_attachments);
        self.memory.windows = knowledge.watched;
        info!(alive, dead, unknown, same_boot, "restored the bindings an earlier run saved");
        self.attachments_dirty = true;
        self.memory.dirty = true;
    }

    /// Saves the ledger with each binding's netns incarnation.
    async fn save_knowledge(&mut self) {
        let snapshot = match self.model.snapshot().await {
            Ok(s) => s,
            Err(e) => {
                warn!("knowledge not saved: no model snapshot: {e}");
                return;
            }
        };
        let now = SystemTime::now();
        let mut windows = self.memory.windows.clone();
        windows.push(Window { since: self.watching_since, until: now });
        let knowledge = restore::knowledge_of(
            &self.ledger,
            &snapshot,
            &self.memory.dead_while_down,
            self.memory.boot_id.clone(),
            windows,
            now,
        );
        if let Err(e) = persist::save(&self.config.state_dir, &knowledge) {
            warn!("knowledge not saved: {e}");
        }
    }

    /// Reacts to kernel records, deaths and timers until SIGINT or SIGTERM.
    async fn event_loop(
        &mut self,
        kernel: &mut KernelStream,
        deaths: &mut tokio::sync::mpsc::Receiver<NetnsDeath>,
        runtime_events: &mut tokio::sync::mpsc::Receiver<()>,
        release_results: &mut tokio::sync::mpsc::Receiver<ReleaseDone>,
    ) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let mut resync = tokio::time::interval(self.config.resync_interval);
        resync.tick().await;
        let mut housekeeping = tokio::time::interval(Duration::from_secs(1));
        // While some verdict waits for a grace to pass, look again sooner
        // than the resync interval.
        let recheck_every = (self.policy.in_flight_grace.min(self.policy.orphan_grace) / 4)
            .clamp(Duration::from_secs(1), self.config.resync_interval);
        let mut recheck = tokio::time::interval(recheck_every);
        // A finished CNI run may change verdicts; runs come in bursts (a
        // chain, a script's helpers, many pods), so their reconciles are
        // coalesced.
        let mut cni_reconcile_at: Option<tokio::time::Instant> = None;
        loop {
            let retry_at = self.gate.next_retry().map(tokio::time::Instant::from_std);
            tokio::select! {
                _ = sigterm.recv() => {
                    info!("SIGTERM: shutting down");
                    return self.finish_release(release_results).await;
                }
                _ = sigint.recv() => {
                    info!("SIGINT: shutting down");
                    return self.finish_release(release_results).await;
                }
                Some(done) = release_results.recv() => {
                    if self.on_release_done(done)? {
                        self.reconcile("release_done").await?;
                    }
                }
                () = sleep_until_some(retry_at), if retry_at.is_some() && self.releaser.is_some() => {
                    self.reconcile("release_retry").await?;
                }
                batch = kernel.next_batch() => {
                    if self.on_kernel_batch(batch?).await? {
                        cni_reconcile_at.get_or_insert_with(|| tokio::time::Instant::now() + CNI_EXIT_COALESCE);
                    }
                }
                () = sleep_until_some(cni_reconcile_at), if cni_reconcile_at.is_some() => {
                    cni_reconcile_at = None;
                    self.reconcile("cni_exit").await?;
                }
                death = deaths.recv() => {
                    let Some(death) = death else { anyhow::bail!("the netns model stopped") };
                    self.on_death(&death)?;
                    while let Ok(more) = deaths.try_recv() {
                        self.on_death(&more)?;
                    }
                    self.reconcile("netns_died").await?;
                    cni_reconcile_at = None;
                }
                Some(()) = runtime_events.recv() => {
                    while runtime_events.try_recv().is_ok() {}
                    self.reconcile("runtime_event").await?;
                }
                _ = resync.tick() => self.reconcile("interval").await?,
                _ = recheck.tick(), if self.waiting_for_grace() => self.reconcile("grace").await?,
                _ = housekeeping.tick() => self.housekeeping(kernel).await?,
            }
        }
    }

    /// Settles intents a previous run left without outcome, re-verified on
    /// fresh observations.
    async fn recover(&mut self) -> anyhow::Result<()> {
        let Some(releaser) = self.releaser.as_ref() else { return Ok(()) };
        if releaser.journal().pending().is_empty() {
            return Ok(());
        }
        let obs = self.observations().await?;
        let (now, policy) = (SystemTime::now(), self.policy);
        self.arm_last_look();
        let Some(mut releaser) = self.releaser.take() else { return Ok(()) };
        // Lock waits and fsyncs: on the blocking pool, so /healthz answers.
        let obs = Arc::new(obs);
        let seen = Arc::clone(&obs);
        let (releaser, records) = tokio::task::spawn_blocking(move || {
            let records = releaser.recover(|r| decide_one(&seen, r, now, &policy));
            (releaser, records)
        })
        .await?;
        self.releaser = Some(releaser);
        let records = records?;
        for record in &records {
            let pod = runtime::pod_of(&obs, &record.verdict.reservation.container_id);
            self.emit_release(record, "recovery", None, pod)?;
        }
        Ok(())
    }

    async fn observations(&mut self) -> anyhow::Result<crate::engine::Observations> {
        let snapshot = Arc::new(self.model.snapshot().await?);
        // A directory scan: on the blocking pool, not the event thread.
        let cache_dir = self.cache.clone();
        let cache = tokio::task::spawn_blocking(move || cache_dir.scan()).await?;
        let now = SystemTime::now();
        self.cache_first_seen.retain(|path, _| cache.attachments.iter().any(|a| &a.path == path));
        for a in &cache.attachments {
            self.cache_first_seen.entry(a.path.clone()).or_insert(now);
        }
        let obs = evidence::observations(
            &snapshot,
            &self.ledger,
            &cache.attachments,
            Some(self.watching_since),
            Some(&self.cache_first_seen),
        );
        let mut obs = obs;
        let view = self.runtime.view(&mut self.events, &self.metrics).await?;
        obs.set_runtime(view);
        obs.dead.extend(self.memory.dead_while_down.iter().cloned());
        obs.watched_before = self.memory.windows.iter().map(|w| (w.since, w.until)).collect();
        if let Some(k) = self.kube.as_mut() {
            k.observe(&mut obs, &self.ledger, &cache.attachments);
        }
        self.metrics.set_netns_alive(snapshot.alive().count() as u64);
        if let Ok(mut s) = self.state.lock() {
            s.model = Some(snapshot);
        }
        Ok(obs)
    }

    /// Returns whether a CNI operation finished (verdicts may change).
    async fn on_kernel_batch(
        &mut self,
        batch: Vec<Result<KernelEvent, crate::kernel::events::DecodeError>>,
    ) -> anyhow::Result<bool> {
        let mut decoded = Vec::with_capacity(batch.len());
        let mut cni_finished = false;
        for record in batch {
            match record {
                Ok(event) => {
                    if !self.admit_cni_run(&event)? {
                        self.events.emit(self.clock.wall(event.task().ktime_ns), event.name(), &event)?;
                        decoded.push(event);
                        continue;
                    }
                    if let (Some(k), KernelEvent::CniExec { task, exec }) = (self.kube.as_mut(), &event)
                        && let Some(cid) = exec.container_id.as_ref().filter(|c| !c.truncated)
                    {
                        k.on_cni_exec(task.tgid, &cid.value);
                    }
                    if let KernelEvent::CniExit { task, exit } = &event {
                        tracing::debug!(
                            pid = task.tgid,
                            ?exit,
                            known = self.ledger.is_running(task.tgid),
                            "cni exit record"
                        );
                    }
                    let clock = self.clock;
                    if let Some(att) = self.ledger.observe(&event, |k| clock.wall(k), &self.resolver)
                        && let KernelEvent::CniExit { task, .. } = &event
                    {
                        if let Some(op) = att.operations.iter().rev().find(|op| op.pid == task.tgid) {
                            self.metrics.cni_operation(&op.command, op.result());
                        }
                        cni_finished = true;
                    }
                    self.events.emit(self.clock.wall(event.task().ktime_ns), event.name(), &event)?;
                    decoded.push(event);
                }
                Err(e) => {
                    warn!("malformed kernel record skipped: {e}");
                    self.events.emit(SystemTime::now(), "malformed_record", &json!({ "error": e.to_string() }))?;
                }
            }
        }
        if !decoded.is_empty() {
            self.model.kernel_events(decoded).await?;
            // Rendered for /state at most once a second (housekeeping).
            self.attachments_dirty = true;
            self.memory.dirty = true;
        }
        Ok(cni_finished)
    }

    /// The CNI-run filter, before the ledger: false for an exec record that
    /// is not a CNI plugin run (reported as an anomaly; the ledger never
    /// sees it). A run whose environment scan was cut short is counted.
    fn admit_cni_run(&mut self, event: &KernelEvent) -> anyhow::Result<bool> {
        let KernelEvent::CniExec { task, exec } = event else { return Ok(true) };
        if let Err(anomaly) = self.cni_filter.admit(event) {
            self.metrics.cni_exec_anomaly(anomaly.reason());
            // Logged once per (reason, binary): plugins' helper processes
            // (iptables, sh) inherit CNI_COMMAND and would flood the log.
            let first = self.cni_anomalies_logged.len() < MAX_LOGGED_CNI_ANOMALIES
                && self.cni_anomalies_logged.insert((anomaly.reason(), anomaly.binary().to_owned()));
            if first {
                warn!(pid = task.tgid, comm = %task.comm, "not a CNI run, ignored: {anomaly}");
            } else {
                tracing::debug!(pid = task.tgid, comm = %task.comm, "not a CNI run, ignored: {anomaly}");
            }
            self.events.emit(
                self.clock.wall(task.ktime_ns),
                "cni_exec_anomaly",
                &json!({
                    "pid": task.tgid,
                    "comm": task.comm,
                    "anomaly": anomaly,
                    "command": exec.command.value,
                    "container_id": exec.container_id.as_ref().map(|v| &v.value),
                    "uid": exec.uid,
                }),
            )?;
            return Ok(false);
        }
        if exec.env_scan_limited {
            self.metrics.cni_env_scan_limited();
            warn!(
                pid = task.tgid,
                binary = %exec.binary.value,
                scanned = exec.env_scanned,
                "the kernel read only part of this CNI run's environment: kept as unknown, in flight"
            );
        }
        Ok(true)
    }

    fn on_death(&mut self, death: &NetnsDeath) -> anyhow::Result<()> {
        self.metrics.netns_destroyed();
        let containers = evidence::containers_of_death(&self.ledger, &[], death);
        let addresses: Vec<String> = death.addresses.iter().map(|a| a.ip.to_string()).collect();
        info!(inode = ?death.inode, nsid = ?death.nsid, source = ?death.source, ?addresses, "netns died");
        self.events.emit(
            death.at,
            "netns_died",
            &json!({
                "netns": death.id(),
                "netns_inode": death.inode,
                "nsid": death.nsid,
                "source": death.source,
                "addresses": addresses,
                "bind_mounts": death.bind_mounts,
                "container_ids": containers,
                "creator": death.creator,
            }),
        )?;
        Ok(())
    }

    /// Renders the ledger for /state when it changed.
    fn publish_attachments(&mut self) {
        if std::mem::take(&mut self.attachments_dirty)
            && let Ok(mut s) = self.state.lock()
        {
            s.attachments = Arc::new(self.ledger.snapshot());
        }
    }

    async fn housekeeping(&mut self, kernel: &mut KernelStream) -> anyhow::Result<()> {
        self.publish_attachments();
        if std::mem::take(&mut self.memory.dirty) {
            self.save_knowledge().await;
        }
        let dropped = kernel.new_drops()?;
        if dropped > 0 {
            // Something may be missing from the ledger: from now on, youth
            // grace again, and re-read the model.
            warn!(dropped, "ring buffer full: kernel records lost; resyncing");
            let now = SystemTime::now();
            self.memory.windows.push(Window { since: self.watching_since, until: now });
            self.watching_since = now;
            self.metrics.ringbuf_drops(dropped);
            self.metrics.resync("ringbuf_drop");
            self.events.emit(SystemTime::now(), "records_dropped", &json!({ "dropped": dropped }))?;
            self.model.resync().await?;
        }
        let vanished =
            self.ledger.reap_vanished(SystemTime::now(), |pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
        if vanished > 0 {
            self.reconcile("cni_exit_unobserved").await?;
        }
        Ok(())
    }

    /// One full pass: observe, decide, release what is orphaned, report.
    async fn reconcile(&mut self, reason: &str) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        let obs = self.observations().await?;
        let stores = self.stores.clone();
        let mut scan = tokio::task::spawn_blocking(move || {
            let stores: Vec<&dyn ReservationStore> = stores.iter().map(|s| s as &dyn ReservationStore).collect();
            scan_all(&stores)
        })
        .await?;
        let now = SystemTime::now();
        let mut verdicts = decide(&obs, &scan.reservations, now, &self.policy);
        // whereabouts verdicts follow the host-local ones; each store's
        // releaser gets only its own.
        let local = verdicts.len();
        if let Some(k) = &self.kube {
            verdicts.extend(k.decide(&obs, now, &self.policy));
            scan.anomalies.extend_from_slice(k.anomalies());
        }
        self.report_anomalies(&scan.anomalies)?;
        self.report_changes(&verdicts, &obs)?;
        // host-local on the blocking pool (records come back to
        // `on_release_done`); whereabouts here, with its own last look.
        self.start_release(&verdicts[..local], &obs);
        if self.kube.is_some() {
            let policy = self.policy;
            let mut look = self.kernel_look();
            let reverify = |r: &crate::ipam::Reservation| decide_one(&obs, r, SystemTime::now(), &policy);
            let mut records = Vec::new();
            if let Some(k) = self.kube.as_mut() {
                records = k.release(&verdicts[local..], reverify, &mut look).await?;
                k.notify(&verdicts, &records, &self.ledger);
            }
            for record in &records {
                let died_at = report::death_time(&record.verdict);
                let pod = runtime::pod_of(&obs, &record.verdict.reservation.container_id).cloned();
                self.emit_release(record, report::release_reason(&record.verdict), died_at, pod.as_ref())?;
            }
        }
        self.runtime.report_stuck(&obs, &mut self.events, &self.metrics)?;
        self.metrics.replace_reservations(report::counts(&verdicts).iter().map(|((n, s), c)| (n.as_str(), *s, *c)));
        let count = verdicts.len();
        if let Ok(mut s) = self.state.lock() {
            s.verdicts = Arc::new(verdicts);
            s.runtime = obs.runtime;
        }
        self.publish_attachments();
        tracing::debug!(reason, reservations = count, took_ms = started.elapsed().as_millis() as u64, "reconciled");
        Ok(())
    }

    /// Hands the orphans the retry gate admits to a release batch on the
    /// blocking pool (flock waits and fsyncs stay off the event thread); its
    /// records come back through `release_done`. One batch at a time: while
    /// one runs, orphans wait for the reconcile that follows it.
    fn start_release(&mut self, verdicts: &[Verdict], obs: &crate::engine::Observations) {
        if self.releaser.is_none() {
            self.release_waiting |= verdicts.iter().any(Verdict::is_orphaned);
            return;
        }
        let admitted = self.gate.admit(verdicts, std::time::Instant::now());
        if admitted.is_empty() {
            return;
        }
        self.arm_last_look();
        let Some(mut releaser) = self.releaser.take() else { return };
        // The runtime's names of the pods, for the release events.
        let pods: HashMap<String, crate::engine::PodRef> = admitted
            .iter()
            .filter_map(|v| {
                let id = &v.reservation.container_id;
                runtime::pod_of(obs, id).map(|p| (id.clone(), p.clone()))
            })
            .collect();
        // The releaser acts on every orphan it is given and reads the
        // others only as context (which IPs an attachment still holds), so
        // orphans the gate holds back go in as context, marked pending.
        let admitted_paths: std::collections::HashSet<&PathBuf> =
            admitted.iter().map(|v| &v.reservation.path).collect();
        let batch: Vec<Verdict> = verdicts
            .iter()
            .map(|v| {
                let mut v = v.clone();
                if v.is_orphaned() && !admitted_paths.contains(&v.reservation.path) {
                    v.status = Status::Pending;
                }
                v
            })
            .collect();
        let done = self.release_done.clone();
        tokio::task::spawn_blocking(move || {
            let result = releaser.release_orphaned(&batch);
            // The receiver lives as long as the event loop; if it is gone
            // the agent is stopping and the journal already holds the truth.
            let _ = done.blocking_send(ReleaseDone { releaser, admitted, pods, result });
        });
    }

    /// Takes a finished batch back: reports its records, updates the retry
    /// gate. Returns whether orphans waited for it (reconcile again).
    fn on_release_done(&mut self, done: ReleaseDone) -> anyhow::Result<bool> {
        let ReleaseDone { releaser, admitted, pods, result } = done;
        self.releaser = Some(releaser);
        let records = match result {
            Ok(records) => records,
            Err(e) => {
                self.gate.settle(&admitted, &[], std::time::Instant::now());
                return Err(e.into());
            }
        };
        self.gate.settle(&admitted, &records, std::time::Instant::now());
        for record in &records {
            let died_at = report::death_time(&record.verdict);
            let pod = pods.get(&record.verdict.reservation.container_id);
            self.emit_release(record, report::release_reason(&record.verdict), died_at, pod)?;
        }
        Ok(std::mem::take(&mut self.release_waiting))
    }

    /// At shutdown: waits for a running batch, so its outcomes are reported
    /// (they are journaled either way).
    async fn finish_release(&mut self, results: &mut tokio::sync::mpsc::Receiver<ReleaseDone>) -> anyhow::Result<()> {
        if self.releaser.is_none()
            && let Some(done) = results.recv().await
        {
            self.on_release_done(done)?;
        }
        Ok(())
    }

    /// Some reservation is pending: a grace may expire before the next resync.
    fn waiting_for_grace(&self) -> bool {
        self.verdicts.values().any(|s| *s == Status::Pending)
    }

    /// Entries that are not reservations: reported once each, never touched.
    fn report_anomalies(&mut self, anomalies: &[crate::ipam::Anomaly]) -> anyhow::Result<()> {
        let mut current = std::collections::HashSet::with_capacity(anomalies.len());
        for a in anomalies {
            if !self.anomalies.contains(&a.path) {
                warn!(path = %a.path, kind = ?a.kind, "not a reservation, left untouched: {}", a.detail);
                self.events.emit(SystemTime::now(), "anomaly", a)?;
            }
            current.insert(a.path.clone());
        }
        self.anomalies = current;
        Ok(())
    }

    fn report_changes(&mut self, verdicts: &[Verdict], obs: &crate::engine::Observations) -> anyhow::Result<()> {
        let mut seen = HashMap::with_capacity(verdicts.len());
        for v in verdicts {
            let key = v.reservation.path.clone();
            let before = self.verdicts.get(&key).copied();
            if before != Some(v.status) {
                let pod = runtime::pod_of(obs, &v.reservation.container_id);
                self.events.emit(
                    SystemTime::now(),
                    "verdict_changed",
                    &report::with_pod(report::verdict_changed(v, before), pod),
                )?;
                if v.status == Status::Conflict {
                    self.metrics.conflict();
                    warn!(ip = %v.reservation.ip, network = %v.reservation.network, "conflict: {}", v.summary);
                    self.events.emit(SystemTime::now(), "conflict", &report::with_pod(report::conflict(v), pod))?;
                }
            }
            seen.insert(key, v.status);
        }
        self.verdicts = seen;
        Ok(())
    }

    /// Gives the releaser a fresh last look: the kernel, asked about every
    /// netns the model knows alive and any process netns it does not, and
    /// the ledger's runs in flight.
    fn arm_last_look(&mut self) {
        let look = self.kernel_look();
        if let Some(releaser) = self.releaser.as_mut() {
            releaser.set_last_look(Box::new(look));
        }
    }

    /// A last look for one batch of releases, with the model's netns.
    fn kernel_look(&self) -> crate::release::lastlook::KernelLook {
        let (mut nsids, mut inodes) = (Vec::new(), std::collections::HashSet::new());
        if let Ok(s) = self.state.lock()
            && let Some(model) = &s.model
        {
            for v in model.alive().filter(|v| !v.host) {
                nsids.extend(v.nsid);
                inodes.extend(v.inode.map(u64::from));
            }
            inodes.extend(model.alive().filter(|v| v.host).filter_map(|v| v.inode.map(u64::from)));
        }
        let in_flight = self.ledger.attachments().filter(|a| a.in_flight()).map(|a| a.container_id.clone()).collect();
        let bin_dirs = self.config.cni_bin_dirs.clone();
        crate::release::lastlook::KernelLook::new(nsids, inodes, in_flight, bin_dirs)
    }

    fn emit_release(
        &mut self,
        record: &ReleaseRecord,
        reason: &str,
        died_at: Option<SystemTime>,
        pod: Option<&crate::engine::PodRef>,
    ) -> anyhow::Result<()> {
        let now = SystemTime::now();
        let latency = died_at.and_then(|d| now.duration_since(d).ok());
        let outcome = report::outcome_label(&record.outcome);
        self.metrics.release(reason, outcome);
        if record.outcome.released()
            && let Some(latency) = latency
        {
            self.metrics.observe_death_to_release(latency);
        }
        let r = &record.verdict.reservation;
        let pod_name = pod.map(ToString::to_string);
        if matches!(record.outcome, crate::release::Outcome::LockBusy { .. }) {
            warn!(ip = %r.ip, network = %r.network, container = %r.container_id, pod = pod_name, reason, "release: {}", record.outcome);
        } else {
            info!(ip = %r.ip, network = %r.network, container = %r.container_id, pod = pod_name, reason, "release: {}", record.outcome);
        }
        self.events.emit(now, "release", &report::with_pod(report::release(record, reason, latency), pod))?;
        if let crate::release::Outcome::LastLookKept { found, ip_configured: true } = &record.outcome {
            // The model said no live netns holds the IP; the kernel, asked
            // under the lock, said one does: both views, one event.
            self.metrics.conflict();
            warn!(ip = %r.ip, network = %r.network, "conflict at the last look: {found}");
            self.events.emit(
                now,
                "conflict",
                &json!({
                    "network": r.network,
                    "ip": r.ip,
                    "reserved_by": r.container_id,
                    "stage": "last_look",
                    "evidence": record.verdict.evidence.iter().map(|e| e.text.clone()).collect::<Vec<_>>(),
                    "kernel_view": found,
                }),
            )?;
        }
        Ok(())
    }
}
