//! One pass: observe, decide, release what is orphaned. It returns what it
//! found and did ([`Reconciled`]) and writes nothing the world reads: no
//! log, event, metric or `/state` (that is `publish`).

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::{Instant, SystemTime},
};

use super::{
    Agent,
    evidence::{self, Concern, PassIndex, Scope},
    runtime::{self, SourceChange, StuckChanges},
    targeted::{self, DeathKey},
    triggers::{self, Reason},
};
use crate::{
    engine::{Observations, PodRef, Status, Verdict, decide, decide_one},
    ipam::{
        Anomaly, Reservation, ReservationStore, StoreScan, cnicache::CacheScan, hostlocal::HostLocalStore, scan_all,
    },
    model::snapshot::{ModelSnapshot, NetnsDeath},
    release::{ReleaseError, ReleaseRecord, Releaser, lastlook::KernelLook},
    telemetry::event::ReleaseReason,
};

/// A full pass walks the whole node unless the netns the model knows and
/// the containers the ledger holds outnumber the containers it judges this
/// many times: under churn, minutes of dead netns and runs against a few
/// pods; at rest, about two per pod.
const HISTORY_PER_CONTAINER: usize = 4;

/// The reservations a death concerns: its containers and IPs, with those
/// of the candidate files found for them (a file found by IP names its
/// owner, whose evidence its verdict reads).
fn concern_of(containers: &HashSet<String>, ips: &HashSet<IpAddr>, candidates: &[Reservation]) -> Concern {
    let mut concern = Concern { containers: containers.clone(), ips: ips.clone(), sandbox_paths: Vec::new() };
    concern.containers.extend(candidates.iter().map(|r| r.container_id.to_string()));
    concern.ips.extend(candidates.iter().map(|r| r.ip));
    concern
}

/// A verdict whose status changed (or that was first seen).
pub(super) struct Change {
    /// Into [`Reconciled::verdicts`].
    pub index: usize,
    pub before: Option<Status>,
    pub pod: Option<PodRef>,
}

/// What a reconcile found and did.
pub(super) struct Reconciled {
    pub reason: Reason,
    pub started: Instant,
    pub verdicts: Vec<Verdict>,
    pub changed: Vec<Change>,
    /// Entries that are not reservations, not reported before.
    pub new_anomalies: Vec<Anomaly>,
    /// whereabouts releases (host-local ones come back later, from the
    /// blocking pool, through [`ReleaseDone`]).
    pub whereabouts: Vec<ReleaseRecord>,
    pub observed: Observed,
    /// When a pending verdict wants another look.
    pub requeue: Option<SystemTime>,
}

/// The sources of one pass's observations, read together.
pub(super) struct Sources {
    snapshot: Arc<ModelSnapshot>,
    /// The CNI cache: shared with the reader, which gives the same scan
    /// again while no entry changed.
    cache: Arc<CacheScan>,
    runtime: Option<crate::engine::RuntimeView>,
    source_changed: Option<SourceChange>,
}

/// What observing found besides the observations themselves.
pub(super) struct Observed {
    pub snapshot: Arc<ModelSnapshot>,
    pub runtime: Option<crate::engine::RuntimeView>,
    pub source_changed: Option<SourceChange>,
    pub stuck: Option<StuckChanges>,
}

/// Which reservations a pass judged: the retry gate forgets only what a
/// pass judged and found no longer orphaned.
#[derive(Debug, Clone, Copy)]
enum Judged {
    /// A full reconcile: every reservation.
    All,
    /// A targeted pass: only those it was given.
    These,
}

/// What a death pass tells the world (its deaths, the verdicts that
/// changed, the model it saw), held back while the release it handed off
/// runs: written at once, those lines and their JSON kept the event loop
/// on its core while the release thread and the intents' fsync waited for
/// one (2-core node). Published at the next turn of the event loop (the
/// batch's report, or anything else first; the one-second tick at the
/// latest), before whatever that turn publishes.
pub(super) struct Deferred {
    /// Each death with the containers bound to it.
    deaths: Vec<(NetnsDeath, Vec<String>)>,
    /// How long the pass took, up to the hand-off.
    took: std::time::Duration,
    verdicts: Vec<Verdict>,
    changed: Vec<Change>,
    observed: Observed,
}

/// A release batch that ran on the blocking pool, with the releaser back.
pub(super) struct ReleaseDone {
    releaser: Releaser,
    admitted: Vec<Verdict>,
    /// The runtime's pod of each admitted container, when it names one.
    pods: HashMap<String, PodRef>,
    result: Result<Vec<ReleaseRecord>, ReleaseError>,
}

impl Agent {
    /// Reconciles and reports.
    pub(super) async fn reconcile(&mut self, reason: Reason) -> anyhow::Result<()> {
        let started = Instant::now();
        // The sources first, then the stores (the order the death path reads
        // them in): a reservation made after the snapshot is judged without
        // its netns, which keeps it.
        let sources = self.gather().await?;
        let scan = self.scan_stores().await?;
        let (obs, observed) = self.observe_reserved(sources, &scan);
        let reconciled = self.reconcile_quietly(reason, started, obs, observed, scan).await?;
        let waiting = triggers::Waiting::of(&reconciled.verdicts);
        self.triggers.reconciled(reconciled.requeue, waiting, self.ledger.any_running());
        self.triggers.full_pass_took(reconciled.started.elapsed());
        self.publish_reconciled(reconciled)
    }

    /// The death path (module `targeted`): judges only the reservations
    /// these deaths concern, on observations of what those reservations
    /// touch (built from fresh sources, as a full reconcile would, but only
    /// the part their verdicts read), hands their orphans to the releaser,
    /// and asks for a full reconcile soon after. When the last full pass may
    /// have missed a reservation of a concerned container (a CNI run of it
    /// since: every pod's own ADD, under churn), the stores are scanned
    /// again first, as a full pass would scan them.
    /// `deaths`: each with the containers bound to it. When the pass
    /// hands a release batch off, what it tells the world waits for that
    /// batch ([`Deferred`]).
    pub(super) async fn reconcile_deaths(&mut self, deaths: Vec<(NetnsDeath, Vec<String>)>) -> anyhow::Result<()> {
        let started = Instant::now();
        // The model's snapshot as it sent these deaths (or later), when no
        // pass took it yet. It lacks what the model read after them (the
        // dead pod's veth and address deletions, netns found since): the
        // verdicts lean on what it shows alive, and the last look, under
        // the lock, asks the kernel again about every IP it would free,
        // finding any netns this snapshot does not know.
        let at_death = self.model.snapshot_at_death();
        let sources = self.gather_with(at_death).await?;
        let keys: Vec<DeathKey> = deaths.iter().map(|(d, _)| DeathKey::from(d)).collect();
        // Indexed once: the concern and its observations look up the few
        // netns, attachments and cache entries they touch in it.
        let index = PassIndex::new(&sources.snapshot, &self.ledger, &sources.cache.attachments);
        let (containers, ips) = targeted::concerned(&index, &self.memory.dead_while_down, &keys);
        let mut candidates = targeted::candidates(&self.known, &containers, &ips);
        let mut concern = concern_of(&containers, &ips, &candidates);
        // The runs alone decide whether the stores are read again: the
        // observations are built once, for the concern that reading gives.
        let mut runs = Some(evidence::cni_ops_in(&self.ledger, Scope::Concerning(&concern)));
        let owners: Vec<&str> = concern.containers.iter().map(String::as_str).collect();
        if targeted::may_have_missed(runs.as_deref().unwrap_or_default(), &self.known, &owners) {
            // What the last full pass found may lack what those runs wrote.
            // Only the stores are read again (after the sources, in the
            // order a full pass reads them): the observations a full pass
            // would build for the whole node are not needed to judge these
            // reservations (a verdict reads only its own part of them), and
            // the full pass follows within a second.
            // (The stores alone: the index stays valid.)
            scan_stores_into(self.stores.clone(), &mut self.known).await?;
            candidates = targeted::candidates(&self.known, &containers, &ips);
            concern = concern_of(&containers, &ips, &candidates);
            // Its containers may have grown: the runs are asked again.
            runs = None;
        }
        let (watching, first_seen) = (Some(self.watching_since), Some(&self.cache_first_seen));
        // The candidates' files as they are now (before the observations: a
        // verdict is only wanted for a file that is still a reservation).
        let reservations = if candidates.len() <= targeted::INLINE_REREAD_LIMIT {
            targeted::reread(&candidates)
        } else {
            tokio::task::spawn_blocking(move || targeted::reread(&candidates)).await?
        };
        // A file rewritten since the full pass may name another owner: its
        // verdict needs that owner's evidence too.
        let widened = reservations
            .iter()
            .filter(|r| !concern.containers.contains(r.container_id.as_str()) || !concern.ips.contains(&r.ip))
            .map(|r| (r.container_id.to_string(), r.ip))
            .collect::<Vec<_>>();
        if !widened.is_empty() {
            for (container, ip) in widened {
                concern.containers.insert(container);
                concern.ips.insert(ip);
            }
            // Runs of the containers added are wanted too.
            runs = None;
        }
        let obs = if reservations.is_empty() {
            // No reservation of what the deaths concern is left (every pod
            // whose DEL ran): no verdict to make, so none of the evidence a
            // verdict reads is gathered. Under churn a death can concern
            // thousands of old runs' containers (those whose netns the model
            // no longer knows may be any netns of their inode).
            Observations { watching_since: watching, ..Observations::default() }
        } else {
            let sandboxed = concern.with_sandboxes(sources.runtime.as_ref());
            index.observations_with(watching, first_seen, &sandboxed, runs)
        };
        drop(index);
        self.scan_pools(&sources);
        let obs = self.completed(obs, sources.runtime.clone());
        let now = SystemTime::now();
        let verdicts = decide(&obs, &reservations, now, &self.policy);
        let changed = self.changes_among(&verdicts, &obs);
        let handed_off = self.start_release(&verdicts, &obs, &sources.snapshot, Judged::These);
        self.triggers.targeted(triggers::Waiting::of(&verdicts));
        let runtime = obs.runtime.clone();
        let Sources { snapshot, source_changed, .. } = sources;
        let observed = Observed { snapshot, runtime, source_changed, stuck: None };
        let pass = Deferred { deaths, took: started.elapsed(), verdicts, changed, observed };
        if handed_off {
            self.deferred = Some(pass);
            Ok(())
        } else {
            self.publish_pass(pass)
        }
    }

    /// Publishes a death pass held back while its release ran: before
    /// anything else is published (the order of the lines is kept), and at
    /// the latest when the batch reports.
    pub(super) fn publish_deferred(&mut self) -> anyhow::Result<()> {
        match self.deferred.take() {
            Some(pass) => self.publish_pass(pass),
            None => Ok(()),
        }
    }

    fn publish_pass(&mut self, pass: Deferred) -> anyhow::Result<()> {
        let Deferred { deaths, took, verdicts, changed, observed } = pass;
        for (death, containers) in &deaths {
            self.publish_death(death, containers)?;
        }
        self.publish_targeted(took, &verdicts, &changed)?;
        self.publish_observed(observed)
    }

    async fn reconcile_quietly(
        &mut self,
        reason: Reason,
        started: Instant,
        obs: Observations,
        observed: Observed,
        mut scan: StoreScan,
    ) -> anyhow::Result<Reconciled> {
        let now = SystemTime::now();
        let mut verdicts = decide(&obs, &scan.reservations, now, &self.policy);
        // whereabouts verdicts follow the host-local ones; each store's
        // releaser gets only its own.
        let local = verdicts.len();
        if let Some(k) = &self.kube {
            verdicts.extend(k.decide(&obs, now, &self.policy));
            scan.anomalies.extend_from_slice(k.anomalies());
        }
        let new_anomalies = self.new_anomalies(scan.anomalies);
        let changed = self.changes(&verdicts, &obs);
        // host-local on the blocking pool (records come back to
        // `on_release_done`); whereabouts here, with its own last look.
        self.start_release(&verdicts[..local], &obs, &observed.snapshot, Judged::All);
        let mut whereabouts = Vec::new();
        if self.kube.is_some() {
            let policy = self.policy;
            let mut look = self.kernel_look(&observed.snapshot);
            let reverify = |r: &crate::ipam::Reservation| decide_one(&obs, r, SystemTime::now(), &policy);
            if let Some(k) = self.kube.as_mut() {
                whereabouts = k.release(&verdicts[local..], reverify, &mut look).await?;
            }
        }
        // Without its events, only asking the runtime again shows a sandbox
        // it is done with: look again at the old pace while one is pending.
        let poll = obs.runtime.is_some().then(|| self.runtime_poll());
        let requeue = triggers::next_recheck(&verdicts, now, &self.policy, poll);
        Ok(Reconciled { reason, started, verdicts, changed, new_anomalies, whereabouts, observed, requeue })
    }

    /// Scans every host-local store and keeps what it found for the death
    /// path ([`targeted::Known`]). On the blocking pool, unless the last scan
    /// found few enough reservations to read them here: the hand-off to
    /// another thread would cost more than the reading.
    async fn scan_stores(&mut self) -> anyhow::Result<StoreScan> {
        scan_stores_into(self.stores.clone(), &mut self.known).await
    }

    /// How often a pending verdict is looked at while the runtime answers.
    fn runtime_poll(&self) -> std::time::Duration {
        (self.policy.in_flight_grace.min(self.policy.orphan_grace) / 4)
            .clamp(std::time::Duration::from_secs(1), self.config.resync_interval)
    }

    /// Fresh observations of the whole node: the model, the CNI cache, the
    /// ledger, the runtime and the Kubernetes API.
    pub(super) async fn observe(&mut self) -> anyhow::Result<(Observations, Observed)> {
        let sources = self.gather().await?;
        Ok(self.observe_all(sources))
    }

    /// The whole node's observations from these sources.
    fn observe_all(&mut self, sources: Sources) -> (Observations, Observed) {
        self.scan_pools(&sources);
        self.observed(sources, None)
    }

    /// The observations a full pass reads, from these sources: those of the
    /// reservations `scan` and the pools hold and of the runtime's sandboxes
    /// ([`Concern::of_reservations`]), not of every netns, run and cache
    /// entry of the node's recent history. A verdict reads only its own
    /// reservation's part of the observations (the death path's premise), so
    /// the verdicts and stuck sandboxes are the whole node's (property-tested:
    /// `observations_for_every_reservation_give_the_whole_nodes_verdicts`),
    /// at a cost in proportion to the node's reservations, not to its
    /// history (under pod churn thousands of dead netns and runs).
    /// When the node's history does not outnumber its reservations
    /// ([`HISTORY_PER_CONTAINER`]), the whole node is walked, as before:
    /// the same verdicts, without a copy of every container's ID for the
    /// concern and a look-up per container where one walk reads it all.
    fn observe_reserved(&mut self, sources: Sources, scan: &StoreScan) -> (Observations, Observed) {
        self.scan_pools(&sources);
        let pools = self.kube.as_ref().map_or(&[][..], |k| k.reservations());
        let concern = Concern::of_reservations(scan.reservations.iter().chain(pools), sources.runtime.as_ref());
        let history = sources.snapshot.netns.len() + self.ledger.len();
        if history <= HISTORY_PER_CONTAINER * concern.containers.len() {
            return self.observed(sources, None);
        }
        self.observed(sources, Some(&concern))
    }

    /// The observations of `concern` (None: the whole node's), and what
    /// else observing found.
    fn observed(&mut self, mut sources: Sources, concern: Option<&Concern>) -> (Observations, Observed) {
        let runtime = sources.runtime.take();
        let scope = concern.map_or(Scope::All, Scope::Concerning);
        let obs = self.observations(&sources, runtime, scope);
        let stuck = self.runtime.stuck_changes(&obs);
        let runtime = obs.runtime.clone();
        let Sources { snapshot, source_changed, .. } = sources;
        (obs, Observed { snapshot, runtime, source_changed, stuck })
    }

    /// Reads the sources a pass decides on: the model's snapshot, the CNI
    /// cache (a directory scan, on the blocking pool while the model's worker
    /// takes the snapshot) and the runtime's view.
    async fn gather(&mut self) -> anyhow::Result<Sources> {
        self.gather_with(None).await
    }

    /// [`Self::gather`] with the model's snapshot given (None: asked for).
    async fn gather_with(&mut self, snapshot: Option<Arc<ModelSnapshot>>) -> anyhow::Result<Sources> {
        // The watch names what changed: read at once. A listing goes to the
        // blocking pool while the model's worker takes the snapshot.
        // With what changed since the scan last dated, when it follows that one.
        let (followed, changed) = {
            let mut reader = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let followed = reader.follow();
            let changed = followed
                .as_ref()
                .zip(self.cache_dated.as_ref())
                .and_then(|(now, dated)| reader.changed_since(dated, now).map(<[_]>::to_vec));
            (followed, changed)
        };
        let listing = followed.is_none().then(|| {
            let reader = Arc::clone(&self.cache);
            tokio::task::spawn_blocking(move || reader.lock().unwrap_or_else(std::sync::PoisonError::into_inner).scan())
        });
        let snapshot = match snapshot {
            Some(snapshot) => snapshot,
            None => Arc::new(self.model.snapshot().await?),
        };
        let cache = match listing {
            Some(listing) => listing.await?,
            None => followed.unwrap_or_default(),
        };
        // The same scan as last time (nothing changed): already dated.
        if !self.cache_dated.as_ref().is_some_and(|dated| Arc::ptr_eq(dated, &cache)) {
            let now = SystemTime::now();
            // Followed from the scan dated last: only its changed entries
            // (dating every path cost ~0.07 ms per death pass at 200).
            if let Some(changed) = changed {
                for (path, attachment) in changed {
                    if attachment {
                        self.cache_first_seen.entry(path).or_insert(now);
                    } else {
                        self.cache_first_seen.remove(&path);
                    }
                }
            } else {
                let present: crate::fast::Set<&PathBuf> = cache.attachments.iter().map(|a| &a.path).collect();
                self.cache_first_seen.retain(|path, _| present.contains(path));
                // A path is copied only when it is new (`entry` would copy each).
                for a in &cache.attachments {
                    if !self.cache_first_seen.contains_key(&a.path) {
                        self.cache_first_seen.insert(a.path.clone(), now);
                    }
                }
            }
            self.cache_dated = Some(Arc::clone(&cache));
        }
        let (runtime, source_changed) = self.runtime.view().await;
        Ok(Sources { snapshot, cache, runtime, source_changed })
    }

    /// The observations `scope` needs, from these sources (the runtime's
    /// view given apart: a full pass moves it in) and the ledger.
    fn observations(
        &mut self,
        sources: &Sources,
        runtime: Option<crate::engine::RuntimeView>,
        scope: Scope<'_>,
    ) -> Observations {
        let widened;
        let scope = match scope {
            Scope::Concerning(concern) => {
                widened = concern.with_sandboxes(runtime.as_ref());
                Scope::Concerning(&widened)
            }
            Scope::All => Scope::All,
        };
        let obs = evidence::observations_in(
            &sources.snapshot,
            &self.ledger,
            &sources.cache.attachments,
            Some(self.watching_since),
            Some(&self.cache_first_seen),
            scope,
        );
        self.completed(obs, runtime)
    }

    /// The evidence's observations with what the agent adds to them: the
    /// runtime's view, the netns that died while it was down, the earlier
    /// runs' watch windows and the Kubernetes API's pods.
    fn completed(&mut self, mut obs: Observations, runtime: Option<crate::engine::RuntimeView>) -> Observations {
        obs.set_runtime(runtime);
        obs.dead.extend(self.memory.dead_while_down.iter().cloned());
        obs.watched_before = self.memory.windows.iter().map(|w| (w.since, w.until)).collect();
        if let Some(k) = self.kube.as_mut() {
            k.observe(&mut obs);
        }
        obs
    }

    /// Scans the whereabouts pools for this node's reservations, if the
    /// Kubernetes side is on (before the observations: [`Self::completed`]
    /// adds the pods the scan named).
    fn scan_pools(&mut self, sources: &Sources) {
        if let Some(k) = self.kube.as_mut() {
            k.scan_pools(&self.ledger, &sources.cache.attachments);
        }
    }

    /// Entries that are not reservations and were not reported yet.
    fn new_anomalies(&mut self, anomalies: Vec<Anomaly>) -> Vec<Anomaly> {
        let current: HashSet<String> = anomalies.iter().map(|a| a.path.clone()).collect();
        let fresh = anomalies.into_iter().filter(|a| !self.anomalies.contains(&a.path)).collect();
        self.anomalies = current;
        fresh
    }

    /// The verdicts whose status changed since the last reconcile.
    fn changes(&mut self, verdicts: &[Verdict], obs: &Observations) -> Vec<Change> {
        let mut seen = HashMap::with_capacity(verdicts.len());
        let mut changed = Vec::new();
        for (index, v) in verdicts.iter().enumerate() {
            let key = &v.reservation.path;
            let before = self.verdicts.remove(key);
            if before != Some(v.status) {
                let pod = runtime::pod_of(obs, &v.reservation.container_id).cloned();
                changed.push(Change { index, before, pod });
            }
            seen.insert(key.clone(), v.status);
        }
        self.verdicts = seen;
        changed
    }

    /// The verdicts of a targeted pass whose status changed; the others'
    /// last verdicts stay as they were.
    fn changes_among(&mut self, verdicts: &[Verdict], obs: &Observations) -> Vec<Change> {
        let mut changed = Vec::new();
        for (index, v) in verdicts.iter().enumerate() {
            let before = self.verdicts.insert(v.reservation.path.clone(), v.status);
            if before != Some(v.status) {
                let pod = runtime::pod_of(obs, &v.reservation.container_id).cloned();
                changed.push(Change { index, before, pod });
            }
        }
        changed
    }

    /// Hands the orphans the retry gate admits to a release batch on the
    /// blocking pool (flock waits and fsyncs stay off the event thread; a
    /// small batch whose lock is free is started here, see below);
    /// its records come back through `release_done`. One batch at a time: while
    /// one runs, orphans wait for the reconcile that follows it. Returns
    /// whether a batch was handed off.
    fn start_release(
        &mut self,
        verdicts: &[Verdict],
        obs: &Observations,
        model: &ModelSnapshot,
        judged: Judged,
    ) -> bool {
        if self.releaser.is_none() {
            self.release_waiting |= verdicts.iter().any(Verdict::is_orphaned);
            return false;
        }
        let admitted = match judged {
            Judged::All => self.gate.admit(verdicts, std::time::Instant::now()),
            Judged::These => self.gate.admit_judged(verdicts, std::time::Instant::now()),
        };
        if admitted.is_empty() {
            return false;
        }
        self.arm_last_look(model);
        let Some(mut releaser) = self.releaser.take() else { return false };
        // The runtime's names of the pods, for the release events.
        let pods: HashMap<String, PodRef> = admitted
            .iter()
            .filter_map(|v| {
                let id = &v.reservation.container_id;
                runtime::pod_of(obs, id).map(|p| (id.to_string(), p.clone()))
            })
            .collect();
        // The releaser acts on every orphan it is given and reads the
        // others only as context (which IPs an attachment still holds), so
        // orphans the gate holds back go in as context, marked pending.
        let admitted_paths: HashSet<&PathBuf> = admitted.iter().map(|v| &v.reservation.path).collect();
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
        // The intents are written here and their fsync starts at once: it
        // does not wait for the blocking pool's thread to be woken and given
        // a core (a journal that cannot be written fails the batch there).
        // A small batch of one network whose lock is free is started here
        // too (`Releaser::act_now`: one try of the lock, the re-reads and
        // one last look under it, no wait; its unlinks follow the fsync on
        // the thread that ends it): the lock and the look no longer wait
        // for the pool's thread. The rest stays there.
        let begun = releaser.begin_orphaned(batch).map(|begun| releaser.act_now(begun));
        tokio::task::spawn_blocking(move || {
            let result = begun.and_then(|begun| releaser.finish_orphaned(begun));
            // The receiver lives as long as the event loop; if it is gone
            // the agent is stopping and the journal already holds the truth.
            let _ = done.blocking_send(ReleaseDone { releaser, admitted, pods, result });
        });
        true
    }

    /// Takes a finished batch back: reports its records, updates the retry
    /// gate. Returns whether orphans waited for it (reconcile again).
    pub(super) fn on_release_done(&mut self, done: ReleaseDone) -> anyhow::Result<bool> {
        self.publish_deferred()?;
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
            let pod = pods.get(record.verdict.reservation.container_id.as_str());
            self.publish_release(record, ReleaseReason::of(&record.verdict), pod)?;
        }
        Ok(std::mem::take(&mut self.release_waiting))
    }

    /// At shutdown: waits for a running batch, so its outcomes are reported
    /// (they are journaled either way).
    pub(super) async fn finish_release(
        &mut self,
        results: &mut tokio::sync::mpsc::Receiver<ReleaseDone>,
    ) -> anyhow::Result<()> {
        self.publish_deferred()?;
        if self.releaser.is_none()
            && let Some(done) = results.recv().await
        {
            self.on_release_done(done)?;
        }
        Ok(())
    }

    /// Settles intents a previous run left without outcome, re-verified on
    /// fresh observations.
    pub(super) async fn recover(&mut self) -> anyhow::Result<()> {
        let Some(releaser) = self.releaser.as_ref() else { return Ok(()) };
        if releaser.journal().pending().is_empty() {
            return Ok(());
        }
        let (obs, observed) = self.observe().await?;
        let (now, policy) = (SystemTime::now(), self.policy);
        self.arm_last_look(&observed.snapshot);
        let Some(releaser) = self.releaser.take() else { return Ok(()) };
        // Lock waits and fsyncs: on the blocking pool, so /healthz answers.
        let obs = Arc::new(obs);
        let seen = Arc::clone(&obs);
        let (releaser, records) = tokio::task::spawn_blocking(move || {
            let mut releaser = releaser;
            let records = releaser.recover(|r| decide_one(&seen, r, now, &policy));
            (releaser, records)
        })
        .await?;
        self.releaser = Some(releaser);
        for record in &records? {
            let pod = runtime::pod_of(&obs, &record.verdict.reservation.container_id);
            self.publish_release(record, ReleaseReason::Recovery, pod)?;
        }
        self.publish_observed(observed)
    }

    /// Gives the releaser a fresh last look: the kernel, asked about every
    /// netns the model knows alive and any process netns it does not, and
    /// the ledger's runs in flight.
    fn arm_last_look(&mut self, model: &ModelSnapshot) {
        let look = self.kernel_look(model);
        if let Some(releaser) = self.releaser.as_mut() {
            releaser.set_last_look(Box::new(look));
        }
    }

    /// A last look for one batch of releases, with the model's netns.
    fn kernel_look(&self, model: &ModelSnapshot) -> KernelLook {
        // The inodes as a list: the look files them in its own set.
        let (mut nsids, mut inodes) = (Vec::new(), Vec::new());
        for v in model.alive().filter(|v| !v.host) {
            nsids.extend(v.nsid);
            inodes.extend(v.inode.map(u64::from));
        }
        inodes.extend(model.alive().filter(|v| v.host).filter_map(|v| v.inode.map(u64::from)));
        let in_flight = self.ledger.attachments().filter(|a| a.in_flight()).map(|a| a.container_id.clone()).collect();
        let bin_dirs = self.config.cni_bin_dirs.clone();
        KernelLook::new(nsids, inodes, in_flight, bin_dirs).with_mount_table(self.discovery.clone())
    }
}

/// Scans every host-local store and keeps what it found for the death path
/// in `known` (see `Agent::scan_stores`): apart from the agent, so the
/// death path can scan while its index borrows the ledger.
async fn scan_stores_into(stores: Vec<HostLocalStore>, known: &mut targeted::Known) -> anyhow::Result<StoreScan> {
    let scan = move || {
        let stores: Vec<&dyn ReservationStore> = stores.iter().map(|s| s as &dyn ReservationStore).collect();
        scan_all(&stores)
    };
    let scan_started = SystemTime::now();
    let scan = if known.scanned_since.is_some() && known.len() <= targeted::INLINE_REREAD_LIMIT {
        scan()
    } else {
        tokio::task::spawn_blocking(scan).await?
    };
    *known = targeted::Known::new(&scan.reservations, scan_started);
    Ok(scan)
}
