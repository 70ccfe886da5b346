//! The container runtime as a second witness, end to end with the real
//! containerd (Debian 1.6.20 + runc) driven through the CRI, Debian's
//! bridge + host-local, and the real agent binary. Each test starts its own
//! containerd (own root, state dir, socket) and uses its own subnet
//! (10.252.4x.0/28).
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]
#![allow(clippy::unwrap_used, reason = "tests panic with context")]

use netreap_testkit as support;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use netreap::runtime::api;
use serde_json::Value;
use support::{
    agent::{Agent, wait_until},
    containerd::Containerd,
    kernel_tests_possible,
};

/// One scenario at a time: each runs containerd and an agent with eBPF
/// probes, and timing bounds mean little when they share two cores.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn netreap(args: &[std::ffi::OsString], sub: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_netreap")).arg(sub).args(args).output().expect("run netreap");
    assert!(out.status.success(), "netreap {sub}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The agent's current verdict (JSON) of the reservation of `ip`.
fn verdict_of(agent: &Agent, ip: &str) -> Option<Value> {
    agent.state()["verdicts"].as_array()?.iter().find(|v| v["reservation"]["ip"] == ip).cloned()
}

fn ip_of(ctd: &Containerd, id: &str) -> String {
    ctd.reservations().into_iter().find(|(_, c)| c == id).map(|(ip, _)| ip).expect("a reservation of the sandbox")
}

fn agent(ctd: &Containerd, extra: &[&str]) -> Agent {
    Agent::start_in(ctd.dir.path(), &ctd.netreap_args(), &[], extra, &[])
}

#[test]
fn live_pods_are_kept_named_and_the_cri_source_is_active() {
    if !kernel_tests_possible() {
        return;
    }
    let _serial = serial();
    let ctd = Containerd::start("10.252.40.0/28");
    let agent = agent(&ctd, &["--resync-interval", "1s"]);
    let pods = [ctd.run_pod("nrc-web-1"), ctd.run_pod("nrc-web-2")];
    for pod in &pods {
        let ip = ip_of(&ctd, &pod.id);
        let kept = wait_until(Duration::from_secs(5), || {
            verdict_of(&agent, &ip).is_some_and(|v| {
                v["status"] == "in_use"
                    && v["summary"].as_str().unwrap_or("").contains(&format!("pod nrc/{}", pod.name))
            })
        });
        assert!(
            kept.is_some(),
            "{} not in use with its pod named: {:?}\n{}",
            pod.name,
            verdict_of(&agent, &ip),
            agent.log()
        );
    }
    // Several reconciles later, both are still reserved.
    std::thread::sleep(Duration::from_secs(3));
    for pod in &pods {
        assert!(ctd.reserved_by(&pod.id), "live pod {} lost its IP", pod.name);
    }
    assert!(agent.events_named("release").is_empty(), "{:?}", agent.events_named("release"));
    let active = agent.events_named("source_changed");
    assert_eq!(active.len(), 1, "{active:?}");
    assert_eq!(active[0]["active"], true);

    let sources = netreap(&ctd.netreap_args(), "sources");
    let cri = sources.lines().find(|l| l.starts_with("container runtime (CRI)")).expect("a CRI row");
    assert!(cri.contains(" active ") && cri.contains("containerd") && cri.contains("2 sandboxes"), "{sources}");
    // No kubeconfig and not in a pod: the Kubernetes source is off, and says why.
    assert!(
        sources
            .lines()
            .any(|l| l.starts_with("Kubernetes API") && l.contains("inactive") && l.contains("no --kubeconfig")),
        "{sources}"
    );
    let scan = netreap(&ctd.netreap_args(), "scan");
    assert!(scan.contains("runtime yes") && scan.contains("pod nrc/nrc-web-1") && scan.contains("READY"), "{scan}");
    let attachments = netreap(&["--metrics-addr".into(), agent.addr.to_string().into()], "attachments");
    assert!(pods.iter().all(|p| attachments.contains(&format!("{}  pod nrc/{}", p.id, p.name))), "{attachments}");
}

/// containerd 1.6 treats a DEL error containing "not found" as success and
/// removes the netns: the bridge and host-local never ran their DEL.
#[test]
fn a_leak_through_containerds_teardown_is_released_within_a_second() {
    if !kernel_tests_possible() {
        return;
    }
    let _serial = serial();
    let ctd = Containerd::start("10.252.41.0/28");
    let agent = agent(&ctd, &[]);
    let pod = ctd.run_pod("nrc-leaky");
    let ip = ip_of(&ctd, &pod.id);
    wait_until(Duration::from_secs(5), || verdict_of(&agent, &ip).is_some_and(|v| v["status"] == "in_use"))
        .expect("kept while running");
    ctd.fail_del_with(Some("injected: network nrc not found"));
    ctd.stop_pod(&pod.id).expect("containerd 1.6 calls the teardown a success");
    let stopped = Instant::now();
    let released = wait_until(Duration::from_secs(5), || !ctd.reserved_by(&pod.id));
    let took = released.map(|_| stopped.elapsed());
    assert!(took.is_some_and(|t| t <= Duration::from_secs(1)), "released after {took:?}\n{}", agent.log());
    // The event follows the unlink.
    wait_until(Duration::from_secs(2), || agent.events_named("release").iter().any(|e| e["ip"] == ip));
    let events = agent.events_named("release");
    let release = events.iter().find(|e| e["ip"] == ip).unwrap_or_else(|| panic!("a release event: {}", agent.log()));
    assert_eq!(release["pod"], "nrc/nrc-leaky", "{release}");
    assert_eq!(release["outcome"], "released", "{release}");
    ctd.remove_pod(&pod.id).expect("remove");
}

#[test]
fn a_notready_sandbox_with_a_live_netns_is_stuck_and_kept() {
    if !kernel_tests_possible() {
        return;
    }
    let _serial = serial();
    let ctd = Containerd::start("10.252.42.0/28");
    let agent = agent(&ctd, &["--resync-interval", "1s"]);
    let pod = ctd.run_pod("nrc-stuck");
    let ip = ip_of(&ctd, &pod.id);
    ctd.fail_del_with(Some("injected failure"));
    assert!(ctd.stop_pod(&pod.id).is_err(), "the teardown must fail");
    assert_eq!(ctd.state(&pod.id), api::PodSandboxState::SandboxNotready as i32);
    let reported = wait_until(Duration::from_secs(5), || {
        agent
            .events_named("sandbox_stuck")
            .iter()
            .any(|e| e["sandbox_id"] == pod.id.as_str() && e["pod"] == "nrc/nrc-stuck")
    });
    assert!(reported.is_some(), "no sandbox_stuck event; log:\n{}", agent.log());
    assert!(agent.metrics().contains("netreap_sandboxes_stuck 1"), "{}", agent.metrics());
    std::thread::sleep(Duration::from_secs(2));
    assert!(ctd.reserved_by(&pod.id), "a stuck sandbox keeps its IP");
    let v = verdict_of(&agent, &ip).expect("verdict");
    assert_eq!(v["status"], "in_use", "{v}");
    assert!(v["summary"].as_str().unwrap().contains("stuck"), "{v}");
    let scan = netreap(&ctd.netreap_args(), "scan");
    assert!(scan.lines().any(|l| l.contains("stuck sandbox") && l.contains("nrc/nrc-stuck")), "{scan}");

    // The teardown succeeds at last: no longer stuck, and the DEL freed it.
    ctd.fail_del_with(None);
    ctd.stop_pod(&pod.id).expect("teardown");
    let unstuck = wait_until(Duration::from_secs(5), || !agent.events_named("sandbox_unstuck").is_empty());
    assert!(unstuck.is_some(), "{}", agent.log());
    assert!(agent.metrics().contains("netreap_sandboxes_stuck 0"), "{}", agent.metrics());
    assert!(!ctd.reserved_by(&pod.id));
}

/// netreap is down while pods are removed uncleanly: two it saw made (its
/// saved bindings and the kernel's nsids tell their netns died), and two
/// made and removed while it was down, which it never saw bound: for those
/// the runtime's word (sandbox gone) plus the kernel's (the IP in no live
/// netns) is what releases them, without the 10 min orphan grace.
#[test]
fn leaks_made_while_netreap_was_down_are_released_within_2s_of_its_start() {
    if !kernel_tests_possible() {
        return;
    }
    let _serial = serial();
    let ctd = Containerd::start("10.252.43.0/28");
    // A short in-flight grace: the pods are seconds old, and a reservation
    // younger than it (whose ADD netreap did not see) is kept whatever the
    // runtime says.
    let grace = ["--in-flight-grace", "2s"];
    let mut first = agent(&ctd, &grace);
    let seen = [ctd.run_pod("nrc-seen-a"), ctd.run_pod("nrc-seen-b")];
    let live = ctd.run_pod("nrc-live");
    first.stop();
    let unseen = [ctd.run_pod("nrc-unseen-a"), ctd.run_pod("nrc-unseen-b")];
    ctd.fail_del_with(Some("injected: device not found"));
    for pod in seen.iter().chain(&unseen) {
        ctd.stop_pod(&pod.id).expect("stop (not found counts as success)");
        ctd.remove_pod(&pod.id).expect("remove");
        assert!(ctd.reserved_by(&pod.id), "the uncleanly removed pod {} leaked its IP", pod.name);
    }
    ctd.fail_del_with(None);
    std::thread::sleep(Duration::from_millis(2100));

    let start = Instant::now();
    let second = agent(&ctd, &grace);
    let leaked: Vec<_> = seen.iter().chain(&unseen).collect();
    let released = wait_until(Duration::from_secs(5), || leaked.iter().all(|p| !ctd.reserved_by(&p.id)));
    let took = released.map(|_| start.elapsed());
    assert!(took.is_some_and(|t| t <= Duration::from_secs(2)), "released {took:?} after start\n{}", second.log());
    assert!(ctd.reserved_by(&live.id), "the live pod keeps its IP");
    wait_until(Duration::from_secs(2), || second.events_named("release").len() >= 4);
    let release_events = second.events_named("release");
    for pod in &unseen {
        let ip_of_pod = release_events.iter().find(|e| e["container_id"] == pod.id.as_str());
        let e = ip_of_pod.unwrap_or_else(|| panic!("no release of {}: {release_events:?}", pod.name));
        assert_eq!(e["reason"], "runtime_gone", "{e}");
    }
    assert_eq!(release_events.len(), 4, "{release_events:?}");
}

#[test]
fn with_the_socket_gone_netreap_goes_on_on_kernel_evidence_and_says_so_once() {
    if !kernel_tests_possible() {
        return;
    }
    let _serial = serial();
    let mut ctd = Containerd::start("10.252.44.0/28");
    let agent = agent(&ctd, &["--resync-interval", "1s"]);
    let pod = ctd.run_pod("nrc-survivor");
    let ip = ip_of(&ctd, &pod.id);
    wait_until(Duration::from_secs(5), || verdict_of(&agent, &ip).is_some_and(|v| v["status"] == "in_use"))
        .expect("kept while running");
    ctd.kill();
    std::thread::sleep(Duration::from_secs(4));
    let changes = agent.events_named("source_changed");
    let down: Vec<&Value> = changes.iter().filter(|e| e["active"] == false).collect();
    assert_eq!(down.len(), 1, "said once: {changes:?}");
    assert_eq!(agent.log().matches("container runtime unavailable").count(), 1, "{}", agent.log());
    assert!(agent.metrics().contains("netreap_source_active{source=\"cri\"} 0"), "{}", agent.metrics());
    // The pause process still runs: its IP stays in use, on the kernel's word.
    assert_eq!(verdict_of(&agent, &ip).unwrap()["status"], "in_use");
    assert!(ctd.reserved_by(&pod.id));

    // A leak made by hand (CNI ADD, then the netns deleted) is still released.
    let netns = support::unique("nrCns");
    support::net::ip(&["netns", "add", &netns]);
    let cni = netreap::cnirt::Runtime { plugin_dirs: vec!["/usr/lib/cni".into()], cache_dir: None };
    let net = netreap::cnirt::Network {
        name: ctd.network.clone(),
        plugins: vec![serde_json::json!({
            "type": "bridge", "bridge": ctd.bridge, "isGateway": false, "ipMasq": false,
            "ipam": { "type": "host-local", "dataDir": ctd.data_dir, "ranges": [[{ "subnet": "10.252.44.0/28" }]] }
        })],
    };
    let cid = format!("{}{}", support::unique("nrCctr"), "0".repeat(40));
    let path = std::path::PathBuf::from(format!("/var/run/netns/{netns}"));
    cni.add(&net, &netreap::cnirt::Attachment { container_id: &cid, netns: &path, ifname: "eth0" }).expect("ADD");
    assert!(ctd.reserved_by(&cid));
    support::net::ip(&["netns", "del", &netns]);
    let released = wait_until(Duration::from_secs(3), || !ctd.reserved_by(&cid));
    assert!(released.is_some(), "kernel evidence alone releases: {}", agent.log());

    // The runtime comes back: said once again.
    ctd.spawn();
    // Asked again at most every 5 s after a failure (daemon/runtime.rs).
    let back = wait_until(Duration::from_secs(10), || {
        agent.events_named("source_changed").iter().filter(|e| e["active"] == true).count() == 2
    });
    assert!(back.is_some(), "{:?}", agent.events_named("source_changed"));
}

/// The client's unit tests run on answers recorded from this containerd
/// (agent/src/runtime/testdata): the live answers must read the same way.
/// `NETREAP_RECORD=1` writes them again.
#[test]
fn recorded_responses_read_like_the_live_runtime() {
    use std::collections::HashMap;

    use netreap::runtime::info::{cni_networks, netns_info};
    if !kernel_tests_possible() {
        return;
    }
    let _serial = serial();
    let ctd = Containerd::start("10.252.45.0/28");
    let testdata = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/runtime/testdata");
    let record = std::env::var("NETREAP_RECORD").is_ok_and(|v| v == "1");
    let tmp = ctd.dir.path().to_str().unwrap().to_owned();
    let network = ctd.network.clone();
    let check = |name: &str, live: HashMap<String, String>| {
        let text =
            serde_json::to_string_pretty(&live).unwrap().replace(&tmp, "/tmp/nrC-recorded").replace(&network, "nrCnet");
        let path = testdata.join(name);
        if record {
            std::fs::write(&path, text.clone() + "\n").unwrap();
        }
        let recorded: HashMap<String, String> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
                .unwrap();
        let live: HashMap<String, String> = serde_json::from_str(&text).unwrap();
        let (a, b) = (netns_info(&live), netns_info(&recorded));
        assert_eq!(a.path.is_some(), b.path.is_some(), "{name}: netns path {a:?} vs recorded {b:?}");
        assert_eq!((a.closed, a.pid.is_some()), (b.closed, b.pid.is_some()), "{name}: {a:?} vs recorded {b:?}");
        assert_eq!(cni_networks(&live), cni_networks(&recorded), "{name}");
    };
    let status = ctd.block_on(ctd.client().status_info()).unwrap();
    check("containerd-1.6.20-status.json", status.into_iter().filter(|(k, _)| k == "cniconfig").collect());
    let ready = ctd.run_pod("nrc-rec-ready");
    check("containerd-1.6.20-ready.json", ctd.status_info(&ready.id));
    let stuck = ctd.run_pod("nrc-rec-stuck");
    ctd.fail_del_with(Some("injected failure"));
    assert!(ctd.stop_pod(&stuck.id).is_err());
    check("containerd-1.6.20-stuck.json", ctd.status_info(&stuck.id));
    ctd.fail_del_with(None);
    ctd.stop_pod(&stuck.id).unwrap();
    check("containerd-1.6.20-stopped.json", ctd.status_info(&stuck.id));
}
