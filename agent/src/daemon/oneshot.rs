//! Evidence for one-shot commands (`scan`, `release --from-report`): the
//! kernel model after a full sync, and the CNI cache. No ledger: CNI runs
//! are only seen by a running agent, so a one-shot view keeps more.

use std::time::SystemTime;

use crate::{
    config::Config,
    engine::{Observations, Policy},
    ipam::{ReservationStore, cnicache::CniCache, hostlocal::HostLocalStore},
    ledger::Ledger,
    model::{Watcher, WatcherConfig},
};

use super::evidence;

/// The stores a configuration names.
#[must_use]
pub fn stores(config: &Config) -> Vec<HostLocalStore> {
    config.host_local_dirs.iter().map(HostLocalStore::new).collect()
}

#[must_use]
pub fn as_dyn(stores: &[HostLocalStore]) -> Vec<&dyn ReservationStore> {
    stores.iter().map(|s| s as &dyn ReservationStore).collect()
}

#[must_use]
pub fn policy(config: &Config) -> Policy {
    Policy { in_flight_grace: config.in_flight_grace, orphan_grace: config.orphan_grace }
}

/// Syncs the model once and returns the observations (cache included).
pub async fn observe(config: &Config) -> anyhow::Result<Observations> {
    let discovery = crate::discovery::DiscoveryPaths::with_mountinfo(config.mountinfo.clone());
    let (watcher, _deaths) = Watcher::start(WatcherConfig { discovery, ..WatcherConfig::default() }).await?;
    let snapshot = watcher.snapshot().await?;
    watcher.stop().await?;
    let cache = CniCache::new(config.cni_cache_dir.clone()).scan();
    let mut obs = evidence::observations(&snapshot, &Ledger::new(), &cache.attachments, None, None);
    // Optional: without it the report says "runtime unavailable".
    let mut runtime = crate::runtime::RuntimeWitness::new(config.cri_socket.clone());
    if !runtime.is_off() {
        match runtime.view().await {
            Ok(view) => obs.set_runtime(Some(view)),
            Err(e) => tracing::info!("container runtime not used: {e}"),
        }
    }
    Ok(obs)
}

/// Blocking wrapper for CLI commands.
pub fn observe_blocking(config: &Config) -> anyhow::Result<(Observations, SystemTime)> {
    let obs = tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(observe(config))?;
    Ok((obs, SystemTime::now()))
}
