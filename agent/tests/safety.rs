//! Issue 10's regressions against the real agent binary, real namespaces
//! and Debian's CNI plugins: a live netns netreap cannot open keeps its IP;
//! leaks made while netreap was down are released at start on the kernel's
//! word; a reservation made just before a restart is released as soon as
//! its netns dies after it. (The 1,300-netns start is in `model.rs`; the
//! forged CNI run and the large environment are in `probes.rs`.)
//! Each test has its own subnet: agents see every netns on the host.

#![allow(clippy::unwrap_used, reason = "tests panic with context")]

use netreap_testkit as support;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use support::{
    agent::{Agent, wait_until},
    kernel_tests_possible,
    lab::{Lab, cni_plugins_present},
    unique,
};

fn possible() -> bool {
    kernel_tests_possible() && cni_plugins_present()
}

/// One scenario at a time: each runs an agent with eBPF probes.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn event_time(e: &serde_json::Value) -> SystemTime {
    humantime::parse_rfc3339(e["time"].as_str().unwrap()).unwrap()
}

/// Waits until the agent has saved a binding for each container.
fn wait_saved(lab: &Lab, containers: &[&str]) {
    let path = lab.state_dir.join("knowledge.json");
    let saved = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&path).is_ok_and(|k| containers.iter().all(|c| k.contains(c)))
    });
    assert!(saved.is_some(), "bindings not saved in {}", path.display());
}

/// The nsids the agent saved for these containers' netns.
fn saved_nsids(lab: &Lab, containers: &[&str]) -> Vec<i32> {
    let k: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(lab.state_dir.join("knowledge.json")).unwrap()).unwrap();
    let nsids: Vec<i32> = k["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| containers.iter().any(|c| b["attachment"]["container_id"] == *c))
        .map(|b| b["netns"]["nsid"].as_i64().unwrap_or_else(|| panic!("saved with its nsid: {b:#}")) as i32)
        .collect();
    assert_eq!(nsids.len(), containers.len(), "{k:#}");
    nsids
}

/// A live netns held only by a bind mount in a private mount namespace
/// (like `/var/run/docker/netns` or kata's `/run/vc` seen from a
/// DaemonSet): netreap cannot open it and knows it only by the nsid its
/// veth gave it. Its IP, with an hour-old reservation and cache entry
/// naming a path netreap cannot resolve, is kept through many reconciles
/// past the orphan grace.
#[test]
fn a_live_netns_netreap_cannot_open_keeps_its_ip() {
    struct Hidden(Child, String, String);
    impl Drop for Hidden {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            let _ = Command::new("ip").args(["link", "del", &self.1]).status();
            // The mount point `ip netns add` made on the shared /run stays
            // behind an unmounted, empty file: remove it.
            let _ = std::fs::remove_file(format!("/run/netns/{}", self.2));
        }
    }
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.246.7.0/29");
    let name = unique("nrhid");
    let veth = unique("nrhv");
    let ip_addr = "10.246.7.3";
    let ready = lab.dir.path().join("hidden-ready");
    // The whole setup runs in the private mount namespace; `sleep` keeps it
    // (and with it the bind mount and the netns) alive.
    let script = format!(
        "set -e; ip netns add {name}; ip link add {veth} type veth peer name eth0 netns {name}; \
         ip -n {name} addr add {ip_addr}/29 dev eth0; ip -n {name} link set eth0 up; ip link set {veth} up; \
         touch {ready}; exec sleep 600",
        ready = ready.display()
    );
    let child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdout(Stdio::null())
        .spawn()
        .expect("unshare");
    let _hidden = Hidden(child, veth.clone(), name.clone());
    assert!(wait_until(Duration::from_secs(10), || ready.exists()).is_some(), "hidden netns set up");
    let host_sees = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!host_sees.contains(&name), "the netns must not be mounted where netreap looks");

    // An hour-old reservation and cache entry for it, naming its path.
    let container = format!("{}{}", unique("hid"), "0".repeat(40));
    let net_dir = lab.data_dir.join("hidden");
    std::fs::create_dir_all(&net_dir).unwrap();
    let file = net_dir.join(ip_addr);
    std::fs::write(&file, format!("{container}\r\neth0")).unwrap();
    let results = lab.cache_dir.join("results");
    std::fs::create_dir_all(&results).unwrap();
    let cache = results.join(format!("hidden-{container}-eth0"));
    let config = base64_of(br#"{"cniVersion":"1.0.0","name":"hidden","type":"bridge"}"#);
    std::fs::write(
        &cache,
        format!(
            r#"{{"kind":"cniCacheV1","containerId":"{container}","config":"{config}","ifName":"eth0","networkName":"hidden","netns":"/run/netns/{name}","result":{{"cniVersion":"1.0.0","ips":[{{"address":"{ip_addr}/29"}}]}}}}"#
        ),
    )
    .unwrap();
    for f in [&file, &cache] {
        let status = Command::new("touch").args(["-d", "1 hour ago"]).arg(f).status().unwrap();
        assert!(status.success());
    }

    let agent =
        Agent::start(&lab, &["--orphan-grace", "2s", "--in-flight-grace", "1s", "--resync-interval", "1s"], &[]);
    std::thread::sleep(Duration::from_secs(6));
    assert!(file.exists(), "the live netns's IP was released; events: {:#?}", agent.events_named("release"));
    let verdicts = agent.events_named("verdict_changed");
    let ours: Vec<_> = verdicts.iter().filter(|v| v.to_string().contains(&container)).collect();
    let last = ours.last().unwrap_or_else(|| panic!("no verdict for it: {verdicts:#?}"));
    assert_eq!(last["to"], "in_use", "{last:#}");
    assert!(last["evidence"].to_string().contains("configured in live netns"), "kept because its IP lives: {last:#}");
    assert!(agent.events_named("release").is_empty());
}

/// Standard base64, for the cache's `config` field.
fn base64_of(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Two pods lose their netns (no CNI DEL) while netreap is stopped, as in
/// a DaemonSet rollout; a third lives on. At start the kernel no longer has
/// the nsids netreap saved for the two: both are released within 2 s of the
/// agent's start, with that evidence; the live one is kept.
#[test]
fn leaks_made_while_netreap_was_down_are_released_at_start() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.246.8.0/29");
    let net = lab.network("downnet", "host-local", &[]);
    let mut agent = Agent::start(&lab, &[], &[]);
    let live = lab.pod();
    let mut a = lab.pod();
    let mut b = lab.pod();
    for p in [&live, &a, &b] {
        lab.add(&net, p).expect("ADD");
    }
    wait_saved(&lab, &[&live.container_id, &a.container_id, &b.container_id]);
    let nsids = saved_nsids(&lab, &[&a.container_id, &b.container_id]);
    agent.stop().expect("agent stops");
    let deaths = support::net::plain_nsid_listener();
    a.delete_netns();
    b.delete_netns();
    // The kernel destroys a netns some time after `ip netns del`: wait
    // until both are really gone, so the agent starts after the deaths.
    let mut gone = std::collections::HashSet::new();
    while gone.len() < nsids.len() {
        let (nsid, _) = deaths.recv_timeout(Duration::from_secs(20)).expect("the kernel destroys both netns");
        if nsids.contains(&nsid) {
            gone.insert(nsid);
        }
    }
    assert_eq!(lab.reservations("downnet").len(), 3, "leaked while down");

    let started = SystemTime::now();
    let agent = Agent::start(&lab, &[], &[]);
    let done = wait_until(Duration::from_secs(5), || lab.reservations("downnet").len() == 1);
    assert!(done.is_some(), "leaks not released; log:\n{}", agent.log());
    assert_eq!(lab.reservations("downnet")[0].1, live.container_id, "the live pod keeps its IP");
    // The release events follow the unlinks (the batch reports when done).
    let ours = || -> Vec<serde_json::Value> {
        agent.events_named("release").into_iter().filter(|r| event_time(r) >= started).collect()
    };
    wait_until(Duration::from_secs(5), || ours().len() >= 2);
    let releases = ours();
    assert_eq!(releases.len(), 2, "{releases:#?}");
    for r in &releases {
        let took = event_time(r).duration_since(started).unwrap();
        assert!(took < Duration::from_secs(2), "released {took:?} after start: {r:#}");
        assert_eq!(r["outcome"], "released");
        assert!(r["evidence"].to_string().contains("died"), "released on the death: {r:#}");
    }
    // Each dead pod's death, found at start, names it. (Only these pods':
    // CNI runs elsewhere on the host leave deaths of their own.)
    let deaths = agent.events_named("netns_died");
    for pod in [&a, &b] {
        let named = deaths
            .iter()
            .filter(|d| d["source"] == "while_down")
            .filter(|d| d["container_ids"].as_array().is_some_and(|c| c.iter().any(|c| c == &pod.container_id)))
            .count();
        assert_eq!(named, 1, "{} in one death found at start: {deaths:#?}", pod.container_id);
    }
}

/// A reservation made 5 s before a restart (younger than the youth grace)
/// whose ADD the earlier run saw finish: after the restart its netns dies,
/// and it is released at once, on that death, not after the youth grace.
#[test]
fn a_young_reservation_across_a_restart_is_released_when_its_netns_dies() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.246.9.0/29");
    let net = lab.network("youngnet", "host-local", &[]);
    let mut agent = Agent::start(&lab, &["--in-flight-grace", "30s"], &[]);
    let mut pod = lab.pod();
    let made = Instant::now();
    lab.add(&net, &pod).expect("ADD");
    wait_saved(&lab, &[&pod.container_id]);
    agent.stop().expect("agent stops");
    let agent = Agent::start(&lab, &["--in-flight-grace", "30s"], &[]);
    assert!(made.elapsed() < Duration::from_secs(10), "still young: {:?}", made.elapsed());
    assert_eq!(lab.reservations("youngnet").len(), 1, "kept while its netns lives");
    let deleted = Instant::now();
    pod.delete_netns();
    let took = wait_until(Duration::from_secs(5), || lab.reservations("youngnet").is_empty());
    let took = took.unwrap_or_else(|| panic!("not released; log:\n{}", agent.log()));
    eprintln!("released {took:?} after the netns was deleted");
    assert!(deleted.elapsed() < Duration::from_secs(30), "before the youth grace");
    wait_until(Duration::from_secs(2), || !agent.events_named("release").is_empty());
    let releases = agent.events_named("release");
    assert_eq!(releases.len(), 1, "{releases:#?}");
    assert_eq!(releases[0]["reason"], "netns_died", "{:#}", releases[0]);
}

/// An agent in a mount namespace of its own (as in a container) whose
/// `/run/netns` is another, empty directory: a pod netns bind-mounted on
/// the host is found in the host's mount table and opened through
/// `/proc/1/root`, so it is known by inode and path, not only by nsid.
#[test]
fn an_agent_in_its_own_mount_namespace_opens_host_netns_through_proc_1_root() {
    if !possible() {
        return;
    }
    let _serial = serial();
    let lab = Lab::new("10.246.10.0/29");
    let pod = lab.pod();
    let inode = std::fs::metadata(&pod.path).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap();
    let agent = Agent::start_wrapped(
        &lab,
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs nrs-hide /run/netns && exec \"$0\" \"$@\"",
        ],
        // The host's mount table, as the DaemonSet configures /proc/1/mountinfo
        // (here the test's own: PID 1 of this sandbox is not the host).
        &["--mountinfo", &format!("/proc/{}/mountinfo", std::process::id())],
        &[],
    );
    let found = wait_until(Duration::from_secs(10), || {
        agent.state()["model"]["netns"].as_array().is_some_and(|all| {
            all.iter().any(|n| {
                n["inode"].as_u64() == Some(inode)
                    && n["bind_mounts"]
                        .as_array()
                        .is_some_and(|m| m.iter().any(|p| p.as_str() == Some(&format!("/run/netns/{}", pod.name))))
            })
        })
    });
    assert!(found.is_some(), "netns {inode} not found by its host path; state: {:#}", agent.state()["model"]);
}
