//! The host-local IPAM plugin's store (containernetworking/plugins,
//! plugins/ipam/host-local/backend/disk): `<dataDir>/<network>/<ip>` holds
//! `containerID\r\nifname` with no trailing newline (files of older plugin
//! versions hold only the container ID). Beside them: `lock` (the plugin's
//! flock) and `last_reserved_ip.<range>`, which are not reservations.

use std::{
    ffi::{CStr, OsStr, OsString},
    fs, io,
    net::IpAddr,
    ops::Range,
    os::{
        fd::{AsFd, BorrowedFd},
        unix::ffi::{OsStrExt, OsStringExt},
    },
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
};

use super::{
    Anomaly, AnomalyKind, Owner, Reservation, ReservationData, ReservationStore, StoreRef, StoreScan,
    is_printable_text,
    safefs::{self, Dir, FileMeta},
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
        // std's IPv4 parser takes exactly four decimal octets without
        // leading zeros: the one spelling it prints, so no rendering to
        // compare (a listing classifies every name of 100k).
        Ok(ip @ IpAddr::V4(_)) => EntryName::Ip(ip),
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
    let (id, ifname) = match split_line_break(trimmed) {
        Some((id, ifname)) => (id, Some(ifname)),
        None => (trimmed, None),
    };
    let token_ok = |s: &str| !s.is_empty() && !holds_whitespace(s);
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

/// `s.split_once(LINE_BREAK)` without building a substring searcher, which
/// cost more than the search for every file of a scan.
fn split_line_break(s: &str) -> Option<(&str, &str)> {
    let at = s.as_bytes().windows(LINE_BREAK.len()).position(|w| w == LINE_BREAK.as_bytes())?;
    Some((s.get(..at)?, s.get(at + LINE_BREAK.len()..)?))
}

/// `s.chars().any(char::is_whitespace)`, byte by byte for ASCII text (what
/// host-local writes): the same six ASCII characters, U+000B included.
fn holds_whitespace(s: &str) -> bool {
    if s.is_ascii() {
        // Without early exit, so it vectorises (see `is_printable_text`).
        s.bytes().fold(false, |found, b| found | matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' '))
    } else {
        s.chars().any(char::is_whitespace)
    }
}

/// The result of reading one reservation file.
#[derive(Debug)]
pub(crate) enum ReadOwner {
    Owner(Owner, FileMeta),
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
/// (container ID, ifname), with the file's status.
type OwnerParts<'b> = ((&'b str, Option<&'b str>), FileMeta);

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
fn owner_of(read: io::Result<safefs::Read>, scratch: &[u8]) -> Result<Option<OwnerParts<'_>>, (AnomalyKind, String)> {
    match read {
        Ok(safefs::Read::Content(meta)) => parse_owner_parts(scratch).map(|parts| Some((parts, meta))),
        Ok(safefs::Read::NotRegular(meta)) => {
            if meta.is_directory() {
                Err((AnomalyKind::Directory, "a directory named as an IP".into()))
            } else {
                Err((AnomalyKind::NotRegularFile, format!("not a regular file (mode {:o})", meta.mode())))
            }
        }
        Ok(safefs::Read::TooLarge(meta)) => Err((
            AnomalyKind::Oversized,
            format!("{} bytes, more than the {MAX_RESERVATION_BYTES} any reservation holds", meta.len()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            Err((AnomalyKind::Symlink, "a symlink; never followed".into()))
        }
        Err(e) => Err((AnomalyKind::Unreadable, e.to_string())),
    }
}

/// [`read_owner_into`] with a NUL-terminated name (no allocation).
fn read_owner_into_c<'b>(
    dir: &Dir,
    name: &CStr,
    scratch: &'b mut Vec<u8>,
) -> Result<Option<OwnerParts<'b>>, (AnomalyKind, String)> {
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

    /// The data directory's network directories, by name, with their
    /// directory bytes; what is not one is an anomaly. None when the data
    /// directory cannot be read (also an anomaly).
    fn network_names(&self, store: &Arc<StoreRef>, anomalies: &mut Vec<Anomaly>) -> Option<(Vec<String>, u64)> {
        let root = &self.data_dir;
        let entries = match fs::read_dir(root) {
            Ok(entries) => entries,
            Err(e) => {
                let kind =
                    if e.kind() == io::ErrorKind::NotFound { AnomalyKind::MissingDir } else { AnomalyKind::Unreadable };
                anomalies.push(Anomaly::new(store, None, root, kind, e.to_string()));
                return None;
            }
        };
        let mut networks = Vec::new();
        let mut dir_bytes = 0_u64;
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    anomalies.push(Anomaly::new(store, None, root, AnomalyKind::Unreadable, e.to_string()));
                    continue;
                }
            };
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().filter(|n| is_valid_network_name(n)).map(str::to_owned) else {
                let detail = "not a usable network name (not UTF-8 or holds control characters)";
                anomalies.push(Anomaly::new(store, None, &path, AnomalyKind::UnparsableName, detail));
                continue;
            };
            match entry.file_type() {
                Ok(t) if t.is_dir() => {
                    // Only to choose one thread or two: never a check.
                    dir_bytes = dir_bytes.saturating_add(entry.metadata().map_or(0, |m| m.len()));
                    networks.push(name);
                }
                Ok(t) if t.is_symlink() => {
                    let detail = "a symlink where a network directory was expected; never followed";
                    anomalies.push(Anomaly::new(store, None, &path, AnomalyKind::Symlink, detail));
                }
                Ok(_) => {
                    let detail = "a file where a network directory was expected";
                    anomalies.push(Anomaly::new(store, None, &path, AnomalyKind::NotADirectory, detail));
                }
                Err(e) => anomalies.push(Anomaly::new(store, None, &path, AnomalyKind::Unreadable, e.to_string())),
            }
        }
        Some((networks, dir_bytes))
    }

    /// Lists one network directory (`network` already validated) through
    /// the descriptor it is opened with: the names that are reservation
    /// files are kept with their IP (host-local names them canonically, so
    /// the IP renders back to the same name); anything else that is not the
    /// plugin's own is an anomaly.
    fn list_network(&self, store: &StoreRef, network: &str) -> (Option<Network>, Vec<Anomaly>) {
        let mut anomalies = Vec::new();
        let net_path = self.data_dir.join(network);
        let anomaly = |path: &Path, kind, detail: String| Anomaly::new(store, Some(network), path, kind, detail);
        let dir = match Dir::open(&net_path) {
            Ok(dir) => dir,
            Err(e) => {
                anomalies.push(anomaly(&net_path, AnomalyKind::Unreadable, e.to_string()));
                return (None, anomalies);
            }
        };
        let mut names = Vec::new();
        let mut files = Vec::new();
        let listed = dir.for_each_name(|c_name| {
            let bytes = c_name.to_bytes();
            let Ok(name) = std::str::from_utf8(bytes) else {
                let path = net_path.join(OsStr::from_bytes(bytes));
                anomalies.push(anomaly(&path, AnomalyKind::UnparsableName, "name is not UTF-8".into()));
                return;
            };
            match classify_name(name) {
                EntryName::Lock | EntryName::LastReserved => {}
                EntryName::Ip(ip) => {
                    files.push((ip, names.len()));
                    names.extend_from_slice(c_name.to_bytes_with_nul());
                }
                EntryName::NonCanonicalIp(ip) => {
                    let detail = format!("{name:?} parses as an IP, but host-local would name it {ip}");
                    anomalies.push(anomaly(&net_path.join(name), AnomalyKind::NonCanonicalName, detail));
                }
                EntryName::NotIp => {
                    let detail = format!("{name:?} is not an IP address");
                    anomalies.push(anomaly(&net_path.join(name), AnomalyKind::UnparsableName, detail));
                }
            }
        });
        if let Err(e) = listed {
            anomalies.push(anomaly(&net_path, AnomalyKind::Unreadable, e.to_string()));
        }
        // In IP order: the order the result is sorted in.
        files.sort_unstable_by_key(|&(ip, _)| ip);
        let mut prefix = net_path.into_os_string().into_vec();
        prefix.push(b'/');
        (Some(Network { name: SharedStr::from(network), dir, prefix, names, files }), anomalies)
    }
}

/// One network directory of a scan: opened, listed, its reservation files
/// not yet read.
struct Network {
    name: SharedStr,
    dir: Dir,
    /// `<data_dir>/<network>/`, what each of its reservations' paths starts
    /// with.
    prefix: Vec<u8>,
    /// The reservation files' names, each NUL-terminated, one after the
    /// other: read back as they were listed, not rendered again per file.
    names: Vec<u8>,
    /// Each reservation file's IP and where its name starts in `names`, in
    /// IP order.
    files: Vec<(IpAddr, usize)>,
}

impl Network {
    /// Reads the reservation files `files` name (a slice of `self.files`),
    /// one at a time into one reused buffer; only each file's compact
    /// [`Reservation`] is kept.
    fn read(&self, store: &Arc<StoreRef>, files: &[(IpAddr, usize)], names: &mut Interner) -> StoreScan {
        let mut out = StoreScan { reservations: Vec::with_capacity(files.len()), anomalies: Vec::new() };
        let mut scratch = Vec::with_capacity(usize::try_from(MAX_RESERVATION_BYTES).unwrap_or(1024) + 1);
        let mut last_ifname: Option<SharedStr> = None;
        for &(ip, at) in files {
            let Some(Ok(c_name)) = self.names.get(at..).map(CStr::from_bytes_until_nul) else { continue };
            // Kept for as long as the reservation is: allocated at its size
            // (`<data_dir>/<network>/` then the name, as `Path::join` makes it).
            let path = || {
                let name = c_name.to_bytes();
                let mut path = Vec::with_capacity(self.prefix.len() + name.len());
                path.extend_from_slice(&self.prefix);
                path.extend_from_slice(name);
                PathBuf::from(OsString::from_vec(path))
            };
            match read_owner_into_c(&self.dir, c_name, &mut scratch) {
                Ok(Some(((id, ifname), meta))) => {
                    // A network's files mostly name one interface: the last
                    // one is tried before the interner.
                    let ifname = ifname.map(|i| match &last_ifname {
                        Some(last) if last.as_str() == i => last.clone(),
                        _ => last_ifname.insert(names.intern(i)).clone(),
                    });
                    out.reservations.push(Reservation::from(ReservationData {
                        store: Arc::clone(store),
                        network: self.name.clone(),
                        ip,
                        container_id: names.intern(id),
                        ifname,
                        created_at: meta.modified(),
                        path: path(),
                        inode: meta.ino(),
                    }));
                }
                // Released by the plugin between listing and reading.
                Ok(None) => {}
                Err((kind, detail)) => {
                    out.anomalies.push(Anomaly::new(store, Some(&self.name), &path(), kind, detail));
                }
            }
        }
        out
    }
}

/// Runs `work` for every index in `0..n`, on this thread and, when
/// `parallel`, on one helper thread: this thread takes indices from the
/// front, the helper from the back, until they meet. So neither waits for
/// the other (one held up by the node leaves the rest to the other), and
/// each mostly reads its own networks. The results come in index order,
/// each with whether the helper made it (and so with the helper's state).
/// A helper that cannot start or that panics leaves its indices to this
/// thread: a scan is never cut short.
fn two_ended<S, T: Send>(
    n: usize,
    parallel: bool,
    state: &mut S,
    helper_state: impl FnOnce() -> S + Send,
    work: impl Fn(usize, &mut S) -> T + Sync,
) -> Vec<(T, bool)> {
    let left = Mutex::new(0..n);
    let take = |front: bool| {
        let mut left = left.lock().unwrap_or_else(PoisonError::into_inner);
        if front { left.next() } else { left.next_back() }
    };
    let mut slots: Vec<Option<(T, bool)>> = std::iter::repeat_with(|| None).take(n).collect();
    std::thread::scope(|s| {
        let helper = parallel.then(|| {
            std::thread::Builder::new().name("netreap-scan".into()).spawn_scoped(s, || {
                let mut state = helper_state();
                let mut done = Vec::new();
                while let Some(i) = take(false) {
                    done.push((i, work(i, &mut state)));
                }
                done
            })
        });
        while let Some(i) = take(true) {
            if let Some(slot) = slots.get_mut(i) {
                *slot = Some((work(i, state), false));
            }
        }
        if let Some(Ok(helper)) = helper
            && let Ok(done) = helper.join()
        {
            for (i, t) in done {
                if let Some(slot) = slots.get_mut(i) {
                    *slot = Some((t, true));
                }
            }
        }
    });
    slots.into_iter().enumerate().map(|(i, slot)| slot.unwrap_or_else(|| (work(i, state), false))).collect()
}

/// Most threads a scan uses: the agent shares the node with its pods.
const SCAN_THREADS: usize = 2;
/// Below this many files a second thread costs more than it saves.
const PARALLEL_SCAN_MIN_FILES: usize = 1024;
/// Files per share of the reading: small enough that the two threads end
/// together, large enough that taking a share costs nothing.
const SCAN_CHUNK: usize = 1024;
/// Directory bytes (as `st_size` gives them: ext4 and xfs count blocks,
/// tmpfs about 20 per entry) from which networks are listed on two threads.
const PARALLEL_LIST_MIN_BYTES: u64 = 64 * 1024;

fn scan_threads() -> usize {
    crate::cpus::available().min(SCAN_THREADS)
}

impl ReservationStore for HostLocalStore {
    fn store_ref(&self) -> StoreRef {
        StoreRef::HostLocal { data_dir: self.data_dir.clone() }
    }

    fn scan(&self) -> StoreScan {
        let store = Arc::new(self.store_ref());
        let mut out = StoreScan::default();
        let Some((mut networks, dir_bytes)) = self.network_names(&store, &mut out.anomalies) else {
            return out;
        };
        // By name, then IP: the order the result is sorted in, which makes
        // that sort a no-op.
        networks.sort_unstable();
        let threads = scan_threads();
        let list_parallel = threads >= 2 && networks.len() >= 2 && dir_bytes >= PARALLEL_LIST_MIN_BYTES;
        let listed = two_ended(
            networks.len(),
            list_parallel,
            &mut (),
            || (),
            |i, ()| networks.get(i).map_or((None, Vec::new()), |name| self.list_network(&store, name)),
        );
        let mut opened = Vec::with_capacity(listed.len());
        for ((network, anomalies), _) in listed {
            out.anomalies.extend(anomalies);
            opened.extend(network);
        }
        drop(networks);

        // The reading in shares of at most SCAN_CHUNK files of one network.
        let shares: Vec<(usize, Range<usize>)> = opened
            .iter()
            .enumerate()
            .flat_map(|(net, n)| {
                (0..n.files.len()).step_by(SCAN_CHUNK).map(move |at| (net, at..(at + SCAN_CHUNK).min(n.files.len())))
            })
            .collect();
        let files: usize = opened.iter().map(|n| n.files.len()).sum();
        let read_parallel = threads >= 2 && files >= PARALLEL_SCAN_MIN_FILES;
        let mut names = Interner::new();
        let dirs: Vec<BorrowedFd<'_>> = opened.iter().map(|n| n.dir.as_fd()).collect();
        let helper_state = || {
            // The helper opens and closes files under these directories
            // only and hands out no descriptor, so it can do so in a table
            // of its own: no lock shared with this thread per open and close.
            if let Err(e) = safefs::private_descriptor_table(&dirs) {
                tracing::debug!("the scan's helper shares the descriptor table: {e}");
            }
            Interner::new()
        };
        let read = two_ended(shares.len(), read_parallel, &mut names, helper_state, |i, names| {
            let Some((network, files)) = shares.get(i).and_then(|(net, range)| {
                let network = opened.get(*net)?;
                Some((network, network.files.get(range.clone())?))
            }) else {
                return StoreScan::default();
            };
            network.read(&store, files, names)
        });
        out.reservations.reserve(files);
        for (share, by_helper) in read {
            // Container IDs the helper interned are made to share this
            // thread's allocation.
            out.reservations.extend(share.reservations.into_iter().map(|mut r| {
                if by_helper
                    && let Some(same) = names.get(&r.container_id)
                    && !SharedStr::ptr_eq(&same, &r.container_id)
                {
                    r.container_id = same;
                }
                r
            }));
            out.anomalies.extend(share.anomalies);
        }
        // Sorted already (networks by name, each read in IP order): a
        // check, not a sort (which allocates its scratch first).
        let order = |a: &Reservation, b: &Reservation| (&a.network, a.ip).cmp(&(&b.network, b.ip));
        if !out.reservations.is_sorted_by(|a, b| order(a, b).is_le()) {
            out.reservations.sort_by(order);
        }
        out.anomalies.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, fs, os::unix::fs::symlink};

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

    /// The owner parsing as it was written first (`split_once`, `chars`):
    /// the byte-wise one must agree with it on any content.
    fn parse_owner_reference(content: &[u8]) -> Result<(&str, Option<&str>), AnomalyKind> {
        let text = std::str::from_utf8(content).map_err(|_| AnomalyKind::BinaryContent)?;
        if !text.chars().all(|c| !c.is_control() || c == '\r' || c == '\n' || c == '\t') {
            return Err(AnomalyKind::BinaryContent);
        }
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(AnomalyKind::EmptyContent);
        }
        let (id, ifname) = match trimmed.split_once(LINE_BREAK) {
            Some((id, ifname)) => (id, Some(ifname)),
            None => (trimmed, None),
        };
        let token_ok = |s: &str| !s.is_empty() && !s.chars().any(char::is_whitespace);
        if !token_ok(id) || ifname.is_some_and(|i| !token_ok(i)) {
            return Err(AnomalyKind::MalformedContent);
        }
        Ok((id, ifname))
    }

    proptest::proptest! {
        /// Names of digits and dots (leading zeros, empty, long and
        /// out-of-range octets among them): an IPv4 name counts as the
        /// plugin's exactly when it prints back as itself.
        #[test]
        fn an_ipv4_name_is_the_plugins_exactly_when_it_renders_back(name in proptest::prop_oneof![
            "[0-9.+-]{0,4}(\\.[0-9]{0,4}){0,4}",
            "(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2}|0[0-9]{1,3})(\\.(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2}|0[0-9]{1,3})){3}",
        ]) {
            let rendered = name.parse::<std::net::Ipv4Addr>().map(|ip| ip.to_string() == name);
            let expected = match rendered {
                Ok(true) => EntryName::Ip(name.parse().unwrap()),
                Ok(false) => EntryName::NonCanonicalIp(name.parse().unwrap()),
                Err(_) => EntryName::NotIp,
            };
            proptest::prop_assert_eq!(classify_name(&name), expected);
        }

        #[test]
        fn owner_parsing_agrees_with_the_reference(parts in proptest::collection::vec(0_usize..16, 0..24)) {
            const PIECES: [&[u8]; 16] = [
                b"abc", b"0f", b"\r\n", b"\r", b"\n", b" ", b"\t", b"\x0b", b"\x0c", b"\0", b"\x7f",
                "\u{85}".as_bytes(), "\u{a0}".as_bytes(), "\u{2003}".as_bytes(), "\u{e9}".as_bytes(), b"\xff",
            ];
            let content: Vec<u8> = parts.iter().flat_map(|&p| PIECES[p].iter().copied()).collect();
            let got = parse_owner_parts(&content).map_err(|(kind, _)| kind);
            proptest::prop_assert_eq!(got, parse_owner_reference(&content));
        }
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
            // Every container in both networks (so in both threads' shares).
            fs::write(net.join(&ip), format!("c{}\r\neth0", i % 49)).unwrap();
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
        // Each container ID is the file's and one allocation, whichever
        // thread read it.
        let mut one_each: HashMap<String, SharedStr> = HashMap::new();
        for r in &scan.reservations {
            assert_eq!(r.path, tmp.path().join(r.network.as_str()).join(r.ip.to_string()));
            assert_eq!(r.owner().ifname.as_deref(), Some("eth0"));
            let IpAddr::V4(ip) = r.ip else { panic!("{}", r.ip) };
            assert_eq!(r.container_id, format!("c{}", (u32::from(ip) & 0xff_ffff) % 49));
            let first = one_each.entry(r.container_id.to_string()).or_insert_with(|| r.container_id.clone());
            assert!(SharedStr::ptr_eq(first, &r.container_id), "{} is two allocations", r.container_id);
        }
        assert_eq!(one_each.len(), 49);
        let last = &scan.reservations[n - 1];
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
    fn a_name_that_is_not_utf8_is_reported_by_its_bytes() {
        use std::os::unix::ffi::OsStrExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let net = tmp.path().join("net1");
        fs::create_dir(&net).unwrap();
        fs::write(net.join("10.0.0.2"), "c1\r\neth0").unwrap();
        fs::write(net.join(OsStr::from_bytes(b"10.0.0.\xff")), "c2\r\neth0").unwrap();
        let scan = HostLocalStore::new(tmp.path()).scan();
        assert_eq!(scan.reservations.len(), 1);
        assert_eq!(scan.anomalies.len(), 1);
        assert_eq!(scan.anomalies[0].kind, AnomalyKind::UnparsableName);
        assert_eq!(scan.anomalies[0].path, net.join(OsStr::from_bytes(b"10.0.0.\xff")).to_string_lossy());
    }

    #[test]
    fn two_ended_work_is_done_once_in_order_even_when_the_helper_fails() {
        let on_helper = || std::thread::current().name() == Some("netreap-scan");
        for parallel in [false, true] {
            let got = two_ended(
                100,
                parallel,
                &mut 0_u32,
                || 0_u32,
                |i, calls| {
                    *calls += 1;
                    i * 2
                },
            );
            assert_eq!(got.iter().map(|(t, _)| *t).collect::<Vec<_>>(), (0..100).map(|i| i * 2).collect::<Vec<_>>());
            if !parallel {
                assert!(got.iter().all(|(_, by_helper)| !by_helper));
            }
        }
        // A helper that panics on its first index: everything still done,
        // by this thread.
        let got = two_ended(
            50,
            true,
            &mut (),
            || (),
            |i, ()| {
                assert!(!on_helper(), "the helper fails");
                i
            },
        );
        assert_eq!(got.iter().map(|(t, _)| *t).collect::<Vec<_>>(), (0..50).collect::<Vec<_>>());
        assert!(got.iter().all(|(_, by_helper)| !by_helper));
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
