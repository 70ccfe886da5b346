//! How `netreap run` uses the Kubernetes API: the node's pods and the
//! whereabouts pools from two reflectors (a reconcile reads their stores and
//! never waits on the API), releases of whereabouts allocations journaled in
//! `<state-dir>/whereabouts/`, and Events for what people should see.
//!
//! When the API goes away the reflectors keep their last view: no pod is
//! added or removed, no verdict changes because of it; a release that needs
//! the API fails and is tried again at the next reconcile, after re-reading
//! the pool and deciding again.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::{Duration, SystemTime},
};

use kube::{Api, Client, runtime::watcher};
use tracing::{debug, info, warn};

use super::{
    ConfigOrigin, KubeSource,
    events::{EventSink, Notice, Regarding},
    pods::PodWatch,
    reflect::Reflected,
    whereabouts::{self, IpPool, PoolScan},
};
use crate::{
    config::Config,
    engine::{Evidence, Observations, Policy, Status, Verdict, decide},
    ipam::{Anomaly, StoreRef, cnicache::CachedAttachment},
    kernel::events::CniValue,
    ledger::Ledger,
    release::{Journal, JournalError, Outcome, ReleaseRecord},
    telemetry::metrics::Metrics,
};

/// Where whereabouts releases are journaled, under the state dir (its own
/// journal and lock: the host-local releaser's is untouched).
pub const JOURNAL_SUBDIR: &str = "whereabouts";

/// A failed DEL repeated this many times in a row makes a sandbox stuck
/// (multus #1498: DEL without a cache fails forever).
pub const STUCK_FAILED_DELS: usize = 3;
/// After a whereabouts release failed (API unreachable, or a pool that kept
/// changing), the next is tried this much later.
pub const API_BACKOFF: Duration = Duration::from_secs(30);
/// A CNI run in flight this long makes a sandbox stuck.
pub const STUCK_IN_FLIGHT: Duration = Duration::from_mins(2);

/// When each container ID was first seen by a CNI run on this node: the
/// ledger (this run), else the CNI cache (an ADD that succeeded here, also
/// before a restart). Nothing else makes an allocation this node's.
#[must_use]
pub fn made_here(ledger: &Ledger, cache: &[std::sync::Arc<CachedAttachment>]) -> HashMap<String, SystemTime> {
    let mut seen: HashMap<String, SystemTime> = HashMap::new();
    for entry in cache {
        let at = seen.entry(entry.container_id.clone()).or_insert(entry.written_at);
        *at = (*at).min(entry.written_at);
    }
    for a in ledger.attachments() {
        // The ledger saw the ADD start: earlier than the cache's write.
        seen.insert(a.container_id.clone(), a.first_seen);
    }
    seen
}

/// Containers whose pod is remembered from CNI_ARGS; past it the memory
/// starts over (the pool's pod references and the API still name most).
const MAX_CNI_PODS: usize = 65_536;

/// The pod `K8S_POD_NAMESPACE`/`K8S_POD_NAME` in `CNI_ARGS` name, from a
/// NUL-separated environment, when its `CNI_CONTAINERID` is `container_id`.
#[must_use]
pub fn pod_from_environ(path: &str, container_id: &str) -> Option<(String, String)> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(path).ok()?.take(256 * 1024).read_to_end(&mut bytes).ok()?;
    let vars: Vec<&[u8]> = bytes.split(|b| *b == 0).collect();
    let value = |name: &str| {
        vars.iter()
            .find_map(|v| v.strip_prefix(name.as_bytes()).and_then(|rest| rest.strip_prefix(b"=")))
            .and_then(|v| std::str::from_utf8(v).ok())
    };
    if value("CNI_CONTAINERID")? != container_id {
        return None;
    }
    pod_of_cni_args(value("CNI_ARGS")?)
}

/// `K8S_POD_NAMESPACE` and `K8S_POD_NAME` of a `CNI_ARGS` value
/// (`IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;...`). None when
/// either is missing, empty, given twice (which one would the plugin
/// believe?) or not a Kubernetes name.
#[must_use]
pub fn pod_of_cni_args(args: &str) -> Option<(String, String)> {
    let get = |key: &str| {
        let mut values = args.split(';').filter_map(|kv| kv.split_once('=')).filter(|(k, _)| *k == key);
        let (_, value) = values.next()?;
        if values.next().is_some() || !is_kube_name(value) {
            return None;
        }
        Some(value.to_owned())
    };
    Some((get("K8S_POD_NAMESPACE")?, get("K8S_POD_NAME")?))
}

/// The pod a CNI_ARGS value read by the kernel names. A value cut at the
/// kernel's buffer keeps only its complete `key=value;` pairs: the last
/// one may be a prefix of the real name.
#[must_use]
pub fn pod_of_cni_args_record(args: &CniValue) -> Option<(String, String)> {
    if !args.truncated {
        return pod_of_cni_args(&args.value);
    }
    let (complete, _cut) = args.value.rsplit_once(';')?;
    pod_of_cni_args(complete)
}

/// A DNS subdomain (RFC 1123), which namespaces and pod names are: this
/// also rejects the replacement characters of a non-UTF-8 value.
fn is_kube_name(name: &str) -> bool {
    (1..=253).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Sets `obs.api_pods` from a pod view, each pod with the containers whose
/// CNI run named it (here: the pod references whereabouts wrote).
pub fn add_pods(
    obs: &mut Observations,
    pods: Option<Vec<crate::engine::ApiPod>>,
    named: &BTreeMap<String, (String, String)>,
) {
    obs.api_pods = pods.map(|mut pods| {
        for pod in &mut pods {
            let containers = named
                .iter()
                .filter(|(_, (ns, name))| *ns == pod.namespace && *name == pod.name)
                .map(|(cid, _)| cid.clone());
            pod.cni_containers.extend(containers);
            pod.cni_containers.sort();
            pod.cni_containers.dedup();
        }
        pods
    });
}

/// Containers whose sandbox looks stuck: failed DELs in a row, or a CNI run
/// in flight for too long.
#[must_use]
pub fn stuck_sandboxes(ledger: &Ledger, now: SystemTime) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for a in ledger.attachments() {
        // Per plugin binary: a script plugin's helpers (they inherit CNI_*)
        // succeed while the plugin itself fails, so runs are told apart by
        // their binary. Stuck: its DEL failed again and again, and the last
        // one failed too.
        let mut dels: BTreeMap<&str, (usize, bool)> = BTreeMap::new();
        for op in a.operations.iter().filter(|op| op.command == "DEL" && !op.in_flight()) {
            let failed = op.result() == "failure";
            let entry = dels.entry(op.plugin.as_str()).or_default();
            entry.0 += usize::from(failed);
            entry.1 = failed;
        }
        let failing = dels.iter().find(|(_, (failures, last_failed))| *last_failed && *failures >= STUCK_FAILED_DELS);
        if let Some((plugin, (failures, _))) = failing {
            let why = format!("CNI DEL failed {failures} times ({plugin}), the last one too");
            out.push((a.container_id.clone(), why));
            continue;
        }
        let long = a
            .operations
            .iter()
            .filter(|op| op.in_flight())
            .find(|op| now.duration_since(op.started_at).is_ok_and(|d| d >= STUCK_IN_FLIGHT));
        if let Some(op) = long {
            let secs = now.duration_since(op.started_at).map_or(0, |d| d.as_secs());
            out.push((a.container_id.clone(), format!("CNI {} by {} in flight for {secs} s", op.command, op.plugin)));
        }
    }
    out.sort();
    out
}

/// The Kubernetes side of the running agent.
pub struct KubeAgent {
    client: Client,
    node: Option<String>,
    pods: Option<PodWatch>,
    pools: Reflected<IpPool>,
    events: EventSink,
    journal: Journal,
    metrics: Metrics,
    dry_run: bool,
    /// The last scan of the pools for this node.
    scan: PoolScan,
    /// Pods named by `CNI_ARGS` (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`) of
    /// CNI runs, by container ID, read from the running plugin's
    /// environment until the probes carry CNI_ARGS themselves.
    cni_pods: BTreeMap<String, (String, String)>,
    /// Every pod known by container ID at the last observation.
    named: BTreeMap<String, (String, String)>,
    /// Verdict keys already reported as conflicts, and containers already
    /// reported stuck: each gets an Event when it starts.
    conflicts: HashSet<std::path::PathBuf>,
    stuck: HashSet<String>,
    recovered: bool,
    /// No whereabouts release is tried before then: the API failed one
    /// (a hung API must not hold every reconcile for a timeout per IP).
    api_backoff_until: Option<std::time::Instant>,
    crd_missing_logged: bool,
}

impl KubeAgent {
    /// Starts the reflectors and the Event sender when the API is
    /// configured; otherwise says why the source is off and returns None.
    pub async fn start(config: &Config, metrics: &Metrics) -> anyhow::Result<Option<Self>> {
        use anyhow::Context as _;
        let (client, origin) = match super::connect(config.kubeconfig.as_deref()).await {
            Ok(KubeSource::Off { reason }) => {
                info!("Kubernetes source off: {reason}");
                return Ok(None);
            }
            Ok(KubeSource::On { client, origin }) => (client, origin),
            // A kubeconfig that was asked for and cannot be used is an error
            // a person must see at start.
            Err(e) if config.kubeconfig.is_some() => {
                return Err(e).context("Kubernetes configuration");
            }
            // In a pod, an optional source that cannot be set up is off, said
            // loudly; the agent works without it.
            Err(e) => {
                warn!("Kubernetes source off: the in-cluster configuration cannot be used: {e}");
                return Ok(None);
            }
        };
        let pods = config.node_name.as_deref().map(|node| PodWatch::start(&client, node));
        if pods.is_none() {
            warn!("Kubernetes: no --node-name/NODE_NAME: the node's pods are not evidence");
        }
        let pools =
            Reflected::start(Api::<IpPool>::all(client.clone()), watcher::Config::default(), "whereabouts IPPools");
        let instance = config.node_name.as_ref().map(|n| format!("netreap-{n}"));
        let events = EventSink::start(client.clone(), instance);
        let journal =
            Journal::open(&config.state_dir.join(JOURNAL_SUBDIR)).context("opening the whereabouts release journal")?;
        log_origin(&origin, config.node_name.as_deref());
        Ok(Some(Self {
            client,
            node: config.node_name.clone(),
            pods,
            pools,
            events,
            journal,
            metrics: metrics.clone(),
            dry_run: config.dry_run,
            scan: PoolScan::default(),
            cni_pods: BTreeMap::new(),
            named: BTreeMap::new(),
            conflicts: HashSet::new(),
            stuck: HashSet::new(),
            recovered: false,
            api_backoff_until: None,
            crd_missing_logged: false,
        }))
    }

    /// Scans the pools for this node's allocations (from the reflector's
    /// store: no request here). Before the observations are built: a full
    /// pass builds them for the reservations it found ([`Self::reservations`]).
    pub fn scan_pools(&mut self, ledger: &Ledger, cache: &[std::sync::Arc<CachedAttachment>]) {
        let (pools, pool_staleness) = self.pools.view();
        self.metrics.set_kube_staleness("ippools", pool_staleness);
        if let Some(pools) = pools {
            let pools: Vec<IpPool> = pools.iter().map(|p| IpPool::clone(p)).collect();
            let seen = made_here(ledger, cache);
            self.scan = whereabouts::scan_pools(&pools, |cid| seen.get(cid).copied());
        } else if !self.crd_missing_logged && self.pools.last_error().is_some_and(|e| e.contains("404")) {
            info!("whereabouts IPPool CRD not found: the whereabouts store is off");
            self.crd_missing_logged = true;
        }
    }

    /// This node's whereabouts reservations, as the last [`Self::scan_pools`]
    /// found them.
    #[must_use]
    pub fn reservations(&self) -> &[crate::ipam::Reservation] {
        &self.scan.scan.reservations
    }

    /// Adds the API's evidence to `obs` (from the reflector's store: no
    /// request here), with the pods the last [`Self::scan_pools`] named.
    pub fn observe(&mut self, obs: &mut Observations) {
        let view = self.pods.as_ref().map(PodWatch::view);
        if let Some(v) = &view {
            self.metrics.set_kube_staleness("pods", v.staleness);
        }
        // Who named which pod: CNI_ARGS of the run, the container runtime's
        // sandbox metadata, the pod reference whereabouts wrote.
        let mut named = self.cni_pods.clone();
        if let Some(runtime) = &obs.runtime {
            for (id, sandbox) in &runtime.sandboxes {
                if let Some(pod) = &sandbox.pod {
                    named.insert(id.clone(), (pod.namespace.clone(), pod.name.clone()));
                }
            }
        }
        named.extend(self.scan.pods.iter().map(|(k, v)| (k.clone(), v.clone())));
        add_pods(obs, view.and_then(|v| v.pods), &named);
        self.named = named;
    }

    /// This node's whereabouts reservations, decided.
    #[must_use]
    pub fn decide(&self, obs: &Observations, now: SystemTime, policy: &Policy) -> Vec<Verdict> {
        decide(obs, &self.scan.scan.reservations, now, policy)
    }

    /// What the pool scan found that is not a reservation.
    #[must_use]
    pub fn anomalies(&self) -> &[Anomaly] {
        &self.scan.scan.anomalies
    }

    /// Releases the orphaned whereabouts verdicts (each journaled, re-read
    /// and re-decided by `reverify` against the pool as it is now), after
    /// settling intents an earlier run left open.
    pub async fn release(
        &mut self,
        verdicts: &[Verdict],
        reverify: impl Fn(&crate::ipam::Reservation) -> Verdict,
        look: &mut dyn crate::release::lastlook::LastLook,
    ) -> Result<Vec<ReleaseRecord>, JournalError> {
        let mut records = Vec::new();
        // The pool watch failing says the API is away: nothing can be
        // re-read or patched, so nothing is tried (verdicts stay as they are).
        if self.pools.last_error().is_some() || self.api_backoff_until.is_some_and(|t| std::time::Instant::now() < t) {
            return Ok(records);
        }
        if !self.recovered {
            self.recovered = true;
            for intent in self.journal.pending().to_vec() {
                let outcome = if intent.dry_run {
                    Outcome::DryRunClosed
                } else {
                    whereabouts::release(&self.client, &intent.verdict.reservation, false, &reverify, &mut *look).await
                };
                self.journal.record_outcome(&intent.id, &outcome, None)?;
                debug!(intent = %intent.id, ip = %intent.verdict.reservation.ip, "recovered whereabouts intent: {outcome}");
                records.push(ReleaseRecord {
                    intent_id: Some(intent.id),
                    dry_run: intent.dry_run,
                    verdict: intent.verdict,
                    outcome,
                    reverified: None,
                });
            }
        }
        for v in verdicts.iter().filter(|v| v.is_orphaned()) {
            if !matches!(*v.reservation.store, StoreRef::Whereabouts { .. }) {
                continue;
            }
            let intent = self.journal.record_intent(v, self.dry_run)?;
            let outcome = whereabouts::release(&self.client, &v.reservation, self.dry_run, &reverify, &mut *look).await;
            self.journal.record_outcome(&intent.id, &outcome, None)?;
            debug!(ip = %v.reservation.ip, pool = %v.reservation.network, container = %v.reservation.container_id, "whereabouts release: {outcome}");
            let failed = matches!(outcome, Outcome::Failed { .. });
            records.push(ReleaseRecord {
                intent_id: Some(intent.id),
                dry_run: self.dry_run,
                verdict: v.clone(),
                outcome,
                reverified: None,
            });
            if failed {
                // The rest would most likely fail the same way, each after a
                // timeout: try again after a pause.
                self.api_backoff_until = Some(std::time::Instant::now() + API_BACKOFF);
                break;
            }
        }
        Ok(records)
    }

    /// A CNI plugin run started (kernel exec record): remember which pod
    /// its `CNI_ARGS` name. The record carries CNI_ARGS, read at exec, so a
    /// plugin that exits at once is still learned. When the record has no
    /// usable value (cut short, or an older probe), it is read from
    /// `/proc/<pid>/environ` while the plugin runs, and only if that process
    /// still names the same container (a reused pid names another); a run
    /// already gone is then simply not learned, which can only keep less,
    /// never release more.
    pub fn on_cni_exec(&mut self, pid: u32, container_id: &str, cni_args: Option<&CniValue>) {
        if self.cni_pods.contains_key(container_id) {
            return;
        }
        let Some(pod) = cni_args
            .and_then(pod_of_cni_args_record)
            .or_else(|| pod_from_environ(&format!("/proc/{pid}/environ"), container_id))
        else {
            return;
        };
        if self.cni_pods.len() >= MAX_CNI_PODS {
            self.cni_pods.clear();
        }
        self.cni_pods.insert(container_id.to_owned(), pod);
    }

    /// The pod a container's CNI run named, when known.
    fn pod_of(&self, container_id: &str) -> Option<Regarding> {
        self.named
            .get(container_id)
            .or_else(|| self.cni_pods.get(container_id))
            .map(|(namespace, name)| Regarding::Pod { namespace: namespace.clone(), name: name.clone() })
    }

    fn on_pod_or_node(&self, container_id: &str) -> Option<Regarding> {
        self.pod_of(container_id).or_else(|| self.node.clone().map(|name| Regarding::Node { name }))
    }

    /// Events for a reconcile: each release that changed a store, each new
    /// conflict, each sandbox that became stuck.
    pub fn notify(&mut self, verdicts: &[Verdict], records: &[ReleaseRecord], ledger: &Ledger) {
        for record in records.iter().filter(|r| r.outcome.released()) {
            let r = &record.verdict.reservation;
            let Some(regarding) = self.on_pod_or_node(&r.container_id) else {
                continue;
            };
            let why: Vec<String> = record.verdict.evidence.iter().take(2).map(Evidence::text).collect();
            self.events.send(Notice {
                regarding,
                warning: false,
                reason: "LeakedIPReleased".into(),
                action: "Release".into(),
                note: format!(
                    "released leaked IP {} of container {} from {} ({}): {}",
                    r.ip,
                    short(&r.container_id),
                    r.store,
                    r.network,
                    why.join("; ")
                ),
            });
        }
        let mut conflicts = HashSet::new();
        for v in verdicts.iter().filter(|v| v.status == Status::Conflict) {
            let key = v.reservation.path.clone();
            if !self.conflicts.contains(&key)
                && let Some(regarding) = self.on_pod_or_node(&v.reservation.container_id)
            {
                self.events.send(Notice {
                    regarding,
                    warning: true,
                    reason: "IPConflict".into(),
                    action: "Report".into(),
                    note: format!("not released: {}", v.summary()),
                });
            }
            conflicts.insert(key);
        }
        self.conflicts = conflicts;
        let stuck = stuck_sandboxes(ledger, SystemTime::now());
        let mut now_stuck = HashSet::new();
        for (cid, why) in stuck {
            if !self.stuck.contains(&cid)
                && let Some(regarding) = self.on_pod_or_node(&cid)
            {
                self.events.send(Notice {
                    regarding,
                    warning: true,
                    reason: "SandboxStuck".into(),
                    action: "Report".into(),
                    note: format!("sandbox {}: {why}", short(&cid)),
                });
            }
            now_stuck.insert(cid);
        }
        self.stuck = now_stuck;
    }
}

fn short(container_id: &str) -> &str {
    container_id.get(..12).unwrap_or(container_id)
}

fn log_origin(origin: &ConfigOrigin, node: Option<&str>) {
    info!(node = node.unwrap_or("-"), "Kubernetes source on ({origin}): pods as evidence, whereabouts store, Events");
}

/// Whether a reservation lives in whereabouts (for callers that split a
/// scan between stores).
#[must_use]
pub fn is_whereabouts(store: &StoreRef) -> bool {
    matches!(store, StoreRef::Whereabouts { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ApiPod;

    #[test]
    fn cni_args_name_a_pod_only_with_both_keys() {
        let pod = pod_of_cni_args("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u");
        assert_eq!(pod, Some(("ns".to_owned(), "p".to_owned())));
        assert_eq!(pod_of_cni_args("K8S_POD_NAME=p"), None);
        assert_eq!(pod_of_cni_args("K8S_POD_NAMESPACE=;K8S_POD_NAME=p"), None);
        assert_eq!(pod_of_cni_args(""), None);
    }

    #[test]
    fn hostile_cni_args_name_no_pod() {
        let both = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p";
        assert_eq!(pod_of_cni_args("no equals sign at all"), None);
        assert_eq!(pod_of_cni_args(";;;===;"), None);
        assert_eq!(pod_of_cni_args(&format!("{both};K8S_POD_NAME=q")), None, "a duplicate key");
        assert_eq!(pod_of_cni_args(&format!("{both};K8S_POD_NAMESPACE=ns")), None, "even with the same value");
        assert_eq!(pod_of_cni_args("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p\u{fffd}x"), None, "lossy non-UTF-8");
        assert_eq!(pod_of_cni_args("K8S_POD_NAMESPACE=Ns;K8S_POD_NAME=p"), None, "not a kube name");
        assert_eq!(pod_of_cni_args(&format!("K8S_POD_NAMESPACE=ns;K8S_POD_NAME={}", "a".repeat(254))), None);
        let huge = format!("{};{both}", "x=y;".repeat(100_000));
        assert_eq!(pod_of_cni_args(&huge), Some(("ns".to_owned(), "p".to_owned())), "long but well-formed");
    }

    #[test]
    fn a_cut_cni_args_keeps_only_its_complete_pairs() {
        let cut = |value: &str| CniValue { value: value.into(), truncated: true };
        let whole = |value: &str| CniValue { value: value.into(), truncated: false };
        let args = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-abc;K8S_POD_UID=u";
        assert_eq!(pod_of_cni_args_record(&whole(args)), Some(("ns".to_owned(), "pod-abc".to_owned())));
        assert_eq!(pod_of_cni_args_record(&cut(args)), Some(("ns".to_owned(), "pod-abc".to_owned())));
        // Cut inside the name: "pod-a" would be another pod.
        assert_eq!(pod_of_cni_args_record(&cut("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-a")), None);
        assert_eq!(pod_of_cni_args_record(&cut("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-abc")), None);
        assert_eq!(pod_of_cni_args_record(&cut("no separator")), None);
    }

    #[test]
    fn an_environ_names_a_pod_only_for_its_own_container() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("environ");
        std::fs::write(&path, b"PATH=/bin\0CNI_CONTAINERID=c1\0CNI_ARGS=K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p\0")
            .unwrap();
        let path = path.to_string_lossy().into_owned();
        assert_eq!(pod_from_environ(&path, "c1"), Some(("ns".to_owned(), "p".to_owned())));
        assert_eq!(pod_from_environ(&path, "c2"), None, "a reused pid names another container");
        assert_eq!(pod_from_environ("/nonexistent/environ", "c1"), None);
    }

    #[test]
    fn pods_learn_which_containers_named_them() {
        let mut obs = Observations::default();
        let pod = |name: &str| ApiPod {
            namespace: "ns".into(),
            name: name.into(),
            ips: Vec::new(),
            pending: true,
            cni_containers: Vec::new(),
        };
        let mut named = BTreeMap::new();
        named.insert("c1".to_owned(), ("ns".to_owned(), "a".to_owned()));
        named.insert("c2".to_owned(), ("other".to_owned(), "a".to_owned()));
        add_pods(&mut obs, Some(vec![pod("a"), pod("b")]), &named);
        let pods = obs.api_pods.unwrap();
        assert_eq!(pods[0].cni_containers, vec!["c1".to_owned()]);
        assert!(pods[1].cni_containers.is_empty());
        let mut none = Observations::default();
        add_pods(&mut none, None, &named);
        assert!(none.api_pods.is_none(), "no view yet is no evidence, not an empty node");
    }
}
