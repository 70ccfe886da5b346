//! End-to-end reclaim scenarios: the real agent binary, the real CNI plugins
//! from Debian (bridge + host-local on a bridge each test creates), driven
//! the way a runtime does (ADD in order with prevResult, DEL in reverse).
//! Each test has its own subnet: agents see every netns on the host, and an
//! address shared across tests would be real evidence of a conflict.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]
#![allow(clippy::unwrap_used, reason = "tests panic with context")]

use netreap_testkit as support;

use std::time::Duration;

use support::{
    agent::{Agent, wait_until},
    kernel_tests_possible,
    lab::{Lab, cni_plugins_present},
};

/// "Within a second of the netns being destroyed", with slack for a noisy
/// 2-core CI machine; `cargo xtask bench` measures it exactly.
const RELEASE_BOUND: Duration = Duration::from_millis(2500);

fn possible() -> bool {
    kernel_tests_possible() && cni_plugins_present()
}

/// One scenario at a time: each runs an agent with eBPF probes, and timing
/// bounds mean little when seven of them share two cores.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn lab_drives_real_plugins() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.1.0/29");
    let net = lab.network("labnet", "host-local", &[]);
    let pod = lab.pod();
    let result = lab.add(&net, &pod).expect("ADD succeeds");
    let ip = result["ips"][0]["address"].as_str().expect("an address").to_owned();
    assert!(ip.starts_with("10.247.1."), "{ip}");
    assert_eq!(lab.reservations("labnet").len(), 1);
    assert!(lab.runtime.cache_path(&net, &pod.attachment()).unwrap().exists());
    lab.del(&net, &pod).expect("DEL succeeds");
    assert!(lab.reservations("labnet").is_empty());
    let failing = lab.network("failnet", "host-local", &["failing"]);
    let pod2 = lab.pod();
    assert!(lab.add(&failing, &pod2).is_err());
    assert!(!lab.runtime.cache_path(&failing, &pod2.attachment()).unwrap().exists(), "no cache after a failed ADD");
    assert_eq!(lab.reservations("failnet").len(), 1, "host-local keeps the IP: the leak");
    assert!(lab.del(&failing, &pod2).is_err());
    assert_eq!(lab.reservations("failnet").len(), 1, "a failed DEL stops the chain: still leaked");
}

/// (a) netns deleted without DEL -> released, with its evidence journaled.
#[test]
fn netns_deleted_without_del_is_released() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.2.0/29");
    let net = lab.network("neta", "host-local", &[]);
    let agent = Agent::start(&lab, &[], &[]);
    let live = lab.pod();
    lab.add(&net, &live).expect("ADD live pod");
    let mut pod = lab.pod();
    lab.add(&net, &pod).expect("ADD");
    assert_eq!(lab.reservations("neta").len(), 2);
    pod.delete_netns();
    let took = wait_until(RELEASE_BOUND, || lab.reservations("neta").len() == 1);
    assert!(
        took.is_some(),
        "not released within {RELEASE_BOUND:?}; verdicts: {:#?}",
        agent.events_named("verdict_changed")
    );
    assert_eq!(lab.reservations("neta")[0].1, live.container_id, "the live pod's reservation is kept");
    wait_until(Duration::from_secs(2), || !agent.events_named("release").is_empty());
    let releases = agent.events_named("release");
    assert_eq!(releases.len(), 1, "{releases:#?}");
    assert_eq!(releases[0]["container_id"], pod.container_id.as_str());
    assert_eq!(releases[0]["outcome"], "released");
    assert_eq!(releases[0]["reason"], "netns_died");
    assert!(releases[0]["evidence"].as_array().is_some_and(|e| !e.is_empty()));
    assert!(!lab.runtime.cache_path(&net, &pod.attachment()).unwrap().exists(), "its cache entry went too");
    let journal = std::fs::read_to_string(lab.state_dir.join("journal.jsonl")).unwrap_or_default();
    assert!(journal.contains(&pod.container_id), "release journaled:\n{journal}");
    assert!(agent.metrics().contains("netreap_releases_total"), "release counted");
    // The death path publishes its pass once the release has reported:
    // the death and the verdict's change are there, before the release.
    let events = agent.events();
    let cid = pod.container_id.as_str();
    let position = |what: &str, of: &dyn Fn(&serde_json::Value) -> bool| {
        events.iter().position(|e| e["event"] == what && of(e)).unwrap_or_else(|| panic!("no {what}: {events:#?}"))
    };
    // The pod's death names its container, also when the model knew its
    // netns by nsid alone (deleted before the mount table was read).
    let died = position("netns_died", &|e| e["container_ids"].as_array().is_some_and(|c| c.iter().any(|c| c == cid)));
    let orphaned = position("verdict_changed", &|e| e["container_id"] == cid && e["to"] == "orphaned");
    let release = position("release", &|e| e["container_id"] == cid);
    assert!(died < release && orphaned < release, "out of order: {events:#?}");
}

/// Runs jobs on a thread of its own mount namespace (private, made when the
/// thread starts): what it spawns (`ip`, the CNI plugins) mounts there, out
/// of the agent's sight, like a runtime whose netns mounts live in a mount
/// namespace the agent does not read.
struct PrivateMounts<'scope> {
    jobs: std::sync::mpsc::Sender<Box<dyn FnOnce() + Send + 'scope>>,
}

impl<'scope> PrivateMounts<'scope> {
    fn start<'env>(scope: &'scope std::thread::Scope<'scope, 'env>) -> Self {
        let (jobs, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send + 'scope>>();
        scope.spawn(move || {
            // SAFETY: unshare(2) of this thread's mount namespace (and its
            // fs attributes); no pointer is passed.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNS) }, 0, "unshare the mount namespace");
            // SAFETY: NUL-terminated strings, null where mount(2) allows it.
            let private = unsafe {
                libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                )
            };
            assert_eq!(private, 0, "make the mounts private");
            for job in rx {
                job();
            }
        });
        Self { jobs }
    }

    /// Runs `f` on the thread and returns what it returns.
    fn run<T: Send + 'scope>(&self, f: impl FnOnce() -> T + Send + 'scope) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        self.jobs.send(Box::new(move || tx.send(f()).expect("answer"))).expect("thread alive");
        rx.recv().expect("job done")
    }
}

fn ip_ok(args: &[&str]) -> bool {
    std::process::Command::new("ip").args(args).status().is_ok_and(|s| s.success())
}

/// A netns the agent never sees mounted (nor any process in it) is known to
/// its model by the nsid the ledger gave it at the CNI run alone. When it is
/// deleted, the death names its container (and the reservation goes at
/// once, on the kernel's word for that nsid).
#[test]
fn the_death_of_a_netns_known_by_nsid_alone_names_its_container() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.9.0/29");
    // IPAM only (host-local, which never enters the netns), held a second
    // after the reservation so that the ledger resolves the plugin's netns
    // through its root while it runs.
    lab.set_delay("slow-ipam", 1);
    let ipam = serde_json::json!({
        "type": "host-local",
        "dataDir": lab.data_dir,
        "ranges": [[{ "subnet": lab.subnet }]]
    });
    let net = netreap::cnirt::Network {
        name: "hidden".into(),
        plugins: vec![serde_json::json!({ "type": "slow-ipam", "ipam": ipam })],
    };
    let name = support::unique("nrhid");
    let path = std::path::PathBuf::from(format!("/run/netns/{name}"));
    let container_id = format!("{}{}", support::unique("ctr"), "0".repeat(40));
    let attachment = netreap::cnirt::Attachment { container_id: &container_id, netns: &path, ifname: "eth0" };
    std::thread::scope(|scope| {
        let hidden = PrivateMounts::start(scope);
        // Made before the agent starts: no creation record to open it by.
        assert!(hidden.run(|| ip_ok(&["netns", "add", &name])), "create netns {name}");
        let agent = Agent::start(&lab, &[], &[]);
        let added = hidden.run(|| lab.runtime.add(&net, &attachment));
        let deleted = hidden.run(|| ip_ok(&["netns", "del", &name]));
        added.expect("ADD");
        assert!(deleted, "delete netns {name}");
        let released = wait_until(RELEASE_BOUND, || lab.reservations("hidden").is_empty());
        // The death is streamed once its release has been handed off.
        let names_ours = |e: &serde_json::Value| {
            e["container_ids"].as_array().is_some_and(|c| c.iter().any(|c| c == container_id.as_str()))
        };
        wait_until(Duration::from_secs(2), || agent.events_named("netns_died").iter().any(names_ours));
        let died = agent.events_named("netns_died");
        let ours: Vec<_> = died.iter().filter(|e| names_ours(e)).collect();
        assert_eq!(ours.len(), 1, "one death names {container_id}: {died:#?}");
        assert!(ours[0]["netns_inode"].is_null(), "known by nsid alone: {:#?}", ours[0]);
        assert!(released.is_some(), "not released; verdicts: {:#?}", agent.events_named("verdict_changed"));
    });
}

/// (b) containerd #12130: a chained plugin fails ADD and DEL; the runtime
/// removes the netns; 20 times. Every leak is released and the /29 (five
/// addresses) keeps allocating. Leaks made while no agent ran exhaust the
/// range; the agent frees them by the orphan grace when it starts.
#[test]
fn failed_chain_leaks_of_containerd_12130_are_released() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.3.0/29");
    let net = lab.network("netb", "host-local", &["failing"]);
    // Without an agent: five leaks exhaust the range.
    for _ in 0..5 {
        let mut pod = lab.pod();
        assert!(lab.add(&net, &pod).is_err());
        assert!(lab.del(&net, &pod).is_err());
        pod.delete_netns();
    }
    assert_eq!(lab.reservations("netb").len(), 5);
    let pod = lab.pod();
    let err = lab.add(&net, &pod).expect_err("range exhausted");
    assert!(err.to_string().contains("no IP addresses available"), "{err}");
    drop(pod);
    // The agent starts: those netns died before it could see them, so only
    // age speaks; a short orphan grace for the test.
    let agent = Agent::start(&lab, &["--orphan-grace", "1s", "--in-flight-grace", "1s"], &[]);
    assert!(
        wait_until(Duration::from_secs(10), || lab.reservations("netb").is_empty()).is_some(),
        "pre-start leaks not released; log:\n{}",
        agent.log()
    );
    // With the agent watching: 20 rounds of the failure, each released.
    for round in 0..20 {
        let mut pod = lab.pod();
        assert!(lab.add(&net, &pod).is_err(), "round {round}: the chain fails");
        assert_eq!(lab.reservations("netb").len(), 1, "round {round}: bridge/host-local reserved an IP");
        assert!(lab.del(&net, &pod).is_err());
        pod.delete_netns();
        assert!(
            wait_until(RELEASE_BOUND, || lab.reservations("netb").is_empty()).is_some(),
            "round {round}: not released; log:\n{}",
            agent.log()
        );
    }
    // The ledger shows the failed operations.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_netreap"))
        .args(["attachments", "--json", "--metrics-addr", &agent.addr.to_string()])
        .output()
        .expect("netreap attachments");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ledger: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let failed_adds = ledger
        .as_array()
        .expect("a list")
        .iter()
        .flat_map(|a| a["operations"].as_array().cloned().unwrap_or_default())
        .filter(|op| {
            op["command"] == "ADD"
                && op["plugin"].as_str().is_some_and(|p| p.ends_with("/failing"))
                && op["exit"]["exit_code"] == 1
        })
        .count();
    assert_eq!(failed_adds, 20, "every failed ADD of the watched rounds is in the ledger");
    // The whole /29 allocates again.
    let ok = lab.network("netb", "host-local", &[]);
    let pods: Vec<_> = (0..5).map(|_| lab.pod()).collect();
    for p in &pods {
        lab.add(&ok, p).expect("a free address");
    }
    assert_eq!(lab.reservations("netb").len(), 5);
    let released = || agent.events_named("release").iter().filter(|e| e["outcome"] == "released").count();
    wait_until(Duration::from_secs(2), || released() == 25);
    assert_eq!(released(), 25);
}

/// (c) A pod re-created under new sandbox IDs, the old ones never deleted:
/// the old reservations are released, the live one kept.
#[test]
fn recreated_sandboxes_release_the_old_and_keep_the_live() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.4.0/29");
    let net = lab.network("netc", "host-local", &[]);
    let agent = Agent::start(&lab, &[], &[]);
    let mut previous = lab.pod();
    lab.add(&net, &previous).expect("first sandbox");
    for _ in 0..3 {
        let successor = lab.pod();
        lab.add(&net, &successor).expect("new sandbox");
        previous.delete_netns();
        let keep = successor.container_id.clone();
        assert!(
            wait_until(RELEASE_BOUND, || {
                let r = lab.reservations("netc");
                r.len() == 1 && r[0].1 == keep
            })
            .is_some(),
            "old sandbox not released; log:\n{}",
            agent.log()
        );
        previous = successor;
    }
    assert_eq!(lab.reservations("netc")[0].1, previous.container_id);
}

/// (d) ADD in flight: IPAM done and the plugin still running (address not
/// configured), then address configured but the cache not yet written:
/// never released while in flight; released once the netns is gone and the
/// ADD has returned.
#[test]
fn add_in_flight_is_never_released() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.5.0/29");
    let agent = Agent::start(&lab, &[], &[]);

    // 1: slow IPAM; the netns is deleted while the ADD runs.
    lab.set_delay("slow-ipam", 3);
    let slow = lab.network("netd", "slow-ipam", &[]);
    let mut pod = lab.pod();
    std::thread::scope(|s| {
        let add = s.spawn(|| lab.add(&slow, &pod));
        assert!(wait_until(Duration::from_secs(5), || lab.reservations("netd").len() == 1).is_some());
        // The runtime gives up on the sandbox mid-ADD.
        assert!(std::process::Command::new("ip").args(["netns", "del", &pod.name]).status().unwrap().success());
        // In flight for ~3 s more: the reservation must stay.
        let gone_early = wait_until(Duration::from_secs(2), || lab.reservations("netd").is_empty());
        assert!(gone_early.is_none(), "released while the ADD was in flight; log:\n{}", agent.log());
        let _ = add.join().expect("ADD thread");
    });
    pod.mark_deleted();
    assert!(
        wait_until(Duration::from_secs(5), || lab.reservations("netd").is_empty()).is_some(),
        "not released after the ADD returned and the netns died; verdict now: {}",
        agent.state()["verdicts"]
    );

    // 2: address configured, the chain's last plugin still sleeping, no cache yet.
    lab.set_delay("slow-chain", 3);
    let chained = lab.network("netd2", "host-local", &["slow-chain"]);
    let mut pod = lab.pod();
    std::thread::scope(|s| {
        let add = s.spawn(|| lab.add(&chained, &pod));
        assert!(wait_until(Duration::from_secs(5), || lab.reservations("netd2").len() == 1).is_some());
        let gone_early = wait_until(Duration::from_secs(2), || lab.reservations("netd2").is_empty());
        assert!(gone_early.is_none(), "released while the ADD was in flight");
        add.join().expect("ADD thread").expect("chained ADD succeeds");
    });
    assert!(lab.runtime.cache_path(&chained, &pod.attachment()).unwrap().exists());
    // Alive and configured: kept.
    assert!(wait_until(Duration::from_secs(1), || lab.reservations("netd2").is_empty()).is_none());
    pod.delete_netns();
    assert!(
        wait_until(RELEASE_BOUND, || lab.reservations("netd2").is_empty()).is_some(),
        "not released after the netns died; attachments: {:#}",
        agent.state()["attachments"]
    );
}

/// (e) An IP reserved for a dead container but configured in another live
/// netns: a conflict, reported, not released.
#[test]
fn ip_configured_in_another_live_netns_is_a_conflict() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.6.0/29");
    let net = lab.network("nete", "host-local", &[]);
    let agent = Agent::start(&lab, &[], &[]);
    let mut owner = lab.pod();
    let result = lab.add(&net, &owner).expect("ADD");
    let address = result["ips"][0]["address"].as_str().expect("address").to_owned();
    // Another sandbox has the same address configured (a duplicate IP).
    let squatter = lab.pod();
    let ok = std::process::Command::new("ip")
        .args(["-n", &squatter.name, "addr", "add", &address, "dev", "lo"])
        .status()
        .unwrap()
        .success();
    assert!(ok, "configure the duplicate");
    owner.delete_netns();
    let conflict = wait_until(Duration::from_secs(5), || !agent.events_named("conflict").is_empty());
    assert!(conflict.is_some(), "no conflict reported; log:\n{}", agent.log());
    // Give a release every chance to (wrongly) happen.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(lab.reservations("nete").len(), 1, "a conflict is never released");
    // A release attempt the last look stopped (the model had not yet seen
    // the squatter's address) is allowed; a release is not.
    let releases = agent.events_named("release");
    assert!(releases.iter().all(|e| e["outcome"] == "kept_by_last_look"), "{releases:#?}\nlog:\n{}", agent.log());
    let ev = &agent.events_named("conflict")[0];
    assert_eq!(ev["reserved_by"], owner.container_id.as_str());
    assert!(agent.metrics().contains("netreap_conflicts_total"));
}

/// (f) The agent is killed between intent and unlink: after a restart there
/// is no double release and nothing is lost.
#[test]
fn crash_between_intent_and_unlink_recovers_once() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.7.0/29");
    let net = lab.network("netf", "host-local", &[]);
    let mut agent = Agent::start(&lab, &[], &[("NETREAP_TEST_CRASH_AFTER_INTENT", "1")]);
    let mut pod = lab.pod();
    lab.add(&net, &pod).expect("ADD");
    pod.delete_netns();
    let status = agent.wait_exit(Duration::from_secs(10)).expect("the agent aborts after the intent");
    assert!(!status.success());
    assert_eq!(lab.reservations("netf").len(), 1, "killed before the unlink: still there");
    let journal = std::fs::read_to_string(lab.state_dir.join("journal.jsonl")).expect("journal");
    assert!(journal.contains(&pod.container_id), "the intent was journaled before acting");
    drop(agent);

    // The restarted agent never saw the netns: its death is not in the new
    // model, so only the orphan grace can release it (1 s here).
    let agent = Agent::start(&lab, &["--orphan-grace", "1s", "--in-flight-grace", "1s"], &[]);
    assert!(
        wait_until(Duration::from_secs(10), || lab.reservations("netf").is_empty()).is_some(),
        "lost: never released after restart; log:\n{}",
        agent.log()
    );
    drop(agent);
    let journal = std::fs::read_to_string(lab.state_dir.join("journal.jsonl")).expect("journal");
    let released = journal.lines().filter(|l| l.contains("\"released\"")).count();
    assert_eq!(released, 1, "exactly one release:\n{journal}");
    // A third start finds nothing pending and releases nothing.
    let before = agent_events_released(&lab);
    let agent = Agent::start(&lab, &["--orphan-grace", "1s", "--in-flight-grace", "1s"], &[]);
    std::thread::sleep(Duration::from_millis(1500));
    drop(agent);
    assert_eq!(agent_events_released(&lab), before, "nothing released twice");
    let journal = std::fs::read_to_string(lab.state_dir.join("journal.jsonl")).expect("journal");
    assert_eq!(journal.lines().filter(|l| l.contains("\"released\"")).count(), 1);
}

fn agent_events_released(lab: &Lab) -> usize {
    std::fs::read_to_string(lab.dir.path().join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"event\":\"release\"") && l.contains("\"outcome\":\"released\""))
        .count()
}

/// (g) Garbage and hostile entries in the data dir: reported, untouched, no
/// panic; the agent keeps working.
#[test]
fn hostile_entries_are_reported_and_untouched() {
    use std::os::unix::fs::symlink;
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.8.0/29");
    let net = lab.network("netg", "host-local", &[]);
    let live = lab.pod();
    lab.add(&net, &live).expect("ADD");
    let dir = lab.data_dir.join("netg");
    let outside = lab.dir.path().join("precious");
    std::fs::write(&outside, "do not delete").unwrap();
    symlink(&outside, dir.join("10.247.8.5")).unwrap();
    std::fs::create_dir(dir.join("10.247.8.6")).unwrap();
    std::fs::write(dir.join("10.247.8.7"), [0u8, 159, 146, 150, 255, 0, 1]).unwrap();
    std::fs::write(dir.join("not-an-ip"), "x").unwrap();
    std::fs::write(dir.join("10.247.8.4"), "a".repeat(1 << 20)).unwrap();
    symlink("/etc/passwd", lab.data_dir.join("evilnet")).unwrap();
    let before = tree(&lab.data_dir);
    let mut agent = Agent::start(&lab, &["--orphan-grace", "1s", "--in-flight-grace", "1s"], &[]);
    assert!(
        wait_until(Duration::from_secs(5), || agent.events_named("anomaly").len() >= 4).is_some(),
        "anomalies not reported: {:#?}\n{}",
        agent.events_named("anomaly"),
        agent.log()
    );
    // It still works: a leak is released next to the garbage.
    let mut pod = lab.pod();
    lab.add(&net, &pod).expect("ADD");
    pod.delete_netns();
    let leaked = pod.container_id.clone();
    assert!(
        wait_until(RELEASE_BOUND, || lab.reservations("netg").iter().all(|(_, c)| *c != leaked)).is_some(),
        "{}",
        agent.log()
    );
    assert!(lab.reservations("netg").iter().any(|(_, c)| *c == live.container_id), "the live pod is kept");
    assert!(agent.exited().is_none(), "no crash");
    assert_eq!(agent.stop().map(|s| s.success()), Some(true), "clean exit");
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "do not delete");
    let after = tree(&lab.data_dir);
    for entry in before.iter().filter(|e| !e.contains("10.247.8.2") && !e.contains("10.247.8.3")) {
        assert!(after.contains(entry), "{entry} was touched");
    }
}

/// Every path below `dir` with its type and size.
fn tree(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let m = std::fs::symlink_metadata(e.path()).unwrap();
        out.push(format!("{} {:?} {}", e.path().display(), m.file_type(), m.len()));
        if m.is_dir() {
            out.extend(tree(&e.path()));
        }
    }
    out.sort();
    out
}

/// SIGTERM detaches the probes and flushes journal and events; a restart
/// neither repeats a release nor loses one made necessary while it was down.
#[test]
fn sigterm_then_restart_neither_repeats_nor_loses_a_release() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.9.0/29");
    let net = lab.network("neth", "host-local", &[]);
    let mut agent = Agent::start(&lab, &[], &[]);
    let mut first = lab.pod();
    lab.add(&net, &first).expect("ADD");
    first.delete_netns();
    assert!(wait_until(RELEASE_BOUND, || lab.reservations("neth").is_empty()).is_some(), "{}", agent.log());
    assert_eq!(agent.stop().map(|s| s.success()), Some(true), "SIGTERM exits cleanly");
    assert!(agent.log().contains("probes detached"), "{}", agent.log());
    let text = std::fs::read_to_string(&agent.events).expect("events");
    assert!(text.ends_with('\n'), "the stream ends on a whole line");
    assert!(text.lines().all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()), "every line is JSON");
    assert_eq!(agent_events_released(&lab), 1);
    drop(agent);

    // A leak made while no agent runs.
    let mut second = lab.pod();
    lab.add(&net, &second).expect("ADD");
    second.delete_netns();
    assert_eq!(lab.reservations("neth").len(), 1);

    let agent = Agent::start(&lab, &["--orphan-grace", "1s", "--in-flight-grace", "1s"], &[]);
    assert!(
        wait_until(Duration::from_secs(10), || lab.reservations("neth").is_empty()).is_some(),
        "the leak made while down is not lost; log:\n{}",
        agent.log()
    );
    wait_until(Duration::from_secs(2), || agent_events_released(&lab) == 2);
    drop(agent);
    assert_eq!(agent_events_released(&lab), 2, "one release each, none repeated");
    let journal = std::fs::read_to_string(lab.state_dir.join("journal.jsonl")).expect("journal");
    assert_eq!(journal.lines().filter(|l| l.contains("\"released\"")).count(), 2, "{journal}");
}

fn netreap(lab: &Lab, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_netreap"))
        .args(args)
        .args(lab.netreap_dir_args())
        .output()
        .expect("netreap runs")
}

/// `netreap scan` explains each leak; `release --from-report` releases
/// exactly what the reviewed report lists, re-verified.
#[test]
fn scan_explains_leaks_and_release_from_report_frees_them() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.247.10.0/29");
    let net = lab.network("neti", "host-local", &[]);
    let live = lab.pod();
    lab.add(&net, &live).expect("ADD");
    let mut spared = lab.pod();
    lab.add(&net, &spared).expect("ADD");
    spared.delete_netns();
    let mut leaked = lab.pod();
    lab.add(&net, &leaked).expect("ADD");
    leaked.delete_netns();
    std::thread::sleep(Duration::from_millis(1200));
    let graces = ["--orphan-grace", "1s", "--in-flight-grace", "1s"];
    let text = netreap(&lab, &[&["scan"][..], &graces].concat());
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(text.contains("2 orphaned") && text.contains("1 in use"), "{text}");
    let json = netreap(&lab, &[&["scan", "--json"][..], &graces].concat());
    let mut report: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON report");
    let verdicts = report["verdicts"].as_array_mut().expect("verdicts");
    let orphaned: Vec<_> = verdicts.iter().filter(|v| v["status"] == "orphaned").collect();
    assert_eq!(orphaned.len(), 2);
    assert!(orphaned.iter().all(|v| !v["evidence"].as_array().unwrap().is_empty()), "each one explained");
    // The reviewer spares one entry by deleting it from the report.
    verdicts.retain(|v| v["reservation"]["container_id"] != spared.container_id.as_str());
    let path = lab.dir.path().join("reviewed.json");
    std::fs::write(&path, serde_json::to_vec(&report).unwrap()).unwrap();
    let out = netreap(&lab, &[&["release", "--from-report", path.to_str().unwrap()][..], &graces].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let left: Vec<String> = lab.reservations("neti").into_iter().map(|(_, c)| c).collect();
    assert!(left.contains(&live.container_id), "live kept");
    assert!(left.contains(&spared.container_id), "spared by the reviewer");
    assert!(!left.contains(&leaked.container_id), "released: {}", String::from_utf8_lossy(&out.stdout));
}

/// `netreap demo` (the README's self-contained demo) works and cleans up.
#[test]
fn the_demo_releases_its_leaks_and_cleans_up() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_netreap"))
        .args(["demo", "--leaks", "2"])
        .output()
        .expect("netreap demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.matches("released by netreap").count(), 2, "{stdout}");
    // "... in netns nrdemo<tag>live: ..." names what it made; all of it is gone.
    let live = stdout
        .split_whitespace()
        .find(|w| w.starts_with("nrdemo") && w.ends_with("live:"))
        .expect("the demo names its live netns")
        .trim_end_matches(':');
    let netns = std::process::Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    assert!(!String::from_utf8_lossy(&netns.stdout).contains(live), "{live} removed");
    let bridge = live.trim_end_matches("live");
    let link = std::process::Command::new("ip").args(["link", "show", bridge]).output().expect("ip link");
    assert!(!link.status.success(), "bridge {bridge} removed");
}
