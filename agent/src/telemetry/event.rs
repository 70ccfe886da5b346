//! The event stream's vocabulary: one variant per event of docs/events.md
//! (a test holds the two together). Payloads borrow what they report, so
//! an event costs one serialization straight into the line, nothing more.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use serde::{Serialize, Serializer};

use crate::{
    engine::{Evidence, Fact, PodRef, Status, StuckSandbox, Verdict},
    identity::NetnsId,
    ipam::{Anomaly, Reservation, StoreRef},
    kernel::{
        cni_runs::CniRunAnomaly,
        events::{CniExec, CniExit, KernelEvent, NetnsVia, Task},
    },
    model::{
        DeathSource,
        snapshot::{Creator, NetnsDeath},
    },
    release::{ReleaseRecord, outcome::Outcome},
};

/// One line of the event stream (without its `time`).
#[derive(Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event<'a> {
    NetnsEntered {
        task: &'a Task,
        netns_inode: u32,
        previous_netns_inode: u32,
        via: NetnsVia,
    },
    NetnsCreated {
        task: &'a Task,
        netns_inode: u32,
        via: NetnsVia,
    },
    NetnsFreed {
        task: &'a Task,
        netns_inode: u32,
    },
    CniExec {
        task: &'a Task,
        exec: &'a CniExec,
    },
    CniExecAnomaly {
        pid: u32,
        comm: &'a str,
        anomaly: &'a CniRunAnomaly,
        command: &'a str,
        container_id: Option<&'a str>,
        uid: u32,
    },
    CniExit {
        task: &'a Task,
        exit: &'a CniExit,
    },
    MalformedRecord {
        error: String,
    },
    RecordsDropped {
        dropped: u64,
    },
    NetnsDied(NetnsDied<'a>),
    VerdictChanged(VerdictChanged<'a>),
    Release(Release<'a>),
    Conflict(Conflict<'a>),
    Anomaly(&'a Anomaly),
    SourceChanged {
        source: &'a str,
        active: bool,
        detail: &'a str,
    },
    SandboxStuck(Sandbox<'a>),
    SandboxUnstuck(Sandbox<'a>),
}

impl<'a> From<&'a KernelEvent> for Event<'a> {
    fn from(event: &'a KernelEvent) -> Self {
        match event {
            KernelEvent::NetnsEntered { task, netns_inode, previous_netns_inode, via } => Self::NetnsEntered {
                task,
                netns_inode: *netns_inode,
                previous_netns_inode: *previous_netns_inode,
                via: *via,
            },
            KernelEvent::NetnsCreated { task, netns_inode, via } => {
                Self::NetnsCreated { task, netns_inode: *netns_inode, via: *via }
            }
            KernelEvent::NetnsFreed { task, netns_inode } => Self::NetnsFreed { task, netns_inode: *netns_inode },
            KernelEvent::CniExec { task, exec } => Self::CniExec { task, exec },
            KernelEvent::CniExit { task, exit } => Self::CniExit { task, exit },
        }
    }
}

/// `netns_died`: live (from the model) or while the agent was down.
#[derive(Debug, Serialize)]
pub struct NetnsDied<'a> {
    pub netns: NetnsId,
    pub netns_inode: Option<u64>,
    pub nsid: Option<i32>,
    pub source: DeathSource,
    /// `while_down` only: when the earlier run last knew it alive.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub died_after: Option<String>,
    /// `while_down` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_boot: Option<bool>,
    pub addresses: Vec<IpAddr>,
    pub bind_mounts: &'a [PathBuf],
    pub container_ids: &'a [String],
    pub creator: Option<&'a Creator>,
}

impl<'a> NetnsDied<'a> {
    /// A death the model saw.
    #[must_use]
    pub fn seen(death: &'a NetnsDeath, container_ids: &'a [String]) -> Self {
        Self {
            netns: death.id(),
            netns_inode: death.inode.map(u64::from),
            nsid: death.nsid,
            source: death.source,
            died_after: None,
            same_boot: None,
            addresses: death.addresses.iter().map(|a| a.ip).collect(),
            bind_mounts: &death.bind_mounts,
            container_ids,
            creator: death.creator.as_ref(),
        }
    }

    /// A saved netns the kernel no longer has: it died while netreap was down.
    #[must_use]
    pub fn while_down(dead: &'a crate::engine::observations::DeadNetns, same_boot: bool) -> Self {
        Self {
            netns: dead.id,
            netns_inode: dead.id.inode,
            nsid: dead.id.nsid,
            source: DeathSource::WhileDown,
            died_after: Some(super::clock::rfc3339(dead.died_at)),
            same_boot: Some(same_boot),
            addresses: Vec::new(),
            bind_mounts: &dead.paths,
            container_ids: &dead.container_ids,
            creator: None,
        }
    }
}

/// The reservation a verdict or release is about.
#[derive(Debug, Serialize)]
pub struct ReservationFields<'a> {
    pub store: &'a StoreRef,
    pub network: &'a str,
    pub ip: IpAddr,
    pub container_id: &'a str,
    pub ifname: Option<&'a str>,
}

impl<'a> From<&'a Reservation> for ReservationFields<'a> {
    fn from(r: &'a Reservation) -> Self {
        Self {
            store: &r.store,
            network: &r.network,
            ip: r.ip,
            container_id: &r.container_id,
            ifname: r.ifname.as_deref(),
        }
    }
}

/// The pod the runtime names for a container, when it does.
#[derive(Debug, Default, Serialize)]
pub struct PodFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
}

impl From<Option<&PodRef>> for PodFields {
    fn from(pod: Option<&PodRef>) -> Self {
        Self { pod: pod.map(ToString::to_string), pod_uid: pod.filter(|p| !p.uid.is_empty()).map(|p| p.uid.clone()) }
    }
}

/// Text for a person, rendered straight into the line as it is written
/// (no string built first), and only for the events that carry it.
#[derive(Debug)]
pub struct Shown<'a, T: ?Sized>(pub &'a T);

impl<T: std::fmt::Display + ?Sized> Serialize for Shown<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self.0)
    }
}

/// A verdict's evidence as the lines a person reads.
#[derive(Debug)]
pub struct EvidenceText<'a>(pub &'a [Evidence]);

impl Serialize for EvidenceText<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|e| Shown(&e.fact)))
    }
}

#[derive(Debug, Serialize)]
pub struct VerdictChanged<'a> {
    #[serde(flatten)]
    pub reservation: ReservationFields<'a>,
    pub from: Option<Status>,
    pub to: Status,
    pub summary: Shown<'a, Verdict>,
    pub evidence: EvidenceText<'a>,
    #[serde(flatten)]
    pub pod: PodFields,
}

impl<'a> VerdictChanged<'a> {
    #[must_use]
    pub fn new(v: &'a Verdict, before: Option<Status>, pod: Option<&PodRef>) -> Self {
        Self {
            reservation: (&v.reservation).into(),
            from: before,
            to: v.status,
            summary: Shown(v),
            evidence: EvidenceText(&v.evidence),
            pod: pod.into(),
        }
    }
}

/// Why a release was attempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// The netns its container was bound to died.
    NetnsDied,
    /// The runtime is done with the sandbox and no netns of it is alive.
    RuntimeGone,
    /// Never seen bound, older than the orphan grace, IP in no live netns.
    OrphanGrace,
    /// An intent of an earlier run, re-verified.
    Recovery,
}

impl ReleaseReason {
    /// The one spelling: event field and metric label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NetnsDied => "netns_died",
            Self::RuntimeGone => "runtime_gone",
            Self::OrphanGrace => "orphan_grace",
            Self::Recovery => "recovery",
        }
    }

    /// Why this orphan is released.
    #[must_use]
    pub fn of(v: &Verdict) -> Self {
        use crate::engine::runtime::RuntimeFact;
        if death_time(v).is_some() {
            Self::NetnsDied
        } else if v.evidence.iter().any(|e| matches!(e.fact.runtime(), Some(RuntimeFact::GoneWithItsNetns))) {
            Self::RuntimeGone
        } else {
            Self::OrphanGrace
        }
    }
}

/// When the netns whose death decided this verdict died.
#[must_use]
pub fn death_time(v: &Verdict) -> Option<std::time::SystemTime> {
    v.evidence.iter().find_map(|e| match &e.fact {
        Fact::BoundNetnsDied { died_at, .. } => Some(*died_at),
        _ => None,
    })
}

/// The one spelling of a verdict status (`in_use`, `pending`, `orphaned`,
/// `conflict`) for metric labels: the same as its serde name in events and
/// /state (a test checks).
#[must_use]
pub fn status_label(s: Status) -> &'static str {
    match s {
        Status::InUse => "in_use",
        Status::Pending => "pending",
        Status::Orphaned => "orphaned",
        Status::Conflict => "conflict",
    }
}

#[derive(Debug, Serialize)]
pub struct Release<'a> {
    #[serde(flatten)]
    pub reservation: ReservationFields<'a>,
    pub reason: ReleaseReason,
    pub outcome: &'static str,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub dry_run: bool,
    pub intent_id: Option<&'a str>,
    pub evidence: EvidenceText<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub death_to_release_seconds: Option<f64>,
    #[serde(flatten)]
    pub pod: PodFields,
}

impl<'a> Release<'a> {
    #[must_use]
    pub fn new(
        record: &'a ReleaseRecord,
        reason: ReleaseReason,
        latency: Option<Duration>,
        pod: Option<&PodRef>,
    ) -> Self {
        let error = match &record.outcome {
            Outcome::Failed { error } => Some(error.clone()),
            Outcome::LockBusy { .. } => Some(record.outcome.to_string()),
            _ => None,
        };
        Self {
            reservation: (&record.verdict.reservation).into(),
            reason,
            outcome: record.outcome.label(),
            detail: record.outcome.to_string(),
            error,
            dry_run: record.dry_run,
            intent_id: record.intent_id.as_deref(),
            evidence: EvidenceText(&record.verdict.evidence),
            death_to_release_seconds: latency.map(|l| l.as_secs_f64()),
            pod: pod.into(),
        }
    }
}

/// A live netns other than the owner's that holds a conflicting IP.
#[derive(Debug, Serialize)]
pub struct Holder<'a> {
    pub netns_inode: Option<u64>,
    pub live_container_ids: &'a [String],
}

#[derive(Debug, Serialize)]
pub struct Conflict<'a> {
    pub network: &'a str,
    pub ip: IpAddr,
    pub reserved_by: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holders: Option<Vec<Holder<'a>>>,
    pub evidence: EvidenceText<'a>,
    /// `last_look`: found by the kernel under the plugin's lock.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_view: Option<&'a str>,
    #[serde(flatten)]
    pub pod: PodFields,
}

impl<'a> Conflict<'a> {
    /// A conflict verdict of the engine.
    #[must_use]
    pub fn verdict(v: &'a Verdict, pod: Option<&PodRef>) -> Self {
        let holders = v
            .evidence
            .iter()
            .filter_map(|e| match &e.fact {
                Fact::IpInOtherLiveNetns { netns, containers, .. } => {
                    Some(Holder { netns_inode: netns.inode, live_container_ids: containers })
                }
                _ => None,
            })
            .collect();
        Self {
            network: &v.reservation.network,
            ip: v.reservation.ip,
            reserved_by: &v.reservation.container_id,
            holders: Some(holders),
            evidence: EvidenceText(&v.evidence),
            stage: None,
            kernel_view: None,
            pod: pod.into(),
        }
    }

    /// The model saw no live netns with the IP; the kernel, asked under the
    /// plugin's lock, showed one.
    #[must_use]
    pub fn last_look(v: &'a Verdict, found: &'a str) -> Self {
        Self {
            network: &v.reservation.network,
            ip: v.reservation.ip,
            reserved_by: &v.reservation.container_id,
            holders: None,
            evidence: EvidenceText(&v.evidence),
            stage: Some("last_look"),
            kernel_view: Some(found),
            pod: PodFields::default(),
        }
    }
}

/// `sandbox_stuck` and `sandbox_unstuck`.
#[derive(Debug, Serialize)]
pub struct Sandbox<'a> {
    pub sandbox_id: &'a str,
    pub pod: Option<String>,
    pub pod_uid: Option<&'a str>,
    pub netns: Option<&'a PathBuf>,
    pub netns_inode: Option<u64>,
    pub netns_closed_by_runtime: Option<bool>,
    pub detail: String,
}

impl<'a> From<&'a StuckSandbox> for Sandbox<'a> {
    fn from(s: &'a StuckSandbox) -> Self {
        Self {
            sandbox_id: &s.id,
            pod: s.pod.as_ref().map(ToString::to_string),
            pod_uid: s.pod.as_ref().map(|p| p.uid.as_str()),
            netns: s.netns.as_ref(),
            netns_inode: s.live.and_then(|id| id.inode),
            netns_closed_by_runtime: s.netns_closed,
            detail: s.to_string(),
        }
    }
}

#[cfg(test)]
#[path = "event_tests.rs"]
mod tests;
