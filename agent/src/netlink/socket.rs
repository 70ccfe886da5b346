//! The rtnetlink socket: one per agent, in its own netns, that hears every
//! netns with an nsid (`NETLINK_LISTEN_ALL_NSID`) and carries our requests.
//! Requests and notifications share it on purpose: the kernel queues replies
//! and notifications in one order, so a reply can never overtake the death
//! of the netns it describes.

use std::{
    io,
    mem::{size_of, zeroed},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
};

use super::wire::consts::{NETLINK_ADD_MEMBERSHIP, NETLINK_GET_STRICT_CHK, NETLINK_LISTEN_ALL_NSID, SOL_NETLINK};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("cannot open a NETLINK_ROUTE socket: {0}")]
    Open(#[source] io::Error),
    #[error("setsockopt {option}: {source}")]
    Option { option: &'static str, source: io::Error },
    #[error("cannot bind the netlink socket: {0}")]
    Bind(#[source] io::Error),
    #[error("sending a netlink request: {0}")]
    Send(#[source] io::Error),
    #[error("receiving from netlink: {0}")]
    Recv(#[source] io::Error),
    /// ENOBUFS: the kernel dropped notifications; state must be resynced.
    #[error("netlink receive buffer overrun: notifications were lost")]
    Overrun,
}

/// What the socket should hear.
#[derive(Debug, Clone)]
pub struct SocketOptions {
    /// rtnetlink multicast groups (`RTNLGRP_*`).
    pub groups: Vec<u32>,
    /// Hear the groups of every netns that has an nsid here.
    pub listen_all_nsid: bool,
    /// Receive buffer; a large one makes ENOBUFS rare (`SO_RCVBUFFORCE`).
    pub receive_buffer: usize,
    pub nonblocking: bool,
}

/// One datagram as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Datagram {
    pub len: usize,
    /// The nsid (in our netns) of the netns the messages come from, from
    /// the `NETLINK_LISTEN_ALL_NSID` control message; `None` for our own
    /// netns and for replies to our requests.
    pub origin_nsid: Option<i32>,
}

#[derive(Debug)]
pub struct RtnlSocket {
    fd: OwnedFd,
}

fn setsockopt_int(fd: RawFd, level: i32, option: i32, name: &'static str, value: i32) -> Result<(), SocketError> {
    // SAFETY: a valid socket fd and a pointer to an int of the stated size.
    let rc =
        unsafe { libc::setsockopt(fd, level, option, (&raw const value).cast(), size_of::<i32>() as libc::socklen_t) };
    if rc < 0 { Err(SocketError::Option { option: name, source: io::Error::last_os_error() }) } else { Ok(()) }
}

/// Largest receive buffer an overrun may grow the socket to.
pub const MAX_RECEIVE_BUFFER: usize = 64 << 20;

impl RtnlSocket {
    /// The kernel's receive buffer size (what it counts, i.e. doubled).
    pub fn receive_buffer(&self) -> Result<usize, SocketError> {
        let mut value: i32 = 0;
        let mut len = size_of::<i32>() as libc::socklen_t;
        // SAFETY: a valid socket fd and an int-sized out buffer.
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&raw mut value).cast(),
                &raw mut len,
            )
        };
        if rc < 0 {
            return Err(SocketError::Option { option: "SO_RCVBUF", source: io::Error::last_os_error() });
        }
        Ok(usize::try_from(value).unwrap_or(0))
    }

    /// Doubles the receive buffer, up to [`MAX_RECEIVE_BUFFER`]: after an
    /// overrun, so that a node busier than the buffer was sized for
    /// converges instead of overrunning on every resync. Returns the new size.
    pub fn grow_receive_buffer(&self) -> Result<usize, SocketError> {
        let current = self.receive_buffer()?;
        let wanted = (current.max(4096) * 2).min(MAX_RECEIVE_BUFFER);
        if wanted <= current {
            return Ok(current);
        }
        let value = i32::try_from(wanted).unwrap_or(i32::MAX);
        let raw = self.fd.as_raw_fd();
        if setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, "SO_RCVBUFFORCE", value).is_err() {
            setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, "SO_RCVBUF", value)?;
        }
        self.receive_buffer()
    }

    pub fn open(options: &SocketOptions) -> Result<Self, SocketError> {
        let mut ty = libc::SOCK_RAW | libc::SOCK_CLOEXEC;
        if options.nonblocking {
            ty |= libc::SOCK_NONBLOCK;
        }
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(libc::AF_NETLINK, ty, libc::NETLINK_ROUTE) };
        if raw < 0 {
            return Err(SocketError::Open(io::Error::last_os_error()));
        }
        // SAFETY: socket(2) just returned this fd and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let sock = Self { fd };
        let raw = sock.fd.as_raw_fd();
        let buf = i32::try_from(options.receive_buffer).unwrap_or(i32::MAX);
        // SO_RCVBUFFORCE needs CAP_NET_ADMIN; fall back to the capped one.
        if setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, "SO_RCVBUFFORCE", buf).is_err() {
            setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, "SO_RCVBUF", buf)?;
        }
        // Strict checking is what makes the kernel honour IFA_TARGET_NETNSID.
        setsockopt_int(raw, SOL_NETLINK, NETLINK_GET_STRICT_CHK, "NETLINK_GET_STRICT_CHK", 1)?;
        if options.listen_all_nsid {
            setsockopt_int(raw, SOL_NETLINK, NETLINK_LISTEN_ALL_NSID, "NETLINK_LISTEN_ALL_NSID", 1)?;
        }
        // SAFETY: zeroed sockaddr_nl is valid; port 0 lets the kernel pick.
        let mut addr: libc::sockaddr_nl = unsafe { zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: valid fd and address of the stated size.
        let rc =
            unsafe { libc::bind(raw, (&raw const addr).cast(), size_of::<libc::sockaddr_nl>() as libc::socklen_t) };
        if rc < 0 {
            return Err(SocketError::Bind(io::Error::last_os_error()));
        }
        // Subscribing after bind and before the first dump: nothing falls
        // between the dump and the notifications.
        for &group in &options.groups {
            setsockopt_int(raw, SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, "NETLINK_ADD_MEMBERSHIP", group as i32)?;
        }
        Ok(sock)
    }

    /// Sends one request to the kernel.
    pub fn send(&self, request: &[u8]) -> Result<(), SocketError> {
        // SAFETY: zeroed sockaddr_nl addresses the kernel (port 0).
        let mut kernel: libc::sockaddr_nl = unsafe { zeroed() };
        kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        loop {
            // SAFETY: valid fd, buffer and address.
            let n = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    request.as_ptr().cast(),
                    request.len(),
                    0,
                    (&raw const kernel).cast(),
                    size_of::<libc::sockaddr_nl>() as libc::socklen_t,
                )
            };
            if n >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(SocketError::Send(e));
            }
        }
    }

    /// Receives one datagram into `buf`. `Ok(None)` when nothing is queued
    /// (non-blocking socket). A datagram larger than `buf` is an error
    /// rather than a silently cut message.
    pub fn recv(&self, buf: &mut [u8]) -> Result<Option<Datagram>, SocketError> {
        // Room for one cmsghdr carrying an int, with alignment slack.
        let mut control = [0u64; 8];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: zeroed msghdr is a valid empty header; fields set below.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; 8]>();
        let n = loop {
            // SAFETY: msg points at live buffers of the stated sizes.
            let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &raw mut msg, 0) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::EAGAIN) => return Ok(None),
                Some(libc::ENOBUFS) => return Err(SocketError::Overrun),
                _ => return Err(SocketError::Recv(e)),
            }
        };
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(SocketError::Recv(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("datagram larger than the {}-byte buffer", buf.len()),
            )));
        }
        let mut origin_nsid = None;
        // SAFETY: msg was filled by recvmsg; the CMSG_* macros walk the
        // control buffer within msg_controllen.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            while !cmsg.is_null() {
                let c = &*cmsg;
                let data_len = c.cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                if c.cmsg_level == SOL_NETLINK && c.cmsg_type == NETLINK_LISTEN_ALL_NSID && data_len >= 4 {
                    origin_nsid = Some(std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>()));
                }
                cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
            }
        }
        Ok(Some(Datagram { len: n, origin_nsid }))
    }
}

impl AsRawFd for RtnlSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for RtnlSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
