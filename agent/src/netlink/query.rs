//! Direct questions to the kernel on a socket of their own, answered at
//! once (requests only, no multicast groups): does an nsid still name a
//! netns, which addresses does a netns hold now. Used where a decision must
//! rest on the kernel's word of this moment rather than on the model, which
//! lags by whatever is still queued on its socket: at start (did a recorded
//! netns die while netreap was down?) and in the last look before a release.
//!
//! Blocking: call from a blocking context. The kernel answers a dump within
//! the sendmsg/recvmsg pair, so no read waits on anything but the kernel.
//!
//! Requests are netlink-packet-route messages (`wire`) on a blocking
//! netlink-sys socket, not `rtnetlink` requests, for three reasons:
//! - its `Handle` needs its `Connection` polled on a runtime, and the
//!   callers are synchronous: the ledger's resolver (under a file lock, on
//!   tokio's blocking pool) and the last look before a release. Driving it
//!   from there takes a second runtime or a `block_on` that panics inside
//!   the agent's own.
//! - a dump the kernel refuses (an nsid that no longer names a netns) ends
//!   with an NLMSG_DONE carrying -EINVAL, and its connection drops DONE
//!   unless told otherwise: the refusal would read as an empty dump, i.e.
//!   "this netns holds no address", the one answer the last look must
//!   never invent.
//! - its nsid requests name a /run/netns mount, not an fd (`NETNSA_FD`):
//!   netreap's netns are opened from /proc or bind mounts anywhere, so the
//!   assignment would be a message built here and sent through its generic
//!   `request` anyway.

use std::net::IpAddr;

use super::{
    RECV_BUFFER,
    socket::{RtnlSocket, SocketError, SocketOptions},
    wire::{self, Address, Message},
};

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error("netlink dump ended without its DONE")]
    Truncated,
    #[error("setting a receive timeout: {0}")]
    Timeout(std::io::Error),
    /// A message of the answer did not decode: what it said is unknown.
    #[error("a message of the answer does not decode: {0}")]
    Undecodable(wire::WireError),
}

/// How a dump ended.
enum End {
    Done,
    Refused(i32),
}

pub struct Querier {
    socket: RtnlSocket,
    seq: u32,
    buf: Vec<u8>,
    /// A dump by target nsid has worked on this kernel.
    targeted_ok: bool,
    /// Whether this kernel echoes an nsid assignment (`NLM_F_ECHO`); None
    /// until an assignment has told.
    echo: Option<bool>,
    /// Requests sent (what a test can count round trips by).
    sent: u64,
}

/// Which nsid request [`Querier::nsid_or_assign`] sends first: the one
/// likely to be the only one needed. Either order gets the same answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guess {
    /// The netns is likely new (a CNI ADD's): assign, with an echo.
    Unassigned,
    /// It likely has an nsid: ask for it.
    Assigned,
}

/// How an echoed assignment went.
enum Assigned {
    Nsid(i32),
    /// Refused (EEXIST: it has one) or not echoed: ask.
    Ask,
}

impl Querier {
    pub fn open() -> Result<Self, QueryError> {
        let socket = RtnlSocket::open(&SocketOptions {
            groups: Vec::new(),
            listen_all_nsid: false,
            receive_buffer: 4 << 20,
            nonblocking: false,
        })?;
        // The kernel answers within the call; a read that waits longer is a
        // request that gets no answer: fail rather than hang.
        let timeout = libc::timeval { tv_sec: 2, tv_usec: 0 };
        // SAFETY: a valid socket fd and a pointer to a timeval of the stated size.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&socket),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(QueryError::Timeout(std::io::Error::last_os_error()));
        }
        Ok(Self { socket, seq: 1, buf: vec![0; RECV_BUFFER], targeted_ok: false, echo: None, sent: 0 })
    }

    /// Sends `request` (built with `seq`) and feeds each message of its
    /// answer to `each` until DONE or an error.
    /// A message that does not decode goes to `each` as its error.
    fn dump(
        &mut self,
        build: impl FnOnce(u32) -> Vec<u8>,
        mut each: impl FnMut(Result<Message, wire::WireError>),
    ) -> Result<End, QueryError> {
        self.seq = self.seq.wrapping_add(1).max(1);
        let seq = self.seq;
        self.send(&build(seq))?;
        loop {
            let Some(d) = self.socket.recv(&mut self.buf)? else { return Err(QueryError::Truncated) };
            for (header, payload) in wire::messages(&self.buf[..d.len]).flatten() {
                if header.seq != seq {
                    continue;
                }
                match wire::decode(&header, payload) {
                    Ok(Message::Done { error: 0 }) => return Ok(End::Done),
                    Ok(Message::Done { error }) => return Ok(End::Refused(error.saturating_neg())),
                    Ok(Message::Error { errno, .. }) if errno != 0 => return Ok(End::Refused(errno)),
                    other => each(other),
                }
            }
        }
    }

    /// Does `nsid` name a netns now? `Some(false)` only on the kernel's
    /// word: a dump aimed at it refused with EINVAL, on a kernel where such
    /// a dump aimed at `known_good` (an nsid that exists) worked. `None`
    /// when that cannot be told.
    pub fn nsid_exists(&mut self, nsid: i32, known_good: Option<i32>) -> Result<Option<bool>, QueryError> {
        if !self.targeted_ok {
            let Some(good) = known_good else { return Ok(None) };
            if matches!(self.dump(|s| wire::dump_links(s, Some(good)), |_| {})?, End::Done) {
                self.targeted_ok = true;
            } else {
                return Ok(None);
            }
        }
        Ok(match self.dump(|s| wire::dump_links(s, Some(nsid)), |_| {})? {
            End::Done => Some(true),
            End::Refused(libc::EINVAL) => Some(false),
            End::Refused(_) => None,
        })
    }

    /// The nsid of the netns behind `fd` (assigning one when `assign` and it
    /// has none). None when the kernel gives none.
    pub fn nsid_of(&mut self, fd: std::os::fd::RawFd, assign: bool) -> Result<Option<i32>, QueryError> {
        if assign {
            // Answered only on failure (EEXIST when it has one): not waited
            // for; the GETNSID below is answered after it, in order.
            self.seq = self.seq.wrapping_add(1).max(1);
            self.send(&wire::assign_nsid(self.seq, fd))?;
        }
        self.seq = self.seq.wrapping_add(1).max(1);
        self.send(&wire::get_nsid(self.seq, fd))?;
        Ok(match self.reply(self.seq)? {
            Some(Message::NewNsid { nsid }) => nsid,
            _ => None,
        })
    }

    /// The nsid of the netns behind `fd`, assigning one when it has none,
    /// in one round trip when `guess` is right: an assignment is echoed
    /// with its nsid, and asking first spares the assignment. Two or three
    /// when wrong (or when another process assigns in between).
    pub fn nsid_or_assign(&mut self, fd: std::os::fd::RawFd, guess: Guess) -> Result<Option<i32>, QueryError> {
        if guess == Guess::Assigned || self.echo == Some(false) {
            if let Some(nsid) = self.nsid_of(fd, false)? {
                return Ok(Some(nsid));
            }
            if self.echo == Some(false) {
                return self.nsid_of(fd, true);
            }
        }
        match self.assign_echoed(fd)? {
            Assigned::Nsid(nsid) => Ok(Some(nsid)),
            Assigned::Ask => self.nsid_of(fd, false),
        }
    }

    /// Assigns an nsid to the netns behind `fd`, with `NLM_F_ECHO`. Until
    /// this kernel has shown whether it echoes, the acknowledgement is asked
    /// for too, so that a kernel that does not answers something.
    fn assign_echoed(&mut self, fd: std::os::fd::RawFd) -> Result<Assigned, QueryError> {
        let probe = self.echo.is_none();
        self.seq = self.seq.wrapping_add(1).max(1);
        let seq = self.seq;
        self.send(&wire::assign_nsid_echo(seq, fd, probe))?;
        match self.reply(seq)? {
            Some(Message::NewNsid { nsid: Some(nsid) }) => {
                if probe {
                    // Its acknowledgement follows: read it now, not as a
                    // stray later.
                    self.reply(seq)?;
                    self.echo = Some(true);
                }
                Ok(Assigned::Nsid(nsid))
            }
            Some(Message::Error { errno: 0, .. }) => {
                // Acknowledged without an echo: this kernel does not echo.
                self.echo = Some(false);
                Ok(Assigned::Ask)
            }
            _ => Ok(Assigned::Ask),
        }
    }

    fn send(&mut self, request: &[u8]) -> Result<(), QueryError> {
        self.sent = self.sent.wrapping_add(1);
        self.socket.send(request)?;
        Ok(())
    }

    /// The one message answering request `seq`.
    fn reply(&mut self, seq: u32) -> Result<Option<Message>, QueryError> {
        loop {
            let Some(d) = self.socket.recv(&mut self.buf)? else { return Err(QueryError::Truncated) };
            for (header, payload) in wire::messages(&self.buf[..d.len]).flatten() {
                if header.seq == seq {
                    return Ok(wire::decode(&header, payload).ok());
                }
            }
        }
    }

    /// The nsids the kernel lists now. The dump is paged by position, so a
    /// netns may be missing from it: use it to find more netns to ask
    /// about, never to conclude one is gone.
    pub fn nsids(&mut self) -> Result<Vec<i32>, QueryError> {
        let mut out = Vec::new();
        self.dump(wire::dump_nsids, |m| {
            if let Ok(Message::NewNsid { nsid: Some(n) }) = m {
                out.push(n);
            }
        })?;
        Ok(out)
    }

    /// The addresses configured in the netns with `nsid` (None: netreap's
    /// own) right now, both families. `Ok(None)` when the kernel refused the
    /// dump.
    pub fn addresses(&mut self, nsid: Option<i32>) -> Result<Option<Vec<IpAddr>>, QueryError> {
        let mut ips = Vec::new();
        Ok(self.each_address(nsid, wire::Family::Both, |a| ips.push(a.ip))?.then_some(ips))
    }

    /// [`Querier::addresses`] of one `family` (or both), without a list per
    /// netns: each address goes to `each` as it is read. `Ok(false)` when
    /// the kernel refused the dump (what `each` was given until then still
    /// stands).
    pub fn each_address(
        &mut self,
        nsid: Option<i32>,
        family: wire::Family,
        mut each: impl FnMut(&Address),
    ) -> Result<bool, QueryError> {
        // An address message that does not decode is an address not known:
        // the dump fails rather than read as "not configured here".
        let mut undecodable = None;
        let end = self.dump(
            |s| wire::dump_addresses(s, nsid, family),
            |m| match m {
                Ok(Message::NewAddress(a)) => each(&a),
                Ok(_) => {}
                Err(e) => undecodable = undecodable.take().or(Some(e)),
            },
        )?;
        match undecodable {
            Some(e) => Err(QueryError::Undecodable(e)),
            None => Ok(matches!(end, End::Done)),
        }
    }
}

impl std::os::fd::AsRawFd for Querier {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.socket.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use std::{os::fd::AsRawFd as _, path::PathBuf, process::Command};

    use super::*;

    /// A named netns for one test (prefix `nrN`), removed on drop, so also
    /// when the test fails.
    struct TestNetns(String);

    impl TestNetns {
        fn new(tag: &str) -> Self {
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            assert!(root, "this test creates a netns and assigns it an nsid: run it as root");
            let name = format!("nrN{}{tag}", std::process::id());
            let status = Command::new("ip").args(["netns", "add", &name]).status().expect("runs ip (iproute2)");
            assert!(status.success(), "ip netns add {name}: {status}");
            Self(name)
        }

        fn path(&self) -> PathBuf {
            PathBuf::from("/run/netns").join(&self.0)
        }

        fn ip(&self, args: &[&str]) {
            let status = Command::new("ip").args(["-n", &self.0]).args(args).status().expect("runs ip");
            assert!(status.success(), "ip -n {} {args:?}: {status}", self.0);
        }
    }

    impl Drop for TestNetns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    /// The requests built with netlink-packet-route against the kernel:
    /// RTM_NEWNSID by fd assigns, RTM_GETNSID by fd answers, a dump aimed at
    /// that nsid lists the netns's address, and a dump aimed at an nsid that
    /// names nothing is refused (not answered as an empty dump).
    #[test]
    fn nsids_by_fd_and_dumps_by_target_nsid() {
        let ns = TestNetns::new("q");
        ns.ip(&["addr", "add", "10.213.7.1/32", "dev", "lo"]);
        let fd = std::fs::File::open(ns.path()).expect("opens the netns");
        let mut q = Querier::open().expect("a NETLINK_ROUTE socket");
        let nsid = q.nsid_of(fd.as_raw_fd(), true).expect("asks").expect("an nsid after assignment");
        // Assigning again is refused with EEXIST, silently: same answer.
        assert_eq!(q.nsid_of(fd.as_raw_fd(), true).expect("asks"), Some(nsid));
        // The dump is paged by position: while other netns come and go
        // (another suite's thousands), a page may skip this one. Listed in
        // one of a few dumps, or the dump does not list it at all.
        assert!((0..5).any(|_| q.nsids().expect("dump").contains(&nsid)), "nsid {nsid} in no dump");
        assert_eq!(q.nsid_exists(nsid, Some(nsid)).expect("asks"), Some(true));
        let ips = q.addresses(Some(nsid)).expect("dump").expect("not refused");
        assert_eq!(ips, vec![IpAddr::from([10, 213, 7, 1])]);
        // The kernel assigns the lowest free nsid: this one names nothing.
        let unused = i32::MAX - 7;
        assert_eq!(q.nsid_exists(unused, Some(nsid)).expect("asks"), Some(false));
        assert_eq!(q.addresses(Some(unused)).expect("dump"), None);
        // The refusal is the dump's NLMSG_DONE carrying -EINVAL (the reason
        // this is not an rtnetlink connection, which drops DONE).
        q.seq += 1;
        q.socket.send(&wire::dump_addresses(q.seq, Some(unused), wire::Family::Both)).expect("sent");
        let d = q.socket.recv(&mut q.buf).expect("receives").expect("blocking socket");
        let (header, payload) = wire::messages(&q.buf[..d.len]).next().expect("a message").expect("frames");
        assert_eq!(wire::decode(&header, payload), Ok(Message::Done { error: -libc::EINVAL }));
    }

    /// One nsid whichever request goes first: a new netns is assigned one
    /// by the echoed assignment (this kernel echoes: no query follows), a
    /// netns that has one is answered by the query or, guessed wrong, by
    /// the assignment's refusal and a query. Each answer is the kernel's
    /// nsid for that netns, as a plain query says after.
    #[test]
    fn nsid_or_assign_answers_the_same_nsid_whichever_it_tries_first() {
        for (tag, first, then) in
            [("ua", Guess::Unassigned, Guess::Assigned), ("au", Guess::Assigned, Guess::Unassigned)]
        {
            let ns = TestNetns::new(tag);
            let fd = std::fs::File::open(ns.path()).expect("opens the netns");
            let mut q = Querier::open().expect("a NETLINK_ROUTE socket");
            assert_eq!(q.nsid_of(fd.as_raw_fd(), false).expect("asks"), None, "a new netns has no nsid");
            // Each answer, and the requests it took: one when the guess
            // is right.
            let ask = |q: &mut Querier, guess| {
                let before = q.sent;
                let nsid = q.nsid_or_assign(fd.as_raw_fd(), guess).expect("asks");
                (nsid, q.sent - before)
            };
            let (nsid, requests) = ask(&mut q, first);
            let nsid = nsid.expect("an nsid");
            assert_eq!(q.echo, Some(true), "5.4 and later echo an assignment");
            assert_eq!(requests, if first == Guess::Unassigned { 1 } else { 2 }, "{tag}: a new netns");
            assert_eq!(Querier::open().expect("a socket").nsid_of(fd.as_raw_fd(), false).expect("asks"), Some(nsid));
            assert_eq!(ask(&mut q, Guess::Assigned), (Some(nsid), 1), "{tag}: asked");
            assert_eq!(ask(&mut q, Guess::Unassigned), (Some(nsid), 2), "{tag}: refused, then asked");
            assert_eq!(ask(&mut q, then).0, Some(nsid));
            // Nothing left unread on the socket: the next answer is read
            // in its turn.
            let other = TestNetns::new(&format!("{tag}2"));
            let other_fd = std::fs::File::open(other.path()).expect("opens the netns");
            let other_nsid = q.nsid_or_assign(other_fd.as_raw_fd(), Guess::Unassigned).expect("asks").expect("an nsid");
            assert_ne!(other_nsid, nsid);
            assert_eq!(q.nsid_of(other_fd.as_raw_fd(), false).expect("asks"), Some(other_nsid));
        }
    }

    /// Every message of this kernel's own dumps (links, addresses, routes,
    /// nsids) decodes: the crate's parsers agree with the running kernel on
    /// every attribute the model reads. Needs no privilege.
    #[test]
    fn the_running_kernels_dumps_decode() {
        let mut q = Querier::open().expect("a NETLINK_ROUTE socket");
        let builders: [fn(u32) -> Vec<u8>; 4] = [
            |s| wire::dump_links(s, None),
            |s| wire::dump_addresses(s, None, wire::Family::Both),
            wire::dump_routes,
            wire::dump_nsids,
        ];
        let mut links = Vec::new();
        for build in builders {
            q.seq += 1;
            let seq = q.seq;
            q.socket.send(&build(seq)).expect("request sent");
            'dump: loop {
                let d = q.socket.recv(&mut q.buf).expect("receives").expect("blocking socket");
                for item in wire::messages(&q.buf[..d.len]) {
                    let (header, payload) = item.expect("frames");
                    match wire::decode(&header, payload) {
                        Ok(Message::Done { error }) => {
                            assert_eq!(error, 0, "dump {} refused", header.kind);
                            break 'dump;
                        }
                        Ok(Message::NewLink(l)) => links.push(l),
                        Ok(Message::Error { errno, .. }) => panic!("request refused: errno {errno}"),
                        Ok(_) => {}
                        Err(e) => panic!("kernel message {} does not decode: {e}", header.kind),
                    }
                }
            }
        }
        assert!(links.iter().any(|l| l.name.as_deref() == Some("lo")), "no lo among {links:?}");
        let own = q.addresses(None).expect("dump").expect("not refused");
        assert!(own.contains(&IpAddr::from([127, 0, 0, 1])), "no 127.0.0.1 among {own:?}");
    }
}
