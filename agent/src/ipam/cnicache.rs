//! libcni's result cache (containernetworking/cni, libcni/api.go `cacheAdd`):
//! `<cacheDir>/results/<network>-<containerID>-<ifname>`, JSON with
//! `kind: "cniCacheV1"`, `containerId`, `ifName`, `networkName`, `netns`
//! (omitted when empty), `config` (base64), `cniArgs`, `capabilityArgs` and
//! `result` (the chain's result: `ips[].address` as CIDR). libcni writes it
//! only after a whole chain's ADD succeeded and removes it on DEL, so it is
//! evidence (container ID -> netns path, IPs), never the reservation itself.

use std::{
    fs, io,
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use serde::{Deserialize, Serialize};

use super::{
    Anomaly, AnomalyKind, StoreRef,
    safefs::{self, Bounded, Dir},
};
use crate::{
    engine::{Binding, BindingSource, NetnsName},
    timefmt,
};

/// The directory holding libcni's result files (`CacheDir` + "/results").
pub const DEFAULT_CACHE_DIR: &str = "/var/lib/cni/results";
/// libcni's cache kind tag.
pub const CACHE_KIND: &str = "cniCacheV1";
/// An entry holds the base64 config and a result: tens of KiB at most.
pub const MAX_CACHE_BYTES: u64 = 1024 * 1024;

/// One cached attachment: a chain ADD that succeeded and was not deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedAttachment {
    pub path: PathBuf,
    pub network: String,
    pub container_id: String,
    pub ifname: String,
    /// `CNI_NETNS` of the ADD, when the runtime gave one.
    pub netns: Option<String>,
    pub ips: Vec<IpAddr>,
    /// File mtime: when the ADD finished.
    #[serde(with = "timefmt::rfc3339")]
    pub written_at: SystemTime,
    pub inode: u64,
}

impl CachedAttachment {
    /// The engine's binding "container -> netns path" this entry records,
    /// when it names a netns.
    #[must_use]
    pub fn binding(&self) -> Option<Binding> {
        let netns = self.netns.as_ref()?;
        Some(Binding {
            container_id: self.container_id.clone(),
            netns: NetnsName::Path(PathBuf::from(netns)),
            source: BindingSource::CniCache,
            seen_at: self.written_at,
        })
    }
}

/// What a scan of the cache found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheScan {
    /// Shared: a reader that gives a scan again after one entry changed
    /// copies the list, not every attachment.
    pub attachments: Vec<Arc<CachedAttachment>>,
    pub anomalies: Vec<Anomaly>,
}

/// The file name libcni gives an attachment.
#[must_use]
pub fn entry_name(network: &str, container_id: &str, ifname: &str) -> String {
    format!("{network}-{container_id}-{ifname}")
}

#[derive(Deserialize)]
struct RawEntry {
    kind: String,
    #[serde(rename = "containerId")]
    container_id: String,
    #[serde(rename = "ifName")]
    if_name: String,
    #[serde(rename = "networkName")]
    network_name: String,
    #[serde(default)]
    netns: Option<String>,
    #[serde(default)]
    result: Option<serde_json::Value>,
}

/// IPs of a cached result: `ips[].address` (CNI >= 0.3) or `ip4.ip` /
/// `ip6.ip` (0.1/0.2), each a CIDR.
fn result_ips(result: Option<&serde_json::Value>) -> Result<Vec<IpAddr>, String> {
    let Some(result) = result else { return Ok(Vec::new()) };
    let mut cidrs = Vec::new();
    if let Some(ips) = result.get("ips") {
        let list = ips.as_array().ok_or("result.ips is not a list")?;
        for ip in list {
            cidrs.push(ip.get("address").and_then(serde_json::Value::as_str).ok_or("result.ips[] has no address")?);
        }
    }
    for legacy in ["ip4", "ip6"] {
        if let Some(cidr) = result.get(legacy).and_then(|v| v.get("ip")).and_then(serde_json::Value::as_str) {
            cidrs.push(cidr);
        }
    }
    cidrs
        .into_iter()
        .map(|cidr| {
            let addr = cidr.split_once('/').map_or(cidr, |(a, _)| a);
            addr.parse::<IpAddr>().map_err(|_| format!("result address {cidr:?} is not an IP/prefix"))
        })
        .collect()
}

/// Parses one entry; the file name must be the one libcni would give it.
pub fn parse_entry(name: &str, bytes: &[u8]) -> Result<RawAttachment, (AnomalyKind, String)> {
    let raw: RawEntry = serde_json::from_slice(bytes)
        .map_err(|e| (AnomalyKind::MalformedContent, format!("not a libcni cache entry: {e}")))?;
    if raw.kind != CACHE_KIND {
        return Err((AnomalyKind::MalformedContent, format!("kind {:?}, expected {CACHE_KIND:?}", raw.kind)));
    }
    if raw.container_id.is_empty() || raw.if_name.is_empty() || raw.network_name.is_empty() {
        return Err((AnomalyKind::MalformedContent, "containerId, ifName or networkName is empty".into()));
    }
    let expected = entry_name(&raw.network_name, &raw.container_id, &raw.if_name);
    if expected != name {
        return Err((AnomalyKind::NameMismatch, format!("content names {expected:?}")));
    }
    let ips = result_ips(raw.result.as_ref()).map_err(|e| (AnomalyKind::MalformedContent, e))?;
    Ok(RawAttachment {
        network: raw.network_name,
        container_id: raw.container_id,
        ifname: raw.if_name,
        netns: raw.netns.filter(|n| !n.is_empty()),
        ips,
    })
}

/// The parsed content of an entry, before file metadata is attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawAttachment {
    pub network: String,
    pub container_id: String,
    pub ifname: String,
    pub netns: Option<String>,
    pub ips: Vec<IpAddr>,
}

/// Reads one entry in an opened cache dir. `Ok(None)`: no such file.
pub(crate) fn read_entry(
    dir: &Dir,
    dir_path: &Path,
    name: &str,
) -> Result<Option<CachedAttachment>, (AnomalyKind, String)> {
    let (bytes, meta) = match safefs::read_bounded(dir, name, MAX_CACHE_BYTES) {
        Ok(Bounded::Content(bytes, meta)) => (bytes, meta),
        Ok(Bounded::NotRegular(meta)) => {
            let kind = if meta.is_directory() { AnomalyKind::Directory } else { AnomalyKind::NotRegularFile };
            return Err((kind, "not a regular file".into()));
        }
        Ok(Bounded::TooLarge(meta)) => {
            return Err((
                AnomalyKind::Oversized,
                format!("{} bytes, over the {MAX_CACHE_BYTES}-byte limit", meta.len()),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err((AnomalyKind::Symlink, "a symlink; never followed".into()));
        }
        Err(e) => return Err((AnomalyKind::Unreadable, e.to_string())),
    };
    let raw = parse_entry(name, &bytes)?;
    Ok(Some(CachedAttachment {
        path: dir_path.join(name),
        network: raw.network,
        container_id: raw.container_id,
        ifname: raw.ifname,
        netns: raw.netns,
        ips: raw.ips,
        written_at: meta.modified(),
        inode: meta.ino(),
    }))
}

/// libcni's result cache directory.
#[derive(Debug, Clone)]
pub struct CniCache {
    dir: PathBuf,
}

impl CniCache {
    /// `dir` is the directory holding the result files
    /// (`/var/lib/cni/results` by default).
    #[must_use]
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    #[must_use]
    pub fn store_ref(&self) -> StoreRef {
        StoreRef::CniCache { dir: self.dir.clone() }
    }

    /// Lists every valid entry; anything else is an anomaly.
    #[must_use]
    pub fn scan(&self) -> CacheScan {
        let store = self.store_ref();
        let mut out = CacheScan::default();
        let listing = Dir::open(&self.dir).and_then(|dir| fs::read_dir(&self.dir).map(|entries| (dir, entries)));
        let (dir, entries) = match listing {
            Ok(found) => found,
            Err(e) => {
                let kind =
                    if e.kind() == io::ErrorKind::NotFound { AnomalyKind::MissingDir } else { AnomalyKind::Unreadable };
                out.anomalies.push(Anomaly::new(&store, None, &self.dir, kind, e.to_string()));
                return out;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    out.anomalies.push(Anomaly::new(&store, None, &self.dir, AnomalyKind::Unreadable, e.to_string()));
                    continue;
                }
            };
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::UnparsableName, "name is not UTF-8"));
                continue;
            };
            match read_entry(&dir, &self.dir, &name) {
                Ok(Some(attachment)) => out.attachments.push(Arc::new(attachment)),
                Ok(None) => {}
                Err((kind, detail)) => out.anomalies.push(Anomaly::new(&store, None, &path, kind, detail)),
            }
        }
        out.attachments.sort_by(|a, b| a.path.cmp(&b.path));
        out.anomalies.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }
}

/// How long after its last change a file's timestamps are trusted to show
/// the next change: file times come from the coarse kernel clock (a jiffy),
/// so a rewrite within the same tick, of the same size, would look the same.
/// An entry read this soon after it changed is read again next time.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(100);

/// What identifies one version of an entry's file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    inode: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &fs::Metadata) -> Self {
        Self {
            inode: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether the file last changed at least [`SETTLE`] before `at`.
    fn settled_before(&self, at: SystemTime) -> bool {
        let changed = u64::try_from(self.ctime.0).ok().map(|s| {
            SystemTime::UNIX_EPOCH
                + std::time::Duration::from_secs(s)
                + std::time::Duration::from_nanos(u64::try_from(self.ctime.1).unwrap_or(0))
        });
        changed.is_some_and(|c| c + SETTLE <= at)
    }
}

/// One entry as the last scan read it.
#[derive(Debug)]
struct Remembered {
    stamp: Stamp,
    /// It had not changed for [`SETTLE`] when it was read: the same stamp
    /// means the same content.
    settled: bool,
    read: Result<Option<Arc<CachedAttachment>>, (AnomalyKind, String)>,
}

/// [`CniCache::scan`] for an agent that scans at every reconcile. An inotify
/// watch on the directory names the entries that changed since the last
/// scan began; only those are read again (no listing, no stat of the
/// others). When the watch cannot name them (no watch yet, queue overflow,
/// the directory removed or moved, many changes at once) or the last full
/// listing is older than [`RELIST_AFTER`], it lists the directory and reads
/// again only the entries whose file changed (name, inode, size, mtime and
/// ctime differ, or it had just changed when it was read). The result is
/// the same as a fresh scan's.
#[derive(Debug)]
pub struct CacheReader {
    cache: CniCache,
    /// By name, so in the order of their paths (one directory).
    entries: std::collections::BTreeMap<String, Remembered>,
    /// Files read by the last scan (the rest were remembered).
    last_reads: usize,
    /// Changes to the directory since the last scan began; None while it
    /// cannot be watched (missing, not a directory, no inotify).
    watch: Option<ChangeWatch>,
    /// When the last full listing began, if it saw nothing that only a
    /// listing reports (an unreadable directory, a name that is not UTF-8,
    /// an entry that could not be stat'ed): the watch may then carry it on.
    listed: Option<std::time::Instant>,
    /// Whether the last scan followed the watch instead of listing.
    last_followed: bool,
    /// The last scan given out, given again while no entry changed: a
    /// death's pass then costs no copy of every entry.
    given: Option<std::sync::Arc<CacheScan>>,
    /// When `given` was followed from the scan given before it: that one
    /// (weak: its allocation, hence its address, stays its own) and the
    /// entries that changed, each with whether it is an attachment now.
    followed_from: Option<(std::sync::Weak<CacheScan>, Vec<ChangedEntry>)>,
}

/// An entry a followed scan read again (or found gone): its path, and
/// whether it is an attachment now.
pub type ChangedEntry = (PathBuf, bool);

/// A listing at least this often, whatever the watch says: a writer that
/// changes a file without a syscall inotify sees (a shared mapping) is
/// caught within this long.
pub const RELIST_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// More changed entries than this since the last scan: a listing (on the
/// blocking pool) instead of reading them one by one.
const FOLLOW_LIMIT: usize = 64;

impl CacheReader {
    #[must_use]
    pub fn new(cache: CniCache) -> Self {
        Self {
            cache,
            entries: std::collections::BTreeMap::new(),
            last_reads: 0,
            watch: None,
            listed: None,
            last_followed: false,
            given: None,
            followed_from: None,
        }
    }

    #[must_use]
    pub fn cache(&self) -> &CniCache {
        &self.cache
    }

    /// How many files the last scan read.
    #[must_use]
    pub fn last_reads(&self) -> usize {
        self.last_reads
    }

    /// Whether the last scan followed the watch (no listing).
    #[must_use]
    pub fn last_followed(&self) -> bool {
        self.last_followed
    }

    /// The scan, when the watch names every entry that changed since the
    /// last one: one read of its queue and one read per changed entry
    /// (cheap enough for the event loop). None: [`CacheReader::scan`] lists.
    pub fn follow(&mut self) -> Option<std::sync::Arc<CacheScan>> {
        // Drained before any listing: a change after this point is either
        // seen by the scan that follows or queued for the next drain.
        let changes = self.watch.as_ref().map_or(Changes::Unknown, ChangeWatch::changes);
        let names = match changes {
            Changes::Names(names) if names.len() <= FOLLOW_LIMIT => names,
            // Unknown, or too many: the next scan lists.
            _ => {
                self.listed = None;
                return None;
            }
        };
        if self.listed.is_none_or(|at| at.elapsed() >= RELIST_AFTER) {
            return None;
        }
        self.last_reads = 0;
        if names.is_empty()
            && let Some(given) = &self.given
        {
            self.last_followed = true;
            return Some(std::sync::Arc::clone(given));
        }
        let dir_path = self.cache.dir.clone();
        let mut read_again = Vec::with_capacity(names.len());
        if !names.is_empty() {
            let Ok(dir) = Dir::open(&dir_path) else {
                self.listed = None;
                return None;
            };
            for name in names {
                match fs::symlink_metadata(dir_path.join(&name)) {
                    Ok(meta) => {
                        let (now, stamp) = (SystemTime::now(), Stamp::of(&meta));
                        self.last_reads += 1;
                        let read = read_entry(&dir, &dir_path, &name).map(|a| a.map(Arc::new));
                        read_again.push((dir_path.join(&name), matches!(read, Ok(Some(_)))));
                        self.entries.insert(name, Remembered { stamp, settled: stamp.settled_before(now), read });
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        read_again.push((dir_path.join(&name), false));
                        self.entries.remove(&name);
                    }
                    Err(_) => {
                        // Unstamped: a listing reports it.
                        self.listed = None;
                        return None;
                    }
                }
            }
        }
        self.last_followed = true;
        let before = self.given.as_ref().map(std::sync::Arc::downgrade);
        let scan = self.remembered();
        let given = self.give(scan);
        self.followed_from = before.map(|before| (before, read_again));
        Some(given)
    }

    /// What changed between `before` and `now`, entry by entry (true: an
    /// attachment now, false: none), when `now` is the last scan given and
    /// was followed from `before`, the one given just before it; None
    /// otherwise (a listing, or scans given in between). Who keeps
    /// something per entry brings it up to date with these alone.
    #[must_use]
    pub fn changed_since(
        &self,
        before: &std::sync::Arc<CacheScan>,
        now: &std::sync::Arc<CacheScan>,
    ) -> Option<&[ChangedEntry]> {
        let (from, changed) = self.followed_from.as_ref()?;
        let is_given = self.given.as_ref().is_some_and(|g| std::sync::Arc::ptr_eq(g, now));
        (is_given && std::ptr::eq(from.as_ptr(), std::sync::Arc::as_ptr(before))).then_some(changed.as_slice())
    }

    /// Lists every valid entry; anything else is an anomaly.
    pub fn scan(&mut self) -> std::sync::Arc<CacheScan> {
        if let Some(followed) = self.follow() {
            return followed;
        }
        self.last_followed = false;
        if self.watch.as_ref().is_none_or(ChangeWatch::lost) {
            self.watch = ChangeWatch::new(&self.cache.dir).ok();
        }
        let started = std::time::Instant::now();
        let (out, clean) = self.list_and_read();
        self.listed = (clean && self.watch.is_some()).then_some(started);
        self.followed_from = None;
        self.give(out)
    }

    /// Remembers `scan` as the one to give again while nothing changes.
    fn give(&mut self, scan: CacheScan) -> std::sync::Arc<CacheScan> {
        let given = std::sync::Arc::new(scan);
        self.given = Some(std::sync::Arc::clone(&given));
        given
    }

    /// The remembered entries as a scan's result: already in the order of
    /// their paths (by name, in one directory), each attachment shared.
    fn remembered(&self) -> CacheScan {
        let store = self.cache.store_ref();
        let mut out = CacheScan { attachments: Vec::with_capacity(self.entries.len()), anomalies: Vec::new() };
        for (name, r) in &self.entries {
            match &r.read {
                Ok(Some(attachment)) => out.attachments.push(Arc::clone(attachment)),
                Ok(None) => {}
                Err((kind, detail)) => {
                    let path = self.cache.dir.join(name);
                    out.anomalies.push(Anomaly::new(&store, None, &path, *kind, detail.clone()));
                }
            }
        }
        out
    }

    /// Lists the directory and reads the entries that changed; says
    /// whether every entry is remembered (nothing only a listing reports).
    fn list_and_read(&mut self) -> (CacheScan, bool) {
        let dir_path = self.cache.dir.clone();
        let store = self.cache.store_ref();
        let mut out = CacheScan::default();
        self.last_reads = 0;
        let listing = Dir::open(&dir_path).and_then(|dir| fs::read_dir(&dir_path).map(|entries| (dir, entries)));
        let (dir, entries) = match listing {
            Ok(found) => found,
            Err(e) => {
                let kind =
                    if e.kind() == io::ErrorKind::NotFound { AnomalyKind::MissingDir } else { AnomalyKind::Unreadable };
                out.anomalies.push(Anomaly::new(&store, None, &dir_path, kind, e.to_string()));
                self.entries.clear();
                return (out, false);
            }
        };
        let mut clean = true;
        let mut kept = std::collections::BTreeMap::new();
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    out.anomalies.push(Anomaly::new(&store, None, &dir_path, AnomalyKind::Unreadable, e.to_string()));
                    clean = false;
                    continue;
                }
            };
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::UnparsableName, "name is not UTF-8"));
                clean = false;
                continue;
            };
            // lstat relative to the listed directory: never follows a link.
            let stamp = entry.metadata().ok().map(|m| Stamp::of(&m));
            let before = self.entries.remove(&name);
            let read = match (before, stamp) {
                (Some(r), Some(stamp)) if r.settled && r.stamp == stamp => r,
                (_, stamp) => {
                    let now = SystemTime::now();
                    self.last_reads += 1;
                    let read = read_entry(&dir, &dir_path, &name).map(|a| a.map(Arc::new));
                    // Unstamped: reported, never remembered.
                    let Some(stamp) = stamp else {
                        push_read(&mut out, &store, &path, read);
                        clean = false;
                        continue;
                    };
                    Remembered { stamp, settled: stamp.settled_before(now), read }
                }
            };
            push_read(&mut out, &store, &path, read.read.clone());
            kept.insert(name, read);
        }
        self.entries = kept;
        out.attachments.sort_by(|a, b| a.path.cmp(&b.path));
        out.anomalies.sort_by(|a, b| a.path.cmp(&b.path));
        (out, clean)
    }
}

/// What a watch saw since the last look.
#[derive(Debug, PartialEq, Eq)]
enum Changes {
    /// These entries (none: nothing changed).
    Names(Vec<String>),
    /// Something it cannot name: overflow, the watch gone, a read error, a
    /// name that is not UTF-8.
    Unknown,
}

/// An inotify watch on one directory: which entries changed since the last
/// look. The kernel queues every change to an entry (create, write,
/// attributes, delete, rename), with its name, and to the directory itself
/// before the syscall that made it returns.
#[derive(Debug)]
struct ChangeWatch {
    fd: std::os::fd::OwnedFd,
    /// The watch is gone (directory removed or moved, queue overflow, a
    /// read failed): every look says "unknown" until it is made again.
    lost: std::cell::Cell<bool>,
}

impl ChangeWatch {
    fn new(dir: &Path) -> io::Result<Self> {
        use std::os::{
            fd::{AsRawFd as _, FromRawFd as _},
            unix::ffi::OsStrExt as _,
        };
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
        // SAFETY: no pointer arguments; the result is checked.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new fd that nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let mask = libc::IN_CREATE
            | libc::IN_DELETE
            | libc::IN_MODIFY
            | libc::IN_ATTRIB
            | libc::IN_CLOSE_WRITE
            | libc::IN_MOVED_FROM
            | libc::IN_MOVED_TO
            | libc::IN_DELETE_SELF
            | libc::IN_MOVE_SELF
            | libc::IN_ONLYDIR
            | libc::IN_DONT_FOLLOW;
        // SAFETY: `path` is a valid C string for the call; the result is checked.
        let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), mask) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd, lost: std::cell::Cell::new(false) })
    }

    /// Whether the watch is gone (it must be made again).
    fn lost(&self) -> bool {
        self.lost.get()
    }

    /// Drains the queue: the entries that changed since the last call.
    fn changes(&self) -> Changes {
        use std::os::fd::AsRawFd as _;
        if self.lost.get() {
            return Changes::Unknown;
        }
        // Room for at least one event with the longest name.
        let mut buf = [0u8; 4096 + 16 + 256];
        let mut names = Vec::new();
        loop {
            // SAFETY: `buf` is valid for writes of its length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(len) = usize::try_from(n) else {
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => {
                        self.lost.set(true);
                        return Changes::Unknown;
                    }
                }
            };
            let Some(events) = parse_events(buf.get(..len).unwrap_or_default()) else {
                self.lost.set(true);
                return Changes::Unknown;
            };
            names.extend(events);
        }
        names.sort_unstable();
        names.dedup();
        Changes::Names(names)
    }
}

/// The entry names of the inotify events in `buf` (one read's); None when
/// one says the watch is gone or cannot be named, or the buffer is cut.
/// Events on the directory itself name nothing and change no entry.
fn parse_events(buf: &[u8]) -> Option<Vec<String>> {
    // struct inotify_event: wd (i32), mask (u32), cookie (u32), len (u32),
    // then `len` bytes of name, NUL-padded.
    const HEADER: usize = 16;
    let gone = libc::IN_IGNORED | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF | libc::IN_Q_OVERFLOW | libc::IN_UNMOUNT;
    let field = |at: usize| buf.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_ne_bytes);
    let (mut names, mut at) = (Vec::new(), 0);
    if buf.is_empty() {
        return None;
    }
    while at < buf.len() {
        let (mask, len) = (field(at + 4)?, usize::try_from(field(at + 12)?).ok()?);
        if mask & gone != 0 {
            return None;
        }
        let raw = buf.get(at + HEADER..at + HEADER + len)?;
        let name = raw.split(|&b| b == 0).next().unwrap_or_default();
        if !name.is_empty() {
            names.push(std::str::from_utf8(name).ok()?.to_owned());
        }
        at += HEADER + len;
    }
    Some(names)
}

fn push_read(
    out: &mut CacheScan,
    store: &StoreRef,
    path: &Path,
    read: Result<Option<Arc<CachedAttachment>>, (AnomalyKind, String)>,
) {
    match read {
        Ok(Some(attachment)) => out.attachments.push(attachment),
        Ok(None) => {}
        Err((kind, detail)) => out.anomalies.push(Anomaly::new(store, None, path, kind, detail)),
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, fs};

    use super::*;

    /// What libcni 1.x writes (config shortened).
    const ENTRY: &str = r#"{"kind":"cniCacheV1","containerId":"c1","config":"e30=","ifName":"eth0","networkName":"net1","netns":"/var/run/netns/cni-1","result":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/cni-1"}],"ips":[{"address":"10.1.0.2/24","gateway":"10.1.0.1","interface":0},{"address":"fd00::2/64"}]}}"#;

    #[test]
    fn parses_what_libcni_writes() {
        let raw = parse_entry("net1-c1-eth0", ENTRY.as_bytes()).unwrap();
        assert_eq!(raw.container_id, "c1");
        assert_eq!(raw.netns.as_deref(), Some("/var/run/netns/cni-1"));
        assert_eq!(raw.ips, ["10.1.0.2".parse::<IpAddr>().unwrap(), "fd00::2".parse().unwrap()]);
    }

    #[test]
    fn legacy_results_and_missing_netns() {
        let entry = r#"{"kind":"cniCacheV1","containerId":"c","ifName":"e","networkName":"n","result":{"ip4":{"ip":"10.0.0.9/24"}}}"#;
        let raw = parse_entry("n-c-e", entry.as_bytes()).unwrap();
        assert_eq!(raw.netns, None);
        assert_eq!(raw.ips, ["10.0.0.9".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn bad_entries_are_typed() {
        assert_eq!(parse_entry("x", b"{").unwrap_err().0, AnomalyKind::MalformedContent);
        assert_eq!(parse_entry("net1-c1-eth1", ENTRY.as_bytes()).unwrap_err().0, AnomalyKind::NameMismatch);
        let wrong_kind = ENTRY.replace("cniCacheV1", "cniCacheV9");
        assert_eq!(parse_entry("net1-c1-eth0", wrong_kind.as_bytes()).unwrap_err().0, AnomalyKind::MalformedContent);
        let bad_ip = ENTRY.replace("10.1.0.2/24", "nonsense");
        assert_eq!(parse_entry("net1-c1-eth0", bad_ip.as_bytes()).unwrap_err().0, AnomalyKind::MalformedContent);
    }

    #[test]
    fn scan_reports_anomalies_beside_entries() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("net1-c1-eth0"), ENTRY).unwrap();
        fs::write(tmp.path().join("junk"), [0u8, 1, 2]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", tmp.path().join("net1-c2-eth0")).unwrap();
        let scan = CniCache::new(tmp.path()).scan();
        assert_eq!(scan.attachments.len(), 1);
        assert_eq!(scan.attachments[0].network, "net1");
        let kinds: Vec<_> = scan.anomalies.iter().map(|a| a.kind).collect();
        assert_eq!(kinds, [AnomalyKind::MalformedContent, AnomalyKind::Symlink]);
    }

    /// The reader re-reads only what changed, and its scan is a fresh one's.
    /// The listing (without the watch): stamps decide what is read again.
    #[test]
    fn the_reader_reads_again_only_entries_whose_file_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let old = tmp.path().join("net1-c1-eth0");
        fs::write(&old, ENTRY).unwrap();
        fs::write(tmp.path().join("junk"), [0u8, 1, 2]).unwrap();
        let mut reader = CacheReader::new(CniCache::new(tmp.path()));
        let first = reader.list_and_read().0;
        assert_eq!(first, CniCache::new(tmp.path()).scan());
        assert_eq!(reader.last_reads(), 2);
        // Just written: read again (its timestamps cannot tell yet).
        assert_eq!(reader.list_and_read().0, first);
        assert_eq!(reader.last_reads(), 2);
        std::thread::sleep(SETTLE + std::time::Duration::from_millis(20));
        assert_eq!(reader.list_and_read().0, first);
        assert_eq!(reader.last_reads(), 2, "read once more after settling");
        assert_eq!(reader.list_and_read().0, first);
        assert_eq!(reader.last_reads(), 0, "settled and unchanged: nothing read");
        // A new entry and a rewritten one are read; a removed one is gone.
        let second = ENTRY.replace("c1", "c2").replace("10.1.0.2/24", "10.1.0.3/24");
        fs::write(tmp.path().join("net1-c2-eth0"), second).unwrap();
        fs::write(&old, ENTRY.replace("cni-1", "cni-9")).unwrap();
        fs::remove_file(tmp.path().join("junk")).unwrap();
        let third = reader.list_and_read().0;
        assert_eq!(reader.last_reads(), 2);
        assert_eq!(third, CniCache::new(tmp.path()).scan());
        assert_eq!(third.attachments.len(), 2);
        assert_eq!(third.attachments[0].netns.as_deref(), Some("/var/run/netns/cni-9"));
        assert!(third.anomalies.is_empty());
    }

    /// Lets what the reader read settle, then scans (a listing: reads again
    /// what had just changed).
    fn settled_scan(reader: &mut CacheReader) -> CacheScan {
        std::thread::sleep(SETTLE + std::time::Duration::from_millis(20));
        (*reader.scan()).clone()
    }

    /// What changed, how many files reading it takes, the change.
    type Change<'a> = (&'a str, usize, Box<dyn Fn() + 'a>);

    #[test]
    fn a_watched_directory_is_followed_by_entry_and_every_change_is_seen() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("results");
        fs::create_dir(&dir).unwrap();
        let entry = dir.join("net1-c1-eth0");
        fs::write(&entry, ENTRY).unwrap();
        for i in 2..20 {
            fs::write(dir.join(format!("net1-c{i}-eth0")), ENTRY.replace("c1", &format!("c{i}"))).unwrap();
        }
        let mut reader = CacheReader::new(CniCache::new(&dir));
        let first = reader.scan();
        assert!(!reader.last_followed(), "the first scan lists");
        let again = reader.scan();
        assert_eq!(again, first);
        assert!(std::sync::Arc::ptr_eq(&again, &first), "unchanged: the same scan given again, not a copy");
        assert!(reader.last_followed(), "unchanged: followed");
        assert_eq!(reader.last_reads(), 0, "nothing read");

        // Each change, made just before the scan, is in the result, and
        // only the changed entries are read.
        let changes: Vec<Change<'_>> = vec![
            // Same size, same second: the stamps alone could miss it.
            ("rewritten in place", 1, Box::new(|| fs::write(&entry, ENTRY.replace("cni-1", "cni-2")).unwrap())),
            ("added", 1, Box::new(|| fs::write(dir.join("net1-cx-eth0"), ENTRY.replace("c1", "cx")).unwrap())),
            (
                "renamed over",
                1,
                Box::new(|| {
                    fs::write(tmp.path().join("staged"), ENTRY.replace("cni-1", "cni-3")).unwrap();
                    fs::rename(tmp.path().join("staged"), &entry).unwrap();
                }),
            ),
            ("removed", 0, Box::new(|| fs::remove_file(dir.join("net1-cx-eth0")).unwrap())),
            ("made unreadable junk", 1, Box::new(|| fs::write(dir.join("net1-c2-eth0"), "{").unwrap())),
        ];
        for (what, reads, change) in changes {
            change();
            let seen = reader.scan();
            assert!(reader.last_followed(), "{what}: followed");
            assert_eq!(reader.last_reads(), reads, "{what}: only the changed entry read");
            assert_eq!(*seen, CniCache::new(&dir).scan(), "{what}");
        }
        assert_eq!(reader.scan().attachments[0].netns.as_deref(), Some("/var/run/netns/cni-3"));
        assert_eq!(reader.scan().anomalies.len(), 1, "the junk entry is reported");

        // The directory replaced: the watch is lost, the next scan lists.
        fs::remove_dir_all(&dir).unwrap();
        fs::create_dir(&dir).unwrap();
        fs::write(&entry, ENTRY.replace("cni-1", "cni-4")).unwrap();
        let seen = reader.scan();
        assert!(!reader.last_followed(), "replaced: listed");
        assert_eq!(*seen, CniCache::new(&dir).scan());
        // Watched again from there.
        fs::write(dir.join("net1-c5-eth0"), ENTRY.replace("c1", "c5")).unwrap();
        assert_eq!(*reader.scan(), CniCache::new(&dir).scan());
        assert!(reader.last_followed());
    }

    /// What a followed scan says changed, applied to the attachments of
    /// the scan before it, gives its attachments (the agent dates cache
    /// entries so); a listing, or a scan that does not follow the one
    /// asked about, says nothing.
    #[test]
    fn a_followed_scan_names_what_changed_since_the_one_before() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("results");
        fs::create_dir(&dir).unwrap();
        let name = |i: u32| dir.join(format!("net1-c{i}-eth0"));
        for i in 1..5 {
            fs::write(name(i), ENTRY.replace("c1", &format!("c{i}"))).unwrap();
        }
        let paths = |scan: &CacheScan| scan.attachments.iter().map(|a| a.path.clone()).collect::<BTreeSet<_>>();
        let mut reader = CacheReader::new(CniCache::new(&dir));
        let first = reader.scan();
        let mut before = std::sync::Arc::clone(&first);
        let mut tracked = paths(&before);
        let edits: Vec<Box<dyn Fn()>> = vec![
            Box::new(|| fs::write(name(9), ENTRY.replace("c1", "c9")).unwrap()),
            Box::new(|| fs::remove_file(name(2)).unwrap()),
            Box::new(|| fs::write(name(3), "{").unwrap()),
            Box::new(|| fs::write(name(3), ENTRY.replace("c1", "c3")).unwrap()),
            Box::new(|| {
                fs::remove_file(name(4)).unwrap();
                fs::write(name(5), ENTRY.replace("c1", "c5")).unwrap();
            }),
        ];
        for (step, edit) in edits.iter().enumerate() {
            edit();
            let now = reader.scan();
            assert!(reader.last_followed(), "step {step}: followed");
            let changed =
                reader.changed_since(&before, &now).unwrap_or_else(|| panic!("step {step}: no changes named"));
            for (path, attachment) in changed {
                if *attachment {
                    tracked.insert(path.clone());
                } else {
                    tracked.remove(path);
                }
            }
            assert_eq!(tracked, paths(&now), "step {step}");
            assert!(reader.changed_since(&now, &now).is_none(), "step {step}: not followed from itself");
            if step > 0 {
                assert!(reader.changed_since(&first, &now).is_none(), "step {step}: not from an older scan");
            }
            before = now;
        }
        // The directory replaced: listed, nothing named.
        fs::remove_dir_all(&dir).unwrap();
        fs::create_dir(&dir).unwrap();
        fs::write(name(1), ENTRY).unwrap();
        let listed = reader.scan();
        assert!(!reader.last_followed());
        assert!(reader.changed_since(&before, &listed).is_none(), "a listing names nothing");
    }

    #[test]
    fn a_directory_that_cannot_be_watched_is_listed_at_every_scan() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("results");
        let mut reader = CacheReader::new(CniCache::new(&missing));
        assert_eq!(reader.scan().anomalies[0].kind, AnomalyKind::MissingDir);
        assert_eq!(reader.scan().anomalies[0].kind, AnomalyKind::MissingDir);
        assert!(!reader.last_followed());
        // Made later: followed once listed.
        fs::create_dir(&missing).unwrap();
        fs::write(missing.join("net1-c1-eth0"), ENTRY).unwrap();
        assert_eq!(reader.scan().attachments.len(), 1);
        assert!(!reader.last_followed());
        settled_scan(&mut reader);
        reader.scan();
        assert!(reader.last_followed());
    }

    #[test]
    fn an_entry_only_a_listing_reports_keeps_the_reader_listing() {
        use std::os::unix::ffi::OsStrExt as _;
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("net1-c1-eth0"), ENTRY).unwrap();
        fs::write(tmp.path().join(std::ffi::OsStr::from_bytes(b"bad-\xff")), ENTRY).unwrap();
        let mut reader = CacheReader::new(CniCache::new(tmp.path()));
        let first = reader.scan();
        assert_eq!(first.anomalies[0].kind, AnomalyKind::UnparsableName);
        assert_eq!(reader.scan(), first);
        assert!(!reader.last_followed(), "the listing's anomaly is reported again, by a listing");
    }

    #[test]
    fn inotify_events_are_read_by_name_and_a_lost_watch_names_nothing() {
        fn event(mask: u32, name: &[u8], pad: usize) -> Vec<u8> {
            let mut e = Vec::new();
            e.extend_from_slice(&1i32.to_ne_bytes());
            e.extend_from_slice(&mask.to_ne_bytes());
            e.extend_from_slice(&0u32.to_ne_bytes());
            e.extend_from_slice(&u32::try_from(name.len() + pad).unwrap().to_ne_bytes());
            e.extend_from_slice(name);
            e.extend(std::iter::repeat_n(0u8, pad));
            e
        }
        let mut buf = event(libc::IN_MODIFY, b"net1-c1-eth0", 4);
        buf.extend(event(libc::IN_ATTRIB, b"", 0));
        buf.extend(event(libc::IN_DELETE, b"x", 15));
        assert_eq!(parse_events(&buf), Some(vec!["net1-c1-eth0".to_owned(), "x".to_owned()]));
        assert_eq!(parse_events(&buf[..20]), None, "a cut record");
        assert_eq!(parse_events(&event(libc::IN_Q_OVERFLOW, b"", 0)), None);
        assert_eq!(parse_events(&event(libc::IN_IGNORED, b"", 0)), None);
        assert_eq!(parse_events(&event(libc::IN_CREATE, b"\xff", 3)), None, "not UTF-8");
    }
}
