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
    netlink::{query::Querier, wire},
    release::addrtable::{AddressTable, TableCounts},
};

/// The kernel, asked right before unlinks.
pub trait LastLook: Send {
    /// One look at the kernel, now. Taken under a network's lock and held
    /// across that network's group of unlinks, it serves every file of the
    /// group. `Err`: the kernel could not be asked (keeps every file).
    /// `asked`: the IPs of the reservations it will judge; the sighting
    /// says where those are configured, and nothing of other IPs.
    fn look(&mut self, asked: &[IpAddr]) -> Result<Sighting, LookFound>;

    /// One look for one reservation; `Err(why)` keeps it.
    fn before_unlink(&mut self, r: &Reservation) -> Result<(), LookFound> {
        self.look(&[r.ip])?.keeps(r).map_or(Ok(()), Err)
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
    fn look(&mut self, _asked: &[IpAddr]) -> Result<Sighting, LookFound> {
        Ok(Sighting::nothing())
    }
}

/// Where the kernel's answers come from.
pub struct KernelLook {
    /// nsids of every netns the model knows alive.
    known_nsids: Vec<i32>,
    /// Their inodes (a process netns outside them is looked at too).
    known_inodes: crate::fast::Set<u64>,
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
    /// IPv4 addresses of every netns with an nsid, kept by events.
    addresses: Option<AddressTable>,
    /// Sockets opened so far (tests: a broken one is replaced).
    sockets_opened: u64,
}

/// Looks share one [`Kept`] per process unless told otherwise: the agent
/// has one releaser, and two looks at once only wait for each other.
static SHARED_KEPT: LazyLock<Arc<Mutex<Kept>>> = LazyLock::new(Arc::default);

/// Drains the process's address table between looks (the daemon calls it
/// once a second), so that its socket's queue stays short and a look
/// drains only what changed since. Skipped while a look holds the state.
/// Returns whether it drained a table.
#[must_use = "whether a table was drained (tests)"]
pub fn drain_between_looks() -> bool {
    let Ok(mut kept) = SHARED_KEPT.try_lock() else { return false };
    let Some(table) = kept.addresses.as_mut() else { return false };
    if let Err(e) = table.drain() {
        tracing::debug!("last look: the address table's socket failed ({e}); the next look dumps every netns");
        kept.addresses = None;
        return false;
    }
    true
}

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
            match discovery::mount_table_changed(file) {
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

/// Default CNI plugin directories.
pub const DEFAULT_CNI_BIN_DIRS: [&str; 3] = ["/opt/cni/bin", "/usr/lib/cni", "/usr/libexec/cni"];

impl KernelLook {
    #[must_use]
    pub fn new(
        known_nsids: Vec<i32>,
        known_inodes: impl IntoIterator<Item = u64>,
        ledger_in_flight: HashSet<String>,
        cni_bin_dirs: Vec<PathBuf>,
    ) -> Self {
        Self {
            known_nsids,
            // foldhash: asked once per process of the node in the walk.
            known_inodes: known_inodes.into_iter().collect(),
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

    /// What this look's address table did so far; None before a look made
    /// one (tests, bench).
    #[must_use]
    pub fn table_counts(&self) -> Option<TableCounts> {
        self.lock_kept().addresses.as_ref().map(AddressTable::counts)
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

    fn gather(&self, asked: &[IpAddr]) -> Result<Sighting, String> {
        let mut kept = self.lock_kept();
        let reused = kept.querier.is_some();
        match self.gather_with(&mut kept, asked) {
            Ok(seen) => Ok(seen),
            Err(e) => {
                // The kept sockets may be what failed: the look is taken once
                // more, whole, on new ones; a second failure keeps the files.
                kept.querier = None;
                kept.addresses = None;
                if !reused {
                    return Err(e);
                }
                tracing::debug!("last look failed on the kept netlink socket ({e}); once more on a new one");
                let again = self.gather_with(&mut kept, asked);
                if again.is_err() {
                    kept.querier = None;
                    kept.addresses = None;
                }
                again
            }
        }
    }

    fn gather_with(&self, kept: &mut Kept, asked: &[IpAddr]) -> Result<Sighting, String> {
        let Kept { querier, mounts, addresses, sockets_opened } = kept;
        if querier.is_none() {
            *sockets_opened += 1;
            *querier = Some(Querier::open().map_err(|e| e.to_string())?);
        }
        let Some(q) = querier.as_mut() else { return Err("no netlink socket".into()) };
        let mut seen = Sighting { ledger_in_flight: self.ledger_in_flight.clone(), ..Sighting::default() };
        // /proc first: the CNI plugins running now, and the netns of
        // processes the model does not know yet (opened now, asked below).
        // A plugin that exits after this walk configured its addresses
        // before it, so the kernel's answers below, which all come after
        // it, hold them; walked after them, a plugin that configured an
        // address and exited in between would be seen by neither.
        let mut process_netns = self.walk_proc(&mut seen)?;
        // Listed before the table is drained: an nsid given to another netns
        // before the listing has its RTM_NEWNSID drained after it, which
        // drops the stale table, so every listed nsid's table is current.
        let listed = q.nsids().map_err(|e| e.to_string())?;
        // IPv4 from the event-kept table, drained now (after the lock was
        // taken); without one, every netns is dumped whole.
        if asked.iter().any(IpAddr::is_ipv4) && addresses.is_none() {
            match AddressTable::open(q) {
                Ok(t) => *addresses = Some(t),
                Err(e) => tracing::debug!("last look: no address table ({e}); every netns is dumped"),
            }
        }
        if let Some(t) = addresses.as_mut()
            && let Err(e) = t.drain()
        {
            tracing::debug!("last look: the address table's socket failed ({e}); every netns is dumped");
            *addresses = None;
        }
        self.answer_by_nsid(q, addresses.as_mut(), listed, asked, &mut seen)?;
        // Bind-mounted netns the model does not know yet. A table that
        // cannot be read keeps the reservation (the look is unavailable).
        if let Some(paths) = &self.mounts {
            if mounts.as_ref().is_none_or(|t| t.paths != *paths) {
                *mounts = Some(WatchedMounts::new(paths.clone()));
            }
            let Some(table) = mounts.as_mut() else { return Err("no mount table".into()) };
            let looked: HashSet<u64> = process_netns.iter().map(|p| p.inode).collect();
            for (&inode, sighting) in table.current().map_err(|e| e.to_string())? {
                let wide = u64::from(inode);
                if self.known_inodes.contains(&wide) || looked.contains(&wide) {
                    continue;
                }
                let Some((fd, path)) = open_any(inode, &mount_candidates(paths, &sighting.bind_mounts)) else {
                    continue; // unmounted meanwhile: gone, or found by nsid above
                };
                process_netns.push(Unknown { inode: wide, fd, found: Found::Mounted { inode, path } });
            }
        }
        // Then every netns found by its process or its mount: held open by
        // our fd, so alive. One the kernel gives no nsid cannot be asked
        // about, and keeps the reservation (unavailable).
        for Unknown { inode, fd, found } in process_netns {
            let nsid = q.nsid_of(fd.as_raw_fd(), true).map_err(|e| e.to_string())?;
            let (nsid, place) = match found {
                Found::Process(pid) => {
                    let nsid = nsid.ok_or_else(|| format!("no nsid for net:[{inode}], the netns of pid {pid}"))?;
                    (nsid, Place::Process { inode, nsid, pid })
                }
                Found::Mounted { inode, path } => {
                    let nsid = nsid.ok_or_else(|| format!("no nsid for the netns mounted at {}", path.display()))?;
                    (nsid, Place::Mounted { inode, nsid, path })
                }
            };
            dump_whole(q, &mut seen, nsid, &place, asked)?;
        }
        Ok(seen)
    }

    /// Walks /proc: the CNI plugins running now (into `seen`), and the
    /// netns of processes the model does not know, opened now.
    fn walk_proc(&self, seen: &mut Sighting) -> Result<Vec<Unknown>, String> {
        let mut found: Vec<Unknown> = Vec::new();
        let mut looked: HashSet<u64> = HashSet::new();
        let proc_dir = ProcDir::open(&self.proc_root).map_err(|e| format!("{}: {e}", self.proc_root.display()))?;
        let mut exe_buf = [0u8; 4096];
        for pid in proc_dir.pids().map_err(|e| format!("{}: {e}", self.proc_root.display()))? {
            let exe = match proc_dir.exe(pid, &mut exe_buf) {
                Ok(exe) => Some(exe),
                Err(e) if is_kernel_thread_or_gone(&e) => continue,
                // Unreadable (EACCES without CAP_SYS_PTRACE...): no plugin
                // seen, its netns still asked.
                Err(_) => None,
            };
            let Some(inode) = proc_dir.netns_inode(pid) else { continue }; // exited
            // Opened now; its inode is checked again on the fd (the process
            // may have exited and its pid been reused).
            if !self.known_inodes.contains(&inode)
                && !looked.contains(&inode)
                && let Some(fd) = proc_dir.open_netns(pid, inode)
            {
                looked.insert(inode);
                found.push(Unknown { inode, fd, found: Found::Process(pid) });
            }
            if exe.is_some_and(|e| self.cni_bin_dirs.iter().any(|d| e.starts_with(d)))
                && let Some(cid) = proc_dir.container_id(pid)
            {
                seen.running.insert(cid, pid);
            }
        }
        Ok(found)
    }

    /// netreap's own netns (the host's, with hostNetwork), the model's, any
    /// the kernel lists that the model does not know (known only by nsid,
    /// e.g. not openable from here), and any the table keeps: IPv4 from the
    /// table when there is one (each netns without a table seeded by a
    /// dump), the rest by a dump of each.
    fn answer_by_nsid(
        &self,
        q: &mut Querier,
        mut table: Option<&mut AddressTable>,
        listed: Vec<i32>,
        asked: &[IpAddr],
        seen: &mut Sighting,
    ) -> Result<(), String> {
        let dumped = match table {
            Some(_) if asked.iter().any(IpAddr::is_ipv6) => Some(wire::Family::Inet6),
            Some(_) => None,
            None => Some(wire::Family::Both),
        };
        let tabled: Vec<i32> = table.as_ref().map(|t| t.origins().flatten().collect()).unwrap_or_default();
        let mut nsids: HashSet<i32> = HashSet::with_capacity(self.known_nsids.len() + listed.len());
        // The host's nsid for itself names the host, asked first.
        nsids.extend(table.as_ref().map(|t| t.host_nsid()));
        let others = self.known_nsids.iter().copied().chain(listed).chain(tabled).filter(|n| nsids.insert(*n));
        for (i, origin) in std::iter::once(None).chain(others.map(Some)).enumerate() {
            // A refused dump: the nsid is gone, so is its netns; netreap's
            // own cannot be.
            let refused = || if i == 0 { Err("own address dump refused".to_owned()) } else { Ok(()) };
            if let Some(t) = table.as_deref_mut()
                && !t.seed(q, origin).map_err(|e| e.to_string())?
            {
                refused()?;
                continue;
            }
            let Some(family) = dumped else { continue };
            let place = origin.map_or(Place::Host, Place::Nsid);
            let answered = q
                .each_address(origin, family, |a| {
                    if asked.contains(&a.ip) {
                        seen.add(a.ip, place.clone());
                    }
                })
                .map_err(|e| e.to_string())?;
            if !answered {
                refused()?;
            }
        }
        if let Some(t) = table {
            for (ip, origin) in t.holding(asked) {
                seen.add(ip, origin.map_or(Place::Host, Place::Nsid));
            }
        }
        Ok(())
    }
}

/// Whether reading a process's `exe` failed because it has none: a kernel
/// thread (`get_task_exe_file` gives none to `PF_KTHREAD`), or a process
/// past `exit_mm()`, or gone. Kernel threads all share the initial netns
/// (the host's: netreap's own, which every look asks first), and an
/// exiting process drops its namespaces next: neither needs its netns
/// read. That halves the walk where kernel threads are most of /proc.
fn is_kernel_thread_or_gone(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOENT) || e.raw_os_error() == Some(libc::ESRCH)
}

/// A netns the model does not know, held open by the look.
struct Unknown {
    inode: u64,
    fd: OwnedFd,
    found: Found,
}

enum Found {
    Process(u32),
    /// Mount tables name nsfs inodes as 32 bits.
    Mounted {
        inode: u32,
        path: PathBuf,
    },
}

/// Both families of a netns the model did not know, found by its mount or
/// its process and given an nsid just now: dumped whole, even when a table
/// or a dump above answered for that nsid. That nsid may have named another
/// netns until a moment ago (freed by a death after the drain, given to
/// this one now), and this netns's addresses are in no table: it had no
/// nsid, so its events reached none.
fn dump_whole(q: &mut Querier, seen: &mut Sighting, nsid: i32, place: &Place, asked: &[IpAddr]) -> Result<(), String> {
    q.each_address(Some(nsid), wire::Family::Both, |a| {
        if asked.contains(&a.ip) {
            seen.add(a.ip, place.clone());
        }
    })
    .map(drop)
    .map_err(|e| e.to_string())
}

/// `/proc`, read with calls relative to one directory fd and paths built
/// on the stack: a look reads two or three files per process.
struct ProcDir {
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
        Ok(Self { dir: OwnedFd::from(dir) })
    }

    fn fd(&self) -> RawFd {
        self.dir.as_raw_fd()
    }

    /// Every process, by pid. A listing that fails makes the look
    /// unavailable (a process netns would go unasked). Read by getdents64
    /// into one buffer on the stack (rustix's `RawDir`): the listing is
    /// `fs::read_dir`'s, at no allocation per entry (a node has hundreds).
    fn pids(&self) -> io::Result<Vec<u32>> {
        let mut pids = Vec::with_capacity(256);
        // From the start, as a new `read_dir` would (the fd is the walk's).
        rustix::fs::seek(&self.dir, rustix::fs::SeekFrom::Start(0))?;
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
        let mut entries = rustix::fs::RawDir::new(&self.dir, &mut buf);
        while let Some(entry) = entries.next() {
            pids.extend(parse_pid(entry?.file_name().to_bytes()));
        }
        Ok(pids)
    }

    /// The listing as it was read before (the reference of a test).
    #[cfg(test)]
    fn pids_read_dir(root: &Path) -> io::Result<Vec<u32>> {
        let mut pids = Vec::new();
        for entry in fs::read_dir(root)? {
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
    fn exe<'b>(&self, pid: u32, buf: &'b mut [u8]) -> io::Result<&'b Path> {
        let rel = RelPath::new(pid, "exe").ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let path = rel.as_cstr().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid dir fd, a NUL-terminated path, a buffer of the stated length.
        let n = unsafe { libc::readlinkat(self.fd(), path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
        let link = buf.get(..n).filter(|_| n < buf.len()).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))?;
        Ok(Path::new(OsStr::from_bytes(link)))
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

/// A pid's directory name (`fs::read_dir` names parsed as u32, as before).
fn parse_pid(name: &[u8]) -> Option<u32> {
    std::str::from_utf8(name).ok()?.parse().ok()
}

impl Default for KernelLook {
    /// Without a model: every process netns, and the host's, are asked.
    fn default() -> Self {
        Self::new(Vec::new(), HashSet::new(), HashSet::new(), DEFAULT_CNI_BIN_DIRS.iter().map(PathBuf::from).collect())
    }
}

impl LastLook for KernelLook {
    fn look(&mut self, asked: &[IpAddr]) -> Result<Sighting, LookFound> {
        self.gather(asked).map_err(|error| LookFound::Unavailable { error })
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeSet,
        fmt::Write as _,
        io::Write as _,
        process::{Child, Command, Stdio},
        time::{Duration, Instant},
    };

    use super::*;
    use crate::test_netns::{TestNetns, ip};

    fn assert_root() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "this test creates network namespaces: run it as root");
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
        look.look(&[ip]).expect("the kernel answers").where_configured(ip)
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
        let ns = TestNetns::new("nrL", "m");
        ip(&["-n", &ns.0, "addr", "add", "10.213.77.1/32", "dev", "lo"]);
        // Other processes on the machine (agents, other suites' looks) give
        // an nsid to every netns they find: one that did so already makes
        // the look find this netns by nsid, before the mount table.
        let mounted = fs::File::open(format!("/run/netns/{}", ns.0)).expect("opens the test netns");
        let nsid_before = Querier::open().expect("a socket").nsid_of(mounted.as_raw_fd(), false).expect("asks");
        let places = seen(&mut look, address);
        assert!(look.mount_table_reads() > reads, "the change was not seen: the table was not read again");
        // Found by its mount (dumped whole: the look cannot tell that its
        // nsid, if it had one, still names it), and by nsid when it had one.
        let mounted = format!("/run/netns/{}", ns.0);
        assert!(places.iter().any(|p| p.contains(&mounted)), "{places:?}");
        match nsid_before {
            None => assert_eq!(places.len(), 1, "{places:?}"),
            Some(nsid) => {
                let by_nsid = format!("netns nsid {nsid}");
                assert!(places.iter().all(|p| p.contains(&mounted) || *p == by_nsid), "{places:?}");
            }
        }
        assert_eq!(look.sockets_opened(), 1, "one socket for every look");
    }

    /// Without a change the table is not read again (other tests and
    /// helpers change it now and then: some pair of looks in a row shows it).
    #[test]
    fn an_unchanged_mount_table_is_not_read_again() {
        let _one = one_look_at_a_time();
        let mut look = own_look();
        look.look(&[IpAddr::from([127, 0, 0, 1])]).expect("the kernel answers");
        let kept = (0..50).any(|_| {
            let before = look.mount_table_reads();
            look.look(&[IpAddr::from([127, 0, 0, 1])]).expect("the kernel answers");
            look.mount_table_reads() == before
        });
        assert!(kept, "every look read the mount table again");
    }

    /// The walk skips only processes without an executable: every one it
    /// would skip is a kernel thread (`PF_KTHREAD` in its stat), exiting or
    /// a zombie, or gone; this process, which has one, is not skipped.
    #[test]
    fn the_walk_skips_only_kernel_threads() {
        const PF_KTHREAD: u64 = 0x0020_0000;
        const PF_EXITING: u64 = 0x0000_0004;
        let proc_dir = ProcDir::open(Path::new("/proc")).expect("opens /proc");
        let mut buf = [0u8; 4096];
        assert!(proc_dir.exe(std::process::id(), &mut buf).is_ok(), "this process has an executable");
        let mut skipped = 0;
        for pid in proc_dir.pids().expect("lists /proc") {
            let Err(e) = proc_dir.exe(pid, &mut buf) else { continue };
            if !is_kernel_thread_or_gone(&e) {
                continue;
            }
            let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { continue }; // gone
            let fields: Vec<&str> =
                stat.rsplit_once(") ").map(|(_, rest)| rest.split(' ').collect()).unwrap_or_default();
            let flags: u64 = fields.get(6).and_then(|f| f.parse().ok()).expect("a stat line with flags");
            let exiting = flags & PF_EXITING != 0 || matches!(fields.first(), Some(&("Z" | "X")));
            assert!(
                flags & PF_KTHREAD != 0 || exiting,
                "pid {pid} would be skipped but is no kernel thread and not exiting: {stat}"
            );
            skipped += 1;
        }
        // A host or VM has kernel threads (a container without the host's
        // pid namespace would not: this suite runs as root on the host).
        assert!(skipped > 0, "no kernel thread found in /proc");
    }

    /// The getdents64 listing of pids is the one `fs::read_dir` gave: over
    /// many getdents64 calls (more names than one buffer holds), names of
    /// every length, and names that are no pid or parse oddly.
    #[test]
    fn the_pid_listing_is_the_read_dir_listing() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut names: Vec<String> = (0..3000_u32).map(|i| (i * 7919 % 4_000_000).to_string()).collect();
        names.extend(
            [
                "self",
                "thread-self",
                "007",
                "+5",
                "-1",
                "4294967295",
                "4294967296",
                "12a",
                "1 2",
                "é9",
                "x".repeat(200).as_str(),
            ]
            .map(String::from),
        );
        for name in &names {
            std::fs::create_dir(dir.path().join(name)).expect("creates a dir");
        }
        let proc_dir = ProcDir::open(dir.path()).expect("opens");
        let sorted = |mut v: Vec<u32>| {
            v.sort_unstable();
            v
        };
        let listed = sorted(proc_dir.pids().expect("lists"));
        assert_eq!(listed, sorted(ProcDir::pids_read_dir(dir.path()).expect("lists")));
        assert_eq!(listed.len(), 3000 + 3, "every pid (and 007, +5, 4294967295) once");
        assert_eq!(sorted(proc_dir.pids().expect("lists")), listed, "listed again from the start");
        // And /proc itself, whose pids may come and go between the two:
        // this process and pid 1 are in both.
        let proc_dir = ProcDir::open(Path::new("/proc")).expect("opens /proc");
        let own = std::process::id();
        for listing in [proc_dir.pids().expect("lists"), ProcDir::pids_read_dir(Path::new("/proc")).expect("lists")] {
            assert!(listing.contains(&own) && listing.contains(&1), "{listing:?}");
        }
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
            look.look(&[IpAddr::from([127, 0, 0, 1])]).expect("the kernel answers");
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
        // By its process; and by nsid too if something gave it one first.
        let by_process = format!("of pid {}", holder.0.id());
        assert!(places.iter().any(|p| p.ends_with(&by_process)), "{places:?}");
        assert!(places.iter().all(|p| p.ends_with(&by_process) || p.starts_with("netns nsid ")), "{places:?}");
    }

    /// Gives a test netns an nsid, as the model does to every netns it finds.
    fn give_nsid(ns: &TestNetns) -> i32 {
        let fd = fs::File::open(format!("/run/netns/{}", ns.0)).expect("opens the test netns");
        Querier::open().expect("a socket").nsid_of(fd.as_raw_fd(), true).expect("asks").expect("an nsid")
    }

    /// A look as the daemon makes one per batch: the model knows `netns`
    /// (nsid and inode) and the host's netns; what looks keep is `kept`.
    fn model_look(kept: &Arc<Mutex<Kept>>, netns: &[(i32, &TestNetns)]) -> KernelLook {
        use std::os::unix::fs::MetadataExt as _;
        let inode = |path: String| fs::metadata(path).expect("a netns file").ino();
        let nsids = netns.iter().map(|(nsid, _)| *nsid).collect();
        let inodes: Vec<u64> = netns
            .iter()
            .map(|(_, ns)| inode(format!("/run/netns/{}", ns.0)))
            .chain([inode("/proc/self/ns/net".into())])
            .collect();
        let mut look =
            KernelLook::new(nsids, inodes, HashSet::new(), Vec::new()).with_mount_table(DiscoveryPaths::default());
        look.kept = Arc::clone(kept);
        look
    }

    /// The IPv4 answer comes from the event-kept table: an address added
    /// before its netns had an nsid (no event reached the table) is found
    /// by the seeding dump; later removals and adds are followed by events,
    /// without dumping that netns again; two point-to-point addresses with
    /// one local end are two.
    #[test]
    fn the_address_table_follows_the_kernel_between_looks() {
        let _one = one_look_at_a_time();
        assert_root();
        let address = IpAddr::from([10, 213, 79, 1]);
        let ns = TestNetns::new("nrL", "t");
        ip(&["-n", &ns.0, "addr", "add", "10.213.79.1/32", "dev", "lo"]);
        let nsid = give_nsid(&ns);
        let here = vec![format!("netns nsid {nsid}")];
        let mut look = model_look(&Arc::default(), &[(nsid, &ns)]);
        assert_eq!(seen(&mut look, address), here);
        ip(&["-n", &ns.0, "addr", "del", "10.213.79.1/32", "dev", "lo"]);
        assert!(seen(&mut look, address).is_empty(), "a removed address is gone from the table");
        ip(&["-n", &ns.0, "addr", "add", "10.213.79.1/32", "dev", "lo"]);
        assert_eq!(seen(&mut look, address), here);
        ip(&["-n", &ns.0, "addr", "add", "10.213.79.1", "peer", "10.213.79.2", "dev", "lo"]);
        ip(&["-n", &ns.0, "addr", "add", "10.213.79.1", "peer", "10.213.79.3", "dev", "lo"]);
        ip(&["-n", &ns.0, "addr", "del", "10.213.79.1/32", "dev", "lo"]);
        ip(&["-n", &ns.0, "addr", "del", "10.213.79.1", "peer", "10.213.79.2", "dev", "lo"]);
        assert_eq!(seen(&mut look, address), here, "the address with the other peer is still configured");
        let seeds = look.lock_kept().addresses.as_ref().map(|t| t.seeds.get(&Some(nsid)).copied());
        assert_eq!(seeds, Some(Some(1)), "the netns was dumped once, then followed by events");
        let counts = look.table_counts().expect("a table");
        assert!(counts.events >= 6, "{counts:?}");
    }

    /// Where `ips` are configured, from fresh dumps of both families of
    /// netreap's netns and of every nsid the kernel lists, rendered as a
    /// look renders them; and the nsids whose dump the kernel answered.
    fn fresh(q: &mut Querier, ips: &[IpAddr]) -> (BTreeSet<(IpAddr, String)>, HashSet<i32>) {
        let (mut out, mut alive) = (BTreeSet::new(), HashSet::new());
        let origins: Vec<Option<i32>> =
            std::iter::once(None).chain(q.nsids().expect("lists").into_iter().map(Some)).collect();
        for origin in origins {
            let place = origin.map_or(Place::Host, Place::Nsid).to_string();
            let Some(configured) = q.addresses(origin).expect("dumps") else { continue };
            alive.extend(origin);
            for ip in configured.into_iter().filter(|ip| ips.contains(ip)) {
                out.insert((ip, place.clone()));
            }
        }
        (out, alive)
    }

    /// Under churn (netns made, given an nsid and deleted, so that nsids
    /// are given again to new netns; addresses added before and after the
    /// nsid, replaced and flushed), every look sees every address that
    /// fresh dumps taken just after it see, and invents none that fresh
    /// dumps taken just before it did not see, except in a netns that is
    /// dying (its cleanup is asynchronous: the kernel refuses dumps of it
    /// before its RTM_DELNSID reaches the table, and keeping its addresses
    /// until then is the safe side). Between two looks the test only
    /// changes the kernel; during a look and its dumps, netns only go.
    #[test]
    fn the_address_table_agrees_with_fresh_dumps_under_churn() {
        let _one = one_look_at_a_time();
        assert_root();
        let ips: Vec<IpAddr> = (1..=4).map(|i| IpAddr::from([10, 213, 80, i])).collect();
        let kept = Arc::default();
        let mut q = Querier::open().expect("a socket");
        let mut slots: [Option<(i32, TestNetns)>; 3] = [None, None, None];
        for round in 0..48_usize {
            let slot = round % 3;
            let cidr = format!("{}/32", ips[(round / 3) % ips.len()]);
            match (round / 3) % 4 {
                0 | 3 => {
                    slots[slot] = None; // deleted first: its nsid may be given again
                    let ns = TestNetns::new("nrL", &format!("c{slot}"));
                    let nsid = if round % 2 == 0 {
                        ip(&["-n", &ns.0, "addr", "add", &cidr, "dev", "lo"]);
                        give_nsid(&ns)
                    } else {
                        let nsid = give_nsid(&ns);
                        ip(&["-n", &ns.0, "addr", "add", &cidr, "dev", "lo"]);
                        nsid
                    };
                    slots[slot] = Some((nsid, ns));
                }
                1 => {
                    if let Some((_, ns)) = &slots[slot] {
                        ip(&["-n", &ns.0, "addr", "replace", &cidr, "dev", "lo"]);
                    }
                }
                _ => {
                    if let Some((_, ns)) = &slots[slot] {
                        ip(&["-n", &ns.0, "addr", "flush", "dev", "lo"]);
                    }
                }
            }
            // The model knows every slot: the table alone answers for them.
            let known: Vec<(i32, &TestNetns)> = slots.iter().flatten().map(|(nsid, ns)| (*nsid, ns)).collect();
            let mut look = model_look(&kept, &known);
            let (before, _) = fresh(&mut q, &ips);
            let sighting = look.look(&ips).expect("the kernel answers");
            let (after, alive) = fresh(&mut q, &ips);
            let answered: BTreeSet<(IpAddr, String)> =
                ips.iter().flat_map(|&ip| sighting.where_configured(ip).into_iter().map(move |p| (ip, p))).collect();
            assert!(answered.is_superset(&after), "round {round}: the look missed {:?}", after.difference(&answered));
            let invented: Vec<_> = answered
                .difference(&before)
                .filter(|(_, place)| alive.iter().any(|n| *place == Place::Nsid(*n).to_string()))
                .collect();
            assert!(invented.is_empty(), "round {round}: the look invented {invented:?} in live netns");
            assert!(
                answered.iter().all(|(_, place)| place.starts_with("netns nsid ")),
                "round {round}: answered from elsewhere than the table: {answered:?}"
            );
        }
        let counts = model_look(&kept, &[]).table_counts().expect("a table");
        assert_eq!(counts.resets, 0, "no overrun: the table itself was checked");
    }

    /// Between looks the daemon drains the process's table (so that its
    /// queue stays short); what it drained is the table's.
    #[test]
    fn the_shared_table_is_drained_between_looks() {
        let _one = one_look_at_a_time();
        assert_root();
        let ns = TestNetns::new("nrL", "d");
        let nsid = give_nsid(&ns);
        let mut look = model_look(&SHARED_KEPT, &[(nsid, &ns)]);
        let address = IpAddr::from([10, 213, 83, 1]);
        assert!(seen(&mut look, address).is_empty(), "{address} is configured before the test");
        let before = look.table_counts().expect("a table").events;
        ip(&["-n", &ns.0, "addr", "add", "10.213.83.1/32", "dev", "lo"]);
        // Another test's look may hold the state a moment: drained once free.
        let drained = (0..200).any(|_| {
            drain_between_looks() || {
                std::thread::sleep(Duration::from_millis(5));
                false
            }
        });
        assert!(drained, "never drained");
        let after = look.table_counts().expect("a table").events;
        assert!(after > before, "the event was not drained between looks ({before} -> {after})");
        assert_eq!(seen(&mut look, address), vec![format!("netns nsid {nsid}")]);
    }

    /// An overrun of the events socket drops every table; the next seeding
    /// dumps again, and the answer is whole.
    #[test]
    fn an_overrun_of_the_address_events_seeds_every_table_again() {
        let _one = one_look_at_a_time();
        assert_root();
        let ns = TestNetns::new("nrL", "o");
        let nsid = give_nsid(&ns);
        let mut q = Querier::open().expect("a socket");
        let mut table = AddressTable::open_with_buffer(&mut q, 4096).expect("an events socket");
        assert!(table.seed(&mut q, Some(nsid)).expect("dumps"));
        let mut batch = String::new();
        for i in 1..=120 {
            writeln!(batch, "addr add 10.213.81.{i}/32 dev lo").expect("writes to a String");
        }
        let mut child =
            Command::new("ip").args(["-n", &ns.0, "-batch", "-"]).stdin(Stdio::piped()).spawn().expect("runs ip");
        child.stdin.take().expect("piped").write_all(batch.as_bytes()).expect("writes the batch");
        assert!(child.wait().expect("ip ends").success());
        table.drain().expect("drains");
        assert!(table.counts().resets >= 1, "{:?}", table.counts());
        assert_eq!(table.origins().count(), 0, "every table was dropped");
        assert!(table.seed(&mut q, Some(nsid)).expect("dumps"));
        let last = [IpAddr::from([10, 213, 81, 120])];
        assert_eq!(table.holding(&last).collect::<Vec<_>>(), vec![(last[0], Some(nsid))]);
    }

    /// An IPv6 address is asked by a dump, not the table: one added with
    /// `nodad` is notified only later, from a workqueue.
    #[test]
    fn an_ipv6_address_is_asked_by_a_dump() {
        let _one = one_look_at_a_time();
        assert_root();
        let ns = TestNetns::new("nrL", "6");
        let nsid = give_nsid(&ns);
        let mut look = model_look(&Arc::default(), &[(nsid, &ns)]);
        let v4 = IpAddr::from([10, 213, 82, 1]);
        assert!(seen(&mut look, v4).is_empty(), "{v4} is configured before the test");
        ip(&["-n", &ns.0, "link", "set", "lo", "up"]);
        ip(&["-n", &ns.0, "addr", "add", "fd00:213:82::1/128", "dev", "lo", "nodad"]);
        let v6: IpAddr = "fd00:213:82::1".parse().expect("an IPv6 address");
        assert_eq!(seen(&mut look, v6), vec![format!("netns nsid {nsid}")]);
    }

    /// A kept socket that broke is replaced: the look is taken on a new one.
    #[test]
    fn a_broken_socket_is_replaced() {
        let _one = one_look_at_a_time();
        let mut look = KernelLook::default().with_own_state();
        look.look(&[IpAddr::from([127, 0, 0, 1])]).expect("the kernel answers");
        assert_eq!(look.sockets_opened(), 1);
        look.look(&[IpAddr::from([127, 0, 0, 1])]).expect("the kernel answers");
        assert_eq!(look.sockets_opened(), 1, "the socket is kept");
        look.break_socket_for_test();
        let started = Instant::now();
        let seen = look.look(&[IpAddr::from([127, 0, 0, 1])]).expect("answered on a new socket");
        assert!(started.elapsed() < Duration::from_secs(2), "no wait for a timeout");
        assert_eq!(look.sockets_opened(), 2);
        assert!(!seen.where_configured(IpAddr::from([127, 0, 0, 1])).is_empty(), "the host's lo was asked");
    }
}
