//! IPAM stores: where reservations live on disk. Each store lists its
//! reservations and reports anything that is not what it should be as an
//! [`Anomaly`], which nothing in netreap ever touches.
//!
//! - [`hostlocal`]: the host-local plugin's data dirs (one file per IP).
//! - [`cnicache`]: libcni's result cache, extra evidence (container ID,
//!   netns path, IPs) for the decision engine, not a store of reservations.

pub mod cnicache;
pub mod hostlocal;
pub(crate) mod safefs;
pub mod shared;

use std::{
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use serde::{Deserialize, Serialize};
pub use shared::SharedStr;

use crate::timefmt;

/// Which store a reservation or anomaly belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StoreRef {
    /// host-local: `<data_dir>/<network>/<ip>`.
    HostLocal { data_dir: PathBuf },
    /// libcni's result cache: `<dir>/<network>-<containerID>-<ifname>`.
    CniCache { dir: PathBuf },
    /// A whereabouts IPPool custom resource (`crate::kube::whereabouts`).
    Whereabouts { namespace: String, pool: String },
}

impl fmt::Display for StoreRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::HostLocal { data_dir } => write!(f, "host-local {}", data_dir.display()),
            Self::CniCache { dir } => write!(f, "cni-cache {}", dir.display()),
            Self::Whereabouts { namespace, pool } => write!(f, "whereabouts IPPool {namespace}/{pool}"),
        }
    }
}

/// Who holds a reservation, as the store records it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Owner {
    pub container_id: String,
    /// None for legacy host-local files, which hold only the container ID.
    pub ifname: Option<String>,
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.ifname {
            Some(ifname) => write!(f, "{}/{ifname}", self.container_id),
            None => write!(f, "{} (legacy, no ifname)", self.container_id),
        }
    }
}

/// One IP reserved in one store for one container. A handle: clones share
/// one [`ReservationData`] (a verdict, an intent and a retry entry all hold
/// the reservation they are about, and a node has one per pod and network).
/// Reads as its fields (`r.ip`); writing a field (tests forging one) copies
/// it first if it is shared.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Reservation(Arc<ReservationData>);

/// What a store records for one reservation. Compact: the store, network,
/// container ID and ifname are shared with every other reservation that
/// names them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationData {
    pub store: Arc<StoreRef>,
    pub network: SharedStr,
    pub ip: IpAddr,
    pub container_id: SharedStr,
    /// None for legacy files (only the container ID).
    pub ifname: Option<SharedStr>,
    /// The file's mtime: host-local writes it once, when it reserves.
    #[serde(with = "timefmt::rfc3339")]
    pub created_at: SystemTime,
    pub path: PathBuf,
    /// Inode of the file when scanned. A release checks inode and mtime are
    /// unchanged, so a file deleted and re-created in between (even for the
    /// same owner) is never removed on the strength of an older decision.
    pub inode: u64,
}

impl From<ReservationData> for Reservation {
    fn from(data: ReservationData) -> Self {
        Self(Arc::new(data))
    }
}

impl std::ops::Deref for Reservation {
    type Target = ReservationData;

    fn deref(&self) -> &ReservationData {
        &self.0
    }
}

impl std::ops::DerefMut for Reservation {
    fn deref_mut(&mut self) -> &mut ReservationData {
        Arc::make_mut(&mut self.0)
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Reservation {
    #[must_use]
    pub fn owner(&self) -> Owner {
        Owner { container_id: self.container_id.to_string(), ifname: self.ifname.as_ref().map(ToString::to_string) }
    }
}

/// What the engine judges of a reservation.
impl crate::engine::Claim for Reservation {
    fn ip(&self) -> IpAddr {
        self.ip
    }

    fn container_id(&self) -> &str {
        &self.container_id
    }

    fn network(&self) -> &str {
        &self.network
    }

    fn reserved_at(&self) -> SystemTime {
        self.created_at
    }
}

/// "net1 10.0.0.2 (c1 of host-local /var/lib/cni/networks)": how verdict
/// summaries name it.
impl fmt::Display for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ({} of {})", self.network, self.ip, self.container_id, self.store)
    }
}

/// What is wrong with an entry that is not a valid reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnomalyKind {
    /// A configured directory does not exist (nothing to scan there).
    MissingDir,
    /// A directory could not be listed or a file could not be read.
    Unreadable,
    /// A symlink where a file or directory was expected; never followed.
    Symlink,
    /// A directory where a reservation file was expected.
    Directory,
    /// A plain file where a network directory was expected.
    NotADirectory,
    /// FIFO, socket or device where a regular file was expected.
    NotRegularFile,
    /// The name is not an IP address (or not valid UTF-8).
    UnparsableName,
    /// An IP address, but not written the way host-local writes it.
    NonCanonicalName,
    /// Larger than any file the store writes.
    Oversized,
    /// Not text: NUL or control bytes, or invalid UTF-8.
    BinaryContent,
    /// The file is empty.
    EmptyContent,
    /// Text, but not `containerID\r\nifname` nor a legacy container ID; or a
    /// cache entry that is not valid libcni JSON.
    MalformedContent,
    /// A cache entry whose file name does not match its content.
    NameMismatch,
}

/// An entry that is not a valid reservation: reported, never touched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anomaly {
    pub store: StoreRef,
    /// The network directory it was found in, when it is inside one.
    pub network: Option<String>,
    /// Lossy text of the path: names may not be UTF-8.
    pub path: String,
    pub kind: AnomalyKind,
    /// What exactly was found, for a person.
    pub detail: String,
}

impl Anomaly {
    pub(crate) fn new(
        store: &StoreRef,
        network: Option<&str>,
        path: &Path,
        kind: AnomalyKind,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            store: store.clone(),
            network: network.map(str::to_owned),
            path: path.to_string_lossy().into_owned(),
            kind,
            detail: detail.into(),
        }
    }
}

/// What one scan of a store found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreScan {
    pub reservations: Vec<Reservation>,
    pub anomalies: Vec<Anomaly>,
}

impl StoreScan {
    pub fn extend(&mut self, other: StoreScan) {
        self.reservations.extend(other.reservations);
        self.anomalies.extend(other.anomalies);
    }
}

/// A store of IP reservations. Scanning never fails as a whole: what cannot
/// be read is an anomaly, and a missing reservation is never a reason to
/// release anything.
pub trait ReservationStore {
    fn store_ref(&self) -> StoreRef;
    fn scan(&self) -> StoreScan;
}

/// Scans every store, in order.
#[must_use]
pub fn scan_all(stores: &[&dyn ReservationStore]) -> StoreScan {
    let mut all = StoreScan::default();
    for store in stores {
        all.extend(store.scan());
    }
    all
}

/// Text a person can read: printable, no control bytes. Shared by the
/// stores to tell text from binary content.
pub(crate) fn is_printable_text(s: &str) -> bool {
    // ASCII (what the stores write) byte by byte: the same test, since the
    // ASCII control characters are exactly U+0000..U+001F and U+007F.
    if s.is_ascii() {
        // A fold without early exit: the compiler checks many bytes at once
        // (a reservation file is short; an exit per byte cost more).
        let control =
            s.bytes().fold(false, |found, b| found | (b.is_ascii_control() && !matches!(b, b'\r' | b'\n' | b'\t')));
        return !control;
    }
    s.chars().all(|c| !c.is_control() || c == '\r' || c == '\n' || c == '\t')
}
