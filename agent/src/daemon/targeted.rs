//! The death path: when netns die, only the reservations the deaths concern
//! are judged, on the same observations a full reconcile would use, and the
//! orphans go to the releaser at once. No whole-store scan: the candidates
//! come from what the last full pass found ([`Known`]), and only their files
//! are read again. A reservation this path does not find (made since the last
//! full pass, or tied to the netns by evidence it does not look at) is left
//! to the full reconcile that follows every targeted pass: that is the only
//! consequence of missing one.
//!
//! Why a targeted verdict equals the full one: both come from
//! `engine::decide` on the same `Observations`, and `decide` judges each
//! reservation on its own (the index it builds is shared, never changed by a
//! verdict). What differs is only which reservations are judged
//! (`tests::a_targeted_verdict_is_the_full_verdict`).

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::{Path, PathBuf},
    time::SystemTime,
};

use super::evidence;
use crate::{
    engine::{CniOp, DeadNetns, NetnsId, NetnsName, observations::same_netns_path},
    ipam::{
        Reservation, SharedStr,
        hostlocal::{ReadOwner, read_owner},
        safefs::Dir,
    },
    model::snapshot::NetnsDeath,
};

/// Above this many candidate files, they are read on the blocking pool (and
/// above this many reservations, a death's scan of the stores).
pub const INLINE_REREAD_LIMIT: usize = 32;

/// The host-local reservations the last full pass found, by container ID and
/// by IP: where the death path looks for the reservations a death concerns.
#[derive(Debug, Default)]
pub struct Known {
    by_container: HashMap<SharedStr, Vec<Reservation>>,
    by_ip: HashMap<IpAddr, Vec<Reservation>>,
    /// When the full pass that found them started (its scan began later):
    /// a CNI run that started before it cannot have written a file the
    /// scan missed.
    pub scanned_since: Option<SystemTime>,
    len: usize,
}

impl Known {
    /// What a full pass that started at `started` found.
    #[must_use]
    pub fn new(reservations: &[Reservation], started: SystemTime) -> Self {
        let mut known = Self { scanned_since: Some(started), len: reservations.len(), ..Self::default() };
        for r in reservations {
            known.by_container.entry(r.container_id.clone()).or_default().push(r.clone());
            known.by_ip.entry(r.ip).or_default().push(r.clone());
        }
        known
    }

    /// How many reservations the pass found.
    #[must_use]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn of_container(&self, cid: &str) -> &[Reservation] {
        self.by_container.get(cid).map_or(&[], Vec::as_slice)
    }

    fn of_ip(&self, ip: IpAddr) -> &[Reservation] {
        self.by_ip.get(&ip).map_or(&[], Vec::as_slice)
    }
}

/// What identifies one netns death for the search.
#[derive(Debug, Clone)]
pub struct DeathKey {
    pub id: NetnsId,
    pub paths: Vec<PathBuf>,
    pub addresses: Vec<IpAddr>,
}

impl From<&NetnsDeath> for DeathKey {
    fn from(d: &NetnsDeath) -> Self {
        Self { id: d.id(), paths: d.bind_mounts.clone(), addresses: d.addresses.iter().map(|a| a.ip).collect() }
    }
}

impl DeathKey {
    /// Whether a binding's netns may be this one (generous: a false match
    /// only adds a candidate).
    pub(super) fn may_name(&self, netns: &NetnsName) -> bool {
        match netns {
            NetnsName::Id(id) => id.may_be(&self.id),
            NetnsName::Path(p) => self.paths.iter().any(|m| same_netns_path(p, m)),
        }
    }

    pub(super) fn is(&self, id: &NetnsId, paths: &[PathBuf]) -> bool {
        *id == self.id || id.may_be(&self.id) || paths.iter().any(|p| self.paths.iter().any(|m| same_netns_path(p, m)))
    }
}

/// The containers and IPs a death can change a verdict of: containers bound
/// to the dead netns (the model's containers of it, and every binding that
/// may name it) and the addresses it held. The reference
/// [`concerned_in_sources`] must equal.
#[cfg(test)]
#[must_use]
pub fn concerned_keys(obs: &crate::engine::Observations, deaths: &[DeathKey]) -> (HashSet<String>, HashSet<IpAddr>) {
    let mut containers = HashSet::new();
    let mut ips: HashSet<IpAddr> = deaths.iter().flat_map(|d| d.addresses.iter().copied()).collect();
    for dead in obs.dead.iter().filter(|n| deaths.iter().any(|d| d.is(&n.id, &n.paths))) {
        containers.extend(dead.container_ids.iter().cloned());
        ips.extend(dead.addresses.iter().copied());
    }
    for b in obs.bindings.iter().filter(|b| deaths.iter().any(|d| d.may_name(&b.netns))) {
        containers.insert(b.container_id.clone());
    }
    (containers, ips)
}

/// What [`concerned_keys`] finds in the whole node's observations, found in
/// their sources (`extra_dead`: the dead netns the agent adds to them)
/// without building those (the agent asks [`concerned`] on its pass's index).
#[cfg(test)]
#[must_use]
pub fn concerned_in_sources(
    snapshot: &crate::model::snapshot::ModelSnapshot,
    ledger: &crate::ledger::Ledger,
    cache: &[std::sync::Arc<crate::ipam::cnicache::CachedAttachment>],
    extra_dead: &[DeadNetns],
    deaths: &[DeathKey],
) -> (HashSet<String>, HashSet<IpAddr>) {
    concerned(&evidence::PassIndex::new(snapshot, ledger, cache), extra_dead, deaths)
}

/// [`concerned_in_sources`] on a pass's index (shared with the
/// observations the pass builds next).
#[must_use]
pub(crate) fn concerned(
    index: &evidence::PassIndex<'_>,
    extra_dead: &[DeadNetns],
    deaths: &[DeathKey],
) -> (HashSet<String>, HashSet<IpAddr>) {
    let (containers, mut ips) = index.death_concern(extra_dead, deaths);
    ips.extend(deaths.iter().flat_map(|d| d.addresses.iter().copied()));
    (containers, ips)
}

/// The known reservations of those containers and IPs, with every other
/// known reservation of their containers (a release batch reads which IPs an
/// attachment still holds from the verdicts it is given), once each, in the
/// order of their files.
#[must_use]
pub fn candidates(known: &Known, containers: &HashSet<String>, ips: &HashSet<IpAddr>) -> Vec<Reservation> {
    let direct =
        containers.iter().flat_map(|c| known.of_container(c)).chain(ips.iter().flat_map(|ip| known.of_ip(*ip)));
    let owners: HashSet<&str> = direct.map(|r| r.container_id.as_str()).collect();
    let mut out: Vec<Reservation> = owners.into_iter().flat_map(|c| known.of_container(c)).cloned().collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out.dedup_by(|a, b| a.path == b.path);
    out
}

/// Reads each candidate's file again: its owner, mtime and inode now. A file
/// that is gone or is no longer a reservation is left out (the full pass
/// reports what it became).
#[must_use]
pub fn reread(candidates: &[Reservation]) -> Vec<Reservation> {
    let mut dirs: HashMap<&Path, Option<Dir>> = HashMap::new();
    let mut out = Vec::with_capacity(candidates.len());
    for old in candidates {
        let (Some(parent), Some(name)) = (old.path.parent(), old.path.file_name().and_then(|n| n.to_str())) else {
            continue;
        };
        let Some(dir) = dirs.entry(parent).or_insert_with(|| Dir::open(parent).ok()) else { continue };
        if let ReadOwner::Owner(owner, meta) = read_owner(dir, name) {
            out.push(refreshed(old, &owner.container_id, owner.ifname.as_deref(), &meta));
        }
    }
    out
}

/// `old` as its file is now.
fn refreshed(
    old: &Reservation,
    container_id: &str,
    ifname: Option<&str>,
    meta: &crate::ipam::safefs::FileMeta,
) -> Reservation {
    let mut r = old.clone();
    if r.container_id.as_str() != container_id {
        r.container_id = container_id.into();
    }
    if r.ifname.as_deref() != ifname {
        r.ifname = ifname.map(SharedStr::from);
    }
    let created_at = meta.modified();
    if r.created_at != created_at || r.inode != meta.ino() {
        r.created_at = created_at;
        r.inode = meta.ino();
    }
    r
}

/// Kernel and wall clock may disagree by this much: a run this close to the
/// full pass counts as after it.
const SCAN_SLACK: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the last full pass may have missed a reservation of one of these
/// containers: a CNI run of it (or of a container the kernel could not name)
/// that may reserve (an ADD, or a command not known to be another) was in
/// flight at or after the moment that pass began (host-local writes during
/// the run). A release batch reads which IPs an attachment still holds
/// from its verdicts, so the batch needs the whole store. A pod's DEL, which runs just before its netns goes, writes
/// no reservation: it does not send its death to a full pass. `runs`: the
/// observations' runs ([`crate::engine::Observations::cni_ops`], or
/// [`evidence::cni_ops_in`] alone).
#[must_use]
pub fn may_have_missed(runs: &[CniOp], known: &Known, containers: &[&str]) -> bool {
    let Some(since) = known.scanned_since else { return true };
    let since = since.checked_sub(SCAN_SLACK).unwrap_or(SystemTime::UNIX_EPOCH);
    runs.iter()
        .filter(|op| op.may_reserve() && op.finished_at.is_none_or(|f| f >= since))
        .any(|op| containers.iter().any(|c| op.may_concern(c)))
}

#[cfg(test)]
mod tests;
