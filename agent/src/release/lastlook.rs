//! The last look before an unlink: under the plugin's lock, right before a
//! reservation file goes, ask the kernel once more whether its IP is
//! configured in any netns now, and whether a CNI run of its container is
//! running. The decision was made on the model, which lags by whatever is
//! still queued; the last look rests on this moment's kernel.
//!
//! The kernel is asked under the network's lock, after it is taken. A look
//! shared by a batch *before* the lock is not enough: the spin model
//! (`verify/`) found that a file re-created at once for the same container
//! (the inode reused, the coarse mtime the same) passes the identity check
//! under the lock, and its IP may have been configured after a look taken
//! earlier. One look taken under a lock that is then held across a group of
//! unlinks of that network is sound (`verify/release.pml`, the group
//! protocol): while the lock is held no plugin of that network can write a
//! file, so the answer postdates anything the plugin did to any file of the
//! group, and a run still in flight is seen in flight.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ffi::{CStr, OsStr},
    fs,
    io::{self, Write as _},
    net::IpAddr,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
    sync::{Arc, LazyLock, Mutex, MutexGuard},
};

use crate::{
    discovery::{self, DiscoveryError, DiscoveryPaths, MountChanges, MountReader, mount_candidates, open_any},
    ipam::Reservation,
    netlink::query::Querier,
};

/// The kernel, asked right before unlinks.
pub trait LastLook: Send {
    /// One look at the kernel, now. Taken under a network's lock and held
    /// across that network's group of unlinks, it serves every file of the
    /// group. `Err`: the kernel could not be asked (keeps every file).
    fn look(&mut self) -> Result<Sighting, LookFound>;

    /// One look for one reservation; `Err(why)` keeps it.
    fn before_unlink(&mut self, r: &Reservation) -> Result<(), LookFound> {
        self.look()?.keeps(r).map_or(Ok(()), Err)
    }
}

/// What one look saw: where IPs are configured, which CNI runs are going.
#[derive(Debug, Clone, Default)]
pub struct Sighting {
    /// IP -> where it is configured.
    ips: HashMap<IpAddr, Vec<Place>>,
    /// CNI_CONTAINERID of running plugin processes -> pid.
    running: HashMap<String, u32>,
    /// Containers the ledger has a CNI run in flight for.
    ledger_in_flight: HashSet<String>,
}

/// Where an IP was seen, rendered only for a reservation it keeps (a look
/// sees every address of the node; few of them keep anything).
#[derive(Debug, Clone)]
enum Place {
    Host,
    Nsid(i32),
    Mounted { inode: u32, nsid: i32, path: PathBuf },
    Process { inode: u64, nsid: i32, pid: u32 },
    Named(String),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Host => f.write_str("the host netns"),
            Self::Nsid(nsid) => write!(f, "netns nsid {nsid}"),
            Self::Mounted { inode, nsid, path } => {
                write!(f, "netns net:[{inode}] nsid {nsid} mounted at {}", path.display())
            }
            Self::Process { inode, nsid, pid } => write!(f, "netns net:[{inode}] nsid {nsid} of pid {pid}"),
            Self::Named(name) => f.write_str(name),
        }
    }
}

impl Sighting {
    /// A look that saw nothing (tests and tools that must not ask).
    #[must_use]
    pub fn nothing() -> Self {
        Self::default()
    }

    /// A look that saw `ip` configured in `place` (tests).
    #[must_use]
    pub fn with_ip(ip: IpAddr, place: String) -> Self {
        Self { ips: HashMap::from([(ip, vec![Place::Named(place)])]), ..Self::default() }
    }

    /// What keeps `r`, if anything.
    #[must_use]
    pub fn keeps(&self, r: &Reservation) -> Option<LookFound> {
        if let Some(places) = self.ips.get(&r.ip) {
            return Some(LookFound::IpConfigured { netns: places.iter().map(ToString::to_string).collect() });
        }
        if let Some(&pid) = self.running.get(r.container_id.as_str()) {
            return Some(LookFound::CniRunInFlight { pid: Some(pid) });
        }
        if self.ledger_in_flight.contains(r.container_id.as_str()) {
            return Some(LookFound::CniRunInFlight { pid: None });
        }
        None
    }

    /// Where `ip` was seen configured (empty: nowhere).
    #[must_use]
    pub fn where_configured(&self, ip: IpAddr) -> Vec<String> {
        self.ips.get(&ip).into_iter().flatten().map(ToString::to_string).collect()
    }

    fn add(&mut self, ip: IpAddr, place: Place) {
        self.ips.entry(ip).or_default().push(place);
    }
}

/// What the last look found that keeps a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookFound {
    /// The IP is configured in these netns now (a conflict with the model's
    /// view, reported with both).
    IpConfigured { netns: Vec<String> },
    /// A CNI plugin of the container is running.
    CniRunInFlight { pid: Option<u32> },
    /// The kernel could not be asked: keep.
    Unavailable { error: String },
}

impl std::fmt::Display for LookFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::IpConfigured { netns } => write!(f, "its IP is configured now in {}", netns.join(", ")),
            Self::CniRunInFlight { pid: Some(pid) } => {
                write!(f, "a CNI plugin of its container is running (pid {pid})")
            }
            Self::CniRunInFlight { pid: None } => f.write_str("a CNI run of its container is in flight"),
            Self::Unavailable { error } => write!(f, "the kernel could not be asked: {error}"),
        }
    }
}

/// Tests and tools that must not ask the kernel.
pub struct NoLook;

impl LastLook for NoLook {
    fn look(&mut self) -> Result<Sighting, LookFound> {
        Ok(Sighting::nothing())
    }
}

/// Where the kernel's answers come from.
pub struct KernelLook {
    /// nsids of every netns the model knows alive.
    known_nsids: Vec<i32>,
    /// Their inodes (a process netns outside them is looked at too).
    known_inodes: HashSet<u64>,
    /// Containers the ledger has a CNI run in flight for.
    ledger_in_flight: HashSet<String>,
    cni_bin_dirs: Vec<PathBuf>,
    proc_root: PathBuf,
    /// Where netns bind mounts are found: a netns mounted by `ip netns add`
    /// holds no process and may have no nsid yet, and the model may not
    /// have seen it (its mount scan is debounced; without the attribution
    /// probes its creation is not reported). None: not looked at (tests).
    mounts: Option<DiscoveryPaths>,
    /// What looks keep between them (the daemon makes a `KernelLook` per
    /// batch; this outlives it).
    kept: Arc<Mutex<Kept>>,
}

/// What one look leaves to the next, so that a look costs the questions
/// themselves and not their set-up: the netlink socket (a new one per look
/// costs a socket, a bind and a 4 MiB receive buffer) and the parsed mount
/// table, read again only when the kernel says it changed.
#[derive(Default)]
struct Kept {
    querier: Option<Querier>,
    mounts: Option<WatchedMounts>,
    /// Sockets opened so far (tests: a broken one is replaced).
    sockets_opened: u64,
}

/// Looks share one [`Kept`] per process unless told otherwise: the agent
/// has one releaser, and two looks at once only wait for each other.
static SHARED_KEPT: LazyLock<Arc<Mutex<Kept>>> = LazyLock::new(Arc::default);

/// The netns bind mounts of one mount table, read again only after the
/// kernel reported a change. A procfs mount table open for reading polls
/// `POLLPRI | POLLERR` once after each change of its mount namespace since
/// the previous poll (`mounts_poll`, fs/proc_namespace.c), so: poll, then
/// read. A change after the poll is reported by the next poll, and the
/// table read after a poll that reported none is still the table. The poll
/// is made by the look itself, under the network's lock, like the read it
/// replaces.
struct WatchedMounts {
    paths: DiscoveryPaths,
    /// The configured table, open to be polled; None when it is no procfs
    /// table (a test's file) or a poll failed: then every look reads it.
    watch: Option<fs::File>,
    changes: Arc<MountChanges>,
    reader: MountReader,
}

/// `PROC_SUPER_MAGIC`, statfs(2).
const PROC_SUPER_MAGIC: i64 = 0x9fa0;

impl WatchedMounts {
    fn new(paths: DiscoveryPaths) -> Self {
        let changes = Arc::new(MountChanges::default());
        let watch = fs::File::open(&paths.mountinfo).ok().filter(is_procfs);
        if watch.is_some() {
            changes.watching();
        }
        Self { paths, watch, reader: MountReader::new(Arc::clone(&changes)), changes }
    }

    /// The netns bind mounts now, by inode.
    fn current(&mut self) -> Result<&BTreeMap<u32, discovery::Sighting>, DiscoveryError> {
        if let Some(file) = &self.watch {
            match changed_since_last_poll(file) {
                Ok(false) => {}
                Ok(true) => self.changes.changed(),
                Err(e) => {
                    tracing::debug!(table = %self.paths.mountinfo.display(), "polling the mount table: {e}; reading it every look");
                    self.changes.unwatched();
                    self.watch = None;
                }
            }
        }
        self.reader.mounts(&self.paths, false)
    }
}

fn is_procfs(file: &fs::File) -> bool {
    // SAFETY: zeroed statfs is a valid out-buffer.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd and out-pointer.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &raw mut st) };
    #[allow(clippy::useless_conversion, reason = "f_type is i64 here, narrower on other targets")]
    let kind = i64::from(st.f_type);
    rc == 0 && kind == PROC_SUPER_MAGIC
}

/// Whether the mount namespace of `table` changed since its last poll.
fn changed_since_last_poll(table: &fs::File) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd: table.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
    loop {
        // SAFETY: one valid pollfd; a zero timeout never blocks.
        let rc = unsafe { libc::poll(&raw mut pfd, 1, 0) };
        if rc >= 0 {
            if pfd.revents & libc::POLLNVAL != 0 {
                return Err(io::Error::from_raw_os_error(libc::EBADF));
            }
            return Ok(pfd.revents & (libc::POLLPRI | libc::POLLERR) != 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Default CNI plugin directories.
pub const DEFAULT_CNI_BIN_DIRS: [&str; 3] = ["/opt/cni/bin", "/usr/lib/cni", "/usr/libexec/cni"];

impl KernelLook {
    #[must_use]
    pub fn new(
        known_nsids: Vec<i32>,
        known_inodes: HashSet<u64>,
        ledger_in_flight: HashSet<String>,
        cni_bin_dirs: Vec<PathBuf>,
    ) -> Self {
        Self {
            known_nsids,
            known_inodes,
            ledger_in_flight,
            cni_bin_dirs,
            proc_root: PathBuf::from("/proc"),
            mounts: None,
            kept: Arc::clone(&SHARED_KEPT),
        }
    }

    /// Also asks about every netns bind-mounted in this mount table that
    /// the model does not know.
    #[must_use]
    pub fn with_mount_table(mut self, paths: DiscoveryPaths) -> Self {
        self.mounts = Some(paths);
        self
    }

    /// Keeps its socket and mount table to itself instead of sharing the
    /// process's (tests and benches that count what a look redoes).
    #[must_use]
    pub fn with_own_state(mut self) -> Self {
        self.kept = Arc::default();
        self
    }

    /// Times the mount table was read by this look's state (tests, bench).
    #[must_use]
    pub fn mount_table_reads(&self) -> u64 {
        self.lock_kept().mounts.as_ref().map_or(0, |m| m.reader.reads())
    }

    /// Netlink sockets opened by this look's state (tests, bench).
    #[must_use]
    pub fn sockets_opened(&self) -> u64 {
        self.lock_kept().sockets_opened
    }

    /// Breaks the kept socket, as a socket that failed would be.
    #[cfg(test)]
    fn break_socket_for_test(&self) {
        if let Some(q) = &self.lock_kept().querier {
            // SAFETY: /dev/null opened read-only; dup2 puts it in place of
            // the socket's fd number, so the querier's next send fails
            // (ENOTSOCK) while the fd stays owned by the querier.
            unsafe {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if null >= 0 {
                    libc::dup2(null, q.as_raw_fd());
                    libc::close(null);
                }
            }
        }
    }

    /// The kept state; a look that panicked half-way leaves it poisoned,
    /// and then it starts over (a new socket, the table read again).
    fn lock_kept(&self) -> MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|poisoned| {
            let mut kept = poisoned.into_inner();
            *kept = Kept::default();
            self.kept.clear_poison();
            kept
        })
    }

    fn gather(&self) -> Result<Sighting, String> {
        let mut kept = self.lock_kept();
        let reused = kept.querier.is_some();
        match self.gather_with(&mut kept) {
            Ok(seen) => Ok(seen),
            Err(e) => {
                // The kept socket may be what failed: the look is taken once
                // more, whole, on a new one; a second failure keeps the files.
                kept.querier = None;
                if !reused {
                    return Err(e);
                }
                tracing::debug!("last look failed on the kept netlink socket ({e}); once more on a new one");
                let again = self.gather_with(&mut kept);
                if again.is_err() {
                    kept.querier = None;
                }
                again
            }
        }
    }

    fn gather_with(&self, kept: &mut Kept) -> Result<Sighting, String> {
        let Kept { querier, mounts: table, sockets_opened } = kept;
        if querier.is_none() {
            *sockets_opened += 1;
            *querier = Some(Querier::open().map_err(|e| e.to_string())?);
        }
        let Some(q) = querier.as_mut() else { return Err("no netlink socket".into()) };
        let mut seen = Sighting { ledger_in_flight: self.ledger_in_flight.clone(), ..Sighting::default() };
        // /proc first: the CNI plugins running now, and the netns of
        // processes the model does not know yet (opened now, asked below).
        // A plugin that exits after this walk configured its addresses
        // before it, so the dumps below, which all come after it, see them;
        // walked after the dumps, a plugin that configured an address and
        // exited in between would be seen by neither.
        // Netns asked about by way of an fd, by inode.
        let mut looked: HashSet<u64> = HashSet::new();
        let mut process_netns = Vec::new();
        let proc_dir = ProcDir::open(&self.proc_root).map_err(|e| format!("{}: {e}", self.proc_root.display()))?;
        let mut exe = [0u8; 4096];
        for pid in proc_dir.pids().map_err(|e| format!("{}: {e}", self.proc_root.display()))? {
            let Some(inode) = proc_dir.netns_inode(pid) else { continue }; // exited
            // Opened now; its inode is checked again on the fd (the process
            // may have exited and its pid been reused).
            if !self.known_inodes.contains(&inode)
                && !looked.contains(&inode)
                && let Some(fd) = proc_dir.open_netns(pid, inode)
            {
                looked.insert(inode);
                process_netns.push((inode, pid, fd));
            }
            if proc_dir.exe(pid, &mut exe).is_some_and(|e| self.cni_bin_dirs.iter().any(|d| e.starts_with(d)))
                && let Some(cid) = proc_dir.container_id(pid)
            {
                seen.running.insert(cid, pid);
            }
        }
        // netreap's own netns (the host's, with hostNetwork).
        if !q.each_address(None, |ip| seen.add(ip, Place::Host)).map_err(|e| e.to_string())? {
            return Err("own address dump refused".into());
        }
        // The model's netns, and any the kernel lists that it does not know
        // (known only by nsid, e.g. not openable from here).
        let listed = q.nsids().map_err(|e| e.to_string())?;
        let mut seen_nsids: HashSet<i32> = HashSet::with_capacity(self.known_nsids.len() + listed.len());
        for nsid in self.known_nsids.iter().copied().chain(listed) {
            if !seen_nsids.insert(nsid) {
                continue;
            }
            // A refused dump: the nsid is gone, so is its netns.
            q.each_address(Some(nsid), |ip| seen.add(ip, Place::Nsid(nsid))).map_err(|e| e.to_string())?;
        }
        // Bind-mounted netns the model does not know yet. A table that
        // cannot be read keeps the reservation (the look is unavailable).
        if let Some(paths) = &self.mounts {
            if table.as_ref().is_none_or(|t| t.paths != *paths) {
                *table = Some(WatchedMounts::new(paths.clone()));
            }
            let Some(table) = table.as_mut() else { return Err("no mount table".into()) };
            let mounts = table.current().map_err(|e| e.to_string())?;
            for (&inode, sighting) in mounts {
                let wide = u64::from(inode);
                if self.known_inodes.contains(&wide) || looked.contains(&wide) {
                    continue;
                }
                let Some((fd, path)) = open_any(inode, &mount_candidates(paths, &sighting.bind_mounts)) else {
                    continue; // unmounted meanwhile: gone, or found by nsid above
                };
                looked.insert(wide);
                // A netns we hold open but cannot ask about: keep (unavailable).
                let nsid = q
                    .nsid_of(fd.as_raw_fd(), true)
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("no nsid for the netns mounted at {}", path.display()))?;
                if seen_nsids.insert(nsid) {
                    let place = Place::Mounted { inode, nsid, path };
                    q.each_address(Some(nsid), |ip| seen.add(ip, place.clone())).map_err(|e| e.to_string())?;
                }
            }
        }
        // Then the netns of the processes walked first.
        for (inode, pid, fd) in process_netns {
            if let Some(nsid) = q.nsid_of(fd.as_raw_fd(), true).map_err(|e| e.to_string())?
                && seen_nsids.insert(nsid)
            {
                let place = Place::Process { inode, nsid, pid };
                q.each_address(Some(nsid), |ip| seen.add(ip, place.clone())).map_err(|e| e.to_string())?;
            }
        }
        Ok(seen)
    }
}

/// `/proc`, read with calls relative to one directory fd and paths built
/// on the stack: a look reads two or three files per process.
struct ProcDir {
    root: PathBuf,
    dir: OwnedFd,
}

/// `N/name` and its NUL, on the stack.
struct RelPath {
    buf: [u8; 48],
}

impl RelPath {
    fn new(pid: u32, name: &str) -> Option<Self> {
        let mut buf = [0u8; 48];
        let mut cursor = &mut buf[..];
        write!(cursor, "{pid}/{name}\0").ok()?;
        Some(Self { buf })
    }

    fn as_cstr(&self) -> Option<&CStr> {
        CStr::from_bytes_until_nul(&self.buf).ok()
    }
}

impl ProcDir {
    fn open(root: &Path) -> io::Result<Self> {
        let dir = fs::File::open(root)?;
        Ok(Self { root: root.to_path_buf(), dir: OwnedFd::from(dir) })
    }

    fn fd(&self) -> RawFd {
        self.dir.as_raw_fd()
    }

    /// Every process, by pid. A listing that fails makes the look
    /// unavailable (a process netns would go unasked).
    fn pids(&self) -> io::Result<Vec<u32>> {
        let mut pids = Vec::new();
        for entry in fs::read_dir(&self.root)? {
            if let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) {
                pids.push(pid);
            }
        }
        Ok(pids)
    }

    /// The inode of the netns of `pid`; None when it cannot be told (exited).
    /// Read from the link's text (`net:[N]`), which costs less than a stat:
    /// that one makes the kernel find (or build) the nsfs dentry and inode.
    fn netns_inode(&self, pid: u32) -> Option<u64> {
        let mut buf = [0u8; 64];
        let link = self.read_link(pid, "ns/net", &mut buf)?;
        link.strip_prefix(b"net:[")?.strip_suffix(b"]").and_then(|n| std::str::from_utf8(n).ok()?.parse().ok())
    }

    /// The netns of `pid`, open, if it is still `inode`.
    fn open_netns(&self, pid: u32, inode: u64) -> Option<OwnedFd> {
        let fd = self.open_file(pid, "ns/net")?;
        // SAFETY: zeroed stat is a valid out-buffer.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid fd and out-pointer.
        let rc = unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) };
        (rc == 0 && st.st_ino == inode).then_some(fd)
    }

    fn open_file(&self, pid: u32, name: &str) -> Option<OwnedFd> {
        let path = RelPath::new(pid, name)?;
        // SAFETY: a valid dir fd and a NUL-terminated path.
        let raw = unsafe { libc::openat(self.fd(), path.as_cstr()?.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        // SAFETY: openat just returned this fd, owned from here on.
        (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw) })
    }

    /// The executable of `pid`, read into `buf`.
    fn exe<'b>(&self, pid: u32, buf: &'b mut [u8]) -> Option<&'b Path> {
        self.read_link(pid, "exe", buf).map(|b| Path::new(OsStr::from_bytes(b)))
    }

    /// The target of the link `pid/name`, read into `buf` (None when it
    /// cannot be read or does not fit).
    fn read_link<'b>(&self, pid: u32, name: &str, buf: &'b mut [u8]) -> Option<&'b [u8]> {
        let path = RelPath::new(pid, name)?;
        // SAFETY: a valid dir fd, a NUL-terminated path, a buffer of the stated length.
        let n = unsafe { libc::readlinkat(self.fd(), path.as_cstr()?.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let n = usize::try_from(n).ok().filter(|&n| n < buf.len())?;
        Some(&buf[..n])
    }

    /// `CNI_CONTAINERID` from a process's environment.
    fn container_id(&self, pid: u32) -> Option<String> {
        use std::io::Read as _;
        let mut env = Vec::new();
        fs::File::from(self.open_file(pid, "environ")?).read_to_end(&mut env).ok()?;
        env.split(|b| *b == 0)
            .find_map(|kv| kv.strip_prefix(b"CNI_CONTAINERID="))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

impl Default for KernelLook {
    /// Without a model: every process netns, and the host's, are asked.
    fn default() -> Self {
        Self::new(Vec::new(), HashSet::new(), HashSet::new(), DEFAULT_CNI_BIN_DIRS.iter().map(PathBuf::from).collect())
    }
}

impl LastLook for KernelLook {
    fn look(&mut self) -> Result<Sighting, LookFound> {
        self.gather().map_err(|error| LookFound::Unavailable { error })
    }
}

#[cfg(test)]
mod tests {
    use std::{
        process::{Child, Command, Stdio},
        time::{Duration, Instant},
    };

    use super::*;

    fn assert_root() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "this test creates network namespaces: run it as root");
    }

    fn ip(args: &[&str]) {
        let status = Command::new("ip").args(args).status().expect("runs ip (iproute2)");
        assert!(status.success(), "ip {args:?}: {status}");
    }

    /// A named netns (prefix `nrL`), removed on drop, so also on failure.
    struct TestNetns(String);

    impl TestNetns {
        fn new(tag: &str) -> Self {
            let name = format!("nrL{}{tag}", std::process::id());
            ip(&["netns", "add", &name]);
            Self(name)
        }
    }

    impl Drop for TestNetns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    /// A process in a netns of its own, mounted nowhere and without nsid.
    struct Holder(Child);

    impl Drop for Holder {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Looks give an nsid to every process netns they ask: one test's look
    /// would show another's netns by nsid instead of by its process.
    static LOOKS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_look_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        LOOKS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn own_look() -> KernelLook {
        KernelLook::default().with_mount_table(DiscoveryPaths::default()).with_own_state()
    }

    fn seen(look: &mut KernelLook, ip: IpAddr) -> Vec<String> {
        look.look().expect("the kernel answers").where_configured(ip)
    }

    /// The mount table is kept between looks, and a netns mounted after
    /// the first look (no nsid, no process: only the table shows it) is
    /// asked by the second.
    #[test]
    fn a_netns_mounted_between_two_looks_is_seen() {
        let _one = one_look_at_a_time();
        assert_root();
        let address = IpAddr::from([10, 213, 77, 1]);
        let mut look = own_look();
        assert!(seen(&mut look, address).is_empty(), "{address} is configured before the test");
        let reads = look.mount_table_reads();
        assert_eq!(reads, 1);
        let ns = TestNetns::new("m");
        ip(&["-n", &ns.0, "addr", "add", "10.213.77.1/32", "dev", "lo"]);
        // Other processes on the machine (agents, other suites' looks) give
        // an nsid to every netns they find: one that did so already makes
        // the look find this netns by nsid, before the mount table.
        let mounted = fs::File::open(format!("/run/netns/{}", ns.0)).expect("opens the test netns");
        let nsid_before = Querier::open().expect("a socket").nsid_of(mounted.as_raw_fd(), false).expect("asks");
        let places = seen(&mut look, address);
        assert!(look.mount_table_reads() > reads, "the change was not seen: the table was not read again");
        assert_eq!(places.len(), 1, "{places:?}");
        match nsid_before {
            None => assert!(places[0].contains(&format!("/run/netns/{}", ns.0)), "{places:?}"),
            Some(nsid) => assert_eq!(places[0], format!("netns nsid {nsid}"), "{places:?}"),
        }
        assert_eq!(look.sockets_opened(), 1, "one socket for every look");
    }

    /// Without a change the table is not read again (other tests and
    /// helpers change it now and then: some pair of looks in a row shows it).
    #[test]
    fn an_unchanged_mount_table_is_not_read_again() {
        let _one = one_look_at_a_time();
        let mut look = own_look();
        look.look().expect("the kernel answers");
        let kept = (0..50).any(|_| {
            let before = look.mount_table_reads();
            look.look().expect("the kernel answers");
            look.mount_table_reads() == before
        });
        assert!(kept, "every look read the mount table again");
    }

    /// A table that is no procfs file (cannot be polled) is read by every look.
    #[test]
    fn a_table_that_cannot_be_polled_is_read_every_look() {
        let _one = one_look_at_a_time();
        let dir = tempfile::tempdir().expect("temp dir");
        let table = dir.path().join("mountinfo");
        std::fs::write(&table, "").expect("writes");
        let mut look = KernelLook::default().with_mount_table(DiscoveryPaths::with_mountinfo(table)).with_own_state();
        for n in 1..=3 {
            look.look().expect("the kernel answers");
            assert_eq!(look.mount_table_reads(), n);
        }
    }

    /// A netns created after the first look, held only by a process (no
    /// mount, no nsid), is asked by the second.
    #[test]
    fn a_process_netns_created_between_two_looks_is_seen() {
        let _one = one_look_at_a_time();
        assert_root();
        let address = IpAddr::from([10, 213, 78, 1]);
        let mut look = own_look();
        assert!(seen(&mut look, address).is_empty(), "{address} is configured before the test");
        let child = Command::new("unshare")
            .args(["--net", "sh", "-c", "ip addr add 10.213.78.1/32 dev lo && echo ok && exec sleep 60"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("runs unshare (util-linux)");
        let mut holder = Holder(child);
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.0.stdout.as_mut().expect("piped stdout")),
            &mut line,
        )
        .expect("reads the holder's ok");
        assert_eq!(line.trim(), "ok", "the holder configured its address");
        let places = seen(&mut look, address);
        assert_eq!(places.len(), 1, "{places:?}");
        assert!(places[0].ends_with(&format!("of pid {}", holder.0.id())), "{places:?}");
    }

    /// A kept socket that broke is replaced: the look is taken on a new one.
    #[test]
    fn a_broken_socket_is_replaced() {
        let _one = one_look_at_a_time();
        let mut look = KernelLook::default().with_own_state();
        look.look().expect("the kernel answers");
        assert_eq!(look.sockets_opened(), 1);
        look.look().expect("the kernel answers");
        assert_eq!(look.sockets_opened(), 1, "the socket is kept");
        look.break_socket_for_test();
        let started = Instant::now();
        let seen = look.look().expect("answered on a new socket");
        assert!(started.elapsed() < Duration::from_secs(2), "no wait for a timeout");
        assert_eq!(look.sockets_opened(), 2);
        assert!(!seen.where_configured(IpAddr::from([127, 0, 0, 1])).is_empty(), "the host's lo was asked");
    }
}
