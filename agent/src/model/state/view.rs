//! The read-only view: what the registry shows the world as
//! [`NetnsView`]s and [`ModelSnapshot`]s, with `IFLA_LINK` references
//! resolved across namespaces, and the views of the recently dead, kept for
//! a while.

use std::{
    collections::{HashMap, VecDeque},
    net::IpAddr,
    time::{Duration, SystemTime},
};

use super::{
    super::snapshot::{
        AddrScope, AddressView, DeathSource, HostRouteView, InterfaceView, LinkRef, ModelSnapshot, ModelStats,
        NetnsView, PeerNetns,
    },
    age,
    records::{LinkNetns, Netns, NetnsKey, RecordId},
    registry::Registry,
};
use crate::netlink::wire::consts;

/// Resolves `IFLA_LINK` references across namespaces for one view.
struct Resolver {
    refs: HashMap<NetnsKey, PeerNetns>,
    names: HashMap<(NetnsKey, u32), Option<String>>,
    /// (netns, ifindex) -> (netns, ifindex) of the other end, for links
    /// whose own message placed the peer.
    forward: HashMap<(NetnsKey, u32), (NetnsKey, u32)>,
    reverse: HashMap<(NetnsKey, u32), (NetnsKey, u32)>,
    /// Host routes by the netns their interface leads into.
    routes_into: HashMap<NetnsKey, Vec<IpAddr>>,
}

impl Resolver {
    fn new(registry: &Registry) -> Self {
        let mut r = Self {
            refs: HashMap::new(),
            names: HashMap::new(),
            forward: HashMap::new(),
            reverse: HashMap::new(),
            routes_into: HashMap::new(),
        };
        let host = registry.host();
        let all: Vec<(NetnsKey, &Netns)> = std::iter::once((NetnsKey::Host, host))
            .chain(registry.records().map(|(id, rec)| (NetnsKey::Record(id), rec)))
            .collect();
        let mut by_nsid = HashMap::new();
        for &(key, ns) in &all {
            r.refs.insert(key, PeerNetns { inode: ns.inode, nsid: ns.nsid, host: key == NetnsKey::Host });
            if let Some(n) = ns.nsid {
                by_nsid.insert(n, key);
            }
            for (&ifindex, l) in &ns.links {
                r.names.insert((key, ifindex), l.name.clone());
            }
        }
        for &(key, ns) in &all {
            for (&ifindex, l) in &ns.links {
                let Some(p) = l.link else { continue };
                let other = match l.link_netns {
                    LinkNetns::Same => Some(key),
                    LinkNetns::Nsid(n) => by_nsid.get(&n).copied(),
                    LinkNetns::Unverified => None,
                };
                if let Some(o) = other {
                    r.forward.insert((key, ifindex), (o, p));
                    r.reverse.insert((o, p), (key, ifindex));
                }
            }
        }
        for k in host.routes.keys() {
            let Some(p) = host.links.get(&k.oif).and_then(|l| l.link) else {
                continue;
            };
            if let Some((o, _)) = r.place(NetnsKey::Host, k.oif, p)
                && o != NetnsKey::Host
            {
                r.routes_into.entry(o).or_default().push(k.dst);
            }
        }
        r
    }

    /// Where the other end of link `ifindex` of `key` is.
    fn place(&self, key: NetnsKey, ifindex: u32, peer_ifindex: u32) -> Option<(NetnsKey, u32)> {
        self.forward.get(&(key, ifindex)).copied().or_else(|| {
            // The other end placed us: a veth pair names each other.
            self.reverse.get(&(key, ifindex)).copied().filter(|&(ok, oi)| oi == peer_ifindex && ok != key)
        })
    }

    fn link_ref(&self, key: NetnsKey, ifindex: u32, peer_ifindex: u32) -> LinkRef {
        match self.place(key, ifindex, peer_ifindex) {
            Some((o, p)) => LinkRef {
                ifindex: p,
                ifname: self.names.get(&(o, p)).cloned().flatten(),
                netns: self.refs.get(&o).copied(),
            },
            None => LinkRef { ifindex: peer_ifindex, ifname: None, netns: None },
        }
    }
}

fn mac_text(mac: &[u8]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn view(registry: &Registry, resolver: &Resolver, key: NetnsKey, ns: &Netns, now: SystemTime) -> NetnsView {
    let sighting = ns.inode.and_then(|i| registry.sighting(i));
    let interfaces: Vec<InterfaceView> = ns
        .links
        .iter()
        .map(|(&ifindex, l)| InterfaceView {
            ifindex,
            name: l.name.clone(),
            kind: l.kind.clone(),
            up: l.flags & consts::IFF_UP != 0,
            mac: l.mac.as_deref().filter(|m| !m.is_empty()).map(mac_text),
            master: l.master,
            link: l.link.map(|p| resolver.link_ref(key, ifindex, p)),
        })
        .collect();
    let addresses = ns
        .addresses
        .iter()
        .map(|(k, &scope)| AddressView {
            ip: k.ip,
            prefix_len: k.prefix_len,
            ifindex: k.ifindex,
            ifname: ns.links.get(&k.ifindex).and_then(|l| l.name.clone()),
            scope: AddrScope::from_raw(scope),
        })
        .collect();
    let host_routes = resolver.routes_into.get(&key).cloned().unwrap_or_default();
    NetnsView {
        inode: ns.inode,
        nsid: ns.nsid,
        host: key == NetnsKey::Host,
        alive: true,
        first_seen: ns.first_seen,
        age_secs: age(now, ns.first_seen).as_secs(),
        died_at: None,
        death_source: None,
        creator: ns.creator.clone(),
        bind_mounts: sighting.map(|s| s.bind_mounts.clone()).unwrap_or_default(),
        process_count: sighting.map_or(0, |s| s.process_count),
        processes: sighting.map(|s| s.processes.clone()).unwrap_or_default(),
        interfaces,
        addresses,
        host_routes,
    }
}

/// The view of record `id` as it dies at `at`, taken while it is still in
/// the registry (its peers are named through it); `None` if it is not
/// alive.
pub(super) fn dying(registry: &Registry, id: RecordId, source: DeathSource, at: SystemTime) -> Option<NetnsView> {
    let rec = registry.record(id)?;
    let resolver = Resolver::new(registry);
    let mut view = view(registry, &resolver, NetnsKey::Record(id), rec, at);
    view.alive = false;
    if view.bind_mounts.is_empty() {
        view.bind_mounts.clone_from(&rec.last_mounts);
    }
    view.died_at = Some(at);
    view.death_source = Some(source);
    Some(view)
}

/// The whole model at `now`: the agent's own netns, the live ones by first
/// sight, then the recently dead.
pub(super) fn snapshot(registry: &Registry, dead: &DeadViews, stats: ModelStats, now: SystemTime) -> ModelSnapshot {
    let resolver = Resolver::new(registry);
    let host = registry.host();
    let mut netns = vec![view(registry, &resolver, NetnsKey::Host, host, now)];
    let mut live: Vec<(RecordId, &Netns)> = registry.records().collect();
    live.sort_by_key(|&(id, r)| (r.first_seen, id));
    netns.extend(live.into_iter().map(|(id, r)| view(registry, &resolver, NetnsKey::Record(id), r, now)));
    netns.extend(dead.views.iter().map(|d| {
        let mut d = d.clone();
        d.age_secs = age(now, d.first_seen).as_secs();
        d
    }));
    let host_routes = host
        .routes
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
                netns: link.and_then(|l| l.link).and_then(|p| resolver.link_ref(NetnsKey::Host, k.oif, p).netns),
            }
        })
        .collect();
    ModelSnapshot { taken_at: now, netns, host_routes, stats }
}

/// Views of the netns that died recently, oldest death first.
#[derive(Debug)]
pub(super) struct DeadViews {
    views: VecDeque<NetnsView>,
    /// How long one is kept.
    retention: Duration,
    /// At most this many are kept.
    max: usize,
}

impl DeadViews {
    pub(super) fn new(retention: Duration, max: usize) -> Self {
        Self { views: VecDeque::new(), retention, max }
    }

    pub(super) fn push(&mut self, view: NetnsView) {
        self.views.push_back(view);
        if self.views.len() > self.max {
            self.views.pop_front();
        }
    }

    /// Forgets those past the retention (or the limit) at `now`.
    pub(super) fn forget_old(&mut self, now: SystemTime) {
        while self.views.len() > self.max
            || self.views.front().and_then(|d| d.died_at).is_some_and(|t| age(now, t) > self.retention)
        {
            self.views.pop_front();
        }
    }
}
