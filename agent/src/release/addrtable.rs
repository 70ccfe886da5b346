//! The IPv4 addresses of every netns with an nsid here, kept by the
//! kernel's own events, so that the last look drains what changed since the
//! previous look instead of dumping every netns again (issue 13.4; the
//! facts below were checked in `docs/lastlook-events.md`).
//!
//! Why the table after a drain holds every IPv4 address configured before
//! the drain began, in every netns it has a table for:
//! - an IPv4 address's RTM_NEWADDR is queued on every listener within the
//!   syscall that adds it (`__inet_insert_ifa` -> `rtmsg_ifa`), and its
//!   RTM_DELADDR within the one that removes it;
//! - a netns's events reach a `NETLINK_LISTEN_ALL_NSID` socket only while
//!   it has an nsid here. RTM_NEWNSID (group NSID, from our own netns) is
//!   queued when the nsid is given, before any event tagged with it;
//!   RTM_DELNSID of a dying netns is queued before the nsid can name
//!   another. Either drops that nsid's table, and the next look seeds it
//!   again by a dump;
//! - events queued before a seeding dump and drained after it replay on
//!   top of it harmlessly: an address is keyed by the kernel's identity of
//!   it, so its last event decides whether it is there, and the dump saw
//!   the state that event left or a later one;
//! - an overrun (ENOBUFS) or a message that does not decode means events
//!   were lost: the tables they may concern are dropped and seeded again.
//!
//! The host's own netns has an nsid for itself here (the kernel gives it
//! one as soon as a dump shows a link whose peer is in it, and the table
//! gives it one when it has none): its events come tagged with that nsid,
//! or with none before it had one. Both are the host, one table.
//!
//! IPv6 is not kept: an address added with `nodad` (or on an optimistic
//! DAD host) is notified from the `addrconf_wq` workqueue after the adding
//! syscall returned (`addrconf_dad_start`), so a look asked about an IPv6
//! address dumps every netns's IPv6 addresses instead.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
};

use crate::netlink::{
    RECV_BUFFER, RtnlSocket, SocketError, SocketOptions,
    query::{Querier, QueryError},
    wire::{self, Address, Message, consts},
};

/// Receive buffer of the events socket: it hears the IPv4 address events of
/// every netns of the node, and is drained by every look and once a second
/// between them ([`crate::release::lastlook::drain_between_looks`]). A node
/// busier than that overruns it, and an overrun costs one full look (every
/// table seeded again). It is not grown: between looks nothing needs the
/// events soon, and a larger queue would only hold more kernel memory.
const EVENTS_BUFFER: usize = 4 << 20;

/// A netns of the table: `None` is netreap's own.
pub type Origin = Option<i32>;

/// The kernel's identity of an IPv4 address (`__inet_insert_ifa` refuses a
/// second address with the same mask, local end and masked peer on one
/// device; the full peer here is finer, so two kernel addresses never
/// share a key, and an address's DELADDR carries the key of its NEWADDR).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    ifindex: u32,
    prefix_len: u8,
    ip: IpAddr,
    peer: Option<IpAddr>,
}

impl Key {
    fn of(a: &Address) -> Option<Self> {
        a.ip.is_ipv4().then_some(Self { ifindex: a.ifindex, prefix_len: a.prefix_len, ip: a.ip, peer: a.peer })
    }
}

/// What the drains and seeds did, for tests and the bench.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableCounts {
    /// Tables seeded by a dump.
    pub seeded: u64,
    /// Events applied.
    pub events: u64,
    /// Times every table was dropped (overrun, or a message of our own
    /// netns that did not decode).
    pub resets: u64,
}

/// IPv4 addresses per netns, kept by events between looks.
pub struct AddressTable {
    events: RtnlSocket,
    /// The host's nsid for itself, fixed for the table's life (an nsid is
    /// never taken from a live netns).
    host_nsid: i32,
    buf: Vec<u8>,
    tables: HashMap<Origin, HashSet<Key>>,
    counts: TableCounts,
    /// Seeding dumps per netns (tests: a kept table is not dumped again).
    #[cfg(test)]
    pub(crate) seeds: HashMap<Origin, u32>,
}

impl AddressTable {
    /// Subscribes before any table is seeded: nothing falls between a
    /// seeding dump and the events that follow it.
    /// `q` gives the host's netns its nsid for itself if it has none yet.
    pub fn open(q: &mut Querier) -> Result<Self, TableError> {
        Self::open_with_buffer(q, EVENTS_BUFFER)
    }

    /// [`AddressTable::open`] with a receive buffer of `bytes` (tests
    /// overrun a small one).
    pub fn open_with_buffer(q: &mut Querier, bytes: usize) -> Result<Self, TableError> {
        let events = RtnlSocket::open(&SocketOptions {
            groups: vec![consts::RTNLGRP_IPV4_IFADDR, consts::RTNLGRP_NSID],
            listen_all_nsid: true,
            receive_buffer: bytes,
            nonblocking: true,
        })?;
        let own = std::fs::File::open("/proc/self/ns/net").map_err(TableError::OwnNetns)?;
        let host_nsid = q.nsid_of(std::os::fd::AsRawFd::as_raw_fd(&own), true)?.ok_or(TableError::NoHostNsid)?;
        Ok(Self {
            events,
            host_nsid,
            buf: vec![0; RECV_BUFFER],
            tables: HashMap::new(),
            counts: TableCounts::default(),
            #[cfg(test)]
            seeds: HashMap::new(),
        })
    }

    #[must_use]
    pub fn counts(&self) -> TableCounts {
        self.counts
    }

    /// The host's nsid for itself (its events may carry it).
    #[must_use]
    pub fn host_nsid(&self) -> i32 {
        self.host_nsid
    }

    /// Applies every event queued until now. `Err`: the socket failed; the
    /// caller drops the whole table.
    pub fn drain(&mut self) -> Result<(), SocketError> {
        loop {
            let datagram = match self.events.recv(&mut self.buf) {
                Ok(Some(d)) => d,
                Ok(None) => return Ok(()),
                Err(SocketError::Overrun) => {
                    self.reset("the events socket overran");
                    continue;
                }
                Err(e) => return Err(e),
            };
            let origin = host_as_none(self.host_nsid, datagram.origin_nsid);
            let mut broken = false;
            for item in wire::messages(&self.buf[..datagram.len]) {
                let Ok((header, payload)) = item else {
                    broken = true;
                    break;
                };
                match wire::decode(&header, payload) {
                    Ok(message) => {
                        self.counts.events += 1;
                        apply(&mut self.tables, origin, message);
                    }
                    Err(_) => broken = true,
                }
            }
            if broken {
                match origin {
                    // An nsid event of ours may be among what was lost.
                    None => self.reset("a message of netreap's own netns did not decode"),
                    Some(_) => {
                        self.tables.remove(&origin);
                    }
                }
            }
        }
    }

    /// Seeds the table of `origin` by a dump unless it has one. `Ok(false)`
    /// when the kernel refused the dump: the nsid names no netns now.
    pub fn seed(&mut self, q: &mut Querier, origin: Origin) -> Result<bool, QueryError> {
        let origin = host_as_none(self.host_nsid, origin);
        if self.tables.contains_key(&origin) {
            return Ok(true);
        }
        let mut table = HashSet::new();
        if !q.each_address(origin, wire::Family::Inet, |a| {
            table.extend(Key::of(a));
        })? {
            return Ok(false);
        }
        self.counts.seeded += 1;
        #[cfg(test)]
        {
            *self.seeds.entry(origin).or_default() += 1;
        }
        self.tables.insert(origin, table);
        Ok(true)
    }

    /// The netns that have a table.
    pub fn origins(&self) -> impl Iterator<Item = Origin> + '_ {
        self.tables.keys().copied()
    }

    /// Every netns whose table holds one of `ips`, with the IP.
    pub fn holding<'a>(&'a self, ips: &'a [IpAddr]) -> impl Iterator<Item = (IpAddr, Origin)> + 'a {
        self.tables
            .iter()
            .flat_map(|(&origin, keys)| keys.iter().filter(|k| ips.contains(&k.ip)).map(move |k| (k.ip, origin)))
    }

    fn reset(&mut self, why: &str) {
        tracing::debug!("last look: {why}; every address table is seeded again");
        self.tables.clear();
        self.counts.resets += 1;
    }
}

/// The host is `None`, whether an event or a question names it by its
/// nsid for itself or not at all.
fn host_as_none(host_nsid: i32, origin: Origin) -> Origin {
    origin.filter(|&n| n != host_nsid)
}

/// Why no table could be made (the look then dumps every netns).
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error("opening netreap's own netns: {0}")]
    OwnNetns(std::io::Error),
    #[error("the kernel gave netreap's own netns no nsid")]
    NoHostNsid,
}

/// One event: an address of `origin` added or removed; an nsid of ours
/// given or taken (its table, if any, described another netns or is about
/// to: seeded again).
fn apply(tables: &mut HashMap<Origin, HashSet<Key>>, origin: Origin, message: Message) {
    match message {
        Message::NewAddress(a) => {
            if let (Some(table), Some(key)) = (tables.get_mut(&origin), Key::of(&a)) {
                table.insert(key);
            }
        }
        Message::DelAddress(a) => {
            if let (Some(table), Some(key)) = (tables.get_mut(&origin), Key::of(&a)) {
                table.remove(&key);
            }
        }
        // nsids in other netns (their own view of their peers) are theirs.
        Message::NewNsid { nsid: Some(nsid) } | Message::DelNsid { nsid: Some(nsid) } if origin.is_none() => {
            tables.remove(&Some(nsid));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::wire::{
        consts::{RTM_DELADDR, RTM_DELNSID, RTM_NEWADDR, RTM_NEWNSID},
        fake,
    };

    fn addr(ifindex: u32, ip: &str) -> Address {
        Address {
            ifindex,
            prefix_len: 24,
            scope: 0,
            ip: ip.parse().expect("an IP"),
            peer: None,
            label: None,
            target_nsid: None,
        }
    }

    fn decoded(bytes: &[u8]) -> Message {
        let (h, p) = wire::messages(bytes).next().expect("a message").expect("frames");
        wire::decode(&h, p).expect("decodes")
    }

    fn table(entries: &[(Origin, Address)]) -> HashMap<Origin, HashSet<Key>> {
        let mut t: HashMap<Origin, HashSet<Key>> = HashMap::new();
        for (o, a) in entries {
            t.entry(*o).or_default().extend(Key::of(a));
        }
        t
    }

    fn ips(t: &HashMap<Origin, HashSet<Key>>, origin: Origin) -> Vec<String> {
        let mut v: Vec<String> = t.get(&origin).into_iter().flatten().map(|k| k.ip.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn events_of_a_seeded_netns_are_applied_and_others_wait_for_their_seed() {
        let mut t = table(&[(Some(3), addr(2, "10.0.0.5"))]);
        t.insert(None, HashSet::new());
        apply(&mut t, Some(3), decoded(&fake::address(RTM_NEWADDR, 0, &addr(2, "10.0.0.6"))));
        apply(&mut t, Some(3), decoded(&fake::address(RTM_DELADDR, 0, &addr(2, "10.0.0.5"))));
        apply(&mut t, None, decoded(&fake::address(RTM_NEWADDR, 0, &addr(1, "192.0.2.1"))));
        // No table for nsid 4 yet: its seeding dump will show this address.
        apply(&mut t, Some(4), decoded(&fake::address(RTM_NEWADDR, 0, &addr(2, "10.0.0.7"))));
        assert_eq!(ips(&t, Some(3)), ["10.0.0.6"]);
        assert_eq!(ips(&t, None), ["192.0.2.1"]);
        assert!(!t.contains_key(&Some(4)));
    }

    #[test]
    fn replaying_events_older_than_the_seed_leaves_what_the_last_event_says() {
        // Seeded after "add .5, del .5, add .6" happened; all three are
        // still queued and replayed on the dump.
        let mut t = table(&[(Some(3), addr(2, "10.0.0.6"))]);
        for (kind, ip) in [(RTM_NEWADDR, "10.0.0.5"), (RTM_DELADDR, "10.0.0.5"), (RTM_NEWADDR, "10.0.0.6")] {
            apply(&mut t, Some(3), decoded(&fake::address(kind, 0, &addr(2, ip))));
        }
        assert_eq!(ips(&t, Some(3)), ["10.0.0.6"]);
    }

    #[test]
    fn an_nsid_given_or_taken_drops_its_table() {
        for kind in [RTM_NEWNSID, RTM_DELNSID] {
            let mut t = table(&[(Some(3), addr(2, "10.0.0.5")), (Some(4), addr(2, "10.0.0.9"))]);
            apply(&mut t, None, decoded(&fake::nsid(kind, 0, 3)));
            assert!(!t.contains_key(&Some(3)), "{kind}");
            assert_eq!(ips(&t, Some(4)), ["10.0.0.9"]);
            // Another netns's own nsids say nothing about ours.
            apply(&mut t, Some(7), decoded(&fake::nsid(kind, 0, 4)));
            assert_eq!(ips(&t, Some(4)), ["10.0.0.9"], "{kind}");
        }
    }

    #[test]
    fn two_peers_of_one_local_address_are_two_addresses() {
        let a = Address { peer: Some("10.9.0.1".parse().expect("IP")), prefix_len: 32, ..addr(2, "10.9.0.2") };
        let b = Address { peer: Some("10.9.0.3".parse().expect("IP")), ..a.clone() };
        let mut t = table(&[(Some(3), a.clone()), (Some(3), b)]);
        apply(&mut t, Some(3), decoded(&fake::address(RTM_DELADDR, 0, &a)));
        assert_eq!(ips(&t, Some(3)), ["10.9.0.2"], "the other peer's address is still there");
    }

    #[test]
    fn the_hosts_own_nsid_is_the_host() {
        assert_eq!(host_as_none(4, Some(4)), None);
        assert_eq!(host_as_none(4, None), None);
        assert_eq!(host_as_none(4, Some(5)), Some(5));
    }

    #[test]
    fn ipv6_is_not_kept() {
        let mut t = table(&[]);
        t.insert(Some(3), HashSet::new());
        apply(&mut t, Some(3), decoded(&fake::address(RTM_NEWADDR, 0, &addr(2, "fd00::5"))));
        assert!(ips(&t, Some(3)).is_empty());
    }
}
