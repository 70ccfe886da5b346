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

/// The tables' hash maps: foldhash, seeded per process, instead of SipHash
/// (most keys are 64-byte container IDs and every reservation looks up
/// several).
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Positions in an observation list, in order. Almost every key (an IP, a
/// container, a path) names one netns: that one is kept inline, not in a
/// vector of its own (100k addresses make 100k keys).
#[derive(Debug, Clone)]
enum Positions {
    One(u32),
    #[expect(
        clippy::box_collection,
        reason = "16 bytes a key instead of 32: the rare key with many pays a second allocation"
    )]
    Many(Box<Vec<u32>>),
}

impl Positions {
    fn as_slice(&self) -> &[u32] {
        match self {
            Self::One(i) => std::slice::from_ref(i),
            Self::Many(v) => v,
        }
    }
}

/// Positions of `key` (none when absent), in order.
fn at<'m, K, Q>(map: &'m Map<K, Positions>, key: &Q) -> impl Iterator<Item = usize> + use<'m, K, Q>
where
    K: std::hash::Hash + Eq + std::borrow::Borrow<Q>,
    Q: std::hash::Hash + Eq + ?Sized,
{
    map.get(key).map(Positions::as_slice).unwrap_or_default().iter().map(|&i| i as usize)
}

fn push<K: std::hash::Hash + Eq>(map: &mut Map<K, Positions>, key: K, i: usize) {
    // An observation list longer than u32 positions cannot be held in memory.
    let i = u32::try_from(i).unwrap_or(u32::MAX);
    match map.entry(key) {
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(Positions::One(i));
        }
        std::collections::hash_map::Entry::Occupied(mut e) => match e.get_mut() {
            Positions::One(last) if *last == i => {}
            Positions::One(first) => {
                let first = *first;
                e.insert(Positions::Many(Box::new(vec![first, i])));
            }
            Positions::Many(v) => {
                if v.last() != Some(&i) {
                    v.push(i);
                }
            }
        },
    }
}

/// Where a binding's netns stands: what [`Index::live_matching`] and
/// [`Index::dead_matching`] say of it, found once per binding instead of
/// once per reservation of its container, and only for bindings of a
/// container some judged reservation names (see [`Index::binding_resolved`]).
#[derive(Debug, Clone, Copy)]
enum Resolved {
    Live(usize),
    Dead(usize),
    Unresolved,
}

/// A binding of a container, with where its netns stands.
pub enum BindingLink<'a> {
    Live(&'a LiveNetns),
    Dead(&'a DeadNetns),
    Unresolved,
}

/// A live netns with the lists facts cite, shared.
pub struct LiveShared<'a> {
    pub netns: &'a LiveNetns,
    pub paths: Arc<[PathBuf]>,
    pub containers: Arc<[String]>,
}

pub struct Index<'a> {
    pub obs: &'a Observations,
    live_by_inode: Map<u64, Positions>,
    live_by_nsid: Map<i32, Positions>,
    live_by_path: Map<PathBuf, Positions>,
    live_by_ip: Map<IpAddr, Positions>,
    live_by_container: Map<&'a str, Positions>,
    dead_by_inode: Map<u64, Positions>,
    dead_by_nsid: Map<i32, Positions>,
    dead_by_path: Map<PathBuf, Positions>,
    dead_by_container: Map<&'a str, Positions>,
    /// Dead netns bound to no known container, by the addresses they held.
    unowned_dead_by_ip: Map<IpAddr, Positions>,
    bindings_by_container: Map<&'a str, Positions>,
    /// Runs by exact container ID (truncated IDs included as written).
    ops_by_container: Map<&'a str, Positions>,
    /// Runs that may concern any container: no ID, or a truncated one.
    ops_wildcard: Vec<usize>,
    sandboxes: Option<HashSet<&'a str, foldhash::fast::RandomState>>,
    pods_by_ip: Map<IpAddr, Positions>,
    /// Per live netns, its paths and containers in the shared form facts
    /// cite them in: 100k verdicts about 10k netns hold 10k lists, not 100k.
    live_paths: Vec<Arc<[PathBuf]>>,
    live_containers: Vec<Arc<[String]>>,
    /// Per binding, its netns name in the shared form facts cite it in.
    /// Filled on first use, like `binding_resolved` (`OnceLock`s: a large
    /// decision shares one index between two threads).
    binding_names: Vec<std::sync::OnceLock<Arc<NetnsName>>>,
    /// Per binding, where its netns stands, found on first use: a pass that
    /// judges a few reservations (a death's) resolves only their
    /// containers' bindings, not every binding of the node's recent history.
    /// The answer depends on the observations alone (never on which
    /// reservation asked, or when), so finding it late changes nothing.
    binding_resolved: Vec<std::sync::OnceLock<Resolved>>,
}

/// The live netns by the addresses they hold: the largest table (one key
/// per address of the node), sized up front from what will be filed
/// (almost every key is distinct): 100k addresses grown by doubling rehash
/// every key about twice over.
fn live_by_ip(obs: &Observations) -> Map<IpAddr, Positions> {
    let mut by_ip = Map::default();
    by_ip.reserve(obs.live.iter().map(|n| n.addresses.len()).sum());
    for (i, n) in obs.live.iter().enumerate() {
        n.addresses.iter().for_each(|a| push(&mut by_ip, *a, i));
    }
    by_ip
}

impl<'a> Index<'a> {
    #[must_use]
    pub fn new(obs: &'a Observations) -> Self {
        Self::build(obs, false)
    }

    /// [`Index::new`]; when `parallel`, the addresses' table is filled on a
    /// helper thread while this one fills the others (each is filled by
    /// one thread, in observation order, so the tables are the same).
    pub(super) fn build(obs: &'a Observations, parallel: bool) -> Self {
        if !parallel {
            let mut ix = Self::without_addresses(obs);
            ix.live_by_ip = live_by_ip(obs);
            return ix;
        }
        std::thread::scope(|s| {
            let helper = std::thread::Builder::new().name("netreap-index".into()).spawn_scoped(s, || live_by_ip(obs));
            let mut ix = Self::without_addresses(obs);
            // A thread that cannot be started: its table is filled here.
            ix.live_by_ip = match helper.map(std::thread::ScopedJoinHandle::join) {
                Ok(Ok(by_ip)) => by_ip,
                _ => live_by_ip(obs),
            };
            ix
        })
    }

    /// Every table but `live_by_ip` (left empty).
    fn without_addresses(obs: &'a Observations) -> Self {
        let mut ix = Self {
            obs,
            live_by_inode: Map::default(),
            live_by_nsid: Map::default(),
            live_by_path: Map::default(),
            live_by_ip: Map::default(),
            live_by_container: Map::default(),
            dead_by_inode: Map::default(),
            dead_by_nsid: Map::default(),
            dead_by_path: Map::default(),
            dead_by_container: Map::default(),
            unowned_dead_by_ip: Map::default(),
            bindings_by_container: Map::default(),
            ops_by_container: Map::default(),
            ops_wildcard: Vec::new(),
            sandboxes: obs.runtime_sandboxes.as_ref().map(|s| s.iter().map(String::as_str).collect()),
            pods_by_ip: Map::default(),
            live_paths: obs.live.iter().map(|n| Arc::from(n.paths.as_slice())).collect(),
            live_containers: obs.live.iter().map(|n| Arc::from(n.container_ids.as_slice())).collect(),
            binding_names: obs.bindings.iter().map(|_| std::sync::OnceLock::new()).collect(),
            binding_resolved: obs.bindings.iter().map(|_| std::sync::OnceLock::new()).collect(),
        };
        // Sized up front from what will be filed (see `live_by_ip`).
        ix.live_by_inode.reserve(obs.live.len());
        ix.live_by_nsid.reserve(obs.live.len());
        ix.live_by_path.reserve(obs.live.len());
        ix.live_by_container.reserve(obs.live.len());
        ix.dead_by_inode.reserve(obs.dead.len());
        ix.dead_by_nsid.reserve(obs.dead.len());
        ix.dead_by_path.reserve(obs.dead.len());
        ix.dead_by_container.reserve(obs.dead.len());
        ix.bindings_by_container.reserve(obs.bindings.len());
        for (i, n) in obs.live.iter().enumerate() {
            n.id.inode.into_iter().for_each(|k| push(&mut ix.live_by_inode, k, i));
            n.id.nsid.into_iter().for_each(|k| push(&mut ix.live_by_nsid, k, i));
            n.paths.iter().for_each(|p| push(&mut ix.live_by_path, path_key(p), i));
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

    /// Where binding `i`'s netns stands (found once, on first use).
    fn binding_resolved(&self, i: usize) -> Resolved {
        *self.binding_resolved[i].get_or_init(|| {
            let b = &self.obs.bindings[i];
            if let Some(n) = self.live_position(&b.netns) {
                Resolved::Live(n)
            } else if let Some(n) = self.dead_position(&b.netns, b.seen_at) {
                Resolved::Dead(n)
            } else {
                Resolved::Unresolved
            }
        })
    }

    /// The first position, in observation order, filed under `id`'s inode
    /// or its nsid that `matches` accepts (a netns known only by nsid is
    /// found through its nsid).
    ///
    /// Both lists are in ascending order (`push` files positions as the
    /// observations are walked), so a merge of the two visits their union in
    /// order, each position once, and stops at the first match: the answer
    /// of sorting and deduplicating the union, then finding, without
    /// allocating. Kernels reuse the lowest free netns inode and nsid, so
    /// under pod churn nearly every dead netns is filed under the same key:
    /// sorting that bucket again for every binding made the index quadratic
    /// in the node's recent history.
    fn first_by_id(
        by_inode: &Map<u64, Positions>,
        by_nsid: &Map<i32, Positions>,
        id: &NetnsId,
        mut matches: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        let inodes = id.inode.and_then(|i| by_inode.get(&i)).map_or(&[][..], Positions::as_slice);
        let nsids = id.nsid.and_then(|n| by_nsid.get(&n)).map_or(&[][..], Positions::as_slice);
        let (mut a, mut b) = (inodes.iter().peekable(), nsids.iter().peekable());
        loop {
            let next = match (a.peek(), b.peek()) {
                (None, None) => return None,
                (Some(&&x), None) => {
                    a.next();
                    x
                }
                (None, Some(&&y)) => {
                    b.next();
                    y
                }
                (Some(&&x), Some(&&y)) => {
                    if x <= y {
                        a.next();
                    }
                    if y <= x {
                        b.next();
                    }
                    x.min(y)
                }
            };
            let i = next as usize;
            if matches(i) {
                return Some(i);
            }
        }
    }

    /// Position of the live netns a reference may name (first in
    /// observation order).
    fn live_position(&self, netns: &NetnsName) -> Option<usize> {
        let obs = self.obs;
        match netns {
            NetnsName::Id(id) => {
                Self::first_by_id(&self.live_by_inode, &self.live_by_nsid, id, |i| obs.live[i].id.may_be(id))
            }
            NetnsName::Path(p) => at(&self.live_by_path, &path_key(p)).next(),
        }
    }

    /// Position of the dead netns a reference may name, seen bound before
    /// it died.
    fn dead_position(&self, netns: &NetnsName, seen_at: std::time::SystemTime) -> Option<usize> {
        let obs = self.obs;
        match netns {
            NetnsName::Id(id) => Self::first_by_id(&self.dead_by_inode, &self.dead_by_nsid, id, |i| {
                let d = &obs.dead[i];
                seen_at <= d.died_at && d.id.may_be(id)
            }),
            NetnsName::Path(p) => at(&self.dead_by_path, &path_key(p)).find(|&i| seen_at <= obs.dead[i].died_at),
        }
    }

    /// Live netns a reference may name (first in observation order).
    #[must_use]
    pub fn live_matching(&self, netns: &NetnsName) -> Option<&'a LiveNetns> {
        let obs = self.obs;
        self.live_position(netns).map(|i| &obs.live[i])
    }

    /// Dead netns a reference may name, seen bound before it died.
    #[must_use]
    pub fn dead_matching(&self, netns: &NetnsName, seen_at: std::time::SystemTime) -> Option<&'a DeadNetns> {
        let obs = self.obs;
        self.dead_position(netns, seen_at).map(|i| &obs.dead[i])
    }

    pub fn live_holding(&self, ip: IpAddr) -> impl Iterator<Item = &'a LiveNetns> + '_ {
        at(&self.live_by_ip, &ip).map(|i| &self.obs.live[i])
    }

    /// [`Index::live_holding`] with each netns' paths and containers in
    /// their shared form.
    pub fn live_holding_shared(&self, ip: IpAddr) -> impl Iterator<Item = LiveShared<'a>> + '_ {
        at(&self.live_by_ip, &ip).map(|i| LiveShared {
            netns: &self.obs.live[i],
            paths: Arc::clone(&self.live_paths[i]),
            containers: Arc::clone(&self.live_containers[i]),
        })
    }

    pub fn live_of_container(&self, cid: &str) -> impl Iterator<Item = &'a LiveNetns> + '_ {
        at(&self.live_by_container, cid).map(|i| &self.obs.live[i])
    }

    /// Dead netns of this container, and unowned dead netns that held `ip`,
    /// in observation order; the flag says which (true: the container's).
    #[must_use]
    pub fn dead_of_container_or_ip(&self, cid: &str, ip: IpAddr) -> Vec<(&'a DeadNetns, bool)> {
        let own: Vec<usize> = self.dead_positions_of_container(cid).collect();
        self.dead_at_or_holding(&own, ip)
    }

    /// Positions of the dead netns bound to `cid`, ascending.
    pub fn dead_positions_of_container(&self, cid: &str) -> impl Iterator<Item = usize> + '_ {
        at(&self.dead_by_container, cid)
    }

    /// The dead netns at `own` (ascending positions, a container's), and
    /// unowned dead netns that held `ip`, in observation order; the flag
    /// says which (true: at `own`).
    #[must_use]
    pub fn dead_at_or_holding(&self, own: &[usize], ip: IpAddr) -> Vec<(&'a DeadNetns, bool)> {
        // One list alone is in order already (`push` files ascending
        // positions once): no merge, no second vector.
        if !self.unowned_dead_by_ip.contains_key(&ip) {
            return own.iter().map(|&i| (&self.obs.dead[i], true)).collect();
        }
        let mut idx: Vec<(usize, bool)> =
            own.iter().map(|&i| (i, true)).chain(at(&self.unowned_dead_by_ip, &ip).map(|i| (i, false))).collect();
        idx.sort_unstable();
        idx.dedup_by_key(|(i, _)| *i);
        idx.into_iter().map(|(i, own)| (&self.obs.dead[i], own)).collect()
    }

    pub fn bindings_of(&self, cid: &str) -> impl Iterator<Item = &'a Binding> + '_ {
        at(&self.bindings_by_container, cid).map(|i| &self.obs.bindings[i])
    }

    /// [`Index::bindings_of`], each with its netns name in the shared form
    /// and where that netns stands.
    pub fn bindings_of_shared(
        &self,
        cid: &str,
    ) -> impl Iterator<Item = (&'a Binding, Arc<NetnsName>, BindingLink<'a>)> + '_ {
        let obs = self.obs;
        at(&self.bindings_by_container, cid).map(move |i| {
            let link = match self.binding_resolved(i) {
                Resolved::Live(n) => BindingLink::Live(&obs.live[n]),
                Resolved::Dead(n) => BindingLink::Dead(&obs.dead[n]),
                Resolved::Unresolved => BindingLink::Unresolved,
            };
            let name = self.binding_names[i].get_or_init(|| Arc::new(obs.bindings[i].netns.clone()));
            (&obs.bindings[i], Arc::clone(name), link)
        })
    }

    /// Runs that may concern `cid`, in observation order.
    #[must_use]
    pub fn ops_concerning(&self, cid: &str) -> Vec<&'a CniOp> {
        if self.ops_wildcard.is_empty() {
            return at(&self.ops_by_container, cid)
                .map(|i| &self.obs.cni_ops[i])
                .filter(|op| op.may_concern(cid))
                .collect();
        }
        let mut idx: Vec<usize> = at(&self.ops_by_container, cid).collect();
        idx.extend(self.ops_wildcard.iter().copied().filter(|&i| self.obs.cni_ops[i].may_concern(cid)));
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| &self.obs.cni_ops[i]).filter(|op| op.may_concern(cid)).collect()
    }

    /// Runs whose container ID is exactly `cid`.
    pub fn ops_of_exactly(&self, cid: &str) -> impl Iterator<Item = &'a CniOp> + '_ {
        at(&self.ops_by_container, cid).map(|i| &self.obs.cni_ops[i])
    }

    /// None when the runtime is not a source.
    #[must_use]
    pub fn runtime_lists(&self, cid: &str) -> Option<bool> {
        self.sandboxes.as_ref().map(|s| s.contains(cid))
    }

    pub fn pods_with(&self, ip: IpAddr) -> impl Iterator<Item = &'a ApiPod> + '_ {
        let pods = self.obs.api_pods.as_deref().unwrap_or_default();
        at(&self.pods_by_ip, &ip).map(move |i| &pods[i])
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// What `first_by_id` replaced: the union sorted and deduplicated, then
    /// the first match.
    fn reference(inodes: &[usize], nsids: &[usize], matches: &dyn Fn(usize) -> bool) -> Option<usize> {
        let mut all: Vec<usize> = inodes.iter().chain(nsids).copied().collect();
        all.sort_unstable();
        all.dedup();
        all.into_iter().find(|&i| matches(i))
    }

    proptest! {
        /// The merge finds the same position as sorting the union did, for
        /// any filing of positions under one inode and one nsid.
        #[test]
        fn the_merge_finds_what_the_sorted_union_found(
            filed in proptest::collection::vec((any::<bool>(), any::<bool>()), 0..40),
            accepted in proptest::collection::vec(any::<bool>(), 40),
            with_inode in any::<bool>(),
            with_nsid in any::<bool>(),
        ) {
            let (mut by_inode, mut by_nsid): (Map<u64, Positions>, Map<i32, Positions>) = Default::default();
            let (mut inodes, mut nsids) = (Vec::new(), Vec::new());
            for (i, (under_inode, under_nsid)) in filed.iter().enumerate() {
                if *under_inode {
                    push(&mut by_inode, 7, i);
                    inodes.push(i);
                }
                if *under_nsid {
                    push(&mut by_nsid, 3, i);
                    nsids.push(i);
                }
            }
            let id = NetnsId::new(with_inode.then_some(7), with_nsid.then_some(3), None);
            let matches = |i: usize| accepted[i];
            let expected = reference(
                if with_inode { &inodes } else { &[] },
                if with_nsid { &nsids } else { &[] },
                &matches,
            );
            prop_assert_eq!(Index::first_by_id(&by_inode, &by_nsid, &id, matches), expected);
        }
    }
}
