//! The read-only view: what the registry shows the world as
//! [`NetnsView`]s and [`ModelSnapshot`]s, with `IFLA_LINK` references
//! resolved across namespaces, and the views of the recently dead, kept for
//! a while.

use std::{
    collections::{HashMap, VecDeque},
    net::IpAddr,
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{
    super::{
        sealed::{CHUNK, SealedChunk, SealedViews, covered_by},
        snapshot::{
            AddrScope, AddressView, DeathSource, HostRouteView, InterfaceView, LinkRef, ModelSnapshot, ModelStats,
            NetnsView, PeerNetns,
        },
    },
    age,
    records::{LinkNetns, LinkState, Netns, NetnsKey, RecordId, RouteKey},
    registry::Registry,
};
use crate::{
    fast::{Map, Set},
    netlink::wire::consts,
};

/// Resolves `IFLA_LINK` references across namespaces. Names and
/// identities are read from the registry when a reference is made, never
/// copied into maps. A link that names its peer's netns itself is placed
/// from its own record; only a link that does not (an event from inside
/// its netns, in that netns's numbering) is placed from the other end,
/// which the registry files by the end it names ([`Registry::naming`]).
struct Resolver<'a> {
    registry: &'a Registry,
    /// Host routes (destination, interface) by the netns their interface
    /// leads into.
    routes_into: Map<NetnsKey, Vec<(IpAddr, u32)>>,
}

impl<'a> Resolver<'a> {
    /// The references of the netns `wanted` says (and of the host's links:
    /// its routes lead into them): one pass over the host's routes.
    fn new(registry: &'a Registry, wanted: impl Fn(NetnsKey) -> bool) -> Self {
        let mut r = Self { registry, routes_into: Map::default() };
        let host = registry.host();
        let mut routes_into: Map<NetnsKey, Vec<(IpAddr, u32)>> = Map::default();
        for k in host.routes.keys() {
            let Some(link) = host.links.get(&k.oif) else { continue };
            if let Some((o, _)) = r.place(NetnsKey::Host, k.oif, link)
                && o != NetnsKey::Host
                && wanted(o)
            {
                routes_into.entry(o).or_default().push((k.dst, k.oif));
            }
        }
        r.routes_into = routes_into;
        r
    }

    /// Every link of the node, the host's first: the order in which the
    /// last link naming an end wins.
    fn links_in_order(&self) -> impl Iterator<Item = ((NetnsKey, u32), &'a LinkState)> + 'a {
        let registry = self.registry;
        std::iter::once((NetnsKey::Host, registry.host()))
            .chain(registry.records().map(|(id, rec)| (NetnsKey::Record(id), rec)))
            .flat_map(|(k, ns)| ns.links.iter().map(move |(&i, l)| ((k, i), l)))
    }

    /// The last link (in [`Self::links_in_order`]) that names
    /// `(key, ifindex)` as its other end.
    fn reverse(&self, key: NetnsKey, ifindex: u32) -> Option<(NetnsKey, u32)> {
        let mut naming = self.registry.naming(key, ifindex);
        let first = naming.next()?;
        if naming.next().is_none() {
            return Some(first);
        }
        // More than one link names it (one of them stale until a dump
        // says): the last in the node's order, found by a search.
        self.links_in_order()
            .filter(|(_, l)| l.link == Some(ifindex))
            .filter(|&((k, _), l)| self.link_target(k, l.link_netns) == Some(key))
            .map(|(at, _)| at)
            .last()
    }

    /// The netns a link of `key` names as its peer's.
    fn link_target(&self, key: NetnsKey, link_netns: LinkNetns) -> Option<NetnsKey> {
        match link_netns {
            LinkNetns::Same => Some(key),
            LinkNetns::Nsid(n) => by_nsid(self.registry, n),
            LinkNetns::Unverified => None,
        }
    }

    fn netns(&self, key: NetnsKey) -> Option<&'a Netns> {
        netns(self.registry, key)
    }

    /// Where the other end of `l`, link `ifindex` of `key`, is: where `l`
    /// says, else where the link naming it is.
    fn place(&self, key: NetnsKey, ifindex: u32, l: &LinkState) -> Option<(NetnsKey, u32)> {
        let peer_ifindex = l.link?;
        self.link_target(key, l.link_netns).map(|o| (o, peer_ifindex)).or_else(|| {
            // The other end placed us: a veth pair names each other.
            self.reverse(key, ifindex).filter(|&(ok, oi)| oi == peer_ifindex && ok != key)
        })
    }

    /// The reference to a link's other end, placed at `placed` ([`Self::place`]).
    fn link_ref(&self, placed: Option<(NetnsKey, u32)>, peer_ifindex: u32) -> LinkRef {
        match placed {
            Some((o, p)) => {
                let ns = self.netns(o);
                LinkRef {
                    ifindex: p,
                    ifname: ns.and_then(|ns| ns.links.get(&p)).and_then(|l| l.name.clone()),
                    netns: ns.map(|ns| PeerNetns { inode: ns.inode, nsid: ns.nsid, host: o == NetnsKey::Host }),
                }
            }
            None => LinkRef { ifindex: peer_ifindex, ifname: None, netns: None },
        }
    }
}

/// The netns with nsid `n` in the agent's numbering.
fn by_nsid(registry: &Registry, n: i32) -> Option<NetnsKey> {
    registry.by_nsid(n).map(NetnsKey::Record).or_else(|| (registry.host_nsid() == Some(n)).then_some(NetnsKey::Host))
}

fn netns(registry: &Registry, key: NetnsKey) -> Option<&Netns> {
    match key {
        NetnsKey::Host => Some(registry.host()),
        NetnsKey::Record(id) => registry.record(id),
    }
}

/// Where a link's other end was placed ([`Resolver::place`]): None for a
/// link that names none, or one not placed.
type Placed = Option<(NetnsKey, u32)>;

/// One interface's view, and where its link's other end was placed.
fn interface(resolver: &Resolver, key: NetnsKey, ifindex: u32, l: &LinkState) -> (Arc<InterfaceView>, Placed) {
    let placed = resolver.place(key, ifindex, l);
    let view = InterfaceView {
        ifindex,
        name: l.name.clone(),
        kind: l.kind.clone(),
        up: l.flags & consts::IFF_UP != 0,
        mac: l.mac.clone(),
        master: l.master,
        link: l.link.map(|p| resolver.link_ref(placed, p)),
    };
    (Arc::new(view), placed)
}

/// A view as built: the view, where each of its interfaces' other ends was
/// placed (in the order of its interfaces), and the links of other netns
/// it read (a peer's name and identity, or a host link its routes come
/// through).
struct Viewed {
    view: NetnsView,
    placed: Vec<Placed>,
    reads: Vec<(NetnsKey, u32)>,
}

/// A view of `key`. With `kept` (the view built before, and what changed
/// since, when the netns's identity did not change), an interface that
/// [`Recheck::may_change`] clears is shared from it, not built again.
fn view(
    registry: &Registry,
    resolver: &Resolver,
    key: NetnsKey,
    ns: &Netns,
    kept: Option<(&Built, &Recheck)>,
) -> Viewed {
    let sighting = ns.inode.and_then(|i| registry.sighting(i));
    let mut interfaces = Vec::with_capacity(ns.links.len());
    let mut placed = Vec::with_capacity(ns.links.len());
    // Both by ifindex: the kept interfaces are walked alongside.
    let mut old = kept.map(|(b, r)| (b.view.interfaces.iter().zip(&b.placed).peekable(), r));
    for (&ifindex, l) in &ns.links {
        let shared = old.as_mut().and_then(|(old, recheck)| {
            while old.next_if(|(i, _)| i.ifindex < ifindex).is_some() {}
            let (i, &p) = old.next_if(|(i, _)| i.ifindex == ifindex)?;
            (!recheck.may_change(key, ifindex, l, p)).then(|| (Arc::clone(i), p))
        });
        let (i, p) = shared.unwrap_or_else(|| interface(resolver, key, ifindex, l));
        interfaces.push(i);
        placed.push(p);
    }
    // Its addresses (and the names of their links) change only with an
    // address or a link of its own: the host's, one per pod veth, are
    // copied as they were when a pod's death makes its view stale.
    let addresses = match kept {
        Some((built, recheck)) if !recheck.changes.own_view_of(key) => built.view.addresses.clone(),
        _ => ns
            .addresses
            .iter()
            .map(|(k, &scope)| AddressView {
                ip: k.ip,
                prefix_len: k.prefix_len,
                ifindex: k.ifindex,
                ifname: ns.links.get(&k.ifindex).and_then(|l| l.name.clone()),
                scope: AddrScope::from_raw(scope),
            })
            .collect(),
    };
    let routes = resolver.routes_into.get(&key).map_or(&[][..], Vec::as_slice);
    let host_routes = routes.iter().map(|&(dst, _)| dst).collect();
    let reads = placed.iter().flatten().copied().chain(routes.iter().map(|&(_, oif)| (NetnsKey::Host, oif))).collect();
    let view = NetnsView {
        inode: ns.inode,
        nsid: ns.nsid,
        host: key == NetnsKey::Host,
        alive: true,
        first_seen: ns.first_seen,
        died_at: None,
        death_source: None,
        creator: ns.creator.clone(),
        bind_mounts: sighting.map(|s| s.bind_mounts.clone()).unwrap_or_default(),
        process_count: sighting.map_or(0, |s| s.process_count),
        processes: sighting.map(|s| s.processes.clone()).unwrap_or_default(),
        interfaces,
        addresses,
        host_routes,
    };
    Viewed { view, placed, reads }
}

/// What a change can do to an interface of a view whose netns kept its
/// identity: its own link is what it was unless [`Changes::links`] names
/// it, and its other end's place, name and identity depend only on the
/// links, identities and nsids below.
struct Recheck<'c> {
    changes: &'c Changes,
    /// nsids given or taken since the views were built (each netns whose
    /// identity changed: the nsid its view had, and the one it has now):
    /// a link naming one may now name another netns.
    nsids: Set<i32>,
    /// Links named as the other end by a link that changed: it may be
    /// the one that places them now (the last one wins).
    named: Set<(NetnsKey, u32)>,
}

impl<'c> Recheck<'c> {
    /// Made before any view is rebuilt: the nsids the views had are read
    /// from them.
    fn new(registry: &Registry, resolver: &Resolver, changes: &'c Changes, built: &Map<NetnsKey, Built>) -> Self {
        let nsids = changes
            .identities
            .iter()
            .flat_map(|key| {
                let now = netns(registry, *key).and_then(|ns| ns.nsid);
                let then = built.get(key).and_then(|b| b.view.nsid);
                now.into_iter().chain(then)
            })
            .collect();
        let named = changes
            .links
            .iter()
            .filter_map(|&(key, ifindex)| {
                let l = netns(registry, key)?.links.get(&ifindex)?;
                Some((resolver.link_target(key, l.link_netns)?, l.link?))
            })
            .collect();
        Self { changes, nsids, named }
    }

    /// Whether interface `ifindex` of `key` (link `l`, its other end
    /// placed at `placed` when built) may show something else now.
    fn may_change(&self, key: NetnsKey, ifindex: u32, l: &LinkState, placed: Placed) -> bool {
        if self.changes.links.contains(&(key, ifindex)) {
            return true;
        }
        if l.link.is_none() {
            return false;
        }
        let Some((o, p)) = placed else {
            return true; // not placed: it may be now
        };
        self.changes.links.contains(&(o, p))
            || self.changes.identities.contains(&o)
            || matches!(l.link_netns, LinkNetns::Nsid(n) if self.nsids.contains(&n))
            || self.named.contains(&(key, ifindex))
    }
}

/// The view of record `id` as it dies at `at`, taken while it is still in
/// the registry (its peers are named through it); `None` if it is not
/// alive.
pub(super) fn dying(registry: &Registry, id: RecordId, source: DeathSource, at: SystemTime) -> Option<NetnsView> {
    let rec = registry.record(id)?;
    let resolver = Resolver::new(registry, |k| k == NetnsKey::Record(id));
    let Viewed { mut view, .. } = view(registry, &resolver, NetnsKey::Record(id), rec, None);
    view.alive = false;
    if view.bind_mounts.is_empty() {
        view.bind_mounts.clone_from(&rec.last_mounts);
    }
    view.died_at = Some(at);
    view.death_source = Some(source);
    Some(view)
}

fn host_routes(registry: &Registry, resolver: &Resolver) -> Vec<HostRouteView> {
    let host = registry.host();
    host.routes
        .iter()
        .map(|(k, &protocol)| {
            let link = host.links.get(&k.oif);
            HostRouteView {
                dst: k.dst,
                prefix_len: k.dst_len,
                oif: k.oif,
                ifname: link.and_then(|l| l.name.clone()),
                table: k.table,
                protocol,
                netns: link.and_then(|l| resolver.link_ref(resolver.place(NetnsKey::Host, k.oif, l), l.link?).netns),
            }
        })
        .collect()
}

/// Live records in snapshot order: by first sight (sorted here, the
/// reference for the order the registry keeps).
fn live_in_order(registry: &Registry) -> Vec<(RecordId, &Netns)> {
    let mut live: Vec<(RecordId, &Netns)> = registry.records().collect();
    live.sort_by_key(|&(id, r)| (r.first_seen, id));
    live
}

/// The whole model at `now`, built from nothing: the agent's own netns,
/// the live ones by first sight, then the recently dead. What [`Views`]
/// keeps up to date must always equal this.
pub(super) fn fresh_snapshot(
    registry: &Registry,
    dead: &DeadViews,
    stats: ModelStats,
    now: SystemTime,
) -> ModelSnapshot {
    let resolver = Resolver::new(registry, |_| true);
    let mut netns = vec![Arc::new(view(registry, &resolver, NetnsKey::Host, registry.host(), None).view)];
    netns.extend(
        live_in_order(registry)
            .into_iter()
            .map(|(id, r)| Arc::new(view(registry, &resolver, NetnsKey::Record(id), r, None).view)),
    );
    let sealed = dead.sealed(netns.len());
    netns.extend(dead.views.iter().cloned());
    ModelSnapshot { taken_at: now, netns, sealed, host_routes: host_routes(registry, &resolver).into(), stats }
}

/// What changed in the registry since the views were last brought up to
/// date: what a view shows of a netns, one of its links, its identity, a
/// host route. The registry records them as it changes.
#[derive(Debug, Default)]
pub(super) struct Changes {
    /// Netns whose own view changed (addresses, creator, sighting,
    /// identity).
    pub(super) netns: Set<NetnsKey>,
    /// Links added, changed or removed: their netns's view changes (that
    /// interface, and the addresses on it), and so do the views that show
    /// their name or are placed through them.
    links: Set<(NetnsKey, u32)>,
    /// Netns created, removed, or given an inode or nsid: those that name
    /// them change, and an nsid may now name another netns.
    identities: Set<NetnsKey>,
    /// Host routes added, changed or removed.
    routes: Set<RouteKey>,
}

impl Changes {
    pub(super) fn link(&mut self, key: NetnsKey, ifindex: u32) {
        self.links.insert((key, ifindex));
    }

    pub(super) fn identity(&mut self, key: NetnsKey) {
        self.netns.insert(key);
        self.identities.insert(key);
    }

    pub(super) fn route(&mut self, route: RouteKey) {
        self.routes.insert(route);
    }

    /// Whether what a view shows of other netns may have changed: a link,
    /// an identity or a host route changed.
    fn shows_others(&self) -> bool {
        !self.links.is_empty() || !self.identities.is_empty() || !self.routes.is_empty()
    }

    /// Whether what `key`'s view shows of itself may have changed: its
    /// addresses, creator, sighting or identity, or one of its links.
    fn own_view_of(&self, key: NetnsKey) -> bool {
        self.netns.contains(&key) || self.links.iter().any(|&(k, _)| k == key)
    }

    fn is_empty(&self) -> bool {
        self.netns.is_empty() && self.links.is_empty() && self.identities.is_empty() && self.routes.is_empty()
    }
}

/// A view as last built, and the links of other netns it read.
struct Built {
    view: Arc<NetnsView>,
    /// Where each interface's other end was placed, in their order.
    placed: Vec<Placed>,
    /// Sorted, no duplicates.
    reads: Vec<(NetnsKey, u32)>,
}

/// The views of the live netns, kept up to date in proportion to what
/// changed: a snapshot shares every view whose netns (and whatever it
/// shows of others) did not change since the previous one.
#[derive(Default)]
pub(super) struct Views {
    built: Map<NetnsKey, Built>,
    /// netns -> its links -> the views that read them.
    readers: Map<NetnsKey, Map<u32, Set<NetnsKey>>>,
    /// Views with a link that names an nsid no netns held when built.
    unresolved: Set<NetnsKey>,
    host_routes: Arc<[HostRouteView]>,
}

impl Views {
    /// The views that `changes` may have changed.
    fn stale(&self, registry: &Registry, changes: &Changes) -> Set<NetnsKey> {
        let mut stale = changes.netns.clone();
        let readers_of_link = |key: NetnsKey, ifindex: u32| {
            self.readers.get(&key).and_then(|links| links.get(&ifindex)).into_iter().flatten().copied()
        };
        // The netns a link of `key` names now (it may place a peer there).
        let target = |key: NetnsKey, ifindex: u32| {
            let l = netns(registry, key)?.links.get(&ifindex)?;
            l.link?;
            match l.link_netns {
                LinkNetns::Same => Some(key),
                LinkNetns::Nsid(n) => by_nsid(registry, n),
                LinkNetns::Unverified => None,
            }
        };
        for &(key, ifindex) in &changes.links {
            stale.insert(key);
            stale.extend(readers_of_link(key, ifindex));
            stale.extend(target(key, ifindex));
        }
        for r in &changes.routes {
            stale.extend(readers_of_link(NetnsKey::Host, r.oif));
            stale.extend(target(NetnsKey::Host, r.oif));
        }
        if !changes.identities.is_empty() {
            stale.extend(self.unresolved.iter().copied());
        }
        for key in &changes.identities {
            stale.extend(self.readers.get(key).into_iter().flat_map(HashMap::values).flatten().copied());
        }
        stale
    }

    fn forget(&mut self, key: NetnsKey) -> Option<Built> {
        let old = self.built.remove(&key)?;
        self.unread(key, &old.reads);
        self.unresolved.remove(&key);
        Some(old)
    }

    /// Takes `key` out of the readers of each of `reads`.
    fn unread(&mut self, key: NetnsKey, reads: &[(NetnsKey, u32)]) {
        for (o, ifindex) in reads {
            if let Some(links) = self.readers.get_mut(o) {
                if let Some(readers) = links.get_mut(ifindex) {
                    readers.remove(&key);
                    if readers.is_empty() {
                        links.remove(ifindex);
                    }
                }
                if links.is_empty() {
                    self.readers.remove(o);
                }
            }
        }
    }

    /// Keeps `view` as `key`'s, in place of the one built before. Only the
    /// reads that differ from that one's change the readers: the host's
    /// view reads the veth of every pod, and taking each out and back in
    /// on every rebuild cost ~0.1 ms per snapshot at 200 pods (the one
    /// taken as a death is sent included). Reads are kept sorted.
    fn keep(&mut self, key: NetnsKey, ns: &Netns, registry: &Registry, viewed: Viewed) {
        let Viewed { view, placed, mut reads } = viewed;
        reads.sort_unstable();
        reads.dedup();
        let old = self.built.remove(&key).map(|b| b.reads).unwrap_or_default();
        let gone: Vec<(NetnsKey, u32)> = old.iter().filter(|r| reads.binary_search(r).is_err()).copied().collect();
        self.unread(key, &gone);
        for &(o, ifindex) in reads.iter().filter(|r| old.binary_search(r).is_err()) {
            self.readers.entry(o).or_default().entry(ifindex).or_default().insert(key);
        }
        let unresolved = ns
            .links
            .values()
            .any(|l| l.link.is_some() && matches!(l.link_netns, LinkNetns::Nsid(n) if by_nsid(registry, n).is_none()));
        if unresolved {
            self.unresolved.insert(key);
        } else {
            self.unresolved.remove(&key);
        }
        self.built.insert(key, Built { view: Arc::new(view), placed, reads });
    }

    /// Rebuilds the views `changes` may have changed.
    fn update(&mut self, registry: &Registry, changes: &Changes) {
        if changes.is_empty() && !self.built.is_empty() {
            return;
        }
        let mut stale = self.stale(registry, changes);
        let first = self.built.is_empty();
        if first {
            stale.insert(NetnsKey::Host);
            stale.extend(registry.records().map(|(id, _)| NetnsKey::Record(id)));
        }
        let resolver = Resolver::new(registry, |k| stale.contains(&k));
        let recheck = Recheck::new(registry, &resolver, changes, &self.built);
        for &key in &stale {
            let Some(ns) = netns(registry, key) else {
                self.forget(key);
                continue;
            };
            // A netns whose identity changed is built again whole (a link
            // elsewhere that names its nsid may now place one of its
            // interfaces); any other keeps the interfaces that `recheck`
            // clears. What a view shows besides them is read again.
            let kept = self.built.get(&key).filter(|_| !changes.identities.contains(&key)).map(|b| (b, &recheck));
            let viewed = view(registry, &resolver, key, ns, kept);
            self.keep(key, ns, registry, viewed);
        }
        // Which netns a host route leads into can change with a link of any
        // netns (a peer placed from the other end) or an identity: such a
        // change rebuilds them (O(host routes), the host's own table). An
        // address or a sighting does not.
        if first || changes.shows_others() {
            self.host_routes = host_routes(registry, &resolver).into();
        }
    }

    /// The whole model at `now`: the agent's own netns, the live ones by
    /// first sight, then the recently dead. Rebuilds only the views that
    /// `changes` (everything since the previous call) may have changed.
    pub(super) fn snapshot(
        &mut self,
        registry: &Registry,
        changes: &Changes,
        dead: &DeadViews,
        stats: ModelStats,
        now: SystemTime,
    ) -> ModelSnapshot {
        self.update(registry, changes);
        let mut netns = Vec::with_capacity(self.built.len() + dead.views.len());
        netns.extend(self.built.get(&NetnsKey::Host).map(|b| Arc::clone(&b.view)));
        netns.extend(
            registry
                .records_in_order()
                .filter_map(|(id, _)| self.built.get(&NetnsKey::Record(id)).map(|b| Arc::clone(&b.view))),
        );
        let sealed = dead.sealed(netns.len());
        netns.extend(dead.views.iter().cloned());
        ModelSnapshot { taken_at: now, netns, sealed, host_routes: Arc::clone(&self.host_routes), stats }
    }
}

/// Views of the netns that died recently, oldest death first. They no
/// longer change: each run of [`CHUNK`] is indexed once, when it is complete
/// ([`SealedChunk`]), and shared by every snapshot after.
#[derive(Debug)]
pub(super) struct DeadViews {
    views: VecDeque<Arc<NetnsView>>,
    /// The sealed runs, oldest first: they cover `views` from its front,
    /// less the first `skip` views of the first one (forgotten since); the
    /// views after them are not sealed yet.
    sealed: VecDeque<Arc<SealedChunk>>,
    skip: usize,
    /// Views per chunk ([`CHUNK`]; smaller in tests).
    chunk: usize,
    /// How long one is kept.
    retention: Duration,
    /// At most this many are kept.
    max: usize,
}

impl DeadViews {
    pub(super) fn new(retention: Duration, max: usize) -> Self {
        Self { views: VecDeque::new(), sealed: VecDeque::new(), skip: 0, chunk: CHUNK, retention, max }
    }

    pub(super) fn push(&mut self, view: NetnsView) {
        self.views.push_back(Arc::new(view));
        let open = self.views.len() - covered_by(&self.sealed, self.skip);
        if open >= self.chunk {
            let run = self.views.range(self.views.len() - open..).map(Arc::as_ref);
            self.sealed.push_back(Arc::new(SealedChunk::new(run)));
        }
        if self.views.len() > self.max {
            self.pop_oldest();
        }
    }

    /// Forgets those past the retention (or the limit) at `now`.
    pub(super) fn forget_old(&mut self, now: SystemTime) {
        while self.views.len() > self.max
            || self.views.front().and_then(|d| d.died_at).is_some_and(|t| age(now, t) > self.retention)
        {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if self.views.pop_front().is_none() {
            return;
        }
        // The oldest view is the first sealed chunk's while there is one.
        if let Some(first) = self.sealed.front() {
            self.skip += 1;
            if self.skip >= first.len() {
                self.sealed.pop_front();
                self.skip = 0;
            }
        }
    }

    /// Where the sealed views sit in a snapshot whose dead views start at
    /// position `start`.
    fn sealed(&self, start: usize) -> SealedViews {
        SealedViews::new(self.sealed.iter().cloned().collect(), start, self.skip).unwrap_or_else(|| {
            // Not reachable: `skip` is reset as the first chunk empties.
            tracing::warn!(skip = self.skip, "dead views: the sealed chunks are out of step; none indexed");
            SealedViews::NONE
        })
    }
}

/// What the resolver answered when it filed every link of the node in
/// maps up front (before session 22): the reference [`Resolver`] must
/// equal, for the netns it is asked about. Panics where they differ.
#[cfg(test)]
pub(super) fn assert_resolver_matches_filed_maps(registry: &Registry) {
    registry.assert_indexes();
    let all: Vec<(NetnsKey, &Netns)> = std::iter::once((NetnsKey::Host, registry.host()))
        .chain(registry.records().map(|(id, rec)| (NetnsKey::Record(id), rec)))
        .collect();
    let target = |key: NetnsKey, l: &super::records::LinkState| match l.link_netns {
        LinkNetns::Same => Some(key),
        LinkNetns::Nsid(n) => by_nsid(registry, n),
        LinkNetns::Unverified => None,
    };
    // Each record alone (a death's view, a changed one), then all of them.
    let mut wanted_sets: Vec<Vec<NetnsKey>> = all.iter().map(|&(k, _)| vec![NetnsKey::Host, k]).collect();
    wanted_sets.push(all.iter().map(|&(k, _)| k).collect());
    for wanted in wanted_sets {
        let is_wanted = |k: NetnsKey| k == NetnsKey::Host || wanted.contains(&k);
        let mut forward: Map<(NetnsKey, u32), (NetnsKey, u32)> = Map::default();
        let mut reverse: Map<(NetnsKey, u32), (NetnsKey, u32)> = Map::default();
        for &(key, ns) in &all {
            for (&ifindex, l) in &ns.links {
                let Some(p) = l.link else { continue };
                if let Some(o) = target(key, l) {
                    if is_wanted(key) {
                        forward.insert((key, ifindex), (o, p));
                    }
                    if is_wanted(o) {
                        reverse.insert((o, p), (key, ifindex));
                    }
                }
            }
        }
        let filed_place = |key: NetnsKey, ifindex: u32, peer: u32| {
            forward
                .get(&(key, ifindex))
                .copied()
                .or_else(|| reverse.get(&(key, ifindex)).copied().filter(|&(ok, oi)| oi == peer && ok != key))
        };
        let resolver = Resolver::new(registry, is_wanted);
        let mut routes_into: Map<NetnsKey, Vec<(IpAddr, u32)>> = Map::default();
        for k in registry.host().routes.keys() {
            let Some(p) = registry.host().links.get(&k.oif).and_then(|l| l.link) else { continue };
            if let Some((o, _)) = filed_place(NetnsKey::Host, k.oif, p)
                && o != NetnsKey::Host
                && is_wanted(o)
            {
                routes_into.entry(o).or_default().push((k.dst, k.oif));
            }
        }
        assert_eq!(resolver.routes_into, routes_into, "host routes by the netns they lead into, wanted {wanted:?}");
        for &(key, ns) in all.iter().filter(|(k, _)| is_wanted(*k)) {
            for (&ifindex, l) in &ns.links {
                let Some(p) = l.link else { continue };
                assert_eq!(
                    resolver.place(key, ifindex, l),
                    filed_place(key, ifindex, p),
                    "link {ifindex} of {key:?} (peer {p}), wanted {wanted:?}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, path::PathBuf, time::UNIX_EPOCH};

    use super::*;

    fn dead(i: u8, died: u64) -> NetnsView {
        let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, i % 4));
        NetnsView {
            inode: Some(u32::from(i)),
            nsid: None,
            host: false,
            alive: false,
            first_seen: UNIX_EPOCH,
            died_at: Some(UNIX_EPOCH + Duration::from_secs(died)),
            death_source: Some(DeathSource::RtmDelnsid),
            creator: None,
            bind_mounts: vec![PathBuf::from(format!("/run/netns/n{}", i % 3))],
            process_count: 0,
            processes: Vec::new(),
            interfaces: Vec::new(),
            addresses: vec![AddressView { ip, prefix_len: 24, ifindex: 2, ifname: None, scope: AddrScope::Global }],
            host_routes: Vec::new(),
        }
    }

    /// Deaths pushed, forgotten by age and by the limit: the sealed chunks
    /// cover the kept views in order from the front, and find in them what
    /// a walk of those views finds.
    #[test]
    fn sealed_chunks_follow_the_dead_views_as_they_come_and_go() {
        use proptest::prelude::*;
        // (push: true / forget at a time: false, died or forget time).
        let ops = proptest::collection::vec((any::<bool>(), 0_u64..60), 0..80);
        proptest!(ProptestConfig::with_cases(300), |(ops in ops, chunk in 1_usize..5, max in 1_usize..12)| {
            let mut views = DeadViews::new(Duration::from_secs(20), max);
            views.chunk = chunk;
            let mut clock = 0;
            for (i, (push, at)) in ops.into_iter().enumerate() {
                clock = clock.max(at);
                if push {
                    views.push(dead(u8::try_from(i).unwrap_or(0), clock));
                } else {
                    views.forget_old(UNIX_EPOCH + Duration::from_secs(clock));
                }
                let live = 3;
                let sealed = views.sealed(live);
                prop_assert!(views.views.len() <= max);
                // Sealed from the front, less than a chunk left open.
                prop_assert_eq!(sealed.covered().start, live);
                prop_assert!(sealed.covered().end <= live + views.views.len());
                prop_assert!(live + views.views.len() - sealed.covered().end < chunk);
                let netns: Vec<&NetnsView> = views.views.iter().map(Arc::as_ref).collect();
                for ip in (0..4).map(|i| IpAddr::V4(Ipv4Addr::new(10, 0, 0, i))) {
                    let mut found = Vec::new();
                    sealed.at_ip(ip, &mut found);
                    found.sort_unstable();
                    let walked: Vec<usize> = sealed
                        .covered()
                        .filter(|&p| netns[p - live].addresses.iter().any(|a| a.ip == ip))
                        .collect();
                    prop_assert_eq!(found, walked);
                }
                for n in 0..3 {
                    let name = format!("n{n}");
                    let mut found = Vec::new();
                    sealed.at_mount(Some(std::ffi::OsStr::new(&name)), &mut found);
                    found.sort_unstable();
                    let walked: Vec<usize> = sealed
                        .covered()
                        .filter(|&p| netns[p - live].bind_mounts[0].ends_with(&name))
                        .collect();
                    prop_assert_eq!(found, walked);
                }
            }
        });
    }
}
