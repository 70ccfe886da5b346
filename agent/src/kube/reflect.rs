//! A reflector (list, then watch with bookmarks, backoff on errors) whose
//! store keeps its last full view while the API is away, with how long that
//! view has not been known current.

use std::{
    fmt::Debug,
    hash::Hash,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime},
};

use futures::StreamExt as _;
use kube::{
    Api, Resource,
    runtime::{WatchStreamExt as _, reflector, watcher},
};
use serde::de::DeserializeOwned;
use tracing::{info, warn};

#[derive(Debug, Clone, Default)]
struct Health {
    /// A full list arrived: the store holds a complete view.
    synced: bool,
    /// Since when the watch has been failing (None while healthy).
    failing_since: Option<SystemTime>,
    last_error: Option<String>,
}

/// A running reflector of `K`.
pub struct Reflected<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    store: reflector::Store<K>,
    health: Arc<Mutex<Health>>,
    started: SystemTime,
    task: tokio::task::JoinHandle<()>,
}

impl<K> Reflected<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    /// Starts it on the current tokio runtime; `what` names it in logs.
    #[must_use]
    pub fn start(api: Api<K>, config: watcher::Config, what: &'static str) -> Self {
        let (store, writer) = reflector::store();
        let health = Arc::new(Mutex::new(Health::default()));
        let stream = watcher(api, config).default_backoff().reflect(writer);
        let task_health = Arc::clone(&health);
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(item) = stream.next().await {
                let mut h = task_health.lock().unwrap_or_else(PoisonError::into_inner);
                match item {
                    Ok(event) => {
                        if h.failing_since.take().is_some() {
                            info!("Kubernetes watch of {what} recovered");
                        }
                        if matches!(event, watcher::Event::InitDone) && !h.synced {
                            h.synced = true;
                            info!("Kubernetes {what} listed");
                        }
                    }
                    Err(e) => {
                        if h.failing_since.is_none() {
                            warn!("Kubernetes watch of {what} failing (last view kept): {e}");
                            h.failing_since = Some(SystemTime::now());
                        }
                        h.last_error = Some(e.to_string());
                    }
                }
            }
        });
        Self { store, health, started: SystemTime::now(), task }
    }

    /// The objects (None until the first full list) and how long the view
    /// has not been known current (zero while the watch is healthy).
    #[must_use]
    pub fn view(&self) -> (Option<Vec<Arc<K>>>, Duration) {
        let h = self.health.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let now = SystemTime::now();
        let since = |t: SystemTime| now.duration_since(t).unwrap_or(Duration::ZERO);
        let staleness = match (h.synced, h.failing_since) {
            (false, _) => since(self.started),
            (true, Some(t)) => since(t),
            (true, None) => Duration::ZERO,
        };
        (h.synced.then(|| self.store.state()), staleness)
    }

    /// The last watch error, while the watch is failing.
    #[must_use]
    pub fn last_error(&self) -> Option<String> {
        let h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        h.failing_since.and(h.last_error.clone())
    }
}

impl<K> Drop for Reflected<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    fn drop(&mut self) {
        self.task.abort();
    }
}
