//! The netns registry: every network namespace the kernel has shown the
//! model (the agent's own and one record per other netns), with its links,
//! addresses and host routes, and what discovery saw of it. It creates,
//! binds and removes records and applies what netlink says about them; it
//! never decides that a netns died (the router does, on the kernel's word)
//! nor when to ask the kernel anything.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    time::{Duration, SystemTime},
};

use tracing::debug;

use crate::{fast::Map, ipam::SharedStr};

use super::{
    super::snapshot::{Corrections, Creator, DeathSource, HardwareAddr, ModelStats, NetnsInode},
    age,
    records::{Entry, LinkNetns, LinkState, Netns, NetnsKey, RecordId, Table, addr_key, is_host_route, route_key},
    view::Changes,
};
use crate::{
    discovery::{Scope, Sighting},
    kernel::events::{NetnsVia, Task},
    netlink::wire::{Link, Message},
};

/// Who sent a notification, in the registry's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    Host,
    Record(RecordId),
    /// An nsid no record holds yet.
    Unknown(i32),
}

/// What binding an inode to an nsid takes, decided before anything
/// changes: records it supersedes die first (their death notices describe
/// them as they were), then the binding is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum BindPlan {
    /// The record already has this inode and nsid.
    Known(RecordId),
    /// A record known only by this nsid gets the inode; `superseded`
    /// held the inode before (an older netns whose inode was reused).
    Attach { record: RecordId, superseded: Option<RecordId> },
    /// A new record, after the records that held the nsid or the inode
    /// die. `nsid_was_free`: no record held the nsid (a netns no event
    /// had announced).
    Create { superseded: Vec<RecordId>, nsid_was_free: bool },
}

/// What a notification changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Applied {
    /// The entry it showed present.
    pub(super) shown: Option<Entry>,
    /// Its netns should be dumped to learn where a link's peer lives.
    pub(super) needs_link_dump: bool,
}

/// The netns a link names as its other end's, as its message says: its
/// own (`LinkNetns::Same`), or an nsid in the agent's numbering. A link
/// that names neither (`LinkNetns::Unverified`) places nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Named {
    Netns(NetnsKey),
    Nsid(i32),
}

impl Named {
    fn of(owner: NetnsKey, l: &LinkState) -> Option<Self> {
        match l.link_netns {
            LinkNetns::Same => Some(Self::Netns(owner)),
            LinkNetns::Nsid(n) => Some(Self::Nsid(n)),
            LinkNetns::Unverified => None,
        }
    }
}

/// Every link of the node that names another end, filed by that end:
/// (peer ifindex, the netns it is named in, the link's netns, the link's
/// ifindex). Placing a link from its other end is then a look-up, not a
/// search of every link: every pod's `eth0` is ifindex 2, and every host
/// veth names an ifindex 2.
#[derive(Debug, Default, PartialEq, Eq)]
struct PeerIndex(BTreeSet<Filed>);

/// A link in the [`PeerIndex`].
type Filed = (u32, Named, NetnsKey, u32);

impl PeerIndex {
    /// How link `ifindex` of `owner` is filed, if it names another end.
    fn filed(owner: NetnsKey, ifindex: u32, l: &LinkState) -> Option<Filed> {
        Some((l.link?, Named::of(owner, l)?, owner, ifindex))
    }

    fn take(&mut self, owner: NetnsKey, ifindex: u32, l: &LinkState) {
        if let Some(f) = Self::filed(owner, ifindex, l) {
            self.0.remove(&f);
        }
    }

    /// A link filed as `old` is filed as `new` now.
    fn replace(&mut self, old: Option<Filed>, new: Option<Filed>) {
        if old != new {
            if let Some(f) = old {
                self.0.remove(&f);
            }
            self.0.extend(new);
        }
    }

    /// A record's links, gone with it.
    fn forget(&mut self, owner: NetnsKey, rec: &Netns) {
        rec.links.iter().for_each(|(&i, l)| self.take(owner, i, l));
    }

    /// The links that name `(named, peer)` as their other end.
    fn naming(&self, peer: u32, named: Named) -> impl Iterator<Item = (NetnsKey, u32)> + '_ {
        let from = (peer, named, NetnsKey::Host, 0);
        let to = (peer, named, NetnsKey::Record(RecordId::MAX), u32::MAX);
        self.0.range(from..=to).map(|&(_, _, owner, ifindex)| (owner, ifindex))
    }
}

/// The registry's counters, for the model's statistics.
#[derive(Debug, Clone, Copy, Default)]
struct RegistryCounts {
    deaths: u64,
    nsids_assigned: u64,
    corrections: Corrections,
}

/// Every netns the model knows alive, by record id, nsid and inode.
pub(super) struct Registry {
    host: Netns,
    live: Map<RecordId, Netns>,
    /// The live records in snapshot order: by first sight (which never
    /// changes), then id.
    by_first_sight: BTreeSet<(SystemTime, RecordId)>,
    by_nsid: Map<i32, RecordId>,
    by_inode: Map<NetnsInode, RecordId>,
    /// What the latest scans found, by inode.
    sightings: BTreeMap<NetnsInode, Sighting>,
    /// Creators the probes named for netns not bound yet.
    pending_creators: Map<NetnsInode, Creator>,
    next_id: RecordId,
    /// What changed since the views were last brought up to date.
    changes: Changes,
    /// The links of the node by the other end they name.
    peers: PeerIndex,
    /// Advances at each creation and each dump start, to tell which records
    /// a dump can judge.
    epoch: u64,
    counts: RegistryCounts,
}

impl Registry {
    pub(super) fn new(host_inode: NetnsInode, now: SystemTime) -> Self {
        Self {
            host: Netns::new(Some(host_inode), None, now, 0),
            live: Map::default(),
            by_first_sight: BTreeSet::new(),
            by_nsid: Map::default(),
            by_inode: Map::default(),
            sightings: BTreeMap::new(),
            pending_creators: Map::default(),
            next_id: 1,
            changes: Changes::default(),
            peers: PeerIndex::default(),
            epoch: 1,
            counts: RegistryCounts::default(),
        }
    }

    // ---- reading ---------------------------------------------------------

    /// Adds the registry's counters to `stats`.
    pub(super) fn count_into(&self, stats: &mut ModelStats) {
        let RegistryCounts { deaths, nsids_assigned, corrections } = self.counts;
        stats.deaths = deaths;
        stats.nsids_assigned = nsids_assigned;
        stats.corrections = corrections;
    }

    pub(super) fn host(&self) -> &Netns {
        &self.host
    }

    /// The links that name link `ifindex` of `key` as their other end
    /// (whatever their order among the node's links): those of `key` that
    /// name it in their own netns, and those that name it by the nsid the
    /// agent knows `key` by.
    pub(super) fn naming(&self, key: NetnsKey, ifindex: u32) -> impl Iterator<Item = (NetnsKey, u32)> + '_ {
        // A record's nsid is the one it was created with, and the nsid map
        // only ever files a record under that one.
        let nsid = match key {
            NetnsKey::Host => self.host.nsid.filter(|n| !self.by_nsid.contains_key(n)),
            NetnsKey::Record(id) => self.nsid(id).filter(|n| self.by_nsid.get(n) == Some(&id)),
        };
        self.peers
            .naming(ifindex, Named::Netns(key))
            .chain(nsid.into_iter().flat_map(move |n| self.peers.naming(ifindex, Named::Nsid(n))))
    }

    /// The indexes, filed again from every record and link (tests).
    #[cfg(test)]
    pub(super) fn assert_indexes(&self) {
        let order: BTreeSet<(SystemTime, RecordId)> = self.live.iter().map(|(&id, r)| (r.first_seen, id)).collect();
        assert_eq!(self.by_first_sight, order, "live records by first sight");
        let mut filed = PeerIndex::default();
        std::iter::once((NetnsKey::Host, &self.host))
            .chain(self.live.iter().map(|(&id, r)| (NetnsKey::Record(id), r)))
            .for_each(|(key, ns)| filed.0.extend(ns.links.iter().filter_map(|(&i, l)| PeerIndex::filed(key, i, l))));
        assert_eq!(self.peers, filed, "links by the other end they name");
    }

    /// Live records, in no particular order.
    pub(super) fn records(&self) -> impl Iterator<Item = (RecordId, &Netns)> {
        self.live.iter().map(|(&id, r)| (id, r))
    }

    /// Live records in snapshot order: by first sight, then id.
    pub(super) fn records_in_order(&self) -> impl Iterator<Item = (RecordId, &Netns)> {
        self.by_first_sight.iter().filter_map(|&(_, id)| self.live.get(&id).map(|r| (id, r)))
    }

    pub(super) fn record(&self, id: RecordId) -> Option<&Netns> {
        self.live.get(&id)
    }

    /// Live record ids, oldest first.
    pub(super) fn record_ids(&self) -> Vec<RecordId> {
        let mut ids: Vec<RecordId> = self.live.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    pub(super) fn len(&self) -> usize {
        self.live.len()
    }

    pub(super) fn sighting(&self, inode: NetnsInode) -> Option<&Sighting> {
        self.sightings.get(&inode)
    }

    pub(super) fn is_host_inode(&self, inode: NetnsInode) -> bool {
        self.host.inode == Some(inode)
    }

    pub(super) fn host_nsid(&self) -> Option<i32> {
        self.host.nsid
    }

    pub(super) fn by_nsid(&self, nsid: i32) -> Option<RecordId> {
        self.by_nsid.get(&nsid).copied()
    }

    pub(super) fn by_inode(&self, inode: NetnsInode) -> Option<RecordId> {
        self.by_inode.get(&inode).copied()
    }

    /// Every inode the registry knows alive, the agent's own included.
    pub(super) fn known_inodes(&self) -> HashSet<NetnsInode> {
        self.by_inode.keys().copied().chain(self.host.inode).collect()
    }

    /// Some record is known only by its nsid.
    pub(super) fn any_without_inode(&self) -> bool {
        self.live.values().any(|r| r.inode.is_none())
    }

    /// Record `id` is alive and still the netns that had `nsid` (not a
    /// later one after the record died and the nsid went to another).
    pub(super) fn holds_nsid(&self, id: RecordId, nsid: Option<i32>) -> bool {
        self.live.get(&id).is_some_and(|r| r.nsid == nsid)
    }

    pub(super) fn nsid(&self, id: RecordId) -> Option<i32> {
        self.live.get(&id).and_then(|r| r.nsid)
    }

    /// Record `id` has a link whose peer only a dump of its links can
    /// place: its own message names the peer in the record's frame, and no
    /// host link names it back. A veth pair names each other, and the host
    /// side's message is in our frame, so the pod side of a pod's veth is
    /// placed by it (as the views place it) without a dump.
    pub(super) fn has_unplaced_peer(&self, id: RecordId) -> bool {
        let Some(rec) = self.live.get(&id) else {
            return false;
        };
        let Some(nsid) = rec.nsid else {
            return true;
        };
        rec.links.iter().any(|(&ifindex, l)| match (l.link, l.link_netns) {
            (Some(peer), LinkNetns::Unverified) => !self
                .host
                .links
                .get(&peer)
                .is_some_and(|h| h.link == Some(ifindex) && h.link_netns == LinkNetns::Nsid(nsid)),
            _ => false,
        })
    }

    /// The record `__put_net` of `inode` at `freed_at` is about: the one
    /// holding the inode, if it was first seen before. A late record of an
    /// earlier netns with the same inode (reused at once) predates the
    /// current one's first sight.
    pub(super) fn freed(&self, inode: NetnsInode, freed_at: SystemTime) -> Option<RecordId> {
        let id = self.by_inode(inode)?;
        if self.live.get(&id).is_some_and(|r| freed_at >= r.first_seen) {
            return Some(id);
        }
        debug!(inode, "__put_net of an earlier netns with a reused inode: ignored");
        None
    }

    pub(super) fn last_alive(&self, id: RecordId) -> Option<SystemTime> {
        self.live.get(&id).map(|r| r.last_alive)
    }

    /// Who sent a datagram whose `NETLINK_LISTEN_ALL_NSID` control message
    /// said `origin_nsid`.
    pub(super) fn origin(&self, origin_nsid: Option<i32>) -> Origin {
        match origin_nsid {
            None => Origin::Host,
            Some(n) if Some(n) == self.host.nsid => Origin::Host,
            Some(n) => self.by_nsid.get(&n).map_or(Origin::Unknown(n), |&id| Origin::Record(id)),
        }
    }

    /// What binding `inode` to `nsid` takes (see [`BindPlan`]).
    pub(super) fn plan_bind(&self, inode: NetnsInode, nsid: i32) -> BindPlan {
        let holder = self.by_nsid(nsid);
        let by_inode = self.by_inode(inode);
        match holder {
            Some(id) if by_inode == Some(id) => BindPlan::Known(id),
            // One live netns has one nsid: another record claiming this
            // inode is an older netns whose inode was reused.
            Some(id) if self.live.get(&id).is_some_and(|r| r.inode.is_none()) => {
                BindPlan::Attach { record: id, superseded: by_inode }
            }
            // nsid reused: its previous holder died unannounced.
            Some(id) => {
                BindPlan::Create { superseded: std::iter::once(id).chain(by_inode).collect(), nsid_was_free: false }
            }
            None => BindPlan::Create { superseded: by_inode.into_iter().collect(), nsid_was_free: true },
        }
    }

    /// What changed since the last call (for the views).
    pub(super) fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    fn key_of_inode(&self, inode: NetnsInode) -> Option<NetnsKey> {
        if self.is_host_inode(inode) {
            return Some(NetnsKey::Host);
        }
        self.by_inode(inode).map(NetnsKey::Record)
    }

    // ---- writing ---------------------------------------------------------

    pub(super) fn bump_epoch(&mut self) -> u64 {
        self.epoch += 1;
        self.epoch
    }

    fn netns_mut(&mut self, key: NetnsKey) -> Option<&mut Netns> {
        match key {
            NetnsKey::Host => Some(&mut self.host),
            NetnsKey::Record(id) => self.live.get_mut(&id),
        }
    }

    /// The kernel just showed `key` alive.
    pub(super) fn touch(&mut self, key: NetnsKey, now: SystemTime) {
        if let Some(ns) = self.netns_mut(key)
            && ns.last_alive < now
        {
            ns.last_alive = now;
        }
    }

    /// A new record for the netns with `nsid` (and `inode`, once known).
    pub(super) fn create(&mut self, inode: Option<NetnsInode>, nsid: i32, now: SystemTime) -> RecordId {
        let id = self.next_id;
        self.next_id += 1;
        let born = self.bump_epoch();
        let mut rec = Netns::new(inode, Some(nsid), now, born);
        if let Some(i) = inode {
            rec.creator = self.pending_creators.remove(&i);
            rec.last_mounts = self.sightings.get(&i).map(|s| s.bind_mounts.clone()).unwrap_or_default();
            self.by_inode.insert(i, id);
        }
        self.by_nsid.insert(nsid, id);
        self.by_first_sight.insert((rec.first_seen, id));
        self.live.insert(id, rec);
        self.changes.identity(NetnsKey::Record(id));
        debug!(?inode, nsid, "netns tracked");
        id
    }

    /// The agent's own netns has `nsid` for itself.
    pub(super) fn bind_host(&mut self, nsid: i32) {
        // A record made for this nsid before we knew it was ours.
        if let Some(id) = self.by_nsid.remove(&nsid) {
            if let Some(rec) = self.live.remove(&id) {
                self.by_first_sight.remove(&(rec.first_seen, id));
                self.peers.forget(NetnsKey::Record(id), &rec);
            }
            self.changes.identity(NetnsKey::Record(id));
        }
        if self.host.nsid != Some(nsid) {
            debug!(nsid, "the agent's own netns has an nsid for itself");
            self.changes.identity(NetnsKey::Host);
        }
        self.host.nsid = Some(nsid);
    }

    /// Gives record `id`, known so far by nsid only, its inode.
    pub(super) fn attach_inode(&mut self, id: RecordId, inode: NetnsInode) {
        let pending = self.pending_creators.remove(&inode);
        let mounts = self.sightings.get(&inode).map(|s| s.bind_mounts.clone()).unwrap_or_default();
        if let Some(rec) = self.live.get_mut(&id) {
            rec.inode = Some(inode);
            rec.last_mounts = mounts;
            if rec.creator.is_none() {
                rec.creator = pending;
            }
        }
        self.by_inode.insert(inode, id);
        self.changes.identity(NetnsKey::Record(id));
    }

    /// The kernel assigned an nsid (counted as a correction when a
    /// counting resync found the netns).
    pub(super) fn count_assignment(&mut self, found_by_resync: bool) {
        self.counts.nsids_assigned += 1;
        if found_by_resync {
            self.count_found();
        }
    }

    /// A resync found a live netns no event had announced.
    pub(super) fn count_found(&mut self) {
        self.counts.corrections.netns_found += 1;
    }

    /// Removes record `id`, which died (`source` says how the model knows).
    pub(super) fn remove(&mut self, id: RecordId, source: DeathSource) {
        let Some(rec) = self.live.remove(&id) else {
            return;
        };
        self.by_first_sight.remove(&(rec.first_seen, id));
        self.peers.forget(NetnsKey::Record(id), &rec);
        self.changes.identity(NetnsKey::Record(id));
        if matches!(source, DeathSource::NsidGone | DeathSource::Superseded) {
            self.counts.corrections.netns_lost += 1;
        }
        if let Some(n) = rec.nsid
            && self.by_nsid.get(&n) == Some(&id)
        {
            self.by_nsid.remove(&n);
        }
        if let Some(i) = rec.inode
            && self.by_inode.get(&i) == Some(&id)
        {
            self.by_inode.remove(&i);
            // The inode may be reused; its old mounts are not the new
            // netns's.
            self.sightings.remove(&i);
        }
        self.counts.deaths += 1;
    }

    /// A probe named `task` as the creator of `inode` (by `via`, at `at`).
    pub(super) fn note_creator(&mut self, inode: NetnsInode, task: &Task, via: NetnsVia, at: SystemTime) {
        let creator =
            Creator { pid: task.tgid, tid: task.pid, comm: task.comm.clone(), cgroup_id: task.cgroup_id, via, at };
        let id = self.by_inode.get(&inode).copied();
        match id.and_then(|id| self.live.get_mut(&id).map(|rec| (id, rec))) {
            Some((id, rec)) if rec.creator.is_none() => {
                rec.creator = Some(creator);
                self.changes.netns.insert(NetnsKey::Record(id));
            }
            // The record is an older netns with a reused inode whose
            // death is still queued: keep this for the new one.
            Some(_) | None => {
                self.pending_creators.insert(inode, creator);
            }
        }
    }

    /// Forgets creators announced longer than `ttl` ago whose netns was
    /// never bound.
    pub(super) fn forget_stale_creators(&mut self, now: SystemTime, ttl: Duration) {
        self.pending_creators.retain(|_, c| age(now, c.at) <= ttl);
    }

    /// A discovery scan of `scope` found `found`. Work in proportion to
    /// what the scan found, not to the records: a record's last mounts are
    /// set only where its sighting's mounts changed.
    pub(super) fn apply_scan(&mut self, scope: Scope, found: BTreeMap<NetnsInode, Sighting>) {
        let mut changed = Vec::new();
        // Sightings that changed at all (a view shows them).
        let mut seen_changed = Vec::new();
        match scope {
            Scope::Full => {
                changed.extend(found.iter().filter(|(_, s)| !s.bind_mounts.is_empty()).map(|(&i, _)| i));
                seen_changed.extend(self.sightings.keys().filter(|i| !found.contains_key(i)).copied());
                seen_changed.extend(found.iter().filter(|&(i, s)| self.sightings.get(i) != Some(s)).map(|(&i, _)| i));
                self.sightings = found;
            }
            Scope::Mounts => {
                // Mounts gone: the processes a full scan saw stay.
                self.sightings.retain(|inode, s| {
                    if !found.contains_key(inode) && !s.bind_mounts.is_empty() {
                        s.bind_mounts.clear();
                        seen_changed.push(*inode);
                    }
                    !s.bind_mounts.is_empty() || s.process_count > 0
                });
                for (inode, s) in found {
                    let sighting = self.sightings.entry(inode).or_default();
                    if sighting.bind_mounts != s.bind_mounts {
                        sighting.bind_mounts = s.bind_mounts;
                        changed.push(inode);
                        seen_changed.push(inode);
                    }
                }
            }
        }
        for inode in seen_changed {
            if let Some(key) = self.key_of_inode(inode) {
                self.changes.netns.insert(key);
            }
        }
        for inode in changed {
            let Some(rec) = self.by_inode.get(&inode).and_then(|id| self.live.get_mut(id)) else {
                continue;
            };
            if let Some(s) = self.sightings.get(&inode)
                && !s.bind_mounts.is_empty()
                && rec.last_mounts != s.bind_mounts
            {
                rec.last_mounts.clone_from(&s.bind_mounts);
            }
        }
    }

    /// A notification about `key` (not a dump part).
    pub(super) fn apply_event(&mut self, key: NetnsKey, message: Message, now: SystemTime) -> Applied {
        self.touch(key, now);
        match message {
            Message::NewLink(l) => {
                let ifindex = l.ifindex;
                let needs_link_dump = self.upsert_link(key, l, key == NetnsKey::Host, false);
                Applied { shown: Some(Entry::Link(ifindex)), needs_link_dump }
            }
            Message::DelLink(l) => {
                if let Some(ns) = self.netns_mut(key) {
                    let removed = ns.links.remove(&l.ifindex);
                    ns.addresses.retain(|k, _| k.ifindex != l.ifindex);
                    ns.routes.retain(|k, _| k.oif != l.ifindex);
                    if let Some(r) = removed {
                        self.peers.take(key, l.ifindex, &r);
                    }
                    self.changes.link(key, l.ifindex);
                }
                Applied::default()
            }
            Message::NewAddress(a) => {
                let addr = addr_key(&a);
                if let Some(ns) = self.netns_mut(key)
                    && ns.addresses.insert(addr, a.scope) != Some(a.scope)
                {
                    self.changes.netns.insert(key);
                }
                Applied { shown: Some(Entry::Addr(addr)), needs_link_dump: false }
            }
            Message::DelAddress(a) => {
                if let Some(ns) = self.netns_mut(key)
                    && ns.addresses.remove(&addr_key(&a)).is_some()
                {
                    self.changes.netns.insert(key);
                }
                Applied::default()
            }
            Message::NewRoute(r) if key == NetnsKey::Host && is_host_route(&r) => match route_key(&r) {
                Some(route) => {
                    if self.host.routes.insert(route, r.protocol) != Some(r.protocol) {
                        self.changes.route(route);
                    }
                    Applied { shown: Some(Entry::Route(route)), needs_link_dump: false }
                }
                None => Applied::default(),
            },
            Message::DelRoute(r) if key == NetnsKey::Host => {
                if let Some(route) = route_key(&r)
                    && self.host.routes.remove(&route).is_some()
                {
                    self.changes.route(route);
                }
                Applied::default()
            }
            _ => Applied::default(),
        }
    }

    /// A part of a dump of `table` about `key`; returns the entry it shows.
    /// `counting`: differences count as corrections.
    pub(super) fn apply_dump_part(
        &mut self,
        key: NetnsKey,
        table: Table,
        message: Message,
        counting: bool,
    ) -> Option<Entry> {
        match message {
            Message::NewLink(l) if table == Table::Links => {
                let ifindex = l.ifindex;
                self.upsert_link(key, l, true, counting);
                Some(Entry::Link(ifindex))
            }
            Message::NewAddress(a) if table == Table::Addresses => {
                let addr = addr_key(&a);
                if let Some(ns) = self.netns_mut(key) {
                    let old = ns.addresses.insert(addr, a.scope);
                    if old != Some(a.scope) {
                        self.changes.netns.insert(key);
                        if counting {
                            self.counts.corrections.addresses += 1;
                        }
                    }
                }
                Some(Entry::Addr(addr))
            }
            // Host routes are the agent's own netns's: only it is dumped
            // for routes.
            Message::NewRoute(r) if table == Table::Routes && is_host_route(&r) => {
                let route = route_key(&r)?;
                let old = self.host.routes.insert(route, r.protocol);
                if old != Some(r.protocol) {
                    self.changes.route(route);
                }
                if counting && old.is_none() {
                    self.counts.corrections.routes += 1;
                }
                Some(Entry::Route(route))
            }
            _ => None,
        }
    }

    /// Stores a link; returns whether its netns should be re-dumped to
    /// learn where its peer lives. Counts a correction when a counting dump
    /// finds it new or different.
    fn upsert_link(&mut self, key: NetnsKey, l: Link, our_frame: bool, counting: bool) -> bool {
        let Some(ns) = self.netns_mut(key) else {
            return false;
        };
        let old = ns.links.get(&l.ifindex);
        let mut needs_dump = false;
        let link_netns = match (our_frame, l.link_netnsid, l.link) {
            (true, Some(n), _) => LinkNetns::Nsid(n),
            (true, None, _) | (false, _, None) => LinkNetns::Same,
            (false, _, Some(p)) => match old {
                Some(o) if o.link == Some(p) && o.link_netns != LinkNetns::Unverified => o.link_netns,
                _ => {
                    needs_dump = true;
                    LinkNetns::Unverified
                }
            },
        };
        let state = LinkState {
            name: l.name.map(SharedStr::from),
            kind: l.kind.map(SharedStr::from),
            flags: l.flags,
            mac: l.mac.as_deref().and_then(HardwareAddr::new),
            link: l.link,
            link_netns,
            master: l.master,
        };
        let changed = old != Some(&state);
        let filed = old.and_then(|o| PeerIndex::filed(key, l.ifindex, o));
        let filed_now = PeerIndex::filed(key, l.ifindex, &state);
        ns.links.insert(l.ifindex, state);
        self.peers.replace(filed, filed_now);
        if changed {
            self.changes.link(key, l.ifindex);
        }
        if counting && changed {
            self.counts.corrections.links += 1;
        }
        needs_dump
    }

    /// After a complete dump of `table` about `key` that started at
    /// `started_epoch`: removes what existed before it but was in neither
    /// the dump nor a notification since (`seen`): changes whose events
    /// were lost. Never a netns, and nothing from a record that is no
    /// longer the netns the dump targeted (`nsid`).
    pub(super) fn sweep(
        &mut self,
        key: NetnsKey,
        nsid: Option<i32>,
        table: Table,
        seen: &HashSet<Entry>,
        started_epoch: u64,
        counting: bool,
    ) {
        if table == Table::Nsids {
            // Absence from this dump is never death: the kernel sends it in
            // parts and resumes by position, so with many netns (about
            // 1,300, fewer with fragmented memory) live ones go missing.
            // Each record gets a dump aimed at its own nsid next (the
            // resync's per-netns dumps); a refusal of that is the kernel's
            // word (the dump queue's `Outcome::NsidGone`).
            let absent = self
                .live
                .values()
                .filter(|r| r.born < started_epoch && r.nsid.is_some_and(|n| !seen.contains(&Entry::Nsid(n))))
                .count();
            if absent > 0 {
                debug!(absent, "netns missing from the nsid dump; each is checked by its own nsid");
            }
            return;
        }
        if let NetnsKey::Record(id) = key
            && !self.holds_nsid(id, nsid)
        {
            return;
        }
        let ns = match key {
            NetnsKey::Host => &mut self.host,
            NetnsKey::Record(id) => match self.live.get_mut(&id) {
                Some(ns) => ns,
                None => return,
            },
        };
        let changes = &mut self.changes;
        let peers = &mut self.peers;
        let removed = match table {
            Table::Links => {
                let before = ns.links.len();
                ns.links.retain(|k, l| {
                    let keep = seen.contains(&Entry::Link(*k));
                    if !keep {
                        changes.link(key, *k);
                        peers.take(key, *k, l);
                    }
                    keep
                });
                let links = ns.links.keys().copied().collect::<HashSet<_>>();
                let addresses = ns.addresses.len();
                ns.addresses.retain(|k, _| links.contains(&k.ifindex));
                if ns.addresses.len() != addresses {
                    changes.netns.insert(key);
                }
                before - ns.links.len()
            }
            Table::Addresses => {
                let before = ns.addresses.len();
                ns.addresses.retain(|k, _| seen.contains(&Entry::Addr(*k)));
                if ns.addresses.len() != before {
                    changes.netns.insert(key);
                }
                before - ns.addresses.len()
            }
            Table::Routes => {
                let before = ns.routes.len();
                ns.routes.retain(|k, _| {
                    let keep = seen.contains(&Entry::Route(*k));
                    if !keep {
                        changes.route(*k);
                    }
                    keep
                });
                before - ns.routes.len()
            }
            Table::Nsids => 0,
        } as u64;
        if counting {
            let corrections = &mut self.counts.corrections;
            match table {
                Table::Links => corrections.links += removed,
                Table::Addresses => corrections.addresses += removed,
                Table::Routes => corrections.routes += removed,
                Table::Nsids => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: SystemTime = SystemTime::UNIX_EPOCH;
    const HOST: NetnsInode = 1;

    #[test]
    fn binding_plans_name_who_is_superseded_before_anything_changes() {
        let mut r = Registry::new(HOST, T0);
        let a = r.create(Some(100), 7, T0);
        assert_eq!(r.plan_bind(100, 7), BindPlan::Known(a));
        // nsid 7 now names another netns (inode 200): its holder is gone.
        assert_eq!(r.plan_bind(200, 7), BindPlan::Create { superseded: vec![a], nsid_was_free: false });
        // Inode 100 now has nsid 8: the netns that had it is gone.
        assert_eq!(r.plan_bind(100, 8), BindPlan::Create { superseded: vec![a], nsid_was_free: true });
        // A record known by nsid only takes the inode; the inode's old
        // holder is superseded.
        let b = r.create(None, 9, T0);
        assert_eq!(r.plan_bind(100, 9), BindPlan::Attach { record: b, superseded: Some(a) });
        assert_eq!(r.plan_bind(300, 9), BindPlan::Attach { record: b, superseded: None });
        // Planning changed nothing.
        assert_eq!((r.by_inode(100), r.by_nsid(7), r.by_nsid(9), r.len()), (Some(a), Some(a), Some(b), 2));
    }

    #[test]
    fn a_sweep_of_the_nsid_table_removes_no_netns() {
        let mut r = Registry::new(HOST, T0);
        r.create(Some(100), 7, T0);
        let epoch = r.bump_epoch();
        r.sweep(NetnsKey::Host, None, Table::Nsids, &HashSet::new(), epoch + 1, true);
        assert_eq!(r.len(), 1);
        assert_eq!(r.counts.corrections.netns_lost, 0);
    }

    #[test]
    fn a_sweep_spares_a_record_that_is_no_longer_the_dumped_netns() {
        let mut r = Registry::new(HOST, T0);
        let a = r.create(Some(100), 7, T0);
        let link = Link {
            ifindex: 2,
            name: Some("eth0".into()),
            kind: None,
            flags: 0,
            mac: None,
            link: None,
            link_netnsid: None,
            master: None,
            target_nsid: None,
        };
        r.apply_event(NetnsKey::Record(a), Message::NewLink(link), T0);
        // A dump aimed at nsid 8 says nothing about the netns with nsid 7.
        r.sweep(NetnsKey::Record(a), Some(8), Table::Links, &HashSet::new(), 99, true);
        assert_eq!(r.record(a).map(|n| n.links.len()), Some(1));
        r.sweep(NetnsKey::Record(a), Some(7), Table::Links, &HashSet::new(), 99, true);
        assert_eq!(r.record(a).map(|n| n.links.len()), Some(0));
        assert_eq!(r.counts.corrections.links, 1);
    }
}
