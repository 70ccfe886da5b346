//! Kubernetes end-to-end (issue 12): the real agent binary, real network
//! namespaces and kernel probes, and a STAND-IN API server
//! (tests/support/apiserver.py): no kube-apiserver can be installed on these
//! machines. The stand-in enforces the conventions netreap relies on
//! (resourceVersion on every write, 422 on a failed JSON-patch `test`, 409
//! on conflicts and failed preconditions, fieldSelector on pods, watch with
//! bookmarks); the PyPI `kmock` mock was not used because it enforces none
//! of them (merge-only patches, no resourceVersion, no field selectors).
//!
//! whereabouts allocations are made by a stand-in whereabouts IPAM plugin
//! run with CNI_* in its environment, so the probes record it like any CNI
//! plugin run. Every netns and link here starts with `nrK`.

#![allow(clippy::unwrap_used, reason = "tests panic with context")]

mod support;

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
        for d in ["networks", "cache/results", "state"] {
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
    let plugin = WbPlugin::install(setup.dir.path());
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
    assert_eq!(patch["body"][0], json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv_before.to_string()}));
    assert_eq!(patch["body"][1], json!({"op": "test", "path": format!("/spec/allocations/{offset}/id"), "value": sandbox.container_id}));
    assert_eq!(patch["body"][2], json!({"op": "remove", "path": format!("/spec/allocations/{offset}")}));

    let orip_path = format!("{}/namespaces/kube-system/overlappingrangeipreservations/{ip}", support::kube::IPPOOLS);
    let orip_deletes =
        || -> Vec<Value> { api.log().into_iter().filter(|r| r["method"] == "DELETE" && r["path"] == orip_path.as_str()).collect() };
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
    let release = agent.events_named("release");
    assert!(release.iter().any(|e| e["outcome"] == "released" && e["store"]["kind"] == "whereabouts"), "{release:#?}");
}
