//! This node's pods, from a reflector on `spec.nodeName=$NODE_NAME`.
//!
//! The pods are evidence that can only keep an IP: a pod reporting the IP in
//! `status.podIPs`, or a Pending pod a CNI run of the reservation's container
//! named. The reflector's store keeps its last full view while the API is
//! away (a watch error changes nothing in it), so a disconnected API neither
//! adds nor removes anything; how long the view has not been known current is
//! exported as a metric.

use std::{net::IpAddr, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client, api::ListParams, runtime::watcher};

use super::{KubeError, reflect::Reflected, timed};
use crate::engine::ApiPod;

/// The field selector of this node's pods.
#[must_use]
pub fn node_selector(node: &str) -> String {
    format!("spec.nodeName={node}")
}

/// Lists this node's pods once (for `netreap sources`).
pub async fn list_once(client: &Client, node: &str) -> Result<usize, KubeError> {
    let api: Api<Pod> = Api::all(client.clone());
    let list = timed(api.list(&ListParams::default().fields(&node_selector(node)))).await?;
    Ok(list.items.len())
}

/// A pod as evidence: None for pods that hold no IP of their own any more
/// (Succeeded, Failed: their sandboxes are gone).
#[must_use]
pub fn as_evidence(pod: &Pod) -> Option<ApiPod> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone()?;
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    let mut ips: Vec<IpAddr> =
        status.and_then(|s| s.pod_ips.as_ref()).into_iter().flatten().filter_map(|p| p.ip.parse().ok()).collect();
    if let Some(ip) = status.and_then(|s| s.pod_ip.as_deref()).and_then(|ip| ip.parse().ok())
        && !ips.contains(&ip)
    {
        ips.push(ip);
    }
    // No phase yet is the earliest moment of a pod: Pending.
    let pending = phase.is_none_or(|p| p == "Pending");
    Some(ApiPod { namespace, name, ips, pending, cni_containers: Vec::new() })
}

/// The view handed to a reconcile.
#[derive(Debug, Clone)]
pub struct PodView {
    /// None until the first full list: an unknown pod set is no evidence.
    pub pods: Option<Vec<ApiPod>>,
    /// How long the view has not been known current (zero while healthy).
    pub staleness: Duration,
}

/// The running reflector of this node's pods.
pub struct PodWatch {
    node: String,
    reflected: Reflected<Pod>,
}

impl PodWatch {
    #[must_use]
    pub fn start(client: &Client, node: &str) -> Self {
        let api: Api<Pod> = Api::all(client.clone());
        let config = watcher::Config::default().fields(&node_selector(node));
        Self { node: node.to_owned(), reflected: Reflected::start(api, config, "pods of this node") }
    }

    #[must_use]
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The pods as evidence, and how stale they are.
    #[must_use]
    pub fn view(&self) -> PodView {
        let (pods, staleness) = self.reflected.view();
        PodView { pods: pods.map(|p| p.iter().filter_map(|p| as_evidence(p)).collect()), staleness }
    }

    #[must_use]
    pub fn last_error(&self) -> Option<String> {
        self.reflected.last_error()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodIP, PodStatus};
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(phase: Option<&str>, ips: &[&str]) -> Pod {
        Pod {
            metadata: ObjectMeta { name: Some("p".into()), namespace: Some("ns".into()), ..ObjectMeta::default() },
            status: Some(PodStatus {
                phase: phase.map(str::to_owned),
                pod_ips: Some(ips.iter().map(|ip| PodIP { ip: (*ip).to_owned() }).collect()),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn running_pods_report_their_ips_and_pending_ones_say_so() {
        let running = as_evidence(&pod(Some("Running"), &["10.0.0.2", "fd00::2"])).unwrap();
        assert_eq!(running.ips.len(), 2);
        assert!(!running.pending);
        let pending = as_evidence(&pod(Some("Pending"), &[])).unwrap();
        assert!(pending.pending && pending.ips.is_empty());
        assert!(as_evidence(&pod(None, &[])).unwrap().pending, "no phase yet is Pending");
        assert!(as_evidence(&pod(Some("Succeeded"), &["10.0.0.3"])).is_none());
        assert!(as_evidence(&pod(Some("Running"), &["not an ip"])).unwrap().ips.is_empty());
    }
}
