//! rtnetlink messages on the wire, through `netlink-packet-core` (framing,
//! DONE, ERROR) and `netlink-packet-route` (links, addresses, routes,
//! nsids): decoding into the few types the model consumes, and building the
//! requests it sends.
//!
//! Only the attributes the model reads are parsed, each with the crate's
//! parser; the others are skipped unparsed. A link event must not be lost
//! because the crate disagrees with a newer kernel about an attribute
//! netreap never looks at (statistics, AF_SPEC, ...). Malformed framing, or
//! a malformed attribute the model reads, is a typed [`WireError`], never a
//! panic.

use std::net::IpAddr;

use netlink_packet_core::{
    DoneBuffer, Emitable, ErrorBuffer, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_ECHO, NLM_F_REQUEST, NLMSG_DONE,
    NLMSG_ERROR, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NlaBuffer, NlasIterator, Parseable,
    ParseableParametrized,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressHeader, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkHeader, LinkMessage},
    nsid::{NsidAttribute, NsidHeader, NsidMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteLwEnCapType, RouteMessage},
};

/// Kernel UAPI numbers the model and the socket use (`include/uapi/linux/
/// {netlink,rtnetlink,if}.h`), from libc: netlink-packet-route keeps its
/// own private.
pub mod consts {
    pub const NLMSG_HDRLEN: usize = 16;

    pub const RTM_NEWLINK: u16 = libc::RTM_NEWLINK;
    pub const RTM_DELLINK: u16 = libc::RTM_DELLINK;
    pub const RTM_GETLINK: u16 = libc::RTM_GETLINK;
    pub const RTM_NEWADDR: u16 = libc::RTM_NEWADDR;
    pub const RTM_DELADDR: u16 = libc::RTM_DELADDR;
    pub const RTM_GETADDR: u16 = libc::RTM_GETADDR;
    pub const RTM_NEWROUTE: u16 = libc::RTM_NEWROUTE;
    pub const RTM_DELROUTE: u16 = libc::RTM_DELROUTE;
    pub const RTM_GETROUTE: u16 = libc::RTM_GETROUTE;
    pub const RTM_NEWNSID: u16 = libc::RTM_NEWNSID;
    pub const RTM_DELNSID: u16 = libc::RTM_DELNSID;
    pub const RTM_GETNSID: u16 = libc::RTM_GETNSID;

    /// `NETNSA_NSID_NOT_ASSIGNED`: "no nsid", or "pick one" in `RTM_NEWNSID`.
    pub const NSID_NOT_ASSIGNED: i32 = -1;

    pub const IFF_UP: u32 = libc::IFF_UP as u32;
    pub const IFF_LOWER_UP: u32 = libc::IFF_LOWER_UP as u32;

    pub const AF_UNSPEC: u8 = libc::AF_UNSPEC as u8;
    pub const AF_INET: u8 = libc::AF_INET as u8;
    pub const AF_INET6: u8 = libc::AF_INET6 as u8;

    pub const RT_TABLE_MAIN: u32 = libc::RT_TABLE_MAIN as u32;
    pub const RTN_UNICAST: u8 = libc::RTN_UNICAST;

    pub const RTNLGRP_LINK: u32 = libc::RTNLGRP_LINK;
    pub const RTNLGRP_IPV4_IFADDR: u32 = libc::RTNLGRP_IPV4_IFADDR;
    pub const RTNLGRP_IPV4_ROUTE: u32 = libc::RTNLGRP_IPV4_ROUTE;
    pub const RTNLGRP_IPV6_IFADDR: u32 = libc::RTNLGRP_IPV6_IFADDR;
    pub const RTNLGRP_IPV6_ROUTE: u32 = libc::RTNLGRP_IPV6_ROUTE;
    pub const RTNLGRP_NSID: u32 = libc::RTNLGRP_NSID;
}

use consts::{
    NLMSG_HDRLEN, NSID_NOT_ASSIGNED, RTM_DELADDR, RTM_DELLINK, RTM_DELNSID, RTM_DELROUTE, RTM_NEWADDR, RTM_NEWLINK,
    RTM_NEWNSID, RTM_NEWROUTE,
};

// Attribute numbers of the attributes decoded below, to skip the others
// before parsing them.
const IFLA_ADDRESS: u16 = libc::IFLA_ADDRESS;
const IFLA_IFNAME: u16 = libc::IFLA_IFNAME;
const IFLA_LINK: u16 = libc::IFLA_LINK;
const IFLA_MASTER: u16 = libc::IFLA_MASTER;
const IFLA_LINKINFO: u16 = libc::IFLA_LINKINFO;
const IFLA_LINK_NETNSID: u16 = libc::IFLA_LINK_NETNSID;
/// `IFLA_TARGET_NETNSID`, which netlink-packet-route calls by its older
/// alias `IFLA_IF_NETNSID` (`LinkAttribute::IfNetnsId`).
const IFLA_TARGET_NETNSID: u16 = libc::IFLA_IF_NETNSID;
const IFLA_INFO_KIND: u16 = libc::IFLA_INFO_KIND;
const IFA_ADDRESS: u16 = libc::IFA_ADDRESS;
const IFA_LOCAL: u16 = libc::IFA_LOCAL;
const IFA_LABEL: u16 = libc::IFA_LABEL;
const IFA_TARGET_NETNSID: u16 = 10;
const RTA_DST: u16 = libc::RTA_DST;
const RTA_OIF: u16 = libc::RTA_OIF;
const RTA_PRIORITY: u16 = libc::RTA_PRIORITY;
const RTA_TABLE: u16 = libc::RTA_TABLE;
const NETNSA_NSID: u16 = 1;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The length field of a message lies: nothing after it can be framed.
    #[error("message header says {len} bytes but {left} remain")]
    BadMessageLength { len: usize, left: usize },
    /// The crate's parser refused part of a message.
    #[error("{what}: {reason}")]
    Malformed { what: &'static str, reason: String },
    #[error("ifaddrmsg without IFA_ADDRESS or IFA_LOCAL")]
    NoAddress,
}

fn malformed(what: &'static str) -> impl FnOnce(netlink_packet_core::DecodeError) -> WireError {
    move |e| WireError::Malformed { what, reason: e.to_string() }
}

/// The fixed netlink header of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    pub port: u32,
}

impl Header {
    #[must_use]
    pub fn dump_interrupted(&self) -> bool {
        self.flags & NLM_F_DUMP_INTR != 0
    }
}

/// Where a veth's peer (or a macvlan's lower device) lives, as the message
/// said it: `IFLA_LINK_NETNSID` is relative to the netns that *built* the
/// message (the requester for a dump, the device's own netns for an event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub ifindex: u32,
    pub name: Option<String>,
    pub kind: Option<String>,
    pub flags: u32,
    pub mac: Option<Vec<u8>>,
    /// `IFLA_LINK`: peer/lower ifindex.
    pub link: Option<u32>,
    pub link_netnsid: Option<i32>,
    pub master: Option<u32>,
    /// Echo of `IFLA_TARGET_NETNSID` in a targeted dump.
    pub target_nsid: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    pub ifindex: u32,
    pub prefix_len: u8,
    pub scope: u8,
    /// `IFA_LOCAL` when present (the local end of a point-to-point link),
    /// otherwise `IFA_ADDRESS`.
    pub ip: IpAddr,
    /// `IFA_ADDRESS` when it differs from `ip` (the peer of a point-to-point
    /// link). Part of the kernel's identity of an IPv4 address: two
    /// addresses with the same local end and different peers are two.
    pub peer: Option<IpAddr>,
    pub label: Option<String>,
    pub target_nsid: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub family: u8,
    pub dst_len: u8,
    pub table: u32,
    pub protocol: u8,
    pub scope: u8,
    pub route_type: u8,
    pub dst: Option<IpAddr>,
    pub oif: Option<u32>,
    pub priority: Option<u32>,
}

/// The address family a dump asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `AF_UNSPEC`: both, in one dump (`rtnl_dump_all`, which takes the
    /// RTNL for each family).
    Both,
    /// `AF_INET` alone (an RTNL-free dump).
    Inet,
    /// `AF_INET6` alone (an RTNL-free dump).
    Inet6,
}

/// One decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    NewLink(Link),
    DelLink(Link),
    NewAddress(Address),
    DelAddress(Address),
    NewRoute(Route),
    DelRoute(Route),
    /// `RTM_NEWNSID`: a notification, a GETNSID reply or a dump part.
    NewNsid {
        nsid: Option<i32>,
    },
    DelNsid {
        nsid: Option<i32>,
    },
    /// End of a dump; a negative `error` means the dump failed.
    Done {
        error: i32,
    },
    /// `NLMSG_ERROR`: `errno` 0 is an acknowledgement. `request_seq` is the
    /// sequence number of the request it answers.
    Error {
        errno: i32,
        request_seq: Option<u32>,
    },
    /// Anything else (NOOP, OVERRUN, types we did not subscribe to).
    Other,
}

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Splits a datagram into messages. A message whose length field lies ends
/// the datagram with an error: nothing after it can be framed.
#[must_use]
pub fn messages(datagram: &[u8]) -> Messages<'_> {
    Messages { rest: datagram }
}

pub struct Messages<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<(Header, &'a [u8]), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.len() < NLMSG_HDRLEN {
            // Trailing padding shorter than a header is not an error.
            return None;
        }
        let Ok(buffer) = NetlinkBuffer::new_checked(self.rest) else {
            // Checked above that the header is there: the length lies.
            let len = NetlinkBuffer::new(self.rest).length() as usize;
            let left = self.rest.len();
            self.rest = &[];
            return Some(Err(WireError::BadMessageLength { len, left }));
        };
        let header = Header {
            kind: buffer.message_type(),
            flags: buffer.flags(),
            seq: buffer.sequence_number(),
            port: buffer.port_number(),
        };
        let len = buffer.length() as usize;
        let payload = buffer.payload();
        self.rest = &self.rest[align4(len).min(self.rest.len())..];
        Some(Ok((header, payload)))
    }
}

/// The attributes after a fixed header of `header_len` bytes whose type is
/// in `wanted`; framing errors end the run with an error.
fn wanted_attributes<'a>(
    what: &'static str,
    payload: &'a [u8],
    header_len: usize,
    wanted: &'static [u16],
) -> impl Iterator<Item = Result<NlaBuffer<&'a [u8]>, WireError>> {
    NlasIterator::new(payload.get(header_len..).unwrap_or_default())
        .map(move |nla| nla.map_err(malformed(what)))
        .filter(move |nla| nla.as_ref().map_or(true, |nla| wanted.contains(&nla.kind())))
}

/// Decodes one message's payload according to its header.
pub fn decode(header: &Header, payload: &[u8]) -> Result<Message, WireError> {
    Ok(match header.kind {
        // Another family's view of a link is not the link: a bridge sends
        // its ports as AF_BRIDGE (without the veth's peer), and its
        // DELLINK means the port left the bridge, not that it is gone.
        RTM_NEWLINK | RTM_DELLINK if payload.first().is_some_and(|&family| i32::from(family) != libc::AF_UNSPEC) => {
            Message::Other
        }
        RTM_NEWLINK => Message::NewLink(decode_link(payload)?),
        RTM_DELLINK => Message::DelLink(decode_link(payload)?),
        RTM_NEWADDR => Message::NewAddress(decode_address(payload)?),
        RTM_DELADDR => Message::DelAddress(decode_address(payload)?),
        RTM_NEWROUTE => Message::NewRoute(decode_route(payload)?),
        RTM_DELROUTE => Message::DelRoute(decode_route(payload)?),
        RTM_NEWNSID => Message::NewNsid { nsid: decode_nsid(payload)? },
        RTM_DELNSID => Message::DelNsid { nsid: decode_nsid(payload)? },
        NLMSG_DONE => {
            // Old kernels may send DONE without the error word.
            let error = DoneBuffer::new_checked(payload).map_or(0, |done| done.code());
            Message::Done { error }
        }
        NLMSG_ERROR => {
            let error = ErrorBuffer::new_checked(payload).map_err(malformed("nlmsgerr"))?;
            let errno = error.code().map_or(0, |code| code.get().saturating_neg());
            // The header of the request it answers (its payload may be cut).
            let request = error.payload();
            let request_seq = (request.len() >= NLMSG_HDRLEN).then(|| NetlinkBuffer::new(request).sequence_number());
            Message::Error { errno, request_seq }
        }
        // NOOP, OVERRUN and groups we never joined.
        _ => Message::Other,
    })
}

fn decode_link(payload: &[u8]) -> Result<Link, WireError> {
    const WHAT: &str = "ifinfomsg";
    const WANTED: &[u16] =
        &[IFLA_IFNAME, IFLA_ADDRESS, IFLA_LINK, IFLA_MASTER, IFLA_LINK_NETNSID, IFLA_TARGET_NETNSID, IFLA_LINKINFO];
    let header = LinkHeader::parse(payload).map_err(malformed(WHAT))?;
    let mut link = Link {
        ifindex: header.index,
        name: None,
        kind: None,
        flags: header.flags.bits(),
        mac: None,
        link: None,
        link_netnsid: None,
        master: None,
        target_nsid: None,
    };
    for nla in wanted_attributes(WHAT, payload, header.buffer_len(), WANTED) {
        let nla = nla?;
        if nla.kind() == IFLA_LINKINFO {
            // Only IFLA_INFO_KIND: the kind-specific data is not needed,
            // and a kind the crate does not know must not cost the link.
            for info in NlasIterator::new(nla.value()) {
                let info = info.map_err(malformed("IFLA_LINKINFO"))?;
                if info.kind() == IFLA_INFO_KIND {
                    link.kind = Some(InfoKind::parse(&info).map_err(malformed("IFLA_INFO_KIND"))?.to_string());
                }
            }
            continue;
        }
        match LinkAttribute::parse_with_param(&nla, header.interface_family).map_err(malformed(WHAT))? {
            LinkAttribute::IfName(name) => link.name = Some(name),
            LinkAttribute::Address(mac) => link.mac = Some(mac),
            LinkAttribute::Link(index) => link.link = Some(index),
            LinkAttribute::Controller(index) => link.master = Some(index),
            LinkAttribute::LinkNetNsId(nsid) => link.link_netnsid = Some(nsid),
            LinkAttribute::IfNetnsId(nsid) => link.target_nsid = Some(nsid),
            _ => {}
        }
    }
    Ok(link)
}

fn decode_address(payload: &[u8]) -> Result<Address, WireError> {
    const WHAT: &str = "ifaddrmsg";
    const WANTED: &[u16] = &[IFA_ADDRESS, IFA_LOCAL, IFA_LABEL, IFA_TARGET_NETNSID];
    let header = AddressHeader::parse(payload).map_err(malformed(WHAT))?;
    let (mut address, mut local, mut label, mut target_nsid) = (None, None, None, None);
    for nla in wanted_attributes(WHAT, payload, header.buffer_len(), WANTED) {
        match AddressAttribute::parse(&nla?).map_err(malformed(WHAT))? {
            AddressAttribute::Address(ip) => address = Some(ip),
            AddressAttribute::Local(ip) => local = Some(ip),
            AddressAttribute::Label(l) => label = Some(l),
            AddressAttribute::TargetNetNsId(nsid) => target_nsid = Some(nsid),
            _ => {}
        }
    }
    let ip = local.or(address).ok_or(WireError::NoAddress)?;
    let peer = address.filter(|a| *a != ip);
    Ok(Address {
        ifindex: header.index,
        prefix_len: header.prefix_len,
        scope: header.scope.into(),
        ip,
        peer,
        label,
        target_nsid,
    })
}

fn decode_route(payload: &[u8]) -> Result<Route, WireError> {
    const WHAT: &str = "rtmsg";
    const WANTED: &[u16] = &[RTA_DST, RTA_OIF, RTA_PRIORITY, RTA_TABLE];
    let header = RouteHeader::parse(payload).map_err(malformed(WHAT))?;
    let family = header.address_family;
    let mut route = Route {
        family: family.into(),
        dst_len: header.destination_prefix_length,
        table: u32::from(header.table),
        protocol: header.protocol.into(),
        scope: header.scope.into(),
        route_type: header.kind.into(),
        dst: None,
        oif: None,
        priority: None,
    };
    for nla in wanted_attributes(WHAT, payload, header.buffer_len(), WANTED) {
        let param = (family, header.kind, RouteLwEnCapType::default());
        match RouteAttribute::parse_with_param(&nla?, param).map_err(malformed(WHAT))? {
            RouteAttribute::Destination(RouteAddress::Inet(ip)) => route.dst = Some(ip.into()),
            RouteAttribute::Destination(RouteAddress::Inet6(ip)) => route.dst = Some(ip.into()),
            RouteAttribute::Oif(index) => route.oif = Some(index),
            RouteAttribute::Priority(priority) => route.priority = Some(priority),
            RouteAttribute::Table(table) => route.table = table,
            // Including an MPLS (or other non-IP) RTA_DST from an AF_UNSPEC
            // dump: not an IP route, which the model tells by `family`.
            _ => {}
        }
    }
    Ok(route)
}

fn decode_nsid(payload: &[u8]) -> Result<Option<i32>, WireError> {
    const WHAT: &str = "rtgenmsg";
    let header = NsidHeader::parse(payload).map_err(malformed(WHAT))?;
    let mut nsid = None;
    for nla in wanted_attributes(WHAT, payload, header.buffer_len(), &[NETNSA_NSID]) {
        if let NsidAttribute::Id(n) = NsidAttribute::parse(&nla?).map_err(malformed(WHAT))? {
            nsid = Some(n).filter(|&n| n != NSID_NOT_ASSIGNED);
        }
    }
    Ok(nsid)
}

/// Serializes one message with the given header flags and sequence number.
fn serialize(flags: u16, seq: u32, payload: NetlinkPayload<RouteNetlinkMessage>) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut message = NetlinkMessage::new(header, payload);
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    buf
}

fn request(flags: u16, seq: u32, message: RouteNetlinkMessage) -> Vec<u8> {
    serialize(NLM_F_REQUEST | flags, seq, NetlinkPayload::InnerMessage(message))
}

/// `RTM_GETLINK` dump, of another netns when `target_nsid` is set.
#[must_use]
pub fn dump_links(seq: u32, target_nsid: Option<i32>) -> Vec<u8> {
    let mut message = LinkMessage::default();
    message.attributes.extend(target_nsid.map(LinkAttribute::IfNetnsId));
    request(NLM_F_DUMP, seq, RouteNetlinkMessage::GetLink(message))
}

/// `RTM_GETADDR` dump of `family`, of another netns when `target_nsid`
/// is set (needs `NETLINK_GET_STRICT_CHK` on the socket).
#[must_use]
pub fn dump_addresses(seq: u32, target_nsid: Option<i32>, family: Family) -> Vec<u8> {
    let mut message = AddressMessage::default();
    message.header.family = match family {
        Family::Both => AddressFamily::Unspec,
        Family::Inet => AddressFamily::Inet,
        Family::Inet6 => AddressFamily::Inet6,
    };
    message.attributes.extend(target_nsid.map(AddressAttribute::TargetNetNsId));
    request(NLM_F_DUMP, seq, RouteNetlinkMessage::GetAddress(message))
}

/// `RTM_GETROUTE` dump of the socket's own netns, both families.
#[must_use]
pub fn dump_routes(seq: u32) -> Vec<u8> {
    request(NLM_F_DUMP, seq, RouteNetlinkMessage::GetRoute(RouteMessage::default()))
}

/// `RTM_GETNSID` dump: every nsid the socket's netns has assigned.
#[must_use]
pub fn dump_nsids(seq: u32) -> Vec<u8> {
    request(NLM_F_DUMP, seq, RouteNetlinkMessage::GetNsId(NsidMessage::default()))
}

/// `RTM_NEWNSID`: give the netns behind `fd` an nsid of the kernel's choice.
/// Fails with EEXIST when it already has one.
#[must_use]
pub fn assign_nsid(seq: u32, fd: i32) -> Vec<u8> {
    let mut message = NsidMessage::default();
    message.attributes = vec![NsidAttribute::Id(NSID_NOT_ASSIGNED), NsidAttribute::Fd(fd as u32)];
    request(0, seq, RouteNetlinkMessage::NewNsId(message))
}

/// [`assign_nsid`] with `NLM_F_ECHO`: the kernel answers a successful
/// assignment with the `RTM_NEWNSID` it notifies, carrying the nsid, so no
/// `RTM_GETNSID` needs to follow (since Linux 5.4, "netns: fix NLM_F_ECHO
/// mechanism for RTM_NEWNSID", Oct 2019; before, nothing). `ack` also asks
/// for the acknowledgement, sent after the echo: a kernel without the echo
/// answers that alone rather than nothing.
#[must_use]
pub fn assign_nsid_echo(seq: u32, fd: i32, ack: bool) -> Vec<u8> {
    let mut message = NsidMessage::default();
    message.attributes = vec![NsidAttribute::Id(NSID_NOT_ASSIGNED), NsidAttribute::Fd(fd as u32)];
    let flags = NLM_F_ECHO | if ack { NLM_F_ACK } else { 0 };
    request(flags, seq, RouteNetlinkMessage::NewNsId(message))
}

/// `RTM_GETNSID`: the nsid of the netns behind `fd`; answered by a
/// `RTM_NEWNSID` with the same sequence number.
#[must_use]
pub fn get_nsid(seq: u32, fd: i32) -> Vec<u8> {
    let mut message = NsidMessage::default();
    message.attributes = vec![NsidAttribute::Fd(fd as u32)];
    request(0, seq, RouteNetlinkMessage::GetNsId(message))
}

/// Encoders for kernel-side messages, so the model can be tested without a
/// kernel.
#[cfg(test)]
pub mod fake;

#[cfg(test)]
mod tests;
