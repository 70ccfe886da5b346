//! The Kubernetes API as an optional source (issue 12), through kube-rs.
//!
//! - [`connect`]: in-cluster config, or `--kubeconfig`/`KUBECONFIG` on a
//!   plain host; without either the source is off and says so.
//! - [`pods`]: a reflector on this node's pods (`spec.nodeName`): evidence
//!   that can only keep an IP, never release one.
//! - [`whereabouts`]: whereabouts IPPools as a store, released with
//!   resourceVersion-tested JSON patches, only for containers whose CNI run
//!   this node saw.
//! - [`events`]: Kubernetes Events (events.k8s.io/v1) for releases,
//!   conflicts and stuck sandboxes, rate-limited and grouped in series.
//! - [`agent`]: how `netreap run` uses all of the above.

pub mod agent;
pub mod events;
pub mod oneshot;
pub mod pods;
mod reflect;
pub mod whereabouts;

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use kube::config::{KubeConfigOptions, Kubeconfig};
use serde::Serialize;

/// How long one API request may take before it counts as a failure. The
/// agent's reconciles must never wait long on the API.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the in-cluster service account lives.
const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("kubeconfig {}: {source}", .path.display())]
    Kubeconfig { path: PathBuf, source: kube::config::KubeconfigError },
    #[error("kubeconfig {}: {source}", .path.display())]
    KubeconfigUse { path: PathBuf, source: Box<kube::config::KubeconfigError> },
    #[error("in-cluster configuration: {0}")]
    InCluster(#[from] kube::config::InClusterError),
    #[error("building the Kubernetes client: {0}")]
    Client(#[source] Box<kube::Error>),
    #[error("Kubernetes API: {0}")]
    Api(#[source] Box<kube::Error>),
    #[error("Kubernetes API did not answer within {0:?}")]
    Timeout(Duration),
}

impl KubeError {
    fn api(e: kube::Error) -> Self {
        Self::Api(Box::new(e))
    }

    /// The HTTP status of an API answer (409, 422, 404...), if it was one.
    #[must_use]
    pub fn status_code(&self) -> Option<u16> {
        match self {
            Self::Api(e) => match e.as_ref() {
                kube::Error::Api(status) => Some(status.code),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Runs one API request with [`REQUEST_TIMEOUT`].
pub(crate) async fn timed<T>(fut: impl Future<Output = Result<T, kube::Error>>) -> Result<T, KubeError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(result) => result.map_err(KubeError::api),
        Err(_) => Err(KubeError::Timeout(REQUEST_TIMEOUT)),
    }
}

/// Where the client's configuration came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ConfigOrigin {
    /// `--kubeconfig` or `KUBECONFIG` (the first file of a list).
    Kubeconfig { path: PathBuf },
    /// The pod's service account.
    InCluster,
}

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Kubeconfig { path } => write!(f, "kubeconfig {}", path.display()),
            Self::InCluster => f.write_str("in-cluster service account"),
        }
    }
}

/// The Kubernetes source as configured: off (and why) or a client.
pub enum KubeSource {
    Off { reason: String },
    On { client: kube::Client, origin: ConfigOrigin },
}

/// Whether a pod's service account is mounted and the API's address given.
#[must_use]
pub fn in_cluster() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() && Path::new(SERVICE_ACCOUNT_TOKEN).exists()
}

/// Builds a client: `kubeconfig` when given (a `KUBECONFIG`-style list of
/// files separated by `:` is merged), else in-cluster when running in a pod,
/// else off. Only reads configuration: no request is made here.
pub async fn connect(kubeconfig: Option<&Path>) -> Result<KubeSource, KubeError> {
    let (config, origin) = if let Some(list) = kubeconfig {
        let mut merged: Option<Kubeconfig> = None;
        let files: Vec<PathBuf> = std::env::split_paths(list).filter(|p| !p.as_os_str().is_empty()).collect();
        for path in &files {
            let next =
                Kubeconfig::read_from(path).map_err(|source| KubeError::Kubeconfig { path: path.clone(), source })?;
            merged = Some(match merged {
                None => next,
                Some(m) => m.merge(next).map_err(|source| KubeError::Kubeconfig { path: path.clone(), source })?,
            });
        }
        let first = files.first().cloned().unwrap_or_else(|| list.to_path_buf());
        let Some(merged) = merged else {
            return Ok(KubeSource::Off { reason: format!("kubeconfig {:?} names no file", list.display()) });
        };
        let config = kube::Config::from_custom_kubeconfig(merged, &KubeConfigOptions::default())
            .await
            .map_err(|source| KubeError::KubeconfigUse { path: first.clone(), source: Box::new(source) })?;
        (config, ConfigOrigin::Kubeconfig { path: first })
    } else if in_cluster() {
        (kube::Config::incluster()?, ConfigOrigin::InCluster)
    } else {
        return Ok(KubeSource::Off {
            reason: "no --kubeconfig, no KUBECONFIG, and not running in a pod (no service account)".into(),
        });
    };
    let client = kube::Client::try_from(config).map_err(|e| KubeError::Client(Box::new(e)))?;
    Ok(KubeSource::On { client, origin })
}

/// The Kubernetes row of `netreap sources`: whether the source is on, where
/// its configuration came from, and whether the API answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KubeStatus {
    /// "off", "unreachable" or "on".
    pub state: &'static str,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<ConfigOrigin>,
    /// The node whose pods are evidence (`--node-name`/`NODE_NAME`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// What a list of whereabouts IPPools answered (None: not asked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub whereabouts: Option<String>,
    /// The IPPool list answered: the whereabouts store is usable.
    pub whereabouts_active: bool,
}

impl std::fmt::Display for KubeStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kubernetes  {:<11} {}", self.state, self.detail)?;
        if let Some(wb) = &self.whereabouts {
            write!(f, "\nwhereabouts {wb}")?;
        }
        Ok(())
    }
}

/// Probes the Kubernetes source for `netreap sources`: one version request,
/// one list of this node's pods and one of IPPools (each bounded in time).
pub async fn status(kubeconfig: Option<&Path>, node_name: Option<&str>) -> KubeStatus {
    let off = |state, detail: String| KubeStatus {
        state,
        detail,
        origin: None,
        node_name: None,
        whereabouts: None,
        whereabouts_active: false,
    };
    let (client, origin) = match connect(kubeconfig).await {
        Ok(KubeSource::Off { reason }) => return off("off", reason),
        Ok(KubeSource::On { client, origin }) => (client, origin),
        Err(e) => return off("off", format!("configuration refused: {e}")),
    };
    let version = match timed(client.apiserver_version()).await {
        Ok(v) => v,
        Err(e) => {
            return KubeStatus {
                state: "unreachable",
                detail: format!("{origin}: {e}"),
                origin: Some(origin),
                node_name: node_name.map(str::to_owned),
                whereabouts: None,
                whereabouts_active: false,
            };
        }
    };
    let pods = match node_name {
        None => "no --node-name/NODE_NAME: the node's pods are not watched".to_owned(),
        Some(node) => match pods::list_once(&client, node).await {
            Ok(n) => format!("{n} pods on node {node}"),
            Err(e) => format!("listing pods of node {node}: {e}"),
        },
    };
    let (whereabouts, whereabouts_active) = match whereabouts::list_pools(&client).await {
        Ok(pools) => (format!("{} IPPools", pools.len()), true),
        Err(e) if e.status_code() == Some(404) => ("IPPool CRD not installed".to_owned(), false),
        Err(e) => (format!("listing IPPools: {e}"), false),
    };
    KubeStatus {
        state: "on",
        detail: format!("{origin}, API {}.{} ({}); {pods}", version.major, version.minor, version.git_version),
        origin: Some(origin),
        node_name: node_name.map(str::to_owned),
        whereabouts: Some(whereabouts),
        whereabouts_active,
    }
}
