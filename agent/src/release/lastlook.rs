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
    collections::{HashMap, HashSet},
    fs,
    net::IpAddr,
    os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{
    discovery::{DiscoveryPaths, MountReader, mount_candidates, open_any},
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
    ips: HashMap<IpAddr, Vec<String>>,
    /// CNI_CONTAINERID of running plugin processes -> pid.
    running: HashMap<String, u32>,
    /// Containers the ledger has a CNI run in flight for.
    ledger_in_flight: HashSet<String>,
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
        Self { ips: HashMap::from([(ip, vec![place])]), ..Self::default() }
    }

    /// What keeps `r`, if anything.
    #[must_use]
    pub fn keeps(&self, r: &Reservation) -> Option<LookFound> {
        if let Some(places) = self.ips.get(&r.ip) {
            return Some(LookFound::IpConfigured { netns: places.clone() });
        }
        if let Some(&pid) = self.running.get(r.container_id.as_str()) {
            return Some(LookFound::CniRunInFlight { pid: Some(pid) });
        }
        if self.ledger_in_flight.contains(r.container_id.as_str()) {
            return Some(LookFound::CniRunInFlight { pid: None });
        }
        None
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
        }
    }

    /// Also asks about every netns bind-mounted in this mount table that
    /// the model does not know.
    #[must_use]
    pub fn with_mount_table(mut self, paths: DiscoveryPaths) -> Self {
        self.mounts = Some(paths);
        self
    }

    fn gather(&self) -> Result<Sighting, String> {
        let mut q = Querier::open().map_err(|e| e.to_string())?;
        let mut ips: HashMap<IpAddr, Vec<String>> = HashMap::new();
        let mut add = |list: Vec<IpAddr>, place: String| {
            for ip in list {
                ips.entry(ip).or_default().push(place.clone());
            }
        };
        // netreap's own netns (the host's, with hostNetwork).
        let own = q.addresses(None).map_err(|e| e.to_string())?.ok_or("own address dump refused")?;
        add(own, "the host netns".into());
        let mut seen_nsids: HashSet<i32> = HashSet::new();
        // The model's netns, and any the kernel lists that it does not know
        // (known only by nsid, e.g. not openable from here).
        let listed = q.nsids().unwrap_or_default();
        let mut nsids = self.known_nsids.clone();
        nsids.extend(listed.into_iter().filter(|n| !self.known_nsids.contains(n)));
        for nsid in nsids {
            // A refused dump: the nsid is gone, so is its netns.
            if let Some(list) = q.addresses(Some(nsid)).map_err(|e| e.to_string())? {
                add(list, format!("netns nsid {nsid}"));
            }
            seen_nsids.insert(nsid);
        }
        let mut looked: HashSet<u64> = HashSet::new();
        // Bind-mounted netns the model does not know yet. A table that
        // cannot be read keeps the reservation (the look is unavailable).
        if let Some(paths) = &self.mounts {
            let mut reader = MountReader::new(Arc::default());
            let mounts = reader.mounts(paths, true).map_err(|e| e.to_string())?;
            for (&inode, sighting) in mounts {
                if self.known_inodes.contains(&u64::from(inode)) || !looked.insert(u64::from(inode)) {
                    continue;
                }
                let Some((fd, path)) = open_any(inode, &mount_candidates(paths, &sighting.bind_mounts)) else {
                    continue; // unmounted meanwhile: gone, or found by nsid above
                };
                // A netns we hold open but cannot ask about: keep (unavailable).
                let nsid = q
                    .nsid_of(fd.as_raw_fd(), true)
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("no nsid for the netns mounted at {}", path.display()))?;
                if seen_nsids.insert(nsid)
                    && let Some(list) = q.addresses(Some(nsid)).map_err(|e| e.to_string())?
                {
                    add(list, format!("netns net:[{inode}] nsid {nsid} mounted at {}", path.display()));
                }
            }
        }
        // Netns of processes the model does not know yet.
        let mut running = HashMap::new();
        for (pid, inode, exe) in processes(&self.proc_root) {
            if !self.known_inodes.contains(&inode) && looked.insert(inode) {
                let path = self.proc_root.join(pid.to_string()).join("ns/net");
                if let Ok(fd) = fs::File::open(&path)
                    && let Ok(Some(nsid)) = q.nsid_of(fd.as_raw_fd(), true)
                    && seen_nsids.insert(nsid)
                    && let Ok(Some(list)) = q.addresses(Some(nsid))
                {
                    add(list, format!("netns net:[{inode}] nsid {nsid} of pid {pid}"));
                }
            }
            if exe.as_deref().is_some_and(|e| self.cni_bin_dirs.iter().any(|d| e.starts_with(d)))
                && let Some(cid) = container_id_of(&self.proc_root, pid)
            {
                running.insert(cid, pid);
            }
        }
        Ok(Sighting { ips, running, ledger_in_flight: self.ledger_in_flight.clone() })
    }
}

/// (pid, netns inode, exe) of every process.
fn processes(proc_root: &Path) -> Vec<(u32, u64, Option<PathBuf>)> {
    let Ok(entries) = fs::read_dir(proc_root) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let dir = proc_root.join(pid.to_string());
            let inode = fs::metadata(dir.join("ns/net")).ok()?.ino();
            Some((pid, inode, fs::read_link(dir.join("exe")).ok()))
        })
        .collect()
}

/// `CNI_CONTAINERID` from a process's environment.
fn container_id_of(proc_root: &Path, pid: u32) -> Option<String> {
    let env = fs::read(proc_root.join(pid.to_string()).join("environ")).ok()?;
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"CNI_CONTAINERID="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
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
