//! Maps what the agent observed (the kernel model, the attachment ledger,
//! the CNI cache) onto the decision engine's inputs.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::SystemTime,
};

use crate::{
    engine::{
        Observations,
        index::path_key,
        observations::{Binding, BindingSource, CniOp, DeadNetns, LiveNetns, NetnsId, NetnsRef},
    },
    ipam::cnicache::CachedAttachment,
    ledger::Ledger,
    model::snapshot::{ModelSnapshot, NetnsView},
};

fn netns_id(view: &NetnsView) -> Option<NetnsId> {
    view.inode.map(|inode| NetnsId { inode: u64::from(inode), nsid: view.nsid })
}

/// Containers tied to each netns: by inode from the ledger, by path from the
/// cache. Built once per observation, so a node with many pods stays linear.
struct ContainerIndex {
    by_inode: HashMap<u64, Vec<String>>,
    by_path: HashMap<PathBuf, Vec<String>>,
}

impl ContainerIndex {
    fn new(ledger: &Ledger, cache: &[CachedAttachment]) -> Self {
        let mut by_inode: HashMap<u64, Vec<String>> = HashMap::new();
        for a in ledger.attachments() {
            if let Some(inode) = a.netns_inode {
                by_inode.entry(inode).or_default().push(a.container_id.clone());
            }
        }
        let mut by_path: HashMap<PathBuf, Vec<String>> = HashMap::new();
        for entry in cache {
            if let Some(path) = entry.netns.as_deref() {
                by_path.entry(path_key(Path::new(path))).or_default().push(entry.container_id.clone());
            }
        }
        Self { by_inode, by_path }
    }

    fn containers_of(&self, view: &NetnsView) -> Vec<String> {
        let mut ids: Vec<String> =
            view.inode.and_then(|i| self.by_inode.get(&u64::from(i))).cloned().unwrap_or_default();
        for mount in &view.bind_mounts {
            ids.extend(self.by_path.get(&path_key(mount)).into_iter().flatten().cloned());
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

/// Everything the engine needs, from one model snapshot, the ledger and a
/// cache scan. `watching_since` is when the probes last started recording
/// without a gap (None for a one-shot scan that saw no CNI run).
#[must_use]
pub fn observations(
    snapshot: &ModelSnapshot,
    ledger: &Ledger,
    cache: &[CachedAttachment],
    watching_since: Option<SystemTime>,
) -> Observations {
    let mut obs = Observations { watching_since, ..Observations::default() };
    let containers = ContainerIndex::new(ledger, cache);
    for view in &snapshot.netns {
        let Some(id) = netns_id(view) else { continue };
        let container_ids = containers.containers_of(view);
        let addresses = view.global_addresses().map(|a| a.ip).collect();
        let paths: Vec<PathBuf> = view.bind_mounts.clone();
        match (view.alive, view.died_at) {
            (true, _) => obs.live.push(LiveNetns { id, container_ids, addresses, paths }),
            (false, Some(died_at)) => obs.dead.push(DeadNetns { id, died_at, container_ids, addresses, paths }),
            // Dead without a time cannot anchor a release: leave it out.
            (false, None) => {}
        }
    }
    for a in ledger.attachments() {
        let seen_at = a.first_seen;
        let netns = match (a.netns_inode, &a.netns_path) {
            (Some(inode), _) => NetnsRef::Id(NetnsId { inode, nsid: None }),
            (None, Some(path)) => NetnsRef::Path(PathBuf::from(path)),
            (None, None) => continue,
        };
        obs.bindings.push(Binding { container_id: a.container_id.clone(), netns, source: BindingSource::CniExec, seen_at });
        for op in &a.operations {
            obs.cni_ops.push(CniOp {
                container_id: Some(a.container_id.clone()),
                container_id_truncated: op.truncated,
                command: op.command.clone(),
                plugin: op.plugin.clone(),
                started_at: op.started_at,
                finished_at: op.finished_at,
                exit_code: op.exit.as_ref().and_then(|e| e.exit_code),
            });
        }
    }
    obs.add_cached_attachments(cache);
    obs
}
