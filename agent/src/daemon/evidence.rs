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
    /// Ledger bindings by inode, with when they were seen.
    by_inode: HashMap<u64, Vec<(String, SystemTime)>>,
    by_path: HashMap<PathBuf, Vec<String>>,
}

impl ContainerIndex {
    fn new(ledger: &Ledger, cache: &[CachedAttachment]) -> Self {
        let mut by_inode: HashMap<u64, Vec<(String, SystemTime)>> = HashMap::new();
        for a in ledger.attachments() {
            if let Some(inode) = a.netns_inode {
                by_inode.entry(inode).or_default().push((a.container_id.clone(), a.first_seen));
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
        // An inode names a netns only while it lives: a binding belongs to
        // the netns that had the inode when the binding was seen.
        let mut ids: Vec<String> = view
            .inode
            .and_then(|i| self.by_inode.get(&u64::from(i)))
            .into_iter()
            .flatten()
            .filter(|(_, seen_at)| held_inode_at(view, *seen_at))
            .map(|(cid, _)| cid.clone())
            .collect();
        for mount in &view.bind_mounts {
            ids.extend(self.by_path.get(&path_key(mount)).into_iter().flatten().cloned());
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

/// How late the model may learn of a netns after a CNI run named it (the
/// probe record and the discovery race the plugin).
const DISCOVERY_SLACK: std::time::Duration = std::time::Duration::from_secs(1);

/// Did this netns hold its inode at `at`? (Known by then, not dead before.)
fn held_inode_at(view: &NetnsView, at: SystemTime) -> bool {
    view.first_seen <= at + DISCOVERY_SLACK && view.died_at.is_none_or(|d| d >= at)
}

/// The nsid of the netns that had `inode` at `at`: with it, the engine tells
/// that netns from a later one that reuses the inode.
fn nsid_at(snapshot: &ModelSnapshot, inode: u64, at: SystemTime) -> Option<i32> {
    snapshot
        .netns
        .iter()
        .filter(|v| v.inode.map(u64::from) == Some(inode))
        .find(|v| held_inode_at(v, at))
        .and_then(|v| v.nsid)
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
            (Some(inode), _) => NetnsRef::Id(NetnsId { inode, nsid: nsid_at(snapshot, inode, seen_at) }),
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
    // Runs whose environment was not read to CNI_CONTAINERID: unknown, so
    // in flight for every container (the engine's wildcard).
    for op in ledger.unattributed_runs() {
        obs.cni_ops.push(CniOp {
            container_id: None,
            container_id_truncated: false,
            command: op.command.clone(),
            plugin: op.plugin.clone(),
            started_at: op.started_at,
            finished_at: op.finished_at,
            exit_code: None,
        });
    }
    add_cache_bindings(&mut obs, snapshot, ledger, cache);
    obs
}

/// A cache entry binds its container to a netns path. When a CNI run of the
/// same container named the same path, the ledger resolved it to an inode
/// while the plugin ran; the binding then names that netns (inode and nsid)
/// from that moment. A path alone may no longer resolve: `ip netns del`
/// unmounts it before the netns dies (a plugin holding it keeps it alive),
/// and the runtime writes the cache after the plugins returned.
fn add_cache_bindings(obs: &mut Observations, snapshot: &ModelSnapshot, ledger: &Ledger, cache: &[CachedAttachment]) {
    for entry in cache {
        let Some(path) = entry.netns.as_deref() else { continue };
        let resolved = ledger.get(&entry.container_id).and_then(|a| {
            let same_path = a.netns_path.as_deref().is_some_and(|p| path_key(Path::new(p)) == path_key(Path::new(path)));
            a.netns_inode.filter(|_| same_path).map(|inode| (inode, a.first_seen))
        });
        let (netns, seen_at) = match resolved {
            Some((inode, seen_at)) => {
                (NetnsRef::Id(NetnsId { inode, nsid: nsid_at(snapshot, inode, seen_at) }), seen_at)
            }
            None => (NetnsRef::Path(PathBuf::from(path)), entry.written_at),
        };
        obs.bindings.push(Binding {
            container_id: entry.container_id.clone(),
            netns,
            source: BindingSource::CniCache,
            seen_at,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::{
        engine::{Status, decide_one},
        ipam::{Reservation, StoreRef},
        kernel::events::{CniExec, CniExit, CniValue, KernelEvent, Task},
        ledger::NetnsResolver,
        model::snapshot::{AddrScope, AddressView, ModelStats},
    };

    fn t(s: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_000_000 + s)
    }

    fn view(inode: u32, nsid: i32, first_seen: u64, died_at: Option<u64>, ip: Option<&str>) -> NetnsView {
        NetnsView {
            inode: Some(inode),
            nsid: Some(nsid),
            host: false,
            alive: died_at.is_none(),
            first_seen: t(first_seen),
            age_secs: 0,
            died_at: died_at.map(t),
            death_source: None,
            creator: None,
            bind_mounts: Vec::new(),
            process_count: 0,
            processes: Vec::new(),
            interfaces: Vec::new(),
            addresses: ip
                .map(|ip| AddressView {
                    ip: ip.parse().unwrap(),
                    prefix_len: 24,
                    ifindex: 2,
                    ifname: Some("eth0".into()),
                    scope: AddrScope::from_raw(0),
                })
                .into_iter()
                .collect(),
            host_routes: Vec::new(),
        }
    }

    struct Inode(u64);
    impl NetnsResolver for Inode {
        fn inode_of(&self, _: &str) -> Option<u64> {
            Some(self.0)
        }
    }

    fn v(s: &str) -> CniValue {
        CniValue { value: s.into(), truncated: false }
    }

    /// c1's reservation of 10.0.0.2 in network n, made at `created_at`.
    fn reservation_of_c1(created_at: SystemTime) -> Reservation {
        Reservation {
            store: StoreRef::HostLocal { data_dir: "/d".into() },
            network: "n".into(),
            ip: "10.0.0.2".parse().unwrap(),
            container_id: "c1".into(),
            ifname: Some("eth0".into()),
            created_at,
            path: "/d/n/10.0.0.2".into(),
            inode: 1,
        }
    }

    /// A ledger holding one finished ADD of container c1 (pid 9) that named
    /// `netns`, which resolved to `inode`; times in seconds of `t`.
    fn ledger_with_add(netns: &str, started: u64, finished: u64, inode: u64) -> Ledger {
        let mut ledger = Ledger::new();
        let task = |k: u64| Task { ktime_ns: k, pid: 9, tgid: 9, comm: "bridge".into(), cgroup_id: 1 };
        let exec = KernelEvent::CniExec {
            task: task(started),
            exec: CniExec {
                binary: v("/usr/lib/cni/bridge"),
                command: v("ADD"),
                container_id: Some(v("c1")),
                netns: Some(v(netns)),
                ifname: Some(v("eth0")),
                env_scan_limited: false,
                env_scanned: 10,
                uid: 0,
                scan_variant: crate::kernel::events::EnvScanVariant::BpfLoop,
            },
        };
        ledger.observe(&exec, t, &Inode(inode));
        let exit = KernelEvent::CniExit { task: task(finished), exit: CniExit::from_wait_status(0) };
        ledger.observe(&exit, t, &Inode(inode));
        ledger
    }

    /// A container bound to inode 77 at t=10 (nsid 1), dead at t=20; a new
    /// netns reuses inode 77 at t=30 (nsid 2). The binding is the dead one's:
    /// the reservation is orphaned, not "in use" by the newcomer.
    #[test]
    fn a_reused_inode_does_not_keep_a_dead_containers_reservation() {
        let ledger = ledger_with_add("/run/netns/a", 10, 11, 77);
        let snapshot = ModelSnapshot {
            taken_at: t(40),
            netns: vec![view(77, 2, 30, None, None), view(77, 1, 5, Some(20), Some("10.0.0.2"))],
            host_routes: Vec::new(),
            stats: ModelStats::default(),
        };
        let obs = observations(&snapshot, &ledger, &[], Some(t(0)));
        assert_eq!(obs.bindings[0].netns, NetnsRef::Id(NetnsId { inode: 77, nsid: Some(1) }));
        assert!(obs.live[0].container_ids.is_empty(), "the newcomer is not c1's");
        assert_eq!(obs.dead[0].container_ids, vec!["c1".to_owned()]);
        let r = reservation_of_c1(t(10));
        let verdict = decide_one(&obs, &r, t(40), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::Orphaned, "{}", verdict.summary);
    }

    /// `ip netns del` unmounted the netns while a plugin held it, and the
    /// runtime wrote the cache after the death: the cache's path binding
    /// must still name the dead netns (through the ledger), or the
    /// reservation would wait for the orphan grace.
    #[test]
    fn a_cache_binding_names_the_netns_the_ledger_resolved_its_path_to() {
        let ledger = ledger_with_add("/var/run/netns/a", 10, 19, 77);
        let snapshot = ModelSnapshot {
            taken_at: t(40),
            netns: vec![view(77, 1, 5, Some(20), Some("10.0.0.2"))],
            host_routes: Vec::new(),
            stats: ModelStats::default(),
        };
        let cache = vec![CachedAttachment {
            path: "/c/n-c1-eth0".into(),
            network: "n".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: Some("/run/netns/a".into()),
            ips: vec!["10.0.0.2".parse().unwrap()],
            written_at: t(25),
            inode: 5,
        }];
        let obs = observations(&snapshot, &ledger, &cache, Some(t(0)));
        let cached: Vec<_> = obs.bindings.iter().filter(|b| b.source == BindingSource::CniCache).collect();
        assert_eq!(cached[0].netns, NetnsRef::Id(NetnsId { inode: 77, nsid: Some(1) }));
        assert_eq!(cached[0].seen_at, t(10));
        let r = reservation_of_c1(t(12));
        let verdict = decide_one(&obs, &r, t(40), &crate::engine::Policy::default());
        assert_eq!(verdict.status, Status::Orphaned, "{}", verdict.summary);
    }
}
