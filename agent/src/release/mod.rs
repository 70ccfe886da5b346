//! The release executor: acts on orphaned verdicts only, journals every
//! release (intent fsync'd before acting, outcome after), and on restart
//! re-verifies what an earlier run left half done.
//!
//! - [`journal`]: the crash-safe journal in the state dir.
//! - `hostlocal`: the host-local releaser (the plugin's own flock).
//! - `cache`: removal of the released attachment's CNI cache entry.
//! - [`lastlook`]: the kernel, asked under the lock right before unlinks.
//! - [`reviewed_report`]: scan reports and releasing exactly what a reviewed
//!   one lists.

pub mod addrtable;
mod cache;
mod durable;
mod hostlocal;
pub mod journal;
pub mod lastlook;
pub mod outcome;
pub mod retry;
pub mod reviewed_report;

use std::{
    collections::HashMap,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use serde::{Deserialize, Serialize};

use self::{durable::Durable, outcome::micros};
pub use self::{
    journal::{DEFAULT_STATE_DIR, Intent, Journal, JournalError},
    outcome::{Outcome, ReleaseTimings},
    reviewed_report::{release_reviewed, scan_report},
};
use crate::{
    engine::{Status, Verdict},
    ipam::Reservation,
};

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// Without a journal nothing is released.
    #[error(transparent)]
    Journal(#[from] JournalError),
}

/// How the releaser acts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaserConfig {
    /// Journal and report, change no store.
    pub dry_run: bool,
    /// The host-local data dirs this releaser may change (the configured
    /// `--host-local-dir`s). A reservation naming any other dir (a report
    /// edited to point elsewhere) is refused; empty refuses everything.
    pub host_local_dirs: Vec<PathBuf>,
    /// libcni's results dir; when set, a released attachment's entry goes too.
    pub cni_cache_dir: Option<PathBuf>,
    /// Failure injection for crash tests: abort the process right after the
    /// intent is fsync'd, before the store is touched.
    #[doc(hidden)]
    #[serde(skip)]
    pub abort_after_intent: bool,
    /// Longest wait for a plugin's lock; None: [`DEFAULT_LOCK_TIMEOUT`].
    #[serde(skip)]
    pub lock_timeout: Option<std::time::Duration>,
}

/// How long a release waits for a host-local network's lock by default.
pub const DEFAULT_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// One release attempt, for reports and logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRecord {
    /// The journal intent; None when nothing was journaled (refused).
    pub intent_id: Option<String>,
    pub dry_run: bool,
    pub verdict: Verdict,
    pub outcome: Outcome,
    /// The fresh verdict of a re-verification, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverified: Option<Verdict>,
}

/// Releases orphaned reservations, one at a time, journaled.
pub struct Releaser {
    journal: Journal,
    config: ReleaserConfig,
    /// Asked under the plugin's lock right before each unlink.
    look: Box<dyn lastlook::LastLook>,
    /// How long the last look took, in micro-seconds (0: none yet). A look
    /// walks every process of the node: [`Self::act_now`] stays off the
    /// caller's thread while the last one took long.
    last_look_us: u64,
}

impl std::fmt::Debug for Releaser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Releaser").field("journal", &self.journal).field("config", &self.config).finish_non_exhaustive()
    }
}

impl Releaser {
    #[must_use]
    pub fn new(journal: Journal, config: ReleaserConfig) -> Self {
        Self { journal, config, look: Box::new(lastlook::KernelLook::default()), last_look_us: 0 }
    }

    /// The last look for the next releases (the daemon gives one per batch,
    /// with the model's netns; the default asks every netns it can find).
    pub fn set_last_look(&mut self, look: Box<dyn lastlook::LastLook>) {
        self.look = look;
    }

    /// Opens the journal in `state_dir` (taking its lock).
    pub fn open(state_dir: &Path, config: ReleaserConfig) -> Result<Self, ReleaseError> {
        Ok(Self::new(Journal::open(state_dir)?, config))
    }

    #[must_use]
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The journal, to record a clean stop (`Journal::close_clean`).
    pub fn journal_mut(&mut self) -> &mut Journal {
        &mut self.journal
    }

    #[must_use]
    pub fn config(&self) -> &ReleaserConfig {
        &self.config
    }

    /// Releases the reservation of an orphaned verdict. Anything else is
    /// refused without touching the journal or a store. Errors only when the
    /// journal cannot be written (then nothing more is done).
    pub fn release(&mut self, verdict: &Verdict) -> Result<ReleaseRecord, ReleaseError> {
        if verdict.status != Status::Orphaned {
            return Ok(ReleaseRecord {
                intent_id: None,
                dry_run: self.config.dry_run,
                verdict: verdict.clone(),
                outcome: Outcome::Refused { reason: format!("verdict is {}, not orphaned", verdict.status) },
                reverified: None,
            });
        }
        let verdicts = std::slice::from_ref(verdict);
        let started = self.begin(verdicts, &[0], false)?;
        let mut records = self.finish(started, verdicts)?;
        Ok(records.pop().unwrap_or_else(|| ReleaseRecord {
            intent_id: None,
            dry_run: self.config.dry_run,
            verdict: verdict.clone(),
            outcome: Outcome::Failed { error: "no outcome".into() },
            reverified: None,
        }))
    }

    /// Releases every orphaned verdict; the others are skipped silently.
    /// `verdicts` were judged together and hold every reservation of each
    /// orphan's container (a whole scan, or a death pass's candidates, which
    /// take in their containers' other reservations): which other IPs an
    /// attachment still holds (to keep its cache entry) is read from them
    /// instead of the disk, so a release reads no other file of its
    /// network. Crash-safe like single releases (every intent is durable
    /// before the first store change, every unlink before its outcome),
    /// with three fsyncs per batch instead of three per release. Each
    /// network's lock is taken once for its group of files, with one last
    /// look under it (`hostlocal::release_group`).
    pub fn release_orphaned(&mut self, verdicts: &[Verdict]) -> Result<Vec<ReleaseRecord>, ReleaseError> {
        let started = self.begin(verdicts, &orphans_of(verdicts), true)?;
        self.finish(started, verdicts)
    }

    /// The first half of [`Self::release_orphaned`]: refuses what it must
    /// and writes the intents, whose fsync starts on the syncer thread
    /// before this returns. [`Self::finish_orphaned`] does the store work
    /// (on another thread, as the agent does: its event loop writes the
    /// intents, so their fsync does not wait for the release thread to be
    /// woken and scheduled).
    pub fn begin_orphaned(&mut self, verdicts: Vec<Verdict>) -> Result<Begun, ReleaseError> {
        let started = self.begin(&verdicts, &orphans_of(&verdicts), true)?;
        Ok(Begun { verdicts, started, acted: None })
    }

    /// Starts the store work of a begun batch on this thread, at once, when
    /// that is short: a batch of one network's files, at most
    /// [`ACT_NOW_MAX_FILES`], whose lock is free now, while the last look
    /// took at most [`ACT_NOW_MAX_LOOK_US`]. On this thread that is
    /// one try of the lock, the re-reads and one last look under the lock;
    /// the unlinks follow the intents' fsync, on this thread if it has
    /// ended, else on the thread that ends it. Nothing waits here: the lock
    /// stays held until [`Self::finish_orphaned`] (which must be called
    /// either way) has the unlinks' results, and it does the directory's
    /// fsync, the cache entries and the outcomes. Otherwise (a larger
    /// batch, the lock held) no store is changed here and it does all of
    /// it. The agent calls this on its event loop: the lock and the look no
    /// longer wait for the blocking pool's thread to be woken, nor the
    /// unlink for a thread woken after the fsync.
    pub fn act_now(&mut self, mut begun: Begun) -> Begun {
        let Some((_, durable, _)) = begun.started.journaled.as_ref().filter(|_| begun.acted.is_none()) else {
            return begun;
        };
        if self.last_look_us > ACT_NOW_MAX_LOOK_US {
            return begun;
        }
        let accepted = &begun.started.accepted;
        let Some((_, first)) = accepted.first() else { return begun };
        if accepted.len() > ACT_NOW_MAX_FILES || accepted.iter().any(|(_, f)| f.network_dir != first.network_dir) {
            return begun;
        }
        let files: Vec<(&Reservation, &hostlocal::ReservationFile)> =
            accepted.iter().filter_map(|(i, file)| Some((&begun.verdicts.get(*i)?.reservation, file))).collect();
        let handoff_us = micros(durable.begun_at());
        let acted =
            hostlocal::try_release_group(&first.network_dir, &files, self.look.as_mut(), self.config.dry_run, durable);
        begun.acted = acted.map(|underway| (underway, handoff_us));
        begun
    }

    /// The second half of [`Self::release_orphaned`]: the store work of a
    /// batch begun by [`Self::begin_orphaned`], every change after the
    /// intents' fsync.
    pub fn finish_orphaned(&mut self, begun: Begun) -> Result<Vec<ReleaseRecord>, ReleaseError> {
        let Begun { verdicts, started, acted } = begun;
        self.finish_acted(started, &verdicts, acted)
    }

    /// Refuses the orphans (indices into `verdicts`) outside the configured
    /// dirs, writes the intents of the rest and starts their fsync beside
    /// ([`Durable`]: no store changes before it is done). `judged_together`:
    /// `verdicts` hold every reservation of each orphan's container (see
    /// [`Self::release_orphaned`]), so an attachment's other IPs are read
    /// from them; otherwise (one verdict alone) from the store.
    fn begin(
        &mut self,
        verdicts: &[Verdict],
        orphans: &[usize],
        judged_together: bool,
    ) -> Result<Started, ReleaseError> {
        let begun = std::time::Instant::now();
        let dry_run = self.config.dry_run;
        let mut refused = Vec::new();
        let mut accepted = Vec::with_capacity(orphans.len());
        for &i in orphans {
            let Some(v) = verdicts.get(i) else { continue };
            match hostlocal::reservation_file(&v.reservation, &self.config.host_local_dirs) {
                Ok(file) => accepted.push((i, file)),
                Err(reason) => refused.push(ReleaseRecord {
                    intent_id: None,
                    dry_run,
                    verdict: v.clone(),
                    outcome: Outcome::Refused { reason },
                    reverified: None,
                }),
            }
        }
        if accepted.is_empty() {
            return Ok(Started { refused, accepted, judged_together, journaled: None });
        }
        let chosen: Vec<&Verdict> = accepted.iter().map(|(i, _)| &verdicts[*i]).collect();
        let (intents, unsynced) = self.journal.write_intents(&chosen, dry_run)?;
        if self.config.abort_after_intent {
            // The crash test: the intents durable, no store touched.
            unsynced.sync()?;
            std::process::abort();
        }
        // The fsync on the syncer thread, the store work in `finish` (see
        // `durable`): every store change waits for the fsync.
        let durable = Arc::new(Durable::pending_since(begun));
        let syncing = durable::sync_beside(&durable, unsynced);
        Ok(Started { refused, accepted, judged_together, journaled: Some((intents, durable, syncing)) })
    }

    /// Acts on a begun batch network by network, once every store change
    /// may go (see `begin`), and records the outcomes.
    fn finish(&mut self, started: Started, verdicts: &[Verdict]) -> Result<Vec<ReleaseRecord>, ReleaseError> {
        self.finish_acted(started, verdicts, None)
    }

    /// [`Self::finish`], the batch's one group already acted on when
    /// `acted` holds its outcomes ([`Self::act_now`]).
    fn finish_acted(
        &mut self,
        started: Started,
        verdicts: &[Verdict],
        acted: Option<(hostlocal::Underway, u64)>,
    ) -> Result<Vec<ReleaseRecord>, ReleaseError> {
        let Started { refused: mut records, accepted, judged_together, journaled } = started;
        let Some((intents, durable, syncing)) = journaled else { return Ok(records) };
        let dry_run = self.config.dry_run;
        let judged = judged_together.then_some(verdicts);
        let accepted: Vec<(&Verdict, hostlocal::ReservationFile)> =
            accepted.into_iter().filter_map(|(i, file)| Some((verdicts.get(i)?, file))).collect();
        let results = self.act_on(&accepted, judged, &durable, acted);
        if let Err(e) = syncing.result() {
            // Nothing was changed (every store change waited for this).
            self.journal.forget_intents(&intents);
            return Err(e.into());
        }
        let synced = durable.timings();
        let results: Vec<(Outcome, ReleaseTimings)> = results
            .into_iter()
            .map(|(outcome, timings)| {
                (
                    outcome,
                    ReleaseTimings { intent_fsync_us: synced.fsync_us, intent_wait_us: synced.waited_us, ..timings },
                )
            })
            .collect();
        let timed: Vec<(&str, &Outcome, Option<ReleaseTimings>)> =
            intents.iter().zip(&results).map(|(i, (o, t))| (i.id.as_str(), o, Some(*t))).collect();
        self.journal.record_timed_outcomes(&timed)?;
        for ((intent, (v, _)), (outcome, _)) in intents.into_iter().zip(accepted).zip(results) {
            log_outcome(&v.reservation, &outcome, dry_run);
            records.push(ReleaseRecord {
                intent_id: Some(intent.id),
                dry_run,
                verdict: v.clone(),
                outcome,
                reverified: None,
            });
        }
        Ok(records)
    }

    /// The store work of a journaled batch, network by network; outcomes
    /// in the order of `accepted`.
    fn act_on(
        &mut self,
        accepted: &[(&Verdict, hostlocal::ReservationFile)],
        judged: Option<&[Verdict]>,
        durable: &Durable,
        mut acted: Option<(hostlocal::Underway, u64)>,
    ) -> Vec<(Outcome, ReleaseTimings)> {
        let dry_run = self.config.dry_run;
        let handoff_us = micros(durable.begun_at());
        // Each attachment's IPs as the batch's verdicts show them (None:
        // read from the store); released ones leave.
        let mut held: HashMap<(&Path, &str), Vec<&Reservation>> = HashMap::new();
        for v in judged.unwrap_or_default() {
            held.entry((v.reservation.path.parent().unwrap_or(Path::new("")), v.reservation.container_id.as_str()))
                .or_default()
                .push(&v.reservation);
        }
        // Groups by network directory, in the batch's order.
        let mut groups: Vec<(&Path, Vec<usize>)> = Vec::new();
        for (i, (_, file)) in accepted.iter().enumerate() {
            match groups.iter_mut().find(|(dir, _)| *dir == file.network_dir.as_path()) {
                Some((_, members)) => members.push(i),
                None => groups.push((file.network_dir.as_path(), vec![i])),
            }
        }
        let lock_timeout = self.config.lock_timeout.unwrap_or(DEFAULT_LOCK_TIMEOUT);
        let mut results: Vec<Option<(Outcome, ReleaseTimings)>> = vec![None; accepted.len()];
        for (dir, members) in &groups {
            let files: Vec<(&Reservation, &hostlocal::ReservationFile)> =
                members.iter().map(|&i| (&accepted[i].0.reservation, &accepted[i].1)).collect();
            // Acted on at once: the batch was this one group (`act_now`).
            let (mut outcomes, handoff_us) = match acted.take() {
                Some((underway, handoff_us)) if groups.len() == 1 => (underway.complete(), handoff_us),
                _ => (
                    hostlocal::release_group(dir, &files, self.look.as_mut(), lock_timeout, dry_run, durable),
                    handoff_us,
                ),
            };
            for (_, t) in &mut outcomes {
                t.handoff_us = handoff_us;
            }
            // The group's look (0: none asked, as when every re-read failed).
            self.last_look_us = outcomes.iter().map(|(_, t)| t.look_us).max().unwrap_or(0);
            if !dry_run && outcomes.iter().any(|(o, _)| o.released()) {
                let sync = std::time::Instant::now();
                hostlocal::sync_network_dir(dir);
                let dir_fsync_us = micros(sync);
                for (_, t) in &mut outcomes {
                    t.dir_fsync_us = dir_fsync_us;
                }
            }
            for (&i, (outcome, timings)) in members.iter().zip(outcomes) {
                let (v, file) = &accepted[i];
                let r = &v.reservation;
                let attachment = (file.network_dir.as_path(), r.container_id.as_str());
                let others: Option<Vec<IpAddr>> = judged.map(|_| {
                    held.get(&attachment)
                        .into_iter()
                        .flatten()
                        .filter(|o| o.ip != r.ip && (o.ifname.is_none() || r.ifname.is_none() || o.ifname == r.ifname))
                        .map(|o| o.ip)
                        .collect()
                });
                let outcome = self.with_cache(r, file, outcome, dry_run, others, durable);
                if outcome.released()
                    && let Some(list) = held.get_mut(&attachment)
                {
                    list.retain(|o| o.ip != r.ip);
                }
                results[i] = Some((outcome, timings));
            }
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| (Outcome::Failed { error: "not attempted".into() }, ReleaseTimings::default()))
            })
            .collect()
    }

    /// Settles the intents an earlier run left without outcome. Each is
    /// re-verified from scratch by `reverify` (the caller runs the engine on
    /// fresh observations for that reservation) and acted on only if still
    /// orphaned; the store check then finds out whether the earlier run got
    /// as far as the unlink (`AlreadyGone`), so nothing is released twice and
    /// nothing is lost. Dry-run intents are closed without acting.
    pub fn recover(
        &mut self,
        mut reverify: impl FnMut(&Reservation) -> Verdict,
    ) -> Result<Vec<ReleaseRecord>, ReleaseError> {
        let pending: Vec<Intent> = self.journal.pending().to_vec();
        let mut records = Vec::with_capacity(pending.len());
        for intent in pending {
            let reservation = &intent.verdict.reservation;
            let (outcome, reverified) = if intent.dry_run {
                (Outcome::DryRunClosed, None)
            } else {
                let fresh = reverify(reservation);
                let outcome = if fresh.reservation != *reservation {
                    Outcome::Refused { reason: "re-verification judged a different reservation".into() }
                } else if fresh.status != Status::Orphaned {
                    Outcome::Kept { status: fresh.status, reason: fresh.summary() }
                } else if let Err(reason) = hostlocal::reservation_file(reservation, &self.config.host_local_dirs) {
                    Outcome::Refused { reason }
                } else {
                    self.execute(reservation, false)
                };
                (outcome, Some(fresh))
            };
            self.journal.record_outcome(&intent.id, &outcome, reverified.as_ref())?;
            tracing::debug!(intent = %intent.id, ip = %reservation.ip, network = %reservation.network, "recovered intent: {outcome}");
            records.push(ReleaseRecord {
                intent_id: Some(intent.id),
                dry_run: intent.dry_run,
                verdict: intent.verdict,
                outcome,
                reverified,
            });
        }
        Ok(records)
    }

    /// The store work for one reservation whose intent is already durable
    /// (recovery): its file under the plugin's lock (a group of one, the
    /// directory fsync'd), then the cache entry.
    fn execute(&mut self, r: &Reservation, dry_run: bool) -> Outcome {
        let file = match hostlocal::reservation_file(r, &self.config.host_local_dirs) {
            Ok(file) => file,
            Err(reason) => return Outcome::Refused { reason },
        };
        let lock_timeout = self.config.lock_timeout.unwrap_or(DEFAULT_LOCK_TIMEOUT);
        let durable = Durable::already();
        let files = [(r, &file)];
        let outcome =
            hostlocal::release_group(&file.network_dir, &files, self.look.as_mut(), lock_timeout, dry_run, &durable)
                .pop()
                .map_or_else(|| Outcome::Failed { error: "no outcome".into() }, |(outcome, _)| outcome);
        if !dry_run && outcome.released() {
            hostlocal::sync_network_dir(&file.network_dir);
        }
        self.with_cache(r, &file, outcome, dry_run, None, &durable)
    }

    /// The libcni cache entry of a released (or already gone) reservation.
    /// `still_held`: the attachment's other IPs when the caller knows them
    /// (a batch); None reads them from the store.
    fn with_cache(
        &self,
        r: &Reservation,
        file: &hostlocal::ReservationFile,
        mut outcome: Outcome,
        dry_run: bool,
        still_held: Option<Vec<IpAddr>>,
        durable: &Durable,
    ) -> Outcome {
        // After a crash between unlink and cache removal the file is gone but
        // the entry may remain: clean it up too.
        let wants_cache =
            matches!(outcome, Outcome::Released { .. } | Outcome::WouldRelease { .. } | Outcome::AlreadyGone);
        let Some(cache_dir) = self.config.cni_cache_dir.as_deref().filter(|_| wants_cache) else {
            return outcome;
        };
        let (entries, mut notes) = cache::entries_for(cache_dir, r);
        let still_held = match still_held {
            _ if entries.is_empty() => Vec::new(),
            Some(known) => known,
            None => hostlocal::other_ips_of(&r.container_id, r.ifname.as_deref(), file, r.ip),
        };
        let (entries, mut notes) = if entries.is_empty() || still_held.is_empty() {
            (entries, notes)
        } else {
            let held: Vec<String> = still_held.iter().map(ToString::to_string).collect();
            notes.push(format!("attachment still holds {}; cache entry kept", held.join(", ")));
            (Vec::new(), notes)
        };
        match &mut outcome {
            Outcome::WouldRelease { cache_entries, cache_notes } => {
                *cache_entries = entries.into_iter().map(|a| a.path).collect();
                *cache_notes = notes;
            }
            // Released: the unlink already waited for the intents.
            Outcome::Released { cache_entries_removed, cache_notes } => {
                let (removed, more) = cache::remove(cache_dir, &entries);
                notes.extend(more);
                *cache_entries_removed = removed;
                *cache_notes = notes;
            }
            Outcome::AlreadyGone if !dry_run => {
                if let Err(why) = durable.wait() {
                    return Outcome::Failed { error: why };
                }
                let (removed, more) = cache::remove(cache_dir, &entries);
                notes.extend(more);
                if !removed.is_empty() {
                    tracing::info!(ip = %r.ip, "reservation already gone; removed its leftover CNI cache entry");
                }
                if !notes.is_empty() {
                    tracing::debug!(ip = %r.ip, "cache: {}", notes.join("; "));
                }
            }
            _ => {}
        }
        outcome
    }
}

/// The orphans of a batch, by index.
fn orphans_of(verdicts: &[Verdict]) -> Vec<usize> {
    verdicts.iter().enumerate().filter(|(_, v)| v.is_orphaned()).map(|(i, _)| i).collect()
}

/// A batch [`Releaser::begin_orphaned`] began: its intents written, their
/// fsync under way. Dropped without [`Releaser::finish_orphaned`], nothing
/// of it is acted on; the intents stay pending for recovery.
pub struct Begun {
    verdicts: Vec<Verdict>,
    started: Started,
    /// The batch's one group when [`Releaser::act_now`] started it (its
    /// lock held, its look taken), with when it started.
    acted: Option<(hostlocal::Underway, u64)>,
}

/// The most files [`Releaser::act_now`] releases on the caller's thread
/// (a pod's attachments in one network: dual stack, a few interfaces).
pub const ACT_NOW_MAX_FILES: usize = 4;

/// The longest last look after which [`Releaser::act_now`] still runs the
/// next one on the caller's thread (the agent's event loop). A node with
/// thousands of processes takes longer (about 8 us each), and its looks
/// stay on the blocking pool: the event loop is not held up per death.
pub const ACT_NOW_MAX_LOOK_US: u64 = 2_000;

/// A batch's first half, apart from its verdicts (see `Releaser::begin`).
struct Started {
    /// The orphans refused, with their records.
    refused: Vec<ReleaseRecord>,
    /// The orphans to act on: indices into the verdicts, with their files.
    accepted: Vec<(usize, hostlocal::ReservationFile)>,
    /// The verdicts hold every reservation of each orphan's container:
    /// an attachment's other IPs are read from them, not from the store.
    judged_together: bool,
    /// The intents written, their fsync's gate and result; None when no
    /// orphan was accepted.
    journaled: Option<(Vec<Intent>, Arc<Durable>, durable::Syncing)>,
}

/// At debug: the agent logs each release once where it reports it (its
/// publish), the CLI prints its outcomes.
fn log_outcome(r: &Reservation, outcome: &Outcome, dry_run: bool) {
    tracing::debug!(
        network = %r.network,
        ip = %r.ip,
        container_id = %r.container_id,
        dry_run,
        "release: {outcome}"
    );
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::ipam::{ReservationStore, hostlocal::HostLocalStore};

    /// A releaser of `data` (no last look) and one orphaned verdict of a
    /// reservation the plugin's way on disk.
    fn releaser_and_orphan(state: &Path, data: &Path, ip: &str) -> (Releaser, Verdict) {
        fs::create_dir_all(data.join("nrbegin")).unwrap();
        fs::write(data.join("nrbegin").join(ip), "cid-begin\r\neth0").unwrap();
        let scan = HostLocalStore::new(data).scan();
        let r = scan.reservations.into_iter().find(|r| r.ip.to_string() == ip).unwrap();
        let config = ReleaserConfig { host_local_dirs: vec![data.to_owned()], ..ReleaserConfig::default() };
        let mut releaser = Releaser::open(state, config).unwrap();
        releaser.set_last_look(Box::new(lastlook::NoLook));
        (releaser, Verdict::new(&r, Status::Orphaned, Vec::new()))
    }

    #[test]
    fn a_begun_batch_is_journaled_and_touches_no_store_until_it_is_finished() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, data) = (tmp.path().join("state"), tmp.path().join("networks"));
        let (mut releaser, orphan) = releaser_and_orphan(&state, &data, "10.250.1.2");
        let path = orphan.reservation.path.clone();
        let begun = releaser.begin_orphaned(vec![orphan]).unwrap();
        assert_eq!(releaser.journal().pending().len(), 1, "no intent written when the batch began");
        assert!(path.exists(), "a store changed before the batch was finished");
        let records = releaser.finish_orphaned(begun).unwrap();
        let [record] = records.as_slice() else { panic!("one record: {records:?}") };
        assert!(record.outcome.released(), "{}", record.outcome);
        assert!(!path.exists());
        assert!(releaser.journal().pending().is_empty(), "the outcome was not recorded");
    }

    /// A batch reads which IPs an attachment still holds from its verdicts,
    /// not from the other files of its network (a release read every one,
    /// under churn once per death): one orphan whose container holds a
    /// second IP, judged in the same batch, keeps the attachment's cache
    /// entry; a file the batch was not given is not read.
    #[test]
    fn a_batch_takes_an_attachments_other_ips_from_its_verdicts() {
        let tmp = tempfile::tempdir().unwrap();
        let (data, cache) = (tmp.path().join("networks"), tmp.path().join("results"));
        let network = data.join("nrbegin");
        fs::create_dir_all(&network).unwrap();
        fs::create_dir_all(&cache).unwrap();
        let entry = cache.join(crate::ipam::cnicache::entry_name("nrbegin", "cid-two", "eth0"));
        // What libcni writes after the chain's ADD.
        let write_entry = |ip: &str| {
            let json = serde_json::json!({
                "kind": "cniCacheV1", "containerId": "cid-two", "config": "e30=", "ifName": "eth0",
                "networkName": "nrbegin", "netns": "/run/netns/gone",
                "result": {"cniVersion": "0.4.0", "ips": [{"version": "4", "address": format!("{ip}/24")}]},
            });
            fs::write(&entry, json.to_string()).unwrap();
        };
        for ip in ["10.250.1.30", "10.250.1.31"] {
            fs::write(network.join(ip), "cid-two\r\neth0").unwrap();
        }
        let verdict = |ip: &str, status: Status| {
            let scan = HostLocalStore::new(&data).scan();
            let r = scan.reservations.into_iter().find(|r| r.ip.to_string() == ip).unwrap();
            Verdict::new(&r, status, Vec::new())
        };
        let config = ReleaserConfig {
            host_local_dirs: vec![data.clone()],
            cni_cache_dir: Some(cache.clone()),
            ..ReleaserConfig::default()
        };
        let mut releaser = Releaser::open(&tmp.path().join("state"), config).unwrap();
        releaser.set_last_look(Box::new(lastlook::NoLook));

        // Judged together: .31 is still held, so the entry stays.
        write_entry("10.250.1.30");
        let batch = vec![verdict("10.250.1.30", Status::Orphaned), verdict("10.250.1.31", Status::InUse)];
        let begun = releaser.begin_orphaned(batch).unwrap();
        let records = releaser.finish_orphaned(begun).unwrap();
        let [record] = records.as_slice() else { panic!("one record: {records:?}") };
        let Outcome::Released { cache_entries_removed, cache_notes } = &record.outcome else {
            panic!("not released: {}", record.outcome)
        };
        assert!(cache_entries_removed.is_empty(), "{cache_entries_removed:?}");
        assert!(cache_notes.iter().any(|n| n.contains("still holds 10.250.1.31")), "{cache_notes:?}");
        assert!(entry.exists());

        // .31 alone in its batch: the file of .32 (same attachment, not
        // judged) is not read, so nothing holds the entry.
        fs::write(network.join("10.250.1.32"), "cid-two\r\neth0").unwrap();
        write_entry("10.250.1.31");
        let begun = releaser.begin_orphaned(vec![verdict("10.250.1.31", Status::Orphaned)]).unwrap();
        let records = releaser.finish_orphaned(begun).unwrap();
        let [record] = records.as_slice() else { panic!("one record: {records:?}") };
        assert!(
            matches!(&record.outcome, Outcome::Released { cache_entries_removed, .. } if cache_entries_removed == std::slice::from_ref(&entry)),
            "{:?}",
            record.outcome
        );
        assert!(!entry.exists());

        // One verdict released alone (`release`, a reviewed report) reads
        // the store: .32 still holds the entry.
        write_entry("10.250.1.33");
        fs::write(network.join("10.250.1.33"), "cid-two\r\neth0").unwrap();
        let record = releaser.release(&verdict("10.250.1.33", Status::Orphaned)).unwrap();
        let Outcome::Released { cache_entries_removed, cache_notes } = &record.outcome else {
            panic!("not released: {}", record.outcome)
        };
        assert!(cache_entries_removed.is_empty(), "{cache_entries_removed:?}");
        assert!(cache_notes.iter().any(|n| n.contains("still holds 10.250.1.32")), "{cache_notes:?}");
        assert!(entry.exists());
    }

    /// Whether the network's lock was held when the last look was asked
    /// (tried from another open file, as a plugin would).
    struct LockWitness(PathBuf, Arc<std::sync::Mutex<Vec<bool>>>);

    impl lastlook::LastLook for LockWitness {
        fn look(&mut self, _asked: &[IpAddr]) -> Result<lastlook::Sighting, lastlook::LookFound> {
            let file = fs::File::open(&self.0).unwrap();
            let free = crate::ipam::safefs::FlockGuard::try_lock_exclusive(file).unwrap().is_some();
            self.1.lock().unwrap().push(!free);
            Ok(lastlook::Sighting::nothing())
        }
    }

    #[test]
    fn act_now_unlinks_under_the_free_lock_and_leaves_the_outcome_to_finish() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, data) = (tmp.path().join("state"), tmp.path().join("networks"));
        let (mut releaser, orphan) = releaser_and_orphan(&state, &data, "10.250.1.4");
        let path = orphan.reservation.path.clone();
        let held = Arc::new(std::sync::Mutex::new(Vec::new()));
        // There before: the witness tells a lock held from none taken.
        fs::File::create(data.join("nrbegin/lock")).unwrap();
        releaser.set_last_look(Box::new(LockWitness(data.join("nrbegin/lock"), Arc::clone(&held))));
        let begun = releaser.begin_orphaned(vec![orphan]).unwrap();
        let begun = releaser.act_now(begun);
        assert!(begun.acted.is_some(), "the lock was free, yet the batch was left to finish");
        assert_eq!(*held.lock().unwrap(), [true], "the last look was not asked once under the lock");
        // Unlinked once the intents are durable (by the syncer thread),
        // without finish.
        let t = std::time::Instant::now();
        while path.exists() && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(!path.exists(), "not unlinked before finish");
        assert_eq!(releaser.journal().pending().len(), 1, "the outcome was recorded before finish");
        let records = releaser.finish_orphaned(begun).unwrap();
        let [record] = records.as_slice() else { panic!("one record: {records:?}") };
        assert!(record.outcome.released(), "{}", record.outcome);
        assert_eq!(held.lock().unwrap().len(), 1, "finish looked again");
        assert!(releaser.journal().pending().is_empty(), "the outcome was not recorded");
    }

    /// A last look that takes this long and finds nothing.
    struct SlowLook(std::time::Duration);

    impl lastlook::LastLook for SlowLook {
        fn look(&mut self, _asked: &[IpAddr]) -> Result<lastlook::Sighting, lastlook::LookFound> {
            std::thread::sleep(self.0);
            Ok(lastlook::Sighting::nothing())
        }
    }

    #[test]
    fn act_now_leaves_the_look_to_finish_while_the_last_one_took_long() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, data) = (tmp.path().join("state"), tmp.path().join("networks"));
        let (mut releaser, first) = releaser_and_orphan(&state, &data, "10.250.1.20");
        let slow = std::time::Duration::from_micros(ACT_NOW_MAX_LOOK_US) * 2;
        releaser.set_last_look(Box::new(SlowLook(slow)));
        let mut acted = Vec::new();
        let mut batch = |releaser: &mut Releaser, orphan: Verdict| {
            let begun = releaser.begin_orphaned(vec![orphan]).unwrap();
            let begun = releaser.act_now(begun);
            acted.push(begun.acted.is_some());
            let records = releaser.finish_orphaned(begun).unwrap();
            assert!(records[0].outcome.released(), "{}", records[0].outcome);
        };
        // No look yet: acted on at once, and that look was slow.
        batch(&mut releaser, first);
        let (_, second) = releaser_and_orphan(&state.join("unused"), &data, "10.250.1.21");
        batch(&mut releaser, second);
        // The pool's look was quick again: the next one is acted on at once.
        releaser.set_last_look(Box::new(lastlook::NoLook));
        let (_, third) = releaser_and_orphan(&state.join("unused2"), &data, "10.250.1.22");
        batch(&mut releaser, third);
        let (_, fourth) = releaser_and_orphan(&state.join("unused3"), &data, "10.250.1.23");
        batch(&mut releaser, fourth);
        assert_eq!(acted, [true, false, false, true], "act_now after a first slow look, then a quick one");
    }

    #[test]
    fn act_now_changes_nothing_while_the_plugin_holds_the_lock() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, data) = (tmp.path().join("state"), tmp.path().join("networks"));
        let (mut releaser, orphan) = releaser_and_orphan(&state, &data, "10.250.1.5");
        let path = orphan.reservation.path.clone();
        let lock = fs::File::create(data.join("nrbegin/lock")).unwrap();
        let plugin = crate::ipam::safefs::FlockGuard::try_lock_exclusive(lock).unwrap().unwrap();
        let begun = releaser.begin_orphaned(vec![orphan]).unwrap();
        let t = std::time::Instant::now();
        let begun = releaser.act_now(begun);
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "act_now waited for the lock");
        assert!(begun.acted.is_none(), "act_now acted with the lock held");
        assert!(path.exists(), "a store changed while the plugin held the lock");
        drop(plugin);
        let records = releaser.finish_orphaned(begun).unwrap();
        assert!(records[0].outcome.released(), "{}", records[0].outcome);
        assert!(!path.exists());
    }

    #[test]
    fn act_now_leaves_a_batch_of_two_networks_or_many_files_to_finish() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, data) = (tmp.path().join("state"), tmp.path().join("networks"));
        let (mut releaser, _) = releaser_and_orphan(&state, &data, "10.250.1.6");
        fs::create_dir_all(data.join("nrother")).unwrap();
        fs::write(data.join("nrother/10.250.2.6"), "cid-other\r\neth0").unwrap();
        for n in 7..8 + ACT_NOW_MAX_FILES {
            fs::write(data.join(format!("nrbegin/10.250.1.{n}")), format!("cid-{n}\r\neth0")).unwrap();
        }
        let orphans = |filter: &dyn Fn(&Reservation) -> bool| -> Vec<Verdict> {
            let scan = HostLocalStore::new(&data).scan();
            scan.reservations
                .iter()
                .filter(|r| filter(r))
                .map(|r| Verdict::new(r, Status::Orphaned, Vec::new()))
                .collect()
        };
        let two_networks = orphans(&|r| r.ip.to_string() == "10.250.1.6" || r.network == "nrother");
        let many = orphans(&|r| r.network == "nrbegin" && r.ip.to_string() != "10.250.1.6");
        assert_eq!((two_networks.len(), many.len()), (2, ACT_NOW_MAX_FILES + 1));
        for batch in [two_networks, many] {
            let paths: Vec<PathBuf> = batch.iter().map(|v| v.reservation.path.clone()).collect();
            let begun = releaser.begin_orphaned(batch).unwrap();
            let begun = releaser.act_now(begun);
            assert!(begun.acted.is_none());
            assert!(paths.iter().all(|p| p.exists()), "act_now changed a store of a batch it should leave");
            let records = releaser.finish_orphaned(begun).unwrap();
            assert!(records.iter().all(|r| r.outcome.released()), "{records:?}");
        }
    }

    #[test]
    fn a_begun_batch_never_finished_leaves_its_intent_for_recovery() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, data) = (tmp.path().join("state"), tmp.path().join("networks"));
        let (mut releaser, orphan) = releaser_and_orphan(&state, &data, "10.250.1.3");
        let path = orphan.reservation.path.clone();
        let begun = releaser.begin_orphaned(vec![orphan]).unwrap();
        drop(begun);
        drop(releaser);
        assert!(path.exists(), "a batch never finished changed a store");
        let again = Journal::open(&state).unwrap();
        assert_eq!(again.pending().len(), 1, "the next start does not see the intent to recover");
    }
}
