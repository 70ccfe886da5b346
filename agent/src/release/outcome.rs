//! What a release did, as journaled and reported.

use std::{fmt, path::PathBuf};

use serde::{Deserialize, Serialize};

use crate::{engine::Status, ipam::AnomalyKind};

/// How long the parts of one release took, in micro-seconds, as journaled
/// with its outcome (the bench reads them). Parts shared by a group (the
/// lock, the last look) or a batch (the intents' fsync, the directory's)
/// are given to each of its releases; a part not reached is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseTimings {
    /// The fdatasync of the batch's intents (the outcomes' write is the
    /// same kind, after the unlinks). It runs beside the lock, the re-read
    /// and the last look; see `intent_wait_us`.
    pub intent_fsync_us: u64,
    /// How long the first store change of the batch waited for that fsync:
    /// the part of it the release path still pays. (Journals before it
    /// existed read 0.)
    #[serde(default)]
    pub intent_wait_us: u64,
    /// Opening the network's lock and waiting for it.
    pub lock_us: u64,
    /// Re-reading the file and comparing owner, inode and mtime.
    pub reread_us: u64,
    /// The last look (once per group, under the lock).
    pub look_us: u64,
    pub unlink_us: u64,
    /// fsync of the network directory after the group's unlinks.
    pub dir_fsync_us: u64,
    /// From just before the batch's intents were written to the start of
    /// its store work: the intents' write and the hand-off to the thread
    /// that does the store work. (Journals before it existed read 0.)
    #[serde(default)]
    pub handoff_us: u64,
    /// From just before the intents were written to this release's unlink
    /// done: the whole of the release path after the decision, so what the
    /// parts above leave out shows. (Journals before it existed read 0.)
    #[serde(default)]
    pub unlinked_us: u64,
}

/// Micro-seconds since `t`, for [`ReleaseTimings`].
pub(crate) fn micros(t: std::time::Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    /// The reservation file was removed under the plugin's lock.
    Released {
        cache_entries_removed: Vec<PathBuf>,
        /// Cache entries looked at and kept, and why.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cache_notes: Vec<String>,
    },
    /// Dry run: the file still names the same owner and would be removed.
    /// (Older journals spelled it `would_release`; read either way.)
    #[serde(rename = "dry_run", alias = "would_release")]
    WouldRelease {
        cache_entries: Vec<PathBuf>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cache_notes: Vec<String>,
    },
    /// The file no longer exists (released by the plugin, or by an earlier
    /// run of netreap that died before writing its outcome).
    AlreadyGone,
    /// The file names another owner, or is another file: not touched.
    OwnerChanged { found: String },
    /// Re-verification said keep.
    Kept { status: Status, reason: String },
    /// The last look under the plugin's lock found the reservation in use
    /// (its IP configured in a netns now, or a CNI run in flight): kept.
    #[serde(rename = "kept_by_last_look", alias = "last_look_kept")]
    LastLookKept { found: String, ip_configured: bool },
    /// Not acted on: not orphaned, or not a reservation netreap can release.
    Refused { reason: String },
    /// The file became something that is not a reservation: not touched.
    Anomalous { kind: AnomalyKind, detail: String },
    /// The store could not be read or changed.
    #[serde(rename = "error", alias = "failed")]
    Failed { error: String },
    /// The plugin's lock was still held when the wait ran out (a plugin
    /// stuck?): nothing was touched; retried later, with back-off.
    LockBusy {
        lock: PathBuf,
        waited_ms: u64,
        /// "pid (comm)" of each holder, when /proc/locks names them.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        holders: Vec<String>,
    },
    /// A dry-run intent found without outcome at start: nothing was done.
    DryRunClosed,
}

impl Outcome {
    /// The one spelling of this outcome: the journal's `result`, the event
    /// stream's `outcome` and the metric label.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            Self::Released { .. } => "released",
            Self::WouldRelease { .. } => "dry_run",
            Self::AlreadyGone => "already_gone",
            Self::OwnerChanged { .. } => "owner_changed",
            Self::Kept { .. } => "kept",
            Self::LastLookKept { .. } => "kept_by_last_look",
            Self::Refused { .. } => "refused",
            Self::Anomalous { .. } => "anomalous",
            Self::Failed { .. } => "error",
            Self::LockBusy { .. } => "lock_busy",
            Self::DryRunClosed => "dry_run_closed",
        }
    }

    /// Whether a store was changed.
    #[must_use]
    pub fn released(&self) -> bool {
        matches!(self, Self::Released { .. })
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let paths = |v: &[PathBuf]| v.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
        match self {
            Self::Released { cache_entries_removed, .. } if cache_entries_removed.is_empty() => f.write_str("released"),
            Self::Released { cache_entries_removed, .. } => {
                write!(f, "released; CNI cache entry removed: {}", paths(cache_entries_removed))
            }
            Self::WouldRelease { cache_entries, .. } if cache_entries.is_empty() => {
                f.write_str("would release (dry run)")
            }
            Self::WouldRelease { cache_entries, .. } => {
                write!(f, "would release and remove CNI cache entry {} (dry run)", paths(cache_entries))
            }
            Self::AlreadyGone => f.write_str("already gone"),
            Self::OwnerChanged { found } => write!(f, "not released: owner changed ({found})"),
            Self::Kept { status, reason } => write!(f, "kept: now {status}: {reason}"),
            Self::LastLookKept { found, .. } => write!(f, "kept by the last look: {found}"),
            Self::Refused { reason } => write!(f, "refused: {reason}"),
            Self::Anomalous { kind, detail } => write!(f, "not released: {kind:?}: {detail}"),
            Self::Failed { error } => write!(f, "failed: {error}"),
            Self::LockBusy { lock, waited_ms, holders } => {
                let by = if holders.is_empty() { "another process".to_owned() } else { holders.join(", ") };
                write!(
                    f,
                    "not released: {} still held by {by} after waiting {waited_ms} ms (a CNI plugin stuck?); retried later",
                    lock.display()
                )
            }
            Self::DryRunClosed => f.write_str("dry-run intent closed; nothing was done"),
        }
    }
}
