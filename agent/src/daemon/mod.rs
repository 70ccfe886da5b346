//! `netreap run`: the agent. Kernel events feed the ledger and the model
//! (`ingest`); deaths, finished CNI runs, the runtime's events and timers
//! (`triggers`) start a reconcile, which observes, decides and releases and
//! returns what it found (`reconcile`); `publish` tells the world: logs,
//! events, metrics and `/state`.

pub mod evidence;
mod ingest;
mod knowledge;
pub mod oneshot;
mod publish;
mod reconcile;
pub mod restore;
mod runtime;
mod targeted;
mod triggers;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use tokio::signal::unix::SignalKind;
use tracing::info;

pub use self::publish::log_probe_status;
use self::{
    knowledge::Memory,
    publish::StateDoc,
    reconcile::ReleaseDone,
    triggers::{Reason, Triggers},
};
use crate::{
    config::Config,
    engine::{Policy, Status},
    ipam::{
        cnicache::{CacheReader, CniCache},
        hostlocal::HostLocalStore,
    },
    kernel::{cni_runs::CniRunFilter, probes::Probes, stream::KernelStream},
    ledger::{Ledger, StatResolver},
    model::{ModelHandle, Watcher, WatcherConfig, snapshot::NetnsDeath},
    release::{Releaser, ReleaserConfig, retry::RetryGate},
    telemetry::{clock::Clock, metrics::Metrics, stream::EventStream},
};

/// Test-only failure injection (agent killed between intent and unlink):
/// when set to 1 the process aborts right after the first intent is fsync'd.
pub const CRASH_AFTER_INTENT_ENV: &str = "NETREAP_TEST_CRASH_AFTER_INTENT";

/// Measurement only: when set to 1 every death runs a full reconcile, as
/// before the death path existed (the latency bench compares both in one
/// binary, on one machine's load).
pub const FULL_RECONCILE_PER_DEATH_ENV: &str = "NETREAP_BENCH_FULL_RECONCILE_PER_DEATH";

struct Agent {
    config: Config,
    policy: Policy,
    clock: Clock,
    events: EventStream,
    metrics: Metrics,
    ledger: Ledger,
    model: ModelHandle,
    stores: Vec<HostLocalStore>,
    /// The CNI cache, read again only where its files changed (shared
    /// with the blocking pool, where it is scanned).
    cache: Arc<Mutex<CacheReader>>,
    /// What the last full pass found, for the death path.
    known: targeted::Known,
    /// None while a release batch runs on the blocking pool (it owns it).
    releaser: Option<Releaser>,
    /// Which orphans to attempt now: once per verdict change, failures
    /// with back-off.
    gate: RetryGate,
    /// Where a finished release batch reports.
    release_done: tokio::sync::mpsc::Sender<ReleaseDone>,
    /// Orphans were found while a batch ran: reconcile again when it ends.
    release_waiting: bool,
    /// A death pass's publishing, waiting for its release batch.
    deferred: Option<reconcile::Deferred>,
    /// The probes have recorded every CNI run since then (reset by a loss).
    watching_since: SystemTime,
    /// The last verdict of each reservation, by its file.
    verdicts: HashMap<std::path::PathBuf, Status>,
    /// When this agent first saw each CNI cache entry.
    cache_first_seen: evidence::FirstSeen,
    /// The cache scan `cache_first_seen` was last brought up to date with.
    cache_dated: Option<Arc<crate::ipam::cnicache::CacheScan>>,
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
    /// The configured mount table and the host's root, found once (each
    /// last look is given them).
    discovery: crate::discovery::DiscoveryPaths,
    /// Every death runs a full reconcile ([`FULL_RECONCILE_PER_DEATH_ENV`]).
    full_reconcile_per_death: bool,
    /// Anomalies already reported (path), so each is reported once.
    anomalies: std::collections::HashSet<String>,
    state: Arc<Mutex<StateDoc>>,
    /// The Kubernetes API (pods, whereabouts, Events), when configured.
    kube: Option<crate::kube::agent::KubeAgent>,
    runtime: runtime::RuntimeSource,
    /// When to reconcile next, and why.
    triggers: Triggers,
    /// CNI run processes found gone at the last housekeeping tick.
    gone_at_last_tick: std::collections::HashSet<u32>,
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    use anyhow::Context as _;

    let metrics = Metrics::new(env!("CARGO_PKG_VERSION"));
    let events = EventStream::open_rotating(&config.events, config.events_max_bytes, config.events_keep)
        .context("opening the event stream")?;
    let state = Arc::new(Mutex::new(StateDoc::default()));
    let endpoint = publish::serve_endpoint(&config, &metrics, &state).await?;

    let probe_options = crate::kernel::probes::ProbeOptions { attribution: config.probes.attribution };
    let mut probes = Probes::load_configured(probe_options).context("loading the eBPF probes")?;
    log_probe_status(&probes);
    if let Ok(mut s) = state.lock() {
        s.probes.clone_from(&probes.status);
    }
    let watching_since = SystemTime::now();
    let mut kernel = KernelStream::new(&mut probes).context("reading the probes' ring buffer")?;

    let discovery = crate::discovery::DiscoveryPaths::with_mountinfo(config.mountinfo.clone());
    let watcher_config = WatcherConfig {
        resync_interval: config.resync_interval,
        discovery: discovery.clone(),
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
        cache: Arc::new(Mutex::new(CacheReader::new(CniCache::new(config.cni_cache_dir.clone())))),
        known: targeted::Known::default(),
        releaser: Some(Releaser::new(journal, releaser_config)),
        gate: RetryGate::new(),
        release_done,
        release_waiting: false,
        deferred: None,
        watching_since,
        verdicts: HashMap::new(),
        cache_first_seen: evidence::FirstSeen::default(),
        cache_dated: None,
        anomalies: std::collections::HashSet::new(),
        full_reconcile_per_death: std::env::var(FULL_RECONCILE_PER_DEATH_ENV).is_ok_and(|v| v == "1"),
        cni_filter: CniRunFilter::new(&config.cni_bin_dirs),
        cni_anomalies_logged: std::collections::HashSet::new(),
        attachments_dirty: false,
        memory: Memory::default(),
        // The host root found once, with the discovery paths.
        resolver: StatResolver::new(discovery.host_root.clone()),
        discovery,
        state,
        runtime: runtime::RuntimeSource::new(config.cri_socket.clone()),
        triggers: Triggers::default(),
        gone_at_last_tick: std::collections::HashSet::new(),
        config,
        kube,
    };

    agent.remember().await;
    agent.recover().await?;
    agent.catch_up(&mut kernel).await?;
    agent.reconcile(Reason::Startup).await?;
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
    endpoint.stop().await;
    info!("probes detached, journal and event stream flushed; bye");
    Ok(())
}

impl Agent {
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
        let mut housekeeping = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            let retry_at = self.gate.next_retry().map(tokio::time::Instant::from_std);
            let (coalesced_at, requeue_at) = (self.triggers.coalesced_at(), self.triggers.requeue_at());
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
                    self.catch_up(kernel).await?;
                    if self.on_release_done(done)? {
                        self.reconcile(Reason::ReleaseDone).await?;
                    }
                }
                () = triggers::sleep_until_some(retry_at), if retry_at.is_some() && self.releaser.is_some() => {
                    self.catch_up(kernel).await?;
                    self.reconcile(Reason::ReleaseRetry).await?;
                }
                batch = kernel.next_batch() => self.on_kernel_batch(batch?).await?,
                () = triggers::sleep_until_some(coalesced_at), if coalesced_at.is_some() => {
                    self.catch_up(kernel).await?;
                    self.reconcile(Reason::CniExit).await?;
                }
                death = deaths.recv() => {
                    let Some(death) = death else { anyhow::bail!("the netns model stopped") };
                    self.catch_up(kernel).await?;
                    let (containers, mut runs_concerned) = self.on_death(&death);
                    let mut died = vec![(death, containers)];
                    while let Ok(more) = deaths.try_recv() {
                        let (containers, concerned) = self.on_death(&more);
                        runs_concerned |= concerned;
                        died.push((more, containers));
                    }
                    self.triggers.netns_died(runs_concerned);
                    if self.full_reconcile_per_death {
                        for (death, containers) in &died {
                            self.publish_death(death, containers)?;
                        }
                        self.reconcile(Reason::NetnsDied).await?;
                    } else {
                        self.reconcile_deaths(died).await?;
                    }
                }
                Some(()) = runtime_events.recv() => {
                    while runtime_events.try_recv().is_ok() {}
                    self.catch_up(kernel).await?;
                    self.reconcile(Reason::RuntimeEvent).await?;
                }
                () = triggers::sleep_until_some(requeue_at), if requeue_at.is_some() => {
                    self.catch_up(kernel).await?;
                    self.reconcile(Reason::Requeue).await?;
                }
                _ = resync.tick() => {
                    self.catch_up(kernel).await?;
                    self.reconcile(Reason::Interval).await?;
                }
                _ = housekeeping.tick() => self.housekeeping(kernel).await?,
            }
        }
    }
}
