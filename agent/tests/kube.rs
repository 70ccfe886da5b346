//! Kubernetes end-to-end (issue 12): the real agent binary, real network
//! namespaces and kernel probes, and a STAND-IN API server
//! (testkit/apiserver.py): no kube-apiserver can be installed on these
//! machines. The stand-in enforces the conventions netreap relies on
//! (resourceVersion on every write, 422 on a failed JSON-patch `test`, 409
//! on conflicts and failed preconditions, fieldSelector on pods, watch with
//! bookmarks); the PyPI `kmock` mock was not used because it enforces none
//! of them (merge-only patches, no resourceVersion, no field selectors).
//!
//! whereabouts allocations are made by a stand-in whereabouts IPAM plugin
//! run with CNI_* in its environment, so the probes record it like any CNI
//! plugin run. Every netns and link here starts with `nrK`.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]
#![allow(clippy::unwrap_used, reason = "tests panic with context")]
#![allow(clippy::too_many_lines, reason = "each scenario reads top to bottom")]

use netreap_testkit as support;

use std::{ffi::OsString, time::Duration};

use serde_json::{Value, json};
use support::{
    agent::{Agent, wait_until},
    kernel_tests_possible,
    kube::{ApiServer, NODE, Sandbox, WbPlugin, python_present},
};

fn possible() -> bool {
    kernel_tests_possible() && python_present()
}

/// One agent at a time: each loads the eBPF probes.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A test's directories and its agent's flags.
struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for d in ["networks", "cache/results", "state", "plugins"] {
            std::fs::create_dir_all(dir.path().join(d)).expect("dirs");
        }
        Self { dir }
    }

    fn dir_args(&self) -> Vec<OsString> {
        let p = self.dir.path();
        vec![
            "--host-local-dir".into(),
            p.join("networks").into(),
            "--cni-cache-dir".into(),
            p.join("cache/results").into(),
            "--state-dir".into(),
            p.join("state").into(),
            // Only runs of binaries in these dirs count as CNI runs.
            "--cni-bin-dir".into(),
            p.join("plugins").into(),
            "--cni-bin-dir".into(),
            "/usr/lib/cni".into(),
        ]
    }

    /// The agent on the stand-in API, as node NODE.
    fn agent(&self, api: &ApiServer, extra: &[&str]) -> Agent {
        let kubeconfig = api.kubeconfig.to_string_lossy().into_owned();
        let mut args = vec!["--kubeconfig", kubeconfig.as_str(), "--node-name", NODE, "--resync-interval", "1s"];
        args.extend_from_slice(extra);
        Agent::start_in(self.dir.path(), &self.dir_args(), &[], &args, &[])
    }
}

/// The agent's current verdicts on whereabouts allocations, by IP (one
/// /state request).
fn wb_verdicts(agent: &Agent) -> std::collections::HashMap<String, Value> {
    agent.state()["verdicts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["reservation"]["store"]["kind"] == "whereabouts")
        .filter_map(|v| Some((v["reservation"]["ip"].as_str()?.to_owned(), v.clone())))
        .collect()
}

/// The agent's current verdict on a whereabouts allocation of `ip`.
fn wb_verdict(agent: &Agent, ip: &str) -> Option<Value> {
    agent.state()["verdicts"]
        .as_array()?
        .iter()
        .find(|v| v["reservation"]["store"]["kind"] == "whereabouts" && v["reservation"]["ip"] == ip)
        .cloned()
}

fn has_fact(verdict: &Value, fact: &str) -> bool {
    verdict["evidence"].as_array().is_some_and(|e| e.iter().any(|f| f["fact"] == fact))
}

fn allocations(api: &ApiServer, pool: &str) -> serde_json::Map<String, Value> {
    api.pool(pool)["spec"]["allocations"].as_object().cloned().unwrap_or_default()
}

fn rv(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"].as_str().and_then(|r| r.parse().ok()).expect("a resourceVersion")
}

fn patches_of(api: &ApiServer, pool: &str) -> Vec<Value> {
    let path = ApiServer::pool_path(pool);
    api.log().into_iter().filter(|r| r["method"] == "PATCH" && r["path"] == path.as_str()).collect()
}

/// A whereabouts allocation whose netns died is released with one JSON
/// patch that tests the pool's resourceVersion and the allocation's id; the
/// pool's resourceVersion moves; the OverlappingRangeIPReservation goes with
/// a resourceVersion precondition; an Event on the pod says so.
#[test]
fn a_dead_netns_allocation_is_released_with_a_tested_patch_and_an_event_on_its_pod() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.7.0/24");
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let agent = setup.agent(&api, &[]);

    let mut sandbox = Sandbox::new();
    let ip = plugin.add(&api, &pool, &sandbox, "nrk-ns", "leaky");
    sandbox.configure(&ip);
    let offset = allocations(&api, &pool).keys().next().cloned().expect("one allocation");
    assert!(
        wait_until(Duration::from_secs(10), || wb_verdict(&agent, &ip).is_some_and(|v| v["status"] == "in_use"))
            .is_some(),
        "the allocation is this node's and in use; state: {}\nlog:\n{}",
        agent.state()["verdicts"],
        agent.log()
    );
    let rv_before = rv(&api.pool(&pool));

    sandbox.delete_netns();
    let released = wait_until(Duration::from_secs(10), || !allocations(&api, &pool).contains_key(&offset));
    assert!(released.is_some(), "released after the netns died; log:\n{}", agent.log());
    assert!(rv(&api.pool(&pool)) > rv_before, "the pool's resourceVersion moved");

    let patches = patches_of(&api, &pool);
    let ours: Vec<&Value> = patches.iter().filter(|p| p["body"][2]["op"] == "remove").collect();
    assert_eq!(ours.len(), 1, "one release patch: {patches:#?}");
    let patch = ours[0];
    assert_eq!(patch["content_type"], "application/json-patch+json");
    assert_eq!(patch["status"], 200);
    assert_eq!(
        patch["body"][0],
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv_before.to_string()})
    );
    assert_eq!(
        patch["body"][1],
        json!({"op": "test", "path": format!("/spec/allocations/{offset}/id"), "value": sandbox.container_id})
    );
    assert_eq!(patch["body"][2], json!({"op": "remove", "path": format!("/spec/allocations/{offset}")}));

    let orip_path = format!("{}/namespaces/kube-system/overlappingrangeipreservations/{ip}", support::kube::IPPOOLS);
    let orip_deletes = || -> Vec<Value> {
        api.log().into_iter().filter(|r| r["method"] == "DELETE" && r["path"] == orip_path.as_str()).collect()
    };
    wait_until(Duration::from_secs(5), || !orip_deletes().is_empty());
    let deletes = orip_deletes();
    assert_eq!(deletes.len(), 1, "the reservation is deleted once; log:\n{}", agent.log());
    assert!(deletes[0]["body"]["preconditions"]["resourceVersion"].is_string(), "with a precondition: {}", deletes[0]);
    assert_eq!(api.request("GET", &orip_path, "application/json", None).0, 404);

    let events = wait_until(Duration::from_secs(10), || !api.events_regarding("Pod", "leaky").is_empty());
    assert!(events.is_some(), "an Event on the pod; log:\n{}", agent.log());
    let event = &api.events_regarding("Pod", "leaky")[0];
    assert_eq!(event["reason"], "LeakedIPReleased");
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["regarding"]["namespace"], "nrk-ns");
    assert!(event["note"].as_str().unwrap().contains(&ip), "{event}");
    // The node's pods: listed and watched with the field selector, with
    // bookmarks.
    let pod_watches: Vec<Value> =
        api.log().into_iter().filter(|r| r["path"] == "/api/v1/pods" && r["query"]["watch"] == "true").collect();
    assert!(!pod_watches.is_empty(), "the pods are watched");
    for w in &pod_watches {
        assert_eq!(w["query"]["fieldSelector"], format!("spec.nodeName={NODE}").as_str(), "{w}");
        assert_eq!(w["query"]["allowWatchBookmarks"], "true", "{w}");
    }
    let release = agent.events_named("release");
    assert!(release.iter().any(|e| e["outcome"] == "released" && e["store"]["kind"] == "whereabouts"), "{release:#?}");
}

/// whereabouts #162: the IPPool holds a Pending pod's allocation while the
/// pod reports no IP yet. Even with the sandbox's netns gone (kubelet is
/// retrying), a Pending pod a CNI run named keeps its allocation through
/// any number of reconciles: 50 pods, several reconciles each, no loss.
/// Then, as a control, the pods that go away lose theirs (the rule, not
/// something else, kept them).
#[test]
fn pending_pods_keep_their_allocations_through_reconciles_whereabouts_162() {
    const PODS: usize = 50;
    const GONE: usize = 5;
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.8.0/24");
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let agent = setup.agent(&api, &[]);

    let mut sandboxes = Vec::new();
    for i in 0..PODS {
        let name = format!("pend-{i}");
        api.create_pod("nrk-ns", &name, NODE, "Pending", &[]);
        let sandbox = Sandbox::new();
        let ip = plugin.add(&api, &pool, &sandbox, "nrk-ns", &name);
        sandboxes.push((sandbox, ip, name));
    }
    assert_eq!(allocations(&api, &pool).len(), PODS);
    // The agent knows each pod is Pending and named by its container's run.
    let all_named = wait_until(Duration::from_secs(20), || {
        let verdicts = wb_verdicts(&agent);
        sandboxes
            .iter()
            .all(|(_, ip, _)| verdicts.get(ip).is_some_and(|v| has_fact(v, "api_pending_pod_named_by_cni_run")))
    });
    assert!(all_named.is_some(), "state: {:#}\nlog:\n{}", agent.state()["verdicts"], agent.log());

    let rv_before = rv(&api.pool(&pool));
    for (sandbox, _, _) in &mut sandboxes {
        sandbox.delete_netns();
    }
    // Every death is seen (each triggers a reconcile)...
    let died = |a: &Agent| -> Vec<String> {
        a.events_named("netns_died")
            .iter()
            .flat_map(|e| e["container_ids"].as_array().cloned().unwrap_or_default())
            .filter_map(|c| c.as_str().map(str::to_owned))
            .collect()
    };
    // The netns are gone (ip netns del returned); wait until the agent has
    // processed the deaths (its netns_died events name the containers; a
    // death the ledger could not attribute still counts as seen by the
    // kernel, so most, not all, are required here).
    let seen = wait_until(Duration::from_secs(20), || {
        let died = died(&agent);
        sandboxes.iter().filter(|(s, _, _)| died.contains(&s.container_id)).count() == PODS
    });
    let attributed = sandboxes.iter().filter(|(s, _, _)| died(&agent).contains(&s.container_id)).count();
    assert!(seen.is_some() || attributed >= PODS * 9 / 10, "deaths seen: {attributed}/{PODS}\nlog:\n{}", agent.log());
    // ...and several more reconciles follow (resync every second).
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(allocations(&api, &pool).len(), PODS, "no Pending pod lost its IP");
    assert_eq!(rv(&api.pool(&pool)), rv_before, "the pool was not written");
    assert!(patches_of(&api, &pool).iter().all(|p| p["body"][2]["op"] != "remove"), "no release was even tried");
    let verdicts = wb_verdicts(&agent);
    for (_, ip, _) in &sandboxes {
        let v = &verdicts[ip];
        assert_eq!(v["status"], "in_use", "{v:#}");
    }

    // Control: pods that are gone no longer keep anything.
    for (_, _, name) in sandboxes.iter().take(GONE) {
        api.delete(&format!("/api/v1/namespaces/nrk-ns/pods/{name}"));
    }
    let gone_ips: Vec<String> = sandboxes.iter().take(GONE).map(|(_, ip, _)| ip.clone()).collect();
    let released = wait_until(Duration::from_secs(20), || allocations(&api, &pool).len() == PODS - GONE);
    assert!(released.is_some(), "the {GONE} pods that went away lose their IPs; log:\n{}", agent.log());
    let range: std::net::Ipv4Addr = "10.248.8.0".parse().unwrap();
    let left: Vec<String> = allocations(&api, &pool)
        .keys()
        .map(|o| std::net::Ipv4Addr::from(u32::from(range) + o.parse::<u32>().unwrap()).to_string())
        .collect();
    assert!(gone_ips.iter().all(|ip| !left.contains(ip)), "exactly theirs: {gone_ips:?} vs {left:?}");
    // Each with a patch that tested the pool's resourceVersion and the
    // allocation's owner, and an Event on its pod.
    let patches = patches_of(&api, &pool);
    for (sandbox, _, name) in sandboxes.iter().take(GONE) {
        let applied: Vec<&Value> = patches
            .iter()
            .filter(|p| p["body"][1]["value"] == sandbox.container_id.as_str() && p["status"] == 200)
            .collect();
        assert_eq!(applied.len(), 1, "{name}: {patches:#?}");
        assert_eq!(applied[0]["body"][0]["op"], "test");
        assert_eq!(applied[0]["body"][0]["path"], "/metadata/resourceVersion");
        assert_eq!(applied[0]["body"][2]["op"], "remove");
        let event = wait_until(Duration::from_secs(10), || {
            api.events_regarding("Pod", name).iter().any(|e| e["reason"] == "LeakedIPReleased")
        });
        assert!(event.is_some(), "an Event on {name}");
    }
}

/// An allocation made on another node (a container this node's CNI never
/// ran) is never touched, however old and however dead it looks from here;
/// this node's own leak in the same pool is released meanwhile.
#[test]
fn another_nodes_allocation_is_never_touched() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.9.0/24");
    let foreign = "f".repeat(64);
    let (code, body) = api.request(
        "PATCH",
        &ApiServer::pool_path(&pool),
        "application/json-patch+json",
        Some(&json!([{ "op": "add", "path": "/spec/allocations/100", "value": { "id": foreign, "podref": "nrk-ns/elsewhere", "ifname": "eth0" } }])),
    );
    assert_eq!(code, 200, "{body}");
    api.create_pod("nrk-ns", "elsewhere", "nrk-other-node", "Running", &["10.248.9.100"]);
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let agent = setup.agent(&api, &["--in-flight-grace", "1s", "--orphan-grace", "1s"]);

    let mut ours = Sandbox::new();
    let ip = plugin.add(&api, &pool, &ours, "nrk-ns", "mine");
    ours.configure(&ip);
    assert!(wait_until(Duration::from_secs(10), || wb_verdict(&agent, &ip).is_some()).is_some(), "{}", agent.log());
    ours.delete_netns();
    let released = wait_until(Duration::from_secs(10), || allocations(&api, &pool).len() == 1);
    assert!(released.is_some(), "our own leak is released; log:\n{}", agent.log());
    std::thread::sleep(Duration::from_secs(3));

    let left = allocations(&api, &pool);
    assert_eq!(left["100"]["id"], foreign.as_str(), "the other node's allocation is intact");
    assert!(wb_verdict(&agent, "10.248.9.100").is_none(), "not even judged: not this node's");
    for p in patches_of(&api, &pool) {
        let touches_foreign =
            p["body"].as_array().unwrap().iter().any(|op| op["path"].as_str().unwrap().contains("/100"));
        assert!(!touches_foreign || p["body"][0]["op"] == "add", "no patch of ours names offset 100: {p}");
    }
    let orip_deletes = api
        .log()
        .into_iter()
        .filter(|r| r["method"] == "DELETE" && r["path"].as_str().unwrap().ends_with("10.248.9.100"))
        .count();
    assert_eq!(orip_deletes, 0);
}

/// A concurrent allocator changes the pool between netreap's read and its
/// patch. (a) It allocates another IP: the patch's resourceVersion test
/// fails (422), netreap re-reads, decides again and releases only its own
/// allocation. (b) It gives the very allocation to a new container: the
/// patch fails, the re-read shows another owner, and nothing is removed.
#[test]
fn a_concurrent_allocator_between_read_and_patch_makes_netreap_decide_again() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.10.0/24");
    let pool_path = ApiServer::pool_path(&pool);
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let agent = setup.agent(&api, &[]);

    // (a) another IP allocated in between.
    let mut a = Sandbox::new();
    let ip_a = plugin.add(&api, &pool, &a, "nrk-ns", "a");
    a.configure(&ip_a);
    let off_a = allocations(&api, &pool).keys().next().cloned().unwrap();
    assert!(wait_until(Duration::from_secs(10), || wb_verdict(&agent, &ip_a).is_some()).is_some(), "{}", agent.log());
    let newcomer = json!({ "id": "a".repeat(64), "podref": "nrk-ns/newcomer", "ifname": "eth0" });
    api.hook("PATCH", &pool_path, &json!([{ "op": "add", "path": "/spec/allocations/200", "value": newcomer }]));
    a.delete_netns();
    let released = wait_until(Duration::from_secs(10), || !allocations(&api, &pool).contains_key(&off_a));
    assert!(released.is_some(), "released after deciding again; log:\n{}", agent.log());
    assert_eq!(allocations(&api, &pool)["200"], newcomer, "the concurrent allocation survives");
    let removes: Vec<Value> = patches_of(&api, &pool).into_iter().filter(|p| p["body"][2]["op"] == "remove").collect();
    assert_eq!(removes.len(), 2, "refused once, then applied: {removes:#?}");
    assert_eq!(removes[0]["status"], 422);
    assert_eq!(removes[1]["status"], 200);
    assert_ne!(
        removes[0]["body"][0]["value"], removes[1]["body"][0]["value"],
        "the retry tests the new resourceVersion"
    );

    // (b) the same allocation handed to a new container in between.
    let mut b = Sandbox::new();
    let ip_b = plugin.add(&api, &pool, &b, "nrk-ns", "b");
    b.configure(&ip_b);
    let off_b =
        allocations(&api, &pool).iter().find(|(_, v)| v["podref"] == "nrk-ns/b").map(|(k, _)| k.clone()).unwrap();
    assert!(wait_until(Duration::from_secs(10), || wb_verdict(&agent, &ip_b).is_some()).is_some(), "{}", agent.log());
    let reallocated = json!({ "id": "b".repeat(64), "podref": "nrk-ns/reborn", "ifname": "eth0" });
    let at = format!("/spec/allocations/{off_b}");
    api.hook(
        "PATCH",
        &pool_path,
        &json!([{ "op": "remove", "path": at }, { "op": "add", "path": at, "value": reallocated }]),
    );
    b.delete_netns();
    let settled = wait_until(Duration::from_secs(10), || {
        agent.events_named("release").iter().any(|e| e["ip"] == ip_b.as_str() && e["outcome"] != "released")
    });
    assert!(settled.is_some(), "a release attempt ends without removing; log:\n{}", agent.log());
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(allocations(&api, &pool)[&off_b], reallocated, "the new owner keeps the IP");
    let removes_b: Vec<Value> = patches_of(&api, &pool)
        .into_iter()
        .filter(|p| p["body"][1]["value"] == b.container_id.as_str() && p["body"][2]["op"] == "remove")
        .collect();
    assert_eq!(removes_b.len(), 1, "one refused patch, no retry against the new owner: {removes_b:#?}");
    assert_eq!(removes_b[0]["status"], 422);
    let outcome =
        agent.events_named("release").into_iter().find(|e| e["container_id"] == b.container_id.as_str()).unwrap();
    assert!(outcome["detail"].as_str().unwrap().contains("owner changed"), "{outcome:#}");
}

/// The API goes away mid-run: the reflectors keep their last view, so no
/// verdict changes (a pod that kept an IP still keeps it, nothing is added
/// or removed), the agent keeps running, and the staleness shows.
#[test]
fn the_api_going_away_changes_no_verdict() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let mut api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.11.0/24");
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let mut agent = setup.agent(&api, &[]);

    let live = Sandbox::new();
    let ip_live = plugin.add(&api, &pool, &live, "nrk-ns", "live");
    live.configure(&ip_live);
    api.create_pod("nrk-ns", "waiting", NODE, "Pending", &[]);
    let mut waiting = Sandbox::new();
    let ip_waiting = plugin.add(&api, &pool, &waiting, "nrk-ns", "waiting");
    let named = wait_until(Duration::from_secs(10), || {
        wb_verdict(&agent, &ip_waiting).is_some_and(|v| has_fact(&v, "api_pending_pod_named_by_cni_run"))
    });
    assert!(named.is_some(), "{}", agent.log());
    waiting.delete_netns();
    let settled = wait_until(Duration::from_secs(10), || {
        agent.events_named("netns_died").iter().any(|e| e["container_ids"][0] == waiting.container_id.as_str())
            && wb_verdict(&agent, &ip_live).is_some()
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(settled.is_some(), "{}", agent.log());
    let statuses = |a: &Agent| -> Vec<(String, String)> {
        [&ip_live, &ip_waiting]
            .iter()
            .map(|ip| ((*ip).clone(), wb_verdict(a, ip).unwrap()["status"].as_str().unwrap().to_owned()))
            .collect()
    };
    let before = statuses(&agent);
    assert!(before.iter().all(|(_, s)| s == "in_use"), "{before:?}");

    api.kill();
    // Reconciles on deaths and on the resync interval, API gone.
    let mut other = Sandbox::new();
    other.delete_netns();
    std::thread::sleep(Duration::from_secs(4));
    assert!(agent.exited().is_none(), "the agent runs on; log:\n{}", agent.log());
    assert_eq!(statuses(&agent), before, "no verdict changed");
    let waiting_v = wb_verdict(&agent, &ip_waiting).unwrap();
    assert!(has_fact(&waiting_v, "api_pending_pod_named_by_cni_run"), "the last view still keeps it: {waiting_v:#}");
    let stale = agent
        .metrics()
        .lines()
        .find(|l| l.starts_with("netreap_kube_view_staleness_seconds{source=\"pods\"}"))
        .and_then(|l| l.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()));
    assert!(stale.is_some_and(|s| s > 0.0), "staleness shows: {stale:?}\n{}", agent.metrics());
    assert!(agent.events_named("release").iter().all(|e| e["store"]["kind"] != "whereabouts"), "nothing released");
    agent.stop();
}

fn netreap(args: &[&str], env_clear_kube: bool) -> (bool, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_netreap"));
    cmd.args(args);
    if env_clear_kube {
        cmd.env_remove("KUBECONFIG").env_remove("NODE_NAME").env_remove("KUBERNETES_SERVICE_HOST");
    }
    let out = cmd.output().expect("netreap runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The rows `netreap sources --json` gives for the Kubernetes API and
/// whereabouts: (state, detail) each.
fn kube_rows(args: &[&str]) -> ((String, String), (String, String)) {
    let (ok, out, err) = netreap(&[&["sources", "--json"][..], args].concat(), true);
    assert!(ok, "{err}");
    let rows: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let row = |id: &str| {
        let r = rows.as_array().unwrap().iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("no {id} row: {out}"));
        (r["state"].as_str().unwrap().to_owned(), r["detail"].as_str().unwrap().to_owned())
    };
    (row("kubernetes"), row("whereabouts"))
}

/// `netreap sources` tells the truth: off without a kubeconfig (and not in
/// a pod), active with the stand-in API server, unreachable when it is gone.
#[test]
fn sources_tell_whether_the_api_is_there() {
    if !python_present() {
        return;
    }
    let setup = Setup::new();
    let ((state, detail), (wb_state, _)) = kube_rows(&[]);
    assert_eq!(state, "inactive", "{detail}");
    assert!(detail.contains("no --kubeconfig"), "{detail}");
    assert_eq!(wb_state, "inactive");

    let mut api = ApiServer::start(setup.dir.path());
    api.create_pool("10.248.12.0/24");
    api.create_pod("nrk-ns", "here", NODE, "Running", &["10.248.12.9"]);
    api.create_pod("nrk-ns", "there", "nrk-other-node", "Running", &["10.248.12.10"]);
    let kubeconfig = api.kubeconfig.to_string_lossy().into_owned();
    let ((state, detail), (wb_state, wb_detail)) = kube_rows(&["--kubeconfig", &kubeconfig, "--node-name", NODE]);
    assert_eq!(state, "active", "{detail}");
    assert!(detail.contains("v1.33.0-netreap-standin"), "{detail}");
    assert!(detail.contains(&format!("1 pods on node {NODE}")), "the field selector counts this node's only: {detail}");
    assert_eq!(wb_state, "active", "{wb_detail}");
    assert!(wb_detail.contains("1 IPPools"), "{wb_detail}");

    api.kill();
    let ((state, detail), (wb_state, _)) = kube_rows(&["--kubeconfig", &kubeconfig, "--node-name", NODE]);
    assert_eq!(state, "inactive", "{detail}");
    assert!(detail.starts_with("unreachable"), "{detail}");
    assert_eq!(wb_state, "inactive");
}

/// `scan` lists this node's whereabouts allocations (a CNI cache entry
/// here makes an allocation this node's in a one-shot command) with their
/// verdicts and nothing of other nodes; `release --from-report` releases
/// the reviewed orphan with a tested patch.
#[test]
fn scan_and_release_from_report_cover_whereabouts() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.13.0/24");
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let mut sandbox = Sandbox::new();
    let ip = plugin.add(&api, &pool, &sandbox, "nrk-ns", "gone");
    let entry = json!({
        "kind": "cniCacheV1", "containerId": sandbox.container_id, "ifName": "eth0", "networkName": "wbnet",
        "netns": sandbox.path, "config": "e30=",
        "result": { "cniVersion": "1.0.0", "ips": [{ "address": format!("{ip}/24") }] },
    });
    let results = setup.dir.path().join("cache/results");
    std::fs::write(results.join(format!("wbnet-{}-eth0", sandbox.container_id)), entry.to_string()).unwrap();
    let (code, body) = api.request(
        "PATCH",
        &ApiServer::pool_path(&pool),
        "application/json-patch+json",
        Some(&json!([{ "op": "add", "path": "/spec/allocations/99", "value": { "id": "e".repeat(64), "podref": "nrk-ns/far", "ifname": "eth0" } }])),
    );
    assert_eq!(code, 200, "{body}");
    sandbox.delete_netns();
    std::thread::sleep(Duration::from_millis(1200));

    let kubeconfig = api.kubeconfig.to_string_lossy().into_owned();
    let mut args: Vec<String> = setup.dir_args().iter().map(|a| a.to_string_lossy().into_owned()).collect();
    args.extend(
        ["--kubeconfig", kubeconfig.as_str(), "--node-name", NODE, "--in-flight-grace", "1s", "--orphan-grace", "1s"]
            .map(str::to_owned),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = netreap(&[&["scan", "--json"][..], &args].concat(), true);
    assert!(ok, "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    let wb: Vec<&Value> = report["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["reservation"]["store"]["kind"] == "whereabouts")
        .collect();
    assert_eq!(wb.len(), 1, "this node's allocation only: {wb:#?}");
    assert_eq!(wb[0]["reservation"]["ip"], ip.as_str());
    assert_eq!(wb[0]["status"], "orphaned", "{:#}", wb[0]);
    assert_eq!(report["sources"]["api"], true);

    let report_file = setup.dir.path().join("report.json");
    std::fs::write(&report_file, &out).unwrap();
    let rv_before = rv(&api.pool(&pool));
    let report_path = report_file.to_string_lossy().into_owned();
    let (ok, out, err) = netreap(&[&["release", "--from-report", report_path.as_str()][..], &args].concat(), true);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("{ip} ")) && out.contains("released"), "{out}");
    let left = allocations(&api, &pool);
    assert_eq!(left.len(), 1, "only the other node's allocation is left: {left:?}");
    assert!(left.contains_key("99"));
    assert!(rv(&api.pool(&pool)) > rv_before);
    let journal = std::fs::read_to_string(setup.dir.path().join("state/whereabouts/journal.jsonl")).unwrap();
    assert!(journal.contains("\"intent\"") && journal.contains("released"), "{journal}");
}

/// The ClusterRole grants exactly what the Kubernetes source uses: pods
/// read, events created and patched, IPPools read/watched/patched,
/// OverlappingRangeIPReservations read and deleted; nothing else.
#[test]
fn rbac_grants_only_what_the_kubernetes_source_uses() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/serviceaccount.yaml")).unwrap();
    let list = |line: &str| -> Vec<String> {
        let inner = line.split_once('[').and_then(|(_, r)| r.split_once(']')).map(|(l, _)| l).unwrap_or_default();
        inner.split(',').map(|s| s.trim().trim_matches('"').to_owned()).collect()
    };
    let mut rules = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if let Some(groups) = line.trim().strip_prefix("- apiGroups:") {
            let resources = lines.next().unwrap();
            let verbs = lines.next().unwrap();
            assert!(resources.trim().starts_with("resources:") && verbs.trim().starts_with("verbs:"), "{line}");
            rules.push((list(groups), list(resources), list(verbs)));
        }
    }
    let rule = |g: &str, r: &str, v: &[&str]| {
        (vec![g.to_owned()], vec![r.to_owned()], v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
    };
    assert_eq!(
        rules,
        vec![
            rule("", "pods", &["get", "list", "watch"]),
            rule("events.k8s.io", "events", &["create", "patch"]),
            rule("whereabouts.cni.cncf.io", "ippools", &["get", "list", "watch", "patch"]),
            rule("whereabouts.cni.cncf.io", "overlappingrangeipreservations", &["get", "list", "delete"]),
        ]
    );
}

/// Events people can see: a sandbox whose DEL keeps failing (multus #1498)
/// gets a SandboxStuck warning on its pod; an IP whose owner's netns died
/// while another netns has it configured gets an IPConflict warning, and is
/// not released.
#[test]
fn events_for_a_stuck_sandbox_and_a_conflict() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.14.0/24");
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let failing = setup.dir.path().join("plugins/failing-del");
    std::fs::write(&failing, "#!/bin/sh\ncat >/dev/null\necho '{\"code\":11,\"msg\":\"no cache\"}'\nexit 1\n").unwrap();
    std::fs::set_permissions(&failing, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let agent = setup.agent(&api, &[]);

    // Stuck: ADD, then DEL fails three times.
    let stuck = Sandbox::new();
    let ip_stuck = plugin.add(&api, &pool, &stuck, "nrk-ns", "stuck");
    stuck.configure(&ip_stuck);
    for _ in 0..3 {
        let status = std::process::Command::new(&failing)
            .env("CNI_COMMAND", "DEL")
            .env("CNI_CONTAINERID", &stuck.container_id)
            .env("CNI_NETNS", &stuck.path)
            .env("CNI_IFNAME", "eth0")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!status.success());
    }
    let warned = wait_until(Duration::from_secs(10), || !api.events_regarding("Pod", "stuck").is_empty());
    assert!(
        warned.is_some(),
        "a SandboxStuck event; attachments: {:#}\nevents: {:#}",
        agent.state()["attachments"],
        api.get("/apis/events.k8s.io/v1/events")
    );
    let event = &api.events_regarding("Pod", "stuck")[0];
    assert_eq!((event["reason"].as_str(), event["type"].as_str()), (Some("SandboxStuck"), Some("Warning")), "{event}");
    assert!(event["note"].as_str().unwrap().contains("DEL failed 3 times"), "{event}");

    // Conflict: the owner's netns dies while another netns has its IP.
    let mut owner = Sandbox::new();
    let ip = plugin.add(&api, &pool, &owner, "nrk-ns", "owner");
    owner.configure(&ip);
    assert!(wait_until(Duration::from_secs(10), || wb_verdict(&agent, &ip).is_some()).is_some(), "{}", agent.log());
    let squatter = Sandbox::new();
    squatter.configure(&ip);
    owner.delete_netns();
    let conflict =
        wait_until(Duration::from_secs(10), || wb_verdict(&agent, &ip).is_some_and(|v| v["status"] == "conflict"));
    assert!(conflict.is_some(), "{:#}\n{}", agent.state()["verdicts"], agent.log());
    let warned = wait_until(Duration::from_secs(10), || !api.events_regarding("Pod", "owner").is_empty());
    assert!(warned.is_some(), "an IPConflict event; log:\n{}", agent.log());
    let event = &api.events_regarding("Pod", "owner")[0];
    assert_eq!((event["reason"].as_str(), event["type"].as_str()), (Some("IPConflict"), Some("Warning")), "{event}");
    std::thread::sleep(Duration::from_secs(2));
    assert!(allocations(&api, &pool).values().any(|a| a["podref"] == "nrk-ns/owner"), "a conflict is never released");
    assert_eq!(api.events_regarding("Pod", "owner").len(), 1, "reported once, not on every reconcile");
}

/// A process stopped (SIGSTOP) until dropped (SIGCONT), even on failure.
struct Frozen(u32);
impl Frozen {
    fn stop(pid: u32) -> Self {
        let status = std::process::Command::new("kill").args(["-STOP", &pid.to_string()]).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -STOP {pid}");
        Self(pid)
    }
}
impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill").args(["-CONT", &self.0.to_string()]).status();
    }
}

/// The Pending-pod rule with the pod named only by CNI_ARGS of the
/// container's CNI run (the pool names no pod): the allocation is kept
/// while the pod is Pending, released once the pod is gone, and the Event
/// lands on that pod.
#[test]
fn a_pending_pod_named_only_by_cni_args_keeps_its_allocation() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.15.0/24");
    let plugin = WbPlugin::install(&setup.dir.path().join("plugins"));
    let agent = setup.agent(&api, &[]);
    api.create_pod("nrk-ns", "argsonly", NODE, "Pending", &[]);
    let mut sandbox = Sandbox::new();
    // The agent is stopped while the plugin runs, exits and is reaped: its
    // /proc/<pid>/environ is gone before the agent reads the exec record,
    // so the pod's name can only come from the record itself (a plugin that
    // exits at once: the race this used to lose now and then).
    let frozen = Frozen::stop(agent.pid().expect("the agent runs"));
    let ip = plugin.add_with(&api, &pool, &sandbox, "nrk-ns", "argsonly", false);
    drop(frozen);
    assert!(allocations(&api, &pool).values().all(|a| a["podref"] == ""), "the pool names no pod");
    let named = wait_until(Duration::from_secs(10), || {
        wb_verdict(&agent, &ip).is_some_and(|v| has_fact(&v, "api_pending_pod_named_by_cni_run"))
    });
    assert!(named.is_some(), "{:#}\n{}", agent.state()["verdicts"], agent.log());
    sandbox.delete_netns();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(allocations(&api, &pool).len(), 1, "kept while the pod is Pending");
    assert_eq!(wb_verdict(&agent, &ip).unwrap()["status"], "in_use");

    api.delete("/api/v1/namespaces/nrk-ns/pods/argsonly");
    let released = wait_until(Duration::from_secs(10), || allocations(&api, &pool).is_empty());
    assert!(released.is_some(), "released once the pod is gone; log:\n{}", agent.log());
    let event = wait_until(Duration::from_secs(10), || !api.events_regarding("Pod", "argsonly").is_empty());
    assert!(event.is_some(), "the Event names the pod CNI_ARGS named");
}

/// The stand-in API server itself enforces the conventions the other tests
/// rely on (so they cannot pass by a mock agreeing with our client).
#[test]
fn the_stand_in_api_server_enforces_the_conventions() {
    if !python_present() {
        return;
    }
    let setup = Setup::new();
    let api = ApiServer::start(setup.dir.path());
    let pool = api.create_pool("10.248.16.0/24");
    let path = ApiServer::pool_path(&pool);
    let rv0 = rv(&api.pool(&pool)).to_string();
    let jp = "application/json-patch+json";
    let add = json!([{ "op": "test", "path": "/metadata/resourceVersion", "value": rv0 },
                     { "op": "add", "path": "/spec/allocations/1", "value": { "id": "c1", "podref": "a/b" } }]);
    assert_eq!(api.request("PATCH", &path, jp, Some(&add)).0, 200);
    assert_eq!(api.request("PATCH", &path, jp, Some(&add)).0, 422, "a stale resourceVersion test fails");
    let wrong_owner = json!([{ "op": "test", "path": "/spec/allocations/1/id", "value": "c2" },
                             { "op": "remove", "path": "/spec/allocations/1" }]);
    assert_eq!(api.request("PATCH", &path, jp, Some(&wrong_owner)).0, 422, "a failed test applies nothing");
    assert_eq!(allocations(&api, &pool)["1"]["id"], "c1");
    let missing = json!([{ "op": "remove", "path": "/spec/allocations/9" }]);
    assert_eq!(api.request("PATCH", &path, jp, Some(&missing)).0, 422);
    let mut stale = api.pool(&pool);
    stale["metadata"]["resourceVersion"] = json!(rv0);
    assert_eq!(api.request("PUT", &path, "application/json", Some(&stale)).0, 409, "a stale update conflicts");
    let merge = json!({ "metadata": { "resourceVersion": rv0 }, "spec": { "range": "10.0.0.0/8" } });
    assert_eq!(api.request("PATCH", &path, "application/merge-patch+json", Some(&merge)).0, 409);
    let pre = json!({ "preconditions": { "resourceVersion": rv0 } });
    assert_eq!(api.request("DELETE", &path, "application/json", Some(&pre)).0, 409, "a failed precondition keeps it");
    assert_eq!(
        api.request(
            "POST",
            &format!("{}/namespaces/kube-system/ippools", support::kube::IPPOOLS),
            "application/json",
            Some(&json!({ "metadata": { "name": pool } }))
        )
        .0,
        409
    );
    assert_eq!(
        api.request("GET", "/api/v1/pods?fieldSelector=status.phase%3DRunning", "application/json", None).0,
        400,
        "unindexed fields are refused"
    );
    api.create_pod("nrk-ns", "here", NODE, "Running", &[]);
    api.create_pod("nrk-ns", "there", "nrk-other-node", "Running", &[]);
    let listed = api.get(&format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE}"));
    let names: Vec<&str> =
        listed["items"].as_array().unwrap().iter().map(|p| p["metadata"]["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["here"]);
}
