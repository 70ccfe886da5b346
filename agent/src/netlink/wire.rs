//! rtnetlink messages on the wire: bounds-checked decoding of the messages
//! the model consumes (links, addresses, routes, nsids, errors) and encoding
//! of the few requests it sends. Hand-rolled on purpose: we need a dozen
//! attributes, the target-nsid ones that crates tend to lack, and full
//! control over what a malformed message does (a typed error, never a panic).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Kernel UAPI numbers (`include/uapi/linux/{netlink,rtnetlink,if_link,
/// if_addr,net_namespace}.h`). Stable ABI, spelled out here because libc
/// exposes only part of them on linux-gnu.
pub mod consts {
    pub const NLMSG_HDRLEN: usize = 16;
    pub const NLMSG_NOOP: u16 = 1;
    pub const NLMSG_ERROR: u16 = 2;
    pub const NLMSG_DONE: u16 = 3;
    pub const NLMSG_OVERRUN: u16 = 4;

    pub const NLM_F_REQUEST: u16 = 0x1;
    pub const NLM_F_MULTI: u16 = 0x2;
    pub const NLM_F_DUMP_INTR: u16 = 0x10;
    pub const NLM_F_DUMP: u16 = 0x300;

    pub const RTM_NEWLINK: u16 = 16;
    pub const RTM_DELLINK: u16 = 17;
    pub const RTM_GETLINK: u16 = 18;
    pub const RTM_NEWADDR: u16 = 20;
    pub const RTM_DELADDR: u16 = 21;
    pub const RTM_GETADDR: u16 = 22;
    pub const RTM_NEWROUTE: u16 = 24;
    pub const RTM_DELROUTE: u16 = 25;
    pub const RTM_GETROUTE: u16 = 26;
    pub const RTM_NEWNSID: u16 = 88;
    pub const RTM_DELNSID: u16 = 89;
    pub const RTM_GETNSID: u16 = 90;

    pub const IFLA_ADDRESS: u16 = 1;
    pub const IFLA_IFNAME: u16 = 3;
    pub const IFLA_LINK: u16 = 5;
    pub const IFLA_MASTER: u16 = 10;
    pub const IFLA_LINKINFO: u16 = 18;
    pub const IFLA_LINK_NETNSID: u16 = 37;
    pub const IFLA_TARGET_NETNSID: u16 = 46;
    pub const IFLA_INFO_KIND: u16 = 1;

    pub const IFA_ADDRESS: u16 = 1;
    pub const IFA_LOCAL: u16 = 2;
    pub const IFA_LABEL: u16 = 3;
    pub const IFA_TARGET_NETNSID: u16 = 10;

    pub const RTA_DST: u16 = 1;
    pub const RTA_OIF: u16 = 4;
    pub const RTA_PRIORITY: u16 = 6;
    pub const RTA_TABLE: u16 = 15;

    pub const NETNSA_NSID: u16 = 1;
    pub const NETNSA_FD: u16 = 3;
    /// `NETNSA_NSID_NOT_ASSIGNED`: "no nsid", or "pick one" in `RTM_NEWNSID`.
    pub const NSID_NOT_ASSIGNED: i32 = -1;

    pub const IFF_UP: u32 = 0x1;
    pub const IFF_LOWER_UP: u32 = 0x1_0000;

    pub const AF_UNSPEC: u8 = 0;
    pub const AF_INET: u8 = 2;
    pub const AF_INET6: u8 = 10;

    pub const RT_TABLE_MAIN: u32 = 254;
    pub const RTN_UNICAST: u8 = 1;

    pub const RTNLGRP_LINK: u32 = 1;
    pub const RTNLGRP_IPV4_IFADDR: u32 = 5;
    pub const RTNLGRP_IPV4_ROUTE: u32 = 7;
    pub const RTNLGRP_IPV6_IFADDR: u32 = 9;
    pub const RTNLGRP_IPV6_ROUTE: u32 = 11;
    pub const RTNLGRP_NSID: u32 = 28;

    pub const SOL_NETLINK: i32 = 270;
    pub const NETLINK_ADD_MEMBERSHIP: i32 = 1;
    pub const NETLINK_LISTEN_ALL_NSID: i32 = 8;
    pub const NETLINK_GET_STRICT_CHK: i32 = 12;
}

use consts::{
    AF_INET, AF_INET6, AF_UNSPEC, IFA_ADDRESS, IFA_LABEL, IFA_LOCAL, IFA_TARGET_NETNSID, IFLA_ADDRESS, IFLA_IFNAME,
    IFLA_INFO_KIND, IFLA_LINK, IFLA_LINK_NETNSID, IFLA_LINKINFO, IFLA_MASTER, IFLA_TARGET_NETNSID, NETNSA_FD,
    NETNSA_NSID, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NSID_NOT_ASSIGNED,
    RTA_DST, RTA_OIF, RTA_PRIORITY, RTA_TABLE, RTM_DELADDR, RTM_DELLINK, RTM_DELNSID, RTM_DELROUTE, RTM_GETADDR,
    RTM_GETLINK, RTM_GETNSID, RTM_GETROUTE, RTM_NEWADDR, RTM_NEWLINK, RTM_NEWNSID, RTM_NEWROUTE,
};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{what}: {have} bytes, need {need}")]
    Truncated { what: &'static str, have: usize, need: usize },
    #[error("message header says {len} bytes but {left} remain")]
    BadMessageLength { len: usize, left: usize },
    #[error("attribute {kind} of {what}: length {len} is invalid")]
    BadAttribute { what: &'static str, kind: u16, len: usize },
    #[error("address family {0} is not IPv4 or IPv6")]
    UnknownFamily(u8),
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

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn need(what: &'static str, bytes: &[u8], n: usize) -> Result<(), WireError> {
    if bytes.len() < n { Err(WireError::Truncated { what, have: bytes.len(), need: n }) } else { Ok(()) }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
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
        let len = u32_at(self.rest, 0) as usize;
        if len < NLMSG_HDRLEN || len > self.rest.len() {
            let left = self.rest.len();
            self.rest = &[];
            return Some(Err(WireError::BadMessageLength { len, left }));
        }
        let header = Header {
            kind: u16_at(self.rest, 4),
            flags: u16_at(self.rest, 6),
            seq: u32_at(self.rest, 8),
            port: u32_at(self.rest, 12),
        };
        let payload = &self.rest[NLMSG_HDRLEN..len];
        self.rest = &self.rest[align4(len).min(self.rest.len())..];
        Some(Ok((header, payload)))
    }
}

/// Iterates `(type, value)` over a run of netlink attributes.
struct Attrs<'a> {
    what: &'static str,
    rest: &'a [u8],
}

fn attrs<'a>(what: &'static str, bytes: &'a [u8]) -> Attrs<'a> {
    Attrs { what, rest: bytes }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<(u16, &'a [u8]), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.len() < 4 {
            return None;
        }
        let len = u16_at(self.rest, 0) as usize;
        // NLA_F_NESTED and NLA_F_NET_BYTEORDER live in the top two bits.
        let kind = u16_at(self.rest, 2) & 0x3fff;
        if len < 4 || len > self.rest.len() {
            let what = self.what;
            self.rest = &[];
            return Some(Err(WireError::BadAttribute { what, kind, len }));
        }
        let value = &self.rest[4..len];
        self.rest = &self.rest[align4(len).min(self.rest.len())..];
        Some(Ok((kind, value)))
    }
}

fn attr_u32(what: &'static str, kind: u16, v: &[u8]) -> Result<u32, WireError> {
    if v.len() < 4 {
        return Err(WireError::BadAttribute { what, kind, len: v.len() + 4 });
    }
    Ok(u32_at(v, 0))
}

fn attr_i32(what: &'static str, kind: u16, v: &[u8]) -> Result<i32, WireError> {
    attr_u32(what, kind, v).map(|u| u as i32)
}

fn attr_string(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

fn attr_ip(what: &'static str, kind: u16, family: u8, v: &[u8]) -> Result<IpAddr, WireError> {
    match family {
        AF_INET if v.len() >= 4 => Ok(IpAddr::V4(Ipv4Addr::new(v[0], v[1], v[2], v[3]))),
        AF_INET6 if v.len() >= 16 => {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&v[..16]);
            Ok(IpAddr::V6(Ipv6Addr::from(octets)))
        }
        AF_INET | AF_INET6 => Err(WireError::BadAttribute { what, kind, len: v.len() + 4 }),
        other => Err(WireError::UnknownFamily(other)),
    }
}

/// Decodes one message's payload according to its header.
pub fn decode(header: &Header, payload: &[u8]) -> Result<Message, WireError> {
    Ok(match header.kind {
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
            let error = if payload.len() >= 4 { u32_at(payload, 0) as i32 } else { 0 };
            Message::Done { error }
        }
        NLMSG_ERROR => {
            need("nlmsgerr", payload, 4)?;
            let error = u32_at(payload, 0) as i32;
            let request_seq = (payload.len() >= 4 + NLMSG_HDRLEN).then(|| u32_at(payload, 4 + 8));
            Message::Error { errno: -error, request_seq }
        }
        // NOOP, OVERRUN and groups we never joined.
        _ => Message::Other,
    })
}

fn decode_link(p: &[u8]) -> Result<Link, WireError> {
    const WHAT: &str = "ifinfomsg";
    need(WHAT, p, 16)?;
    let mut link = Link {
        ifindex: u32_at(p, 4),
        name: None,
        kind: None,
        flags: u32_at(p, 8),
        mac: None,
        link: None,
        link_netnsid: None,
        master: None,
        target_nsid: None,
    };
    for attr in attrs(WHAT, &p[16..]) {
        let (kind, v) = attr?;
        match kind {
            IFLA_IFNAME => link.name = Some(attr_string(v)),
            IFLA_ADDRESS => link.mac = Some(v.to_vec()),
            IFLA_LINK => link.link = Some(attr_u32(WHAT, kind, v)?),
            IFLA_MASTER => link.master = Some(attr_u32(WHAT, kind, v)?),
            IFLA_LINK_NETNSID => link.link_netnsid = Some(attr_i32(WHAT, kind, v)?),
            IFLA_TARGET_NETNSID => link.target_nsid = Some(attr_i32(WHAT, kind, v)?),
            IFLA_LINKINFO => {
                for info in attrs("IFLA_LINKINFO", v) {
                    let (info_kind, iv) = info?;
                    if info_kind == IFLA_INFO_KIND {
                        link.kind = Some(attr_string(iv));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(link)
}

fn decode_address(p: &[u8]) -> Result<Address, WireError> {
    const WHAT: &str = "ifaddrmsg";
    need(WHAT, p, 8)?;
    let family = p[0];
    let (mut address, mut local, mut label, mut target_nsid) = (None, None, None, None);
    for attr in attrs(WHAT, &p[8..]) {
        let (kind, v) = attr?;
        match kind {
            IFA_ADDRESS => address = Some(attr_ip(WHAT, kind, family, v)?),
            IFA_LOCAL => local = Some(attr_ip(WHAT, kind, family, v)?),
            IFA_LABEL => label = Some(attr_string(v)),
            IFA_TARGET_NETNSID => target_nsid = Some(attr_i32(WHAT, kind, v)?),
            _ => {}
        }
    }
    let ip =
        local.or(address).ok_or(WireError::Truncated { what: "ifaddrmsg without IFA_ADDRESS", have: 0, need: 1 })?;
    Ok(Address { ifindex: u32_at(p, 4), prefix_len: p[1], scope: p[3], ip, label, target_nsid })
}

fn decode_route(p: &[u8]) -> Result<Route, WireError> {
    const WHAT: &str = "rtmsg";
    need(WHAT, p, 12)?;
    let family = p[0];
    let mut route = Route {
        family,
        dst_len: p[1],
        table: u32::from(p[4]),
        protocol: p[5],
        scope: p[6],
        route_type: p[7],
        dst: None,
        oif: None,
        priority: None,
    };
    for attr in attrs(WHAT, &p[12..]) {
        let (kind, v) = attr?;
        match kind {
            RTA_DST => route.dst = Some(attr_ip(WHAT, kind, family, v)?),
            RTA_OIF => route.oif = Some(attr_u32(WHAT, kind, v)?),
            RTA_PRIORITY => route.priority = Some(attr_u32(WHAT, kind, v)?),
            RTA_TABLE => route.table = attr_u32(WHAT, kind, v)?,
            _ => {}
        }
    }
    Ok(route)
}

fn decode_nsid(p: &[u8]) -> Result<Option<i32>, WireError> {
    const WHAT: &str = "rtgenmsg";
    // rtgenmsg is one byte, padded to four.
    need(WHAT, p, 4)?;
    let mut nsid = None;
    for attr in attrs(WHAT, &p[4..]) {
        let (kind, v) = attr?;
        if kind == NETNSA_NSID {
            nsid = Some(attr_i32(WHAT, kind, v)?).filter(|&n| n != NSID_NOT_ASSIGNED);
        }
    }
    Ok(nsid)
}

/// Builds one request message.
pub struct Request {
    buf: Vec<u8>,
}

impl Request {
    fn new(kind: u16, flags: u16, seq: u32, fixed: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(fixed);
        buf.resize(align4(buf.len()), 0);
        Self { buf }
    }

    fn attr(mut self, kind: u16, value: &[u8]) -> Self {
        let len = (4 + value.len()) as u16;
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// `RTM_GETLINK` dump, of another netns when `target_nsid` is set.
#[must_use]
pub fn dump_links(seq: u32, target_nsid: Option<i32>) -> Vec<u8> {
    let req = Request::new(RTM_GETLINK, NLM_F_DUMP, seq, &[0u8; 16]);
    match target_nsid {
        Some(n) => req.attr(IFLA_TARGET_NETNSID, &n.to_ne_bytes()).finish(),
        None => req.finish(),
    }
}

/// `RTM_GETADDR` dump of both families, of another netns when `target_nsid`
/// is set (needs `NETLINK_GET_STRICT_CHK` on the socket).
#[must_use]
pub fn dump_addresses(seq: u32, target_nsid: Option<i32>) -> Vec<u8> {
    let req = Request::new(RTM_GETADDR, NLM_F_DUMP, seq, &[AF_UNSPEC, 0, 0, 0, 0, 0, 0, 0]);
    match target_nsid {
        Some(n) => req.attr(IFA_TARGET_NETNSID, &n.to_ne_bytes()).finish(),
        None => req.finish(),
    }
}

/// `RTM_GETROUTE` dump of the socket's own netns, both families.
#[must_use]
pub fn dump_routes(seq: u32) -> Vec<u8> {
    Request::new(RTM_GETROUTE, NLM_F_DUMP, seq, &[0u8; 12]).finish()
}

/// `RTM_GETNSID` dump: every nsid the socket's netns has assigned.
#[must_use]
pub fn dump_nsids(seq: u32) -> Vec<u8> {
    Request::new(RTM_GETNSID, NLM_F_DUMP, seq, &[AF_UNSPEC]).finish()
}

/// `RTM_NEWNSID`: give the netns behind `fd` an nsid of the kernel's choice.
/// Fails with EEXIST when it already has one.
#[must_use]
pub fn assign_nsid(seq: u32, fd: i32) -> Vec<u8> {
    Request::new(RTM_NEWNSID, 0, seq, &[AF_UNSPEC])
        .attr(NETNSA_NSID, &NSID_NOT_ASSIGNED.to_ne_bytes())
        .attr(NETNSA_FD, &(fd as u32).to_ne_bytes())
        .finish()
}

/// `RTM_GETNSID`: the nsid of the netns behind `fd`; answered by a
/// `RTM_NEWNSID` with the same sequence number.
#[must_use]
pub fn get_nsid(seq: u32, fd: i32) -> Vec<u8> {
    Request::new(RTM_GETNSID, 0, seq, &[AF_UNSPEC]).attr(NETNSA_FD, &(fd as u32).to_ne_bytes()).finish()
}

/// Encoders for kernel-side messages, so the model can be tested without a
/// kernel.
#[cfg(test)]
pub mod fake {
    use super::{Address, Link, Request, Route, align4, consts::*};
    use std::net::IpAddr;

    fn message(kind: u16, flags: u16, seq: u32, fixed: &[u8], attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut req = Request::new(kind, 0, seq, fixed);
        // Request::new sets NLM_F_REQUEST; kernel messages do not carry it.
        req.buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        for (k, v) in attrs {
            req = req.attr(*k, v);
        }
        req.finish()
    }

    #[must_use]
    pub fn link(kind: u16, seq: u32, l: &Link) -> Vec<u8> {
        let mut fixed = [0u8; 16];
        fixed[4..8].copy_from_slice(&l.ifindex.to_ne_bytes());
        fixed[8..12].copy_from_slice(&l.flags.to_ne_bytes());
        let mut a = Vec::new();
        if let Some(n) = &l.name {
            let mut v = n.as_bytes().to_vec();
            v.push(0);
            a.push((IFLA_IFNAME, v));
        }
        if let Some(x) = l.link {
            a.push((IFLA_LINK, x.to_ne_bytes().to_vec()));
        }
        if let Some(x) = l.link_netnsid {
            a.push((IFLA_LINK_NETNSID, x.to_ne_bytes().to_vec()));
        }
        if let Some(x) = l.target_nsid {
            a.push((IFLA_TARGET_NETNSID, x.to_ne_bytes().to_vec()));
        }
        if let Some(k) = &l.kind {
            let mut v = Vec::new();
            let mut s = k.as_bytes().to_vec();
            s.push(0);
            v.extend_from_slice(&((4 + s.len()) as u16).to_ne_bytes());
            v.extend_from_slice(&IFLA_INFO_KIND.to_ne_bytes());
            v.extend_from_slice(&s);
            v.resize(align4(v.len()), 0);
            a.push((IFLA_LINKINFO, v));
        }
        message(kind, if seq == 0 { 0 } else { NLM_F_MULTI }, seq, &fixed, &a)
    }

    #[must_use]
    pub fn address(kind: u16, seq: u32, a: &Address) -> Vec<u8> {
        let (family, bytes) = match a.ip {
            IpAddr::V4(v4) => (AF_INET, v4.octets().to_vec()),
            IpAddr::V6(v6) => (AF_INET6, v6.octets().to_vec()),
        };
        let mut fixed = [family, a.prefix_len, 0, a.scope, 0, 0, 0, 0];
        fixed[4..8].copy_from_slice(&a.ifindex.to_ne_bytes());
        let mut attrs = vec![(IFA_ADDRESS, bytes)];
        if let Some(n) = a.target_nsid {
            attrs.push((IFA_TARGET_NETNSID, n.to_ne_bytes().to_vec()));
        }
        message(kind, if seq == 0 { 0 } else { NLM_F_MULTI }, seq, &fixed, &attrs)
    }

    #[must_use]
    pub fn route(kind: u16, seq: u32, r: &Route) -> Vec<u8> {
        let fixed = [r.family, r.dst_len, 0, 0, r.table as u8, r.protocol, r.scope, r.route_type, 0, 0, 0, 0];
        let mut attrs = vec![(RTA_TABLE, r.table.to_ne_bytes().to_vec())];
        if let Some(IpAddr::V4(d)) = r.dst {
            attrs.push((RTA_DST, d.octets().to_vec()));
        }
        if let Some(IpAddr::V6(d)) = r.dst {
            attrs.push((RTA_DST, d.octets().to_vec()));
        }
        if let Some(o) = r.oif {
            attrs.push((RTA_OIF, o.to_ne_bytes().to_vec()));
        }
        message(kind, if seq == 0 { 0 } else { NLM_F_MULTI }, seq, &fixed, &attrs)
    }

    #[must_use]
    pub fn nsid(kind: u16, seq: u32, nsid: i32) -> Vec<u8> {
        message(kind, 0, seq, &[AF_UNSPEC], &[(NETNSA_NSID, nsid.to_ne_bytes().to_vec())])
    }

    #[must_use]
    pub fn done(seq: u32) -> Vec<u8> {
        message(NLMSG_DONE, NLM_F_MULTI, seq, &0i32.to_ne_bytes(), &[])
    }

    /// A dump the kernel refused: DONE carrying `-errno`.
    #[must_use]
    pub fn done_refused(seq: u32, errno: i32) -> Vec<u8> {
        message(NLMSG_DONE, NLM_F_MULTI, seq, &(-errno).to_ne_bytes(), &[])
    }

    #[must_use]
    pub fn error(seq: u32, errno: i32) -> Vec<u8> {
        let mut fixed = (-errno).to_ne_bytes().to_vec();
        let mut orig = [0u8; NLMSG_HDRLEN];
        orig[8..12].copy_from_slice(&seq.to_ne_bytes());
        fixed.extend_from_slice(&orig);
        message(NLMSG_ERROR, 0, seq, &fixed, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::{consts::IFF_UP, *};

    fn one(bytes: &[u8]) -> (Header, Message) {
        let mut it = messages(bytes);
        let (h, p) = it.next().expect("one message").expect("frames");
        assert!(it.next().is_none());
        (h, decode(&h, p).expect("decodes"))
    }

    #[test]
    fn link_round_trips_through_the_fake_encoder() {
        let l = Link {
            ifindex: 7,
            name: Some("veth1".into()),
            kind: Some("veth".into()),
            flags: IFF_UP,
            mac: None,
            link: Some(2),
            link_netnsid: Some(3),
            master: None,
            target_nsid: Some(5),
        };
        let (h, m) = one(&fake::link(RTM_NEWLINK, 9, &l));
        assert_eq!(h.seq, 9);
        assert_eq!(m, Message::NewLink(l));
    }

    #[test]
    fn addresses_prefer_ifa_local_and_decode_both_families() {
        let a = Address {
            ifindex: 2,
            prefix_len: 64,
            scope: 0,
            ip: "fd00::5".parse().unwrap(),
            label: None,
            target_nsid: None,
        };
        assert_eq!(one(&fake::address(RTM_DELADDR, 0, &a)).1, Message::DelAddress(a));
        // IPv4 with IFA_LOCAL differing from IFA_ADDRESS (point-to-point).
        let mut msg = Request::new(RTM_NEWADDR, 0, 0, &[AF_INET, 32, 0, 0, 3, 0, 0, 0])
            .attr(IFA_ADDRESS, &[10, 0, 0, 1])
            .attr(IFA_LOCAL, &[10, 0, 0, 2])
            .finish();
        msg[6] = 0;
        let Message::NewAddress(got) = one(&msg).1 else { panic!("not an address") };
        assert_eq!(got.ip, "10.0.0.2".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn nsid_not_assigned_is_none() {
        assert_eq!(one(&fake::nsid(RTM_NEWNSID, 0, -1)).1, Message::NewNsid { nsid: None });
        assert_eq!(one(&fake::nsid(RTM_DELNSID, 0, 4)).1, Message::DelNsid { nsid: Some(4) });
    }

    #[test]
    fn errors_carry_the_request_sequence() {
        assert_eq!(
            one(&fake::error(12, libc::EEXIST)).1,
            Message::Error { errno: libc::EEXIST, request_seq: Some(12) }
        );
    }

    #[test]
    fn requests_have_consistent_lengths() {
        for req in [dump_links(1, Some(2)), dump_addresses(1, None), dump_routes(3), dump_nsids(4), assign_nsid(5, 9)] {
            assert_eq!(u32_at(&req, 0) as usize, req.len());
            assert_eq!(req.len() % 4, 0);
            assert!(u16_at(&req, 6) & NLM_F_REQUEST != 0);
        }
    }

    #[test]
    fn a_lying_length_stops_the_datagram() {
        let mut bytes = fake::done(1);
        bytes[0] = 200;
        assert!(matches!(messages(&bytes).next(), Some(Err(WireError::BadMessageLength { .. }))));
        let mut attr = fake::nsid(RTM_NEWNSID, 0, 1);
        attr[20] = 99; // attribute length past the end
        let (h, p) = messages(&attr).next().unwrap().unwrap();
        assert!(matches!(decode(&h, p), Err(WireError::BadAttribute { .. })));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_datagrams_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            for (h, p) in messages(&bytes).flatten() {
                let _ = decode(&h, p);
            }
        }

        #[test]
        fn arbitrary_payloads_never_panic(kind in 0u16..100, payload in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let h = Header { kind, flags: 0, seq: 0, port: 0 };
            let _ = decode(&h, &payload);
        }
    }
}
