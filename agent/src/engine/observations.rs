//! The engine's inputs: what netreap knows about the node at one instant.
//! The caller maps its live model (netns, addresses), the attachment ledger
//! (CNI runs) and optional runtime/API lists onto these plain types; the
//! engine never looks anywhere else.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::SystemTime,
};

use serde::{Deserialize, Serialize};

use crate::{ipam::SharedStr, timefmt};

pub use crate::identity::NetnsId;
use crate::identity::last_name;

/// A netns that exists now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveNetns {
    pub id: NetnsId,
    /// Container IDs bound to it (CNI runs that named it, cache entries).
    pub container_ids: Vec<String>,
    /// Addresses configured on its interfaces.
    pub addresses: Vec<IpAddr>,
    /// Bind mounts and other paths naming it (e.g. /run/netns/cni-...).
    pub paths: Vec<PathBuf>,
}

/// A netns whose death was observed (`RTM_DELNSID`, `__put_net`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadNetns {
    pub id: NetnsId,
    #[serde(with = "timefmt::rfc3339")]
    pub died_at: SystemTime,
    /// Container IDs that were bound to it.
    pub container_ids: Vec<String>,
    /// Addresses it held before it died.
    pub addresses: Vec<IpAddr>,
    /// Paths that named it.
    pub paths: Vec<PathBuf>,
}

impl Default for DeadNetns {
    fn default() -> Self {
        Self {
            id: NetnsId::default(),
            died_at: SystemTime::UNIX_EPOCH,
            container_ids: Vec::new(),
            addresses: Vec::new(),
            paths: Vec::new(),
        }
    }
}

/// How a binding names its netns.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetnsName {
    /// Resolved when it was seen (stat of `CNI_NETNS` while the netns lived).
    Id(NetnsId),
    /// Only a path (`CNI_NETNS`, the cache's `netns`), matched against the
    /// paths of live and dead netns.
    Path(PathBuf),
}

impl std::fmt::Display for NetnsName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Id(id) => id.fmt(f),
            Self::Path(p) => p.display().fmt(f),
        }
    }
}

/// Where a binding was learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BindingSource {
    /// `CNI_NETNS` of a CNI plugin run (kernel exec record).
    CniExec,
    /// libcni's result cache.
    CniCache,
    /// The container runtime.
    Runtime,
}

impl std::fmt::Display for BindingSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::CniExec => "CNI run",
            Self::CniCache => "CNI cache",
            Self::Runtime => "runtime",
        })
    }
}

/// "Container X was given netns N", seen at some time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    pub container_id: String,
    pub netns: NetnsName,
    pub source: BindingSource,
    #[serde(with = "timefmt::rfc3339")]
    pub seen_at: SystemTime,
}

/// One CNI plugin run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniOp {
    /// `CNI_CONTAINERID`; None when the kernel could not read it, which makes
    /// an in-flight run concern every reservation.
    pub container_id: Option<SharedStr>,
    /// The kernel's buffer cut the container ID: it is a prefix.
    pub container_id_truncated: bool,
    /// ADD, DEL, CHECK, GC...
    pub command: SharedStr,
    /// The plugin binary.
    pub plugin: SharedStr,
    #[serde(with = "timefmt::rfc3339")]
    pub started_at: SystemTime,
    /// None while the run is in flight.
    #[serde(with = "timefmt::rfc3339_opt")]
    pub finished_at: Option<SystemTime>,
    pub exit_code: Option<i32>,
}

impl CniOp {
    #[must_use]
    pub fn in_flight(&self) -> bool {
        self.finished_at.is_none()
    }

    /// Whether this run may have written a reservation: an ADD, or a
    /// command it cannot be sure of. DEL, CHECK, GC, VERSION and STATUS
    /// never allocate an address.
    #[must_use]
    pub fn may_reserve(&self) -> bool {
        !matches!(self.command.as_str(), "DEL" | "CHECK" | "GC" | "VERSION" | "STATUS")
    }

    /// Whether this run may be about `container_id`.
    #[must_use]
    pub fn may_concern(&self, container_id: &str) -> bool {
        match &self.container_id {
            None => true,
            Some(id) if self.container_id_truncated => container_id.starts_with(id.as_str()),
            Some(id) => id == container_id,
        }
    }
}

/// A pod of this node, from the Kubernetes API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiPod {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    /// The pod is Pending: its IPs may not be reported yet (whereabouts
    /// #162, Antrea #8239).
    #[serde(default)]
    pub pending: bool,
    /// Containers whose CNI run named this pod (`K8S_POD_NAMESPACE` and
    /// `K8S_POD_NAME` in `CNI_ARGS`, or the pod reference an IPAM store
    /// wrote during that run). While the pod is Pending, their reservations
    /// are kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cni_containers: Vec<String>,
}

/// Everything the engine may use. Optional sources are `None` when not
/// available; present, they only add reasons to keep.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observations {
    pub live: Vec<LiveNetns>,
    pub dead: Vec<DeadNetns>,
    pub bindings: Vec<Binding>,
    pub cni_ops: Vec<CniOp>,
    /// Sandbox IDs the CRI runtime lists as live.
    pub runtime_sandboxes: Option<Vec<String>>,
    /// The runtime's sandbox list in detail (engine/runtime.rs); set with
    /// `set_runtime`, which keeps `runtime_sandboxes` in step.
    #[serde(default)]
    pub runtime: Option<super::runtime::RuntimeView>,
    pub api_pods: Option<Vec<ApiPod>>,
    /// Since when the kernel probes have recorded every CNI plugin run
    /// without a gap (attach time, or the last ring-buffer loss). A
    /// reservation made after it, whose container's CNI runs were seen,
    /// needs no youth grace: the ledger knows whether its ADD is in flight.
    #[serde(default)]
    pub watching_since: Option<SystemTime>,
    /// Spans in which earlier runs of netreap saw every CNI run (from its
    /// state dir): the same holds for reservations made inside them.
    #[serde(default)]
    pub watched_before: Vec<(SystemTime, SystemTime)>,
}

/// `/var/run` is a symlink to `/run` on every current distribution, and
/// runtimes spell netns paths both ways.
#[must_use]
pub fn same_netns_path(a: &Path, b: &Path) -> bool {
    // The usual pair, spelt alike once a leading `/var/run/` is cut to
    // `/run/`, is the same path with no component parsing (the death
    // path compares every path it looks up). Bytes that differ still may
    // name the same path (`//`, `.`): the components decide.
    fn cut(p: &Path) -> &[u8] {
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str());
        if bytes.starts_with(b"/var/run/") { &bytes[4..] } else { bytes }
    }
    if cut(a) == cut(b) {
        return true;
    }
    // Equal component lists end in the same name (the fold of `/var`
    // never changes the last component): paths of two different names,
    // the usual unequal pair, are told apart without parsing.
    last_name(a) == last_name(b) && same_netns_path_by_components(a, b)
}

fn same_netns_path_by_components(a: &Path, b: &Path) -> bool {
    fn norm(p: &Path) -> &Path {
        p.strip_prefix("/var").ok().filter(|rest| rest.starts_with("run")).unwrap_or(p)
    }
    let (a, b) = (norm(a), norm(b));
    // strip_prefix drops the leading '/', so compare component-wise.
    a.components()
        .filter(|c| !matches!(c, std::path::Component::RootDir))
        .eq(b.components().filter(|c| !matches!(c, std::path::Component::RootDir)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_netns_path_answers_as_the_components_do() {
        use proptest::prelude::*;
        let part = prop::sample::select(vec![
            "/",
            "//",
            ".",
            "..",
            "var",
            "run",
            "x",
            "/var/run/",
            "/run/",
            "/var/run",
            "/run",
        ]);
        let path = prop::collection::vec(part, 0..7).prop_map(|parts| parts.concat());
        proptest!(ProptestConfig::with_cases(5000), |(a in path.clone(), b in path)| {
            // `a` with its `/var` put on or taken off: the pairs the
            // shortcut takes for equal.
            let a_other = a.strip_prefix("/var").map_or_else(|| format!("/var{a}"), str::to_owned);
            for (x, y) in [(&a, &b), (&a, &a), (&a, &a_other)] {
                let (x, y) = (Path::new(x), Path::new(y));
                prop_assert_eq!(same_netns_path(x, y), same_netns_path_by_components(x, y), "{:?} {:?}", x, y);
            }
        });
    }

    #[test]
    fn var_run_and_run_are_the_same_path() {
        assert!(same_netns_path(Path::new("/var/run/netns/cni-1"), Path::new("/run/netns/cni-1")));
        assert!(same_netns_path(Path::new("/run/netns/cni-1"), Path::new("/run/netns/cni-1")));
        assert!(!same_netns_path(Path::new("/run/netns/cni-1"), Path::new("/run/netns/cni-2")));
        assert!(!same_netns_path(Path::new("/var/lib/x"), Path::new("/lib/x")));
    }

    #[test]
    fn truncated_container_ids_match_as_prefixes() {
        let op = |id: Option<&str>, truncated| CniOp {
            container_id: id.map(SharedStr::from),
            container_id_truncated: truncated,
            command: "ADD".into(),
            plugin: "bridge".into(),
            started_at: SystemTime::UNIX_EPOCH,
            finished_at: None,
            exit_code: None,
        };
        assert!(op(Some("abc"), true).may_concern("abcdef"));
        assert!(!op(Some("abc"), false).may_concern("abcdef"));
        assert!(op(None, false).may_concern("anything"));
    }
}
