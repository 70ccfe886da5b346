//! whereabouts as a store: `IPPool` custom resources
//! (whereabouts.cni.cncf.io/v1alpha1) hold a cluster's allocations in
//! `spec.allocations`, keyed by the offset of the IP from `spec.range`, each
//! `{id: containerID, podref: "ns/name", ifname}`; with overlapping ranges
//! on, an `OverlappingRangeIPReservation` named after the IP holds it too.
//!
//! A node's netreap considers only allocations whose container ID a CNI run
//! on this node made (its ledger, or its CNI cache): it never touches another
//! node's. The rule for release is the host-local one (the engine decides).
//! The release is one JSON patch that tests `metadata.resourceVersion` and
//! the allocation's `id` before it removes the allocation; a 409 or 422
//! means someone else changed the pool in between: re-read, decide again,
//! never force. The reservation is deleted with a resourceVersion
//! precondition, and only while it names the same container.

use std::{borrow::Cow, collections::BTreeMap, net::IpAddr, path::PathBuf, time::SystemTime};

use k8s_openapi::{NamespaceResourceScope, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::{
    Api, Client, Resource,
    api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions},
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{KubeError, timed};
use crate::{
    engine::{Status, Verdict},
    ipam::{Anomaly, AnomalyKind, Reservation, StoreRef, StoreScan},
    release::{
        Outcome,
        lastlook::{LastLook, LookFound},
    },
};

pub const GROUP: &str = "whereabouts.cni.cncf.io";
pub const VERSION: &str = "v1alpha1";

/// How many times one release re-reads the pool after its patch was refused
/// (409/422) before it gives up for this reconcile.
pub const MAX_ATTEMPTS: usize = 5;

/// One allocation of an IPPool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpAllocation {
    /// The container ID of the CNI run that allocated it.
    #[serde(default)]
    pub id: String,
    /// "namespace/name" of the pod.
    #[serde(default)]
    pub podref: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ifname: Option<String>,
    /// "namespace/name" of an IPAMClaim: the IP outlives its pods on purpose
    /// (persistent IPs), so a netns death is no reason to release it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipamclaimref: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpPoolSpec {
    #[serde(default)]
    pub range: String,
    #[serde(default)]
    pub allocations: BTreeMap<String, IpAllocation>,
}

/// An IPPool custom resource.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IpPool {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: IpPoolSpec,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationSpec {
    #[serde(default)]
    pub containerid: String,
    #[serde(default)]
    pub podref: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ifname: Option<String>,
}

/// An OverlappingRangeIPReservation custom resource.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverlappingReservation {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: ReservationSpec,
}

macro_rules! namespaced_crd {
    ($ty:ty, $kind:literal, $plural:literal) => {
        impl Resource for $ty {
            type DynamicType = ();
            type Scope = NamespaceResourceScope;

            fn kind((): &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group((): &()) -> Cow<'_, str> {
                Cow::Borrowed(GROUP)
            }
            fn version((): &()) -> Cow<'_, str> {
                Cow::Borrowed(VERSION)
            }
            fn plural((): &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

namespaced_crd!(IpPool, "IPPool", "ippools");
namespaced_crd!(OverlappingReservation, "OverlappingRangeIPReservation", "overlappingrangeipreservations");

/// whereabouts' name for a range: `:` and `/` become `-` (IPv6 ranges
/// ending in `:` get a `0`).
#[must_use]
pub fn normalize_range(range: &str) -> String {
    let mut r = range.to_owned();
    if r.ends_with(':') {
        r.push('0');
    }
    r.replace([':', '/'], "-")
}

/// The network name of a pool: pools are named `<range>` or
/// `<network>-<range>`.
#[must_use]
pub fn network_of(pool_name: &str, range: &str) -> Option<String> {
    let normalized = normalize_range(range);
    pool_name.strip_suffix(&normalized)?.strip_suffix('-').map(str::to_owned)
}

/// The name of the OverlappingRangeIPReservation of `ip` in `network`.
#[must_use]
pub fn reservation_name(ip: IpAddr, network: Option<&str>) -> String {
    let mut text = ip.to_string();
    if text.ends_with(':') {
        text.push('0');
    }
    let text = text.replace(':', "-");
    match network {
        Some(n) if !n.is_empty() => format!("{n}-{text}"),
        _ => text,
    }
}

/// The IP at `offset` from the address `range` is written with (whereabouts
/// adds the offset to the parsed address, not to the network's first one).
#[must_use]
pub fn ip_at(range: &str, offset: &str) -> Option<IpAddr> {
    let (base, prefix) = range.split_once('/')?;
    let _: u8 = prefix.parse().ok()?;
    // whereabouts writes offsets with %d of an int64: digits, no sign, no
    // leading zero. Anything else was not written by it.
    let text = offset;
    let offset: u64 = text.parse().ok()?;
    if offset.to_string() != text {
        return None;
    }
    match base.parse::<IpAddr>().ok()? {
        IpAddr::V4(v4) => {
            let sum = u64::from(u32::from(v4)).checked_add(offset)?;
            Some(IpAddr::V4(u32::try_from(sum).ok()?.into()))
        }
        IpAddr::V6(v6) => Some(IpAddr::V6(u128::from(v6).checked_add(u128::from(offset))?.into())),
    }
}

/// Where a whereabouts reservation lives, recovered from its [`Reservation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub namespace: String,
    pub pool: String,
    pub offset: String,
}

/// The path a whereabouts reservation is known by (reports, journal, the
/// daemon's verdict keys): `whereabouts/<namespace>/<pool>/<offset>`.
#[must_use]
pub fn reservation_path(namespace: &str, pool: &str, offset: &str) -> PathBuf {
    PathBuf::from(format!("whereabouts/{namespace}/{pool}/{offset}"))
}

/// The pool and offset of a whereabouts reservation, or why it is not one.
pub fn location(r: &Reservation) -> Result<Location, String> {
    let StoreRef::Whereabouts { namespace, pool } = &r.store else {
        return Err(format!("not a whereabouts reservation ({})", r.store));
    };
    let offset = r
        .path
        .file_name()
        .and_then(|o| o.to_str())
        .filter(|o| !o.is_empty() && o.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| format!("{} names no allocation offset", r.path.display()))?;
    if r.path != reservation_path(namespace, pool, offset) {
        return Err(format!("{} is not where pool {namespace}/{pool} keeps its allocations", r.path.display()));
    }
    Ok(Location { namespace: namespace.clone(), pool: pool.clone(), offset: offset.to_owned() })
}

/// What a scan of the pools found for this node.
#[derive(Debug, Clone, Default)]
pub struct PoolScan {
    pub scan: StoreScan,
    /// Pod references of the allocations this node made: container ID ->
    /// (namespace, name). The whereabouts plugin wrote them from
    /// `K8S_POD_NAMESPACE`/`K8S_POD_NAME` of that container's CNI run.
    pub pods: BTreeMap<String, (String, String)>,
    /// Allocations left alone: made on other nodes (or before this node's
    /// records), or owned by an IPAMClaim.
    pub not_ours: usize,
}

/// Turns pools into this node's reservations. `made_here` answers, for a
/// container ID, when this node's CNI runs first saw it (None: not this
/// node's, never touched); that time stands for the allocation's, which
/// whereabouts does not record.
pub fn scan_pools(pools: &[IpPool], made_here: impl Fn(&str) -> Option<SystemTime>) -> PoolScan {
    let mut out = PoolScan::default();
    for pool in pools {
        let namespace = pool.metadata.namespace.clone().unwrap_or_default();
        let Some(name) = pool.metadata.name.clone() else {
            continue;
        };
        let store = StoreRef::Whereabouts { namespace: namespace.clone(), pool: name.clone() };
        for (offset, alloc) in &pool.spec.allocations {
            let path = reservation_path(&namespace, &name, offset);
            let anomaly = |kind, detail: String| Anomaly::new(&store, Some(&name), &path, kind, detail);
            let Some(created_at) = made_here(&alloc.id) else {
                out.not_ours += 1;
                continue;
            };
            if alloc.ipamclaimref.as_deref().is_some_and(|c| !c.is_empty()) {
                out.not_ours += 1;
                continue;
            }
            let Some(ip) = ip_at(&pool.spec.range, offset) else {
                let detail = format!("offset {offset:?} of range {:?} is not an IP", pool.spec.range);
                out.scan.anomalies.push(anomaly(AnomalyKind::UnparsableName, detail));
                continue;
            };
            if let Some((ns, pod)) = alloc.podref.split_once('/') {
                out.pods.insert(alloc.id.clone(), (ns.to_owned(), pod.to_owned()));
            }
            out.scan.reservations.push(Reservation {
                store: store.clone(),
                network: name.clone(),
                ip,
                container_id: alloc.id.clone(),
                ifname: alloc.ifname.clone().filter(|i| !i.is_empty()),
                created_at,
                path,
                inode: 0,
            });
        }
    }
    out
}

/// Every IPPool of the cluster (404 when the CRD is not installed).
pub async fn list_pools(client: &Client) -> Result<Vec<IpPool>, KubeError> {
    let api: Api<IpPool> = Api::all(client.clone());
    Ok(timed(api.list(&ListParams::default())).await?.items)
}

/// The JSON patch that removes the allocation at `offset`, valid only on
/// the pool's `resource_version` and while the allocation names `id`.
#[must_use]
pub fn removal_patch(resource_version: &str, offset: &str, id: &str) -> serde_json::Value {
    let at = format!("/spec/allocations/{offset}");
    json!([
        { "op": "test", "path": "/metadata/resourceVersion", "value": resource_version },
        { "op": "test", "path": format!("{at}/id"), "value": id },
        { "op": "remove", "path": at },
    ])
}

/// How the allocation a verdict named stands in a freshly read pool.
enum Current {
    /// Same owner: the reservation as it reads now.
    Same(Reservation),
    Gone,
    Changed(String),
}

fn current(pool: &IpPool, loc: &Location, r: &Reservation) -> Current {
    let Some(alloc) = pool.spec.allocations.get(&loc.offset) else {
        return Current::Gone;
    };
    let ifname = alloc.ifname.clone().filter(|i| !i.is_empty());
    if alloc.id != r.container_id || (ifname.is_some() && r.ifname.is_some() && ifname != r.ifname) {
        return Current::Changed(format!("{} {}", alloc.id, alloc.podref));
    }
    if ip_at(&pool.spec.range, &loc.offset) != Some(r.ip) {
        return Current::Changed(format!("range is now {}", pool.spec.range));
    }
    Current::Same(r.clone())
}

/// Releases one whereabouts reservation whose verdict is orphaned: re-read
/// the pool, check the allocation still names the same container, decide
/// again with `reverify`, take the last look at the kernel (`look`: is the
/// IP configured anywhere now, is a CNI run of the container running?),
/// then patch with tests. A refused patch (409/422) starts over from the
/// re-read. Never forces anything.
///
/// The last look and the patch are not under one lock as with host-local;
/// the patch's resourceVersion test stands in for it: whereabouts hands an
/// IP out only by writing the pool, which would fail the test.
pub async fn release(
    client: &Client,
    r: &Reservation,
    dry_run: bool,
    mut reverify: impl FnMut(&Reservation) -> Verdict,
    look: &mut dyn LastLook,
) -> Outcome {
    let loc = match location(r) {
        Ok(loc) => loc,
        Err(reason) => return Outcome::Refused { reason },
    };
    let pools: Api<IpPool> = Api::namespaced(client.clone(), &loc.namespace);
    let mut refused = Vec::new();
    for _ in 0..MAX_ATTEMPTS {
        let pool = match timed(pools.get(&loc.pool)).await {
            Ok(pool) => pool,
            Err(e) if e.status_code() == Some(404) => return Outcome::AlreadyGone,
            Err(e) => {
                return Outcome::Failed { error: format!("reading pool {}/{}: {e}", loc.namespace, loc.pool) };
            }
        };
        let fresh = match current(&pool, &loc, r) {
            Current::Gone => return Outcome::AlreadyGone,
            Current::Changed(found) => return Outcome::OwnerChanged { found },
            Current::Same(fresh) => fresh,
        };
        let verdict = reverify(&fresh);
        if verdict.status != Status::Orphaned {
            return Outcome::Kept { status: verdict.status, reason: verdict.summary };
        }
        if let Err(found) = look.before_unlink(&fresh) {
            return Outcome::LastLookKept {
                ip_configured: matches!(found, LookFound::IpConfigured { .. }),
                found: found.to_string(),
            };
        }
        let Some(rv) = pool.metadata.resource_version.clone() else {
            return Outcome::Failed { error: "pool has no resourceVersion: refusing an untested patch".into() };
        };
        let network = network_of(&loc.pool, &pool.spec.range);
        if dry_run {
            let name = reservation_name(r.ip, network.as_deref());
            return Outcome::WouldRelease {
                cache_entries: Vec::new(),
                cache_notes: vec![format!(
                    "would patch pool {}/{} at resourceVersion {rv} and delete reservation {name} if it names {}",
                    loc.namespace, loc.pool, r.container_id
                )],
            };
        }
        let patch: json_patch::Patch = match serde_json::from_value(removal_patch(&rv, &loc.offset, &r.container_id)) {
            Ok(p) => p,
            Err(e) => {
                return Outcome::Failed { error: format!("building the patch: {e}") };
            }
        };
        match timed(pools.patch(&loc.pool, &PatchParams::default(), &Patch::Json::<()>(patch))).await {
            Ok(patched) => {
                let mut notes = vec![format!(
                    "pool {}/{} patched at resourceVersion {rv} -> {}",
                    loc.namespace,
                    loc.pool,
                    patched.metadata.resource_version.as_deref().unwrap_or("?")
                )];
                notes.extend(refused);
                notes.push(delete_reservation(client, &loc.namespace, r, network.as_deref()).await);
                return Outcome::Released { cache_entries_removed: Vec::new(), cache_notes: notes };
            }
            Err(e) if matches!(e.status_code(), Some(409 | 422)) => {
                // Someone changed the pool since it was read: its test
                // failed. Read again and decide again.
                tracing::info!(pool = %loc.pool, ip = %r.ip, "pool changed under the patch ({e}); re-reading");
                refused
                    .push(format!("patch at resourceVersion {rv} refused ({}): re-read", e.status_code().unwrap_or(0)));
            }
            Err(e) => {
                return Outcome::Failed { error: format!("patching pool {}/{}: {e}", loc.namespace, loc.pool) };
            }
        }
    }
    Outcome::Failed {
        error: format!(
            "pool {}/{} changed under {MAX_ATTEMPTS} patches in a row; next reconcile",
            loc.namespace, loc.pool
        ),
    }
}

/// Deletes the OverlappingRangeIPReservation of a released IP, with a
/// resourceVersion precondition, and only while it names the same
/// container. Returns what happened, for the outcome's notes.
async fn delete_reservation(client: &Client, namespace: &str, r: &Reservation, network: Option<&str>) -> String {
    let api: Api<OverlappingReservation> = Api::namespaced(client.clone(), namespace);
    let name = reservation_name(r.ip, network);
    let orip = match timed(api.get(&name)).await {
        Ok(o) => o,
        Err(e) if e.status_code() == Some(404) => return format!("no reservation {name}"),
        Err(e) => return format!("reservation {name} kept: reading it failed: {e}"),
    };
    if orip.spec.containerid != r.container_id {
        return format!("reservation {name} kept: it names container {:?}", orip.spec.containerid);
    }
    let dp = DeleteParams {
        preconditions: Some(Preconditions { resource_version: orip.metadata.resource_version.clone(), uid: None }),
        ..DeleteParams::default()
    };
    match timed(api.delete(&name, &dp)).await {
        Ok(_) => format!("reservation {name} deleted"),
        Err(e) if e.status_code() == Some(404) => format!("reservation {name} already gone"),
        Err(e) => format!("reservation {name} kept: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_count_from_the_address_the_range_is_written_with() {
        assert_eq!(ip_at("10.0.0.0/24", "5"), Some("10.0.0.5".parse().unwrap()));
        assert_eq!(ip_at("10.0.0.8/24", "1"), Some("10.0.0.9".parse().unwrap()));
        assert_eq!(ip_at("fd00::/64", "16"), Some("fd00::10".parse().unwrap()));
        assert_eq!(ip_at("10.0.0.0/24", "-1"), None);
        assert_eq!(ip_at("10.0.0.0/24", "05"), None, "whereabouts never writes a leading zero");
        assert_eq!(ip_at("10.0.0.0/24", "x"), None);
        assert_eq!(ip_at("255.255.255.255/32", "1"), None);
        assert_eq!(ip_at("10.0.0.0", "1"), None);
    }

    #[test]
    fn names_follow_whereabouts() {
        assert_eq!(normalize_range("10.0.0.0/24"), "10.0.0.0-24");
        assert_eq!(normalize_range("fd00::/64"), "fd00---64");
        assert_eq!(network_of("net-a-10.0.0.0-24", "10.0.0.0/24").as_deref(), Some("net-a"));
        assert_eq!(network_of("10.0.0.0-24", "10.0.0.0/24"), None);
        assert_eq!(reservation_name("10.0.0.5".parse().unwrap(), None), "10.0.0.5");
        assert_eq!(reservation_name("fd00::".parse().unwrap(), Some("n")), "n-fd00--0");
    }

    fn pool(allocs: &[(&str, &str, &str)]) -> IpPool {
        IpPool {
            metadata: ObjectMeta {
                name: Some("10.0.0.0-24".into()),
                namespace: Some("kube-system".into()),
                resource_version: Some("7".into()),
                ..ObjectMeta::default()
            },
            spec: IpPoolSpec {
                range: "10.0.0.0/24".into(),
                allocations: allocs
                    .iter()
                    .map(|(o, id, pod)| {
                        (
                            (*o).to_owned(),
                            IpAllocation {
                                id: (*id).into(),
                                podref: (*pod).into(),
                                ifname: Some("eth0".into()),
                                ipamclaimref: None,
                            },
                        )
                    })
                    .collect(),
            },
        }
    }

    #[test]
    fn only_this_nodes_allocations_become_reservations() {
        let p = pool(&[("2", "mine", "ns/a"), ("3", "theirs", "ns/b"), ("x", "mine2", "ns/c")]);
        let at = SystemTime::UNIX_EPOCH;
        let scan = scan_pools(&[p], |id| id.starts_with("mine").then_some(at));
        assert_eq!(scan.not_ours, 1);
        assert_eq!(scan.scan.reservations.len(), 1);
        let r = &scan.scan.reservations[0];
        assert_eq!((r.ip.to_string().as_str(), r.container_id.as_str()), ("10.0.0.2", "mine"));
        assert_eq!(location(r).unwrap().offset, "2");
        assert_eq!(scan.pods["mine"], ("ns".to_owned(), "a".to_owned()));
        assert_eq!(scan.scan.anomalies.len(), 1, "an offset that is no number is reported");
    }

    #[test]
    fn claimed_allocations_are_never_ours() {
        let mut p = pool(&[("2", "mine", "ns/a")]);
        p.spec.allocations.get_mut("2").unwrap().ipamclaimref = Some("ns/claim".into());
        let scan = scan_pools(&[p], |_| Some(SystemTime::UNIX_EPOCH));
        assert!(scan.scan.reservations.is_empty());
        assert_eq!(scan.not_ours, 1);
    }

    #[test]
    fn the_patch_tests_version_and_owner_before_it_removes() {
        let patch = removal_patch("7", "2", "c1");
        assert_eq!(patch[0], json!({"op": "test", "path": "/metadata/resourceVersion", "value": "7"}));
        assert_eq!(patch[1], json!({"op": "test", "path": "/spec/allocations/2/id", "value": "c1"}));
        assert_eq!(patch[2], json!({"op": "remove", "path": "/spec/allocations/2"}));
        let typed: json_patch::Patch = serde_json::from_value(patch).unwrap();
        assert_eq!(typed.0.len(), 3);
    }

    #[test]
    fn a_report_cannot_point_a_release_elsewhere() {
        let scan = scan_pools(&[pool(&[("2", "c1", "ns/a")])], |_| Some(SystemTime::UNIX_EPOCH));
        let mut r = scan.scan.reservations[0].clone();
        assert!(location(&r).is_ok());
        r.path = PathBuf::from("whereabouts/other/10.0.0.0-24/2");
        assert!(location(&r).is_err());
        r.path = PathBuf::from("/var/lib/cni/networks/x/10.0.0.2");
        assert!(location(&r).is_err());
    }
}
