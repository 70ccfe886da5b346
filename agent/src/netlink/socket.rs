//! The rtnetlink socket: one per agent, in its own netns, that hears every
//! netns with an nsid (`NETLINK_LISTEN_ALL_NSID`) and carries our requests.
//! Requests and notifications share it on purpose: the kernel queues replies
//! and notifications in one order, so a reply can never overtake the death
//! of the netns it describes. That, and the per-datagram nsid, is why this
//! is a netlink-sys socket read with `recvmsg` and not an `rtnetlink`
//! connection: that one reads with `recvfrom` (no control messages) and
//! hands replies and notifications to two different channels.

use std::{
    io,
    mem::{size_of, zeroed},
    os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd},
};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

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

/// A netlink-sys socket; received with our own `recvmsg`, because
/// netlink-sys (and every connection built on it) reads with `recvfrom`
/// and so never sees the `NETLINK_LISTEN_ALL_NSID` control message that
/// says which netns a datagram comes from.
#[derive(Debug)]
pub struct RtnlSocket {
    socket: Socket,
}

/// `SO_RCVBUFFORCE` (CAP_NET_ADMIN may exceed `rmem_max`), which
/// netlink-sys does not offer, falling back to its capped `SO_RCVBUF`.
fn force_receive_buffer(socket: &Socket, bytes: usize) -> Result<(), SocketError> {
    let value = i32::try_from(bytes).unwrap_or(i32::MAX);
    // SAFETY: a valid socket fd and a pointer to an int of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const value).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    socket.set_rx_buf_sz(value).map_err(|source| SocketError::Option { option: "SO_RCVBUF", source })
}

fn option(option: &'static str) -> impl FnOnce(io::Error) -> SocketError {
    move |source| SocketError::Option { option, source }
}

/// Largest receive buffer an overrun may grow the socket to.
pub const MAX_RECEIVE_BUFFER: usize = 64 << 20;

impl RtnlSocket {
    /// The kernel's receive buffer size (what it counts, i.e. doubled).
    pub fn receive_buffer(&self) -> Result<usize, SocketError> {
        self.socket.get_rx_buf_sz().map_err(option("SO_RCVBUF"))
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
        force_receive_buffer(&self.socket, wanted)?;
        self.receive_buffer()
    }

    pub fn open(options: &SocketOptions) -> Result<Self, SocketError> {
        let mut socket = Socket::new(NETLINK_ROUTE).map_err(SocketError::Open)?;
        if options.nonblocking {
            socket.set_non_blocking(true).map_err(option("O_NONBLOCK"))?;
        }
        force_receive_buffer(&socket, options.receive_buffer)?;
        // Strict checking is what makes the kernel honour IFA_TARGET_NETNSID.
        socket.set_netlink_get_strict_chk(true).map_err(option("NETLINK_GET_STRICT_CHK"))?;
        if options.listen_all_nsid {
            socket.set_listen_all_namespaces(true).map_err(option("NETLINK_LISTEN_ALL_NSID"))?;
        }
        // Port 0 lets the kernel pick.
        socket.bind(&SocketAddr::new(0, 0)).map_err(SocketError::Bind)?;
        // Subscribing after bind and before the first dump: nothing falls
        // between the dump and the notifications.
        for &group in &options.groups {
            socket.add_membership(group).map_err(option("NETLINK_ADD_MEMBERSHIP"))?;
        }
        Ok(Self { socket })
    }

    /// Lets the kernel drop what `program` (classic BPF) rejects before it
    /// is queued (`SO_ATTACH_FILTER`); see [`super::filter`].
    pub fn attach_filter(&self, program: &[libc::sock_filter]) -> Result<(), SocketError> {
        super::filter::attach(self.socket.as_raw_fd(), program).map_err(option("SO_ATTACH_FILTER"))
    }

    /// Sends one request to the kernel.
    pub fn send(&self, request: &[u8]) -> Result<(), SocketError> {
        let kernel = SocketAddr::new(0, 0);
        loop {
            match self.socket.send_to(request, &kernel, 0) {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(SocketError::Send(e)),
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
            let n = unsafe { libc::recvmsg(self.socket.as_raw_fd(), &raw mut msg, 0) };
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
                if c.cmsg_level == libc::SOL_NETLINK && c.cmsg_type == libc::NETLINK_LISTEN_ALL_NSID && data_len >= 4 {
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
        self.socket.as_raw_fd()
    }
}

impl AsFd for RtnlSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}
