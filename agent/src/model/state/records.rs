//! What the registry holds, and the names the model's parts share: a
//! netns record with its links, addresses and host routes, the key of a
//! netns, the kernel's tables and their entries, and how a netlink message
//! maps onto them.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, time::SystemTime};

use super::super::snapshot::{Creator, HardwareAddr, NetnsInode};
use crate::{
    ipam::SharedStr,
    netlink::wire::{Address, Route, consts},
};

pub(super) type RecordId = u64;

/// A netns in the registry: the agent's own, or the record of another.
/// Ordered so that a view's reads can be kept sorted (see `Views::keep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum NetnsKey {
    Host,
    Record(RecordId),
}

/// The kernel tables the model mirrors; a dump lists one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Table {
    Links,
    Addresses,
    Routes,
    Nsids,
}

/// One entry the kernel showed, in a dump or a notification: what a dump's
/// mark-and-sweep marks as still there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Entry {
    Link(u32),
    Addr(AddrKey),
    Route(RouteKey),
    Nsid(i32),
}

impl Entry {
    pub(super) fn table(self) -> Table {
        match self {
            Self::Link(_) => Table::Links,
            Self::Addr(_) => Table::Addresses,
            Self::Route(_) => Table::Routes,
            Self::Nsid(_) => Table::Nsids,
        }
    }
}

/// Where a link's `IFLA_LINK` points, in the agent's frame of reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkNetns {
    Same,
    /// nsid as the agent's netns numbers it.
    Nsid(i32),
    /// Only an event from inside the netns said so, in that netns's own
    /// numbering (or not at all): a dump will tell.
    Unverified,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct LinkState {
    pub(super) name: Option<SharedStr>,
    pub(super) kind: Option<SharedStr>,
    pub(super) flags: u32,
    pub(super) mac: Option<HardwareAddr>,
    pub(super) link: Option<u32>,
    pub(super) link_netns: LinkNetns,
    pub(super) master: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct AddrKey {
    pub(super) ifindex: u32,
    pub(super) ip: IpAddr,
    pub(super) prefix_len: u8,
    /// The peer of a point-to-point address: the kernel holds two
    /// addresses with one local end and two peers, and deletes them apart.
    pub(super) peer: Option<IpAddr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct RouteKey {
    pub(super) dst: IpAddr,
    pub(super) dst_len: u8,
    pub(super) table: u32,
    pub(super) priority: u32,
    pub(super) oif: u32,
}

#[derive(Debug, Clone)]
pub(super) struct Netns {
    pub(super) inode: Option<NetnsInode>,
    pub(super) nsid: Option<i32>,
    pub(super) first_seen: SystemTime,
    /// Last time the kernel showed it alive (an event from it, a dump part
    /// about it, an nsid reply): the earliest it can have died.
    pub(super) last_alive: SystemTime,
    /// Registry epoch at creation: a sweep only judges records older than it.
    pub(super) born: u64,
    pub(super) creator: Option<Creator>,
    /// Where it was last seen bind-mounted: `ip netns del` unmounts before
    /// the netns dies, and a death notice should still name the path a CNI
    /// runtime knew it by.
    pub(super) last_mounts: Vec<PathBuf>,
    pub(super) links: BTreeMap<u32, LinkState>,
    /// Address -> `ifa_scope`.
    pub(super) addresses: BTreeMap<AddrKey, u8>,
    /// Host route -> `rtm_protocol` (the agent's own netns only).
    pub(super) routes: BTreeMap<RouteKey, u8>,
}

impl Netns {
    pub(super) fn new(inode: Option<NetnsInode>, nsid: Option<i32>, now: SystemTime, born: u64) -> Self {
        Self {
            inode,
            nsid,
            first_seen: now,
            last_alive: now,
            born,
            creator: None,
            last_mounts: Vec::new(),
            links: BTreeMap::new(),
            addresses: BTreeMap::new(),
            routes: BTreeMap::new(),
        }
    }
}

pub(super) fn is_host_route(r: &Route) -> bool {
    let full = match r.family {
        consts::AF_INET => 32,
        consts::AF_INET6 => 128,
        _ => return false,
    };
    r.route_type == consts::RTN_UNICAST
        && r.table == consts::RT_TABLE_MAIN
        && r.dst_len == full
        && r.dst.is_some()
        && r.oif.is_some()
}

pub(super) fn route_key(r: &Route) -> Option<RouteKey> {
    Some(RouteKey { dst: r.dst?, dst_len: r.dst_len, table: r.table, priority: r.priority.unwrap_or(0), oif: r.oif? })
}

pub(super) fn addr_key(a: &Address) -> AddrKey {
    AddrKey { ifindex: a.ifindex, ip: a.ip, prefix_len: a.prefix_len, peer: a.peer }
}
