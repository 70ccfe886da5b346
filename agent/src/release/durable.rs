//! The gate between a batch's intents and the stores: the intents' fsync
//! runs while the releaser opens the plugin's lock, re-reads and takes the
//! last look, and every store change (an unlink, a cache entry's removal)
//! first waits here for the intents to be on disk. So the journal's rule
//! holds (an intent is durable before its store is touched) and the fsync
//! is no longer added to the lock and the look.
//!
//! The fsync runs on one thread made once for the process ([`sync_beside`])
//! and the releaser's work on the thread that wrote the intents. A thread
//! made per batch for the store work started 0.43 ms p50 (3.0 ms p99) after
//! it was asked for on a busy 2-core node (timed inside the agent, latency
//! item), and the lock and the look waited for it; a parked thread is only
//! woken. A group's unlinks, once its look under the lock passed them, are
//! handed here ([`Durable::when_durable`]) with the lock, and run by
//! whichever thread gets there last: the releaser's, or the syncer right
//! after the fsync. Under load the fsync outlasts the look (1.2-1.8 ms p50
//! against 0.7-0.8 ms, latency item), and a releaser woken by its end was
//! then one more thread to be scheduled before the unlink.

use std::{
    sync::{Arc, Condvar, LazyLock, Mutex, PoisonError, mpsc},
    time::Instant,
};

use super::{
    journal::{JournalError, UnsyncedIntents},
    outcome::micros,
};

/// Whether the batch's intents are durable yet; see the module's text.
#[derive(Debug)]
pub(crate) struct Durable {
    state: Mutex<State>,
    opened: Condvar,
    /// Just before the batch's intents were written: the release path's
    /// parts are timed from here (`ReleaseTimings::handoff_us`).
    begun: Instant,
}

impl Default for Durable {
    fn default() -> Self {
        Self { state: Mutex::default(), opened: Condvar::new(), begun: Instant::now() }
    }
}

#[derive(Default)]
struct State {
    /// None until the fsync is done; then Ok, or the error's text for each
    /// store change refused after it (the error itself goes to the caller).
    result: Option<Result<(), String>>,
    timings: DurableTimings,
    /// What waits for the result, since when (see `Durable::when_durable`).
    queued: Vec<(Instant, Then)>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("result", &self.result)
            .field("timings", &self.timings)
            .field("queued", &self.queued.len())
            .finish()
    }
}

/// A store change waiting for the intents, given their fsync's result.
pub(crate) type Then = Box<dyn FnOnce(Result<(), String>) + Send>;

impl Durable {
    /// Intents not yet synced: store changes wait for [`Durable::sync`].
    #[cfg(test)]
    pub(crate) fn pending() -> Self {
        Self::default()
    }

    /// Like [`Durable::pending`], for intents whose writing began at `begun`.
    pub(crate) fn pending_since(begun: Instant) -> Self {
        Self { begun, ..Self::default() }
    }

    /// When the batch's intents began to be written.
    pub(crate) fn begun_at(&self) -> Instant {
        self.begun
    }

    /// Intents that are already durable (recovery acts on intents an
    /// earlier run wrote).
    pub(crate) fn already() -> Self {
        let durable = Self::default();
        durable.lock().result = Some(Ok(()));
        durable
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes the intents durable and lets the store changes waiting for
    /// them go on (or fail, when the fsync failed).
    pub(crate) fn sync(&self, intents: &UnsyncedIntents) -> Result<(), JournalError> {
        let t = Instant::now();
        let result = intents.sync();
        self.lock().timings.fsync_us = micros(t);
        self.settle(result.as_ref().copied().map_err(|e| format!("the intent is not durable: {e}")));
        result
    }

    /// No store may change: the intents' sync will not happen (its thread
    /// stopped). A result already there stays.
    fn fail(&self, why: &str) {
        self.settle(Err(why.to_owned()));
    }

    /// Waits until the intents are on disk. Err: they may not be, and no
    /// store may change (the text says why, for the outcome).
    pub(crate) fn wait(&self) -> Result<(), String> {
        let t = Instant::now();
        let mut state = self.lock();
        let mut waited = false;
        while state.result.is_none() {
            waited = true;
            state = self.opened.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        if waited && state.timings.waited_us == 0 {
            state.timings.waited_us = micros(t);
        }
        state.result.clone().unwrap_or(Ok(()))
    }

    /// Runs `then` once the intents' fsync has ended, with its result: here
    /// and now if it has, else on the thread that ends it, right after (so
    /// a store change does not also wait for a waiting thread to be woken).
    /// `then` must be short: the syncer thread runs it.
    pub(crate) fn when_durable(&self, then: Then) {
        let mut state = self.lock();
        match state.result.clone() {
            Some(result) => {
                drop(state);
                then(result);
            }
            None => state.queued.push((Instant::now(), then)),
        }
    }

    /// The result, then what waited for it (see [`Durable::when_durable`]).
    fn settle(&self, result: Result<(), String>) {
        let mut state = self.lock();
        if state.result.is_none() {
            state.result = Some(result);
        }
        let result = state.result.clone().unwrap_or(Ok(()));
        let queued = std::mem::take(&mut state.queued);
        if let Some((since, _)) = queued.first()
            && state.timings.waited_us == 0
        {
            state.timings.waited_us = micros(*since);
        }
        drop(state);
        self.opened.notify_all();
        for (_, then) in queued {
            then(result.clone());
        }
    }

    /// How long the fsync took and the first store change waited for it.
    pub(crate) fn timings(&self) -> DurableTimings {
        self.lock().timings
    }
}

/// One batch's intents for the syncer thread. Dropped unsynced (the
/// thread panicked or stopped), it fails its [`Durable`]: the store changes
/// waiting for it give up instead of waiting forever.
struct Job {
    durable: Arc<Durable>,
    intents: UnsyncedIntents,
    done: mpsc::SyncSender<Result<(), JournalError>>,
    synced: bool,
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.synced {
            self.durable.fail("the thread syncing the intents stopped before their fsync");
        }
    }
}

/// The process's syncer thread, made at its first batch (and again if it
/// stopped).
static SYNCER: LazyLock<Mutex<Option<mpsc::Sender<Job>>>> = LazyLock::new(|| Mutex::new(None));

fn spawn_syncer() -> Option<mpsc::Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("netreap-sync".into())
        .spawn(move || {
            for mut job in rx {
                let result = job.durable.sync(&job.intents);
                job.synced = true;
                // The batch may have stopped waiting (it panicked): nothing to tell.
                let _ = job.done.send(result);
            }
        })
        .ok()?;
    Some(tx)
}

/// The result of [`sync_beside`], to be taken once the store work is done.
pub(crate) struct Syncing(Result<mpsc::Receiver<Result<(), JournalError>>, Result<(), JournalError>>);

impl Syncing {
    /// Whether the intents are durable (blocks until their fsync ended).
    pub(crate) fn result(self) -> Result<(), JournalError> {
        match self.0 {
            Ok(answer) => answer.recv().unwrap_or(Err(JournalError::SyncPanicked)),
            Err(done) => done,
        }
    }
}

/// Starts the intents' fsync on the syncer thread and returns at once:
/// `durable` opens when it is done. Without a syncer thread (none can be
/// made), syncs here first.
pub(crate) fn sync_beside(durable: &Arc<Durable>, intents: UnsyncedIntents) -> Syncing {
    let (done, answer) = mpsc::sync_channel(1);
    let mut job = Job { durable: Arc::clone(durable), intents, done, synced: false };
    let mut syncer = SYNCER.lock().unwrap_or_else(PoisonError::into_inner);
    // A syncer that stopped gives the job back: a new one is made, once.
    for _ in 0..2 {
        let Some(tx) = syncer.as_ref().cloned().or_else(spawn_syncer) else { break };
        match tx.send(job) {
            Ok(()) => {
                *syncer = Some(tx);
                return Syncing(Ok(answer));
            }
            Err(mpsc::SendError(back)) => {
                job = back;
                *syncer = None;
            }
        }
    }
    drop(syncer);
    let result = job.durable.sync(&job.intents);
    job.synced = true;
    Syncing(Err(result))
}

/// How long the intents' fsync took, and how long the first store change
/// that had to wait for it waited: the part not overlapped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DurableTimings {
    pub fsync_us: u64,
    pub waited_us: u64,
}

#[cfg(test)]
mod tests {
    use std::{fs, path::Path, time::Duration};

    use super::*;
    use crate::{
        ipam::{ReservationStore, hostlocal::HostLocalStore},
        release::{
            hostlocal::{release_group, reservation_file, try_release_group},
            lastlook::NoLook,
            outcome::Outcome,
        },
    };

    /// One host-local reservation on disk, as the plugin writes it.
    fn reservation(data: &Path) -> crate::ipam::Reservation {
        fs::create_dir_all(data.join("nrdur")).unwrap();
        fs::write(data.join("nrdur/10.250.0.2"), "cid-durable\r\neth0").unwrap();
        let mut scan = HostLocalStore::new(data).scan();
        assert!(scan.anomalies.is_empty(), "{:?}", scan.anomalies);
        scan.reservations.pop().unwrap()
    }

    /// One reservation under `tmp`, and the file the release acts on.
    fn reservation_and_file(tmp: &Path) -> (crate::ipam::Reservation, crate::release::hostlocal::ReservationFile) {
        let data = tmp.join("networks");
        let r = reservation(&data);
        let file = reservation_file(&r, std::slice::from_ref(&data)).unwrap();
        (r, file)
    }

    /// A journal under `tmp` and an orphaned verdict of `r`.
    fn journal_and_verdict(
        tmp: &Path,
        r: &crate::ipam::Reservation,
    ) -> (crate::release::Journal, crate::engine::Verdict) {
        let journal = crate::release::Journal::open(&tmp.join("state")).unwrap();
        (journal, crate::engine::Verdict::new(r, crate::engine::Status::Orphaned, Vec::new()))
    }

    /// The release of `r` alone, no last look, its store changes behind `durable`.
    fn release_alone(
        r: &crate::ipam::Reservation,
        file: &crate::release::hostlocal::ReservationFile,
        durable: &Durable,
    ) -> Vec<(Outcome, crate::release::outcome::ReleaseTimings)> {
        release_group(&file.network_dir, &[(r, file)], &mut NoLook, Duration::from_secs(1), false, durable)
    }

    #[test]
    fn no_unlink_when_the_intents_could_not_be_synced() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let durable = Durable::pending();
        let (outcomes, synced) = std::thread::scope(|scope| {
            let acting = scope.spawn(|| release_alone(&r, &file, &durable));
            let synced = durable.sync(&UnsyncedIntents::failing());
            (acting.join().unwrap(), synced)
        });
        let [(outcome, _)] = outcomes.as_slice() else { panic!("one outcome: {outcomes:?}") };
        assert!(
            matches!(outcome, Outcome::Failed { error } if error.contains("not durable")),
            "the unlink went ahead: {outcome}"
        );
        assert!(r.path.exists(), "the file was removed without a durable intent");
        assert!(matches!(synced, Err(JournalError::Io { .. })), "{synced:?}");
    }

    #[test]
    fn the_unlink_waits_for_the_intents_then_goes_ahead() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let (mut journal, verdict) = journal_and_verdict(tmp.path(), &r);
        let (_, unsynced) = journal.write_intents(&[&verdict], false).unwrap();
        let durable = Durable::pending();
        let outcomes = std::thread::scope(|scope| {
            let acting = scope.spawn(|| release_alone(&r, &file, &durable));
            // Not synced yet: the unlink is held.
            std::thread::sleep(Duration::from_millis(100));
            assert!(r.path.exists(), "unlinked before the intents were synced");
            durable.sync(&unsynced).unwrap();
            acting.join().unwrap()
        });
        assert!(outcomes[0].0.released(), "{}", outcomes[0].0);
        assert!(!r.path.exists());
        assert!(durable.timings().waited_us > 0);
    }

    #[test]
    fn intents_synced_beside_let_the_unlink_go_ahead() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let (mut journal, verdict) = journal_and_verdict(tmp.path(), &r);
        // Twice: the second batch is synced by the same thread, woken.
        for _ in 0..2 {
            let (_, unsynced) = journal.write_intents(&[&verdict], true).unwrap();
            let durable = Arc::new(Durable::pending());
            let syncing = sync_beside(&durable, unsynced);
            assert_eq!(durable.wait(), Ok(()));
            syncing.result().unwrap();
        }
        let (_, unsynced) = journal.write_intents(&[&verdict], false).unwrap();
        let durable = Arc::new(Durable::pending());
        let syncing = sync_beside(&durable, unsynced);
        let outcomes = release_alone(&r, &file, &durable);
        syncing.result().unwrap();
        assert!(outcomes[0].0.released(), "{}", outcomes[0].0);
        assert!(!r.path.exists());
    }

    #[test]
    fn no_unlink_when_the_intents_synced_beside_failed() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let durable = Arc::new(Durable::pending());
        let syncing = sync_beside(&durable, UnsyncedIntents::failing());
        let outcomes = release_alone(&r, &file, &durable);
        let [(outcome, _)] = outcomes.as_slice() else { panic!("one outcome: {outcomes:?}") };
        assert!(
            matches!(outcome, Outcome::Failed { error } if error.contains("not durable")),
            "the unlink went ahead: {outcome}"
        );
        assert!(r.path.exists(), "the file was removed without a durable intent");
        assert!(matches!(syncing.result(), Err(JournalError::Io { .. })));
    }

    #[test]
    fn a_started_unlink_is_done_by_the_thread_that_makes_the_intents_durable() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let (mut journal, verdict) = journal_and_verdict(tmp.path(), &r);
        let files = [(&r, &file)];
        let lock_is_free = || {
            let lock = fs::File::open(file.network_dir.join("lock")).unwrap();
            crate::ipam::safefs::FlockGuard::try_lock_exclusive(lock).unwrap().is_some()
        };
        // Not durable yet: started, nothing unlinked, the lock held.
        let (_, unsynced) = journal.write_intents(&[&verdict], false).unwrap();
        let durable = Durable::pending();
        let underway =
            try_release_group(&file.network_dir, &files, &mut NoLook, false, &durable).expect("the lock was free");
        assert!(r.path.exists(), "unlinked before the intents were synced");
        assert!(!lock_is_free(), "the lock was let go before the unlink");
        // The fsync ends on this thread, and the unlink with it.
        durable.sync(&unsynced).unwrap();
        assert!(!r.path.exists(), "the thread that synced the intents did not unlink");
        let outcomes = underway.complete();
        assert!(outcomes[0].0.released(), "{}", outcomes[0].0);
        assert!(lock_is_free(), "the lock is still held after the release");
    }

    #[test]
    fn a_started_unlink_keeps_the_lock_until_it_is_done_even_unwaited() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let (mut journal, verdict) = journal_and_verdict(tmp.path(), &r);
        let (_, unsynced) = journal.write_intents(&[&verdict], false).unwrap();
        let durable = Durable::pending();
        let files = [(&r, &file)];
        let underway =
            try_release_group(&file.network_dir, &files, &mut NoLook, false, &durable).expect("the lock was free");
        // No one waits for the results any more: the look's approval must
        // not outlive the lock.
        drop(underway);
        let lock = fs::File::open(file.network_dir.join("lock")).unwrap();
        assert!(
            crate::ipam::safefs::FlockGuard::try_lock_exclusive(lock).unwrap().is_none(),
            "the lock was let go before the unlink"
        );
        durable.sync(&unsynced).unwrap();
        assert!(!r.path.exists());
        let lock = fs::File::open(file.network_dir.join("lock")).unwrap();
        assert!(crate::ipam::safefs::FlockGuard::try_lock_exclusive(lock).unwrap().is_some());
    }

    #[test]
    fn a_started_unlink_is_not_done_when_the_intents_could_not_be_synced() {
        let tmp = tempfile::tempdir().unwrap();
        let (r, file) = reservation_and_file(tmp.path());
        let durable = Durable::pending();
        let files = [(&r, &file)];
        let underway =
            try_release_group(&file.network_dir, &files, &mut NoLook, false, &durable).expect("the lock was free");
        assert!(durable.sync(&UnsyncedIntents::failing()).is_err());
        let outcomes = underway.complete();
        assert!(
            matches!(&outcomes[0].0, Outcome::Failed { error } if error.contains("not durable")),
            "the unlink went ahead: {}",
            outcomes[0].0
        );
        assert!(r.path.exists(), "the file was removed without a durable intent");
    }

    #[test]
    fn a_sync_that_never_happens_fails_the_waiting_store_changes() {
        // The syncer thread stopped with the job: whoever waits for the
        // intents must hear "not durable", not wait forever.
        let durable = Arc::new(Durable::pending());
        let (done, answer) = mpsc::sync_channel(1);
        let job = Job { durable: Arc::clone(&durable), intents: UnsyncedIntents::failing(), done, synced: false };
        let waiter = {
            let durable = Arc::clone(&durable);
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || tx.send(durable.wait()));
            rx
        };
        drop(job);
        let outcome = waiter.recv_timeout(Duration::from_secs(5)).expect("the store change still waits");
        assert!(outcome.is_err(), "{outcome:?}");
        assert!(matches!(Syncing(Ok(answer)).result(), Err(JournalError::SyncPanicked)));
    }

    #[test]
    fn already_durable_intents_do_not_wait() {
        let durable = Durable::already();
        assert_eq!(durable.wait(), Ok(()));
        assert_eq!(durable.timings(), DurableTimings::default());
    }
}
