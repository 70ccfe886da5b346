//! Discovery of network namespaces that already exist: nsfs bind mounts in
//! mountinfo (`/run/netns/*`, `/var/run/netns/cni-*`) and the netns of every
//! process (`/proc/*/ns/net`). Keyed by inode; an inode alone is only
//! trusted while the netns lives (the kernel reuses them), which is why the
//! model pairs it with an nsid.
//!
//! Everything here does blocking file-system work: call it from a thread,
//! never from the async runtime.

pub mod listmount;
pub mod mountinfo;

use std::{
    collections::BTreeMap,
    fs, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("opening netns {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("{path} is netns {found}, not {expected}")]
    WrongInode { path: PathBuf, expected: u32, found: u64 },
}

/// Where to look; the defaults see what the agent's mount namespace sees,
/// and the host's too when the agent runs in a container of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryPaths {
    pub proc_root: PathBuf,
    pub mountinfo: PathBuf,
    /// The host's root (`/proc/1/root`, with hostPID) when the agent's
    /// mount namespace is not the host's: netns bind-mounted in host
    /// directories the container does not mount are found in the host's
    /// mount table and opened through it.
    pub host_root: Option<PathBuf>,
}

impl Default for DiscoveryPaths {
    fn default() -> Self {
        Self::with_mountinfo("/proc/self/mountinfo".into())
    }
}

impl DiscoveryPaths {
    /// Discovery through the mount table `mountinfo` (the configured one:
    /// `/proc/1/mountinfo` in the DaemonSet).
    #[must_use]
    pub fn with_mountinfo(mountinfo: PathBuf) -> Self {
        let proc_root = PathBuf::from("/proc");
        let host_root = host_root(&proc_root, &mountinfo);
        Self { proc_root, mountinfo, host_root }
    }

    /// The host's mount table, when it is not the configured one.
    fn host_mountinfo(&self) -> Option<PathBuf> {
        let table = self.host_root.as_ref()?.parent()?.join("mountinfo");
        (table != self.mountinfo).then_some(table)
    }
}

/// The root through which the host's paths open, when the agent's mount
/// namespace is not the host's: `PROC/N/root` of the process whose mount
/// table is configured (`/proc/N/mountinfo`), else of PID 1 (hostPID).
#[must_use]
pub fn host_root(proc_root: &Path, mountinfo: &Path) -> Option<PathBuf> {
    let pid_dir = mountinfo
        .parent()
        .filter(|dir| dir.parent() == Some(proc_root))
        .filter(|dir| dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.parse::<u32>().is_ok()))
        .map_or_else(|| proc_root.join("1"), Path::to_path_buf);
    let own = fs::metadata(proc_root.join("self/ns/mnt")).ok()?.ino();
    let other = fs::metadata(pid_dir.join("ns/mnt")).ok()?.ino();
    (own != other).then(|| pid_dir.join("root"))
}

/// `path` as seen from `root` (`/run/netns/x` -> `/proc/1/root/run/netns/x`).
#[must_use]
pub fn under_root(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// How much to look at: mountinfo alone is cheap; processes cost one
/// readlink per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Mounts,
    Full,
}

/// A process seen inside a netns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessRef {
    pub pid: u32,
    pub comm: String,
}

/// What one scan saw of one netns.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Sighting {
    pub bind_mounts: Vec<PathBuf>,
    /// Processes whose netns it is (0 after a mounts-only scan).
    pub process_count: u32,
    /// A few of them, lowest pids first.
    pub processes: Vec<ProcessRef>,
}

/// Processes kept per netns in a sighting.
pub const PROCESS_SAMPLE: usize = 4;

/// The mount-table changes the model's driver was told of (`POLLPRI` on
/// the configured mountinfo), shared with the discovery thread so that it
/// reads the table again only after a change: re-reading it costs
/// O(mount table) in the kernel (every line formatted), and the table grows
/// with the pods.
#[derive(Debug, Default)]
pub struct MountChanges {
    seen: AtomicU64,
    watched: AtomicBool,
}

impl MountChanges {
    /// Changes of the configured table are watched from now on.
    pub fn watching(&self) {
        self.watched.store(true, Ordering::SeqCst);
    }

    /// They are no longer watched: every read goes to the file again.
    pub fn unwatched(&self) {
        self.watched.store(false, Ordering::SeqCst);
    }

    /// The table changed (counted before the scan it leads to is asked for).
    pub fn changed(&self) {
        self.seen.fetch_add(1, Ordering::SeqCst);
    }

    /// The number of changes seen, while they are watched.
    fn count(&self) -> Option<u64> {
        self.watched.load(Ordering::SeqCst).then(|| self.seen.load(Ordering::SeqCst))
    }
}

/// Whether the mount namespace of `table` (an open mountinfo) changed
/// since this descriptor was last polled: `POLLPRI` with a zero timeout,
/// which never blocks. Each open file keeps its own "last seen" count.
pub fn mount_table_changed(table: &fs::File) -> io::Result<bool> {
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

/// Reads the nsfs mounts with one reusable buffer, and only when the
/// table may have changed since the last read: a read that started after
/// the latest change counted by [`MountChanges`] is still the table. A
/// change not yet counted leaves the result one change behind, never
/// wrong about what it lists; the count that follows asks for a new scan,
/// and resyncs always read afresh.
///
/// When the configured table is this thread's own (mount namespace and
/// root), it is read through listmount/statmount where the kernel has
/// them (6.8+): after a counted change only the mounts added since are
/// asked about. Otherwise, and after any failure of those calls, the text.
#[derive(Debug)]
pub struct MountReader {
    changes: Arc<MountChanges>,
    text: String,
    /// The mounts of the last read, and the change count before it began.
    last: BTreeMap<u32, Sighting>,
    last_count: Option<u64>,
    reads: u64,
    /// The kernel's mount list, until it failed once for good.
    kernel: Option<listmount::KernelMounts>,
    kernel_reads: u64,
    /// Why the kernel's list was not used once was logged (not again).
    told: bool,
    netns: Vec<mountinfo::NetnsMount>,
    /// (proc root, table) found to be this thread's own, for a table that
    /// stays so: `self` or `thread-self`, whose mount namespace and root
    /// change only if the agent itself moves this thread or its main one,
    /// which it never does (its loader thread unshares, no other). Checked
    /// once, not at each read: four path lookups under /proc a read.
    own_table: Option<(PathBuf, PathBuf)>,
}

impl MountReader {
    #[must_use]
    pub fn new(changes: Arc<MountChanges>) -> Self {
        Self {
            changes,
            text: String::new(),
            last: BTreeMap::new(),
            last_count: None,
            reads: 0,
            kernel: Some(listmount::KernelMounts::default()),
            kernel_reads: 0,
            told: false,
            netns: Vec::new(),
            own_table: None,
        }
    }

    /// A reader that always reads the text (tests and benches compare).
    #[must_use]
    pub fn text_only(changes: Arc<MountChanges>) -> Self {
        Self { kernel: None, told: true, ..Self::new(changes) }
    }

    /// Times the table was read (a measure of the work saved).
    #[must_use]
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// Reads of those made through listmount/statmount.
    #[must_use]
    pub fn kernel_reads(&self) -> u64 {
        self.kernel_reads
    }

    /// statmount calls made so far (a measure of the work per change).
    #[must_use]
    pub fn statmounts(&self) -> u64 {
        self.kernel.as_ref().map_or(0, listmount::KernelMounts::statmounts)
    }

    /// The netns bind mounts, by inode: the last read's when no change was
    /// counted since it began (and `fresh` is not asked for), else a new
    /// read.
    pub fn mounts(&mut self, paths: &DiscoveryPaths, fresh: bool) -> Result<&BTreeMap<u32, Sighting>, DiscoveryError> {
        // Only the configured table is watched: with the host's table read
        // too, every read goes to the files.
        let count = if paths.host_mountinfo().is_some() { None } else { self.changes.count() };
        if !fresh && count.is_some() && count == self.last_count {
            return Ok(&self.last);
        }
        // Whether a change was counted since the last read: without one
        // (a resync, an unwatched table) every mount is asked again.
        let counted = !fresh && count.is_some() && self.last_count.is_some();
        self.last_count = None;
        self.last.clear();
        self.reads += 1;
        if self.read_kernel(paths, counted) {
            self.kernel_reads += 1;
        } else {
            read_into(&paths.mountinfo, &mut self.text)
                .map_err(|source| DiscoveryError::Read { path: paths.mountinfo.clone(), source })?;
            add_mounts(&mut self.last, mountinfo::parse(&self.text));
        }
        // The host's mount table, when ours is another: paths as the host
        // (and the CNI runtime) names them.
        if let Some(table) = paths.host_mountinfo()
            && read_into(&table, &mut self.text).is_ok()
        {
            add_mounts(&mut self.last, mountinfo::parse(&self.text));
        }
        self.last_count = count;
        Ok(&self.last)
    }

    /// The configured table through listmount/statmount into `last`;
    /// false: read the text instead.
    fn read_kernel(&mut self, paths: &DiscoveryPaths, counted: bool) -> bool {
        let Some(kernel) = self.kernel.as_mut() else { return false };
        let known_own =
            self.own_table.as_ref().is_some_and(|(proc, table)| *proc == paths.proc_root && *table == paths.mountinfo);
        if !known_own {
            if let Err(e) = listmount::is_own_table(&paths.proc_root, &paths.mountinfo) {
                if !self.told {
                    self.told = true;
                    tracing::debug!("mount table: reading the text ({e})");
                }
                kernel.forget();
                return false;
            }
            if listmount::stays_own(&paths.mountinfo) {
                self.own_table = Some((paths.proc_root.clone(), paths.mountinfo.clone()));
            }
        }
        if !counted {
            kernel.forget();
        }
        match kernel.read(counted, &mut self.netns) {
            Ok(()) => {
                add_mounts(&mut self.last, self.netns.drain(..));
                true
            }
            Err(e) => {
                if e.is_permanent() {
                    tracing::info!("mount table: listmount/statmount unusable ({e}); reading the text");
                    self.kernel = None;
                } else if !self.told {
                    self.told = true;
                    tracing::debug!("mount table: listmount/statmount failed ({e}); reading the text this time");
                }
                false
            }
        }
    }

    /// Every netns visible, by inode (see [`scan`]); the mounts as
    /// [`MountReader::mounts`] gives them, read afresh for a full scan.
    pub fn scan(&mut self, paths: &DiscoveryPaths, scope: Scope) -> Result<BTreeMap<u32, Sighting>, DiscoveryError> {
        let mut found = self.mounts(paths, scope == Scope::Full)?.clone();
        if scope == Scope::Full {
            scan_processes(&paths.proc_root, &mut found)?;
        }
        Ok(found)
    }
}

/// Reads `path` into `text`, reusing its allocation.
fn read_into(path: &Path, text: &mut String) -> io::Result<()> {
    use std::io::Read as _;
    text.clear();
    fs::File::open(path)?.read_to_string(text).map(drop)
}

fn add_mounts(found: &mut BTreeMap<u32, Sighting>, mounts: impl IntoIterator<Item = mountinfo::NetnsMount>) {
    for m in mounts {
        let s = found.entry(m.inode).or_default();
        if !s.bind_mounts.contains(&m.path) {
            s.bind_mounts.push(m.path);
        }
    }
}

/// Every netns visible, by inode, read afresh.
pub fn scan(paths: &DiscoveryPaths, scope: Scope) -> Result<BTreeMap<u32, Sighting>, DiscoveryError> {
    let mut reader = MountReader::new(Arc::default());
    reader.mounts(paths, true)?;
    let mut found = std::mem::take(&mut reader.last);
    if scope == Scope::Full {
        scan_processes(&paths.proc_root, &mut found)?;
    }
    Ok(found)
}

fn scan_processes(proc_root: &Path, found: &mut BTreeMap<u32, Sighting>) -> Result<(), DiscoveryError> {
    let dir = fs::read_dir(proc_root).map_err(|source| DiscoveryError::Read { path: proc_root.into(), source })?;
    let mut pids: Vec<u32> = dir
        .filter_map(Result::ok)
        .filter_map(|e| std::str::from_utf8(e.file_name().as_bytes()).ok().and_then(|s| s.parse().ok()))
        .collect();
    pids.sort_unstable();
    for pid in pids {
        // Processes come and go during the scan: a vanished one is no error.
        let Ok(link) = fs::read_link(proc_root.join(pid.to_string()).join("ns/net")) else {
            continue;
        };
        let Some(inode) = link.to_str().and_then(mountinfo::parse_ns_link) else {
            continue;
        };
        let s = found.entry(inode).or_default();
        s.process_count += 1;
        if s.processes.len() < PROCESS_SAMPLE {
            let comm = fs::read_to_string(proc_root.join(pid.to_string()).join("comm")).unwrap_or_default();
            s.processes.push(ProcessRef { pid, comm: comm.trim_end().to_owned() });
        }
    }
    Ok(())
}

/// The inode of the netns at `path` (a bind mount or `/proc/PID/ns/net`).
pub fn inode_of(path: &Path) -> Result<u64, DiscoveryError> {
    fs::metadata(path).map(|m| m.ino()).map_err(|source| DiscoveryError::Read { path: path.into(), source })
}

/// Opens the netns at `path` and checks it is the expected one (a pid or a
/// mount can be reused between the scan and the open). The fd holds a
/// reference on the netns: close it as soon as the nsid request is sent.
pub fn open_netns(path: &Path, expected: u32) -> Result<OwnedFd, DiscoveryError> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| DiscoveryError::Open {
        path: path.into(),
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: a valid C string; the returned fd is owned below.
    let raw = unsafe { libc::open(c_path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(DiscoveryError::Open { path: path.into(), source: io::Error::last_os_error() });
    }
    // SAFETY: open(2) just returned this fd.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: zeroed stat is a valid out-buffer for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } < 0 {
        return Err(DiscoveryError::Open { path: path.into(), source: io::Error::last_os_error() });
    }
    if st.st_ino != u64::from(expected) {
        return Err(DiscoveryError::WrongInode { path: path.into(), expected, found: st.st_ino });
    }
    Ok(fd)
}

/// Opens netns `inode` through the first candidate path that still leads
/// to it.
#[must_use]
pub fn open_any(inode: u32, candidates: &[PathBuf]) -> Option<(OwnedFd, PathBuf)> {
    candidates.iter().find_map(|p| open_netns(p, inode).ok().map(|fd| (fd, p.clone())))
}

/// A bind mount's path as we see it, then through the host's root.
#[must_use]
pub fn mount_candidates(paths: &DiscoveryPaths, mounts: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = mounts.to_vec();
    if let Some(root) = &paths.host_root {
        out.extend(mounts.iter().map(|m| under_root(root, m)));
    }
    out
}

/// Paths that may lead to a sighted netns: its bind mounts, then its
/// processes.
#[must_use]
pub fn candidate_paths(paths: &DiscoveryPaths, sighting: &Sighting) -> Vec<PathBuf> {
    let mut out = mount_candidates(paths, &sighting.bind_mounts);
    out.extend(sighting.processes.iter().map(|p| paths.proc_root.join(p.pid.to_string()).join("ns/net")));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_netns::TestNetns;

    #[test]
    fn the_mount_table_is_read_again_only_after_a_counted_change() {
        let dir = std::env::temp_dir().join(format!("nrX-mounts-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        let table = dir.join("mountinfo");
        let line =
            |inode: u32, name: &str| format!("{inode} 25 0:4 net:[{inode}] /run/netns/{name} rw - nsfs nsfs rw\n");
        fs::write(&table, line(7, "a")).expect("write table");
        let paths = DiscoveryPaths { proc_root: "/proc".into(), mountinfo: table.clone(), host_root: None };
        let changes = Arc::new(MountChanges::default());
        let mut reader = MountReader::new(Arc::clone(&changes));
        let inodes =
            |r: &mut MountReader, fresh| r.mounts(&paths, fresh).expect("read").keys().copied().collect::<Vec<_>>();

        // Not watched: every call reads.
        assert_eq!(inodes(&mut reader, false), vec![7]);
        assert_eq!(inodes(&mut reader, false), vec![7]);
        assert_eq!(reader.reads(), 2);

        changes.watching();
        assert_eq!(inodes(&mut reader, false), vec![7]);
        fs::write(&table, line(7, "a") + &line(8, "b")).expect("write table");
        // No change counted yet: the last read stands (one change behind).
        assert_eq!(inodes(&mut reader, false), vec![7]);
        assert_eq!(reader.reads(), 3);
        // A resync reads afresh whatever the count says.
        assert_eq!(inodes(&mut reader, true), vec![7, 8]);
        changes.changed();
        fs::write(&table, line(8, "b")).expect("write table");
        assert_eq!(inodes(&mut reader, false), vec![8]);
        assert_eq!(inodes(&mut reader, false), vec![8]);
        assert_eq!(reader.reads(), 5);
        // Watching stopped: back to reading every time.
        changes.unwatched();
        assert_eq!(inodes(&mut reader, false), vec![8]);
        assert_eq!(reader.reads(), 6);
        // A table that cannot be read is an error, and nothing is kept.
        changes.watching();
        fs::remove_file(&table).expect("remove table");
        assert!(reader.mounts(&paths, false).is_err());
        changes.changed();
        assert!(reader.mounts(&paths, false).is_err());
        // A plain file is never this process's table: always the text.
        assert_eq!(reader.kernel_reads(), 0);
        assert!(matches!(
            listmount::is_own_table(Path::new("/proc"), &table),
            Err(listmount::KernelMountsError::OtherTable { .. })
        ));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_a_table_of_our_mount_namespace_and_root_is_listed_by_the_kernel() {
        let proc = Path::new("/proc");
        for own in ["/proc/self/mountinfo", "/proc/thread-self/mountinfo"] {
            listmount::is_own_table(proc, Path::new(own)).unwrap_or_else(|e| panic!("{own}: {e}"));
        }
        for other in ["/proc/self/mounts", "/etc/mountinfo", "/proc/self/task/mountinfo", "/proc/nope/mountinfo"] {
            assert!(listmount::is_own_table(proc, Path::new(other)).is_err(), "{other}");
        }
        // Checked once only where it cannot become another's: not a pid's,
        // which can be reused by a process in another mount namespace.
        for own in ["/proc/self/mountinfo", "/proc/thread-self/mountinfo"] {
            assert!(listmount::stays_own(Path::new(own)), "{own}");
        }
        for pid in ["/proc/1/mountinfo", "/proc/self/mounts", "/proc/1/task/self/mountinfo/x"] {
            assert!(!listmount::stays_own(Path::new(pid)), "{pid}");
        }
    }

    /// A kernel without listmount (before 6.8), or a seccomp profile that
    /// refuses it: the text, at once and from then on, and the same result.
    #[test]
    fn a_kernel_that_refuses_listmount_leaves_the_text() {
        let paths = DiscoveryPaths::default();
        for (errno, permanent) in [(libc::ENOSYS, true), (libc::EPERM, true), (libc::ENOMEM, false)] {
            let changes = Arc::new(MountChanges::default());
            let mut reader = MountReader::new(Arc::clone(&changes));
            if let Some(kernel) = reader.kernel.as_mut() {
                kernel.fail_with = Some(errno);
            }
            let text = || MountReader::text_only(Arc::default()).mounts(&paths, true).expect("reads").clone();
            // Other processes mount meanwhile: compared when the text
            // did not change around the read.
            let settled = (0..20).any(|_| {
                let before = text();
                let seen = reader.mounts(&paths, true).expect("reads").clone();
                before == seen && seen == text()
            });
            assert!(settled, "errno {errno}: the reader never gave the text's mounts");
            assert_eq!(reader.kernel_reads(), 0, "errno {errno}");
            assert_eq!(reader.kernel.is_none(), permanent, "errno {errno}: given up for good");
        }
    }

    fn assert_root() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "this test mounts and creates network namespaces: run it as root");
    }

    /// Whether this kernel has listmount(2), asked without the code under
    /// test: the test expects the kernel's list exactly when it has.
    fn kernel_has_listmount() -> bool {
        #[repr(C)]
        struct Req {
            size: u32,
            spare: u32,
            mnt_id: u64,
            param: u64,
        }
        let req = Req { size: 24, spare: 0, mnt_id: u64::MAX, param: 0 };
        let mut ids = [0u64; 4];
        // SAFETY: a valid request and room for 4 ids.
        let rc = unsafe { libc::syscall(458, &raw const req, ids.as_mut_ptr(), ids.len(), 0) };
        rc >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS)
    }

    /// Runs `f` on a thread in a mount namespace of its own (private, a
    /// tmpfs on /run/netns): no other process's mounts come and go in it,
    /// and whatever the test leaves mounted goes with the thread.
    fn in_own_mount_namespace(f: impl FnOnce() + Send) {
        std::thread::scope(|s| {
            s.spawn(|| {
                let check = |rc: libc::c_int, what: &str| assert!(rc == 0, "{what}: {}", io::Error::last_os_error());
                fs::create_dir_all("/run/netns").expect("creates /run/netns");
                // SAFETY: plain syscalls on this thread's own mount
                // namespace; NUL-terminated literals.
                unsafe {
                    check(libc::unshare(libc::CLONE_NEWNS), "unshare(CLONE_NEWNS)");
                    let none = std::ptr::null();
                    check(
                        libc::mount(none, c"/".as_ptr(), none, libc::MS_REC | libc::MS_PRIVATE, none.cast()),
                        "private /",
                    );
                    check(
                        libc::mount(c"nrmnt9".as_ptr(), c"/run/netns".as_ptr(), c"tmpfs".as_ptr(), 0, none.cast()),
                        "tmpfs",
                    );
                }
                f();
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        });
    }

    fn mount(source: Option<&Path>, target: &Path, fstype: Option<&std::ffi::CStr>, flags: libc::c_ulong) {
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).expect("a path without NUL");
        let source = source.map(c);
        let target = c(target);
        // SAFETY: NUL-terminated strings or null pointers.
        let rc = unsafe {
            libc::mount(
                source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                target.as_ptr(),
                fstype.map_or(std::ptr::null(), std::ffi::CStr::as_ptr),
                flags,
                std::ptr::null(),
            )
        };
        assert!(rc == 0, "mount {target:?} ({flags:#x}): {}", io::Error::last_os_error());
    }

    /// The kernel's list gives what the text gives, after netns are added,
    /// mounted again at a path mountinfo escapes, moved and deleted; and
    /// each change costs statmount calls for the mounts it added only. On
    /// kernels without listmount (before 6.8) the text is read.
    #[test]
    fn the_kernel_list_and_the_text_agree_after_adds_moves_and_deletes() {
        assert_root();
        let has_listmount = kernel_has_listmount();
        in_own_mount_namespace(|| {
            let paths = DiscoveryPaths {
                proc_root: "/proc".into(),
                mountinfo: "/proc/thread-self/mountinfo".into(),
                host_root: None,
            };
            let changes = Arc::new(MountChanges::default());
            changes.watching();
            let mut kernel = MountReader::new(Arc::clone(&changes));
            let mut text = MountReader::text_only(Arc::default());
            let mut agree = |what: &str| {
                changes.changed();
                let seen = kernel.mounts(&paths, false).expect("reads").clone();
                assert_eq!(seen, *text.mounts(&paths, true).expect("reads"), "{what}");
                let reads = if has_listmount { kernel.reads() } else { 0 };
                assert_eq!(kernel.kernel_reads(), reads, "{what}: listmount {has_listmount}");
                (seen, kernel.statmounts())
            };
            let inode = |p: &Path| u32::try_from(inode_of(p).expect("a netns file")).expect("32-bit inode");
            let bound = |seen: &BTreeMap<u32, Sighting>, ns: u32| seen.get(&ns).map(|s| s.bind_mounts.clone());

            let (seen, asked) = agree("at first");
            // Netns mounted on the host when the thread left its mount
            // namespace are still listed (under the fresh tmpfs): none of
            // ours yet.
            let ours = |s: &Sighting| s.bind_mounts.iter().any(|m| m.to_string_lossy().contains("nrmnt9-"));
            assert!(!seen.values().any(ours), "a fresh /run/netns: {seen:?}");
            let a = TestNetns::new("nrmnt9-", "a");
            let b = TestNetns::new("nrmnt9-", "b");
            let (ia, ib) = (inode(&a.path()), inode(&b.path()));
            let (seen, asked_after) = agree("after two adds");
            assert_eq!(bound(&seen, ia), Some(vec![a.path()]));
            assert_eq!(bound(&seen, ib), Some(vec![b.path()]));
            if has_listmount {
                // Two bind mounts (and /run/netns made shared: no mount).
                assert_eq!(asked_after - asked, 2, "only the new mounts are asked");
            }

            // A second mount of `a`, in a private directory (a mount under a
            // shared one cannot be moved), at a name mountinfo escapes.
            let dir = PathBuf::from("/run/netns/nrmnt9-moves");
            fs::create_dir(&dir).expect("mkdir");
            mount(Some(Path::new("nrmnt9")), &dir, Some(c"tmpfs"), 0);
            mount(None, &dir, None, libc::MS_PRIVATE);
            let odd = dir.join("one two\tthree\\four\nfive");
            fs::write(&odd, "").expect("a mount point");
            mount(Some(&a.path()), &odd, None, libc::MS_BIND);
            let (seen, asked) = agree("after a bind mount at an odd name");
            assert_eq!(bound(&seen, ia), Some(vec![a.path(), odd.clone()]));

            // Moved: no mount added or gone, every one asked again.
            let moved = dir.join("moved");
            fs::write(&moved, "").expect("a mount point");
            mount(Some(&odd), &moved, None, libc::MS_MOVE);
            let (seen, asked_after) = agree("after a move");
            assert_eq!(bound(&seen, ia), Some(vec![a.path(), moved.clone()]));
            if has_listmount {
                assert!(asked_after - asked > 4, "a move asks every mount again");
            }

            // Deleted: `a` lives on through its other mount; nothing asked.
            drop(a);
            drop(b);
            let (seen, asked) = agree("after two deletes");
            assert_eq!(bound(&seen, ia), Some(vec![moved.clone()]));
            assert_eq!(bound(&seen, ib), None);
            let c = TestNetns::new("nrmnt9-", "c");
            let (seen, asked_after) = agree("after one more add");
            assert_eq!(bound(&seen, inode(&c.path())), Some(vec![c.path()]));
            if has_listmount {
                assert_eq!(asked_after - asked, 1, "deletes are not asked about");
            }

            // A table of another mount namespace (the process's, not this
            // thread's) is read as text.
            let process = DiscoveryPaths { mountinfo: "/proc/self/mountinfo".into(), ..paths.clone() };
            let mut other = MountReader::new(Arc::default());
            let theirs = other.mounts(&process, false).expect("reads").clone();
            assert_eq!(other.kernel_reads(), 0);
            let ours = |p: &PathBuf| p.starts_with(&dir) || *p == c.path();
            assert!(theirs.values().all(|s| !s.bind_mounts.iter().any(ours)), "{theirs:?}");
        });
    }

    #[test]
    fn our_own_netns_is_found_by_a_full_scan() {
        let paths = DiscoveryPaths::default();
        let own = inode_of(Path::new("/proc/self/ns/net")).expect("own netns") as u32;
        let found = scan(&paths, Scope::Full).expect("scan");
        let me = std::process::id();
        let s = found.get(&own).expect("own netns sighted");
        assert!(s.process_count >= 1);
        assert!(s.processes.len() <= PROCESS_SAMPLE);
        let fd = open_any(own, &[PathBuf::from(format!("/proc/{me}/ns/net"))]).expect("opens");
        drop(fd);
        assert!(matches!(
            open_netns(Path::new("/proc/self/ns/net"), own.wrapping_add(1)),
            Err(DiscoveryError::WrongInode { .. })
        ));
    }
}
