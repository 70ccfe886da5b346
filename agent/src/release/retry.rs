//! Which orphaned reservations to hand to the releaser on this reconcile.
//!
//! Without it every reconcile re-journals every orphan that is still there:
//! in dry run all of them (nothing is removed), and any whose release
//! failed. With it:
//! - a reservation is attempted once per verdict change: once orphaned, it
//!   is not attempted again until it stops being orphaned (or the file is
//!   replaced) and becomes orphaned anew;
//! - an attempt that left the file in place because of something that may
//!   pass (an error, a busy lock, a file that changed under us) is retried
//!   with exponential back-off, [`RETRY_FIRST`] doubling up to [`RETRY_MAX`];
//! - a dry run's "would release", and a refusal (configuration, not
//!   chance), are final for that verdict.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    time::{Duration, Instant, SystemTime},
};

use super::{ReleaseRecord, outcome::Outcome};
use crate::engine::Verdict;

/// First retry after a failed attempt.
pub const RETRY_FIRST: Duration = Duration::from_secs(5);
/// Longest wait between retries.
pub const RETRY_MAX: Duration = Duration::from_mins(5);

/// The file a verdict was about: a re-created file (new owner, or the same
/// owner again) is another reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    container_id: String,
    inode: u64,
    created_at: SystemTime,
}

impl Identity {
    fn of(v: &Verdict) -> Self {
        let r = &v.reservation;
        Self { container_id: r.container_id.to_string(), inode: r.inode, created_at: r.created_at }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Handed to the releaser; its record has not come back yet.
    InFlight { attempts: u32 },
    /// Attempted; nothing more to do while the verdict stays.
    Settled,
    /// Attempted `attempts` times without effect; next try at `next_at`.
    BackingOff { attempts: u32, next_at: Instant },
}

#[derive(Debug)]
struct Entry {
    identity: Identity,
    state: State,
}

/// See the module documentation. Keyed by reservation file.
#[derive(Debug, Default)]
pub struct RetryGate {
    entries: HashMap<PathBuf, Entry>,
}

impl RetryGate {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets what is no longer orphaned (so its next orphan verdict is a
    /// change), and returns the orphaned verdicts to attempt now, marking
    /// them in flight until [`RetryGate::settle`] hears of them.
    pub fn admit(&mut self, verdicts: &[Verdict], now: Instant) -> Vec<Verdict> {
        self.admit_among(verdicts, now, |_| true)
    }

    /// [`RetryGate::admit`] for a pass that judged only these reservations
    /// (the daemon's death path): what it did not judge stays as it was.
    pub fn admit_judged(&mut self, verdicts: &[Verdict], now: Instant) -> Vec<Verdict> {
        let judged: HashSet<&PathBuf> = verdicts.iter().map(|v| &v.reservation.path).collect();
        self.admit_among(verdicts, now, |path| judged.contains(path))
    }

    /// `admit`, forgetting only entries `judged` says the verdicts cover.
    fn admit_among(&mut self, verdicts: &[Verdict], now: Instant, judged: impl Fn(&PathBuf) -> bool) -> Vec<Verdict> {
        let orphans: HashMap<&PathBuf, &Verdict> =
            verdicts.iter().filter(|v| v.is_orphaned()).map(|v| (&v.reservation.path, v)).collect();
        self.entries
            .retain(|path, e| !judged(path) || orphans.get(path).is_some_and(|v| Identity::of(v) == e.identity));
        let mut admitted = Vec::new();
        for v in verdicts.iter().filter(|v| v.is_orphaned()) {
            let attempts = match self.entries.get(&v.reservation.path).map(|e| e.state) {
                None => 0,
                Some(State::BackingOff { attempts, next_at }) if next_at <= now => attempts,
                Some(_) => continue,
            };
            self.entries.insert(
                v.reservation.path.clone(),
                Entry { identity: Identity::of(v), state: State::InFlight { attempts } },
            );
            admitted.push(v.clone());
        }
        admitted
    }

    /// Takes the records of the attempts [`RetryGate::admit`] handed out.
    /// Attempts given back without a record (a batch that failed as a
    /// whole) are retried after back-off.
    pub fn settle(&mut self, admitted: &[Verdict], records: &[ReleaseRecord], now: Instant) {
        let mut answered = HashSet::with_capacity(records.len());
        for record in records {
            let path = &record.verdict.reservation.path;
            answered.insert(path.clone());
            let Some(entry) = self.entries.get_mut(path) else { continue };
            if entry.identity != Identity::of(&record.verdict) {
                continue;
            }
            match &record.outcome {
                // Gone: nothing left to remember.
                Outcome::Released { .. } | Outcome::AlreadyGone | Outcome::DryRunClosed | Outcome::Kept { .. } => {
                    self.entries.remove(path);
                }
                Outcome::WouldRelease { .. } | Outcome::Refused { .. } => entry.state = State::Settled,
                Outcome::OwnerChanged { .. }
                | Outcome::Anomalous { .. }
                | Outcome::Failed { .. }
                | Outcome::LockBusy { .. }
                // The kernel showed it in use at the last moment: the next
                // verdict will most likely say so too; if not, look later.
                | Outcome::LastLookKept { .. } => {
                    entry.state = back_off(entry.state, now);
                }
            }
        }
        for v in admitted {
            if answered.contains(&v.reservation.path) {
                continue;
            }
            if let Some(entry) = self.entries.get_mut(&v.reservation.path) {
                entry.state = back_off(entry.state, now);
            }
        }
    }

    /// Reservations waiting to be retried.
    #[must_use]
    pub fn backing_off(&self) -> usize {
        self.entries.values().filter(|e| matches!(e.state, State::BackingOff { .. })).count()
    }

    /// When the earliest retry is due, if any waits.
    #[must_use]
    pub fn next_retry(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter_map(|e| match e.state {
                State::BackingOff { next_at, .. } => Some(next_at),
                _ => None,
            })
            .min()
    }
}

fn back_off(state: State, now: Instant) -> State {
    let attempts = match state {
        State::InFlight { attempts } | State::BackingOff { attempts, .. } => attempts + 1,
        State::Settled => 1,
    };
    let wait = RETRY_FIRST.saturating_mul(1u32 << (attempts - 1).min(16)).min(RETRY_MAX);
    State::BackingOff { attempts, next_at: now + wait }
}

#[cfg(test)]
mod tests {
    use std::{net::IpAddr, path::Path};

    use super::*;
    use crate::{
        engine::Status,
        ipam::{Reservation, ReservationData, StoreRef},
    };

    fn verdict(ip: &str, container: &str, status: Status) -> Verdict {
        let ip: IpAddr = ip.parse().expect("test IP");
        let reservation = Reservation::from(ReservationData {
            store: StoreRef::HostLocal { data_dir: PathBuf::from("/d") }.into(),
            network: "n".into(),
            ip,
            container_id: container.into(),
            ifname: Some("eth0".into()),
            path: Path::new("/d/n").join(ip.to_string()),
            created_at: SystemTime::UNIX_EPOCH,
            inode: 7,
        });
        Verdict { reservation, status, evidence: Vec::new().into() }
    }

    fn record(v: &Verdict, outcome: Outcome) -> ReleaseRecord {
        ReleaseRecord { intent_id: None, dry_run: false, verdict: v.clone(), outcome, reverified: None }
    }

    fn would() -> Outcome {
        Outcome::WouldRelease { cache_entries: Vec::new(), cache_notes: Vec::new() }
    }

    #[test]
    fn a_dry_run_orphan_is_attempted_once_per_verdict_change() {
        let mut gate = RetryGate::new();
        let t = Instant::now();
        let orphan = verdict("10.0.0.2", "c", Status::Orphaned);
        let admitted = gate.admit(std::slice::from_ref(&orphan), t);
        assert_eq!(admitted.len(), 1);
        assert!(gate.admit(std::slice::from_ref(&orphan), t).is_empty(), "in flight: not twice");
        gate.settle(&admitted, &[record(&orphan, would())], t);
        for s in 1..100 {
            assert!(gate.admit(std::slice::from_ref(&orphan), t + Duration::from_secs(s)).is_empty());
        }
        // The verdict changes (in use again), then orphaned again: a change.
        let in_use = verdict("10.0.0.2", "c", Status::InUse);
        assert!(gate.admit(&[in_use], t).is_empty());
        assert_eq!(gate.admit(std::slice::from_ref(&orphan), t).len(), 1);
        // A re-created file is another reservation.
        let mut recreated = orphan.clone();
        recreated.reservation.inode = 8;
        gate.settle(&[orphan], &[], t);
        assert_eq!(gate.admit(&[recreated], t).len(), 1);
    }

    #[test]
    fn failures_back_off_exponentially_up_to_the_cap() {
        let mut gate = RetryGate::new();
        let mut t = Instant::now();
        let orphan = verdict("10.0.0.3", "c", Status::Orphaned);
        let failed = || record(&orphan, Outcome::Failed { error: "lock busy".into() });
        let mut waits = Vec::new();
        let mut last_attempt = t;
        for _ in 0..400 {
            let admitted = gate.admit(std::slice::from_ref(&orphan), t);
            if !admitted.is_empty() {
                waits.push(t - last_attempt);
                last_attempt = t;
                gate.settle(&admitted, &[failed()], t);
                assert_eq!(gate.backing_off(), 1);
            }
            t += Duration::from_secs(1);
        }
        let secs: Vec<u64> = waits.iter().map(Duration::as_secs).collect();
        assert_eq!(&secs[..7], [0, 5, 10, 20, 40, 80, 160], "{secs:?}");
        assert!(secs[7..].iter().all(|s| *s == 300), "capped at 5 min: {secs:?}");
        // Success ends it.
        t += RETRY_MAX;
        let admitted = gate.admit(std::slice::from_ref(&orphan), t);
        gate.settle(&admitted, &[record(&orphan, Outcome::AlreadyGone)], t);
        assert_eq!((gate.backing_off(), gate.next_retry()), (0, None));
    }

    #[test]
    fn an_attempt_without_a_record_backs_off() {
        let mut gate = RetryGate::new();
        let t = Instant::now();
        let orphan = verdict("10.0.0.4", "c", Status::Orphaned);
        let admitted = gate.admit(std::slice::from_ref(&orphan), t);
        gate.settle(&admitted, &[], t);
        assert_eq!(gate.next_retry(), Some(t + RETRY_FIRST));
        assert!(gate.admit(std::slice::from_ref(&orphan), t).is_empty());
        assert_eq!(gate.admit(std::slice::from_ref(&orphan), t + RETRY_FIRST).len(), 1);
    }
}
