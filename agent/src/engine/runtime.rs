//! The container runtime (CRI) as a second witness: its sandbox list, and
//! the rules that turn it into reasons to keep or evidence to release.
//!
//! The rules, each property-tested in `engine/runtime_tests.rs`:
//! - a READY sandbox keeps every reservation of its ID;
//! - a NOTREADY sandbox whose netns is alive (the runtime says it did not
//!   close it, or the kernel has a live netns at its path) keeps them too,
//!   and is *stuck*: the runtime gave up on the pod but its network is still
//!   there (typically a CNI DEL that keeps failing);
//! - a sandbox the runtime does not list, or lists NOTREADY with its netns
//!   closed, adds release evidence, and never overrides a live netns, an
//!   in-flight CNI run or the youth grace (those are decided before);
//! - a runtime that cannot be reached is `None`: it adds and removes nothing;
//! - the runtime saying the sandbox is gone plus the kernel holding its IP in
//!   no live netns (and no netns of it alive) is enough: a reservation never
//!   seen bound does not wait for the orphan grace.

use std::{collections::BTreeMap, fmt, path::PathBuf, time::SystemTime};

use serde::{Deserialize, Serialize};

use super::{
    claim::Claim,
    decide::CLOCK_SLACK,
    index::Index,
    observations::{NetnsId, NetnsName, Observations},
    verdict::Fact,
};
use crate::timefmt;

/// CRI `PodSandboxState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SandboxState {
    Ready,
    NotReady,
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ready => "READY",
            Self::NotReady => "NOTREADY",
        })
    }
}

/// A pod as the runtime names it (CRI `PodSandboxMetadata`).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One sandbox the runtime lists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSandbox {
    /// The sandbox ID: the container ID CNI is called with.
    pub id: String,
    pub state: SandboxState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
    /// The netns path the runtime gave the sandbox (containerd:
    /// `runtimeSpec.linux.namespaces[type=network].path`). None when not
    /// known or the pod uses the host's network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    /// The runtime's word on whether it closed that netns (containerd:
    /// `netNamespaceClosed`). None when it did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_closed: Option<bool>,
}

/// The runtime's sandbox list at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeView {
    /// e.g. "containerd 1.6.20~ds1 (runtime.v1)".
    pub runtime: String,
    /// When `ListPodSandbox` answered. A reservation made after it may
    /// belong to a sandbox the list could not show yet.
    #[serde(with = "timefmt::rfc3339")]
    pub listed_at: SystemTime,
    /// By sandbox ID.
    pub sandboxes: BTreeMap<String, RuntimeSandbox>,
    /// The CNI networks the runtime attaches pods to, when it says
    /// (containerd's `cniconfig`). When known, the runtime's absence is
    /// evidence only for reservations of these networks: another user of
    /// the same IPAM store (podman, a script) is not the runtime's to judge.
    #[serde(default)]
    pub networks: Option<Vec<String>>,
    /// Pods of sandboxes this agent saw listed earlier and no longer are:
    /// their names, for the people reading about their release.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub departed: BTreeMap<String, PodRef>,
}

impl RuntimeView {
    /// The pod a sandbox ID belongs (or belonged) to, when known.
    #[must_use]
    pub fn pod_of(&self, id: &str) -> Option<&PodRef> {
        self.sandboxes.get(id).and_then(|s| s.pod.as_ref()).or_else(|| self.departed.get(id))
    }

    fn judges_network(&self, network: &str) -> bool {
        self.networks.as_ref().is_none_or(|n| n.iter().any(|x| x == network))
    }
}

/// A runtime fact in a verdict's evidence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "runtime", rename_all = "snake_case")]
pub enum RuntimeFact {
    /// Listed READY: the runtime runs the pod.
    SandboxReady {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodRef>,
    },
    /// Listed NOTREADY with its netns alive: stuck; kept.
    SandboxStuck {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodRef>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        netns: Option<PathBuf>,
        /// The live netns the kernel has at that path, if it does.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        live: Option<NetnsId>,
    },
    /// Not listed (any more).
    SandboxGone {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodRef>,
    },
    /// Listed NOTREADY, and the runtime closed its netns.
    SandboxNetnsClosed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodRef>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        netns: Option<PathBuf>,
    },
    /// Listed NOTREADY, its netns state not said and not alive in the
    /// kernel: neither a reason to keep nor evidence to release.
    SandboxNotReady {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pod: Option<PodRef>,
    },
    /// The runtime's word and the kernel's together: its sandbox is gone
    /// (or its netns closed) and no netns of it is alive, so no orphan grace.
    GoneWithItsNetns,
}

fn pod_text(pod: Option<&PodRef>) -> String {
    pod.map_or_else(String::new, |p| format!(" (pod {p})"))
}

impl fmt::Display for RuntimeFact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SandboxReady { pod } => write!(f, "the runtime lists its sandbox{} READY", pod_text(pod.as_ref())),
            Self::SandboxStuck { pod, netns, .. } => write!(
                f,
                "the runtime lists its sandbox{} NOTREADY with its netns{} alive: stuck",
                pod_text(pod.as_ref()),
                netns.as_ref().map_or_else(String::new, |p| format!(" {}", p.display()))
            ),
            Self::SandboxGone { pod } => {
                write!(f, "the runtime does not list its sandbox{}", pod_text(pod.as_ref()))
            }
            Self::SandboxNetnsClosed { pod, .. } => {
                write!(f, "the runtime lists its sandbox{} NOTREADY with its netns closed", pod_text(pod.as_ref()))
            }
            Self::SandboxNotReady { pod } => write!(
                f,
                "the runtime lists its sandbox{} NOTREADY (netns state not said, not alive in the kernel)",
                pod_text(pod.as_ref())
            ),
            Self::GoneWithItsNetns => f.write_str(
                "the runtime is done with its sandbox and the kernel has no netns of it alive: no orphan grace needed",
            ),
        }
    }
}

/// What the runtime says about one container ID.
enum Word<'a> {
    /// No runtime view: nothing.
    Silent,
    Ready(&'a RuntimeSandbox),
    Stuck(&'a RuntimeSandbox, Option<NetnsId>),
    /// NOTREADY with its netns closed.
    Closed(&'a RuntimeSandbox),
    /// NOTREADY, netns state unknown and not alive in the kernel.
    NotReady(&'a RuntimeSandbox),
    Gone,
}

fn word<'a>(ix: &Index<'a>, cid: &str) -> Word<'a> {
    let Some(view) = &ix.obs.runtime else {
        return Word::Silent;
    };
    let Some(sandbox) = view.sandboxes.get(cid) else {
        return Word::Gone;
    };
    if sandbox.state == SandboxState::Ready {
        return Word::Ready(sandbox);
    }
    let live = sandbox.netns.as_ref().and_then(|p| ix.live_matching(&NetnsName::Path(p.clone()))).map(|n| n.id);
    match (sandbox.netns_closed, live) {
        (Some(false), _) | (_, Some(_)) => Word::Stuck(sandbox, live),
        (Some(true), None) => Word::Closed(sandbox),
        (None, None) => Word::NotReady(sandbox),
    }
}

/// Reasons to keep: READY, or stuck. Without a detailed view, the bare
/// `runtime_sandboxes` list keeps what it names.
pub(crate) fn keep_facts(ix: &Index<'_>, cid: &str) -> Vec<Fact> {
    match word(ix, cid) {
        Word::Ready(s) => vec![Fact::from(RuntimeFact::SandboxReady { pod: s.pod.clone() })],
        Word::Stuck(s, live) => {
            vec![Fact::from(RuntimeFact::SandboxStuck { pod: s.pod.clone(), netns: s.netns.clone(), live })]
        }
        Word::Silent if ix.runtime_lists(cid) == Some(true) => vec![Fact::RuntimeListsSandbox],
        _ => Vec::new(),
    }
}

/// What the runtime adds to an orphaned verdict: how it lists the sandbox,
/// or that it could not be asked.
pub(crate) fn release_facts(ix: &Index<'_>, r: &impl Claim) -> Vec<Fact> {
    let obs = ix.obs;
    let pod = || obs.runtime.as_ref().and_then(|v| v.pod_of(r.container_id())).cloned();
    match word(ix, r.container_id()) {
        Word::Gone => vec![Fact::from(RuntimeFact::SandboxGone { pod: pod() })],
        Word::Closed(s) => {
            vec![Fact::from(RuntimeFact::SandboxNetnsClosed { pod: s.pod.clone(), netns: s.netns.clone() })]
        }
        Word::NotReady(s) => vec![Fact::from(RuntimeFact::SandboxNotReady { pod: s.pod.clone() })],
        // Keeping words never reach an orphaned verdict; say what was seen.
        Word::Ready(_) | Word::Stuck(..) => Vec::new(),
        Word::Silent => match &obs.runtime_sandboxes {
            Some(_) => vec![Fact::RuntimeDoesNotListSandbox],
            None => vec![Fact::SourceUnavailable { source: "runtime sandbox list".into() }],
        },
    }
}

/// Whether the runtime's word plus the kernel's make the owner dead without
/// waiting for the orphan grace. Called only when nothing keeps the
/// reservation (no live netns of it, no in-flight CNI run, not young): the
/// runtime is done with the sandbox (not listed, or NOTREADY with its netns
/// closed and no live netns at its path), it listed after the reservation
/// was made, and the reservation's network is one the runtime uses.
pub(crate) fn says_gone(ix: &Index<'_>, r: &impl Claim) -> Option<Vec<Fact>> {
    let view = ix.obs.runtime.as_ref()?;
    if r.reserved_at() + CLOCK_SLACK > view.listed_at || !view.judges_network(r.network()) {
        return None;
    }
    match word(ix, r.container_id()) {
        Word::Gone | Word::Closed(_) => Some(vec![Fact::from(RuntimeFact::GoneWithItsNetns)]),
        _ => None,
    }
}

/// A NOTREADY sandbox whose netns is alive: the runtime gave up on the pod,
/// its network did not go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StuckSandbox {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    /// The live netns the kernel has at that path, if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<NetnsId>,
    /// What the runtime said about its netns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_closed: Option<bool>,
}

impl fmt::Display for StuckSandbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sandbox {}{} NOTREADY, netns", self.id, pod_text(self.pod.as_ref()))?;
        if let Some(p) = &self.netns {
            write!(f, " {}", p.display())?;
        }
        match (self.live, self.netns_closed) {
            (Some(id), _) => write!(f, " alive in the kernel ({id})")?,
            (None, _) => f.write_str(" not closed by the runtime")?,
        }
        f.write_str(": stuck (its IPs are kept)")
    }
}

/// Every stuck sandbox, in ID order.
#[must_use]
pub fn stuck_sandboxes(obs: &Observations) -> Vec<StuckSandbox> {
    let Some(view) = &obs.runtime else {
        return Vec::new();
    };
    let ix = Index::new(obs);
    view.sandboxes
        .values()
        .filter_map(|s| match word(&ix, &s.id) {
            Word::Stuck(s, live) => Some(StuckSandbox {
                id: s.id.clone(),
                pod: s.pod.clone(),
                netns: s.netns.clone(),
                live,
                netns_closed: s.netns_closed,
            }),
            _ => None,
        })
        .collect()
}

impl Observations {
    /// Sets the runtime's view (None: not reachable, which adds nothing and
    /// removes nothing), keeping `runtime_sandboxes` in step: the IDs it
    /// lists as live by its own word (READY, or NOTREADY with its netns not
    /// closed).
    pub fn set_runtime(&mut self, view: Option<RuntimeView>) {
        self.runtime_sandboxes = view.as_ref().map(|v| {
            v.sandboxes
                .values()
                .filter(|s| s.state == SandboxState::Ready || s.netns_closed == Some(false))
                .map(|s| s.id.clone())
                .collect()
        });
        self.runtime = view;
    }
}

#[cfg(test)]
#[path = "runtime_tests.rs"]
mod tests;
