//! The runtime's answers turned into engine types. Pure, so it is tested on
//! responses recorded from the real containerd (testdata/).
//!
//! containerd's verbose `PodSandboxStatus` puts a JSON document under
//! `info["info"]`: `runtimeSpec.linux.namespaces[type=network].path` is the
//! netns it made for the pod, `netNamespaceClosed` whether it already closed
//! (unmounted) it. CRI-O's `info["info"]` carries `runtimeSpec` too. Absent
//! keys mean "not said", never "closed".

use std::{collections::HashMap, path::PathBuf};

use serde_json::Value;

use crate::{
    engine::{PodRef, RuntimeSandbox, SandboxState},
    runtime::api,
};

/// What the verbose `info` says about a sandbox's netns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetnsInfo {
    /// The netns path in the sandbox's runtime spec.
    pub path: Option<PathBuf>,
    /// Whether the runtime says it closed it.
    pub closed: Option<bool>,
    /// The sandbox's pid (its pause process), 0 or absent when stopped.
    pub pid: Option<u32>,
}

/// Reads the netns of a sandbox from a verbose `info` map.
#[must_use]
pub fn netns_info<S: std::hash::BuildHasher>(info: &HashMap<String, String, S>) -> NetnsInfo {
    let Some(doc) = info.get("info").and_then(|text| serde_json::from_str::<Value>(text).ok()) else {
        return NetnsInfo::default();
    };
    let path = doc
        .pointer("/runtimeSpec/linux/namespaces")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|ns| ns.get("type").and_then(Value::as_str) == Some("network"))
        .and_then(|ns| ns.get("path"))
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from);
    let closed = doc.get("netNamespaceClosed").and_then(Value::as_bool);
    let pid = doc.get("pid").and_then(Value::as_u64).and_then(|p| u32::try_from(p).ok()).filter(|p| *p > 0);
    NetnsInfo { path, closed, pid }
}

/// The CNI networks a runtime attaches pods to, from its verbose `Status`
/// info (containerd: `cniconfig.Networks[].Config.Name`, the loopback
/// network left out). None when it does not say.
#[must_use]
pub fn cni_networks<S: std::hash::BuildHasher>(info: &HashMap<String, String, S>) -> Option<Vec<String>> {
    let doc: Value = serde_json::from_str(info.get("cniconfig")?).ok()?;
    let networks = doc.get("Networks")?.as_array()?;
    let names: Vec<String> = networks
        .iter()
        .filter_map(|n| n.pointer("/Config/Name").and_then(Value::as_str))
        .filter(|name| *name != "cni-loopback")
        .map(str::to_owned)
        .collect();
    Some(names)
}

#[must_use]
pub fn state(state: i32) -> SandboxState {
    if state == api::PodSandboxState::SandboxReady as i32 { SandboxState::Ready } else { SandboxState::NotReady }
}

#[must_use]
pub fn pod(metadata: Option<&api::PodSandboxMetadata>) -> Option<PodRef> {
    metadata.filter(|m| !m.name.is_empty()).map(|m| PodRef {
        namespace: m.namespace.clone(),
        name: m.name.clone(),
        uid: m.uid.clone(),
    })
}

/// Whether the sandbox shares the host's network (no netns of its own).
#[must_use]
pub fn host_network(status: &api::PodSandboxStatus) -> bool {
    status
        .linux
        .as_ref()
        .and_then(|l| l.namespaces.as_ref())
        .and_then(|n| n.options.as_ref())
        .is_some_and(|o| o.network == api::NamespaceMode::Node as i32)
}

/// A listed sandbox with what its status says about its netns.
#[must_use]
pub fn sandbox(listed: &api::PodSandbox, netns: &NetnsInfo) -> RuntimeSandbox {
    RuntimeSandbox {
        id: listed.id.clone(),
        state: state(listed.state),
        pod: pod(listed.metadata.as_ref()),
        netns: netns.path.clone(),
        netns_closed: netns.closed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(name: &str) -> HashMap<String, String> {
        let path = format!("{}/src/runtime/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn a_ready_containerd_sandbox_names_its_open_netns() {
        let info = netns_info(&recorded("containerd-1.6.20-ready.json"));
        let path = info.path.expect("netns path");
        assert!(path.to_string_lossy().contains("/netns/cni-"), "{}", path.display());
        assert_eq!(info.closed, Some(false));
        assert!(info.pid.is_some());
    }

    #[test]
    fn a_stopped_containerd_sandbox_says_its_netns_is_closed() {
        let info = netns_info(&recorded("containerd-1.6.20-stopped.json"));
        assert!(info.path.is_some());
        assert_eq!(info.closed, Some(true));
        assert_eq!(info.pid, None);
    }

    #[test]
    fn a_stuck_containerd_sandbox_keeps_its_netns_open() {
        let info = netns_info(&recorded("containerd-1.6.20-stuck.json"));
        assert!(info.path.is_some());
        assert_eq!(info.closed, Some(false));
    }

    #[test]
    fn containerd_status_names_its_cni_networks() {
        assert_eq!(cni_networks(&recorded("containerd-1.6.20-status.json")), Some(vec!["nrCnet".to_owned()]));
    }

    #[test]
    fn missing_or_malformed_info_says_nothing() {
        assert_eq!(netns_info(&HashMap::new()), NetnsInfo::default());
        let bad = HashMap::from([("info".to_owned(), "{not json".to_owned())]);
        assert_eq!(netns_info(&bad), NetnsInfo::default());
        // A runtime spec without a network namespace path (host network).
        let host = HashMap::from([(
            "info".to_owned(),
            r#"{"runtimeSpec":{"linux":{"namespaces":[{"type":"pid"},{"type":"network"}]}}}"#.to_owned(),
        )]);
        assert_eq!(netns_info(&host).path, None);
        assert_eq!(netns_info(&host).closed, None, "absent is not closed");
        assert_eq!(cni_networks(&HashMap::new()), None);
    }
}
