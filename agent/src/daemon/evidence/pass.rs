//! One pass's sources (model snapshot, ledger, CNI cache), indexed once and
//! shared by the death path's questions: which containers and IPs a death
//! concerns, and the observations of that concern. Dead netns are kept for
//! minutes and the ledger and cache with them, so walking them per death made
//! a release cost in proportion to the node's history; here each question
//! looks up the few netns, attachments and cache entries it can touch. The
//! ledger files its bindings itself as they change ([`Ledger::bindings`]);
//! the snapshot and the cache are indexed here, per pass.
//!
//! Every lookup gives a superset of what the walk it replaces keeps (an
//! identity matches only through a shared inode or nsid; two paths that are
//! the same netns path end in the same component), and the walk's own test
//! then decides: the answers are exactly the walks' (tests at the end).

use std::{
    cell::{Cell, OnceCell},
    collections::HashSet,
    ffi::OsStr,
    net::IpAddr,
    ops::Range,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use super::{
    Concern, ContainerIndex, DISCOVERY_SLACK, FirstSeen, Incarnations, Life, binding_time, cache_names, cache_names_if,
    cni_ops_in, dead_incarnation, distinct_names, ledger_names, ledger_names_if, may_be_named, push_netns,
    resolution_may_name,
};
use crate::{
    daemon::targeted::DeathKey,
    engine::{
        Observations,
        observations::{Binding, BindingSource, CniOp, DeadNetns, NetnsName, same_netns_path},
    },
    fast::{Filed, Map, sized_map},
    identity::{NetnsId, last_name},
    ipam::cnicache::CachedAttachment,
    ledger::{Attachment, Ledger, bindings::Bound},
    model::NetnsView,
    model::{sealed::SealedViews, snapshot::ModelSnapshot},
};

/// The key paths are filed under: their last component. Paths that
/// [`same_netns_path`] calls equal have equal component lists once `/var`
/// is folded and the root dropped, hence the same last one (None for a path
/// that ends in no name, e.g. `/` or `..`: those share a key too).
fn name_of(p: &Path) -> Option<&OsStr> {
    // Not `Path::file_name`'s parse (1.4 % of the agent's CPU in pod
    // cycles: every ledger, cache and mount path, on every death's pass).
    last_name(p)
}

/// Positions filed by [`name_of`] a path.
type ByName<'a> = Map<Option<&'a OsStr>, Filed<usize>>;

/// Pushes `key`'s positions from `map`, if any.
fn push_filed<K: std::hash::Hash + Eq>(out: &mut Vec<usize>, map: &Map<K, Filed<usize>>, key: &K) {
    out.extend(map.get(key).into_iter().flatten().copied());
}

/// The ledger's attachments bound to this incarnation ([`Life::names`]),
/// looked up in the bindings the ledger files as they change: pinned ones
/// that may be it, and those resolved to its inode (or, known by nsid alone,
/// its nsid) during its lifetime. In the ledger's binding order, pinned
/// first; a container may come twice.
pub(super) fn bound_to<'l>(ledger: &'l Ledger, life: &Life) -> impl Iterator<Item = &'l Attachment> {
    let index = ledger.bindings();
    let filed = match (life.id.inode, life.id.nsid) {
        (Some(inode), _) => index.resolved_to_inode(inode),
        (None, Some(nsid)) => index.resolved_to_nsid(nsid),
        (None, None) => &[],
    };
    index
        .pinned_sharing(life.id.inode, life.id.nsid)
        .chain(life.bound_during(filed, |b| b.at))
        .filter_map(|b| ledger.in_slot(b.slot))
        .filter(|a| life.names(a))
}

/// For a snapshot whose sealed views are out of its range (none indexed).
static NONE_SEALED: SealedViews = SealedViews::NONE;

/// Questions a map of the index answers by a walk before it is filed. A
/// death's pass asks each a handful: filing every live netns and cache
/// entry of the node up front cost ~0.1 ms per death at 200 pods, more than
/// those walks. A pass that asks more (a burst, a full pass) files once.
const WALKS_BEFORE_FILING: u32 = 8;

/// Positions filed by key, filed when first asked past the walks.
struct Lazy<K> {
    filed: OnceCell<Map<K, Filed<usize>>>,
    walks: Cell<u32>,
}

impl<K: std::hash::Hash + Eq> Lazy<K> {
    fn new() -> Self {
        Self { filed: OnceCell::new(), walks: Cell::new(0) }
    }

    /// The map `file` builds, once `walks` questions were answered by a
    /// walk; None: the caller walks this time (its walk pushes what the
    /// map holds under its key, in the same order).
    fn filed(&self, walks: u32, file: impl FnOnce() -> Map<K, Filed<usize>>) -> Option<&Map<K, Filed<usize>>> {
        if self.filed.get().is_none() && self.walks.get() < walks {
            self.walks.set(self.walks.get() + 1);
            return None;
        }
        Some(self.filed.get_or_init(file))
    }
}

/// See the module.
pub(crate) struct PassIndex<'a> {
    pub(crate) incarnations: Incarnations<'a>,
    /// The snapshot's netns (positions) by each global address, and by
    /// each bind mount's last component: those the model did not seal.
    views_by_ip: Lazy<IpAddr>,
    views_by_mount: Lazy<Option<&'a OsStr>>,
    /// The sealed ones, indexed by the model.
    sealed: &'a SealedViews,
    /// Their positions.
    covered: Range<usize>,
    /// Its bindings are filed by the netns they may name as it changes
    /// ([`Ledger::bindings`]).
    ledger: &'a Ledger,
    cache: &'a [Arc<CachedAttachment>],
    /// Cache entries (positions) by container, and by their netns path's
    /// last component.
    cache_by_container: Lazy<&'a str>,
    cache_by_netns: Lazy<Option<&'a OsStr>>,
    /// [`WALKS_BEFORE_FILING`] (tests vary it).
    walks: u32,
}

impl<'a> PassIndex<'a> {
    #[must_use]
    pub(crate) fn new(snapshot: &'a ModelSnapshot, ledger: &'a Ledger, cache: &'a [Arc<CachedAttachment>]) -> Self {
        // The dead views the model sealed are indexed already: only the
        // others are filed here (the live ones, the latest deaths), when a
        // pass asks enough to pay for it (`Lazy`).
        let sealed =
            if snapshot.sealed.covered().end <= snapshot.netns.len() { &snapshot.sealed } else { &NONE_SEALED };
        Self {
            incarnations: Incarnations::new(snapshot),
            views_by_ip: Lazy::new(),
            views_by_mount: Lazy::new(),
            covered: sealed.covered(),
            sealed,
            ledger,
            cache,
            cache_by_container: Lazy::new(),
            cache_by_netns: Lazy::new(),
            walks: WALKS_BEFORE_FILING,
        }
    }

    /// The index answering every question from its maps (`0`) or by walks
    /// (`u32::MAX`), or anything between (tests).
    #[cfg(test)]
    pub(super) fn with_walks_before_filing(mut self, walks: u32) -> Self {
        self.walks = walks;
        self
    }

    /// The views not sealed, with their positions.
    fn unsealed(&self) -> impl Iterator<Item = (usize, &'a NetnsView)> + '_ {
        let netns: &[&'a NetnsView] = &self.incarnations.netns;
        netns.iter().enumerate().filter(|(i, _)| !self.covered.contains(i)).map(|(i, &v)| (i, v))
    }

    /// Pushes the positions of the netns holding `ip`.
    fn views_at_ip(&self, ip: IpAddr, out: &mut Vec<usize>) {
        let file = || {
            let mut filed: Map<IpAddr, Filed<usize>> = sized_map(self.incarnations.netns.len());
            for (i, view) in self.unsealed() {
                for a in view.global_addresses() {
                    filed.entry(a.ip).or_default().push(i);
                }
            }
            filed
        };
        match self.views_by_ip.filed(self.walks, file) {
            Some(filed) => push_filed(out, filed, &ip),
            None => {
                for (i, view) in self.unsealed() {
                    out.extend(view.global_addresses().filter(|a| a.ip == ip).map(|_| i));
                }
            }
        }
        self.sealed.at_ip(ip, out);
    }

    /// Pushes the positions of the netns mounted at a path that may be `path`.
    fn views_mounted_at(&self, path: &Path, out: &mut Vec<usize>) {
        let name = name_of(path);
        let file = || {
            let mut filed: ByName<'a> = sized_map(self.incarnations.netns.len());
            for (i, view) in self.unsealed() {
                for m in &view.bind_mounts {
                    filed.entry(name_of(m)).or_default().push(i);
                }
            }
            filed
        };
        match self.views_by_mount.filed(self.walks, file) {
            Some(filed) => push_filed(out, filed, &name),
            None => {
                for (i, view) in self.unsealed() {
                    out.extend(view.bind_mounts.iter().filter(|m| name_of(m) == name).map(|_| i));
                }
            }
        }
        self.sealed.at_mount(name, out);
    }

    /// Cache entries of a container.
    fn cache_of<'s>(&'s self, container_id: &str) -> impl Iterator<Item = &'a CachedAttachment> + use<'s, 'a> {
        let cache = self.cache;
        let file = || {
            let mut filed: Map<&str, Filed<usize>> = sized_map(cache.len());
            for (i, entry) in cache.iter().enumerate() {
                filed.entry(entry.container_id.as_str()).or_default().push(i);
            }
            filed
        };
        let mut found = Vec::new();
        match self.cache_by_container.filed(self.walks, file) {
            Some(filed) => push_filed(&mut found, filed, &container_id),
            None => found.extend((0..cache.len()).filter(|&i| cache[i].container_id == container_id)),
        }
        found.into_iter().map(move |i| cache[i].as_ref())
    }

    /// Cache entries whose netns path may be `path`.
    fn cache_at<'s>(&'s self, path: &'s Path) -> impl Iterator<Item = &'a CachedAttachment> + use<'s, 'a> {
        let cache = self.cache;
        let name = name_of(path);
        let file = || {
            let mut filed: ByName<'a> = sized_map(cache.len());
            for (i, entry) in cache.iter().enumerate() {
                if let Some(path) = entry.netns.as_deref() {
                    filed.entry(name_of(Path::new(path))).or_default().push(i);
                }
            }
            filed
        };
        let mut found = Vec::new();
        match self.cache_by_netns.filed(self.walks, file) {
            Some(filed) => push_filed(&mut found, filed, &name),
            None => found.extend(
                (0..cache.len()).filter(|&i| cache[i].netns.as_deref().is_some_and(|p| name_of(Path::new(p)) == name)),
            ),
        }
        found.into_iter().map(move |i| cache[i].as_ref())
    }

    /// The attachments of these filed bindings.
    fn attachments_of<I: IntoIterator<Item = &'a Bound>>(
        &self,
        filed: I,
    ) -> impl Iterator<Item = &'a Attachment> + use<'a, I> {
        let ledger = self.ledger;
        filed.into_iter().filter_map(move |b| ledger.in_slot(b.slot))
    }

    /// Attachments whose binding may name `dead`: pinned ones that may be
    /// it, and those resolved from an (inode, nsid) that
    /// [`resolution_may_name`] does not rule out.
    fn may_name(&self, dead: &NetnsId) -> impl Iterator<Item = &'a Attachment> + use<'a> {
        let index = self.ledger.bindings();
        let by_inode = dead.inode.map_or(&[][..], |i| index.resolved_to_inode(i));
        let by_nsid = dead.nsid.map_or(&[][..], |n| index.resolved_to_nsid(n));
        let without_nsid = if dead.inode.is_none() { index.resolved_without_nsid() } else { &[] };
        self.attachments_of(
            index.pinned_sharing(dead.inode, dead.nsid).chain(by_inode).chain(by_nsid).chain(without_nsid),
        )
    }

    /// What [`super::containers_walked`] answers for one incarnation: the
    /// same attachments ([`Life::names`]: those filed under its identity,
    /// its inode, or its nsid when that is all the model knows of it) and
    /// cache entries (by path), looked up.
    pub(super) fn containers_of(&self, life: &Life, bind_mounts: &[PathBuf]) -> Vec<String> {
        let mut ids: Vec<String> = bound_to(self.ledger, life).map(|a| a.container_id.clone()).collect();
        for mount in bind_mounts {
            ids.extend(
                self.cache_at(mount)
                    .filter(|e| e.netns.as_deref().is_some_and(|p| same_netns_path(mount, Path::new(p))))
                    .map(|e| e.container_id.clone()),
            );
        }
        ids.sort();
        ids.dedup();
        ids
    }

    /// The containers and IPs these deaths concern (`extra_dead`: the dead
    /// netns the caller adds to the observations): what
    /// `daemon::targeted::concerned_keys` finds in the whole node's
    /// observations, from the sources, looking up only what the deaths can
    /// name.
    #[must_use]
    pub(crate) fn death_concern(
        &self,
        extra_dead: &[DeadNetns],
        deaths: &[DeathKey],
    ) -> (HashSet<String>, HashSet<IpAddr>) {
        let is_dead = |id: &NetnsId, paths: &[PathBuf]| deaths.iter().any(|d| d.is(id, paths));
        let names_dead = |name: &NetnsName| deaths.iter().any(|d| d.may_name(name));
        let resolve = |inode: u64, nsid: Option<i32>| deaths.iter().any(|d| resolution_may_name(inode, nsid, &d.id));
        let (mut containers, mut ips) = (HashSet::new(), HashSet::new());
        // `DeathKey::is`: an identity shares an inode or nsid with it (or it
        // has neither: then every netns is looked at), or a path is one of its.
        let mut found: Vec<usize> = Vec::new();
        for d in deaths {
            found.extend(self.incarnations.sharing(&d.id));
            for p in &d.paths {
                self.views_mounted_at(p, &mut found);
            }
        }
        found.sort_unstable();
        found.dedup();
        for view in found.into_iter().map(|i| self.incarnations.netns[i]) {
            let life = Life::of(view);
            if !view.alive && view.died_at.is_some() && is_dead(&life.id, &view.bind_mounts) {
                containers.extend(self.containers_of(&life, &view.bind_mounts));
                ips.extend(view.global_addresses().map(|a| a.ip));
            }
        }
        for dead in extra_dead.iter().filter(|d| is_dead(&d.id, &d.paths)) {
            containers.extend(dead.container_ids.iter().cloned());
            ips.extend(dead.addresses.iter().copied());
        }
        // Attachments whose binding may name a death: by identity, by the
        // inode or nsid a run resolved, or by path alone.
        let named = deaths.iter().flat_map(|d| self.may_name(&d.id));
        // A run resolves to the netns that held its inode then, first seen by
        // then give or take discovery, and an identity naming a time may be
        // only a netns first seen then: a run before every death was first
        // seen names one only with its own (inode, nsid), when the model
        // knows no netns that held it (under churn, nearly every run of the
        // inode's history is such a run, and this spares resolving each),
        // or with the dead incarnation the ledger kept for it, when that one
        // was first seen before every death (`Incarnations::of_binding`).
        let earliest: Option<SystemTime> =
            deaths.iter().map(|d| d.id.first_seen).collect::<Option<Vec<_>>>().and_then(|t| t.into_iter().min());
        let resolved_elsewhere = |a: &Attachment| match (a.pinned, a.netns_inode, earliest) {
            (None, Some(inode), Some(earliest)) => {
                let bound_at = binding_time(a);
                let named_dead_before =
                    || dead_incarnation(a).is_some_and(|(id, _)| id.first_seen.is_some_and(|f| f < earliest));
                bound_at + DISCOVERY_SLACK < earliest
                    && (named_dead_before() || self.incarnations.knows_holder(inode, a.netns_nsid, bound_at))
            }
            _ => false,
        };
        // Cheapest test first: under churn most runs are spared.
        for a in named {
            if !resolved_elsewhere(a)
                && !containers.contains(&a.container_id)
                && ledger_names_if(a, &self.incarnations, resolve).0.iter().any(names_dead)
            {
                containers.insert(a.container_id.clone());
            }
        }
        for d in deaths {
            for p in &d.paths {
                for a in self.attachments_of(self.ledger.bindings().at_path_named(name_of(p))) {
                    if !containers.contains(&a.container_id)
                        && ledger_names_if(a, &self.incarnations, resolve).0.iter().any(names_dead)
                    {
                        containers.insert(a.container_id.clone());
                    }
                }
            }
        }
        // Cache entries name a death by path, or through their container's
        // attachment when its run resolved the same path: then they name
        // what that attachment names (`cache_names_if` and
        // `ledger_names_if` resolve the same run alike), and a container
        // whose attachment names a death is in already. So only the
        // entries at the deaths' paths can add one.
        let entries = deaths.iter().flat_map(|d| d.paths.iter()).flat_map(|p| self.cache_at(p));
        for entry in entries {
            // Path-only names need no first-seen time: only the name is asked.
            if !containers.contains(&entry.container_id)
                && cache_names_if(entry, &self.incarnations, self.ledger, None, resolve)
                    .iter()
                    .any(|(n, _)| names_dead(n))
            {
                containers.insert(entry.container_id.clone());
            }
        }
        (containers, ips)
    }

    /// [`super::observations_in`] for a concern: the same observations,
    /// with the netns looked up instead of walked.
    #[must_use]
    pub(crate) fn observations(
        &self,
        watching_since: Option<std::time::SystemTime>,
        cache_first_seen: Option<&FirstSeen>,
        concern: &Concern,
    ) -> Observations {
        self.observations_with(watching_since, cache_first_seen, concern, None)
    }

    /// [`Self::observations`], given the concern's runs when the caller
    /// already asked for them ([`cni_ops_in`] for the same containers).
    #[must_use]
    pub(crate) fn observations_with(
        &self,
        watching_since: Option<std::time::SystemTime>,
        cache_first_seen: Option<&FirstSeen>,
        concern: &Concern,
        runs: Option<Vec<CniOp>>,
    ) -> Observations {
        let scope = super::Scope::Concerning(concern);
        let mut obs = Observations { watching_since, ..Observations::default() };
        // Bindings first (in the ledger's and the cache's order, as the
        // whole node's): a concern's netns are found through them.
        for a in self.ledger.attachments().filter(|a| concern.has_container(&a.container_id)) {
            let (names, bound_at) = ledger_names(a, &self.incarnations);
            for netns in names {
                obs.bindings.push(Binding {
                    container_id: a.container_id.clone(),
                    netns,
                    source: BindingSource::CniExec,
                    seen_at: bound_at,
                });
            }
        }
        obs.cni_ops = runs.unwrap_or_else(|| cni_ops_in(self.ledger, scope));
        for entry in self.cache.iter().filter(|e| concern.has_container(&e.container_id)) {
            for (netns, seen_at) in cache_names(entry, &self.incarnations, self.ledger, cache_first_seen) {
                obs.bindings.push(Binding {
                    container_id: entry.container_id.clone(),
                    netns,
                    source: BindingSource::CniCache,
                    seen_at,
                });
            }
        }
        let attachments: Vec<&Attachment> = concern.containers.iter().filter_map(|c| self.ledger.get(c)).collect();
        let entries: Vec<&CachedAttachment> = concern.containers.iter().flat_map(|c| self.cache_of(c)).collect();
        let containers = ContainerIndex::new(attachments.iter().copied(), entries.iter().copied());
        // The netns the walk could keep: holding one of the IPs, filed under
        // an inode or identity the containers are bound to or a binding
        // names, or mounted at a path their cache entries, bindings or
        // sandboxes name.
        let mut found: Vec<usize> = Vec::new();
        for &ip in &concern.ips {
            self.views_at_ip(ip, &mut found);
        }
        for a in &attachments {
            match (a.pinned, a.netns_inode) {
                (Some(id), _) => found.extend(self.incarnations.sharing(&id)),
                (None, Some(inode)) => {
                    if let Some(bound_at) = a.netns_bound_at {
                        // `Life::names` accepts only a holder at that time.
                        self.incarnations.holding(inode, bound_at, &mut found);
                    }
                }
                (None, _) => {}
            }
        }
        let names = distinct_names(&obs.bindings);
        let mounts = entries.iter().filter_map(|e| e.netns.as_deref().map(Path::new));
        let named_paths = names.iter().filter_map(|name| match name {
            NetnsName::Path(p) => Some(p.as_path()),
            NetnsName::Id(_) => None,
        });
        for p in mounts.chain(named_paths).chain(concern.sandbox_paths.iter().map(PathBuf::as_path)) {
            self.views_mounted_at(p, &mut found);
        }
        for name in &names {
            if let NetnsName::Id(id) = name {
                found.extend(self.incarnations.sharing(id));
            }
        }
        found.sort_unstable();
        found.dedup();
        for view in found.into_iter().map(|i| self.incarnations.netns[i]) {
            let life = Life::of(view);
            let concerned = view.global_addresses().any(|a| concern.ips.contains(&a.ip))
                || !containers.containers_of(&life, &view.bind_mounts).is_empty()
                || may_be_named(view, &names, &concern.sandbox_paths);
            if !concerned {
                continue;
            }
            let container_ids = self.containers_of(&life, &view.bind_mounts);
            push_netns(&mut obs, life.id, view, container_ids);
        }
        obs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_of_is_the_paths_file_name() {
        use proptest::prelude::*;
        for p in
            ["", "/", "//", ".", "..", "a", "/a", "a/", "/a/.", "/a/..", "/a/b/", "./a", "a//b", "/var/run/netns/x"]
        {
            assert_eq!(name_of(Path::new(p)), Path::new(p).file_name(), "{p:?}");
        }
        // Paths of `/`, `.`, `..` and names, in any order.
        let parts = prop::collection::vec(prop::sample::select(vec!["/", ".", "..", "a", "b.", "..."]), 0..8);
        proptest!(ProptestConfig::with_cases(3000), |(parts in parts)| {
            let p = parts.concat();
            prop_assert_eq!(name_of(Path::new(&p)), Path::new(&p).file_name(), "{:?}", p);
        });
    }
}
