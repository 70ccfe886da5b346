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
    pub attachments: Vec<CachedAttachment>,
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
            let kind = if meta.is_dir() { AnomalyKind::Directory } else { AnomalyKind::NotRegularFile };
            return Err((kind, "not a regular file".into()));
        }
        Ok(Bounded::TooLarge(meta)) => {
            return Err((
                AnomalyKind::Oversized,
                format!("{} bytes, over the {MAX_CACHE_BYTES}-byte limit", meta.size()),
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
        written_at: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
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
                Ok(Some(attachment)) => out.attachments.push(attachment),
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
    read: Result<Option<CachedAttachment>, (AnomalyKind, String)>,
}

/// [`CniCache::scan`] for an agent that scans at every reconcile: it lists
/// the directory and reads again only the entries whose file changed since
/// the last scan (name, inode, size, mtime and ctime differ, or it had just
/// changed when it was read). The result is the same as a fresh scan's.
#[derive(Debug)]
pub struct CacheReader {
    cache: CniCache,
    entries: std::collections::HashMap<String, Remembered>,
    /// Files read by the last scan (the rest were remembered).
    last_reads: usize,
}

impl CacheReader {
    #[must_use]
    pub fn new(cache: CniCache) -> Self {
        Self { cache, entries: std::collections::HashMap::new(), last_reads: 0 }
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

    /// Lists every valid entry; anything else is an anomaly.
    pub fn scan(&mut self) -> CacheScan {
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
                return out;
            }
        };
        let mut kept = std::collections::HashMap::with_capacity(self.entries.len());
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    out.anomalies.push(Anomaly::new(&store, None, &dir_path, AnomalyKind::Unreadable, e.to_string()));
                    continue;
                }
            };
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::UnparsableName, "name is not UTF-8"));
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
                    let read = read_entry(&dir, &dir_path, &name);
                    // Unstamped: reported, never remembered.
                    let Some(stamp) = stamp else {
                        push_read(&mut out, &store, &path, read);
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
        out
    }
}

fn push_read(
    out: &mut CacheScan,
    store: &StoreRef,
    path: &Path,
    read: Result<Option<CachedAttachment>, (AnomalyKind, String)>,
) {
    match read {
        Ok(Some(attachment)) => out.attachments.push(attachment),
        Ok(None) => {}
        Err((kind, detail)) => out.anomalies.push(Anomaly::new(store, None, path, kind, detail)),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

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
    #[test]
    fn the_reader_reads_again_only_entries_whose_file_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let old = tmp.path().join("net1-c1-eth0");
        fs::write(&old, ENTRY).unwrap();
        fs::write(tmp.path().join("junk"), [0u8, 1, 2]).unwrap();
        let mut reader = CacheReader::new(CniCache::new(tmp.path()));
        let first = reader.scan();
        assert_eq!(first, CniCache::new(tmp.path()).scan());
        assert_eq!(reader.last_reads(), 2);
        // Just written: read again (its timestamps cannot tell yet).
        assert_eq!(reader.scan(), first);
        assert_eq!(reader.last_reads(), 2);
        std::thread::sleep(SETTLE + std::time::Duration::from_millis(20));
        assert_eq!(reader.scan(), first);
        assert_eq!(reader.last_reads(), 2, "read once more after settling");
        assert_eq!(reader.scan(), first);
        assert_eq!(reader.last_reads(), 0, "settled and unchanged: nothing read");
        // A new entry and a rewritten one are read; a removed one is gone.
        let second = ENTRY.replace("c1", "c2").replace("10.1.0.2/24", "10.1.0.3/24");
        fs::write(tmp.path().join("net1-c2-eth0"), second).unwrap();
        fs::write(&old, ENTRY.replace("cni-1", "cni-9")).unwrap();
        fs::remove_file(tmp.path().join("junk")).unwrap();
        let third = reader.scan();
        assert_eq!(reader.last_reads(), 2);
        assert_eq!(third, CniCache::new(tmp.path()).scan());
        assert_eq!(third.attachments.len(), 2);
        assert_eq!(third.attachments[0].netns.as_deref(), Some("/var/run/netns/cni-9"));
        assert!(third.anomalies.is_empty());
    }
}
