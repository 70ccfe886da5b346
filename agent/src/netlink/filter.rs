//! A classic BPF socket filter for the model's socket: the kernel drops the
//! notifications the model never reads before they are queued, so they
//! neither wake the agent nor cost a parse.
//!
//! In a pod cycle about half of what `NETLINK_LISTEN_ALL_NSID` hears is
//! such noise: every pod's local-table, prefix and IPv6 routes (the model
//! keeps host routes of its own netns only: main table, /32 or /128) and a
//! bridge's `AF_BRIDGE` view of its ports (the model reads links in their
//! `AF_UNSPEC` form only; the decoder ignores other families too, so a
//! socket without this filter reads the same model).
//!
//! Only single notifications are judged. Dump parts (`NLM_F_MULTI`, several
//! messages in one datagram), acks, errors, nsid and address messages always
//! pass: a filter that cut into a dump would end it early.

use std::{io, mem::size_of, os::fd::RawFd};

use libc::{BPF_ABS, BPF_B, BPF_H, BPF_JEQ, BPF_JMP, BPF_JSET, BPF_K, BPF_LD, BPF_RET, sock_filter, sock_fprog};

/// Byte offsets in a datagram that starts with a `nlmsghdr` (16 bytes).
const NLMSG_TYPE: u32 = 4;
const NLMSG_FLAGS: u32 = 6;
/// `ifinfomsg.ifi_family` and the `rtmsg` fields, after the header.
const IFI_FAMILY: u32 = 16;
const RTM_FAMILY: u32 = 16;
const RTM_DST_LEN: u32 = 17;
const RTM_TABLE: u32 = 20;

const KEEP: u32 = u32::MAX;
const DROP: u32 = 0;

/// A 16-bit field as a classic BPF half-word load sees it: loads are in
/// network byte order, netlink's fields in the host's.
fn as_loaded(value: u16) -> u32 {
    u32::from(u16::from_be_bytes(value.to_ne_bytes()))
}

/// Where a conditional jump goes: the next instruction or a label.
#[derive(Clone, Copy)]
enum To {
    Next,
    Label(&'static str),
}

/// One instruction of the program as written: labels instead of the
/// relative offsets the kernel wants (resolved by [`assemble`]).
enum Op {
    /// Names the next instruction.
    At(&'static str),
    Stmt(u32, u32),
    Jump(u32, u32, To, To),
}

fn assemble(ops: &[Op]) -> Vec<sock_filter> {
    let mut at = std::collections::HashMap::new();
    let mut n = 0usize;
    for op in ops {
        match op {
            Op::At(name) => {
                at.insert(*name, n);
            }
            _ => n += 1,
        }
    }
    let mut out = Vec::with_capacity(n);
    for op in ops {
        let here = out.len();
        // Offsets count from the instruction after the jump; the program
        // is ours and short, so every label exists and lies ahead.
        let offset = |to: To| match to {
            To::Next => 0,
            To::Label(name) => at.get(name).map_or(0, |&t: &usize| u8::try_from(t - here - 1).unwrap_or(0)),
        };
        match *op {
            Op::At(_) => {}
            Op::Stmt(code, k) => out.push(sock_filter { code: code as u16, jt: 0, jf: 0, k }),
            Op::Jump(code, k, jt, jf) => {
                out.push(sock_filter { code: code as u16, jt: offset(jt), jf: offset(jf), k });
            }
        }
    }
    out
}

/// The model's filter. Keeps a route notification only when it could be a
/// host route (main table, IPv4 /32 or IPv6 /128: the header fields of
/// `is_host_route`; its type is not judged, so that a route replaced by
/// another type is still seen to leave), and a link notification only in
/// its `AF_UNSPEC` form. Everything else passes.
#[must_use]
pub fn model_notifications() -> Vec<sock_filter> {
    use {
        Op::{At, Jump, Stmt},
        To::{Label, Next},
    };
    let ld_h = BPF_LD | BPF_H | BPF_ABS;
    let ld_b = BPF_LD | BPF_B | BPF_ABS;
    let jeq = BPF_JMP | BPF_JEQ | BPF_K;
    let jset = BPF_JMP | BPF_JSET | BPF_K;
    let multi = as_loaded(libc::NLM_F_MULTI as u16);
    assemble(&[
        Stmt(ld_h, NLMSG_TYPE),
        Jump(jeq, as_loaded(libc::RTM_NEWLINK), Label("link"), Next),
        Jump(jeq, as_loaded(libc::RTM_DELLINK), Label("link"), Next),
        Jump(jeq, as_loaded(libc::RTM_NEWROUTE), Label("route"), Next),
        Jump(jeq, as_loaded(libc::RTM_DELROUTE), Label("route"), Label("keep")),
        // Links: a dump part passes; a notification only as AF_UNSPEC.
        At("link"),
        Stmt(ld_h, NLMSG_FLAGS),
        Jump(jset, multi, Label("keep"), Next),
        Stmt(ld_b, IFI_FAMILY),
        Jump(jeq, libc::AF_UNSPEC as u32, Label("keep"), Label("drop")),
        // Routes: a dump part passes; a notification only from the main
        // table with a full-length destination.
        At("route"),
        Stmt(ld_h, NLMSG_FLAGS),
        Jump(jset, multi, Label("keep"), Next),
        Stmt(ld_b, RTM_TABLE),
        Jump(jeq, u32::from(libc::RT_TABLE_MAIN), Next, Label("drop")),
        Stmt(ld_b, RTM_FAMILY),
        Jump(jeq, libc::AF_INET as u32, Label("v4"), Next),
        Jump(jeq, libc::AF_INET6 as u32, Label("v6"), Label("drop")),
        At("v4"),
        Stmt(ld_b, RTM_DST_LEN),
        Jump(jeq, 32, Label("keep"), Label("drop")),
        At("v6"),
        Stmt(ld_b, RTM_DST_LEN),
        Jump(jeq, 128, Label("keep"), Label("drop")),
        At("keep"),
        Stmt(BPF_RET | BPF_K, KEEP),
        At("drop"),
        Stmt(BPF_RET | BPF_K, DROP),
    ])
}

/// The death bell's filter: only `RTM_DELNSID` passes. The bell's socket
/// hears the nsid group of the agent's own netns and carries no requests,
/// so each datagram it keeps is one netns losing its nsid here.
#[must_use]
pub fn nsid_deaths() -> Vec<sock_filter> {
    use {
        Op::{At, Jump, Stmt},
        To::{Label, Next},
    };
    assemble(&[
        Stmt(BPF_LD | BPF_H | BPF_ABS, NLMSG_TYPE),
        Jump(BPF_JMP | BPF_JEQ | BPF_K, as_loaded(libc::RTM_DELNSID), Next, Label("drop")),
        Stmt(BPF_RET | BPF_K, KEEP),
        At("drop"),
        Stmt(BPF_RET | BPF_K, DROP),
    ])
}

/// Attaches `program` to the socket `fd` (`SO_ATTACH_FILTER`).
pub fn attach(fd: RawFd, program: &[sock_filter]) -> io::Result<()> {
    let len = u16::try_from(program.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let fprog = sock_fprog { len, filter: program.as_ptr().cast_mut() };
    // SAFETY: fprog points at `len` instructions that outlive the call; the
    // kernel copies them.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&raw const fprog).cast(),
            size_of::<sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    //! The program run by the kernel itself: datagrams sent through a
    //! unix socket pair whose reader has the filter attached.

    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use super::*;
    use crate::netlink::wire::{Link, Route, consts::*, fake};

    fn pair() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: fds has room for the two descriptors.
        let rc =
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_NONBLOCK, 0, fds.as_mut_ptr()) };
        assert_eq!(rc, 0, "socketpair: {}", io::Error::last_os_error());
        // SAFETY: both fds were just created and are owned by nobody else.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    /// Whether the model's filtered reader receives `datagram`.
    fn kept(datagram: &[u8]) -> bool {
        kept_by(&model_notifications(), datagram)
    }

    /// Whether a reader filtered by `program` receives `datagram`.
    fn kept_by(program: &[sock_filter], datagram: &[u8]) -> bool {
        let (writer, reader) = pair();
        attach(reader.as_raw_fd(), program).expect("attach");
        // SAFETY: a valid fd and a buffer of the stated length.
        let sent = unsafe { libc::send(writer.as_raw_fd(), datagram.as_ptr().cast(), datagram.len(), 0) };
        assert_eq!(sent, datagram.len() as isize);
        let mut buf = [0u8; 4096];
        // SAFETY: as above.
        let got = unsafe { libc::recv(reader.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if got < 0 {
            assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EAGAIN));
        }
        got == datagram.len() as isize
    }

    fn route(dst: &str, dst_len: u8, table: u32) -> Route {
        let dst: std::net::IpAddr = dst.parse().expect("ip");
        Route {
            family: if dst.is_ipv4() { AF_INET } else { AF_INET6 },
            dst_len,
            table,
            protocol: 4,
            scope: 0,
            route_type: RTN_UNICAST,
            dst: Some(dst),
            oif: Some(5),
            priority: None,
        }
    }

    fn link() -> Link {
        Link {
            ifindex: 7,
            name: Some("veth1".into()),
            kind: None,
            flags: 0,
            mac: None,
            link: None,
            link_netnsid: None,
            master: None,
            target_nsid: None,
        }
    }

    fn with_family(mut bytes: Vec<u8>, family: i32) -> Vec<u8> {
        bytes[16] = family as u8;
        bytes
    }

    fn with_flags(mut bytes: Vec<u8>, flags: u16) -> Vec<u8> {
        bytes[6..8].copy_from_slice(&flags.to_ne_bytes());
        bytes
    }

    #[test]
    fn host_routes_pass_and_other_routes_are_dropped() {
        for kind in [RTM_NEWROUTE, RTM_DELROUTE] {
            assert!(kept(&fake::route(kind, 0, &route("10.1.0.5", 32, RT_TABLE_MAIN))));
            assert!(kept(&fake::route(kind, 0, &route("fd00::5", 128, RT_TABLE_MAIN))));
            // The local table, prefixes, and IPv4 at 128 / IPv6 at 32.
            assert!(!kept(&fake::route(kind, 0, &route("10.1.0.5", 32, 255))));
            assert!(!kept(&fake::route(kind, 0, &route("10.1.0.0", 24, RT_TABLE_MAIN))));
            assert!(!kept(&fake::route(kind, 0, &route("fe80::", 64, RT_TABLE_MAIN))));
            assert!(!kept(&fake::route(kind, 0, &route("fd00::5", 32, RT_TABLE_MAIN))));
            assert!(!kept(&with_family(fake::route(kind, 0, &route("10.1.0.5", 32, RT_TABLE_MAIN)), AF_INET6.into())));
        }
    }

    #[test]
    fn links_pass_unless_another_family_views_them() {
        let link = link();
        for kind in [RTM_NEWLINK, RTM_DELLINK] {
            assert!(kept(&fake::link(kind, 0, &link)));
            assert!(!kept(&with_family(fake::link(kind, 0, &link), libc::AF_BRIDGE)));
        }
    }

    #[test]
    fn dump_parts_and_everything_else_pass() {
        let multi = libc::NLM_F_MULTI as u16;
        // What a notification would lose passes as part of a dump.
        assert!(kept(&with_flags(fake::route(RTM_NEWROUTE, 3, &route("10.1.0.0", 24, 255)), multi)));
        let link = link();
        assert!(kept(&with_flags(with_family(fake::link(RTM_NEWLINK, 3, &link), libc::AF_BRIDGE), multi)));
        // Other kinds, whatever their bytes say.
        for kind in
            [RTM_NEWNSID, RTM_DELNSID, RTM_NEWADDR, RTM_DELADDR, libc::NLMSG_DONE as u16, libc::NLMSG_ERROR as u16]
        {
            assert!(kept(&fake::raw(kind, 0, 0, &[0xff; 12])), "kind {kind}");
        }
        // Too short for the fields the filter reads: the kernel never sends
        // one; dropped rather than read past its end.
        assert!(!kept(&fake::raw(RTM_NEWROUTE, 0, 0, &[])));
    }

    #[test]
    fn the_death_bell_hears_nsid_deaths_only() {
        let bell = nsid_deaths();
        assert!(kept_by(&bell, &fake::raw(RTM_DELNSID, 0, 0, &[0; 12])));
        let link = link();
        for datagram in [
            fake::raw(RTM_NEWNSID, 0, 0, &[0; 12]),
            fake::link(RTM_NEWLINK, 0, &link),
            fake::link(RTM_DELLINK, 0, &link),
            fake::raw(RTM_DELADDR, 0, 0, &[0; 12]),
            fake::raw(libc::NLMSG_ERROR as u16, 0, 0, &[0; 12]),
        ] {
            assert!(!kept_by(&bell, &datagram));
        }
    }
}
