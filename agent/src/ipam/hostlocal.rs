//! The host-local IPAM plugin's store (containernetworking/plugins,
//! plugins/ipam/host-local/backend/disk): `<dataDir>/<network>/<ip>` holds
//! `containerID\r\nifname` with no trailing newline (files of older plugin
//! versions hold only the container ID). Beside them: `lock` (the plugin's
//! flock) and `last_reserved_ip.<range>`, which are not reservations.

use std::{
    ffi::{CStr, OsStr},
    fs,
    io::{self, Write as _},
    net::IpAddr,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use super::{
    Anomaly, AnomalyKind, Owner, Reservation, ReservationData, ReservationStore, StoreRef, StoreScan,
    is_printable_text,
    safefs::{self, Dir, FileMeta, FileStatus},
    shared::{Interner, SharedStr},
};

/// Where host-local keeps its data when the config names no `dataDir`.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";
/// The plugin's lock file in each network directory.
pub const LOCK_FILE: &str = "lock";
/// Prefix of the plugin's "last reserved IP" files, one per range.
pub const LAST_RESERVED_PREFIX: &str = "last_reserved_ip.";
/// host-local writes at most a container ID (64 hex in practice), CRLF and
/// an interface name (15 bytes): anything larger is not one of its files.
pub const MAX_RESERVATION_BYTES: u64 = 1024;
/// What separates container ID and ifname (the plugin's `LineBreak`).
pub const LINE_BREAK: &str = "\r\n";

/// One host-local data dir (the plugin's `dataDir`), with one directory per
/// network below it.
#[derive(Debug, Clone)]
pub struct HostLocalStore {
    data_dir: PathBuf,
}

/// What a name in a network directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryName {
    /// The plugin's lock file.
    Lock,
    /// `last_reserved_ip.<range>`.
    LastReserved,
    /// A reservation file, named as the plugin names it.
    Ip(IpAddr),
    /// Parses as an IP, but host-local would never write this spelling.
    NonCanonicalIp(IpAddr),
    /// Anything else.
    NotIp,
}

/// Classifies a file name with an IP parser. host-local names files with
/// Go's `net.IP.String()`: dotted quad, or RFC 5952 compressed IPv6, which
/// is also what Rust prints. Any other spelling is not the plugin's.
#[must_use]
pub fn classify_name(name: &str) -> EntryName {
    if name == LOCK_FILE {
        return EntryName::Lock;
    }
    if name.starts_with(LAST_RESERVED_PREFIX) {
        return EntryName::LastReserved;
    }
    match name.parse::<IpAddr>() {
        Ok(ip) if renders_as(ip, name) => EntryName::Ip(ip),
        Ok(ip) => EntryName::NonCanonicalIp(ip),
        Err(_) => EntryName::NotIp,
    }
}

/// Whether `ip` prints as exactly `name`, compared as it is formatted (a
/// listing classifies every name of 100k: no string per name).
fn renders_as(ip: IpAddr, name: &str) -> bool {
    struct Compare<'n> {
        rest: &'n [u8],
    }
    impl std::fmt::Write for Compare<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let rest = self.rest.strip_prefix(s.as_bytes()).ok_or(std::fmt::Error)?;
            self.rest = rest;
            Ok(())
        }
    }
    let mut compare = Compare { rest: name.as_bytes() };
    std::fmt::Write::write_fmt(&mut compare, format_args!("{ip}")).is_ok() && compare.rest.is_empty()
}

/// Parses a reservation file's content the way the plugin matches it
/// (`strings.TrimSpace(data) == id + "\r\n" + ifname`, or `== id` for legacy).
pub fn parse_owner(content: &[u8]) -> Result<Owner, (AnomalyKind, String)> {
    let (id, ifname) = parse_owner_parts(content)?;
    Ok(Owner { container_id: id.to_owned(), ifname: ifname.map(str::to_owned) })
}

/// [`parse_owner`] without copying: container ID and ifname borrow from
/// `content`.
fn parse_owner_parts(content: &[u8]) -> Result<(&str, Option<&str>), (AnomalyKind, String)> {
    let Ok(text) = std::str::from_utf8(content) else {
        return Err((AnomalyKind::BinaryContent, "content is not valid UTF-8".into()));
    };
    if !is_printable_text(text) {
        return Err((AnomalyKind::BinaryContent, "content holds NUL or control bytes".into()));
    }
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err((AnomalyKind::EmptyContent, "file holds no container ID".into()));
    }
    let (id, ifname) = match trimmed.split_once(LINE_BREAK) {
        Some((id, ifname)) => (id, Some(ifname)),
        None => (trimmed, None),
    };
    let token_ok = |s: &str| !s.is_empty() && !s.chars().any(char::is_whitespace);
    if !token_ok(id) {
        return Err((AnomalyKind::MalformedContent, format!("container ID {id:?} is empty or holds whitespace")));
    }
    if let Some(ifname) = ifname
        && !token_ok(ifname)
    {
        return Err((AnomalyKind::MalformedContent, format!("interface name {ifname:?} is empty or holds whitespace")));
    }
    Ok((id, ifname))
}

/// The result of reading one reservation file.
#[derive(Debug)]
pub(crate) enum ReadOwner {
    Owner(Owner, fs::Metadata),
    /// No such file (any more).
    Gone,
    Anomaly(AnomalyKind, String),
}

/// Reads and parses `name` in an opened network directory, without
/// following symlinks or blocking on FIFOs.
pub(crate) fn read_owner(dir: &Dir, name: &str) -> ReadOwner {
    let mut scratch = Vec::new();
    match read_owner_into(dir, name, &mut scratch) {
        Ok(Some(((id, ifname), meta))) => {
            ReadOwner::Owner(Owner { container_id: id.to_owned(), ifname: ifname.map(str::to_owned) }, meta)
        }
        Ok(None) => ReadOwner::Gone,
        Err((kind, detail)) => ReadOwner::Anomaly(kind, detail),
    }
}

/// The owner a reservation file names, borrowed from `scratch`
/// (container ID, ifname), with the file's status (`M`: std's metadata for
/// a single file, the compact [`FileMeta`] in a scan).
type OwnerParts<'b, M = fs::Metadata> = ((&'b str, Option<&'b str>), M);

/// [`read_owner`] into a buffer reused from file to file. `Ok(None)`: the
/// file is gone.
fn read_owner_into<'b>(
    dir: &Dir,
    name: &str,
    scratch: &'b mut Vec<u8>,
) -> Result<Option<OwnerParts<'b>>, (AnomalyKind, String)> {
    owner_of(safefs::read_bounded_into(dir, name, MAX_RESERVATION_BYTES, scratch), scratch)
}

/// What a bounded read of a reservation file says of its owner.
fn owner_of<M: FileStatus>(
    read: io::Result<safefs::Read<M>>,
    scratch: &[u8],
) -> Result<Option<OwnerParts<'_, M>>, (AnomalyKind, String)> {
    match read {
        Ok(safefs::Read::Content(meta)) => parse_owner_parts(scratch).map(|parts| Some((parts, meta))),
        Ok(safefs::Read::NotRegular(meta)) => {
            if meta.is_directory() {
                Err((AnomalyKind::Directory, "a directory named as an IP".into()))
            } else {
                Err((AnomalyKind::NotRegularFile, format!("not a regular file (mode {:o})", meta.st_mode())))
            }
        }
        Ok(safefs::Read::TooLarge(meta)) => Err((
            AnomalyKind::Oversized,
            format!("{} bytes, more than the {MAX_RESERVATION_BYTES} any reservation holds", meta.st_size()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            Err((AnomalyKind::Symlink, "a symlink; never followed".into()))
        }
        Err(e) => Err((AnomalyKind::Unreadable, e.to_string())),
    }
}

/// [`read_owner_into`] with a NUL-terminated name (no allocation) and the
/// compact status a scan keeps.
fn read_owner_into_c<'b>(
    dir: &Dir,
    name: &CStr,
    scratch: &'b mut Vec<u8>,
) -> Result<Option<OwnerParts<'b, FileMeta>>, (AnomalyKind, String)> {
    owner_of(safefs::read_bounded_into_c(dir, name, MAX_RESERVATION_BYTES, scratch), scratch)
}

/// A network name as a single plain path component of printable text.
#[must_use]
pub fn is_valid_network_name(name: &str) -> bool {
    safefs::is_plain_name(name) && is_printable_text(name) && !name.contains(['\r', '\n', '\t'])
}

impl HostLocalStore {
    #[must_use]
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self { data_dir: data_dir.into() }
    }

    #[must_use]
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Lists one network directory (`network` already validated): the
    /// names that are reservation files go to `files` as their IP (host-local
    /// names them canonically, so the IP renders back to the same name);
    /// anything else that is not the plugin's own is an anomaly.
    fn list_network(
        &self,
        store: &StoreRef,
        network: &str,
        net: u32,
        files: &mut Vec<(u32, IpAddr)>,
        anomalies: &mut Vec<Anomaly>,
    ) -> Option<Dir> {
        let net_path = self.data_dir.join(network);
        let anomaly = |path: &Path, kind, detail: String| Anomaly::new(store, Some(network), path, kind, detail);
        let dir = match Dir::open(&net_path) {
            Ok(dir) => dir,
            Err(e) => {
                anomalies.push(anomaly(&net_path, AnomalyKind::Unreadable, e.to_string()));
                return None;
            }
        };
        let entries = match fs::read_dir(&net_path) {
            Ok(entries) => entries,
            Err(e) => {
                anomalies.push(anomaly(&net_path, AnomalyKind::Unreadable, e.to_string()));
                return None;
            }
        };
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    anomalies.push(anomaly(&net_path, AnomalyKind::Unreadable, e.to_string()));
                    continue;
                }
            };
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str() else {
                anomalies.push(anomaly(&entry.path(), AnomalyKind::UnparsableName, "name is not UTF-8".into()));
                continue;
            };
            match classify_name(name) {
                EntryName::Lock | EntryName::LastReserved => {}
                EntryName::Ip(ip) => files.push((net, ip)),
                EntryName::NonCanonicalIp(ip) => {
                    let detail = format!("{name:?} parses as an IP, but host-local would name it {ip}");
                    anomalies.push(anomaly(&entry.path(), AnomalyKind::NonCanonicalName, detail));
                }
                EntryName::NotIp => {
                    let detail = format!("{name:?} is not an IP address");
                    anomalies.push(anomaly(&entry.path(), AnomalyKind::UnparsableName, detail));
                }
            }
        }
        Some(dir)
    }
}

/// The network directories of one scan, opened, with what their
/// reservations share.
struct Networks<'s> {
    store: &'s Arc<StoreRef>,
    data_dir: &'s Path,
    /// Name, interned, and the open directory, by the index `files` use.
    dirs: Vec<(SharedStr, Dir)>,
}

impl Networks<'_> {
    /// Reads the reservation files `files` name, one at a time into one
    /// reused buffer; only each file's compact [`Reservation`] is kept.
    fn read(&self, files: &[(u32, IpAddr)], names: &mut Interner) -> StoreScan {
        let mut out = StoreScan { reservations: Vec::with_capacity(files.len()), anomalies: Vec::new() };
        let mut scratch = Vec::with_capacity(usize::try_from(MAX_RESERVATION_BYTES).unwrap_or(1024) + 1);
        // The file name, NUL-terminated: an IPv6 address is at most 45 bytes.
        let mut name_buf = Vec::with_capacity(64);
        for &(net, ip) in files {
            let Some((network, dir)) = self.dirs.get(net as usize) else { continue };
            name_buf.clear();
            // Writing to a Vec cannot fail.
            let _ = write!(name_buf, "{ip}\0");
            let Ok(c_name) = CStr::from_bytes_with_nul(&name_buf) else { continue };
            // Kept for as long as the reservation is: allocated at its size.
            let path = || {
                let len = self.data_dir.as_os_str().len() + network.len() + c_name.to_bytes().len() + 2;
                let mut path = PathBuf::with_capacity(len);
                path.push(self.data_dir);
                path.push(network.as_str());
                path.push(OsStr::from_bytes(c_name.to_bytes()));
                path
            };
            match read_owner_into_c(dir, c_name, &mut scratch) {
                Ok(Some(((id, ifname), meta))) => out.reservations.push(Reservation::from(ReservationData {
                    store: Arc::clone(self.store),
                    network: network.clone(),
                    ip,
                    container_id: names.intern(id),
                    ifname: ifname.map(|i| names.intern(i)),
                    created_at: meta.modified(),
                    path: path(),
                    inode: meta.ino(),
                })),
                // Released by the plugin between listing and reading.
                Ok(None) => {}
                Err((kind, detail)) => {
                    out.anomalies.push(Anomaly::new(self.store, Some(network), &path(), kind, detail));
                }
            }
        }
        out
    }

    /// [`Networks::read`] on up to [`SCAN_THREADS`] threads, each on its
    /// own share of the files: a scan is mostly syscalls (open, fstat,
    /// read, close), which run in parallel. Container IDs are then made to
    /// share one allocation across the shares.
    fn read_parallel(&self, files: &[(u32, IpAddr)], names: &mut Interner) -> StoreScan {
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(SCAN_THREADS);
        if threads < 2 || files.len() < PARALLEL_SCAN_MIN_FILES {
            return self.read(files, names);
        }
        let (first, rest) = files.split_at(files.len() / 2);
        let (mut out, other) = std::thread::scope(|s| {
            let helper = std::thread::Builder::new().name("netreap-scan".into()).spawn_scoped(s, || {
                let mut names = Interner::new();
                self.read(rest, &mut names)
            });
            let out = self.read(first, names);
            // A thread that cannot be started or that panicked: its share
            // is read here (a scan is never cut short).
            let other = match helper.map(std::thread::ScopedJoinHandle::join) {
                Ok(Ok(other)) => other,
                _ => self.read(rest, names),
            };
            (out, other)
        });
        out.reservations.extend(other.reservations.into_iter().map(|mut r| {
            if let Some(same) = names.get(&r.container_id)
                && !SharedStr::ptr_eq(&same, &r.container_id)
            {
                r.container_id = same;
            }
            r
        }));
        out.anomalies.extend(other.anomalies);
        out
    }
}

/// Most threads a scan uses: the agent shares the node with its pods.
const SCAN_THREADS: usize = 2;
/// Below this many files a second thread costs more than it saves.
const PARALLEL_SCAN_MIN_FILES: usize = 1024;

impl ReservationStore for HostLocalStore {
    fn store_ref(&self) -> StoreRef {
        StoreRef::HostLocal { data_dir: self.data_dir.clone() }
    }

    fn scan(&self) -> StoreScan {
        let store = Arc::new(self.store_ref());
        let mut names = Interner::new();
        let mut out = StoreScan::default();
        let root = &self.data_dir;
        let entries = match fs::read_dir(root) {
            Ok(entries) => entries,
            Err(e) => {
                let kind =
                    if e.kind() == io::ErrorKind::NotFound { AnomalyKind::MissingDir } else { AnomalyKind::Unreadable };
                out.anomalies.push(Anomaly::new(&store, None, root, kind, e.to_string()));
                return out;
            }
        };
        let mut networks = Networks { store: &store, data_dir: root, dirs: Vec::new() };
        let mut files = Vec::new();
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    out.anomalies.push(Anomaly::new(&store, None, root, AnomalyKind::Unreadable, e.to_string()));
                    continue;
                }
            };
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().filter(|n| is_valid_network_name(n)).map(str::to_owned) else {
                let detail = "not a usable network name (not UTF-8 or holds control characters)";
                out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::UnparsableName, detail));
                continue;
            };
            match entry.file_type() {
                Ok(t) if t.is_dir() => {
                    let net = u32::try_from(networks.dirs.len()).unwrap_or(u32::MAX);
                    if let Some(dir) = self.list_network(&store, &name, net, &mut files, &mut out.anomalies) {
                        networks.dirs.push((names.intern(&name), dir));
                    }
                }
                Ok(t) if t.is_symlink() => {
                    let detail = "a symlink where a network directory was expected; never followed";
                    out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::Symlink, detail));
                }
                Ok(_) => {
                    let detail = "a file where a network directory was expected";
                    out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::NotADirectory, detail));
                }
                Err(e) => out.anomalies.push(Anomaly::new(&store, None, &path, AnomalyKind::Unreadable, e.to_string())),
            }
        }
        // By network, then IP: the order the result is sorted in, and a
        // cheap sort here (the network is an index) makes that one a no-op.
        let mut by_name: Vec<usize> = (0..networks.dirs.len()).collect();
        by_name.sort_unstable_by(|&a, &b| networks.dirs[a].0.cmp(&networks.dirs[b].0));
        let mut rank = vec![0_u32; by_name.len()];
        for (r, &net) in by_name.iter().enumerate() {
            rank[net] = u32::try_from(r).unwrap_or(u32::MAX);
        }
        files.sort_unstable_by_key(|&(net, ip)| (rank[net as usize], ip));
        out.extend(networks.read_parallel(&files, &mut names));
        drop(files);
        out.reservations.sort_by(|a, b| (&a.network, a.ip).cmp(&(&b.network, b.ip)));
        out.anomalies.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::symlink};

    use super::*;

    #[test]
    fn names_are_classified_with_an_ip_parser() {
        assert_eq!(classify_name("lock"), EntryName::Lock);
        assert_eq!(classify_name("last_reserved_ip.0"), EntryName::LastReserved);
        assert_eq!(classify_name("10.0.0.2"), EntryName::Ip("10.0.0.2".parse().unwrap()));
        assert_eq!(classify_name("fd00:1::2"), EntryName::Ip("fd00:1::2".parse().unwrap()));
        assert!(matches!(classify_name("fd00:1:0::2"), EntryName::NonCanonicalIp(_)));
        assert_eq!(classify_name("010.0.0.2"), EntryName::NotIp);
        assert_eq!(classify_name("10.0.0.256"), EntryName::NotIp);
        assert_eq!(classify_name("notes.txt"), EntryName::NotIp);
        assert_eq!(classify_name("10.0.0.2.bak"), EntryName::NotIp);
    }

    #[test]
    fn owner_parsing_matches_the_plugin() {
        let owner = parse_owner(b"abc\r\neth0").unwrap();
        assert_eq!(owner, Owner { container_id: "abc".into(), ifname: Some("eth0".into()) });
        let legacy = parse_owner(b"abc \n").unwrap();
        assert_eq!(legacy, Owner { container_id: "abc".into(), ifname: None });
        assert_eq!(parse_owner(b"").unwrap_err().0, AnomalyKind::EmptyContent);
        assert_eq!(parse_owner(b"  \r\n ").unwrap_err().0, AnomalyKind::EmptyContent);
        assert_eq!(parse_owner(b"ab\0c").unwrap_err().0, AnomalyKind::BinaryContent);
        assert_eq!(parse_owner(&[0xff, 0xfe]).unwrap_err().0, AnomalyKind::BinaryContent);
        assert_eq!(parse_owner(b"a b").unwrap_err().0, AnomalyKind::MalformedContent);
        assert_eq!(parse_owner(b"abc\r\neth0\r\nx").unwrap_err().0, AnomalyKind::MalformedContent);
    }

    #[test]
    fn scan_lists_reservations_and_reports_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let net = tmp.path().join("net1");
        fs::create_dir(&net).unwrap();
        fs::write(net.join("lock"), "").unwrap();
        fs::write(net.join("last_reserved_ip.0"), "10.0.0.3").unwrap();
        fs::write(net.join("10.0.0.2"), "c1\r\neth0").unwrap();
        fs::write(net.join("10.0.0.3"), "c2").unwrap();
        fs::write(net.join("fd00::5"), "c3\r\nnet1").unwrap();
        fs::write(net.join("garbage"), "c4").unwrap();
        fs::create_dir(net.join("10.0.0.4")).unwrap();
        symlink("/etc/passwd", net.join("10.0.0.5")).unwrap();
        fs::write(net.join("10.0.0.6"), vec![b'a'; 5000]).unwrap();
        fs::write(tmp.path().join("stray"), "x").unwrap();
        symlink(&net, tmp.path().join("net2")).unwrap();

        let scan = HostLocalStore::new(tmp.path()).scan();
        let got: Vec<_> = scan.reservations.iter().map(|r| (r.ip.to_string(), r.owner().to_string())).collect();
        assert_eq!(
            got,
            [
                ("10.0.0.2".to_owned(), "c1/eth0".to_owned()),
                ("10.0.0.3".into(), "c2 (legacy, no ifname)".into()),
                ("fd00::5".into(), "c3/net1".into()),
            ]
        );
        let mut kinds: Vec<_> = scan.anomalies.iter().map(|a| a.kind).collect();
        kinds.sort_by_key(|k| format!("{k:?}"));
        assert_eq!(
            kinds,
            [
                AnomalyKind::Directory,
                AnomalyKind::NotADirectory,
                AnomalyKind::Oversized,
                AnomalyKind::Symlink,
                AnomalyKind::Symlink,
                AnomalyKind::UnparsableName,
            ]
        );
    }

    #[test]
    fn a_large_directory_read_on_two_threads_gives_what_one_would() {
        // More files than PARALLEL_SCAN_MIN_FILES, hostile entries among
        // them (in either thread's share): every reservation once, in
        // (network, IP) order, the same anomalies, container IDs shared
        // across the shares.
        let tmp = tempfile::tempdir().unwrap();
        let (net_a, net_b) = (tmp.path().join("nrS-a"), tmp.path().join("nrS-b"));
        fs::create_dir(&net_a).unwrap();
        fs::create_dir(&net_b).unwrap();
        let n = PARALLEL_SCAN_MIN_FILES + 500;
        for i in 0..n {
            let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 0xff, i & 0xff);
            let net = if i % 2 == 0 { &net_a } else { &net_b };
            fs::write(net.join(&ip), format!("c{}\r\neth0", i % 50)).unwrap();
        }
        fs::write(net_a.join("lock"), "").unwrap();
        symlink("/etc/passwd", net_a.join("10.200.0.1")).unwrap();
        symlink("/etc/passwd", net_b.join("10.200.0.2")).unwrap();
        fs::create_dir(net_b.join("10.200.0.3")).unwrap();
        fs::write(net_a.join("10.200.0.4"), vec![b'a'; 5000]).unwrap();
        fs::write(net_b.join("10.200.0.5"), b"c1\0x").unwrap();
        let fifo = std::ffi::CString::new(net_b.join("10.200.0.6").into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        fs::write(net_a.join("010.200.0.7"), "c1").unwrap();

        let scan = HostLocalStore::new(tmp.path()).scan();
        assert_eq!(scan.reservations.len(), n);
        let keys: Vec<_> = scan.reservations.iter().map(|r| (r.network.to_string(), r.ip)).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(keys, sorted, "sorted by network and IP, each once");
        for r in &scan.reservations {
            assert_eq!(r.path, tmp.path().join(r.network.as_str()).join(r.ip.to_string()));
            assert_eq!(r.owner().ifname.as_deref(), Some("eth0"));
        }
        let (first, last) = (&scan.reservations[0], &scan.reservations[n - 1]);
        let same_cid = scan.reservations.iter().filter(|r| r.container_id == first.container_id);
        assert!(same_cid.clone().count() > 2);
        assert!(same_cid.clone().all(|r| SharedStr::ptr_eq(&r.container_id, &first.container_id)));
        assert!(scan.reservations.iter().filter(|r| r.network == last.network).all(|r| r.network == "nrS-b"));
        let mut kinds: Vec<_> = scan.anomalies.iter().map(|a| format!("{:?} {}", a.kind, a.path)).collect();
        kinds.sort();
        let p = |net: &str, name: &str| tmp.path().join(net).join(name).display().to_string();
        assert_eq!(
            kinds,
            [
                format!("BinaryContent {}", p("nrS-b", "10.200.0.5")),
                format!("Directory {}", p("nrS-b", "10.200.0.3")),
                format!("NotRegularFile {}", p("nrS-b", "10.200.0.6")),
                format!("Oversized {}", p("nrS-a", "10.200.0.4")),
                format!("Symlink {}", p("nrS-a", "10.200.0.1")),
                format!("Symlink {}", p("nrS-b", "10.200.0.2")),
                format!("UnparsableName {}", p("nrS-a", "010.200.0.7")),
            ]
        );
    }

    #[test]
    fn a_missing_data_dir_is_reported_not_fatal() {
        let tmp = tempfile::tempdir().unwrap();
        let scan = HostLocalStore::new(tmp.path().join("nope")).scan();
        assert!(scan.reservations.is_empty());
        assert_eq!(scan.anomalies.len(), 1);
        assert_eq!(scan.anomalies[0].kind, AnomalyKind::MissingDir);
    }
}
