//! Releasing a host-local reservation the way the plugin itself does: under
//! `flock(LOCK_EX)` on `<dataDir>/<network>/lock` (go-filemutex: open
//! `O_CREAT|O_RDONLY` 0750, `flock(LOCK_EX)`), after re-reading the file and
//! checking it still names the same owner and is the same file. Only the
//! re-read, the last look and the unlink happen under the lock. A batch
//! takes each network's lock once for its group of files, with one last
//! look under it (see `lastlook`).

use std::{
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use super::{
    durable::Durable,
    lastlook::{LastLook, LookFound, Sighting},
    outcome::{Outcome, ReleaseTimings, micros},
};
use crate::ipam::{
    AnomalyKind, Owner, Reservation, StoreRef,
    hostlocal::{EntryName, LOCK_FILE, ReadOwner, classify_name, is_valid_network_name, read_owner},
    safefs::{Dir, FlockGuard},
};

/// The host-local file a reservation lives in, rebuilt from (data dir,
/// network, IP) and checked against the recorded path: a report edited by
/// hand (or by someone hostile) cannot point a release anywhere else.
#[derive(Debug, Clone)]
pub(crate) struct ReservationFile {
    pub network_dir: PathBuf,
    pub name: String,
}

pub(crate) fn reservation_file(r: &Reservation, allowed: &[PathBuf]) -> Result<ReservationFile, String> {
    let StoreRef::HostLocal { data_dir } = &*r.store else {
        return Err(format!("{} is not a host-local store", r.store));
    };
    if !allowed.contains(data_dir) {
        return Err(format!("data dir {} is not one this releaser is configured for", data_dir.display()));
    }
    if !is_valid_network_name(&r.network) {
        return Err(format!("network {:?} is not a plain directory name", r.network));
    }
    let name = r.ip.to_string();
    let network_dir = data_dir.join(&r.network);
    let expected = network_dir.join(&name);
    if expected != r.path {
        return Err(format!(
            "path {} is not where host-local keeps {} ({})",
            r.path.display(),
            r.ip,
            expected.display()
        ));
    }
    Ok(ReservationFile { network_dir, name })
}

fn open_dir(network_dir: &Path) -> Result<Dir, Outcome> {
    Dir::open(network_dir).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => Outcome::AlreadyGone,
        Some(libc::ELOOP | libc::ENOTDIR) => Outcome::Anomalous {
            kind: AnomalyKind::Symlink,
            detail: format!("{} is no longer a plain directory", network_dir.display()),
        },
        _ => Outcome::Failed { error: format!("{}: {e}", network_dir.display()) },
    })
}

/// Compares what the file says now with what the decision was about.
fn check(r: &Reservation, read: ReadOwner) -> Result<(), Outcome> {
    match read {
        ReadOwner::Gone => Err(Outcome::AlreadyGone),
        ReadOwner::Anomaly(kind, detail) => Err(Outcome::Anomalous { kind, detail }),
        ReadOwner::Owner(owner, _) if owner != r.owner() => Err(Outcome::OwnerChanged { found: owner.to_string() }),
        // Inodes are reused at once on most filesystems: the mtime tells a
        // file re-created for the same owner (host-local never rewrites one).
        ReadOwner::Owner(_, meta) if meta.ino() != r.inode || meta.modified() != r.created_at => {
            Err(Outcome::OwnerChanged {
                found: format!(
                    "same owner, but a re-created file (inode {}, was {}; mtime {}, was {})",
                    meta.ino(),
                    r.inode,
                    humantime::format_rfc3339_nanos(meta.modified()),
                    humantime::format_rfc3339_nanos(r.created_at),
                ),
            })
        }
        ReadOwner::Owner(..) => Ok(()),
    }
}

fn kept_by(found: &LookFound) -> Outcome {
    Outcome::LastLookKept { ip_configured: matches!(found, LookFound::IpConfigured { .. }), found: found.to_string() }
}

/// Releases a group of files of one network directory: the plugin's lock
/// is taken once and held across the group; under it, one last look (taken
/// when the first file passes its re-read) serves every file, and every
/// file is re-read and compared before the unlinks of those that passed
/// (after the intents' fsync, see `durable`). `dry_run`: no lock (taking it
/// could create the lock file), no unlink; the same reads. Outcomes in the
/// order of `files`. The directory is not fsync'd here (the caller does it
/// once per directory, after the lock is released).
pub(crate) fn release_group(
    network_dir: &Path,
    files: &[(&Reservation, &ReservationFile)],
    look: &mut dyn LastLook,
    lock_timeout: Duration,
    dry_run: bool,
    durable: &Durable,
) -> Vec<(Outcome, ReleaseTimings)> {
    let lock_wait = Instant::now();
    let locked = open_lock(network_dir, dry_run).and_then(|(dir, lock_file)| {
        let Some(lock_file) = lock_file else { return Ok((dir, None)) };
        match FlockGuard::lock_exclusive_timeout(lock_file, lock_timeout) {
            Ok(Ok(guard)) => Ok((dir, Some(guard))),
            Ok(Err(busy_lock)) => Err(Outcome::LockBusy {
                lock: network_dir.join(LOCK_FILE),
                waited_ms: lock_timeout.as_millis() as u64,
                holders: FlockGuard::holders(&busy_lock),
            }),
            Err(e) => Err(Outcome::Failed { error: format!("flock {}/{LOCK_FILE}: {e}", network_dir.display()) }),
        }
    });
    match locked {
        Ok((dir, guard)) => release_locked(&dir, guard, micros(lock_wait), files, look, dry_run, durable).complete(),
        Err(outcome) => all_alike(files, &outcome),
    }
}

/// [`release_group`] on a thread that must not block for long (the
/// agent's event loop), up to the unlinks: the lock only if it is free now,
/// and the unlinks left waiting for the intents' fsync
/// ([`Underway::complete`] waits for them). None: the lock is held by
/// someone else (a plugin running) and no store was changed: the group is
/// to be released again, waiting.
pub(crate) fn try_release_group(
    network_dir: &Path,
    files: &[(&Reservation, &ReservationFile)],
    look: &mut dyn LastLook,
    dry_run: bool,
    durable: &Durable,
) -> Option<Underway> {
    let lock_wait = Instant::now();
    let (dir, lock_file) = match open_lock(network_dir, dry_run) {
        Ok(opened) => opened,
        Err(outcome) => return Some(Underway { out: all_alike(files, &outcome), unlinks: None }),
    };
    let guard = match lock_file.map(FlockGuard::try_lock_exclusive) {
        None => None,
        Some(Ok(Some(guard))) => Some(guard),
        Some(Ok(None)) => return None,
        Some(Err(e)) => {
            let outcome = Outcome::Failed { error: format!("flock {}/{LOCK_FILE}: {e}", network_dir.display()) };
            return Some(Underway { out: all_alike(files, &outcome), unlinks: None });
        }
    };
    Some(release_locked(&dir, guard, micros(lock_wait), files, look, dry_run, durable))
}

/// The same outcome for every file of a group, untimed.
fn all_alike(files: &[(&Reservation, &ReservationFile)], outcome: &Outcome) -> Vec<(Outcome, ReleaseTimings)> {
    files.iter().map(|_| (outcome.clone(), ReleaseTimings::default())).collect()
}

/// The network's directory, and its lock file opened (none in a dry run:
/// opening it could create it).
fn open_lock(network_dir: &Path, dry_run: bool) -> Result<(Arc<Dir>, Option<std::fs::File>), Outcome> {
    let dir = Arc::new(open_dir(network_dir)?);
    if dry_run {
        return Ok((dir, None));
    }
    match dir.open_lock(LOCK_FILE) {
        Ok(file) => Ok((dir, Some(file))),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            Err(Outcome::Anomalous { kind: AnomalyKind::Symlink, detail: "the lock file is a symlink".to_owned() })
        }
        Err(e) => Err(Outcome::Failed { error: format!("lock {}/{LOCK_FILE}: {e}", network_dir.display()) }),
    }
}

/// A group's release once its lock is held (`guard`; none in a dry run),
/// up to the unlinks.
fn release_locked(
    dir: &Arc<Dir>,
    guard: Option<FlockGuard>,
    lock_wait_us: u64,
    files: &[(&Reservation, &ReservationFile)],
    look: &mut dyn LastLook,
    dry_run: bool,
    durable: &Durable,
) -> Underway {
    // Critical section: per file, re-read and compare, the group's one last
    // look (asked now that the lock is held); then the unlinks of the files
    // that passed, once the intents are durable.
    let mut sighting: Option<(Result<Sighting, LookFound>, u64)> = None;
    let mut out = Vec::with_capacity(files.len());
    let mut passed: Vec<(usize, String, PathBuf)> = Vec::new();
    for (r, f) in files {
        let mut timings = ReleaseTimings { lock_us: lock_wait_us, ..ReleaseTimings::default() };
        let reread = Instant::now();
        let checked = check(r, read_owner(dir, &f.name));
        timings.reread_us = micros(reread);
        let outcome = if let Err(outcome) = checked {
            outcome
        } else {
            let (seen, took_us) = sighting.get_or_insert_with(|| {
                let t = Instant::now();
                let asked: Vec<IpAddr> = files.iter().map(|(r, _)| r.ip).collect();
                let seen = look.look(&asked);
                (seen, micros(t))
            });
            timings.look_us = *took_us;
            let found = match seen {
                Ok(seen) => seen.keeps(r),
                Err(unavailable) => Some(unavailable.clone()),
            };
            match found {
                Some(found) => kept_by(&found),
                None if dry_run => Outcome::WouldRelease { cache_entries: Vec::new(), cache_notes: Vec::new() },
                None => {
                    passed.push((out.len(), f.name.clone(), r.path.clone()));
                    // Replaced by the unlink's outcome (see `Underway::complete`).
                    Outcome::Failed { error: "the unlink did not report".into() }
                }
            }
        };
        out.push((outcome, timings));
    }
    if passed.is_empty() {
        return Underway { out, unlinks: None };
    }
    let unlinks = unlink_when_durable(Arc::clone(dir), guard, passed, durable);
    Underway { out, unlinks: Some(unlinks) }
}

/// The unlinks of the files that passed (index into the group's outcomes,
/// name, path), once the intents are durable; their results come on the
/// receiver.
fn unlink_when_durable(
    dir: Arc<Dir>,
    guard: Option<FlockGuard>,
    passed: Vec<(usize, String, PathBuf)>,
    durable: &Durable,
) -> mpsc::Receiver<Unlinked> {
    // The unlinks wait for the intents' fsync: run by this thread if it
    // has ended, else by the thread that ends it, at once (no wake-up of
    // this one before the unlink). They own the lock: it is let go only
    // after them, even if no one waits for their results any more.
    let (done, unlinks) = mpsc::sync_channel(1);
    let begun_at = durable.begun_at();
    durable.when_durable(Box::new(move |durable: Result<(), String>| {
        let _guard = guard;
        let results: Unlinked = match &durable {
            Ok(()) => passed
                .into_iter()
                .map(|(i, name, path)| {
                    let unlink = Instant::now();
                    let outcome = match dir.unlink(&name) {
                        Ok(()) => Outcome::Released { cache_entries_removed: Vec::new(), cache_notes: Vec::new() },
                        Err(e) if e.kind() == io::ErrorKind::NotFound => Outcome::AlreadyGone,
                        Err(e) => Outcome::Failed { error: format!("unlink {}: {e}", path.display()) },
                    };
                    (i, outcome, micros(unlink), micros(begun_at))
                })
                .collect(),
            Err(why) => passed.into_iter().map(|(i, ..)| (i, Outcome::Failed { error: why.clone() }, 0, 0)).collect(),
        };
        // The group may have stopped waiting (it panicked): nothing to tell.
        let _ = done.send(results);
    }));
    unlinks
}

/// Unlinks' results: (index into the group's outcomes, outcome, unlink and
/// intents-to-unlink micro-seconds).
type Unlinked = Vec<(usize, Outcome, u64, u64)>;

/// A group's release under way: its files re-read and looked at under its
/// lock, the unlinks of those that passed (holding the lock) waiting for
/// the batch's intents to be durable (see `release_locked`).
pub(crate) struct Underway {
    out: Vec<(Outcome, ReleaseTimings)>,
    unlinks: Option<mpsc::Receiver<Unlinked>>,
}

impl Underway {
    /// Waits for the unlinks (the intents' fsync first; the lock is let go
    /// after them). Outcomes in the order of the group's files.
    pub(crate) fn complete(self) -> Vec<(Outcome, ReleaseTimings)> {
        let Self { mut out, unlinks } = self;
        // Dropped unrun (the sync never happened): nothing was unlinked,
        // and the outcomes say the unlink did not report.
        for (i, outcome, unlink_us, unlinked_us) in unlinks.and_then(|u| u.recv().ok()).unwrap_or_default() {
            if let Some((o, t)) = out.get_mut(i) {
                *o = outcome;
                t.unlink_us = unlink_us;
                t.unlinked_us = unlinked_us;
            }
        }
        out
    }
}

/// fsyncs a network directory so its unlinks are durable.
pub(crate) fn sync_network_dir(network_dir: &Path) {
    if let Err(e) = Dir::open(network_dir).and_then(|d| d.sync()) {
        tracing::warn!(dir = %network_dir.display(), "fsync after releases: {e}");
    }
}

/// Other IPs the attachment (container ID, ifname) still holds in this
/// network (dual stack, or a release that failed half-way), so its cache
/// entry is still needed. An unknown ifname (legacy file) matches any.
pub(crate) fn other_ips_of(
    container_id: &str,
    ifname: Option<&str>,
    t: &ReservationFile,
    except: IpAddr,
) -> Vec<IpAddr> {
    let (Ok(dir), Ok(entries)) = (Dir::open(&t.network_dir), std::fs::read_dir(&t.network_dir)) else {
        return Vec::new();
    };
    let same_attachment = |o: &Owner| {
        o.container_id == container_id
            && match (o.ifname.as_deref(), ifname) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter_map(|name| match classify_name(&name) {
            EntryName::Ip(ip) if ip != except => Some((name, ip)),
            _ => None,
        })
        .filter(|(name, _)| matches!(read_owner(&dir, name), ReadOwner::Owner(o, _) if same_attachment(&o)))
        .map(|(_, ip)| ip)
        .collect()
}
