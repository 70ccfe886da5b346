//! What the model shows the world: a serializable snapshot of every netns
//! (the input of the decision engine, `netreap netns --json` and the state
//! endpoint) and the death notice sent for each netns that dies.

use std::{net::IpAddr, path::PathBuf, sync::Arc, time::SystemTime};

use serde::{Serialize, Serializer};

use super::sealed::SealedViews;
use crate::{discovery::ProcessRef, ipam::SharedStr, kernel::events::NetnsVia, telemetry::clock::rfc3339};

/// Inode number of a netns (`ns.inum`, an unsigned int in the kernel).
pub type NetnsInode = u32;

pub(crate) fn time<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

#[expect(clippy::ref_option, reason = "serde's serialize_with passes &Option")]
pub(crate) fn opt_time<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(&rfc3339(*t)),
        None => s.serialize_none(),
    }
}

/// How the model learned that a netns died.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeathSource {
    /// The kernel removed its nsid while destroying it (`RTM_DELNSID`).
    RtmDelnsid,
    /// fentry `__put_net`: its last reference dropped.
    PutNet,
    /// Its death notice was lost (overrun), and a dump aimed at its nsid
    /// was refused with EINVAL: the kernel no longer has that nsid, which it
    /// removes only when the netns is destroyed. Dated by when it was last
    /// known alive (the true time is between that and when this was noticed).
    NsidGone,
    /// The kernel gave its nsid, or its inode, to another netns: it is gone
    /// (one live netns has one nsid and one inode). Dated by when it was
    /// last known alive.
    Superseded,
    /// Recorded by an earlier run of netreap, and the kernel no longer
    /// lists it (see agent/src/identity.rs): it died while netreap was
    /// down. Dated by when that run last knew it alive.
    WhileDown,
}

/// The task that created a netns, from the probes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Creator {
    /// Process id (tgid).
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    pub comm: String,
    pub cgroup_id: u64,
    pub via: NetnsVia,
    #[serde(serialize_with = "time")]
    pub at: SystemTime,
}

/// `ifa_scope` / `rtm_scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AddrScope {
    Global,
    Site,
    Link,
    Host,
    Nowhere,
    Other(u8),
}

impl AddrScope {
    #[must_use]
    pub fn from_raw(raw: u8) -> Self {
        match raw {
            0 => Self::Global,
            200 => Self::Site,
            253 => Self::Link,
            254 => Self::Host,
            255 => Self::Nowhere,
            other => Self::Other(other),
        }
    }
}

/// A link's hardware address, shared by every view of the link and
/// rendered (`aa:bb:cc:dd:ee:ff`) only when printed: views are rebuilt
/// whenever a link of their netns changes, the text is seldom read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HardwareAddr(Arc<[u8]>);

impl HardwareAddr {
    /// None for an empty address (a link without one).
    #[must_use]
    pub fn new(bytes: &[u8]) -> Option<Self> {
        (!bytes.is_empty()).then(|| Self(bytes.into()))
    }
}

impl std::fmt::Display for HardwareAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ":" };
            write!(f, "{sep}{b:02x}")?;
        }
        Ok(())
    }
}

impl Serialize for HardwareAddr {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct AddressView {
    pub ip: IpAddr,
    pub prefix_len: u8,
    pub ifindex: u32,
    pub ifname: Option<SharedStr>,
    pub scope: AddrScope,
}

impl AddressView {
    /// Could an IPAM have handed it out? (Not loopback, not link-local.)
    #[must_use]
    pub fn is_global(&self) -> bool {
        self.scope == AddrScope::Global
    }
}

/// The netns at the other end of a link (a veth peer's, a lower device's),
/// as the model knows it: enough to find its [`NetnsView`] in the same
/// snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct PeerNetns {
    pub inode: Option<NetnsInode>,
    pub nsid: Option<i32>,
    /// The agent's own netns (the host's, with hostNetwork).
    pub host: bool,
}

/// The other end of a veth, or the lower device of a macvlan/ipvlan/vlan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LinkRef {
    pub ifindex: u32,
    pub ifname: Option<SharedStr>,
    /// `None` while the model has not yet resolved where it lives.
    pub netns: Option<PeerNetns>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InterfaceView {
    pub ifindex: u32,
    pub name: Option<SharedStr>,
    /// `IFLA_INFO_KIND` (veth, bridge, macvlan, ...); none for physical.
    pub kind: Option<SharedStr>,
    pub up: bool,
    pub mac: Option<HardwareAddr>,
    pub master: Option<u32>,
    pub link: Option<LinkRef>,
}

/// One netns as the model knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetnsView {
    pub inode: Option<NetnsInode>,
    /// Its nsid in the agent's netns.
    pub nsid: Option<i32>,
    pub host: bool,
    pub alive: bool,
    #[serde(serialize_with = "time")]
    pub first_seen: SystemTime,
    #[serde(serialize_with = "opt_time")]
    pub died_at: Option<SystemTime>,
    pub death_source: Option<DeathSource>,
    pub creator: Option<Creator>,
    /// nsfs bind mounts (e.g. /run/netns/cni-...) as of the last scan; for
    /// a dead netns, where it was last seen mounted.
    pub bind_mounts: Vec<PathBuf>,
    /// Processes in it, as of the last full scan.
    pub process_count: u32,
    pub processes: Vec<ProcessRef>,
    /// By ifindex. Each is shared by the snapshots taken while it did not
    /// change: the host's view has one per pod, and a pod's birth or death
    /// changes one of them.
    pub interfaces: Vec<Arc<InterfaceView>>,
    pub addresses: Vec<AddressView>,
    /// Host routes (main table, /32 or /128) through an interface whose
    /// peer lives in this netns.
    pub host_routes: Vec<IpAddr>,
}

impl NetnsView {
    pub fn global_addresses(&self) -> impl Iterator<Item = &AddressView> {
        self.addresses.iter().filter(|a| a.is_global())
    }

    /// Seconds since `first_seen` at `at` (a snapshot's `taken_at`: the
    /// snapshot shows it as `age_secs`). Not a field: a view is shared by
    /// every snapshot taken while its netns did not change.
    #[must_use]
    pub fn age_secs(&self, at: SystemTime) -> u64 {
        at.duration_since(self.first_seen).unwrap_or_default().as_secs()
    }

    /// This incarnation's identity.
    #[must_use]
    pub fn id(&self) -> crate::identity::NetnsId {
        crate::identity::NetnsId::new(self.inode.map(u64::from), self.nsid, Some(self.first_seen))
    }

    /// This netns as the other end of a link names it.
    #[must_use]
    pub fn as_peer(&self) -> PeerNetns {
        PeerNetns { inode: self.inode, nsid: self.nsid, host: self.host }
    }
}

/// A route in the agent's netns to a single address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostRouteView {
    pub dst: IpAddr,
    pub prefix_len: u8,
    pub oif: u32,
    pub ifname: Option<SharedStr>,
    pub table: u32,
    pub protocol: u8,
    /// The netns behind `oif` (its veth peer's), when known.
    pub netns: Option<PeerNetns>,
}

/// Drift a resync found and corrected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Corrections {
    /// Live netns no event had announced.
    pub netns_found: u64,
    /// Netns found dead whose death no event had announced.
    pub netns_lost: u64,
    pub links: u64,
    pub addresses: u64,
    pub routes: u64,
}

impl Corrections {
    #[must_use]
    pub fn total(&self) -> u64 {
        self.netns_found + self.netns_lost + self.links + self.addresses + self.routes
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ModelStats {
    /// The first full sync has completed.
    pub ready: bool,
    pub resyncs: u64,
    #[serde(serialize_with = "opt_time")]
    pub last_resync_at: Option<SystemTime>,
    pub corrections: Corrections,
    /// ENOBUFS: notifications lost, each followed by a full resync.
    pub overruns: u64,
    pub deaths: u64,
    /// Death notices the consumer had no room for (the snapshot keeps them).
    pub deaths_dropped: u64,
    pub nsids_assigned: u64,
    pub malformed_messages: u64,
    /// Netns records from the probes (the agent keeps CNI-run records to
    /// its ledger).
    pub kernel_events: u64,
    /// Netns announced by a probe that were gone before they could be
    /// opened.
    pub unresolved_creations: u64,
}

/// The whole model at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSnapshot {
    pub taken_at: SystemTime,
    /// The agent's own netns first, then live ones by first sight, then
    /// recently dead ones by time of death. Shared with the model (and with
    /// earlier snapshots): a snapshot rebuilds only the views of netns that
    /// changed. Each is serialized with its `age_secs` at `taken_at`.
    pub netns: Vec<Arc<NetnsView>>,
    /// Which of `netns` (the dead) are indexed once for every snapshot.
    pub sealed: SealedViews,
    /// Shared with the model until the routes or what they lead into change.
    pub host_routes: Arc<[HostRouteView]>,
    pub stats: ModelStats,
}

/// A view as a snapshot shows it: with its age when the snapshot was taken.
#[derive(Serialize)]
struct AgedView<'a> {
    #[serde(flatten)]
    view: &'a NetnsView,
    age_secs: u64,
}

/// The views of a snapshot taken at `at`, each with its age then.
struct AgedViews<'a> {
    views: &'a [Arc<NetnsView>],
    at: SystemTime,
}

impl Serialize for AgedViews<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.views.iter().map(|v| AgedView { view: v, age_secs: v.age_secs(self.at) }))
    }
}

impl Serialize for ModelSnapshot {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut st = s.serialize_struct("ModelSnapshot", 4)?;
        st.serialize_field("taken_at", &rfc3339(self.taken_at))?;
        st.serialize_field("netns", &AgedViews { views: &self.netns, at: self.taken_at })?;
        st.serialize_field("host_routes", &*self.host_routes)?;
        st.serialize_field("stats", &self.stats)?;
        st.end()
    }
}

impl ModelSnapshot {
    pub fn alive(&self) -> impl Iterator<Item = &NetnsView> {
        self.netns.iter().map(Arc::as_ref).filter(|n| n.alive)
    }

    /// The live netns with this inode.
    #[must_use]
    pub fn live_by_inode(&self, inode: NetnsInode) -> Option<&NetnsView> {
        self.alive().find(|n| n.inode == Some(inode))
    }

    /// Every live netns that holds `ip`.
    pub fn holders_of(&self, ip: IpAddr) -> impl Iterator<Item = &NetnsView> {
        self.alive().filter(move |n| n.addresses.iter().any(|a| a.ip == ip))
    }
}

/// Sent once for each netns the model sees die.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetnsDeath {
    pub inode: Option<NetnsInode>,
    pub nsid: Option<i32>,
    #[serde(serialize_with = "time")]
    pub at: SystemTime,
    pub source: DeathSource,
    /// Global-scope addresses it held when it died.
    pub addresses: Vec<AddressView>,
    pub bind_mounts: Vec<PathBuf>,
    #[serde(serialize_with = "time")]
    pub first_seen: SystemTime,
    pub creator: Option<Creator>,
}

impl NetnsDeath {
    /// The identity of the incarnation that died.
    #[must_use]
    pub fn id(&self) -> crate::identity::NetnsId {
        crate::identity::NetnsId::new(self.inode.map(u64::from), self.nsid, Some(self.first_seen))
    }

    pub(crate) fn from_view(v: &NetnsView, at: SystemTime, source: DeathSource) -> Self {
        Self {
            inode: v.inode,
            nsid: v.nsid,
            at,
            source,
            addresses: v.global_addresses().cloned().collect(),
            bind_mounts: v.bind_mounts.clone(),
            first_seen: v.first_seen,
            creator: v.creator.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hardware_address_prints_as_colon_separated_hex() {
        let mac = HardwareAddr::new(&[0x02, 0x00, 0xab, 0x01, 0x2c, 0xff]).expect("non-empty");
        assert_eq!(mac.to_string(), "02:00:ab:01:2c:ff");
        assert_eq!(serde_json::to_string(&mac).expect("serializes"), "\"02:00:ab:01:2c:ff\"");
        assert_eq!(HardwareAddr::new(&[]), None, "a link without an address has none");
    }
}
