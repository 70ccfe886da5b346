//! The one name of a network namespace incarnation, used by the model, the
//! ledger, the engine and every event.
//!
//! The kernel reuses a netns inode at once after a death (50 churned netns
//! used 14 inodes here), and an nsid as soon as it is free. Neither alone
//! names one incarnation across a death; together with the time netreap
//! first saw it, they do: two incarnations that share an inode and an nsid
//! were still seen first at different times.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::timefmt;

/// One netns incarnation. Parts netreap does not know are `None`: a netns
/// known only by nsid (not openable from netreap's mount namespace) has no
/// inode; a binding resolved before the model saw the netns has no
/// `first_seen`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NetnsId {
    /// `ns.inum`.
    pub inode: Option<u64>,
    /// Its nsid in netreap's netns (a weak handle: it names this
    /// incarnation until the kernel's RTM_DELNSID for it).
    pub nsid: Option<i32>,
    /// When netreap first saw this incarnation.
    #[serde(default, with = "timefmt::rfc3339_opt", skip_serializing_if = "Option::is_none")]
    pub first_seen: Option<SystemTime>,
}

impl NetnsId {
    #[must_use]
    pub fn new(inode: Option<u64>, nsid: Option<i32>, first_seen: Option<SystemTime>) -> Self {
        Self { inode, nsid, first_seen }
    }

    /// Known by inode alone (tests, one-shot scans without nsids).
    #[must_use]
    pub fn inode(inode: u64) -> Self {
        Self { inode: Some(inode), ..Self::default() }
    }

    /// Whether both may name the same incarnation: they share an inode or
    /// an nsid, and no part known on both sides differs. Keeping is the safe
    /// side when this decides "alive"; "dead" needs a time check as well.
    #[must_use]
    pub fn may_be(&self, other: &NetnsId) -> bool {
        fn agree<T: PartialEq>(a: Option<T>, b: Option<T>) -> Option<bool> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a == b),
                _ => None,
            }
        }
        let parts =
            [agree(self.inode, other.inode), agree(self.nsid, other.nsid), agree(self.first_seen, other.first_seen)];
        let shared = agree(self.inode, other.inode) == Some(true) || agree(self.nsid, other.nsid) == Some(true);
        shared && parts.iter().all(|p| *p != Some(false))
    }
}

impl std::fmt::Display for NetnsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.inode {
            Some(inode) => write!(f, "net:[{inode}]")?,
            None => f.write_str("net:[?]")?,
        }
        if let Some(nsid) = self.nsid {
            write!(f, " nsid {nsid}")?;
        }
        if let Some(t) = self.first_seen {
            write!(f, " seen {}", humantime::format_rfc3339_millis(t))?;
        }
        Ok(())
    }
}

/// [`std::path::Path::file_name`], without parsing the components of a path that
/// ends in a name after its last `/` (the usual netns path): the death
/// path asks it of every path it files or compares. Anything else (a
/// trailing `/`, `.` or `..`, empty) is left to the parser.
#[must_use]
pub fn last_name(p: &std::path::Path) -> Option<&std::ffi::OsStr> {
    use std::os::unix::ffi::OsStrExt as _;
    let bytes = p.as_os_str().as_bytes();
    let tail = bytes.rsplit(|&b| b == b'/').next().unwrap_or(bytes);
    if tail.is_empty() || tail == b"." || tail == b".." {
        return p.file_name();
    }
    Some(std::ffi::OsStr::from_bytes(tail))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[expect(clippy::unnecessary_wraps, reason = "shaped as NetnsId's first_seen")]
    fn t(s: u64) -> Option<SystemTime> {
        Some(UNIX_EPOCH + Duration::from_secs(s))
    }

    #[test]
    fn nsids_and_first_sight_tell_lives_of_an_inode_apart() {
        let a = NetnsId::new(Some(7), Some(1), t(10));
        assert!(a.may_be(&NetnsId::inode(7)));
        assert!(!a.may_be(&NetnsId::new(Some(7), Some(2), None)));
        assert!(!a.may_be(&NetnsId::new(Some(8), Some(1), None)));
        // Same inode and nsid, both reused: first sight differs.
        assert!(!a.may_be(&NetnsId::new(Some(7), Some(1), t(20))));
        assert!(a.may_be(&NetnsId::new(Some(7), Some(1), t(10))));
    }

    #[test]
    fn a_netns_known_only_by_nsid_matches_by_nsid() {
        let only_nsid = NetnsId::new(None, Some(4), t(1));
        assert!(only_nsid.may_be(&NetnsId::new(Some(9), Some(4), None)));
        assert!(!only_nsid.may_be(&NetnsId::new(Some(9), Some(5), None)));
        assert!(!only_nsid.may_be(&NetnsId::inode(9)), "nothing in common");
    }
}
