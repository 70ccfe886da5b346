//! Maps what the agent observed (the kernel model, the attachment ledger,
//! the CNI cache) onto the decision engine's inputs.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::{Path, PathBuf},
    time::SystemTime,
};

use crate::{
    engine::{
        Observations,
        index::path_key,
        observations::{Binding, BindingSource, CniOp, DeadNetns, LiveNetns, NetnsName, same_netns_path},
    },
    fast::{Filed, Map, sized_map},
    identity::NetnsId,
    ipam::{Reservation, SharedStr, cnicache::CachedAttachment},
    ledger::{
        Attachment, Ledger,
        bindings::{Slot, binding_time},
    },
    model::snapshot::{ModelSnapshot, NetnsDeath, NetnsView},
};

mod pass;
pub(crate) use pass::PassIndex;

/// Containers tied to each netns: by inode or nsid from the ledger, by path
/// from the cache. Built once per observation, so a node with many pods
/// stays linear. This is the one place where containers are joined to netns.
struct ContainerIndex<'s> {
    /// Ledger bindings a CNI run resolved, by inode, and by nsid when the
    /// run got one (for an incarnation known by nsid alone), each list by
    /// binding time: under pod churn one inode is bound by most of the
    /// ledger's runs, and an incarnation is bound only by those of its
    /// lifetime.
    by_inode: HashMap<u64, Vec<&'s Attachment>>,
    by_nsid: HashMap<i32, Vec<&'s Attachment>>,
    /// Bindings restored from an earlier run, which name their incarnation.
    pinned: Vec<&'s Attachment>,
    by_path: HashMap<PathBuf, Vec<String>>,
}

impl<'s> ContainerIndex<'s> {
    /// Over these attachments and cache entries (every one of the node's, or
    /// only some containers': then `containers_of` answers for those alone).
    fn new(
        attachments: impl Iterator<Item = &'s Attachment>,
        cache: impl Iterator<Item = &'s CachedAttachment>,
    ) -> Self {
        let mut by_inode: HashMap<u64, Vec<&Attachment>> = HashMap::new();
        let mut by_nsid: HashMap<i32, Vec<&Attachment>> = HashMap::new();
        let mut pinned = Vec::new();
        for a in attachments {
            if a.pinned.is_some() {
                pinned.push(a);
            } else if let (Some(inode), Some(_)) = (a.netns_inode, a.netns_bound_at) {
                by_inode.entry(inode).or_default().push(a);
                if let Some(nsid) = a.netns_nsid {
                    by_nsid.entry(nsid).or_default().push(a);
                }
            }
        }
        by_inode.values_mut().chain(by_nsid.values_mut()).for_each(|filed| filed.sort_by_key(|a| binding_time(a)));
        let mut by_path: HashMap<PathBuf, Vec<String>> = HashMap::new();
        for entry in cache {
            if let Some(path) = entry.netns.as_deref() {
                by_path.entry(path_key(Path::new(path))).or_default().push(entry.container_id.clone());
            }
        }
        Self { by_inode, by_nsid, pinned, by_path }
    }

    /// Containers of one incarnation: ledger bindings that name it
    /// ([`Life::names`]), and cache entries naming a path it was mounted at.
    fn containers_of(&self, life: &Life, bind_mounts: &[PathBuf]) -> Vec<String> {
        // The bindings `Life::names` may accept: filed under its inode, or
        // (known by nsid alone) under its nsid.
        let filed = match (life.id.inode, life.id.nsid) {
            (Some(inode), _) => self.by_inode.get(&inode),
            (None, Some(nsid)) => self.by_nsid.get(&nsid),
            (None, None) => None,
        };
        let mut ids: Vec<String> = life
            .bound_during(filed.map_or(&[][..], Vec::as_slice), |a| binding_time(a))
            .iter()
            .chain(&self.pinned)
            .filter(|a| life.names(a))
            .map(|a| a.container_id.clone())
            .collect();
        for mount in bind_mounts {
            ids.extend(self.by_path.get(&path_key(mount)).into_iter().flatten().cloned());
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

/// How late the model may learn of a netns after a CNI run named it (the
/// probe record and the discovery race the plugin).
pub(crate) const DISCOVERY_SLACK: std::time::Duration = std::time::Duration::from_secs(1);

/// One incarnation's lifetime as the model saw it.
struct Life {
    id: NetnsId,
    first_seen: SystemTime,
    died_at: Option<SystemTime>,
}

impl Life {
    fn of(view: &NetnsView) -> Self {
        Self { id: view.id(), first_seen: view.first_seen, died_at: view.died_at }
    }

    /// Could this incarnation have held its inode at `at`? (Known by then,
    /// give or take discovery; not dead before.) Deaths are dated by when
    /// the model learned of them, which can be late: near a death, both the
    /// old and the new holder of an inode may qualify, and a binding then
    /// names both (a live one keeps).
    fn held_inode_at(&self, at: SystemTime) -> bool {
        self.first_seen <= at + DISCOVERY_SLACK && self.died_at.is_none_or(|d| d >= at)
    }

    /// Whether a CNI run that resolved its netns to `inode` (and `nsid`,
    /// when it got one) at `bound_at` bound its container to this
    /// incarnation, as [`Incarnations::of_binding`] resolves such a binding: by
    /// inode when the model knows this one's; one known by nsid alone, by
    /// the run's nsid. Both are reused at once (the lowest free), so either
    /// way only if this incarnation held them at `bound_at`. One with a
    /// known inode is never matched by nsid: a run that resolved another
    /// inode named another netns.
    fn bound_by(&self, inode: u64, nsid: Option<i32>, bound_at: SystemTime) -> bool {
        let same = match self.id.inode {
            Some(known) => known == inode,
            None => nsid.is_some() && nsid == self.id.nsid,
        };
        same && self.held_inode_at(bound_at)
    }

    /// The part of `filed` (attachments sorted by [`binding_time`]) bound
    /// during this lifetime, give or take discovery: the only runs
    /// [`Life::names`] may accept ([`Life::held_inode_at`]). Under pod churn
    /// one inode is bound by most of the ledger's runs.
    fn bound_during<'f, T>(&self, filed: &'f [T], bound_at: impl Fn(&T) -> SystemTime) -> &'f [T] {
        let from = filed.partition_point(|a| bound_at(a) + DISCOVERY_SLACK < self.first_seen);
        let to = self.died_at.map_or(filed.len(), |died| from + filed[from..].partition_point(|a| bound_at(a) <= died));
        &filed[from..to]
    }

    /// Whether ledger attachment `a` binds its container to this
    /// incarnation: pinned, by identity; otherwise [`Life::bound_by`] the
    /// run that resolved it. The one rule every lookup of a netns's
    /// containers applies (`containers_walked`, `ContainerIndex`,
    /// `PassIndex::containers_of`).
    fn names(&self, a: &Attachment) -> bool {
        match (a.pinned, a.netns_inode, a.netns_bound_at) {
            (Some(id), _, _) => id.may_be(&self.id),
            (None, Some(inode), Some(bound_at)) => self.bound_by(inode, a.netns_nsid, bound_at),
            (None, _, _) => false,
        }
    }
}

/// The snapshot's netns by inode and by nsid, so that resolving every
/// binding of a node stays linear.
pub(crate) struct Incarnations<'a> {
    netns: Vec<&'a NetnsView>,
    by_inode: Map<u64, Filed<usize>>,
    by_nsid: Map<i32, Filed<usize>>,
    /// Inodes held by more than one incarnation, their holders by time.
    reused: Map<u64, Holders>,
    /// Nsids held by more than one incarnation, their holders by time:
    /// built on the first lookup of an identity without an inode (rare: a
    /// netns that died before the model could open it).
    reused_nsid: std::cell::OnceCell<Map<i32, Holders>>,
    /// Netns the model knows by nsid alone, by time: under pod churn a netns
    /// that dies before the model opens it is known so, and one nsid is
    /// held by most of them.
    nsid_only: Map<i32, Holders>,
}

/// The incarnations that held one inode (or one nsid), by first sight, each
/// with the latest death among it and those seen before it (`None`: one of
/// them is alive). Kernels reuse the lowest free inode and nsid, so under pod
/// churn one key is held by most of the recent history: asking which holders
/// could have held it at a time then looks at those near that time only.
struct Holders {
    first_seen: Vec<SystemTime>,
    position: Vec<usize>,
    /// Running maximum of the deaths, `None` once a live one is among them.
    reach: Vec<Option<SystemTime>>,
}

impl Holders {
    fn new(positions: &[usize], netns: &[&NetnsView]) -> Self {
        let mut by_time: Vec<usize> = positions.to_vec();
        by_time.sort_by_key(|&i| netns[i].first_seen);
        let mut reach = Vec::with_capacity(by_time.len());
        let mut latest: Option<Option<SystemTime>> = None;
        for &i in &by_time {
            let died = netns[i].died_at;
            latest = Some(match (latest, died) {
                (None, d) => d,
                (Some(None), _) | (Some(Some(_)), None) => None,
                (Some(Some(a)), Some(b)) => Some(a.max(b)),
            });
            reach.push(latest.flatten());
        }
        Self { first_seen: by_time.iter().map(|&i| netns[i].first_seen).collect(), position: by_time, reach }
    }

    /// Positions of the holders first seen at `seen`.
    fn first_seen_at(&self, seen: SystemTime) -> impl Iterator<Item = usize> + '_ {
        let from = self.first_seen.partition_point(|&f| f < seen);
        let to = self.first_seen.partition_point(|&f| f <= seen);
        self.position[from..to].iter().copied()
    }

    /// Positions of every holder that [`Life::held_inode_at`] `at` may
    /// accept, and a few more: those first seen by then, back to the last
    /// one whose deaths so far reach `at`.
    fn near(&self, at: SystemTime) -> impl Iterator<Item = usize> + '_ {
        let seen_by = self.first_seen.partition_point(|&f| f <= at + DISCOVERY_SLACK);
        // Every holder first seen before one whose deaths so far all came
        // before `at` died before `at`.
        (0..seen_by).rev().take_while(move |&j| self.reach[j].is_none_or(|r| r >= at)).map(|j| self.position[j])
    }
}

impl<'a> Incarnations<'a> {
    pub(crate) fn new(snapshot: &'a ModelSnapshot) -> Self {
        // Built per death pass over every netns of the snapshot: room
        // reserved up front.
        let n = snapshot.netns.len();
        let mut by_inode: Map<u64, Filed<usize>> = sized_map(n);
        let mut by_nsid: Map<i32, Filed<usize>> = sized_map(n);
        let mut nsid_only: Map<i32, Filed<usize>> = Map::default();
        for (i, v) in snapshot.netns.iter().enumerate() {
            if let Some(inode) = v.inode {
                by_inode.entry(u64::from(inode)).or_default().push(i);
            }
            if let Some(nsid) = v.nsid {
                by_nsid.entry(nsid).or_default().push(i);
                if v.inode.is_none() {
                    nsid_only.entry(nsid).or_default().push(i);
                }
            }
        }
        let netns: Vec<&NetnsView> = snapshot.netns.iter().map(std::sync::Arc::as_ref).collect();
        let reused = by_inode
            .iter()
            .filter(|(_, filed)| filed.as_slice().len() > 1)
            .map(|(&inode, filed)| (inode, Holders::new(filed.as_slice(), &netns)))
            .collect();
        let nsid_only = nsid_only.iter().map(|(&nsid, filed)| (nsid, Holders::new(filed.as_slice(), &netns))).collect();
        Self { netns, by_inode, by_nsid, reused, reused_nsid: std::cell::OnceCell::new(), nsid_only }
    }

    /// Positions of the netns that may have held `inode` at `at`
    /// ([`Life::held_inode_at`]), and a few more: a reused inode's holders
    /// near that time ([`Holders`]), otherwise every netns filed under it.
    pub(crate) fn holding(&self, inode: u64, at: SystemTime, out: &mut Vec<usize>) {
        match self.reused.get(&inode) {
            Some(holders) => out.extend(holders.near(at)),
            None => out.extend(self.by_inode.get(&inode).map_or(&[][..], Filed::as_slice)),
        }
    }

    /// See the field.
    fn reused_nsid(&self) -> &Map<i32, Holders> {
        self.reused_nsid.get_or_init(|| {
            self.by_nsid
                .iter()
                .filter(|(_, filed)| filed.as_slice().len() > 1)
                .map(|(&nsid, filed)| (nsid, Holders::new(filed.as_slice(), &self.netns)))
                .collect()
        })
    }

    /// Positions of the netns known by `nsid` alone that may have held it at
    /// `at`, and a few more ([`Holders::near`]).
    fn nsid_only_near(&self, nsid: Option<i32>, at: SystemTime) -> impl Iterator<Item = usize> + '_ {
        nsid.and_then(|n| self.nsid_only.get(&n)).into_iter().flat_map(move |h| h.near(at))
    }

    /// Whether `view` is one [`Self::known_at`] answers for a run that resolved
    /// `resolved` (inode, nsid) at `at`: it agrees with it and held the
    /// inode then.
    fn held_for(view: &NetnsView, resolved: &NetnsId, at: SystemTime) -> bool {
        view.id().may_be(resolved) && Life::of(view).held_inode_at(at)
    }

    /// Whether [`Self::known_at`] finds a netns the model knows, rather than
    /// answering with the run's own (inode, nsid); the same candidates and
    /// test, without collecting them.
    pub(crate) fn knows_holder(&self, inode: u64, nsid: Option<i32>, at: SystemTime) -> bool {
        let resolved = NetnsId::new(Some(inode), nsid, None);
        let held = |&i: &usize| Self::held_for(self.netns[i], &resolved, at);
        let by_inode = match self.reused.get(&inode) {
            Some(holders) => holders.near(at).any(|i| held(&i)),
            None => self.by_inode.get(&inode).map_or(&[][..], Filed::as_slice).iter().any(held),
        };
        by_inode || self.nsid_only_near(nsid, at).any(|i| held(&i))
    }

    /// [`Self::known_at`], or when the model knows none, the inode alone
    /// (it then matches any holder, which keeps): what a run names that the
    /// ledger knows no death of ([`Self::of_binding`]).
    #[cfg(test)]
    pub(crate) fn at(&self, inode: u64, nsid: Option<i32>, at: SystemTime) -> Vec<NetnsId> {
        let ids = self.known_at(inode, nsid, at);
        if ids.is_empty() { vec![NetnsId::new(Some(inode), nsid, None)] } else { ids }
    }

    /// What attachment `a`'s binding names (the inode and nsid its run
    /// resolved, at [`binding_time`]): the incarnations the model knows
    /// held it then
    /// ([`Self::known_at`]). None known: the inode alone (it then matches
    /// any holder, which keeps), except when the kernel said the
    /// incarnation this very binding resolved to died
    /// ([`dead_incarnation`]). That one is named then, not the inode alone:
    /// the model forgets dead netns sooner than the ledger its dead
    /// bindings (at most `ModelConfig::max_dead` views, 205 s at 20 pod
    /// deaths a second, against 30 minutes), and a reused inode alone may
    /// be any of its later holders: a keep on a live one that is not this
    /// binding's, and every later death's concern holding the container.
    /// The binding names what it named while the model knew that netns;
    /// absent from the observations now, it is unresolved (the orphan grace
    /// decides), never taken for dead on another netns's death.
    /// Nothing when the run resolved no inode.
    pub(crate) fn of_binding(&self, a: &Attachment) -> Vec<NetnsId> {
        let Some(inode) = a.netns_inode else { return Vec::new() };
        let ids = self.known_at(inode, a.netns_nsid, binding_time(a));
        if !ids.is_empty() {
            return ids;
        }
        vec![dead_incarnation(a).map_or_else(|| NetnsId::new(Some(inode), a.netns_nsid, None), |(id, _)| id)]
    }

    /// The incarnations the model knows that may have held `inode` at
    /// `at` (none: empty). With `nsid` (resolved with the inode at the CNI
    /// run), only incarnations that agree with it; it also finds a netns
    /// the model knew only by nsid.
    ///
    /// `may_be` needs a shared inode or nsid, so only the netns filed under
    /// them can match; they are taken in the snapshot's order, as a walk of
    /// all of them would. Those are the inode's holders and the netns known
    /// by that nsid alone (one holding another inode is not `may_be`); a
    /// reused inode's holders are looked up by time ([`Holders`]).
    fn known_at(&self, inode: u64, nsid: Option<i32>, at: SystemTime) -> Vec<NetnsId> {
        let resolved = NetnsId::new(Some(inode), nsid, None);
        let mut near: Vec<usize> = Vec::new();
        self.holding(inode, at, &mut near);
        near.extend(self.nsid_only_near(nsid, at));
        // The two lists share no netns (one has an inode, the other none).
        near.sort_unstable();
        let ids: Vec<NetnsId> = near
            .into_iter()
            .map(|i| self.netns[i])
            .filter(|v| Self::held_for(v, &resolved, at))
            .map(NetnsView::id)
            .collect();
        ids
    }

    /// Positions of the netns filed under `inode` or `nsid`, ascending, each
    /// once. Both lists are ascending (filed as the snapshot is walked), so
    /// a merge gives what sorting and deduplicating their union would,
    /// without allocating: kernels reuse the lowest free netns inode and
    /// nsid, so under pod churn one key holds nearly every recent netns, and
    /// sorting it again for every binding was quadratic in that history.
    fn filed_under(&self, inode: Option<u64>, nsid: Option<i32>) -> Ascending<'_> {
        let by_inode = inode.and_then(|i| self.by_inode.get(&i)).map_or(&[][..], Filed::as_slice);
        let by_nsid = nsid.and_then(|n| self.by_nsid.get(&n)).map_or(&[][..], Filed::as_slice);
        Ascending { a: by_inode, b: by_nsid }
    }

    /// Positions of the netns that may be `id` ([`NetnsId::may_be`]) and a
    /// few more, in order. Under pod churn one inode and one nsid are
    /// shared by most of the recent history, so an identity that names when
    /// it was first seen (every view's does) is looked up by that time too:
    /// with an inode, among that inode's holders first seen then and the
    /// netns known by its nsid alone (one with another inode is not it);
    /// without, among its nsid's netns first seen then.
    fn sharing(&self, id: &NetnsId) -> Vec<usize> {
        if id.inode.is_none() && id.nsid.is_none() {
            // Nothing to look up by: every netns is a candidate.
            return (0..self.netns.len()).collect();
        }
        let Some(seen) = id.first_seen else { return self.filed_under(id.inode, id.nsid).collect() };
        let seen_then = |&i: &usize| self.netns[i].first_seen == seen;
        let mut found: Vec<usize> = match id.inode {
            Some(inode) => {
                let mut found: Vec<usize> = match self.reused.get(&inode) {
                    Some(holders) => holders.first_seen_at(seen).collect(),
                    None => self
                        .by_inode
                        .get(&inode)
                        .map_or(&[][..], Filed::as_slice)
                        .iter()
                        .copied()
                        .filter(seen_then)
                        .collect(),
                };
                found.extend(
                    id.nsid.and_then(|n| self.nsid_only.get(&n)).into_iter().flat_map(|h| h.first_seen_at(seen)),
                );
                found
            }
            None => match id.nsid.and_then(|n| self.reused_nsid().get(&n)) {
                Some(holders) => holders.first_seen_at(seen).collect(),
                None => self.filed_under(None, id.nsid).filter(seen_then).collect(),
            },
        };
        found.sort_unstable();
        found.dedup();
        found
    }

    /// The netns that may be `id` ([`NetnsId::may_be`]), in the snapshot's order.
    pub(crate) fn may_be(&self, id: NetnsId) -> impl Iterator<Item = &'a NetnsView> + '_ {
        self.sharing(&id).into_iter().map(|i| self.netns[i]).filter(move |v| v.id().may_be(&id))
    }

    /// The netns that are exactly one of `ids`, in the snapshot's order.
    pub(crate) fn exactly(&self, ids: &[NetnsId]) -> Vec<&'a NetnsView> {
        let mut found: Vec<usize> = ids.iter().flat_map(|id| self.sharing(id)).collect();
        found.sort_unstable();
        found.dedup();
        found.into_iter().map(|i| self.netns[i]).filter(|v| ids.contains(&v.id())).collect()
    }
}

/// The union of two ascending position lists, ascending, each position
/// once (see [`Incarnations::filed_under`]).
struct Ascending<'a> {
    a: &'a [usize],
    b: &'a [usize],
}

impl Iterator for Ascending<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let next = match (self.a.first(), self.b.first()) {
            (None, None) => return None,
            (Some(&x), None) => x,
            (None, Some(&y)) => y,
            (Some(&x), Some(&y)) => x.min(y),
        };
        // Past every copy of it in both lists.
        while self.a.first() == Some(&next) {
            self.a = &self.a[1..];
        }
        while self.b.first() == Some(&next) {
            self.b = &self.b[1..];
        }
        Some(next)
    }
}

/// The containers a netns that just died was bound to (for its death event
/// and the ledger's marks): the attachments looked up in the ledger's
/// binding index ([`pass::bound_to`]: under churn the ledger holds thousands
/// of earlier pods' runs), and the cache entries at one of its paths. The
/// same answer as [`containers_walked`] (tested).
#[must_use]
pub fn containers_of_death(
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    death: &NetnsDeath,
) -> Vec<String> {
    let life = Life { id: death.id(), first_seen: death.first_seen, died_at: Some(death.at) };
    let mut ids: Vec<String> = pass::bound_to(ledger, &life).map(|a| a.container_id.clone()).collect();
    for entry in cache {
        if entry.netns.as_deref().is_some_and(|p| death.bind_mounts.iter().any(|m| same_netns_path(m, Path::new(p)))) {
            ids.push(entry.container_id.clone());
        }
    }
    ids.sort();
    ids.dedup();
    ids
}

/// What `ContainerIndex::containers_of` answers for one incarnation, without
/// indexing every binding of the ledger: a walk that keeps the same
/// attachments ([`Life::names`]) and the same cache entries (by path).
fn containers_walked(
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    life: &Life,
    bind_mounts: &[PathBuf],
) -> Vec<String> {
    let mut ids: Vec<String> = ledger.attachments().filter(|a| life.names(a)).map(|a| a.container_id.clone()).collect();
    for entry in cache {
        if entry.netns.as_deref().is_some_and(|p| bind_mounts.iter().any(|m| same_netns_path(m, Path::new(p)))) {
            ids.push(entry.container_id.clone());
        }
    }
    ids.sort();
    ids.dedup();
    ids
}

/// The index-based answer [`containers_of_death`] must equal.
#[cfg(test)]
fn containers_of_death_indexed(
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    death: &NetnsDeath,
) -> Vec<String> {
    let life = Life { id: death.id(), first_seen: death.first_seen, died_at: Some(death.at) };
    ContainerIndex::new(ledger.attachments(), cache.iter().map(AsRef::as_ref)).containers_of(&life, &death.bind_mounts)
}

/// When netreap itself first saw each CNI cache entry (by file), so that a
/// binding it cannot resolve is timed from its own look, never from the
/// file's mtime (a restart or an old file must not start the clock early).
/// foldhash: every death's pass dates the whole cache again after a
/// release removed one entry (SipHash on each path was ~65 us per death at
/// 200 entries).
pub type FirstSeen = Map<PathBuf, SystemTime>;

/// Which reservations a set of observations serves.
#[derive(Debug, Clone, Copy)]
pub enum Scope<'c> {
    /// Every reservation of the node (a full pass).
    All,
    /// Only reservations whose container and IP a [`Concern`] names (the
    /// death path).
    Concerning(&'c Concern),
}

/// The containers and IPs of the reservations a pass judges, and the paths
/// the runtime gives those containers' sandboxes. Observations for a concern
/// hold every entry of the whole node's observations that a verdict on such
/// a reservation reads, exactly as there and in the same order, and leave
/// out the rest (`tests::observations_for_a_concern_give_its_verdicts`):
/// - the live and dead netns that hold one of the IPs, that one of the
///   containers is bound to, or that one of their bindings or sandbox paths
///   may name, each with all of its containers and addresses;
/// - the containers' bindings;
/// - every CNI run that may concern one of them (unattributed runs and
///   truncated IDs included).
#[derive(Debug, Clone, Default)]
pub struct Concern {
    pub containers: HashSet<String>,
    pub ips: HashSet<IpAddr>,
    pub sandbox_paths: Vec<PathBuf>,
}

impl Concern {
    /// What a full pass judges: every reservation's container and IP, and
    /// every sandbox the runtime lists (its stuck sandboxes are found among
    /// them).
    #[must_use]
    pub fn of_reservations<'r>(
        reservations: impl IntoIterator<Item = &'r Reservation>,
        runtime: Option<&crate::engine::RuntimeView>,
    ) -> Self {
        let mut concern = Self::default();
        for r in reservations {
            // A container holds a reservation in each of its networks: its ID
            // is copied once.
            if !concern.containers.contains(r.container_id.as_str()) {
                concern.containers.insert(r.container_id.to_string());
            }
            concern.ips.insert(r.ip);
        }
        if let Some(view) = runtime {
            concern.containers.extend(view.sandboxes.keys().cloned());
        }
        concern
    }

    /// This concern with the runtime's sandbox paths of its containers: the
    /// engine asks which live netns is at each.
    #[must_use]
    pub fn with_sandboxes(&self, runtime: Option<&crate::engine::RuntimeView>) -> Self {
        let mut c = self.clone();
        if let Some(view) = runtime {
            c.sandbox_paths =
                self.containers.iter().filter_map(|id| view.sandboxes.get(id).and_then(|s| s.netns.clone())).collect();
        }
        c
    }

    /// Up to this many containers, a concern is searched by comparing with
    /// each (see [`Self::has_container`]).
    const FEW: usize = 8;

    /// Whether a run of attachment `container_id` may concern one of the
    /// containers ([`CniOp::may_concern`]: a truncated ID is a prefix).
    fn wants_run(&self, container_id: &str, truncated: bool) -> bool {
        if truncated {
            self.containers.iter().any(|c| c.starts_with(container_id))
        } else {
            self.has_container(container_id)
        }
    }

    /// Whether `container_id` is one of the containers. A death concerns a
    /// few, and this is asked of every attachment and cache entry: comparing
    /// with each of a few (most differ in their first bytes) costs less than
    /// hashing a 64-byte ID with SipHash.
    fn has_container(&self, container_id: &str) -> bool {
        if self.containers.len() <= Self::FEW {
            self.containers.iter().any(|c| c == container_id)
        } else {
            self.containers.contains(container_id)
        }
    }
}

impl Scope<'_> {
    fn wants_container(self, container_id: &str) -> bool {
        match self {
            Self::All => true,
            Self::Concerning(c) => c.has_container(container_id),
        }
    }

    fn wants_run(self, container_id: &str, truncated: bool) -> bool {
        match self {
            Self::All => true,
            Self::Concerning(c) => c.wants_run(container_id, truncated),
        }
    }
}

/// The attachments `scope` may want a run of (a container of it is their ID
/// or starts with it: [`Concern::wants_run`]), in the ledger's order. A
/// death's concern names a few containers: their attachments, and those
/// filed under a prefix of one (a run whose ID was cut short), are looked up
/// rather than the ledger walked (under churn it holds thousands, whose runs
/// are most of its memory).
fn runs_wanted_of<'l>(ledger: &'l Ledger, scope: Scope<'_>) -> Box<dyn Iterator<Item = &'l Attachment> + 'l> {
    match scope {
        Scope::Concerning(c) if c.containers.len() <= Concern::FEW => {
            let mut slots: Vec<Slot> = c.containers.iter().flat_map(|x| ledger.slots_prefixing(x)).collect();
            slots.sort_unstable();
            slots.dedup();
            Box::new(slots.into_iter().filter_map(|slot| ledger.in_slot(slot)))
        }
        // Every container, or more than a few: each attachment may be wanted.
        _ => Box::new(ledger.attachments()),
    }
}

/// The CNI runs of the ledger that observations for `scope` hold
/// ([`Observations::cni_ops`], in the same order): every run of each
/// attachment the scope wants a run of, then the runs the kernel could not
/// attribute (in flight for every container: the engine's wildcard). Apart
/// from [`observations_in`] so the death path can ask about runs without
/// building the rest.
#[must_use]
pub fn cni_ops_in(ledger: &Ledger, scope: Scope<'_>) -> Vec<CniOp> {
    let mut ops = Vec::new();
    for a in runs_wanted_of(ledger, scope) {
        // Whether a run is wanted depends only on its attachment's container
        // and on whether the run's ID was cut short: asked once each per
        // attachment, not once per run (a container runs a plugin chain).
        let (mut whole, mut cut) = (None, None);
        let mut wanted = |truncated: bool| {
            let answer = if truncated { &mut cut } else { &mut whole };
            *answer.get_or_insert_with(|| scope.wants_run(&a.container_id, truncated))
        };
        // One copy of the ID for all of the attachment's runs.
        let mut container_id: Option<SharedStr> = None;
        for op in a.operations.iter().filter(|op| wanted(op.truncated)) {
            let container_id = container_id.get_or_insert_with(|| SharedStr::from(&a.container_id));
            ops.push(CniOp {
                container_id: Some(container_id.clone()),
                container_id_truncated: op.truncated,
                command: op.command.clone(),
                plugin: op.plugin.clone(),
                started_at: op.started_at,
                finished_at: op.finished_at,
                exit_code: op.exit.as_ref().and_then(|e| e.exit_code),
            });
        }
    }
    // Runs whose environment was not read to CNI_CONTAINERID.
    for op in ledger.unattributed_runs() {
        ops.push(CniOp {
            container_id: None,
            container_id_truncated: false,
            command: op.command.clone(),
            plugin: op.plugin.clone(),
            started_at: op.started_at,
            finished_at: op.finished_at,
            exit_code: None,
        });
    }
    ops
}

/// Everything the engine needs, from one model snapshot, the ledger and a
/// cache scan. `watching_since` is when the probes last started recording
/// without a gap (None for a one-shot scan that saw no CNI run).
/// `cache_first_seen`: see [`FirstSeen`]; None (a one-shot scan) dates an
/// unresolved cache binding by the file.
#[must_use]
pub fn observations(
    snapshot: &ModelSnapshot,
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    watching_since: Option<SystemTime>,
    cache_first_seen: Option<&FirstSeen>,
) -> Observations {
    observations_in(snapshot, ledger, cache, watching_since, cache_first_seen, Scope::All)
}

/// [`observations`] for the reservations `scope` names: with
/// [`Scope::Concerning`], work in proportion to what the concern touches
/// (plus one comparison per netns, attachment and cache entry), not to the
/// node's pods.
#[must_use]
pub fn observations_in(
    snapshot: &ModelSnapshot,
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    watching_since: Option<SystemTime>,
    cache_first_seen: Option<&FirstSeen>,
    scope: Scope<'_>,
) -> Observations {
    match scope {
        Scope::All => observations_walked(snapshot, ledger, cache, watching_since, cache_first_seen, scope),
        Scope::Concerning(concern) => {
            PassIndex::new(snapshot, ledger, cache).observations(watching_since, cache_first_seen, concern)
        }
    }
}

/// [`observations_in`] by walking every netns, attachment and cache entry:
/// the whole node's observations, and (in tests) the reference a concern's
/// indexed ones must equal.
fn observations_walked(
    snapshot: &ModelSnapshot,
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    watching_since: Option<SystemTime>,
    cache_first_seen: Option<&FirstSeen>,
    scope: Scope<'_>,
) -> Observations {
    let mut obs = Observations { watching_since, ..Observations::default() };
    let incarnations = Incarnations::new(snapshot);
    // Bindings first: a concern's netns are found through them.
    for a in ledger.attachments() {
        if scope.wants_container(&a.container_id) {
            let (names, bound_at) = ledger_names(a, &incarnations);
            for netns in names {
                obs.bindings.push(Binding {
                    container_id: a.container_id.clone(),
                    netns,
                    source: BindingSource::CniExec,
                    seen_at: bound_at,
                });
            }
        }
    }
    obs.cni_ops = cni_ops_in(ledger, scope);
    for entry in cache.iter().filter(|e| scope.wants_container(&e.container_id)) {
        for (netns, seen_at) in cache_names(entry, &incarnations, ledger, cache_first_seen) {
            obs.bindings.push(Binding {
                container_id: entry.container_id.clone(),
                netns,
                source: BindingSource::CniCache,
                seen_at,
            });
        }
    }
    let containers = match scope {
        Scope::All => ContainerIndex::new(ledger.attachments(), cache.iter().map(AsRef::as_ref)),
        Scope::Concerning(_) => ContainerIndex::new(
            ledger.attachments().filter(|a| scope.wants_container(&a.container_id)),
            cache.iter().map(AsRef::as_ref).filter(|e: &&CachedAttachment| scope.wants_container(&e.container_id)),
        ),
    };
    // Asked only for a concern (see `may_be_named`).
    let names = match scope {
        Scope::All => Vec::new(),
        Scope::Concerning(_) => distinct_names(&obs.bindings),
    };
    for view in &snapshot.netns {
        let life = Life::of(view);
        let container_ids = match scope {
            Scope::All => containers.containers_of(&life, &view.bind_mounts),
            Scope::Concerning(concern) => {
                let concerned = view.global_addresses().any(|a| concern.ips.contains(&a.ip))
                    || !containers.containers_of(&life, &view.bind_mounts).is_empty()
                    || may_be_named(view, &names, &concern.sandbox_paths);
                if !concerned {
                    continue;
                }
                containers_walked(ledger, cache, &life, &view.bind_mounts)
            }
        };
        push_netns(&mut obs, life.id, view, container_ids);
    }
    obs
}

/// A netns of the model into the observations, live or dead, with the
/// containers bound to it.
pub(super) fn push_netns(obs: &mut Observations, id: NetnsId, view: &NetnsView, container_ids: Vec<String>) {
    let addresses = view.global_addresses().map(|a| a.ip).collect();
    let paths: Vec<PathBuf> = view.bind_mounts.clone();
    // A netns known only by nsid (not openable from here) is as alive as
    // any: it holds the addresses configured in it.
    match (view.alive, view.died_at) {
        (true, _) => obs.live.push(LiveNetns { id, container_ids, addresses, paths }),
        (false, Some(died_at)) => obs.dead.push(DeadNetns { id, died_at, container_ids, addresses, paths }),
        // Dead without a time cannot anchor a release: leave it out.
        (false, None) => {}
    }
}

/// The netns the bindings name, each once, in their order: under pod churn
/// thousands of runs name one reused inode alone (a netns the model no
/// longer knows), and asking each binding per netns was quadratic.
pub(super) fn distinct_names(bindings: &[Binding]) -> Vec<NetnsName> {
    let mut seen = HashSet::with_capacity(bindings.len());
    bindings.iter().map(|b| &b.netns).filter(|name| seen.insert(*name)).cloned().collect()
}

/// Whether a binding or a sandbox path may name this netns, as the engine's
/// index matches them (an identity that may be its own, or one of its
/// paths).
fn may_be_named(view: &NetnsView, names: &[NetnsName], sandbox_paths: &[PathBuf]) -> bool {
    let id = view.id();
    let at_path = |p: &Path| view.bind_mounts.iter().any(|m| same_netns_path(m, p));
    names.iter().any(|name| match name {
        NetnsName::Id(other) => id.may_be(other),
        NetnsName::Path(p) => at_path(p),
    }) || sandbox_paths.iter().any(|p| at_path(p))
}

/// The incarnation attachment `a`'s binding named when the kernel said it
/// died, and when it died ([`crate::ledger::BindingDeath`]), if it agrees
/// with the run's resolution (its inode and nsid): what the binding names
/// once the model has forgotten that netns ([`Incarnations::of_binding`]).
pub(super) fn dead_incarnation(a: &Attachment) -> Option<(NetnsId, SystemTime)> {
    let resolved = NetnsId::new(Some(a.netns_inode?), a.netns_nsid, None);
    a.died.and_then(|d| d.incarnation).filter(|(id, _)| a.pinned.is_none() && id.may_be(&resolved))
}

/// Whether the run that made `a`'s binding resolved it to the netns whose
/// death this is (the rule every lookup of a netns's containers applies,
/// [`Life::names`], and an nsid that agrees): then the ledger keeps that
/// incarnation with the binding ([`crate::ledger::Ledger::netns_died`]).
#[must_use]
pub fn binding_resolved_to(death: &NetnsDeath, a: &Attachment) -> bool {
    let id = death.id();
    let life = Life { id, first_seen: death.first_seen, died_at: Some(death.at) };
    a.pinned.is_none() && life.names(a) && id.may_be(&NetnsId::new(a.netns_inode, a.netns_nsid, None))
}

/// The netns a ledger attachment binds its container to (the
/// incarnations that held its inode when the run named it), and since when.
fn ledger_names(a: &Attachment, incarnations: &Incarnations<'_>) -> (Vec<NetnsName>, SystemTime) {
    ledger_names_if(a, incarnations, |_, _| true)
}

/// [`ledger_names`], leaving out the incarnations of a run's (inode, nsid)
/// when `resolve` says none of them can matter (nothing is looked up then).
fn ledger_names_if(
    a: &Attachment,
    incarnations: &Incarnations<'_>,
    resolve: impl Fn(u64, Option<i32>) -> bool,
) -> (Vec<NetnsName>, SystemTime) {
    let bound_at = binding_time(a);
    let names = match (a.pinned, a.netns_inode, &a.netns_path) {
        (Some(id), _, _) => vec![NetnsName::Id(id)],
        (None, Some(inode), _) if !resolve(inode, a.netns_nsid) => Vec::new(),
        (None, Some(_), _) => incarnations.of_binding(a).into_iter().map(NetnsName::Id).collect(),
        (None, None, Some(path)) => vec![NetnsName::Path(PathBuf::from(path))],
        (None, None, None) => Vec::new(),
    };
    (names, bound_at)
}

/// A cache entry binds its container to a netns path. When a CNI run of the
/// same container named the same path, the ledger resolved it to an inode
/// while the plugin ran; the binding then names that netns (inode and nsid)
/// from that moment. A path alone may no longer resolve: `ip netns del`
/// unmounts it before the netns dies (a plugin holding it keeps it alive),
/// and the runtime writes the cache after the plugins returned.
fn cache_names(
    entry: &CachedAttachment,
    incarnations: &Incarnations<'_>,
    ledger: &Ledger,
    first_seen: Option<&FirstSeen>,
) -> Vec<(NetnsName, SystemTime)> {
    cache_names_if(entry, incarnations, ledger, first_seen, |_, _| true)
}

/// [`cache_names`], leaving out the incarnations of a resolved (inode, nsid)
/// when `resolve` says none of them can matter.
fn cache_names_if(
    entry: &CachedAttachment,
    incarnations: &Incarnations<'_>,
    ledger: &Ledger,
    first_seen: Option<&FirstSeen>,
    resolve: impl Fn(u64, Option<i32>) -> bool,
) -> Vec<(NetnsName, SystemTime)> {
    let Some(path) = entry.netns.as_deref() else { return Vec::new() };
    let resolved = ledger.get(&entry.container_id).and_then(|a| {
        let same_path = a.netns_path.as_deref().is_some_and(|p| same_netns_path(Path::new(p), Path::new(path)));
        a.netns_inode.filter(|_| same_path).zip(a.netns_bound_at).map(|r| (r, a))
    });
    match resolved {
        Some(((_, bound_at), &Attachment { pinned: Some(pinned), .. })) => vec![(NetnsName::Id(pinned), bound_at)],
        Some(((inode, _), a)) if !resolve(inode, a.netns_nsid) => Vec::new(),
        Some(((_, bound_at), a)) => {
            incarnations.of_binding(a).into_iter().map(|id| (NetnsName::Id(id), bound_at)).collect()
        }
        None => {
            let seen =
                first_seen.and_then(|f| f.get(&entry.path)).map_or(entry.written_at, |&s| s.max(entry.written_at));
            vec![(NetnsName::Path(PathBuf::from(path)), seen)]
        }
    }
}

/// Whether a binding resolved from a CNI run's (inode, nsid) may name the
/// netns `dead` ([`NetnsId::may_be`]): [`Incarnations::of_binding`] gives only ids
/// whose inode is that inode or unknown and whose nsid is that nsid or
/// unknown (any nsid, when the run's is unknown), and `may_be` needs a part
/// both know and agree on. A false answer spares the lookup; a true one only
/// asks for it.
#[must_use]
pub fn resolution_may_name(inode: u64, nsid: Option<i32>, dead: &NetnsId) -> bool {
    dead.inode == Some(inode) || (nsid.is_some() && nsid == dead.nsid) || (dead.inode.is_none() && nsid.is_none())
}

/// The reference [`PassIndex::death_concern`] must equal (it walks every
/// netns, attachment and cache entry). The containers and IPs a set of
/// deaths concerns, from the sources: what
/// `daemon::targeted::concerned_keys` finds in the whole node's
/// observations (`extra_dead` are the dead netns the caller adds to them),
/// without building those. `is_dead` says whether a dead netns (identity,
/// paths) is one of the deaths; `names_dead` whether a binding's netns may
/// be one; `dead_ids` are the deaths' identities (a binding resolved from
/// an inode no death can be is not looked up: [`resolution_may_name`]).
#[cfg(test)]
#[must_use]
pub fn death_concern(
    snapshot: &ModelSnapshot,
    ledger: &Ledger,
    cache: &[std::sync::Arc<CachedAttachment>],
    extra_dead: &[DeadNetns],
    dead_ids: &[NetnsId],
    is_dead: impl Fn(&NetnsId, &[PathBuf]) -> bool,
    names_dead: impl Fn(&NetnsName) -> bool,
) -> (HashSet<String>, HashSet<IpAddr>) {
    let resolve = |inode: u64, nsid: Option<i32>| dead_ids.iter().any(|d| resolution_may_name(inode, nsid, d));
    let (mut containers, mut ips) = (HashSet::new(), HashSet::new());
    for view in snapshot.netns.iter().filter(|v| !v.alive && v.died_at.is_some()) {
        let life = Life::of(view);
        if is_dead(&life.id, &view.bind_mounts) {
            containers.extend(containers_walked(ledger, cache, &life, &view.bind_mounts));
            ips.extend(view.global_addresses().map(|a| a.ip));
        }
    }
    for dead in extra_dead.iter().filter(|d| is_dead(&d.id, &d.paths)) {
        containers.extend(dead.container_ids.iter().cloned());
        ips.extend(dead.addresses.iter().copied());
    }
    let incarnations = Incarnations::new(snapshot);
    for a in ledger.attachments() {
        if !containers.contains(&a.container_id) && ledger_names_if(a, &incarnations, resolve).0.iter().any(&names_dead)
        {
            containers.insert(a.container_id.clone());
        }
    }
    for entry in cache {
        // Path-only names need no first-seen time: only the name is asked.
        if !containers.contains(&entry.container_id)
            && cache_names_if(entry, &incarnations, ledger, None, resolve).iter().any(|(n, _)| names_dead(n))
        {
            containers.insert(entry.container_id.clone());
        }
    }
    (containers, ips)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::{
        engine::{Status, decide_one},
        ipam::{Reservation, ReservationData, StoreRef},
        kernel::events::{CniExec, CniExit, CniValue, KernelEvent, Task},
        ledger::NetnsResolver,
        model::{
            sealed::{SealedChunk, SealedViews},
            snapshot::{AddrScope, AddressView, ModelStats},
        },
    };

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn view(inode: u32, nsid: i32, first_seen: u64, died_at: Option<u64>, ip: Option<&str>) -> NetnsView {
        NetnsView {
            inode: Some(inode),
            nsid: Some(nsid),
            host: false,
            alive: died_at.is_none(),
            first_seen: t(first_seen),
            died_at: died_at.map(t),
            death_source: None,
            creator: None,
            bind_mounts: Vec::new(),
            process_count: 0,
            processes: Vec::new(),
            interfaces: Vec::new(),
            addresses: ip
                .map(|ip| AddressView {
                    ip: ip.parse().unwrap(),
                    prefix_len: 24,
                    ifindex: 2,
                    ifname: Some("eth0".into()),
                    scope: AddrScope::from_raw(0),
                })
                .into_iter()
                .collect(),
            host_routes: Vec::new(),
        }
    }

    struct Inode(u64);
    impl NetnsResolver for Inode {
        fn inode_of(&self, _: &str, _: Option<u32>) -> Option<u64> {
            Some(self.0)
        }
    }

    fn v(s: &str) -> CniValue {
        CniValue { value: s.into(), truncated: false }
    }

    /// c1's reservation of 10.0.0.2 in network n, made at `created_at`.
    fn reservation_of_c1(created_at: SystemTime) -> Reservation {
        Reservation::from(ReservationData {
            store: StoreRef::HostLocal { data_dir: "/d".into() }.into(),
            network: "n".into(),
            ip: "10.0.0.2".parse().unwrap(),
            container_id: "c1".into(),
            ifname: Some("eth0".into()),
            created_at,
            path: "/d/n/10.0.0.2".into(),
            inode: 1,
        })
    }

    /// A ledger holding one finished ADD of container c1 (pid 9) that named
    /// `netns`, which resolved to `inode`; times in seconds of `t`.
    fn ledger_with_add(netns: &str, started: u64, finished: u64, inode: u64) -> Ledger {
        let mut ledger = Ledger::new();
        let task = |k: u64| Task { ktime_ns: k, pid: 9, tgid: 9, comm: "bridge".into(), cgroup_id: 1 };
        let exec = KernelEvent::CniExec {
            task: task(started),
            exec: CniExec {
                binary: v("/usr/lib/cni/bridge"),
                command: v("ADD"),
                container_id: Some(v("c1")),
                netns: Some(v(netns)),
                ifname: Some(v("eth0")),
                cni_args: None,
                env_scan_limited: false,
                env_scanned: 10,
                uid: 0,
                scan_variant: crate::kernel::events::EnvScanVariant::BpfLoop,
                nested_in: None,
            },
        };
        ledger.observe(&exec, t, &Inode(inode));
        let exit = KernelEvent::CniExit { task: task(finished), exit: CniExit::from_wait_status(0) };
        ledger.observe(&exit, t, &Inode(inode));
        ledger
    }

    /// A container bound to inode 77 at t=10 (nsid 1), dead at t=20; a new
    /// netns reuses inode 77 at t=30 (nsid 2). The binding is the dead one's:
    /// the reservation is orphaned, not "in use" by the newcomer.
    #[test]
    fn a_reused_inode_does_not_keep_a_dead_containers_reservation() {
        let ledger = ledger_with_add("/run/netns/a", 10, 11, 77);
        let snapshot = ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(40),
            netns: vec![view(77, 2, 30, None, None).into(), view(77, 1, 5, Some(20), Some("10.0.0.2")).into()],
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        };
        let obs = observations(&snapshot, &ledger, &[], Some(t(0)), None);
        assert_eq!(obs.bindings[0].netns, NetnsName::Id(NetnsId::new(Some(77), Some(1), Some(t(5)))));
        assert!(obs.live[0].container_ids.is_empty(), "the newcomer is not c1's");
        assert_eq!(obs.dead[0].container_ids, vec!["c1".to_owned()]);
        let r = reservation_of_c1(t(10));
        let verdict = decide_one(&obs, &r, t(40), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::Orphaned, "{}", verdict.summary());
    }

    /// `ip netns del` unmounted the netns while a plugin held it, and the
    /// runtime wrote the cache after the death: the cache's path binding
    /// must still name the dead netns (through the ledger), or the
    /// reservation would wait for the orphan grace.
    #[test]
    fn a_cache_binding_names_the_netns_the_ledger_resolved_its_path_to() {
        let ledger = ledger_with_add("/var/run/netns/a", 10, 19, 77);
        let snapshot = ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(40),
            netns: vec![view(77, 1, 5, Some(20), Some("10.0.0.2")).into()],
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        };
        let cache = vec![std::sync::Arc::new(CachedAttachment {
            path: "/c/n-c1-eth0".into(),
            network: "n".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: Some("/run/netns/a".into()),
            ips: vec!["10.0.0.2".parse().unwrap()],
            written_at: t(25),
            inode: 5,
        })];
        let obs = observations(&snapshot, &ledger, &cache, Some(t(0)), None);
        let cached: Vec<_> = obs.bindings.iter().filter(|b| b.source == BindingSource::CniCache).collect();
        assert_eq!(cached[0].netns, NetnsName::Id(NetnsId::new(Some(77), Some(1), Some(t(5)))));
        assert_eq!(cached[0].seen_at, t(10));
        let r = reservation_of_c1(t(12));
        let verdict = decide_one(&obs, &r, t(40), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::Orphaned, "{}", verdict.summary());
    }

    /// Issue 10: a live netns netreap cannot open (bind-mounted where its
    /// mount namespace does not see) is known only by nsid. It still holds
    /// the IP configured in it; and a cache binding to its path that
    /// netreap cannot resolve is timed from netreap's own first look, not
    /// from the file's hour-old mtime.
    #[test]
    fn a_netns_known_only_by_nsid_keeps_its_ip_and_an_old_cache_file_starts_no_clock() {
        let mut only_nsid = view(1, 9, 3000, None, Some("10.0.0.2"));
        only_nsid.inode = None;
        let snapshot = ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(3600),
            netns: vec![only_nsid.into()],
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        };
        let cache = vec![std::sync::Arc::new(CachedAttachment {
            path: "/c/n-c1-eth0".into(),
            network: "n".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: Some("/var/run/docker/netns/abc".into()),
            ips: vec!["10.0.0.2".parse().unwrap()],
            written_at: t(0),
            inode: 5,
        })];
        let first_seen: FirstSeen = [(PathBuf::from("/c/n-c1-eth0"), t(3500))].into_iter().collect();
        let obs = observations(&snapshot, &Ledger::new(), &cache, Some(t(3000)), Some(&first_seen));
        assert_eq!(obs.live.len(), 1, "the nsid-only netns is live");
        assert_eq!(obs.bindings[0].seen_at, t(3500));
        let r = reservation_of_c1(t(0));
        let verdict = decide_one(&obs, &r, t(3600), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::InUse, "{}", verdict.summary());
        // Even with the address gone from view, the binding is not past
        // the orphan grace: netreap looked first 100 s ago.
        let mut no_addr = obs.clone();
        no_addr.live[0].addresses.clear();
        let verdict = decide_one(&no_addr, &r, t(3600), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::Pending, "{}", verdict.summary());
    }

    /// The model learns of a death a little late; a CNI run that names the
    /// inode just after it was reused binds the container to both the dying
    /// holder and the new one. The live one keeps the reservation.
    #[test]
    fn a_binding_made_near_an_inode_reuse_names_both_holders_and_the_live_one_keeps() {
        // Old holder (nsid 1) died at t=20.5 as the model saw it; the new
        // one (nsid 2) was first seen at t=20.2; the ADD named inode 77 at 20.
        let ledger = ledger_with_add("/run/netns/b", 20, 21, 77);
        let snapshot = ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(40),
            netns: vec![view(77, 2, 20, None, None).into(), view(77, 1, 5, Some(21), None).into()],
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        };
        let obs = observations(&snapshot, &ledger, &[], Some(t(0)), None);
        let ids: Vec<_> = obs.bindings.iter().map(|b| b.netns.clone()).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        let r = reservation_of_c1(t(20));
        let verdict = decide_one(&obs, &r, t(40), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::InUse, "{}", verdict.summary());
    }

    /// Under load the model may never open a short-lived netns: it knows it
    /// only by the nsid its veth gave it, and sees it die by that nsid. The
    /// CNI run resolved both inode and nsid, so the binding names the dead
    /// netns and the leak goes at once (no orphan grace).
    #[test]
    fn a_binding_with_its_nsid_finds_a_netns_the_model_knew_only_by_nsid() {
        struct InodeNsid;
        impl NetnsResolver for InodeNsid {
            fn inode_of(&self, _: &str, _: Option<u32>) -> Option<u64> {
                Some(77)
            }
            fn nsid_of(&self, _: &str, _: Option<u32>, _: u32) -> Option<i32> {
                Some(1)
            }
        }
        let mut ledger = Ledger::new();
        let task = |k: u64| Task { ktime_ns: k, pid: 9, tgid: 9, comm: "bridge".into(), cgroup_id: 1 };
        let exec = KernelEvent::CniExec {
            task: task(10),
            exec: CniExec {
                binary: v("/usr/lib/cni/bridge"),
                command: v("ADD"),
                container_id: Some(v("c1")),
                netns: Some(v("/run/netns/x")),
                ifname: Some(v("eth0")),
                cni_args: None,
                env_scan_limited: false,
                env_scanned: 10,
                uid: 0,
                scan_variant: crate::kernel::events::EnvScanVariant::BpfLoop,
                nested_in: None,
            },
        };
        ledger.observe(&exec, t, &InodeNsid);
        ledger.observe(&KernelEvent::CniExit { task: task(11), exit: CniExit::from_wait_status(256) }, t, &InodeNsid);
        let mut gone = view(0, 1, 10, Some(12), Some("10.0.0.2"));
        gone.inode = None;
        let snapshot = ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(13),
            netns: vec![gone.into()],
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        };
        let obs = observations(&snapshot, &ledger, &[], Some(t(0)), None);
        let r = reservation_of_c1(t(10));
        let verdict = decide_one(&obs, &r, t(13), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::Orphaned, "{}", verdict.summary());
    }

    /// The indexed lookup finds what a walk over every netns finds, in the
    /// same order.
    #[test]
    fn incarnations_by_index_equal_a_walk_over_every_netns() {
        use proptest::prelude::*;
        fn walk(snapshot: &ModelSnapshot, inode: u64, nsid: Option<i32>, at: SystemTime) -> Vec<NetnsId> {
            let resolved = NetnsId::new(Some(inode), nsid, None);
            let ids: Vec<NetnsId> = snapshot
                .netns
                .iter()
                .filter(|v| v.id().may_be(&resolved))
                .map(|v| Life::of(v))
                .filter(|l| l.held_inode_at(at))
                .map(|l| l.id)
                .collect();
            if ids.is_empty() { vec![resolved] } else { ids }
        }
        let a_view = (prop::option::of(1u32..4), prop::option::of(1i32..4), 0u64..30, prop::option::of(0u64..30))
            .prop_map(|(inode, nsid, first, died)| {
                let mut v = view(inode.unwrap_or(1), nsid.unwrap_or(1), first, died, None);
                v.inode = inode;
                v.nsid = nsid;
                v
            });
        let cases = (prop::collection::vec(a_view, 0..8), 1u64..4, prop::option::of(1i32..4), 0u64..30);
        proptest!(ProptestConfig::with_cases(2000), |((netns, inode, nsid, at) in cases)| {
            let snapshot =
                ModelSnapshot {
                    sealed: SealedViews::NONE,
                    taken_at: t(40),
                    netns: netns.into_iter().map(std::sync::Arc::new).collect(),
                    host_routes: std::sync::Arc::default(),
                    stats: ModelStats::default(),
                };
            let index = Incarnations::new(&snapshot);
            prop_assert_eq!(index.at(inode, nsid, t(at)), walk(&snapshot, inode, nsid, t(at)));
            // The lookups the saved knowledge makes, against walks too.
            let id = NetnsId::new(Some(inode), nsid, None);
            let may_be: Vec<NetnsId> = index.may_be(id).map(NetnsView::id).collect();
            let walked: Vec<NetnsId> = snapshot.netns.iter().map(|v| v.id()).filter(|v| v.may_be(&id)).collect();
            prop_assert_eq!(may_be, walked);
            let all: Vec<NetnsId> = snapshot.netns.iter().map(|v| v.id()).collect();
            let mut exact: Vec<NetnsId> = index.exactly(&all[..all.len() / 2]).into_iter().map(NetnsView::id).collect();
            let mut expected: Vec<NetnsId> =
                snapshot.netns.iter().map(|v| v.id()).filter(|v| all[..all.len() / 2].contains(v)).collect();
            exact.dedup();
            expected.dedup();
            prop_assert_eq!(exact, expected);
        });
    }

    /// A death's containers, walked, are those the container index and the
    /// pass index give: deaths of netns known by inode, by nsid alone or by
    /// both, bindings with and without the run's nsid.
    #[test]
    fn a_deaths_containers_walked_equal_the_indexed_ones() {
        use proptest::prelude::*;
        let an_attachment = (
            (prop::option::of(1u64..4), prop::option::of(1i32..4)),
            prop::option::of(0u64..30),
            prop::option::of((prop::option::of(1u64..4), prop::option::of(1i32..4), prop::option::of(0u64..30))),
            prop::option::of(0usize..3),
        );
        let a_cache_entry = (0usize..6, prop::option::of(0usize..3));
        let cases = (
            prop::collection::vec(an_attachment, 0..6),
            prop::collection::vec(a_cache_entry, 0..4),
            (prop::option::of(1u32..4), prop::option::of(1i32..4), 0u64..30, 0u64..30),
            prop::collection::vec(0usize..3, 0..3),
        );
        let paths = ["/run/netns/a", "/run/netns/b", "/run/netns//a"];
        proptest!(ProptestConfig::with_cases(2000), |((attachments, cache, (inode, nsid, first, died), mounts) in cases)| {
            let mut ledger = Ledger::new();
            ledger.restore(
                // Distinct container IDs (c0, c1, ...): restore keeps each.
                attachments
                    .iter()
                    .enumerate()
                    .map(|(i, ((inode, nsid), bound_at, pinned, path))| crate::ledger::Attachment {
                        container_id: format!("c{i}"),
                        netns_path: path.map(|p| paths[p].to_owned()),
                        netns_inode: *inode,
                        netns_nsid: *nsid,
                        netns_bound_at: bound_at.map(t),
                        pinned: pinned.map(|(i, n, f)| NetnsId::new(i, n, f.map(t))),
                        died: None,
                        ifnames: Vec::new(),
                        operations: Vec::new(),
                        first_seen: t(0),
                        last_seen: t(0),
                    })
                    .collect(),
            );
            let cache: Vec<std::sync::Arc<CachedAttachment>> = cache
                .iter()
                .enumerate()
                .map(|(i, (owner, path))| {
                    std::sync::Arc::new(CachedAttachment {
                        path: PathBuf::from(format!("/cache/{i}")),
                        network: "n".into(),
                        container_id: format!("c{owner}"),
                        ifname: "eth0".into(),
                        netns: path.map(|p| paths[p].to_owned()),
                        ips: Vec::new(),
                        written_at: t(0),
                        inode: 1,
                    })
                })
                .collect();
            let death = NetnsDeath {
                inode,
                nsid,
                at: t(died),
                source: crate::model::snapshot::DeathSource::RtmDelnsid,
                addresses: Vec::new(),
                bind_mounts: mounts.iter().map(|&m| PathBuf::from(paths[m])).collect(),
                first_seen: t(first),
                creator: None,
            };
            let life = Life { id: death.id(), first_seen: death.first_seen, died_at: Some(death.at) };
            let walked = containers_walked(&ledger, &cache, &life, &death.bind_mounts);
            prop_assert_eq!(&walked, &containers_of_death(&ledger, &cache, &death));
            prop_assert_eq!(&walked, &containers_of_death_indexed(&ledger, &cache, &death));
            let snapshot = snapshot_with(dead_view(&death));
            let life = Life::of(&snapshot.netns[0]);
            let pass = PassIndex::new(&snapshot, &ledger, &cache).containers_of(&life, &death.bind_mounts);
            prop_assert_eq!(&walked, &pass);
        });
    }

    /// A snapshot of this one netns.
    fn snapshot_with(view: NetnsView) -> ModelSnapshot {
        ModelSnapshot {
            sealed: SealedViews::NONE,
            taken_at: t(40),
            netns: vec![std::sync::Arc::new(view)],
            host_routes: std::sync::Arc::default(),
            stats: ModelStats::default(),
        }
    }

    /// The model's view of the netns that died in `death`.
    fn dead_view(death: &NetnsDeath) -> NetnsView {
        let mut v = view(1, 1, 0, Some(0), None);
        (v.inode, v.nsid, v.first_seen, v.died_at) = (death.inode, death.nsid, death.first_seen, Some(death.at));
        v.bind_mounts.clone_from(&death.bind_mounts);
        v
    }

    /// A death of the netns the model knew as `inode` (None: by nsid alone)
    /// and `nsid`, first seen at `first_seen`, dead at `died`.
    fn death_of(inode: Option<u32>, nsid: i32, first_seen: u64, died: u64) -> NetnsDeath {
        NetnsDeath {
            inode,
            nsid: Some(nsid),
            at: t(died),
            source: crate::model::snapshot::DeathSource::RtmDelnsid,
            addresses: Vec::new(),
            bind_mounts: Vec::new(),
            first_seen: t(first_seen),
            creator: None,
        }
    }

    /// A ledger of these containers, each bound at a time (seconds of `t`)
    /// to the netns its CNI run resolved to an inode and maybe an nsid.
    fn bound(bindings: &[(&str, u64, Option<i32>, u64)]) -> Ledger {
        let mut ledger = Ledger::new();
        ledger.restore(
            bindings
                .iter()
                .map(|&(container, inode, nsid, bound_at)| crate::ledger::Attachment {
                    container_id: container.to_owned(),
                    netns_path: Some(format!("/run/netns/{container}")),
                    netns_inode: Some(inode),
                    netns_nsid: nsid,
                    netns_bound_at: Some(t(bound_at)),
                    pinned: None,
                    died: None,
                    ifnames: Vec::new(),
                    operations: Vec::new(),
                    first_seen: t(0),
                    last_seen: t(0),
                })
                .collect(),
        );
        ledger
    }

    /// The containers of `death` by each lookup: the walk, the ledger's
    /// binding index (the death's event and the ledger's marks), the
    /// container index (the whole node's observations) and the pass index
    /// (the death path's observations).
    fn containers_by_each_lookup(ledger: &Ledger, death: &NetnsDeath) -> [(&'static str, Vec<String>); 4] {
        let snapshot = snapshot_with(dead_view(death));
        let life = Life::of(&snapshot.netns[0]);
        [
            ("walked", containers_walked(ledger, &[], &life, &death.bind_mounts)),
            ("the ledger's index", containers_of_death(ledger, &[], death)),
            ("indexed", containers_of_death_indexed(ledger, &[], death)),
            ("pass index", PassIndex::new(&snapshot, ledger, &[]).containers_of(&life, &[])),
        ]
    }

    /// A netns deleted before the model read its mount is known by nsid
    /// alone. Its death names the containers whose CNI run resolved that
    /// nsid (as the decision does: `Incarnations::at`), not one whose run
    /// got no nsid (its inode alone cannot be matched to it).
    #[test]
    fn a_death_known_by_nsid_alone_names_the_containers_bound_by_that_nsid() {
        let ledger = bound(&[("c1", 77, Some(2), 10), ("c2", 77, None, 10), ("c3", 78, Some(3), 10)]);
        let death = death_of(None, 2, 10, 12);
        for (lookup, containers) in containers_by_each_lookup(&ledger, &death) {
            assert_eq!(containers, vec!["c1".to_owned()], "{lookup}");
        }
        let snapshot = snapshot_with(dead_view(&death));
        assert!(Incarnations::new(&snapshot).at(77, Some(2), t(10)).contains(&death.id()), "the decision agrees");
    }

    /// nsids are reused at once (the lowest free): a run that named nsid 2
    /// after its netns died, or before the model first saw that netns, was
    /// about another netns. Only the one bound while it held nsid 2 is
    /// named.
    #[test]
    fn an_nsid_names_a_death_only_while_its_netns_held_it() {
        let ledger = bound(&[("later", 77, Some(2), 25), ("earlier", 78, Some(2), 5), ("during", 79, Some(2), 15)]);
        for (lookup, containers) in containers_by_each_lookup(&ledger, &death_of(None, 2, 10, 20)) {
            assert_eq!(containers, vec!["during".to_owned()], "{lookup}");
        }
    }

    /// A netns whose inode the model knows is matched by inode only: a run
    /// that resolved another inode named another netns, even with the same
    /// nsid (reused).
    #[test]
    fn a_binding_to_another_inode_names_no_death_that_shared_its_nsid() {
        let ledger = bound(&[("other", 77, Some(2), 15), ("own", 88, Some(2), 15)]);
        for (lookup, containers) in containers_by_each_lookup(&ledger, &death_of(Some(88), 2, 10, 20)) {
            assert_eq!(containers, vec!["own".to_owned()], "{lookup}");
        }
    }

    /// The model forgets dead netns sooner than the ledger forgets their
    /// bindings. Once it has forgotten the netns c1's run resolved to, the
    /// ledger's mark of that death still names it: the inode's next holder
    /// neither keeps c1's reservation nor draws c1 into its own death's
    /// concern, as while the model knew the dead one. Without the mark (a
    /// death the agent never saw), the inode alone still keeps.
    #[test]
    fn a_binding_whose_dead_netns_the_model_forgot_still_names_that_netns() {
        use crate::engine::{Policy, Status, verdict::Fact};
        let mut ledger = bound(&[("c1", 77, Some(1), 10)]);
        let died = death_of(Some(77), 1, 5, 20);
        // The next holder: inode and nsid reused, first seen after the death.
        let next = view(77, 1, 30, None, Some("10.0.0.9"));
        let next_dies = crate::daemon::targeted::DeathKey { id: next.id(), paths: Vec::new(), addresses: Vec::new() };
        let forgot = snapshot_with(next);
        let r = reservation_of_c1(t(10));
        let policy = Policy::default();
        let verdict = |ledger: &Ledger, now: SystemTime| {
            decide_one(&observations(&forgot, ledger, &[], Some(t(0)), None), &r, now, &policy)
        };
        let concern = |ledger: &Ledger| {
            PassIndex::new(&forgot, ledger, &[]).death_concern(&[], std::slice::from_ref(&next_dies)).0
        };
        // Unmarked: the inode alone may be the live newcomer.
        assert_eq!(verdict(&ledger, t(40)).status, Status::InUse);
        assert!(concern(&ledger).contains("c1"));

        let containers = containers_of_death(&ledger, &[], &died);
        assert_eq!(containers, vec!["c1".to_owned()]);
        ledger.netns_died(&containers, (died.id(), died.at), |a| binding_resolved_to(&died, a));
        let obs = observations(&forgot, &ledger, &[], Some(t(0)), None);
        assert_eq!(obs.bindings[0].netns, NetnsName::Id(died.id()));
        assert!(obs.live[0].container_ids.is_empty(), "the newcomer is not c1's");
        let held = verdict(&ledger, t(40));
        assert_eq!(held.status, Status::Pending, "{}", held.summary());
        assert!(held.evidence.iter().any(|e| matches!(e.fact, Fact::UnresolvedBinding { .. })), "{}", held.summary());
        let late = t(10) + policy.orphan_grace + Duration::from_secs(1);
        assert_eq!(verdict(&ledger, late).status, Status::Orphaned, "the grace decides");
        assert!(!concern(&ledger).contains("c1"), "the newcomer's death is not c1's");
    }

    /// The mark names the dead netns only for a binding its own run
    /// resolved to it: not a run of another nsid on the same inode, nor one
    /// bound before the dead netns was first seen.
    #[test]
    fn a_death_marks_with_its_netns_only_the_bindings_resolved_to_it() {
        let died = death_of(Some(77), 1, 5, 20);
        let ledger = bound(&[("own", 77, Some(1), 10), ("other-nsid", 77, Some(2), 10), ("before", 77, Some(1), 2)]);
        let resolved: Vec<&str> = ["own", "other-nsid", "before"]
            .into_iter()
            .filter(|c| ledger.get(c).is_some_and(|a| binding_resolved_to(&died, a)))
            .collect();
        assert_eq!(resolved, vec!["own"]);
        // A mark that disagrees with the run's resolution is not used.
        let mut marked = ledger.get("other-nsid").cloned().unwrap();
        marked.died = Some(crate::ledger::BindingDeath { incarnation: Some((died.id(), died.at)) });
        assert_eq!(dead_incarnation(&marked), None);
        let forgot = snapshot_with(view(90, 9, 30, None, None));
        assert_eq!(Incarnations::new(&forgot).of_binding(&marked), vec![NetnsId::new(Some(77), Some(2), None)]);
    }

    /// The death path spares resolving a run bound before every death was
    /// first seen only when what it names was first seen before them too: a
    /// mark (however it came) naming a netns first seen later is resolved,
    /// and may be the death.
    #[test]
    fn a_mark_naming_a_later_netns_is_not_spared_by_the_death_path() {
        let late = death_of(Some(77), 1, 20, 25);
        let mut a = bound(&[("c1", 77, Some(1), 2)]).get("c1").cloned().unwrap();
        a.died = Some(crate::ledger::BindingDeath { incarnation: Some((late.id(), late.at)) });
        let mut ledger = Ledger::new();
        ledger.restore(vec![a]);
        let forgot = snapshot_with(view(90, 9, 30, None, None));
        let key = crate::daemon::targeted::DeathKey::from(&late);
        let (containers, _) = PassIndex::new(&forgot, &ledger, &[]).death_concern(&[], &[key]);
        assert!(containers.contains("c1"));
    }

    /// Random nodes (netns, ledger, cache, deaths) over small alphabets, so
    /// that identities, paths, containers and IPs meet often.
    mod concern {
        use proptest::prelude::*;

        use super::*;
        use crate::{
            daemon::targeted::{DeathKey, concerned_in_sources, concerned_keys},
            engine::{Policy, decide},
            ledger::CniOperation,
        };

        const PATHS: [&str; 3] = ["/run/netns/a", "/var/run/netns/b", "/run/netns/b"];
        const CIDS: [&str; 6] = ["c0", "c1", "c2", "c3", "c4", "c5"];

        fn ip(n: u8) -> IpAddr {
            IpAddr::from([10, 0, 0, n])
        }

        fn a_view() -> impl Strategy<Value = NetnsView> {
            (
                (prop::option::of(1u32..4), prop::option::of(1i32..4)),
                0u64..30,
                prop::option::of(0u64..30),
                prop::option::of(1u8..4),
                prop::collection::vec(0usize..3, 0..2),
            )
                .prop_map(|((inode, nsid), first, died, addr, mounts)| {
                    let mut v = view(inode.unwrap_or(1), nsid.unwrap_or(1), first, died, None);
                    v.inode = inode;
                    v.nsid = nsid;
                    if let Some(n) = addr {
                        v.addresses.push(AddressView {
                            ip: ip(n),
                            prefix_len: 24,
                            ifindex: 2,
                            ifname: Some("eth0".into()),
                            scope: AddrScope::from_raw(0),
                        });
                    }
                    v.bind_mounts = mounts.into_iter().map(|m| PathBuf::from(PATHS[m])).collect();
                    v
                })
        }

        fn an_op() -> impl Strategy<Value = CniOperation> {
            (0u64..30, prop::option::of(0u64..30), any::<bool>()).prop_map(|(started, finished, truncated)| {
                CniOperation {
                    command: "ADD".into(),
                    plugin: "bridge".into(),
                    pid: 1,
                    started_at: t(started),
                    started_ktime_ns: 0,
                    finished_at: finished.map(t),
                    exit: None,
                    exit_unobserved: false,
                    ifname: None,
                    netns_path: None,
                    truncated,
                }
            })
        }

        /// An attachment: netns inode, nsid, bound at, pinned, path, runs,
        /// and the death the kernel reported for its binding (with the
        /// incarnation, or without).
        type AttachmentCase = (
            Option<u64>,
            Option<i32>,
            Option<u64>,
            Option<NetnsId>,
            Option<usize>,
            Vec<CniOperation>,
            Option<crate::ledger::BindingDeath>,
        );

        fn an_id() -> impl Strategy<Value = NetnsId> {
            (prop::option::of(1u64..4), prop::option::of(1i32..4), prop::option::of(0u64..30))
                .prop_map(|(i, n, f)| NetnsId::new(i, n, f.map(t)))
        }

        fn an_attachment() -> impl Strategy<Value = AttachmentCase> {
            (
                prop::option::of(1u64..4),
                prop::option::of(1i32..4),
                prop::option::of(0u64..30),
                prop::option::of(an_id()),
                prop::option::of(0usize..3),
                prop::collection::vec(an_op(), 0..2),
                prop::option::of(prop::option::of((an_id(), 0u64..30))).prop_map(|died| {
                    died.map(|d| crate::ledger::BindingDeath { incarnation: d.map(|(id, at)| (id, t(at))) })
                }),
            )
        }

        /// Ledger attachments of c0, c1, ... (a truncated run names a prefix: "c").
        fn ledger_of(attachments: &[AttachmentCase]) -> Ledger {
            let mut ledger = Ledger::new();
            ledger.restore(
                attachments
                    .iter()
                    .enumerate()
                    .map(|(i, (inode, nsid, bound_at, pinned, path, ops, died))| crate::ledger::Attachment {
                        container_id: if ops.iter().any(|o| o.truncated) { "c".to_owned() } else { CIDS[i].to_owned() },
                        netns_path: path.map(|p| PATHS[p].to_owned()),
                        netns_inode: *inode,
                        netns_nsid: *nsid,
                        netns_bound_at: bound_at.map(t),
                        pinned: *pinned,
                        died: *died,
                        ifnames: Vec::new(),
                        operations: ops.clone(),
                        first_seen: t(0),
                        last_seen: t(0),
                    })
                    .collect(),
            );
            ledger
        }

        fn a_death() -> impl Strategy<Value = DeathKey> {
            (
                prop::option::of(1u64..4),
                prop::option::of(1i32..4),
                prop::collection::vec(0usize..3, 0..2),
                prop::option::of(1u8..4),
                prop::option::of(0u64..30),
            )
                .prop_map(|(inode, nsid, mounts, addr, first_seen)| DeathKey {
                    // A death the model saw names when it first saw the netns.
                    id: NetnsId::new(inode, nsid, first_seen.map(t)),
                    paths: mounts.into_iter().map(|m| PathBuf::from(PATHS[m])).collect(),
                    addresses: addr.map(ip).into_iter().collect(),
                })
        }

        fn a_node()
        -> impl Strategy<Value = (Vec<NetnsView>, Ledger, Vec<std::sync::Arc<CachedAttachment>>, Vec<DeadNetns>)>
        {
            (
                prop::collection::vec(a_view(), 0..7),
                prop::collection::vec(an_attachment(), 0..6),
                prop::collection::vec((0usize..6, prop::option::of(0usize..3), 0u64..30), 0..4),
                prop::collection::vec((0usize..6, prop::option::of(1u8..4), prop::option::of(1u64..4), 0u64..30), 0..2),
            )
                .prop_map(|(views, attachments, cache, extra)| {
                    let cache = cache
                        .into_iter()
                        .enumerate()
                        .map(|(i, (owner, path, written))| {
                            std::sync::Arc::new(CachedAttachment {
                                path: PathBuf::from(format!("/cache/{i}")),
                                network: "n".into(),
                                container_id: CIDS[owner].to_owned(),
                                ifname: "eth0".into(),
                                netns: path.map(|p| PATHS[p].to_owned()),
                                ips: Vec::new(),
                                written_at: t(written),
                                inode: 1,
                            })
                        })
                        .collect();
                    let extra = extra
                        .into_iter()
                        .map(|(owner, addr, inode, died)| DeadNetns {
                            id: NetnsId::new(inode, None, None),
                            died_at: t(died),
                            container_ids: vec![CIDS[owner].to_owned()],
                            addresses: addr.map(ip).into_iter().collect(),
                            paths: Vec::new(),
                        })
                        .collect();
                    (views, ledger_of(&attachments), cache, extra)
                })
        }

        /// The views as the model shows them: the last half sealed (as it
        /// seals the dead), in chunks of two after a view forgotten since (a
        /// copy of the first, which must not be found), the rest not.
        fn snapshot_of(views: Vec<NetnsView>) -> ModelSnapshot {
            let netns: Vec<std::sync::Arc<NetnsView>> = views.into_iter().map(std::sync::Arc::new).collect();
            let start = netns.len() / 2;
            let forgotten = netns.first().map(|v| v.as_ref().clone());
            let run: Vec<&NetnsView> = forgotten.iter().chain(netns[start..].iter().map(AsRef::as_ref)).collect();
            let chunks = run.chunks(2).map(|c| std::sync::Arc::new(SealedChunk::new(c.iter().copied()))).collect();
            let sealed = SealedViews::new(chunks, start, usize::from(forgotten.is_some())).expect("skip inside chunk");
            assert_eq!(sealed.covered(), start..netns.len());
            ModelSnapshot {
                sealed,
                taken_at: t(40),
                netns,
                host_routes: std::sync::Arc::default(),
                stats: ModelStats::default(),
            }
        }

        /// Container `CIDS[c]`'s reservation of IP `n` in `network`, made at `at`.
        fn reservation_of(network: &str, c: usize, n: u8, at: u64) -> Reservation {
            Reservation::from(ReservationData {
                store: StoreRef::HostLocal { data_dir: "/d".into() }.into(),
                network: network.into(),
                ip: ip(n),
                container_id: CIDS[c].into(),
                ifname: Some("eth0".into()),
                created_at: t(at),
                path: format!("/d/{network}/{}", ip(n)).into(),
                inode: 1,
            })
        }

        fn with_extra(mut obs: Observations, extra: &[DeadNetns]) -> Observations {
            obs.dead.extend(extra.iter().cloned());
            obs
        }

        /// A live netns a container is bound to by inode alone (the run's
        /// nsid is another's): the model's binding keeps its reservation.
        #[test]
        fn a_netns_bound_by_inode_alone_is_in_the_concern() {
            let views = vec![view(1, 2, 0, None, None)];
            let ledger = ledger_of(&[(Some(1), Some(3), Some(10), None, None, Vec::new(), None)]);
            let snapshot = snapshot_of(views);
            let concern = Concern {
                containers: ["c0".to_owned()].into_iter().collect(),
                ips: [ip(1)].into_iter().collect(),
                sandbox_paths: Vec::new(),
            };
            let full = observations(&snapshot, &ledger, &[], Some(t(0)), None);
            let part = observations_in(&snapshot, &ledger, &[], Some(t(0)), None, Scope::Concerning(&concern));
            assert_eq!(full.live[0].container_ids, vec!["c0".to_owned()]);
            assert_eq!(part.live, full.live);
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(3000))]

            /// The lookup a death's concern spares never held an
            /// incarnation that may be the dead netns.
            #[test]
            fn a_spared_resolution_names_no_dead_netns(
                views in prop::collection::vec(a_view(), 0..7),
                attachment in an_attachment(),
                (inode, at) in (1u64..4, 0u64..30),
                dead in (prop::option::of(1u64..4), prop::option::of(1i32..4)),
            ) {
                let snapshot = snapshot_of(views);
                // The run resolved `inode` at `at`.
                let mut attachment = attachment;
                (attachment.0, attachment.2) = (Some(inode), Some(at));
                let ledger = ledger_of(&[attachment]);
                let Some(a) = ledger.attachments().next() else { unreachable!("one attachment") };
                let dead = NetnsId::new(dead.0, dead.1, None);
                let named = Incarnations::new(&snapshot).of_binding(a).iter().any(|id| id.may_be(&dead));
                prop_assert!(!named || resolution_may_name(inode, a.netns_nsid, &dead));
            }

            /// A netns's containers are matched to ledger bindings as the
            /// decision resolves those bindings ([`Incarnations::of_binding`]):
            /// every binding resolved to an incarnation names its container
            /// there, and one known by nsid alone is named by no other
            /// binding (its nsid, held at the run, is all that ties them).
            #[test]
            fn a_netns_names_the_containers_whose_bindings_resolve_to_it(
                (views, ledger, _cache, _extra) in a_node(),
            ) {
                let snapshot = snapshot_of(views);
                let incarnations = Incarnations::new(&snapshot);
                for view in &snapshot.netns {
                    let life = Life::of(view);
                    // Twins (same identity, other death) are one name to `at`.
                    if snapshot.netns.iter().filter(|v| v.id() == life.id).count() > 1 {
                        continue;
                    }
                    for a in ledger.attachments().filter(|a| a.pinned.is_none()) {
                        let (Some(inode), Some(bound_at)) = (a.netns_inode, a.netns_bound_at) else { continue };
                        let resolved = incarnations.at(inode, a.netns_nsid, bound_at).contains(&life.id);
                        prop_assert!(!resolved || life.names(a), "{a:?} resolves to {:?}", life.id);
                        if view.inode.is_none() {
                            prop_assert_eq!(life.names(a), resolved, "{:?} {:?}", a, life.id);
                        }
                    }
                }
            }

            /// The death path's concern, found in the sources, is what the
            /// whole node's observations give.
            #[test]
            fn a_deaths_concern_from_the_sources_is_the_one_the_observations_give(
                (views, ledger, cache, extra) in a_node(),
                deaths in prop::collection::vec(a_death(), 1..3),
            ) {
                let snapshot = snapshot_of(views);
                let full = with_extra(observations(&snapshot, &ledger, &cache, Some(t(0)), None), &extra);
                let expected = concerned_keys(&full, &deaths);
                prop_assert_eq!(concerned_in_sources(&snapshot, &ledger, &cache, &extra, &deaths), expected);
            }

            /// Observations for a concern give its reservations the verdicts
            /// (status and evidence) the whole node's observations give.
            #[test]
            fn observations_for_a_concern_give_its_verdicts(
                (views, ledger, cache, extra) in a_node(),
                containers in prop::collection::hash_set(0usize..6, 0..4),
                ips in prop::collection::hash_set(1u8..5, 0..3),
                reserved in prop::collection::vec((0usize..6, 1u8..5, 0u64..30), 0..6),
                watching in prop::option::of(0u64..30),
                now in 0u64..60,
            ) {
                let snapshot = snapshot_of(views);
                let first_seen: FirstSeen = cache.iter().map(|e| (e.path.clone(), t(5))).collect();
                let concern = Concern {
                    containers: containers.iter().map(|&c| CIDS[c].to_owned()).collect(),
                    ips: ips.iter().map(|&n| ip(n)).collect(),
                    sandbox_paths: Vec::new(),
                };
                let watching = watching.map(t);
                let full = with_extra(observations(&snapshot, &ledger, &cache, watching, Some(&first_seen)), &extra);
                let part = with_extra(
                    observations_in(&snapshot, &ledger, &cache, watching, Some(&first_seen), Scope::Concerning(&concern)),
                    &extra,
                );
                let judged: Vec<Reservation> = reserved
                    .iter()
                    .filter(|(c, n, _)| concern.containers.contains(CIDS[*c]) && concern.ips.contains(&ip(*n)))
                    .map(|&(c, n, at)| reservation_of("n", c, n, at))
                    .collect();
                let policy = Policy::default();
                let expected = decide(&full, &judged, t(now), &policy);
                prop_assert_eq!(decide(&part, &judged, t(now), &policy), expected);
                prop_assert!(part.live.len() <= full.live.len() && part.dead.len() <= full.dead.len());
                // Whatever ties a netns to the concern brings it in whole.
                let tied = |containers: &[String], addresses: &[IpAddr]| {
                    containers.iter().any(|c| concern.containers.contains(c))
                        || addresses.iter().any(|a| concern.ips.contains(a))
                };
                for n in full.live.iter().filter(|n| tied(&n.container_ids, &n.addresses)) {
                    prop_assert!(part.live.contains(n), "{n:?} left out");
                }
                for n in full.dead.iter().filter(|n| tied(&n.container_ids, &n.addresses)) {
                    prop_assert!(part.dead.contains(n), "{n:?} left out");
                }
            }

            /// A full pass's observations, built for every reservation and
            /// every sandbox the runtime lists ([`Concern::of_reservations`])
            /// rather than for every netns, run and cache entry of the node,
            /// give every reservation the whole node's verdict, and the same
            /// stuck sandboxes.
            #[test]
            fn observations_for_every_reservation_give_the_whole_nodes_verdicts(
                (views, ledger, cache, extra) in a_node(),
                reserved in prop::collection::vec((0usize..6, 1u8..5, 0u64..30), 0..6),
                sandboxes in prop::collection::vec(
                    (0usize..6, any::<bool>(), prop::option::of(0usize..3), prop::option::of(any::<bool>())),
                    0..4,
                ),
                listed in any::<bool>(),
                watching in prop::option::of(0u64..30),
                now in 0u64..60,
            ) {
                use crate::engine::{RuntimeSandbox, RuntimeView, SandboxState, runtime::stuck_sandboxes};
                let snapshot = snapshot_of(views);
                let first_seen: FirstSeen = cache.iter().map(|e| (e.path.clone(), t(5))).collect();
                let runtime = listed.then(|| RuntimeView {
                    runtime: "test".into(),
                    listed_at: t(20),
                    sandboxes: sandboxes
                        .iter()
                        .map(|&(c, ready, path, closed)| {
                            let sandbox = RuntimeSandbox {
                                id: CIDS[c].to_owned(),
                                state: if ready { SandboxState::Ready } else { SandboxState::NotReady },
                                pod: None,
                                netns: path.map(|p| PathBuf::from(PATHS[p])),
                                netns_closed: closed,
                            };
                            (CIDS[c].to_owned(), sandbox)
                        })
                        .collect(),
                    networks: None,
                    departed: std::collections::BTreeMap::new(),
                });
                let reservations: Vec<Reservation> = reserved
                    .iter()
                    .enumerate()
                    .map(|(i, &(c, n, at))| reservation_of(&format!("n{i}"), c, n, at))
                    .collect();
                let watching = watching.map(t);
                let completed = |mut obs: Observations| {
                    obs.dead.extend(extra.iter().cloned());
                    obs.set_runtime(runtime.clone());
                    obs
                };
                let full = completed(observations(&snapshot, &ledger, &cache, watching, Some(&first_seen)));
                let concern = Concern::of_reservations(&reservations, runtime.as_ref()).with_sandboxes(runtime.as_ref());
                let part = completed(observations_in(
                    &snapshot, &ledger, &cache, watching, Some(&first_seen), Scope::Concerning(&concern),
                ));
                let policy = Policy::default();
                prop_assert_eq!(
                    decide(&part, &reservations, t(now), &policy),
                    decide(&full, &reservations, t(now), &policy)
                );
                prop_assert_eq!(stuck_sandboxes(&part), stuck_sandboxes(&full));
            }

            /// The pass index's answers are exactly the walks': a death's
            /// concern (containers and IPs), a concern's observations (every
            /// entry, in order) and each dead netns's containers, whether its
            /// maps answer or its own walks do.
            #[test]
            fn the_pass_index_answers_exactly_as_the_walks(
                (views, ledger, cache, extra) in a_node(),
                deaths in prop::collection::vec(a_death(), 1..3),
                of_views in prop::collection::vec(0usize..7, 0..2),
                containers in prop::collection::hash_set(0usize..6, 0..4),
                ips in prop::collection::hash_set(1u8..5, 0..3),
                sandboxes in prop::collection::vec(0usize..3, 0..2),
                walks in prop::sample::select(vec![0_u32, 1, 2, 3, u32::MAX]),
            ) {
                // Deaths of the snapshot's own netns too, as the model sends them.
                let mut deaths = deaths;
                deaths.extend(of_views.iter().filter_map(|&i| views.get(i)).map(|v| DeathKey {
                    id: v.id(),
                    paths: v.bind_mounts.clone(),
                    addresses: v.addresses.iter().map(|a| a.ip).collect(),
                }));
                let snapshot = snapshot_of(views);
                // Its maps filed at once, never, or after a few walks.
                let index = PassIndex::new(&snapshot, &ledger, &cache).with_walks_before_filing(walks);
                let walked = death_concern(
                    &snapshot,
                    &ledger,
                    &cache,
                    &extra,
                    &deaths.iter().map(|d| d.id).collect::<Vec<_>>(),
                    |id, paths| deaths.iter().any(|d| d.is(id, paths)),
                    |name| deaths.iter().any(|d| d.may_name(name)),
                );
                prop_assert_eq!(index.death_concern(&extra, &deaths), walked);
                let first_seen: FirstSeen = cache.iter().map(|e| (e.path.clone(), t(5))).collect();
                let concern = Concern {
                    containers: containers.iter().map(|&c| CIDS[c].to_owned()).collect(),
                    ips: ips.iter().map(|&n| ip(n)).collect(),
                    sandbox_paths: sandboxes.into_iter().map(|p| PathBuf::from(PATHS[p])).collect(),
                };
                let scope = Scope::Concerning(&concern);
                let walked = observations_walked(&snapshot, &ledger, &cache, Some(t(3)), Some(&first_seen), scope);
                prop_assert_eq!(index.observations(Some(t(3)), Some(&first_seen), &concern), walked);
                for view in &snapshot.netns {
                    let life = Life::of(view);
                    prop_assert_eq!(
                        index.containers_of(&life, &view.bind_mounts),
                        containers_walked(&ledger, &cache, &life, &view.bind_mounts)
                    );
                }
            }

            /// The runs for a concern are the whole node's runs it wants,
            /// each asked on its own (as before the answer was kept per
            /// attachment), in the same order; the unattributed ones always.
            #[test]
            fn runs_for_a_concern_are_the_runs_it_wants(
                (_views, ledger, _cache, _extra) in a_node(),
                containers in prop::collection::hash_set(0usize..6, 0..4),
            ) {
                let concern = Concern {
                    containers: containers.iter().map(|&c| CIDS[c].to_owned()).collect(),
                    ips: HashSet::new(),
                    sandbox_paths: Vec::new(),
                };
                let expected: Vec<CniOp> = cni_ops_in(&ledger, Scope::All)
                    .into_iter()
                    .filter(|op| op.container_id.as_ref().is_none_or(|id| concern.wants_run(id, op.container_id_truncated)))
                    .collect();
                prop_assert_eq!(cni_ops_in(&ledger, Scope::Concerning(&concern)), expected);
            }
        }
    }
}
