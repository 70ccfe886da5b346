//! Verdicts and the evidence that decided them, for machines (tagged JSON)
//! and for people (`text`, `summary`).

use std::{
    fmt,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use serde::{Deserialize, Serialize};

use super::claim::Claim;
use super::observations::{BindingSource, NetnsId, NetnsName};
use crate::{ipam::Reservation, timefmt};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Something live holds it: keep.
    InUse,
    /// In flight or too young to judge: keep for now.
    Pending,
    /// Its owner is gone and nothing holds it: may be released.
    Orphaned,
    /// Its owner is gone, but its IP is configured in a live netns of
    /// another container: report, never release.
    Conflict,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InUse => "in use",
            Self::Pending => "pending",
            Self::Orphaned => "orphaned",
            Self::Conflict => "conflict",
        })
    }
}

/// How a container came to be tied to a netns (not how a task entered
/// one, which is `kernel::events::NetnsVia`). Written as `via` in facts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BoundBy {
    /// A binding (CNI run, cache entry, runtime). The name is shared with
    /// every verdict that cites the same binding.
    Binding { source: BindingSource, netns: Arc<NetnsName> },
    /// The model lists the container on the netns.
    Model,
    /// The reservation's IP was configured in that netns.
    Address,
}

impl fmt::Display for BoundBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Binding { source: BindingSource::CniExec, netns } => write!(f, "CNI_NETNS {netns} of a CNI run"),
            Self::Binding { source: BindingSource::CniCache, netns } => write!(f, "netns {netns} in the CNI cache"),
            Self::Binding { source: BindingSource::Runtime, netns } => write!(f, "netns {netns} from the runtime"),
            Self::Model => f.write_str("the netns model"),
            Self::Address => f.write_str("its IP was configured there"),
        }
    }
}

/// One fact the engine relied on. Kept small (every verdict holds a few):
/// lists of paths and containers are shared with the netns they describe,
/// the rare large payloads are boxed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
pub enum Fact {
    /// The IP is configured in a live netns of its own container.
    IpInOwnLiveNetns {
        netns: NetnsId,
        paths: Arc<[PathBuf]>,
    },
    /// The IP is configured in a live netns whose containers are unknown or
    /// others than the reservation's.
    IpInOtherLiveNetns {
        netns: NetnsId,
        containers: Arc<[String]>,
        paths: Arc<[PathBuf]>,
    },
    BoundToLiveNetns {
        netns: NetnsId,
        via: BoundBy,
    },
    CniOpInFlight {
        container_id: Option<Box<str>>,
        command: Box<str>,
        plugin: Box<str>,
        #[serde(with = "timefmt::rfc3339")]
        started_at: SystemTime,
    },
    RuntimeListsSandbox,
    ApiPodHasIp {
        namespace: String,
        name: String,
    },
    /// A Pending pod of this node was named by a CNI run of the
    /// reservation's container: its IP may not be reported yet.
    ApiPendingPodNamedByCniRun {
        namespace: String,
        name: String,
    },
    Young {
        #[serde(with = "timefmt::duration")]
        age: Duration,
        #[serde(with = "timefmt::duration")]
        grace: Duration,
    },
    /// Never seen bound and not yet old enough to be called a leak.
    AwaitingOrphanGrace {
        #[serde(with = "timefmt::duration")]
        age: Duration,
        #[serde(with = "timefmt::duration")]
        grace: Duration,
    },
    /// A binding whose netns is neither known live nor seen to die.
    UnresolvedBinding {
        netns: Arc<NetnsName>,
        source: BindingSource,
        #[serde(with = "timefmt::rfc3339")]
        seen_at: SystemTime,
    },
    BoundNetnsDied {
        netns: NetnsId,
        #[serde(with = "timefmt::rfc3339")]
        died_at: SystemTime,
        via: BoundBy,
    },
    /// Its container's netns died before the reservation was made: the
    /// reservation belongs to a later netns nobody has seen.
    BoundNetnsDiedBeforeReservation {
        netns: NetnsId,
        #[serde(with = "timefmt::rfc3339")]
        died_at: SystemTime,
        via: BoundBy,
    },
    NeverSeenBound {
        #[serde(with = "timefmt::duration")]
        age: Duration,
        #[serde(with = "timefmt::duration")]
        grace: Duration,
    },
    /// Bound only to netns of unknown fate, all seen longer ago than the
    /// orphan grace, and reserved longer ago than that too.
    NoLiveBindingPastGrace {
        #[serde(with = "timefmt::duration")]
        age: Duration,
        #[serde(with = "timefmt::duration")]
        grace: Duration,
    },
    IpInNoLiveNetns,
    NoCniOpInFlight,
    RuntimeDoesNotListSandbox,
    /// What the container runtime says (engine/runtime.rs).
    Runtime(Box<super::runtime::RuntimeFact>),
    /// An optional source was not available to check.
    SourceUnavailable {
        source: String,
    },
}

impl From<super::runtime::RuntimeFact> for Fact {
    fn from(fact: super::runtime::RuntimeFact) -> Self {
        Self::Runtime(Box::new(fact))
    }
}

impl Fact {
    /// The runtime's word, when this fact is one.
    #[must_use]
    pub fn runtime(&self) -> Option<&super::runtime::RuntimeFact> {
        match self {
            Self::Runtime(fact) => Some(fact),
            _ => None,
        }
    }
}

impl fmt::Display for Fact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use timefmt::human;
        let time = |t: &SystemTime| humantime::format_rfc3339_millis(*t).to_string();
        match self {
            Self::IpInOwnLiveNetns { netns, .. } => write!(f, "its IP is configured in its own live netns {netns}"),
            Self::IpInOtherLiveNetns { netns, containers, .. } if containers.is_empty() => {
                write!(f, "its IP is configured in live netns {netns} (containers unknown)")
            }
            Self::IpInOtherLiveNetns { netns, containers, .. } => {
                write!(f, "its IP is configured in live netns {netns} of container(s) {}", containers.join(", "))
            }
            Self::BoundToLiveNetns { netns, via } => {
                write!(f, "its container is bound to live netns {netns} (via {via})")
            }
            Self::CniOpInFlight { container_id: Some(id), command, plugin, started_at } => {
                write!(f, "CNI {command} by {plugin} for container {id} in flight since {}", time(started_at))
            }
            Self::CniOpInFlight { container_id: None, command, plugin, started_at } => {
                write!(f, "CNI {command} by {plugin} for an unknown container in flight since {}", time(started_at))
            }
            Self::RuntimeListsSandbox => f.write_str("the runtime lists its sandbox as live"),
            Self::ApiPodHasIp { namespace, name } => write!(f, "pod {namespace}/{name} reports this IP"),
            Self::ApiPendingPodNamedByCniRun { namespace, name } => {
                write!(f, "pod {namespace}/{name} is Pending and a CNI run of its container named it")
            }
            Self::Young { age, grace } => {
                write!(f, "reserved {} ago, within the in-flight grace of {}", human(*age), human(*grace))
            }
            Self::AwaitingOrphanGrace { age, grace } => {
                write!(f, "never seen bound; reserved {} ago, orphan grace is {}", human(*age), human(*grace))
            }
            Self::UnresolvedBinding { netns, source, seen_at } => {
                write!(
                    f,
                    "bound to netns {netns} (from the {source}, seen {}), neither live nor seen to die",
                    time(seen_at)
                )
            }
            Self::BoundNetnsDied { netns, died_at, via } => {
                write!(f, "its netns {netns} died at {} (bound via {via})", time(died_at))
            }
            Self::BoundNetnsDiedBeforeReservation { netns, died_at, via } => write!(
                f,
                "its container's netns {netns} died at {}, before this IP was reserved (bound via {via})",
                time(died_at)
            ),
            Self::NeverSeenBound { age, grace } => {
                write!(f, "never seen bound; reserved {} ago, past the orphan grace of {}", human(*age), human(*grace))
            }
            Self::NoLiveBindingPastGrace { age, grace } => write!(
                f,
                "no netns it was bound to is known live; reserved {} ago, past the orphan grace of {}",
                human(*age),
                human(*grace)
            ),
            Self::IpInNoLiveNetns => f.write_str("its IP is configured in no live netns"),
            Self::NoCniOpInFlight => f.write_str("no CNI operation for its container is in flight"),
            Self::RuntimeDoesNotListSandbox => f.write_str("the runtime does not list its sandbox"),
            Self::Runtime(fact) => fact.fmt(f),
            Self::SourceUnavailable { source } => write!(f, "{source} not available"),
        }
    }
}

/// A fact the engine relied on. Its sentence is rendered only when someone
/// reads it ([`Evidence::text`], or serialization, which writes it as
/// `text` beside the fact's fields): a node with 100k reservations keeps
/// 100k verdicts, and almost none of them is ever printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    pub fact: Fact,
}

impl Evidence {
    /// The sentence for a person (what the event stream and reports show).
    #[must_use]
    pub fn text(&self) -> String {
        self.fact.to_string()
    }
}

impl From<Fact> for Evidence {
    fn from(fact: Fact) -> Self {
        Self { fact }
    }
}

impl fmt::Display for Evidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fact.fmt(f)
    }
}

/// The wire form of [`Evidence`]: the fact's fields and its sentence.
#[derive(Serialize)]
struct EvidenceOut<'a> {
    #[serde(flatten)]
    fact: &'a Fact,
    text: String,
}

/// Reading it back: the sentence is derived, so it is not read.
#[derive(Deserialize)]
struct EvidenceIn {
    #[serde(flatten)]
    fact: Fact,
}

impl Serialize for Evidence {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        EvidenceOut { fact: &self.fact, text: self.text() }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Evidence {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        EvidenceIn::deserialize(d).map(|e| Self { fact: e.fact })
    }
}

/// The engine's decision about one reservation. `R` is the caller's
/// reservation, which the engine reads only through [`Claim`] and hands
/// back untouched; it defaults to the IPAM stores' reservation, which is
/// what every caller in netreap judges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict<R = Reservation> {
    pub reservation: R,
    pub status: Status,
    /// The facts that decided it, the deciding ones first. Shared: the
    /// reservations of one pod (one per network it is attached to) are
    /// mostly decided by the same facts, and `decide` hands them one list.
    pub evidence: Arc<[Evidence]>,
}

impl<R: Claim + Clone> Verdict<R> {
    pub(crate) fn new(reservation: &R, status: Status, facts: Vec<Fact>) -> Self {
        Self::with_evidence(reservation, status, facts.into_iter().map(Evidence::from).collect())
    }

    pub(crate) fn with_evidence(reservation: &R, status: Status, evidence: Arc<[Evidence]>) -> Self {
        Self { reservation: reservation.clone(), status, evidence }
    }
}

impl<R> Verdict<R> {
    #[must_use]
    pub fn is_orphaned(&self) -> bool {
        self.status == Status::Orphaned
    }

    /// Each fact's sentence, deciding ones first (the `evidence` of events).
    #[must_use]
    pub fn evidence_text(&self) -> Vec<String> {
        self.evidence.iter().map(Evidence::text).collect()
    }
}

impl<R: fmt::Display> Verdict<R> {
    /// One line for a person: the reservation, its status and every reason.
    #[must_use]
    pub fn summary(&self) -> String {
        self.to_string()
    }
}

/// The summary: "net1 10.0.0.2 (c1 of host-local /var/lib/cni/networks):
/// orphaned: reason; reason".
impl<R: fmt::Display> fmt::Display for Verdict<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: ", self.reservation, self.status)?;
        for (i, e) in self.evidence.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            e.fact.fmt(f)?;
        }
        Ok(())
    }
}

#[derive(Serialize)]
struct VerdictOut<'a, R> {
    reservation: &'a R,
    status: Status,
    evidence: &'a [Evidence],
    summary: String,
}

#[derive(Deserialize)]
struct VerdictIn<R> {
    reservation: R,
    status: Status,
    evidence: Arc<[Evidence]>,
}

/// Written as before the sentences became derived: `summary` included.
impl<R: Serialize + fmt::Display> Serialize for Verdict<R> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        VerdictOut {
            reservation: &self.reservation,
            status: self.status,
            evidence: &self.evidence,
            summary: self.summary(),
        }
        .serialize(s)
    }
}

impl<'de, R: Deserialize<'de>> Deserialize<'de> for Verdict<R> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        VerdictIn::deserialize(d).map(|v| Self { reservation: v.reservation, status: v.status, evidence: v.evidence })
    }
}
