//! The gate between a batch's intents and the stores: the intents' fsync
//! runs on a thread of its own while the releaser opens the plugin's lock,
//! re-reads and takes the last look, and every store change (an unlink, a
//! cache entry's removal) first waits here for the intents to be on disk.
//! So the journal's rule holds (an intent is durable before its store is
//! touched) and the fsync is no longer added to the lock and the look.

use std::{thread::ScopedJoinHandle, time::Instant};

use super::{
    journal::{JournalError, UnsyncedIntents},
    outcome::micros,
};

/// The fsync's result and how long it took, in micro-seconds.
type Synced = (Result<(), JournalError>, u64);

/// Whether the batch's intents are durable yet; see the module's text.
#[derive(Debug)]
pub(crate) struct Durable<'scope> {
    /// The fsync, until it is joined.
    syncing: Option<ScopedJoinHandle<'scope, Synced>>,
    /// Once joined: Ok, or the error's text for each store change refused
    /// after it (the error itself goes to the caller).
    state: Result<(), String>,
    error: Option<JournalError>,
    timings: DurableTimings,
}

impl<'scope> Durable<'scope> {
    /// Starts the fsync of `intents` on a thread of `scope`; when no
    /// thread can be made, syncs here, before anything else.
    pub(crate) fn start<'env>(scope: &'scope std::thread::Scope<'scope, 'env>, intents: UnsyncedIntents) -> Self {
        let intents = std::sync::Arc::new(intents);
        let theirs = std::sync::Arc::clone(&intents);
        let spawned = std::thread::Builder::new().name("netreap-fsync".into()).spawn_scoped(scope, move || {
            let t = Instant::now();
            let result = theirs.sync();
            (result, micros(t))
        });
        match spawned {
            Ok(syncing) => Self { syncing: Some(syncing), ..Self::already() },
            Err(e) => {
                tracing::debug!("no thread for the journal's fsync ({e}); synced before the lock");
                let t = Instant::now();
                let result = intents.sync();
                let fsync_us = micros(t);
                Self::settled(result, DurableTimings { fsync_us, waited_us: fsync_us })
            }
        }
    }

    /// Intents that are already durable (recovery acts on intents an
    /// earlier run wrote).
    pub(crate) fn already() -> Self {
        Self { syncing: None, state: Ok(()), error: None, timings: DurableTimings::default() }
    }

    fn settled(result: Result<(), JournalError>, timings: DurableTimings) -> Self {
        let state = result.as_ref().copied().map_err(|e| format!("the intent is not durable: {e}"));
        Self { syncing: None, state, error: result.err(), timings }
    }

    /// Waits until the intents are on disk. Err: they may not be, and no
    /// store may change (the text says why, for the outcome).
    pub(crate) fn wait(&mut self) -> Result<(), String> {
        if let Some(syncing) = self.syncing.take() {
            let t = Instant::now();
            let (result, fsync_us) = syncing.join().unwrap_or((Err(JournalError::SyncPanicked), 0));
            *self = Self::settled(result, DurableTimings { fsync_us, waited_us: micros(t) });
        }
        self.state.clone()
    }

    /// Joins the fsync (when nothing waited for it) and gives its error.
    pub(crate) fn finish(mut self) -> Result<DurableTimings, JournalError> {
        // The text is for outcomes; the error itself is returned here.
        let _ = self.wait();
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.timings),
        }
    }
}

/// How long the intents' fsync took, and how long the first store change
/// (or the end of the batch) waited for it: the part not overlapped.
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
        let (outcomes, finished) = std::thread::scope(|scope| {
            let mut durable = Durable::start(scope, UnsyncedIntents::failing());
            let outcomes = release_group(
                &file.network_dir,
                &[(&r, &file)],
                &mut NoLook,
                Duration::from_secs(1),
                false,
                &mut durable,
            );
            (outcomes, durable.finish())
        });
        let [(outcome, _)] = outcomes.as_slice() else { panic!("one outcome: {outcomes:?}") };
        assert!(
            matches!(outcome, Outcome::Failed { error } if error.contains("not durable")),
            "the unlink went ahead: {outcome}"
        );
        assert!(r.path.exists(), "the file was removed without a durable intent");
        assert!(matches!(finished, Err(JournalError::Io { .. })), "{finished:?}");
    }

    #[test]
    fn the_unlink_goes_ahead_once_the_intents_are_durable() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("networks");
        let r = reservation(&data);
        let file = reservation_file(&r, std::slice::from_ref(&data)).unwrap();
        let mut journal = crate::release::Journal::open(&tmp.path().join("state")).unwrap();
        let verdict = crate::engine::Verdict::new(&r, crate::engine::Status::Orphaned, Vec::new());
        let (_, unsynced) = journal.write_intents(&[&verdict], false).unwrap();
        let (outcomes, finished) = std::thread::scope(|scope| {
            let mut durable = Durable::start(scope, unsynced);
            let outcomes = release_group(
                &file.network_dir,
                &[(&r, &file)],
                &mut NoLook,
                Duration::from_secs(1),
                false,
                &mut durable,
            );
            (outcomes, durable.finish())
        });
        assert!(outcomes[0].0.released(), "{}", outcomes[0].0);
        assert!(!r.path.exists());
        finished.unwrap();
    }

    #[test]
    fn already_durable_intents_do_not_wait() {
        let mut durable = Durable::already();
        assert_eq!(durable.wait(), Ok(()));
        assert_eq!(durable.finish().unwrap(), DurableTimings::default());
    }
}
