//! The gRPC calls netreap makes to the runtime (CRI runtime.v1), each bounded
//! by [`super::CALL_TIMEOUT`]. Read-only: netreap never changes the runtime.

use std::{
    collections::HashMap,
    future::Future,
    path::{Path, PathBuf},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    ContainerEventResponse, GetEventsRequest, ListPodSandboxRequest, PodSandbox, PodSandboxStatusRequest,
    PodSandboxStatusResponse, StatusRequest, VersionRequest, runtime_service_client::RuntimeServiceClient,
};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::{CALL_TIMEOUT, RuntimeError};

/// What `Version` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeVersion {
    pub name: String,
    pub version: String,
    pub api_version: String,
}

impl std::fmt::Display for RuntimeVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} (CRI {})", self.name, self.version, self.api_version)
    }
}

/// A CRI runtime service client on a unix socket. Cloning shares the
/// connection; a lost connection is dialled again on the next call.
#[derive(Debug, Clone)]
pub struct CriClient {
    socket: PathBuf,
    rpc: RuntimeServiceClient<Channel>,
    timeout: Duration,
}

impl CriClient {
    /// Connects to `socket` (fails fast when nothing listens there).
    pub async fn connect(socket: &Path) -> Result<Self, RuntimeError> {
        Self::connect_with_timeout(socket, CALL_TIMEOUT).await
    }

    pub async fn connect_with_timeout(socket: &Path, timeout: Duration) -> Result<Self, RuntimeError> {
        let path = socket.to_path_buf();
        // The URI is required by the HTTP/2 layer and ignored by the connector.
        let channel = Endpoint::from_static("http://cri.invalid")
            .connect_timeout(timeout)
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
            }))
            .await
            .map_err(|source| RuntimeError::Connect { socket: socket.to_path_buf(), source })?;
        Ok(Self { socket: socket.to_path_buf(), rpc: RuntimeServiceClient::new(channel), timeout })
    }

    /// The generated client, for calls netreap itself never makes (tests
    /// drive pods through it).
    #[must_use]
    pub fn rpc(&self) -> RuntimeServiceClient<Channel> {
        self.rpc.clone()
    }

    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn call<T>(
        &self,
        call: &'static str,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, RuntimeError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(RuntimeError::Call { socket: self.socket.clone(), call, status: Box::new(status) }),
            Err(_) => Err(RuntimeError::Timeout { socket: self.socket.clone(), call, after: self.timeout }),
        }
    }

    pub async fn version(&self) -> Result<RuntimeVersion, RuntimeError> {
        let mut rpc = self.rpc.clone();
        let v = self.call("Version", rpc.version(VersionRequest { version: "v1".into() })).await?;
        Ok(RuntimeVersion { name: v.runtime_name, version: v.runtime_version, api_version: v.runtime_api_version })
    }

    /// Every sandbox the runtime knows (READY and NOTREADY).
    pub async fn list_sandboxes(&self) -> Result<Vec<PodSandbox>, RuntimeError> {
        let mut rpc = self.rpc.clone();
        Ok(self.call("ListPodSandbox", rpc.list_pod_sandbox(ListPodSandboxRequest { filter: None })).await?.items)
    }

    /// `PodSandboxStatus` with `verbose`: the runtime's `info` map holds the
    /// netns path and whether it closed it.
    pub async fn sandbox_status(&self, id: &str) -> Result<PodSandboxStatusResponse, RuntimeError> {
        let mut rpc = self.rpc.clone();
        let request = PodSandboxStatusRequest { pod_sandbox_id: id.to_owned(), verbose: true };
        self.call("PodSandboxStatus", rpc.pod_sandbox_status(request)).await
    }

    /// The runtime's verbose `Status` info (containerd: `cniconfig`).
    pub async fn status_info(&self) -> Result<HashMap<String, String>, RuntimeError> {
        let mut rpc = self.rpc.clone();
        Ok(self.call("Status", rpc.status(StatusRequest { verbose: true })).await?.info)
    }

    /// Opens the `GetContainerEvents` stream (containerd 1.7+, CRI-O):
    /// `is_unimplemented()` on the error when the runtime does not offer it.
    pub async fn container_events(&self) -> Result<tonic::Streaming<ContainerEventResponse>, RuntimeError> {
        let mut rpc = self.rpc.clone();
        self.call("GetContainerEvents", rpc.get_container_events(GetEventsRequest {})).await
    }
}
