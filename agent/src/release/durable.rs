//! The gate between a batch's intents and the stores: the intents' fsync
//! runs while the releaser opens the plugin's lock, re-reads and takes the
//! last look, and every store change (an unlink, a cache entry's removal)
//! first waits here for the intents to be on disk. So the journal's rule
//! holds (an intent is durable before its store is touched) and the fsync
//! is no longer added to the lock and the look.
//!
//! The releaser's work runs on a thread made for the batch and the fsync on
//! the thread that made it: a new thread starts at once when its maker
//! blocks, and the fsync blocks on the disk. (The other way round, the
//! fsync's thread started about 1 ms late on a busy 2-core node, after the
//! look: no overlap.)

use std::{
    sync::{Condvar, Mutex, PoisonError},
    time::Instant,
};

use super::{
    journal::{JournalError, UnsyncedIntents},
    outcome::micros,
};

/// Whether the batch's intents are durable yet; see the module's text.
#[derive(Debug, Default)]
pub(crate) struct Durable {
    state: Mutex<State>,
    opened: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// None until the fsync is done; then Ok, or the error's text for each
    /// store change refused after it (the error itself goes to the caller).
    result: Option<Result<(), String>>,
    timings: DurableTimings,
}

impl Durable {
    /// Intents not yet synced: store changes wait for [`Durable::sync`].
    pub(crate) fn pending() -> Self {
        Self::default()
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
        let mut state = self.lock();
        state.timings.fsync_us = micros(t);
        state.result = Some(result.as_ref().copied().map_err(|e| format!("the intent is not durable: {e}")));
        drop(state);
        self.opened.notify_all();
        result
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

    /// How long the fsync took and the first store change waited for it.
    pub(crate) fn timings(&self) -> DurableTimings {
        self.lock().timings
    }
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
            hostlocal::{release_group, reservation_file},
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

    #[test]
    fn no_unlink_when_the_intents_could_not_be_synced() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("networks");
        let r = reservation(&data);
        let file = reservation_file(&r, std::slice::from_ref(&data)).unwrap();
        let durable = Durable::pending();
        let (outcomes, synced) = std::thread::scope(|scope| {
            let acting = scope.spawn(|| {
                release_group(&file.network_dir, &[(&r, &file)], &mut NoLook, Duration::from_secs(1), false, &durable)
            });
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
        let data = tmp.path().join("networks");
        let r = reservation(&data);
        let file = reservation_file(&r, std::slice::from_ref(&data)).unwrap();
        let mut journal = crate::release::Journal::open(&tmp.path().join("state")).unwrap();
        let verdict = crate::engine::Verdict::new(&r, crate::engine::Status::Orphaned, Vec::new());
        let (_, unsynced) = journal.write_intents(&[&verdict], false).unwrap();
        let durable = Durable::pending();
        let outcomes = std::thread::scope(|scope| {
            let acting = scope.spawn(|| {
                release_group(&file.network_dir, &[(&r, &file)], &mut NoLook, Duration::from_secs(1), false, &durable)
            });
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
    fn already_durable_intents_do_not_wait() {
        let durable = Durable::already();
        assert_eq!(durable.wait(), Ok(()));
        assert_eq!(durable.timings(), DurableTimings::default());
    }
}
