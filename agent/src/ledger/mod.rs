//! The attachment ledger: container ID <-> netns <-> CNI operations, built
//! from the kernel's record of every CNI plugin run. It binds a container to
//! its netns even when ADD failed (no CNI cache is written then), and tells
//! an ADD in flight from a leak.

use std::{collections::HashMap, sync::Arc, time::SystemTime};

use bindings::{BindingIndex, Filed, Slot};

use serde::{Deserialize, Serialize};

pub mod bindings;
pub mod persist;

pub use crate::netlink::query::Guess;
use crate::{
    fast::Map,
    ipam::SharedStr,
    kernel::events::{CniExit, KernelEvent},
};

/// Operations kept per container. Past it, finished operations after the
/// first few are dropped oldest first: the first ones (the ADD that made the
/// reservation) and every one in flight are evidence the engine needs, while
/// a script plugin's helper processes (they inherit CNI_* too) are not.
const MAX_OPS_PER_CONTAINER: usize = 32;
const KEEP_FIRST_OPS: usize = 8;
/// Containers kept; the least recently seen go first.
const MAX_CONTAINERS: usize = 65_536;
/// Default [`Ledger::forget_dead`] age: how long a container whose netns
/// died is remembered after its last CNI run. Past it, its reservations
/// have been released or judged (a death is acted on in milliseconds), and
/// keeping it would make memory grow with every pod the node ever ran.
pub const DEAD_NETNS_MAX_AGE: std::time::Duration = std::time::Duration::from_mins(30);

/// How long after its last CNI run a container whose bound netns died is
/// remembered, with the engine's orphan grace `orphan_grace`: at least
/// [`DEAD_NETNS_MAX_AGE`], and never less than the grace (plus a second of
/// clock slack).
///
/// Why this is safe: forgetting a binding the kernel saw die can only turn
/// a reservation's "its bound netns died" (released at once) into "never
/// seen bound" (agent/src/engine/decide.rs: released only once the
/// reservation is older than the orphan grace and its IP is in no live
/// netns) or into "bound netns died before the reservation" (held for the
/// grace after the reservation). Every reservation of that container was
/// made by a CNI run the ledger saw, so at or before its last run: by the
/// time the binding is forgotten the reservation is already older than the
/// grace, and the engine's answer is what it would have been with the
/// binding. Nothing that keeps a reservation (an IP in a live netns, a run
/// in flight, the runtime's or the API's word) comes from a dead binding.
#[must_use]
pub fn dead_binding_max_age(orphan_grace: std::time::Duration) -> std::time::Duration {
    DEAD_NETNS_MAX_AGE.max(orphan_grace + std::time::Duration::from_secs(1))
}

/// One run of one CNI plugin binary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniOperation {
    /// ADD, DEL, CHECK, GC, VERSION, STATUS. Shared: every pass's
    /// observations hold a copy of every run.
    pub command: SharedStr,
    /// The plugin binary's path (shared, as `command`).
    pub plugin: SharedStr,
    pub pid: u32,
    pub started_at: SystemTime,
    pub started_ktime_ns: u64,
    pub finished_at: Option<SystemTime>,
    /// None while in flight, or when the exit was never seen.
    pub exit: Option<CniExit>,
    /// The exit was not observed (lost record or agent restart); the process
    /// was found gone.
    pub exit_unobserved: bool,
    pub ifname: Option<String>,
    pub netns_path: Option<String>,
    /// A value was longer than the kernel's buffer.
    pub truncated: bool,
}

impl CniOperation {
    #[must_use]
    pub fn in_flight(&self) -> bool {
        self.finished_at.is_none()
    }

    #[must_use]
    pub fn result(&self) -> &'static str {
        match (&self.exit, self.exit_unobserved) {
            (None, false) => "in_flight",
            (None, true) => "unknown",
            (Some(e), _) if e.succeeded() => "success",
            (Some(_), _) => "failure",
        }
    }
}

/// What the ledger knows about one container ID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub container_id: String,
    /// CNI_NETNS of the latest operation that named one.
    pub netns_path: Option<String>,
    /// Inode of that netns, resolved when the operation started (0 = unknown).
    pub netns_inode: Option<u64>,
    /// Its nsid when it was resolved (None: unknown).
    #[serde(default)]
    pub netns_nsid: Option<i32>,
    /// Start of the CNI run that resolved `netns_inode`: the binding's date.
    /// (Not the container's first run: a later ADD may name a new netns.)
    pub netns_bound_at: Option<SystemTime>,
    /// The netns incarnation an earlier run of netreap knew this binding
    /// by (restored at start, see [`persist`]); it names the netns instead
    /// of the inode, which may have been reused since.
    #[serde(default)]
    pub pinned: Option<crate::identity::NetnsId>,
    /// The kernel said the netns of this binding (the one above) died;
    /// cleared when a run binds the container anew. Kept in memory only:
    /// a restart re-learns deaths from the kernel (`daemon::restore`).
    #[serde(skip)]
    pub died: Option<BindingDeath>,
    pub ifnames: Vec<String>,
    pub operations: Vec<CniOperation>,
    pub first_seen: SystemTime,
    pub last_seen: SystemTime,
}

/// A death the kernel reported for an attachment's binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindingDeath {
    /// The incarnation that died and when, if the binding's own run
    /// resolved to it (not only its path, through the CNI cache): once the
    /// model has forgotten that netns, the binding still names it rather
    /// than every later holder of its reused inode
    /// (`daemon::evidence::Incarnations::of_binding`).
    pub incarnation: Option<(crate::identity::NetnsId, SystemTime)>,
}

impl Attachment {
    /// Some CNI operation of this container is running now.
    #[must_use]
    pub fn in_flight(&self) -> bool {
        self.operations.iter().any(CniOperation::in_flight)
    }

    /// The last ADD that finished, and whether it succeeded.
    #[must_use]
    pub fn last_finished(&self, command: &str) -> Option<&CniOperation> {
        self.operations.iter().rev().find(|op| op.command == command && !op.in_flight())
    }
}

/// Resolves a CNI_NETNS path to its netns inode (stat), when it exists.
/// `pid`: the plugin process that named it, whose own root is tried first
/// (the path as the plugin sees it, from the nearest point to its exec).
pub trait NetnsResolver {
    fn inode_of(&self, path: &str, pid: Option<u32>) -> Option<u64>;

    /// The nsid (in netreap's netns) of the netns at `path`, which has
    /// `inode`, assigning one when it has none: with it, a binding names the
    /// incarnation even if the model never gets to open that netns.
    fn nsid_of(&self, _path: &str, _pid: Option<u32>, _inode: u32) -> Option<i32> {
        None
    }

    /// Both: the inode of the netns at `path` and its nsid (the nsid only
    /// with an inode). `guess`: whether that netns likely has an nsid yet
    /// (a hint for the order of the requests, never for the answer).
    fn resolve(&self, path: &str, pid: Option<u32>, _guess: Guess) -> (Option<u64>, Option<i32>) {
        let Some(inode) = self.inode_of(path, pid) else { return (None, None) };
        (Some(inode), self.nsid_of(path, pid, inode as u32))
    }
}

/// Resolves with `stat(2)`: a bind mount of nsfs or /proc/PID/ns/net. A
/// path that is not nsfs (the empty mount point `ip netns del` leaves for a
/// moment after unmounting) resolves to nothing, never to its own inode.
#[derive(Default)]
pub struct StatResolver {
    /// The host's root when the agent's mount namespace is another
    /// (`discovery::host_root`): runtime paths are the host's.
    pub host_root: Option<std::path::PathBuf>,
    /// Asks the kernel for nsids (opened on first use).
    querier: std::cell::RefCell<Option<crate::netlink::query::Querier>>,
}

impl StatResolver {
    #[must_use]
    pub fn new(host_root: Option<std::path::PathBuf>) -> Self {
        Self { host_root, querier: std::cell::RefCell::new(None) }
    }

    /// Where `path` may be found: the plugin's root, ours, then the host's
    /// (in a container, runtime paths are the host's).
    fn candidates(&self, path: &str, pid: Option<u32>) -> Vec<std::path::PathBuf> {
        let mut candidates: Vec<std::path::PathBuf> = Vec::with_capacity(3);
        if let Some(pid) = pid {
            candidates
                .push(crate::discovery::under_root(std::path::Path::new(&format!("/proc/{pid}/root")), path.as_ref()));
        }
        candidates.push(path.into());
        if let Some(root) = &self.host_root {
            candidates.push(crate::discovery::under_root(root, path.as_ref()));
        }
        candidates
    }
}

/// `statfs(2)` type of the namespace filesystem.
const NSFS_MAGIC: i64 = 0x6e73_6673;

impl NetnsResolver for StatResolver {
    fn inode_of(&self, path: &str, pid: Option<u32>) -> Option<u64> {
        self.candidates(path, pid).iter().find_map(|p| p.to_str().and_then(nsfs_inode))
    }

    fn nsid_of(&self, path: &str, pid: Option<u32>, inode: u32) -> Option<i32> {
        let fd = self.candidates(path, pid).iter().find_map(|p| crate::discovery::open_netns(p, inode).ok())?;
        self.nsid_by_fd(&fd, Guess::Unassigned)
    }

    /// One path walk fewer than `inode_of` + `nsid_of` (a CNI run costs
    /// one of these): the nsfs file found is opened once, and its inode and
    /// nsid come from that open file. Only a path `statfs` shows on nsfs is
    /// opened (CNI_NETNS is any string a plugin's caller chose).
    fn resolve(&self, path: &str, pid: Option<u32>, guess: Guess) -> (Option<u64>, Option<i32>) {
        // The candidates of `candidates`, in its order, each built only
        // when the one before did not resolve (usually the first does).
        let plugin_root = pid.map(|pid| {
            let mut root = Vec::with_capacity(32);
            let _ = std::io::Write::write_fmt(&mut root, format_args!("/proc/{pid}/root"));
            root
        });
        let host_root = self.host_root.as_deref().map(|r| std::os::unix::ffi::OsStrExt::as_bytes(r.as_os_str()));
        let roots = [plugin_root.as_deref(), Some(&b""[..]), host_root];
        for root in roots.into_iter().flatten() {
            let Some(c_path) = under_root_c(root, path) else { continue };
            if !on_nsfs(&c_path) {
                continue;
            }
            if let Some((fd, inode)) = open_nsfs(&c_path) {
                return (Some(inode), self.nsid_by_fd(&fd, guess));
            }
            // Not openable now (a race, or no fd left): as `inode_of` +
            // `nsid_of` would say.
            let inode = c_path.to_str().ok().and_then(nsfs_inode);
            if let Some(inode) = inode {
                return (Some(inode), self.nsid_of(path, pid, inode as u32));
            }
        }
        (None, None)
    }
}

impl StatResolver {
    /// The nsid of the netns behind `fd`, assigned when it has none.
    fn nsid_by_fd(&self, fd: &std::os::fd::OwnedFd, guess: Guess) -> Option<i32> {
        let mut querier = self.querier.try_borrow_mut().ok()?;
        if querier.is_none() {
            *querier = crate::netlink::query::Querier::open().ok();
        }
        querier.as_mut()?.nsid_or_assign(std::os::fd::AsRawFd::as_raw_fd(fd), guess).ok().flatten()
    }
}

/// `path` under `root` for the kernel, without the `PathBuf`s of
/// [`StatResolver::candidates`]: the same file as
/// `discovery::under_root` names (an empty root: `path` itself). It may
/// differ from that name by a doubled `/` or a `.` component, which the
/// kernel's walk reads alike. None for a path with a NUL.
fn under_root_c(root: &[u8], path: &str) -> Option<std::ffi::CString> {
    let mut bytes = Vec::with_capacity(root.len() + path.len() + 2);
    bytes.extend_from_slice(root);
    if !root.is_empty() && !path.starts_with('/') {
        bytes.push(b'/');
    }
    bytes.extend_from_slice(path.as_bytes());
    std::ffi::CString::new(bytes).ok()
}

/// Whether `path` is a file of the namespace filesystem (`statfs`, which
/// opens nothing).
fn on_nsfs(path: &std::ffi::CStr) -> bool {
    // SAFETY: a zeroed statfs is a valid out-struct.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    unsafe { libc::statfs(path.as_ptr(), &raw mut fs) == 0 && fs.f_type == NSFS_MAGIC }
}

/// Opens the nsfs file at `path` and returns it with its inode; None when
/// it does not open or what opened is not on nsfs (the path changed since
/// it was checked).
fn open_nsfs(path: &std::ffi::CStr) -> Option<(std::os::fd::OwnedFd, u64)> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    // SAFETY: a NUL-terminated path; the fd returned is owned below.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        return None;
    }
    // SAFETY: open(2) just returned this fd.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    // SAFETY: zeroed out-structs are valid for fstatfs and fstat.
    let (mut fs, mut st): (libc::statfs, libc::stat) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: a valid fd and out-pointers.
    let nsfs = unsafe { libc::fstatfs(fd.as_raw_fd(), &raw mut fs) == 0 && fs.f_type == NSFS_MAGIC };
    // SAFETY: as above.
    if !nsfs || unsafe { libc::fstat(fd.as_raw_fd(), &raw mut st) } != 0 {
        return None;
    }
    Some((fd, st.st_ino))
}

/// The inode of the nsfs file at `path`; None for anything else.
fn nsfs_inode(path: &str) -> Option<u64> {
    {
        use std::os::unix::fs::MetadataExt as _;
        let c_path = std::ffi::CString::new(path).ok()?;
        // SAFETY: a NUL-terminated path and a zeroed out-struct.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::statfs(c_path.as_ptr(), &raw mut fs) } != 0 || fs.f_type != NSFS_MAGIC {
            return None;
        }
        std::fs::metadata(path).ok().map(|m| m.ino())
    }
}

#[derive(Debug)]
pub struct Ledger {
    /// Each container's attachment, by its slot.
    by_container: Map<String, Slot>,
    /// Shared with the last `/state` snapshot: a snapshot copies pointers,
    /// and a change copies only the attachment it changes while a snapshot
    /// still holds it.
    attachments: slab::Slab<Arc<Attachment>>,
    /// Their bindings, filed by the netns they may name.
    bindings: BindingIndex,
    /// Running plugin processes -> their container.
    running: HashMap<u32, Run>,
    /// Runs whose environment the kernel could not read to its end and
    /// that named no container: unknown, so in flight for every container
    /// until their process exits. Keyed by pid; reaped with the process.
    unattributed: HashMap<u32, CniOperation>,
    /// Containers kept ([`MAX_CONTAINERS`]; fewer in tests).
    max_containers: usize,
}

impl Default for Ledger {
    fn default() -> Self {
        Self {
            by_container: Map::default(),
            attachments: slab::Slab::new(),
            bindings: BindingIndex::default(),
            running: HashMap::new(),
            unattributed: HashMap::new(),
            max_containers: MAX_CONTAINERS,
        }
    }
}

/// A plugin process running a CNI operation.
#[derive(Debug, Clone)]
struct Run {
    container: String,
    /// What its exec record's CNI_NETNS resolved to (inode and nsid), when
    /// both were, for its nested runs.
    netns: Option<(u64, i32)>,
}

impl Ledger {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one kernel event in. `wall` converts its monotonic time.
    pub fn observe(
        &mut self,
        event: &KernelEvent,
        wall: impl Fn(u64) -> SystemTime,
        resolver: &impl NetnsResolver,
    ) -> Option<&Attachment> {
        match event {
            KernelEvent::CniExec { task, exec } => {
                let at = wall(task.ktime_ns);
                let container_id = exec.container_id.as_ref().map(|v| v.value.clone()).unwrap_or_default();
                // A process exec'ing again ends what it ran before.
                self.unattributed.remove(&task.tgid);
                if container_id.is_empty() {
                    if exec.env_scan_limited {
                        self.track_unattributed(task, exec, at);
                    }
                    return None;
                }
                let netns_path = exec.netns.as_ref().map(|v| v.value.clone()).filter(|p| !p.is_empty());
                let ifname = exec.ifname.as_ref().map(|v| v.value.clone()).filter(|i| !i.is_empty());
                let truncated = exec.command.truncated
                    || exec.container_id.as_ref().is_some_and(|v| v.truncated)
                    || exec.netns.as_ref().is_some_and(|v| v.truncated)
                    || exec.ifname.as_ref().is_some_and(|v| v.truncated);
                // Any run but an ADD (a DEL, a CHECK) naming the path its
                // container is bound to, by a run's resolution not known
                // to have died, leaves that binding as it is, unresolved:
                // only an ADD configures a netns, so only an ADD's netns
                // can hold the container's addresses (see `kept_binding`).
                let kept = (exec.command.value != "ADD" && !truncated)
                    .then(|| self.kept_binding(&container_id, netns_path.as_deref()?))
                    .flatten();
                // A nested run (bridge's host-local) takes its parent run's
                // resolution of the same path: made when the parent's
                // record was read, never later than this one's would be
                // (the parent exec'd first, so its record is ahead in the
                // ring), so no further from the netns the operation used.
                // Only that run's own resolution, never one found by path
                // or inode: a path or inode may name a new netns since.
                let inherited = || {
                    exec.nested_in.filter(|_| !truncated).and_then(|parent| {
                        self.parent_resolution(parent, &container_id, &exec.command.value, netns_path.as_deref()?)
                    })
                };
                // An ADD's netns is usually new, without an nsid yet; any
                // other run's was given one by the ADD's resolution.
                let guess = if exec.command.value == "ADD" { Guess::Unassigned } else { Guess::Assigned };
                let (netns_inode, netns_nsid) = match kept {
                    Some(_) => (None, None),
                    None => inherited().map_or_else(
                        || netns_path.as_deref().map_or((None, None), |p| resolver.resolve(p, Some(task.tgid), guess)),
                        |(inode, nsid)| (Some(inode), Some(nsid)),
                    ),
                };
                self.evict_if_full();
                let slot = match self.by_container.get(&container_id) {
                    Some(&slot) => slot,
                    None => self.insert(Attachment {
                        container_id: container_id.clone(),
                        netns_path: None,
                        netns_inode: None,
                        netns_nsid: None,
                        netns_bound_at: None,
                        pinned: None,
                        died: None,
                        ifnames: Vec::new(),
                        operations: Vec::new(),
                        first_seen: at,
                        last_seen: at,
                    }),
                };
                self.bind(slot, at, netns_path.as_ref(), (netns_inode, netns_nsid), ifname.as_ref());
                // A process exec'ing a second CNI binary (a plugin delegating
                // to IPAM by exec, rare) finishes its first operation.
                let run = Run { container: container_id.clone(), netns: kept.or(netns_inode.zip(netns_nsid)) };
                if let Some(previous) = self.running.insert(task.tgid, run)
                    && let Some(prev) = self.attachment_mut(&previous.container)
                {
                    finish(prev, task.tgid, at, None, true);
                }
                let entry = Arc::make_mut(self.attachments.get_mut(slot)?);
                entry.operations.push(CniOperation {
                    command: SharedStr::from(&exec.command.value),
                    plugin: SharedStr::from(&exec.binary.value),
                    pid: task.tgid,
                    started_at: at,
                    started_ktime_ns: task.ktime_ns,
                    finished_at: None,
                    exit: None,
                    exit_unobserved: false,
                    ifname,
                    netns_path,
                    truncated,
                });
                if entry.operations.len() > MAX_OPS_PER_CONTAINER {
                    let victim = entry.operations.iter().skip(KEEP_FIRST_OPS).position(|op| !op.in_flight());
                    if let Some(i) = victim {
                        entry.operations.remove(KEEP_FIRST_OPS + i);
                    }
                }
                Some(entry)
            }
            KernelEvent::CniExit { task, exit } => {
                if self.unattributed.remove(&task.tgid).is_some() {
                    return None;
                }
                let container_id = self.running.remove(&task.tgid)?.container;
                let entry = self.attachment_mut(&container_id)?;
                finish(entry, task.tgid, wall(task.ktime_ns), Some(exit.clone()), false);
                Some(entry)
            }
            _ => None,
        }
    }

    /// Records a run of the attachment in `slot` at `at`, naming
    /// `netns_path` that resolved to `resolved` (inode, nsid): it binds the
    /// container anew, unless it names the same path and resolved nothing
    /// (a DEL after the netns is gone keeps the inode learned while it was
    /// alive). The binding is filed again when it changed.
    fn bind(
        &mut self,
        slot: Slot,
        at: SystemTime,
        netns_path: Option<&String>,
        (netns_inode, netns_nsid): (Option<u64>, Option<i32>),
        ifname: Option<&String>,
    ) {
        // Only a run that names a netns may bind the container anew.
        let filed_before = netns_path.and(self.attachments.get(slot)).map(|a| Filed::of(a));
        let Some(entry) = self.attachments.get_mut(slot).map(Arc::make_mut) else { return };
        entry.last_seen = at;
        if let Some(path) = netns_path {
            if netns_inode.is_some() || entry.netns_path.as_ref() != Some(path) {
                entry.netns_inode = netns_inode;
                entry.netns_nsid = netns_nsid;
                entry.netns_bound_at = netns_inode.map(|_| at);
                entry.pinned = None;
                entry.died = None;
            }
            entry.netns_path = Some(path.clone());
        }
        if let Some(ifname) = ifname
            && !entry.ifnames.contains(ifname)
        {
            entry.ifnames.push(ifname.clone());
        }
        if let Some(before) = filed_before {
            let after = Filed::of(entry);
            if after != before {
                self.bindings.unfile(slot, &before);
                self.bindings.file(slot, &after);
            }
        }
    }

    /// Closes operations whose process is gone although no exit was seen
    /// (a dropped record, or an agent restart); `alive(pid)` checks /proc.
    pub fn reap_vanished(&mut self, now: SystemTime, alive: impl Fn(u32) -> bool) -> usize {
        self.unattributed.retain(|pid, _| alive(*pid));
        let gone: Vec<(u32, String)> =
            self.running.iter().filter(|(pid, _)| !alive(**pid)).map(|(p, r)| (*p, r.container.clone())).collect();
        for (pid, container) in &gone {
            self.running.remove(pid);
            if let Some(entry) = self.attachment_mut(container) {
                finish(entry, *pid, now, None, true);
            }
        }
        gone.len()
    }

    /// Runs in flight whose container is unknown (the kernel's environment
    /// scan stopped before CNI_CONTAINERID): each concerns every container.
    pub fn unattributed_runs(&self) -> impl Iterator<Item = &CniOperation> {
        self.unattributed.values()
    }

    fn track_unattributed(
        &mut self,
        task: &crate::kernel::events::Task,
        exec: &crate::kernel::events::CniExec,
        at: SystemTime,
    ) {
        // Ends the run this process was in, if any (see the exec path).
        if let Some(previous) = self.running.remove(&task.tgid)
            && let Some(prev) = self.attachment_mut(&previous.container)
        {
            finish(prev, task.tgid, at, None, true);
        }
        self.unattributed.insert(
            task.tgid,
            CniOperation {
                command: SharedStr::from(&exec.command.value),
                plugin: SharedStr::from(&exec.binary.value),
                pid: task.tgid,
                started_at: at,
                started_ktime_ns: task.ktime_ns,
                finished_at: None,
                exit: None,
                exit_unobserved: false,
                ifname: None,
                netns_path: None,
                truncated: true,
            },
        );
    }

    /// Some CNI run is in the ledger and not finished.
    #[must_use]
    pub fn any_running(&self) -> bool {
        !self.running.is_empty() || !self.unattributed.is_empty()
    }

    /// A CNI run of this process is in the ledger and not finished.
    #[must_use]
    pub fn is_running(&self, pid: u32) -> bool {
        self.running.contains_key(&pid) || self.unattributed.contains_key(&pid)
    }

    /// For a CNI run of this process in the ledger and not finished: the
    /// container it runs for, None when the kernel did not name it whole
    /// (its environment was cut short, or a value was truncated). None
    /// outside when no such run is.
    #[must_use]
    pub fn running_for(&self, pid: u32) -> Option<Option<String>> {
        if self.unattributed.contains_key(&pid) {
            return Some(None);
        }
        let container = &self.running.get(&pid)?.container;
        let whole = self.get(container).is_some_and(|a| {
            a.operations.iter().rev().find(|op| op.pid == pid && op.in_flight()).is_some_and(|op| !op.truncated)
        });
        Some(whole.then(|| container.clone()))
    }

    #[must_use]
    pub fn get(&self, container_id: &str) -> Option<&Attachment> {
        self.by_container.get(container_id).and_then(|&slot| self.in_slot(slot))
    }

    /// The slots of the attachments whose container ID is `container_id`
    /// or a prefix of it (a run whose ID was cut short is filed under what
    /// the kernel read), each once (one ID, one slot), shortest ID first.
    /// Sorted, slots are the order [`Ledger::attachments`] walks.
    pub fn slots_prefixing<'l>(&'l self, container_id: &'l str) -> impl Iterator<Item = Slot> + 'l {
        let ends = container_id.char_indices().map(|(i, _)| i).chain([container_id.len()]);
        ends.filter_map(|end| self.by_container.get(&container_id[..end]).copied())
    }

    /// The attachment in `slot` (as [`Ledger::bindings`] files it).
    #[must_use]
    pub fn in_slot(&self, slot: Slot) -> Option<&Attachment> {
        self.attachments.get(slot).map(AsRef::as_ref)
    }

    /// The bindings of every attachment, by the netns they may name.
    #[must_use]
    pub fn bindings(&self) -> &BindingIndex {
        &self.bindings
    }

    /// How many containers the ledger holds (those of the last
    /// [`DEAD_NETNS_MAX_AGE`] included).
    #[must_use]
    pub fn len(&self) -> usize {
        self.attachments.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.attachments.is_empty()
    }

    pub fn attachments(&self) -> impl Iterator<Item = &Attachment> {
        self.attachments.iter().map(|(_, a)| a.as_ref())
    }

    /// Every attachment, shared (a copy costs a pointer).
    pub fn shared_attachments(&self) -> impl Iterator<Item = &Arc<Attachment>> {
        self.attachments.iter().map(|(_, a)| a)
    }

    /// Adds an attachment of a container the ledger does not know, filing
    /// its binding.
    fn insert(&mut self, a: Attachment) -> Slot {
        let filed = Filed::of(&a);
        let container = a.container_id.clone();
        let slot = self.attachments.insert(Arc::new(a));
        self.bindings.file(slot, &filed);
        self.by_container.insert(container, slot);
        slot
    }

    /// Forgets a container's attachment and its binding.
    fn remove(&mut self, container_id: &str) {
        if let Some(slot) = self.by_container.remove(container_id)
            && let Some(a) = self.attachments.try_remove(slot)
        {
            self.bindings.unfile(slot, &Filed::of(&a));
        }
    }

    /// A container's attachment, to change anything but its binding (the
    /// fields [`Filed`] reads): that is filed in `observe` alone.
    fn attachment_mut(&mut self, container_id: &str) -> Option<&mut Attachment> {
        let slot = *self.by_container.get(container_id)?;
        self.attachments.get_mut(slot).map(Arc::make_mut)
    }

    /// Adds attachments an earlier run recorded, unless this run has seen
    /// the container already. Runs recorded in flight stay in flight until
    /// their process is found gone ([`Ledger::reap_vanished`]).
    pub fn restore(&mut self, attachments: Vec<Attachment>) {
        for a in attachments {
            if self.by_container.contains_key(&a.container_id) || self.by_container.len() >= self.max_containers {
                continue;
            }
            for op in a.operations.iter().filter(|op| op.in_flight()) {
                self.running.entry(op.pid).or_insert_with(|| Run { container: a.container_id.clone(), netns: None });
            }
            self.insert(a);
        }
    }

    /// Forgets containers whose netns `is_dead` says died, that have
    /// nothing in flight and were last seen more than `max_age` before
    /// `now`. What is not known dead is never forgotten here (only the
    /// size bound evicts it): absence of evidence is not death. Returns how
    /// many were forgotten.
    pub fn forget_dead(
        &mut self,
        now: SystemTime,
        max_age: std::time::Duration,
        is_dead: impl Fn(&Attachment) -> bool,
    ) -> usize {
        let forgotten: Vec<String> = self
            .attachments()
            .filter(|a| {
                let old = now.duration_since(a.last_seen).is_ok_and(|age| age > max_age);
                old && !a.in_flight() && is_dead(a)
            })
            .map(|a| a.container_id.clone())
            .collect();
        for c in &forgotten {
            self.remove(c);
        }
        forgotten.len()
    }

    /// The kernel said the netns `containers` are bound to died (the
    /// containers a death names: `daemon::evidence::containers_of_death`):
    /// marked on their present binding, for [`Ledger::forget_dead_bindings`].
    /// `incarnation` (the dead netns and when it died) is kept for the
    /// bindings `resolved_to_it` says their own run resolved to it.
    pub fn netns_died(
        &mut self,
        containers: &[String],
        incarnation: (crate::identity::NetnsId, SystemTime),
        resolved_to_it: impl Fn(&Attachment) -> bool,
    ) {
        for c in containers {
            if let Some(a) = self.attachment_mut(c) {
                let ours = resolved_to_it(a).then_some(incarnation);
                // A death named through the cache's path alone does not
                // replace the incarnation the run's own resolution named.
                let earlier = a.died.and_then(|d| d.incarnation);
                a.died = Some(BindingDeath { incarnation: ours.or(earlier) });
            }
        }
    }

    /// Forgets containers whose bound netns the kernel said died
    /// ([`Ledger::netns_died`], about the binding they still have), with
    /// nothing in flight, last seen more than `max_age` before `now` (see
    /// [`dead_binding_max_age`] for a safe one): the ledger stays as large as
    /// the pods of the last `max_age`, not of every pod ever run. Returns
    /// how many were forgotten.
    pub fn forget_dead_bindings(&mut self, now: SystemTime, max_age: std::time::Duration) -> usize {
        self.forget_dead(now, max_age, |a| a.died.is_some())
    }

    /// The binding (inode, nsid) that a run other than an ADD naming
    /// `path` for `container` leaves as it is: one a run's own resolution
    /// of the same path made (not restored from an earlier agent: a pinned
    /// binding is resolved anew, as before), whose netns the kernel has not
    /// said died. Resolving again would find that netns, or, if the path
    /// was mounted over meanwhile, a netns this run may tear down but no
    /// run of the container configured: its addresses are the ADD's, in
    /// the netns the ADD resolved (a later ADD binds anew). After a death,
    /// the path is resolved again, as every run's was before.
    fn kept_binding(&self, container: &str, path: &str) -> Option<(u64, i32)> {
        let a = self.get(container)?;
        let resolved = a.netns_inode.zip(a.netns_nsid)?;
        (a.netns_path.as_deref() == Some(path) && a.netns_bound_at.is_some() && a.pinned.is_none() && a.died.is_none())
            .then_some(resolved)
    }

    /// The resolution of `path` that the run of process `parent`, in
    /// flight, made for the same operation (container, command and path,
    /// none of them cut), if it resolved both inode and nsid.
    fn parent_resolution(&self, parent: u32, container: &str, command: &str, path: &str) -> Option<(u64, i32)> {
        let run = self.running.get(&parent)?;
        let resolved = run.netns.filter(|_| run.container == container)?;
        let op = self.get(container)?.operations.iter().rev().find(|op| op.pid == parent && op.in_flight())?;
        (!op.truncated && op.command == command && op.netns_path.as_deref() == Some(path)).then_some(resolved)
    }

    fn evict_if_full(&mut self) {
        if self.by_container.len() < self.max_containers {
            return;
        }
        // Evict the least recently seen container that has nothing in flight.
        let victim =
            self.attachments().filter(|a| !a.in_flight()).min_by_key(|a| a.last_seen).map(|a| a.container_id.clone());
        if let Some(victim) = victim {
            self.remove(&victim);
        }
    }
}

fn finish(entry: &mut Attachment, pid: u32, at: SystemTime, exit: Option<CniExit>, unobserved: bool) {
    if let Some(op) = entry.operations.iter_mut().rev().find(|op| op.pid == pid && op.in_flight()) {
        op.finished_at = Some(at);
        op.exit = exit;
        op.exit_unobserved = unobserved;
    }
    entry.last_seen = entry.last_seen.max(at);
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::kernel::events::{CniExec, CniValue, Task};

    struct FixedResolver(Option<u64>);
    impl NetnsResolver for FixedResolver {
        fn inode_of(&self, _: &str, _: Option<u32>) -> Option<u64> {
            self.0
        }
    }

    fn wall(ns: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(ns)
    }

    fn v(s: &str) -> CniValue {
        CniValue { value: s.into(), truncated: false }
    }

    fn task(pid: u32, t: u64) -> Task {
        Task { ktime_ns: t, pid, tgid: pid, comm: "bridge".into(), cgroup_id: 1 }
    }

    fn exec(pid: u32, t: u64, command: &str, container: &str) -> KernelEvent {
        KernelEvent::CniExec {
            task: task(pid, t),
            exec: CniExec {
                binary: v("/usr/lib/cni/bridge"),
                command: v(command),
                container_id: Some(v(container)),
                netns: Some(v("/var/run/netns/cni-1")),
                ifname: Some(v("eth0")),
                cni_args: None,
                env_scan_limited: false,
                env_scanned: 10,
                uid: 0,
                scan_variant: crate::kernel::events::EnvScanVariant::BpfLoop,
                nested_in: None,
            },
        }
    }

    fn exit(pid: u32, t: u64, code: u32) -> KernelEvent {
        KernelEvent::CniExit { task: task(pid, t), exit: CniExit::from_wait_status(code << 8) }
    }

    /// The attachments a run of a container may be filed under: its own
    /// ID, and each prefix of it (a run whose ID was cut short), cut at
    /// character boundaries only. (A run naming no ID is not filed.)
    #[test]
    fn slots_prefixing_an_id_are_those_of_its_prefixes() {
        let mut l = Ledger::new();
        let ids = ["", "a", "ab", "abc", "é", "éa", "b"];
        for (pid, id) in (1..).zip(ids) {
            l.observe(&exec(pid, u64::from(pid), "ADD", id), wall, &FixedResolver(None));
        }
        let named = |container: &str| -> Vec<&str> {
            let mut slots: Vec<Slot> = l.slots_prefixing(container).collect();
            slots.sort_unstable();
            slots.into_iter().filter_map(|s| l.in_slot(s)).map(|a| a.container_id.as_str()).collect()
        };
        assert_eq!(named("abc"), ["a", "ab", "abc"]);
        assert_eq!(named("ab"), ["a", "ab"]);
        assert_eq!(named("éab"), ["é", "éa"]);
        assert!(named("x").is_empty());
        // In the order the ledger walks its attachments.
        let walked: Vec<&str> =
            l.attachments().map(|a| a.container_id.as_str()).filter(|id| "abcd".starts_with(id)).collect();
        assert_eq!(named("abcd"), walked);
    }

    #[test]
    fn the_stat_resolver_only_believes_nsfs() {
        use std::os::unix::fs::MetadataExt as _;
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        assert_eq!(StatResolver::new(None).inode_of("/proc/self/ns/net", None), Some(own));
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("cni-1234");
        std::fs::write(&plain, "").unwrap();
        assert_eq!(StatResolver::new(None).inode_of(plain.to_str().unwrap(), None), None, "an unmounted mount point");
        assert_eq!(StatResolver::new(None).inode_of("/nonexistent/netns", None), None);
    }

    #[test]
    fn the_stat_resolver_resolves_inode_and_nsid_from_one_open_as_the_two_lookups_do() {
        let r = StatResolver::new(None);
        let own = "/proc/self/ns/net";
        let inode = r.inode_of(own, None).expect("our own netns is on nsfs");
        let (resolved_inode, resolved_nsid) = r.resolve(own, None, Guess::Unassigned);
        assert_eq!(resolved_inode, Some(inode));
        assert_eq!(resolved_nsid, r.nsid_of(own, None, inode as u32));
        assert_eq!(r.resolve(own, None, Guess::Assigned), (resolved_inode, resolved_nsid));
        // The plugin's own root first: a pid that is gone falls through.
        assert_eq!(r.resolve(own, Some(u32::MAX), Guess::Assigned).0, Some(inode));
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("cni-1234");
        std::fs::write(&plain, "").unwrap();
        assert_eq!(
            r.resolve(plain.to_str().unwrap(), None, Guess::Unassigned),
            (None, None),
            "an unmounted mount point"
        );
        assert_eq!(r.resolve("/nonexistent/netns", None, Guess::Assigned), (None, None));
    }

    /// A thread that `prepare`s itself (unshare, chroot) and stays until
    /// the returned sender is dropped; its tid, or None when prepare failed.
    fn parked_thread(
        prepare: impl FnOnce() -> bool + Send + 'static,
    ) -> (Option<u32>, std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let tid = u32::try_from(unsafe { libc::gettid() }).ok();
            tid_tx.send(if prepare() { tid } else { None }).unwrap();
            let _ = stop_rx.recv();
        });
        (tid_rx.recv().unwrap(), stop_tx, handle)
    }

    #[test]
    fn the_stat_resolver_tries_the_plugins_root_then_ours_then_the_hosts() {
        use std::os::unix::fs::MetadataExt as _;
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        let pid = std::process::id();
        // "The host": a thread in a netns of its own, whose task directory
        // has `ns/net`.
        // SAFETY: unshare on this thread alone (a new netns).
        let (other_tid, stop_other, other) = parked_thread(|| unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0);
        let other_tid = other_tid.expect("a thread in a new netns");
        let other_ns = std::fs::metadata(format!("/proc/{pid}/task/{other_tid}/ns/net")).unwrap().ino();
        assert_ne!(other_ns, own);
        // "The plugin": a thread whose root is its own task directory, where
        // `/ns/net` is our netns.
        let (plugin, stop_plugin, plugin_thread) = parked_thread(move || {
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let Ok(root) = std::ffi::CString::new(format!("/proc/{pid}/task/{tid}")) else { return false };
            // SAFETY: this thread's fs is its own after unshare(CLONE_FS);
            // a NUL-terminated path.
            unsafe { libc::unshare(libc::CLONE_FS) == 0 && libc::chroot(root.as_ptr()) == 0 }
        });
        let plugin = plugin.expect("a chrooted thread");
        let r = StatResolver::new(Some(format!("/proc/{pid}/task/{other_tid}").into()));
        // `/ns/net` is no file of ours: the plugin's root names our netns,
        // the host's the other.
        assert_eq!(r.resolve("/ns/net", Some(plugin), Guess::Assigned).0, Some(own), "the plugin's root first");
        assert_eq!(r.resolve("ns/net", Some(plugin), Guess::Assigned).0, Some(own), "a relative path under a root");
        assert_eq!(r.resolve("/ns/net", None, Guess::Assigned).0, Some(other_ns), "then the host's");
        assert_eq!(r.resolve("/ns/net", Some(u32::MAX), Guess::Assigned).0, Some(other_ns));
        // Ours before the host's.
        assert_eq!(r.resolve("/proc/self/ns/net", None, Guess::Assigned).0, Some(own));
        assert_eq!(StatResolver::new(None).resolve("/ns/net", Some(plugin), Guess::Assigned).0, Some(own));
        assert_eq!(StatResolver::new(None).resolve("/ns/net", None, Guess::Assigned), (None, None));
        drop((stop_other, stop_plugin));
        other.join().unwrap();
        plugin_thread.join().unwrap();
    }

    #[test]
    fn exec_then_exit_records_a_finished_operation() {
        let mut l = Ledger::new();
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
        let a = l.get("c1").unwrap();
        assert!(a.in_flight());
        assert_eq!(a.netns_inode, Some(77));
        l.observe(&exit(10, 2, 1), wall, &FixedResolver(None));
        let a = l.get("c1").unwrap();
        assert!(!a.in_flight());
        assert_eq!(a.operations[0].result(), "failure");
        assert_eq!(a.last_finished("ADD").unwrap().exit.as_ref().unwrap().exit_code, Some(1));
    }

    #[test]
    fn a_running_process_names_its_container_only_when_the_kernel_read_it_whole() {
        let mut l = Ledger::new();
        assert_eq!(l.running_for(10), None, "not a run");
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
        assert_eq!(l.running_for(10), Some(Some("c1".to_owned())));
        let mut cut = exec(11, 1, "ADD", "c2");
        if let KernelEvent::CniExec { exec, .. } = &mut cut {
            exec.container_id = Some(crate::kernel::events::CniValue { value: "c2".into(), truncated: true });
        }
        l.observe(&cut, wall, &FixedResolver(Some(78)));
        assert_eq!(l.running_for(11), Some(None), "a cut container ID may be any container's");
        let mut unnamed = exec(12, 1, "ADD", "");
        if let KernelEvent::CniExec { exec, .. } = &mut unnamed {
            exec.container_id = None;
            exec.env_scan_limited = true;
        }
        l.observe(&unnamed, wall, &FixedResolver(None));
        assert_eq!(l.running_for(12), Some(None), "a run without a container concerns all");
        l.observe(&exit(10, 2, 0), wall, &FixedResolver(None));
        assert_eq!(l.running_for(10), None, "ended");
    }

    #[test]
    fn a_del_after_the_netns_is_gone_keeps_the_inode_learned_earlier() {
        let mut l = Ledger::new();
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
        l.observe(&exit(10, 2, 0), wall, &FixedResolver(None));
        l.observe(&exec(11, 3, "DEL", "c1"), wall, &FixedResolver(None));
        assert_eq!(l.get("c1").unwrap().netns_inode, Some(77));
        assert_eq!(l.get("c1").unwrap().operations.len(), 2);
    }

    /// The probes let a nested run's records (host-local under bridge)
    /// wait for its parent's exit: read after a failed ADD's netns is gone,
    /// they keep the binding and date its parent resolved while it lived.
    #[test]
    fn a_nested_add_read_after_the_netns_is_gone_keeps_its_parents_binding() {
        let mut l = Ledger::new();
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
        let bound_at = l.get("c1").unwrap().netns_bound_at;
        l.observe(&exec(11, 2, "ADD", "c1"), wall, &FixedResolver(None));
        l.observe(&exit(11, 3, 1), wall, &FixedResolver(None));
        l.observe(&exit(10, 4, 1), wall, &FixedResolver(None));
        let a = l.get("c1").unwrap();
        assert_eq!((a.netns_inode, a.netns_bound_at), (Some(77), bound_at));
        assert_eq!(
            a.operations.iter().map(|op| (op.pid, op.result())).collect::<Vec<_>>(),
            [(10, "failure"), (11, "failure")]
        );
        assert!(!a.in_flight());
    }

    /// Answers one netns (inode and nsid) and counts its resolutions.
    struct Counting {
        inode: u64,
        nsid: i32,
        calls: std::cell::Cell<u32>,
    }

    impl Counting {
        fn new(inode: u64, nsid: i32) -> Self {
            Self { inode, nsid, calls: std::cell::Cell::new(0) }
        }
    }

    impl NetnsResolver for Counting {
        fn inode_of(&self, _: &str, _: Option<u32>) -> Option<u64> {
            Some(self.inode)
        }

        fn resolve(&self, _: &str, _: Option<u32>, _: Guess) -> (Option<u64>, Option<i32>) {
            self.calls.set(self.calls.get() + 1);
            (Some(self.inode), Some(self.nsid))
        }
    }

    /// `event` (an exec) as the kernel reports a run nested in `parent`.
    fn nested_in(mut event: KernelEvent, parent: u32) -> KernelEvent {
        if let KernelEvent::CniExec { exec, .. } = &mut event {
            exec.nested_in = Some(parent);
        }
        event
    }

    fn with_netns(mut event: KernelEvent, path: &str) -> KernelEvent {
        if let KernelEvent::CniExec { exec, .. } = &mut event {
            exec.netns = Some(v(path));
        }
        event
    }

    /// A nested run (host-local under bridge, a delegate under a meta
    /// plugin) is bound as its parent run resolved the path, without a
    /// resolution of its own: here the path would now resolve to another
    /// netns, and the binding stays the parent's, dated by the nested run.
    #[test]
    fn a_nested_run_takes_its_parent_runs_resolution() {
        let mut l = Ledger::new();
        let first = Counting::new(77, 5);
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &first);
        assert_eq!(first.calls.get(), 1);
        let later = Counting::new(88, 6);
        l.observe(&nested_in(exec(11, 2, "ADD", "c1"), 10), wall, &later);
        l.observe(&nested_in(exec(12, 3, "ADD", "c1"), 11), wall, &later);
        assert_eq!(later.calls.get(), 0, "resolved nothing");
        let a = l.get("c1").unwrap();
        assert_eq!((a.netns_inode, a.netns_nsid, a.netns_bound_at), (Some(77), Some(5), Some(wall(3))));
        assert_eq!(a.operations.iter().map(|op| op.pid).collect::<Vec<_>>(), [10, 11, 12]);
        assert!(a.operations.iter().all(CniOperation::in_flight));
    }

    /// Only the parent run's own whole resolution, made for the same
    /// operation, is taken: a parent that exited (its pid may be anyone's
    /// now), ran for another container, command or path, resolved no nsid,
    /// or had a value cut, leaves the nested run to resolve its own; so
    /// does a nested run with a value cut.
    #[test]
    fn a_nested_run_resolves_its_own_unless_its_parent_run_resolved_the_same_operation() {
        let whole = Counting::new(77, 5);
        let parent_exited = [exec(10, 1, "ADD", "c1"), exit(10, 2, 0)];
        let other_container = [exec(10, 1, "ADD", "c2")];
        let other_command = [exec(10, 1, "DEL", "c1")];
        let other_path = [with_netns(exec(10, 1, "ADD", "c1"), "/var/run/netns/cni-2")];
        let mut cut = exec(10, 1, "ADD", "c1");
        if let KernelEvent::CniExec { exec, .. } = &mut cut {
            exec.ifname = Some(CniValue { value: "eth".into(), truncated: true });
        }
        for (what, before) in [
            ("exited", &parent_exited[..]),
            ("another container", &other_container[..]),
            ("another command", &other_command[..]),
            ("another path", &other_path[..]),
            ("a cut value", std::slice::from_ref(&cut)),
        ] {
            let mut l = Ledger::new();
            for e in before {
                l.observe(e, wall, &whole);
            }
            let own = Counting::new(88, 6);
            l.observe(&nested_in(exec(11, 3, "ADD", "c1"), 10), wall, &own);
            assert_eq!(own.calls.get(), 1, "{what}");
            assert_eq!(l.get("c1").unwrap().netns_inode, Some(88), "{what}");
        }
        // A parent whose nsid is unknown (FixedResolver gives none).
        let mut l = Ledger::new();
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
        let own = Counting::new(88, 6);
        l.observe(&nested_in(exec(11, 2, "ADD", "c1"), 10), wall, &own);
        assert_eq!((own.calls.get(), l.get("c1").unwrap().netns_nsid), (1, Some(6)), "a parent without nsid");
        // A nested run with a value cut.
        let mut l = Ledger::new();
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &whole);
        let own = Counting::new(88, 6);
        let KernelEvent::CniExec { task, mut exec } = nested_in(exec(11, 2, "ADD", "c1"), 10) else { unreachable!() };
        exec.ifname = Some(CniValue { value: "eth".into(), truncated: true });
        l.observe(&KernelEvent::CniExec { task, exec }, wall, &own);
        assert_eq!(own.calls.get(), 1, "a cut nested run");
    }

    /// A DEL or CHECK naming the path its container's ADD resolved leaves
    /// that binding as it was, dated by the ADD, without resolving the path
    /// again (here it would now resolve to another netns); its nested runs
    /// too. A later ADD resolves and binds anew.
    #[test]
    fn a_run_other_than_an_add_keeps_the_binding_its_path_has() {
        let mut l = Ledger::new();
        let add = Counting::new(77, 5);
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &add);
        l.observe(&exit(10, 2, 0), wall, &add);
        let later = Counting::new(88, 6);
        l.observe(&exec(11, 3, "CHECK", "c1"), wall, &later);
        l.observe(&exit(11, 4, 0), wall, &later);
        l.observe(&exec(12, 5, "DEL", "c1"), wall, &later);
        l.observe(&nested_in(exec(13, 6, "DEL", "c1"), 12), wall, &later);
        assert_eq!(later.calls.get(), 0, "resolved nothing");
        let a = l.get("c1").unwrap();
        assert_eq!((a.netns_inode, a.netns_nsid, a.netns_bound_at), (Some(77), Some(5), Some(wall(1))));
        assert_eq!(a.operations.iter().map(|op| op.pid).collect::<Vec<_>>(), [10, 11, 12, 13]);
        l.observe(&exit(13, 7, 0), wall, &later);
        l.observe(&exit(12, 8, 0), wall, &later);
        l.observe(&exec(14, 9, "ADD", "c1"), wall, &later);
        assert_eq!(later.calls.get(), 1, "an ADD resolves");
        let a = l.get("c1").unwrap();
        assert_eq!((a.netns_inode, a.netns_nsid, a.netns_bound_at), (Some(88), Some(6), Some(wall(9))));
    }

    /// A DEL resolves its path, as every run did before, when the binding
    /// is not one a run's resolution of that path made and that still
    /// stands: none yet (the agent started after the ADD), another path,
    /// no nsid resolved, a binding restored from an earlier agent, or one
    /// whose netns the kernel said died; and when a value of the DEL was cut.
    #[test]
    fn a_run_other_than_an_add_resolves_unless_a_standing_binding_names_its_path() {
        type Setup = fn(&mut Ledger);
        let add: Setup = |l| {
            l.observe(&exec(10, 1, "ADD", "c1"), wall, &Counting::new(77, 5));
        };
        let cases: [(&str, Setup); 6] = [
            ("no binding yet", |_| {}),
            ("another path", |l| {
                l.observe(&with_netns(exec(10, 1, "ADD", "c1"), "/var/run/netns/cni-2"), wall, &Counting::new(77, 5));
            }),
            ("no nsid", |l| {
                l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
            }),
            ("restored", |l| {
                l.observe(&exec(10, 1, "ADD", "c1"), wall, &Counting::new(77, 5));
                let mut a = l.get("c1").unwrap().clone();
                a.pinned = Some(crate::identity::NetnsId::new(Some(77), Some(5), Some(wall(1))));
                let mut restored = Ledger::new();
                restored.restore(vec![a]);
                *l = restored;
            }),
            ("died", |l| {
                l.observe(&exec(10, 1, "ADD", "c1"), wall, &Counting::new(77, 5));
                let id = crate::identity::NetnsId::new(Some(77), Some(5), Some(wall(1)));
                l.netns_died(&["c1".to_owned()], (id, wall(2)), |_| true);
            }),
            ("the DEL's value cut", add),
        ];
        for (what, setup) in cases {
            let mut l = Ledger::new();
            setup(&mut l);
            let del = Counting::new(88, 6);
            let mut event = exec(11, 3, "DEL", "c1");
            if what == "the DEL's value cut"
                && let KernelEvent::CniExec { exec, .. } = &mut event
            {
                exec.ifname = Some(CniValue { value: "eth".into(), truncated: true });
            }
            l.observe(&event, wall, &del);
            assert_eq!(del.calls.get(), 1, "{what}");
            let a = l.get("c1").unwrap();
            assert_eq!((a.netns_inode, a.netns_nsid, a.netns_bound_at), (Some(88), Some(6), Some(wall(3))), "{what}");
        }
    }

    #[test]
    fn vanished_processes_close_their_operation_as_unknown() {
        let mut l = Ledger::new();
        l.observe(&exec(10, 1, "ADD", "c1"), wall, &FixedResolver(Some(77)));
        assert_eq!(l.reap_vanished(wall(5), |_| true), 0);
        assert!(l.get("c1").unwrap().in_flight());
        assert_eq!(l.reap_vanished(wall(5), |_| false), 1);
        let op = &l.get("c1").unwrap().operations[0];
        assert_eq!(op.result(), "unknown");
        assert!(!op.in_flight());
    }

    #[test]
    fn exits_of_unknown_processes_and_execs_without_container_are_ignored() {
        let mut l = Ledger::new();
        assert!(l.observe(&exit(99, 1, 0), wall, &FixedResolver(None)).is_none());
        let KernelEvent::CniExec { task, mut exec } = exec(10, 1, "VERSION", "") else { unreachable!() };
        exec.container_id = None;
        assert!(l.observe(&KernelEvent::CniExec { task, exec }, wall, &FixedResolver(None)).is_none());
        assert!(l.attachments().next().is_none());
    }

    #[test]
    fn a_scan_limited_run_without_container_is_in_flight_for_all_until_it_exits() {
        let mut l = Ledger::new();
        let KernelEvent::CniExec { task, exec: mut e } = exec(10, 1, "", "") else { unreachable!() };
        e.container_id = None;
        e.env_scan_limited = true;
        assert!(l.observe(&KernelEvent::CniExec { task, exec: e }, wall, &FixedResolver(None)).is_none());
        let runs: Vec<&CniOperation> = l.unattributed_runs().collect();
        assert_eq!(runs.len(), 1, "kept as unknown, never absent");
        assert!(runs[0].in_flight());
        assert!(l.is_running(10));
        l.observe(&exit(10, 2, 0), wall, &FixedResolver(None));
        assert_eq!(l.unattributed_runs().count(), 0, "its exit ends it");
        // A vanished process ends it too.
        let KernelEvent::CniExec { task, exec: mut e } = exec(11, 3, "", "") else { unreachable!() };
        e.container_id = None;
        e.env_scan_limited = true;
        l.observe(&KernelEvent::CniExec { task, exec: e }, wall, &FixedResolver(None));
        l.reap_vanished(wall(4), |_| true);
        assert_eq!(l.unattributed_runs().count(), 1);
        l.reap_vanished(wall(5), |_| false);
        assert_eq!(l.unattributed_runs().count(), 0);
    }

    #[test]
    fn a_scan_limited_run_with_its_container_is_an_operation_in_flight() {
        let mut l = Ledger::new();
        let KernelEvent::CniExec { task, mut exec } = exec(10, 1, "", "c1") else { unreachable!() };
        exec.env_scan_limited = true;
        exec.netns = None;
        l.observe(&KernelEvent::CniExec { task, exec }, wall, &FixedResolver(None));
        assert!(l.get("c1").expect("recorded").in_flight());
    }

    #[test]
    fn only_old_settled_containers_of_dead_netns_are_forgotten() {
        let mut l = Ledger::new();
        l.observe(&exec(10, 1_000_000_000, "ADD", "dead-old"), wall, &FixedResolver(Some(77)));
        l.observe(&exit(10, 2_000_000_000, 0), wall, &FixedResolver(None));
        l.observe(&exec(11, 1_000_000_000, "ADD", "alive-old"), wall, &FixedResolver(Some(78)));
        l.observe(&exit(11, 2_000_000_000, 0), wall, &FixedResolver(None));
        l.observe(&exec(12, 1_000_000_000, "ADD", "dead-in-flight"), wall, &FixedResolver(Some(77)));
        l.observe(&exec(13, 50_000_000_000, "ADD", "dead-recent"), wall, &FixedResolver(Some(77)));
        l.observe(&exit(13, 51_000_000_000, 0), wall, &FixedResolver(None));
        let dead = |a: &Attachment| a.netns_inode == Some(77);
        let forgotten = l.forget_dead(wall(60_000_000_000), Duration::from_secs(30), dead);
        assert_eq!(forgotten, 1);
        assert!(l.get("dead-old").is_none(), "dead, settled and old: forgotten");
        assert!(l.get("alive-old").is_some(), "not known dead: kept");
        assert!(l.get("dead-in-flight").is_some(), "in flight: kept");
        assert!(l.get("dead-recent").is_some(), "recent: kept");
    }

    #[test]
    fn operations_per_container_are_bounded_keeping_the_first_and_the_in_flight() {
        let mut l = Ledger::new();
        // A long-running ADD, then a script plugin's many helper processes.
        l.observe(&exec(1, 0, "ADD", "c1"), wall, &FixedResolver(None));
        for i in 0..100u32 {
            l.observe(&exec(1000 + i, u64::from(i) * 2 + 1, "ADD", "c1"), wall, &FixedResolver(None));
            l.observe(&exit(1000 + i, u64::from(i) * 2 + 2, 0), wall, &FixedResolver(None));
        }
        let ops = &l.get("c1").unwrap().operations;
        assert_eq!(ops.len(), MAX_OPS_PER_CONTAINER);
        assert_eq!(ops[0].pid, 1, "the first (in-flight) ADD is kept");
        assert!(ops[0].in_flight());
        assert_eq!(ops[1].pid, 1000, "the first few are kept");
        assert_eq!(ops.last().unwrap().pid, 1099, "the newest is kept");
    }

    #[test]
    fn bindings_the_kernel_saw_die_are_forgotten_after_the_age_limit_and_no_others() {
        let mut l = Ledger::new();
        let secs = |s: u64| s * 1_000_000_000;
        for (pid, c) in [(10, "dead"), (11, "alive"), (12, "rebound")] {
            l.observe(&exec(pid, secs(1), "ADD", c), wall, &FixedResolver(Some(77)));
            l.observe(&exit(pid, secs(2), 0), wall, &FixedResolver(None));
        }
        let dead = (crate::identity::NetnsId::inode(77), wall(secs(2)));
        l.netns_died(&["dead".into(), "rebound".into(), "never-seen".into()], dead, |_| true);
        assert_eq!(l.get("dead").and_then(|a| a.died), Some(BindingDeath { incarnation: Some(dead) }));
        // A later ADD binds "rebound" to another netns: that one is not dead.
        l.observe(&exec(13, secs(3), "ADD", "rebound"), wall, &FixedResolver(Some(78)));
        l.observe(&exit(13, secs(4), 0), wall, &FixedResolver(None));
        let max_age = dead_binding_max_age(Duration::from_mins(10));
        assert_eq!(max_age, DEAD_NETNS_MAX_AGE);
        assert_eq!(dead_binding_max_age(Duration::from_hours(1)), Duration::from_hours(1) + Duration::from_secs(1));
        let last_seen = wall(secs(2));
        assert_eq!(l.forget_dead_bindings(last_seen + max_age, max_age), 0, "not before the age limit");
        assert_eq!(l.forget_dead_bindings(last_seen + max_age + Duration::from_secs(1), max_age), 1);
        assert!(l.get("dead").is_none());
        assert!(l.get("alive").is_some(), "not known dead: never forgotten here");
        assert!(l.get("rebound").is_some(), "its present binding did not die");
        assert_eq!(l.get("rebound").and_then(|a| a.died), None, "the new binding is not marked dead");
        // In flight: kept whatever its age.
        l.observe(&exec(14, secs(5), "DEL", "rebound"), wall, &FixedResolver(None));
        l.netns_died(&["rebound".into()], dead, |_| false);
        assert_eq!(l.get("rebound").and_then(|a| a.died), Some(BindingDeath { incarnation: None }), "named by path");
        assert_eq!(l.forget_dead_bindings(wall(secs(5)) + Duration::from_hours(10), max_age), 0);
    }

    /// Answers what the test sets: the inode and nsid a path resolves to.
    #[derive(Default)]
    struct Settable(std::cell::Cell<(Option<u64>, Option<i32>)>);

    impl NetnsResolver for Settable {
        fn inode_of(&self, _: &str, _: Option<u32>) -> Option<u64> {
            self.0.get().0
        }

        fn resolve(&self, _: &str, _: Option<u32>, _: Guess) -> (Option<u64>, Option<i32>) {
            let (inode, nsid) = self.0.get();
            (inode, inode.and(nsid))
        }
    }

    #[derive(Debug, Clone)]
    enum Change {
        /// A run of container `c` (of a few) naming `path` (of a few, or
        /// none) that resolves to `resolved`, at second `t`.
        Exec {
            pid: u32,
            t: u64,
            add: bool,
            c: u8,
            path: Option<u8>,
            resolved: (Option<u64>, Option<i32>),
        },
        Exit {
            pid: u32,
            t: u64,
        },
        Died {
            c: u8,
            t: u64,
        },
        Forget {
            t: u64,
        },
        Reap,
        /// An attachment an earlier run saved, pinned or not.
        Restore {
            c: u8,
            t: u64,
            pinned: Option<(Option<u64>, Option<i32>)>,
            inode: Option<u64>,
        },
    }

    fn change() -> impl proptest::strategy::Strategy<Value = Change> {
        use proptest::prelude::*;
        let resolved = (proptest::option::of(1..4u64), proptest::option::of(0..3i32));
        prop_oneof![
            4 => (1..12u32, 0..60u64, any::<bool>(), 0..6u8, proptest::option::of(0..4u8), resolved.clone())
                .prop_map(|(pid, t, add, c, path, resolved)| Change::Exec { pid, t, add, c, path, resolved }),
            2 => (1..12u32, 0..60u64).prop_map(|(pid, t)| Change::Exit { pid, t }),
            1 => (0..6u8, 0..60u64).prop_map(|(c, t)| Change::Died { c, t }),
            1 => (0..120u64).prop_map(|t| Change::Forget { t }),
            1 => Just(Change::Reap),
            1 => (0..8u8, 0..60u64, proptest::option::of(resolved), proptest::option::of(1..4u64))
                .prop_map(|(c, t, pinned, inode)| Change::Restore { c, t, pinned, inode }),
        ]
    }

    #[test]
    fn the_binding_index_kept_as_the_ledger_changes_is_the_one_built_from_scratch() {
        use proptest::prelude::*;
        let paths = ["/var/run/netns/cni-1", "/var/run/netns/cni-2", "/run/netns/cni-1", "/"];
        let secs = |s: u64| s * 1_000_000_000;
        proptest!(ProptestConfig::with_cases(400), |(changes in proptest::collection::vec(change(), 1..60))| {
            let mut l = Ledger { max_containers: 4, ..Ledger::default() };
            let resolver = Settable::default();
            for change in changes {
                match change {
                    Change::Exec { pid, t, add, c, path, resolved } => {
                        resolver.0.set(resolved);
                        let mut event = exec(pid, secs(t), if add { "ADD" } else { "DEL" }, &format!("c{c}"));
                        if let KernelEvent::CniExec { exec, .. } = &mut event {
                            exec.netns = path.map(|p| v(paths[usize::from(p)]));
                        }
                        l.observe(&event, wall, &resolver);
                    }
                    Change::Exit { pid, t } => {
                        l.observe(&exit(pid, secs(t), 0), wall, &resolver);
                    }
                    Change::Died { c, t } => {
                        let dead = (crate::identity::NetnsId::inode(1), wall(secs(t)));
                        l.netns_died(&[format!("c{c}")], dead, |a| a.netns_inode == Some(1));
                    }
                    Change::Forget { t } => {
                        l.forget_dead_bindings(wall(secs(t)), Duration::from_secs(10));
                    }
                    Change::Reap => {
                        l.reap_vanished(wall(secs(60)), |_| false);
                    }
                    Change::Restore { c, t, pinned, inode } => l.restore(vec![Attachment {
                        container_id: format!("c{c}"),
                        netns_path: Some(paths[0].into()),
                        netns_inode: inode,
                        netns_nsid: None,
                        netns_bound_at: inode.map(|_| wall(secs(t))),
                        pinned: pinned.map(|(inode, nsid)| crate::identity::NetnsId::new(inode, nsid, Some(wall(secs(t))))),
                        died: None,
                        ifnames: Vec::new(),
                        operations: Vec::new(),
                        first_seen: wall(secs(t)),
                        last_seen: wall(secs(t)),
                    }]),
                }
                let mut rebuilt = BindingIndex::default();
                for (slot, a) in &l.attachments {
                    rebuilt.file(slot, &Filed::of(a));
                }
                prop_assert_eq!(l.bindings(), &rebuilt);
                prop_assert_eq!(l.by_container.len(), l.attachments.len());
                for (slot, a) in &l.attachments {
                    prop_assert_eq!(l.by_container.get(&a.container_id), Some(&slot));
                }
            }
        });
    }
}
