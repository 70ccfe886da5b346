//! Kernel-side messages built with netlink-packet-route's emitters, so the
//! model can be tested without a kernel.

use std::num::NonZeroI32;

use netlink_packet_core::{DoneMessage, ErrorMessage, NLM_F_MULTIPART, NetlinkPayload};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
    nsid::{NsidAttribute, NsidMessage},
    route::{RouteAddress, RouteAttribute, RouteMessage},
};

use super::{
    Address, Link, Route,
    consts::{NLMSG_HDRLEN, RTM_DELADDR, RTM_DELLINK, RTM_DELNSID, RTM_DELROUTE},
    serialize,
};

/// Dump parts carry NLM_F_MULTI; notifications (seq 0) do not.
fn multi(seq: u32) -> u16 {
    if seq == 0 { 0 } else { NLM_F_MULTIPART }
}

fn inner(seq: u32, message: RouteNetlinkMessage) -> Vec<u8> {
    serialize(multi(seq), seq, NetlinkPayload::InnerMessage(message))
}

/// `RTM_NEWLINK`, or `RTM_DELLINK` when `kind` says so.
#[must_use]
pub fn link(kind: u16, seq: u32, l: &Link) -> Vec<u8> {
    let mut m = LinkMessage::default();
    m.header.index = l.ifindex;
    m.header.flags = LinkFlags::from_bits_retain(l.flags);
    let a = &mut m.attributes;
    a.extend(l.name.clone().map(LinkAttribute::IfName));
    a.extend(l.link.map(LinkAttribute::Link));
    a.extend(l.link_netnsid.map(LinkAttribute::LinkNetNsId));
    a.extend(l.target_nsid.map(LinkAttribute::IfNetnsId));
    a.extend(l.kind.as_deref().map(|k| LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::from(k))])));
    inner(seq, if kind == RTM_DELLINK { RouteNetlinkMessage::DelLink(m) } else { RouteNetlinkMessage::NewLink(m) })
}

/// `RTM_NEWADDR`, or `RTM_DELADDR` when `kind` says so.
#[must_use]
pub fn address(kind: u16, seq: u32, a: &Address) -> Vec<u8> {
    let mut m = AddressMessage::default();
    m.header.family = if a.ip.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    m.header.prefix_len = a.prefix_len;
    m.header.scope = a.scope.into();
    m.header.index = a.ifindex;
    if let Some(peer) = a.peer {
        m.attributes.push(AddressAttribute::Local(a.ip));
        m.attributes.push(AddressAttribute::Address(peer));
    } else {
        m.attributes.push(AddressAttribute::Address(a.ip));
    }
    m.attributes.extend(a.target_nsid.map(AddressAttribute::TargetNetNsId));
    inner(
        seq,
        if kind == RTM_DELADDR { RouteNetlinkMessage::DelAddress(m) } else { RouteNetlinkMessage::NewAddress(m) },
    )
}

/// `RTM_NEWROUTE`, or `RTM_DELROUTE` when `kind` says so.
#[must_use]
pub fn route(kind: u16, seq: u32, r: &Route) -> Vec<u8> {
    let mut m = RouteMessage::default();
    m.header.address_family = r.family.into();
    m.header.destination_prefix_length = r.dst_len;
    m.header.table = r.table as u8;
    m.header.protocol = r.protocol.into();
    m.header.scope = r.scope.into();
    m.header.kind = r.route_type.into();
    m.attributes.push(RouteAttribute::Table(r.table));
    m.attributes.extend(r.dst.map(|d| RouteAttribute::Destination(RouteAddress::from(d))));
    m.attributes.extend(r.oif.map(RouteAttribute::Oif));
    m.attributes.extend(r.priority.map(RouteAttribute::Priority));
    inner(seq, if kind == RTM_DELROUTE { RouteNetlinkMessage::DelRoute(m) } else { RouteNetlinkMessage::NewRoute(m) })
}

/// `RTM_NEWNSID`, or `RTM_DELNSID` when `kind` says so.
#[must_use]
pub fn nsid(kind: u16, seq: u32, nsid: i32) -> Vec<u8> {
    let mut m = NsidMessage::default();
    m.attributes.push(NsidAttribute::Id(nsid));
    let message = if kind == RTM_DELNSID { RouteNetlinkMessage::DelNsId(m) } else { RouteNetlinkMessage::NewNsId(m) };
    serialize(0, seq, NetlinkPayload::InnerMessage(message))
}

#[must_use]
pub fn done(seq: u32) -> Vec<u8> {
    done_refused(seq, 0)
}

/// A dump the kernel refused: DONE carrying `-errno`.
#[must_use]
pub fn done_refused(seq: u32, errno: i32) -> Vec<u8> {
    let mut done = DoneMessage::default();
    done.code = -errno;
    serialize(NLM_F_MULTIPART, seq, NetlinkPayload::Done(done))
}

/// `NLMSG_ERROR` answering request `seq` with `errno` (0: an ACK).
#[must_use]
pub fn error(seq: u32, errno: i32) -> Vec<u8> {
    let mut request = [0u8; NLMSG_HDRLEN];
    request[8..12].copy_from_slice(&seq.to_ne_bytes());
    let mut error = ErrorMessage::default();
    error.code = NonZeroI32::new(-errno);
    error.header = request.to_vec();
    serialize(0, seq, NetlinkPayload::Error(error))
}

/// Raw bytes of a message of type `kind` (for malformed input).
#[must_use]
pub fn raw(kind: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(NLMSG_HDRLEN + payload.len());
    buf.extend_from_slice(&((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf
}
