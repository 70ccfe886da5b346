//! Every source of evidence netreap can use, whether it is active here and
//! why not: the `netreap sources` report. One typed row per source, so a new
//! source (the Kubernetes API) adds a row and nothing else.

use std::fmt;

use serde::Serialize;

use crate::{
    config::Config,
    ipam::{ReservationStore as _, cnicache::CniCache, hostlocal::HostLocalStore},
    kernel::probes::{ProbeState, Probes},
    netlink::{RtnlSocket, SocketOptions, wire::consts::RTNLGRP_NSID},
    runtime::RuntimeWitness,
};

/// What a source is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The kernel: births, deaths, addresses, CNI runs. Decides alone.
    Kernel,
    /// Where reservations are read (and released).
    Store,
    /// Optional witness: only adds reasons to keep, or (with the kernel's
    /// word) evidence to release.
    Witness,
}

/// Whether a source is used, and why (not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum SourceState {
    Active(String),
    Inactive(String),
    /// This build has no code for it yet.
    NotBuilt(String),
}

impl SourceState {
    #[must_use]
    pub fn is_active(&self) -> bool {
        matches!(self, Self::Active(_))
    }
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Source {
    /// Stable identifier (`kernel_probes`, `netlink`, `host_local`,
    /// `cni_cache`, `cri`, `kubernetes`): the `source` of events and metrics.
    pub id: &'static str,
    pub name: &'static str,
    pub role: Role,
    #[serde(flatten)]
    pub state: SourceState,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (state, detail) = match &self.state {
            SourceState::Active(d) => ("active", d),
            SourceState::Inactive(d) => ("inactive", d),
            SourceState::NotBuilt(d) => ("off", d),
        };
        write!(f, "{:<24} {:<8} {state:<9} {detail}", self.name, format!("{:?}", self.role).to_lowercase())
    }
}

/// Looks at every source now (loads and unloads the probes, opens a netlink
/// socket, reads the stores, asks the runtime).
pub async fn survey(config: &Config) -> Vec<Source> {
    let mut rows = vec![kernel_probes(), netlink(), host_local(config), cni_cache(config), cri(config).await];
    rows.extend(kubernetes(config).await);
    rows
}

fn kernel_probes() -> Source {
    let state = match Probes::survey() {
        Ok(probes) => {
            let active = probes.status.iter().filter(|s| matches!(s.state, ProbeState::Active)).count();
            let failed_required: Vec<&str> = probes
                .status
                .iter()
                .filter(|s| s.spec.required && !matches!(s.state, ProbeState::Active))
                .map(|s| s.spec.program)
                .collect();
            if failed_required.is_empty() {
                SourceState::Active(format!(
                    "{active} of {} probes load (netns births, CNI plugin runs); `netreap probes` for each",
                    probes.status.len()
                ))
            } else {
                SourceState::Inactive(format!("required probes refused: {}", failed_required.join(", ")))
            }
        }
        Err(e) => SourceState::Inactive(format!("{e}")),
    };
    Source { id: "kernel_probes", name: "kernel probes (eBPF)", role: Role::Kernel, state }
}

fn netlink() -> Source {
    let options = SocketOptions {
        groups: vec![RTNLGRP_NSID],
        listen_all_nsid: true,
        receive_buffer: crate::netlink::RECV_BUFFER,
        nonblocking: true,
    };
    let state = match RtnlSocket::open(&options) {
        Ok(_) => SourceState::Active(
            "rtnetlink: netns deaths (RTM_DELNSID), links and addresses of every netns (all-nsid)".to_owned(),
        ),
        Err(e) => SourceState::Inactive(format!("cannot open an rtnetlink socket: {e}")),
    };
    Source { id: "netlink", name: "netlink netns model", role: Role::Kernel, state }
}

fn host_local(config: &Config) -> Source {
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for dir in &config.host_local_dirs {
        if dir.is_dir() {
            let scan = HostLocalStore::new(dir).scan();
            found.push(format!("{} ({} reservations)", dir.display(), scan.reservations.len()));
        } else {
            missing.push(dir.display().to_string());
        }
    }
    let state = if found.is_empty() {
        SourceState::Inactive(format!("no data directory exists: {}", missing.join(", ")))
    } else {
        let mut detail = found.join(", ");
        if !missing.is_empty() {
            detail = format!("{detail}; missing: {}", missing.join(", "));
        }
        SourceState::Active(detail)
    };
    Source { id: "host_local", name: "host-local IPAM", role: Role::Store, state }
}

fn cni_cache(config: &Config) -> Source {
    let dir = &config.cni_cache_dir;
    let state = if dir.is_dir() {
        let scan = CniCache::new(dir.clone()).scan();
        SourceState::Active(format!("{} ({} cached attachments)", dir.display(), scan.attachments.len()))
    } else {
        SourceState::Inactive(format!("{} does not exist", dir.display()))
    };
    Source { id: "cni_cache", name: "libcni result cache", role: Role::Witness, state }
}

async fn cri(config: &Config) -> Source {
    let mut witness = RuntimeWitness::new(config.cri_socket.clone());
    let state = if witness.is_off() {
        SourceState::Inactive(witness.choice().to_string())
    } else {
        match witness.view().await {
            Ok(view) => {
                let ready = view.sandboxes.values().filter(|s| s.state == crate::engine::SandboxState::Ready).count();
                let events = match witness.connected() {
                    Some(client) => match client.container_events().await {
                        Ok(_) => "container events followed".to_owned(),
                        Err(e) if e.is_unimplemented() => "no GetContainerEvents: listed on each reconcile".to_owned(),
                        Err(e) => format!("container events: {e}"),
                    },
                    None => String::new(),
                };
                SourceState::Active(format!(
                    "{} on {}: {} sandboxes ({ready} READY); {events}",
                    view.runtime,
                    witness.choice(),
                    view.sandboxes.len(),
                ))
            }
            Err(e) => SourceState::Inactive(e.to_string()),
        }
    };
    Source { id: "cri", name: "container runtime (CRI)", role: Role::Witness, state }
}

/// The Kubernetes rows (issue 12): the API as a witness (the node's pods)
/// and whereabouts as a store. One version request and a list or two, each
/// bounded in time.
async fn kubernetes(config: &Config) -> [Source; 2] {
    let status = crate::kube::status(config.kubeconfig.as_deref(), config.node_name.as_deref()).await;
    let api = match status.state {
        "on" => SourceState::Active(status.detail.clone()),
        other => SourceState::Inactive(format!("{other}: {}", status.detail)),
    };
    let whereabouts = match (&status.whereabouts, status.whereabouts_active) {
        (Some(detail), true) => SourceState::Active(format!(
            "{detail}; this node's allocations only, released with resourceVersion-tested patches"
        )),
        (Some(detail), false) => SourceState::Inactive(detail.clone()),
        (None, _) => SourceState::Inactive("needs the Kubernetes API".to_owned()),
    };
    [
        Source { id: "kubernetes", name: "Kubernetes API pods", role: Role::Witness, state: api },
        Source { id: "whereabouts", name: "whereabouts IPPools", role: Role::Store, state: whereabouts },
    ]
}
