//! Lookup tables over one set of observations, built once per `decide`, so
//! judging N reservations costs O(N + observations) instead of their
//! product. Every lookup returns candidates in the observations' own order,
//! so verdicts and their evidence are exactly what a linear search gives.

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    path::{Component, Path, PathBuf},
    sync::Arc,
};

use super::observations::{ApiPod, Binding, CniOp, DeadNetns, LiveNetns, NetnsId, NetnsName, Observations};

/// The form under which [`super::observations::same_netns_path`] calls two
/// paths equal: `/var/run` folded into `/run`, components without the root.
#[must_use]
pub fn path_key(p: &Path) -> PathBuf {
    let p = p.strip_prefix("/var").ok().filter(|rest| rest.starts_with("run")).unwrap_or(p);
    // One allocation of the final size, not one regrowth per component
    // (this runs for every path of every netns on each index build).
    let mut key = PathBuf::with_capacity(p.as_os_str().len());
    p.components().filter(|c| !matches!(c, Component::RootDir)).for_each(|c| key.push(c));
    key
}

fn push<K: std::hash::Hash + Eq>(map: &mut HashMap<K, Vec<usize>>, key: K, i: usize) {
    let v = map.entry(key).or_default();
    if v.last() != Some(&i) {
        v.push(i);
    }
}

/// A live netns with the lists facts cite, shared.
pub struct LiveShared<'a> {
    pub netns: &'a LiveNetns,
    pub paths: Arc<[PathBuf]>,
    pub containers: Arc<[String]>,
}

pub struct Index<'a> {
    pub obs: &'a Observations,
    live_by_inode: HashMap<u64, Vec<usize>>,
    live_by_nsid: HashMap<i32, Vec<usize>>,
    live_by_path: HashMap<PathBuf, Vec<usize>>,
    live_by_ip: HashMap<IpAddr, Vec<usize>>,
    live_by_container: HashMap<&'a str, Vec<usize>>,
    dead_by_inode: HashMap<u64, Vec<usize>>,
    dead_by_nsid: HashMap<i32, Vec<usize>>,
    dead_by_path: HashMap<PathBuf, Vec<usize>>,
    dead_by_container: HashMap<&'a str, Vec<usize>>,
    /// Dead netns bound to no known container, by the addresses they held.
    unowned_dead_by_ip: HashMap<IpAddr, Vec<usize>>,
    bindings_by_container: HashMap<&'a str, Vec<usize>>,
    /// Runs by exact container ID (truncated IDs included as written).
    ops_by_container: HashMap<&'a str, Vec<usize>>,
    /// Runs that may concern any container: no ID, or a truncated one.
    ops_wildcard: Vec<usize>,
    sandboxes: Option<HashSet<&'a str>>,
    pods_by_ip: HashMap<IpAddr, Vec<usize>>,
    /// Per live netns, its paths and containers in the shared form facts
    /// cite them in: 100k verdicts about 10k netns hold 10k lists, not 100k.
    live_paths: Vec<Arc<[PathBuf]>>,
    live_containers: Vec<Arc<[String]>>,
    /// Per binding, its netns name in the shared form facts cite it in.
    binding_names: Vec<Arc<NetnsName>>,
}

impl<'a> Index<'a> {
    #[must_use]
    pub fn new(obs: &'a Observations) -> Self {
        let mut ix = Self {
            obs,
            live_by_inode: HashMap::new(),
            live_by_nsid: HashMap::new(),
            live_by_path: HashMap::new(),
            live_by_ip: HashMap::new(),
            live_by_container: HashMap::new(),
            dead_by_inode: HashMap::new(),
            dead_by_nsid: HashMap::new(),
            dead_by_path: HashMap::new(),
            dead_by_container: HashMap::new(),
            unowned_dead_by_ip: HashMap::new(),
            bindings_by_container: HashMap::new(),
            ops_by_container: HashMap::new(),
            ops_wildcard: Vec::new(),
            sandboxes: obs.runtime_sandboxes.as_ref().map(|s| s.iter().map(String::as_str).collect()),
            pods_by_ip: HashMap::new(),
            live_paths: obs.live.iter().map(|n| Arc::from(n.paths.as_slice())).collect(),
            live_containers: obs.live.iter().map(|n| Arc::from(n.container_ids.as_slice())).collect(),
            binding_names: obs.bindings.iter().map(|b| Arc::new(b.netns.clone())).collect(),
        };
        for (i, n) in obs.live.iter().enumerate() {
            n.id.inode.into_iter().for_each(|k| push(&mut ix.live_by_inode, k, i));
            n.id.nsid.into_iter().for_each(|k| push(&mut ix.live_by_nsid, k, i));
            n.paths.iter().for_each(|p| push(&mut ix.live_by_path, path_key(p), i));
            n.addresses.iter().for_each(|a| push(&mut ix.live_by_ip, *a, i));
            n.container_ids.iter().for_each(|c| push(&mut ix.live_by_container, c.as_str(), i));
        }
        for (i, d) in obs.dead.iter().enumerate() {
            d.id.inode.into_iter().for_each(|k| push(&mut ix.dead_by_inode, k, i));
            d.id.nsid.into_iter().for_each(|k| push(&mut ix.dead_by_nsid, k, i));
            d.paths.iter().for_each(|p| push(&mut ix.dead_by_path, path_key(p), i));
            d.container_ids.iter().for_each(|c| push(&mut ix.dead_by_container, c.as_str(), i));
            if d.container_ids.is_empty() {
                d.addresses.iter().for_each(|a| push(&mut ix.unowned_dead_by_ip, *a, i));
            }
        }
        for (i, b) in obs.bindings.iter().enumerate() {
            push(&mut ix.bindings_by_container, b.container_id.as_str(), i);
        }
        for (i, op) in obs.cni_ops.iter().enumerate() {
            if let Some(id) = &op.container_id {
                push(&mut ix.ops_by_container, id.as_str(), i);
            }
            if op.container_id.is_none() || op.container_id_truncated {
                ix.ops_wildcard.push(i);
            }
        }
        if let Some(pods) = &obs.api_pods {
            for (i, p) in pods.iter().enumerate() {
                p.ips.iter().for_each(|ip| push(&mut ix.pods_by_ip, *ip, i));
            }
        }
        ix
    }

    /// Candidates for an identity, by inode and by nsid, in observation
    /// order (a netns known only by nsid is found through its nsid).
    fn by_id<'m>(
        by_inode: &'m HashMap<u64, Vec<usize>>,
        by_nsid: &'m HashMap<i32, Vec<usize>>,
        id: &NetnsId,
    ) -> impl Iterator<Item = &'m usize> + 'm {
        let mut found: Vec<&usize> = id
            .inode
            .and_then(|i| by_inode.get(&i))
            .into_iter()
            .flatten()
            .chain(id.nsid.and_then(|n| by_nsid.get(&n)).into_iter().flatten())
            .collect();
        found.sort_unstable();
        found.dedup();
        found.into_iter()
    }

    /// Live netns a reference may name (first in observation order).
    #[must_use]
    pub fn live_matching(&self, netns: &NetnsName) -> Option<&'a LiveNetns> {
        let obs = self.obs;
        match netns {
            NetnsName::Id(id) => Self::by_id(&self.live_by_inode, &self.live_by_nsid, id)
                .map(|&i| &obs.live[i])
                .find(|n| n.id.may_be(id)),
            NetnsName::Path(p) => self.live_by_path.get(&path_key(p))?.first().map(|&i| &obs.live[i]),
        }
    }

    /// Dead netns a reference may name, seen bound before it died.
    #[must_use]
    pub fn dead_matching(&self, netns: &NetnsName, seen_at: std::time::SystemTime) -> Option<&'a DeadNetns> {
        let obs = self.obs;
        let bucket = match netns {
            NetnsName::Id(id) => Self::by_id(&self.dead_by_inode, &self.dead_by_nsid, id).collect::<Vec<_>>(),
            NetnsName::Path(p) => self.dead_by_path.get(&path_key(p))?.iter().collect(),
        };
        bucket.into_iter().map(|&i| &obs.dead[i]).find(|d| {
            seen_at <= d.died_at
                && match netns {
                    NetnsName::Id(id) => d.id.may_be(id),
                    NetnsName::Path(_) => true,
                }
        })
    }

    pub fn live_holding(&self, ip: IpAddr) -> impl Iterator<Item = &'a LiveNetns> + '_ {
        self.live_by_ip.get(&ip).into_iter().flatten().map(|&i| &self.obs.live[i])
    }

    /// [`Index::live_holding`] with each netns' paths and containers in
    /// their shared form.
    pub fn live_holding_shared(&self, ip: IpAddr) -> impl Iterator<Item = LiveShared<'a>> + '_ {
        self.live_by_ip.get(&ip).into_iter().flatten().map(|&i| LiveShared {
            netns: &self.obs.live[i],
            paths: Arc::clone(&self.live_paths[i]),
            containers: Arc::clone(&self.live_containers[i]),
        })
    }

    pub fn live_of_container(&self, cid: &str) -> impl Iterator<Item = &'a LiveNetns> + '_ {
        self.live_by_container.get(cid).into_iter().flatten().map(|&i| &self.obs.live[i])
    }

    /// Dead netns of this container, and unowned dead netns that held `ip`,
    /// in observation order; the flag says which (true: the container's).
    #[must_use]
    pub fn dead_of_container_or_ip(&self, cid: &str, ip: IpAddr) -> Vec<(&'a DeadNetns, bool)> {
        let mut idx: Vec<(usize, bool)> = self
            .dead_by_container
            .get(cid)
            .into_iter()
            .flatten()
            .map(|&i| (i, true))
            .chain(self.unowned_dead_by_ip.get(&ip).into_iter().flatten().map(|&i| (i, false)))
            .collect();
        idx.sort_unstable();
        idx.dedup_by_key(|(i, _)| *i);
        idx.into_iter().map(|(i, own)| (&self.obs.dead[i], own)).collect()
    }

    pub fn bindings_of(&self, cid: &str) -> impl Iterator<Item = &'a Binding> + '_ {
        self.bindings_by_container.get(cid).into_iter().flatten().map(|&i| &self.obs.bindings[i])
    }

    /// [`Index::bindings_of`], each with its netns name in the shared form.
    pub fn bindings_of_shared(&self, cid: &str) -> impl Iterator<Item = (&'a Binding, Arc<NetnsName>)> + '_ {
        self.bindings_by_container
            .get(cid)
            .into_iter()
            .flatten()
            .map(|&i| (&self.obs.bindings[i], Arc::clone(&self.binding_names[i])))
    }

    /// Runs that may concern `cid`, in observation order.
    #[must_use]
    pub fn ops_concerning(&self, cid: &str) -> Vec<&'a CniOp> {
        let mut idx: Vec<usize> = self.ops_by_container.get(cid).into_iter().flatten().copied().collect();
        idx.extend(self.ops_wildcard.iter().copied().filter(|&i| self.obs.cni_ops[i].may_concern(cid)));
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| &self.obs.cni_ops[i]).filter(|op| op.may_concern(cid)).collect()
    }

    /// Runs whose container ID is exactly `cid`.
    pub fn ops_of_exactly(&self, cid: &str) -> impl Iterator<Item = &'a CniOp> + '_ {
        self.ops_by_container.get(cid).into_iter().flatten().map(|&i| &self.obs.cni_ops[i])
    }

    /// None when the runtime is not a source.
    #[must_use]
    pub fn runtime_lists(&self, cid: &str) -> Option<bool> {
        self.sandboxes.as_ref().map(|s| s.contains(cid))
    }

    pub fn pods_with(&self, ip: IpAddr) -> impl Iterator<Item = &'a ApiPod> + '_ {
        let pods = self.obs.api_pods.as_deref().unwrap_or_default();
        self.pods_by_ip.get(&ip).into_iter().flatten().map(move |&i| &pods[i])
    }
}
