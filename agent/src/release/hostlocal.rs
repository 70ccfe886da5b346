//! Releasing a host-local reservation the way the plugin itself does: under
//! `flock(LOCK_EX)` on `<dataDir>/<network>/lock` (go-filemutex: open
//! `O_CREAT|O_RDONLY` 0750, `flock(LOCK_EX)`), after re-reading the file and
//! checking it still names the same owner and is the same file. Only the
//! re-read and the unlink happen under the lock.

use std::{io, net::IpAddr, os::unix::fs::MetadataExt, path::PathBuf};

use super::{
    lastlook::{LastLook, LookFound},
    outcome::Outcome,
};
use crate::ipam::{
    AnomalyKind, Owner, Reservation, StoreRef,
    hostlocal::{EntryName, LOCK_FILE, ReadOwner, classify_name, is_valid_network_name, read_owner},
    safefs::{Dir, FlockGuard},
};

/// Where a reservation lives, rebuilt from (data dir, network, IP) and
/// checked against the recorded path: a report edited by hand (or by
/// someone hostile) cannot point a release anywhere else.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub network_dir: PathBuf,
    pub name: String,
}

pub(crate) fn target(r: &Reservation, allowed: &[PathBuf]) -> Result<Target, String> {
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
    Ok(Target { network_dir, name })
}

fn open_dir(t: &Target) -> Result<Dir, Outcome> {
    Dir::open(&t.network_dir).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => Outcome::AlreadyGone,
        Some(libc::ELOOP | libc::ENOTDIR) => Outcome::Anomalous {
            kind: AnomalyKind::Symlink,
            detail: format!("{} is no longer a plain directory", t.network_dir.display()),
        },
        _ => Outcome::Failed { error: format!("{}: {e}", t.network_dir.display()) },
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
        ReadOwner::Owner(_, meta) if meta.ino() != r.inode || meta.modified().ok() != Some(r.created_at) => {
            Err(Outcome::OwnerChanged {
                found: format!(
                    "same owner, but a re-created file (inode {}, was {}; mtime {}, was {})",
                    meta.ino(),
                    r.inode,
                    meta.modified()
                        .map_or_else(|_| "unknown".into(), |t| humantime::format_rfc3339_nanos(t).to_string()),
                    humantime::format_rfc3339_nanos(r.created_at),
                ),
            })
        }
        ReadOwner::Owner(..) => Ok(()),
    }
}

/// Dry run: reads without the lock (taking it could create the lock file)
/// and changes nothing.
pub(crate) fn would_release(r: &Reservation, t: &Target, look: &mut dyn LastLook) -> Outcome {
    let dir = match open_dir(t) {
        Ok(dir) => dir,
        Err(outcome) => return outcome,
    };
    match check(r, read_owner(&dir, &t.name)).and_then(|()| last_look(r, look)) {
        Ok(()) => Outcome::WouldRelease { cache_entries: Vec::new(), cache_notes: Vec::new() },
        Err(outcome) => outcome,
    }
}

fn last_look(r: &Reservation, look: &mut dyn LastLook) -> Result<(), Outcome> {
    look.before_unlink(r).map_err(|found| Outcome::LastLookKept {
        ip_configured: matches!(found, LookFound::IpConfigured { .. }),
        found: found.to_string(),
    })
}

/// Removes the reservation file if it still is the one decided about.
/// `sync_dir`: fsync the directory after the unlink (a batch does it once
/// per directory instead, see `Releaser::release_orphaned`).
/// `lock_timeout`: how long to wait for the plugin's lock before giving up
/// with [`Outcome::LockBusy`].
pub(crate) fn release(
    r: &Reservation,
    t: &Target,
    sync_dir: bool,
    look: &mut dyn LastLook,
    lock_timeout: std::time::Duration,
) -> Outcome {
    let dir = match open_dir(t) {
        Ok(dir) => dir,
        Err(outcome) => return outcome,
    };
    let lock_file = match dir.open_lock(LOCK_FILE) {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Outcome::Anomalous { kind: AnomalyKind::Symlink, detail: "the lock file is a symlink".into() };
        }
        Err(e) => return Outcome::Failed { error: format!("lock {}/{LOCK_FILE}: {e}", t.network_dir.display()) },
    };
    let outcome = {
        let _guard = match FlockGuard::lock_exclusive_timeout(lock_file, lock_timeout) {
            Ok(Ok(guard)) => guard,
            Ok(Err(busy_lock)) => {
                return Outcome::LockBusy {
                    lock: t.network_dir.join(LOCK_FILE),
                    waited_ms: lock_timeout.as_millis() as u64,
                    holders: FlockGuard::holders(&busy_lock),
                };
            }
            Err(e) => return Outcome::Failed { error: format!("flock {}/{LOCK_FILE}: {e}", t.network_dir.display()) },
        };
        // Critical section: re-read, compare, the last look, unlink.
        match check(r, read_owner(&dir, &t.name)).and_then(|()| last_look(r, look)) {
            Ok(()) => match dir.unlink(&t.name) {
                Ok(()) => Outcome::Released { cache_entries_removed: Vec::new(), cache_notes: Vec::new() },
                Err(e) if e.kind() == io::ErrorKind::NotFound => Outcome::AlreadyGone,
                Err(e) => Outcome::Failed { error: format!("unlink {}: {e}", r.path.display()) },
            },
            Err(outcome) => outcome,
        }
    };
    if sync_dir
        && outcome.released()
        && let Err(e) = dir.sync()
    {
        tracing::warn!(dir = %t.network_dir.display(), "fsync after release: {e}");
    }
    outcome
}

/// fsyncs a network directory so its unlinks are durable.
pub(crate) fn sync_network_dir(network_dir: &std::path::Path) {
    if let Err(e) = Dir::open(network_dir).and_then(|d| d.sync()) {
        tracing::warn!(dir = %network_dir.display(), "fsync after releases: {e}");
    }
}

/// Other IPs the attachment (container ID, ifname) still holds in this
/// network (dual stack, or a release that failed half-way), so its cache
/// entry is still needed. An unknown ifname (legacy file) matches any.
pub(crate) fn other_ips_of(container_id: &str, ifname: Option<&str>, t: &Target, except: IpAddr) -> Vec<IpAddr> {
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
