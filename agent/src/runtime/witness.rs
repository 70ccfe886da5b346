//! One [`RuntimeView`] per reconcile: `ListPodSandbox`, plus a verbose
//! `PodSandboxStatus` for sandboxes not seen before and for every NOTREADY
//! one (whether its netns is closed changes while it is stopped). A READY
//! sandbox's netns path never changes, so it is asked once.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    path::PathBuf,
    time::SystemTime,
};

use super::{
    RuntimeError,
    client::{CriClient, RuntimeVersion},
    info::{self, NetnsInfo},
    socket::{self, SocketChoice},
};
use crate::engine::{PodRef, RuntimeView, SandboxState};

/// How many departed sandboxes' pod names are remembered (for naming pods
/// in release events after the runtime forgot them).
const DEPARTED_KEPT: usize = 1024;

/// The runtime as a source: where it is, and what was learnt that does not
/// change.
pub struct RuntimeWitness {
    configured: Option<PathBuf>,
    choice: SocketChoice,
    client: Option<CriClient>,
    version: Option<RuntimeVersion>,
    networks: Option<Vec<String>>,
    /// Netns of sandboxes last seen READY (stable while READY).
    ready_netns: HashMap<String, NetnsInfo>,
    /// Pods of listed sandboxes, to remember them once they go.
    listed_pods: HashMap<String, PodRef>,
    departed: BTreeMap<String, PodRef>,
    departed_order: VecDeque<String>,
}

impl RuntimeWitness {
    /// `configured`: the `cri_socket` setting (None: look at the defaults).
    #[must_use]
    pub fn new(configured: Option<PathBuf>) -> Self {
        let choice = socket::choose(configured.as_deref());
        Self {
            configured,
            choice,
            client: None,
            version: None,
            networks: None,
            ready_netns: HashMap::new(),
            listed_pods: HashMap::new(),
            departed: BTreeMap::new(),
            departed_order: VecDeque::new(),
        }
    }

    #[must_use]
    pub fn choice(&self) -> &SocketChoice {
        &self.choice
    }

    /// The runtime's name and version once it answered.
    #[must_use]
    pub fn version(&self) -> Option<&RuntimeVersion> {
        self.version.as_ref()
    }

    /// Whether the configuration turned the runtime off.
    #[must_use]
    pub fn is_off(&self) -> bool {
        self.choice == SocketChoice::Off
    }

    async fn client(&mut self) -> Result<CriClient, RuntimeError> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        if self.choice.path().is_none() && !self.is_off() {
            // A runtime may start after netreap: look again.
            self.choice = socket::choose(self.configured.as_deref());
        }
        let Some(path) = self.choice.path() else { return Err(RuntimeError::NoSocket(self.choice.to_string())) };
        let client = CriClient::connect(path).await?;
        self.version = Some(client.version().await?);
        // Optional: a runtime that does not say leaves every network judged.
        self.networks = client.status_info().await.ok().as_ref().and_then(info::cni_networks);
        self.client = Some(client.clone());
        Ok(client)
    }

    /// The sandbox list now. On error the connection is dropped (the next
    /// call dials again and re-reads the version: the runtime may have been
    /// restarted or upgraded).
    pub async fn view(&mut self) -> Result<RuntimeView, RuntimeError> {
        let result = self.try_view().await;
        if result.is_err() {
            self.client = None;
        }
        result
    }

    async fn try_view(&mut self) -> Result<RuntimeView, RuntimeError> {
        let client = self.client().await?;
        let listed = client.list_sandboxes().await?;
        let listed_at = SystemTime::now();
        let mut sandboxes = BTreeMap::new();
        let mut ready_netns = HashMap::with_capacity(listed.len());
        let mut listed_pods = HashMap::with_capacity(listed.len());
        for s in &listed {
            let ready = info::state(s.state) == SandboxState::Ready;
            let netns = match self.ready_netns.remove(&s.id).filter(|_| ready) {
                Some(known) => known,
                None => match client.sandbox_status(&s.id).await {
                    Ok(status) => info::netns_info(&status.info),
                    // Removed between the list and the status: say nothing
                    // about its netns (it is still listed, so it keeps if READY).
                    Err(e) if matches!(&e, RuntimeError::Call { status, .. } if status.code() == tonic::Code::NotFound) => {
                        NetnsInfo::default()
                    }
                    Err(e) => return Err(e),
                },
            };
            let sandbox = info::sandbox(s, &netns);
            if ready {
                ready_netns.insert(s.id.clone(), netns);
            }
            if let Some(pod) = &sandbox.pod {
                listed_pods.insert(s.id.clone(), pod.clone());
            }
            sandboxes.insert(s.id.clone(), sandbox);
        }
        let gone: Vec<(String, PodRef)> =
            self.listed_pods.drain().filter(|(id, _)| !listed_pods.contains_key(id)).collect();
        for (id, pod) in gone {
            self.remember_departed(id, pod);
        }
        self.listed_pods = listed_pods;
        self.ready_netns = ready_netns;
        let runtime = self.version.as_ref().map_or_else(|| "CRI runtime".to_owned(), ToString::to_string);
        Ok(RuntimeView {
            runtime,
            listed_at,
            sandboxes,
            networks: self.networks.clone(),
            departed: self.departed.clone(),
        })
    }

    fn remember_departed(&mut self, id: String, pod: PodRef) {
        if self.departed.insert(id.clone(), pod).is_none() {
            self.departed_order.push_back(id);
        }
        while self.departed_order.len() > DEPARTED_KEPT {
            if let Some(old) = self.departed_order.pop_front() {
                self.departed.remove(&old);
            }
        }
    }

    /// A client for the event stream, when connected.
    #[must_use]
    pub fn connected(&self) -> Option<CriClient> {
        self.client.clone()
    }
}
