//! The ledger's bindings filed by the netns they may name, kept as the
//! ledger changes. A netns death asks which containers were bound to it;
//! under pod churn the ledger holds the last 30 minutes of pods, and
//! filing every binding anew for each death made a release cost in
//! proportion to the node's history (a third of the agent's CPU after 4
//! minutes of 20 pods a second). Here each binding is filed once, when a
//! run binds its container, and moved only when a run binds it anew.

use std::{collections::hash_map::Entry, ffi::OsString, path::Path, time::SystemTime};

use super::Attachment;
use crate::{fast::Map, identity::last_name};

/// An attachment's place in the ledger's storage.
pub type Slot = usize;

/// One binding in a list: when it was bound ([`binding_time`]) and its
/// attachment. Lists are sorted by this, so by binding time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bound {
    pub at: SystemTime,
    pub slot: Slot,
}

/// When an attachment's binding was made: the start of the run that
/// resolved it, or (resolved by none) when the ledger first saw the
/// container.
#[must_use]
pub fn binding_time(a: &Attachment) -> SystemTime {
    a.netns_bound_at.unwrap_or(a.first_seen)
}

/// Where one attachment is filed: what its binding names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Filing {
    /// Restored from an earlier run with the incarnation it named.
    Pinned { inode: Option<u64>, nsid: Option<i32> },
    /// A run resolved its netns to an inode (and nsid, when it got one).
    Resolved { inode: u64, nsid: Option<i32> },
    /// Known by its path alone: the path's last component.
    Path(Option<OsString>),
    /// Names no netns.
    Nowhere,
}

impl Filing {
    fn of(a: &Attachment) -> Self {
        match (a.pinned, a.netns_inode, &a.netns_path) {
            (Some(id), _, _) => Self::Pinned { inode: id.inode, nsid: id.nsid },
            (None, Some(inode), _) => Self::Resolved { inode, nsid: a.netns_nsid },
            (None, None, Some(path)) => Self::Path(last_name(Path::new(path)).map(ToOwned::to_owned)),
            (None, None, None) => Self::Nowhere,
        }
    }
}

/// What a binding was filed under, to find it again when it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filed {
    filing: Filing,
    at: SystemTime,
}

impl Filed {
    #[must_use]
    pub fn of(a: &Attachment) -> Self {
        Self { filing: Filing::of(a), at: binding_time(a) }
    }
}

/// See the module. Every list is sorted by [`Bound`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BindingIndex {
    /// Not pinned, resolved to an inode: by inode, by nsid when the run got
    /// one, and those without an nsid apart.
    by_inode: Map<u64, Vec<Bound>>,
    by_nsid: Map<i32, Vec<Bound>>,
    without_nsid: Vec<Bound>,
    /// Pinned to an incarnation: by its inode and by its nsid (an identity
    /// with neither may be no other: `NetnsId::may_be`).
    pinned_by_inode: Map<u64, Vec<Bound>>,
    pinned_by_nsid: Map<i32, Vec<Bound>>,
    /// Known by path alone: by the path's last component, and those whose
    /// path ends in none (`/`, `..`) apart.
    by_path: Map<OsString, Vec<Bound>>,
    by_unnamed_path: Vec<Bound>,
}

fn insert(list: &mut Vec<Bound>, bound: Bound) {
    // New bindings are the latest: nearly always pushed at the end.
    if let Err(i) = list.binary_search(&bound) {
        list.insert(i, bound);
    }
}

fn remove(list: &mut Vec<Bound>, bound: Bound) {
    if let Ok(i) = list.binary_search(&bound) {
        list.remove(i);
    }
}

/// Applies `change` to `key`'s list, dropping the list once empty (under
/// churn most keys are inodes and nsids of netns long gone).
fn change_at<K: std::hash::Hash + Eq>(map: &mut Map<K, Vec<Bound>>, key: K, change: impl FnOnce(&mut Vec<Bound>)) {
    match map.entry(key) {
        Entry::Occupied(mut filed) => {
            change(filed.get_mut());
            if filed.get().is_empty() {
                filed.remove();
            }
        }
        Entry::Vacant(empty) => {
            let mut list = Vec::new();
            change(&mut list);
            if !list.is_empty() {
                empty.insert(list);
            }
        }
    }
}

impl BindingIndex {
    /// Files `slot`'s binding as `filed` says.
    pub fn file(&mut self, slot: Slot, filed: &Filed) {
        self.change(slot, filed, insert);
    }

    /// Takes out `slot`'s binding, filed as `filed` says.
    pub fn unfile(&mut self, slot: Slot, filed: &Filed) {
        self.change(slot, filed, remove);
    }

    fn change(&mut self, slot: Slot, filed: &Filed, op: fn(&mut Vec<Bound>, Bound)) {
        let bound = Bound { at: filed.at, slot };
        match &filed.filing {
            Filing::Pinned { inode, nsid } => {
                if let Some(inode) = *inode {
                    change_at(&mut self.pinned_by_inode, inode, |l| op(l, bound));
                }
                if let Some(nsid) = *nsid {
                    change_at(&mut self.pinned_by_nsid, nsid, |l| op(l, bound));
                }
            }
            Filing::Resolved { inode, nsid } => {
                change_at(&mut self.by_inode, *inode, |l| op(l, bound));
                match *nsid {
                    Some(nsid) => change_at(&mut self.by_nsid, nsid, |l| op(l, bound)),
                    None => op(&mut self.without_nsid, bound),
                }
            }
            Filing::Path(Some(name)) => change_at(&mut self.by_path, name.clone(), |l| op(l, bound)),
            Filing::Path(None) => op(&mut self.by_unnamed_path, bound),
            Filing::Nowhere => {}
        }
    }

    /// Bindings a run resolved to `inode`, by binding time.
    #[must_use]
    pub fn resolved_to_inode(&self, inode: u64) -> &[Bound] {
        self.by_inode.get(&inode).map_or(&[], Vec::as_slice)
    }

    /// Bindings a run resolved with `nsid`, by binding time.
    #[must_use]
    pub fn resolved_to_nsid(&self, nsid: i32) -> &[Bound] {
        self.by_nsid.get(&nsid).map_or(&[], Vec::as_slice)
    }

    /// Bindings a run resolved to an inode without an nsid.
    #[must_use]
    pub fn resolved_without_nsid(&self) -> &[Bound] {
        &self.without_nsid
    }

    /// Pinned bindings whose incarnation has `inode`, then those whose
    /// incarnation has `nsid` (one may be in both).
    pub fn pinned_sharing(&self, inode: Option<u64>, nsid: Option<i32>) -> impl Iterator<Item = &Bound> {
        let by_inode = inode.and_then(|i| self.pinned_by_inode.get(&i)).into_iter().flatten();
        let by_nsid = nsid.and_then(|n| self.pinned_by_nsid.get(&n)).into_iter().flatten();
        by_inode.chain(by_nsid)
    }

    /// Bindings known by a path alone whose last component is `name`.
    #[must_use]
    pub fn at_path_named(&self, name: Option<&std::ffi::OsStr>) -> &[Bound] {
        match name {
            Some(name) => self.by_path.get(name).map_or(&[], Vec::as_slice),
            None => &self.by_unnamed_path,
        }
    }
}
