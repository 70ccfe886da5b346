//! Release on real files: reservations written by the real host-local
//! plugin (/usr/lib/cni/host-local), its real lock, hostile entries, the
//! journal across a real crash (abort) of a child process, and dry runs.
#![expect(clippy::unwrap_used, reason = "a failing test panics with its context")]

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    net::IpAddr,
    os::unix::{
        ffi::OsStrExt,
        fs::{FileTypeExt, MetadataExt, symlink},
        process::ExitStatusExt,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant, SystemTime},
};

use netreap::{
    engine::{DeadNetns, LiveNetns, NetnsId, Observations, Policy, ScanReport, Status, Verdict, decide, decide_one},
    ipam::{
        AnomalyKind, Reservation, ReservationStore, StoreRef,
        cnicache::{CniCache, entry_name},
        hostlocal::HostLocalStore,
    },
    release::{Journal, Outcome, Releaser, ReleaserConfig, release_reviewed, scan_report},
};

use netreap_testkit as support;

const HOST_LOCAL: &str = "/usr/lib/cni/host-local";

/// The real plugin needs root (for `CNI_NETNS`) and the Debian package.
fn real_plugin_possible() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return support::skip("needs root to create network namespaces");
    }
    if !Path::new(HOST_LOCAL).exists() {
        return support::skip(&format!("{HOST_LOCAL} missing (Debian package containernetworking-plugins)"));
    }
    true
}

fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{}x{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed))
}

/// A named netns (`ip netns add`), deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Self {
        let name = unique("nrr");
        let st = Command::new("ip").args(["netns", "add", &name]).status().unwrap();
        assert!(st.success(), "ip netns add {name}");
        Self { name }
    }

    fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    fn inode(&self) -> u64 {
        fs::metadata(self.path()).unwrap().ino()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Runs host-local the way a runtime does; returns the allocated IP or the
/// plugin's error output.
fn host_local(
    command: &str,
    data_dir: &Path,
    network: &str,
    subnet: &str,
    cid: &str,
    ifname: &str,
    netns: &str,
) -> Result<Option<IpAddr>, String> {
    let conf = serde_json::json!({
        "cniVersion": "0.4.0",
        "name": network,
        "type": "bridge",
        "ipam": {"type": "host-local", "dataDir": data_dir, "ranges": [[{"subnet": subnet}]]},
    });
    let mut child = Command::new(HOST_LOCAL)
        .env_clear()
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", cid)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", ifname)
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(conf.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        return Err(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
    }
    if command != "ADD" {
        return Ok(None);
    }
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cidr = result["ips"][0]["address"].as_str().unwrap();
    Ok(Some(cidr.split('/').next().unwrap().parse().unwrap()))
}

fn add(data_dir: &Path, network: &str, subnet: &str, cid: &str, netns: &Netns) -> IpAddr {
    host_local("ADD", data_dir, network, subnet, cid, "eth0", &netns.path()).unwrap().unwrap()
}

/// What libcni writes after a successful chain ADD.
fn write_cache_entry(cache_dir: &Path, network: &str, cid: &str, ifname: &str, netns: &str, ip: IpAddr) -> PathBuf {
    fs::create_dir_all(cache_dir).unwrap();
    let entry = serde_json::json!({
        "kind": "cniCacheV1", "containerId": cid, "config": "e30=", "ifName": ifname,
        "networkName": network, "netns": netns,
        "result": {"cniVersion": "0.4.0", "ips": [{"version": "4", "address": format!("{ip}/29")}]},
    });
    let path = cache_dir.join(entry_name(network, cid, ifname));
    fs::write(&path, entry.to_string()).unwrap();
    path
}

/// Container `cid`'s netns was seen to die a moment ago.
fn died(cids: &[&str]) -> Observations {
    Observations {
        dead: vec![DeadNetns {
            id: NetnsId::new(Some(4_026_000_001), Some(7), None),
            died_at: SystemTime::now(),
            container_ids: cids.iter().map(|c| (*c).to_owned()).collect(),
            addresses: vec![],
            paths: vec![],
        }],
        ..Observations::default()
    }
}

/// Tests run right after the plugin reserved: no in-flight grace.
fn policy() -> Policy {
    Policy { in_flight_grace: Duration::ZERO, ..Policy::default() }
}

fn verdicts(data_dir: &Path, obs: &Observations) -> Vec<Verdict> {
    let scan = HostLocalStore::new(data_dir).scan();
    decide(obs, &scan.reservations, SystemTime::now(), &policy())
}

fn verdict_for(data_dir: &Path, obs: &Observations, ip: IpAddr) -> Verdict {
    verdicts(data_dir, obs).into_iter().find(|v| v.reservation.ip == ip).unwrap()
}

/// A real host-local reservation for `cid`, whose netns is then seen to
/// die: its IP and its verdict (orphaned).
fn orphan(data_dir: &Path, network: &str, subnet: &str, cid: &str, netns: &Netns) -> (IpAddr, Verdict) {
    let ip = add(data_dir, network, subnet, cid, netns);
    let v = verdict_for(data_dir, &died(&[cid]), ip);
    assert_eq!(v.status, Status::Orphaned, "{v:?}");
    (ip, v)
}

fn releaser(state: &Path, data_dirs: &[&Path], cache: Option<&Path>, dry_run: bool) -> Releaser {
    let config = ReleaserConfig {
        dry_run,
        host_local_dirs: data_dirs.iter().map(|d| d.to_path_buf()).collect(),
        cni_cache_dir: cache.map(Path::to_owned),
        ..ReleaserConfig::default()
    };
    Releaser::open(state, config).unwrap()
}

fn journal_lines(state: &Path) -> Vec<serde_json::Value> {
    fs::read_to_string(state.join("journal.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Every entry below `root` (never following symlinks) with its type and
/// content, to show that nothing changed.
fn snapshot(root: &Path) -> BTreeMap<Vec<u8>, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let meta = fs::symlink_metadata(e.path()).unwrap();
            let key = e.path().strip_prefix(root).unwrap().as_os_str().as_bytes().to_vec();
            let t = meta.file_type();
            let what = if t.is_symlink() {
                format!("symlink -> {}", fs::read_link(e.path()).unwrap().display())
            } else if t.is_dir() {
                stack.push(e.path());
                "dir".to_owned()
            } else if t.is_fifo() {
                "fifo".to_owned()
            } else {
                let bytes = fs::read(e.path()).unwrap();
                format!("file ino {} len {} {:?}", meta.ino(), bytes.len(), &bytes[..bytes.len().min(64)])
            };
            out.insert(key, what);
        }
    }
    out
}

#[test]
fn releases_real_host_local_reservations_and_the_range_allocates_again() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (data, cache, state) = (tmp.path().join("networks"), tmp.path().join("results"), tmp.path().join("state"));
    let netns = Netns::new();
    // A /29 holds 5 pod IPs (.2 - .6; .1 is the gateway).
    let cids: Vec<String> = (0..5).map(|i| format!("leak{i}")).collect();
    let ips: Vec<IpAddr> = cids.iter().map(|c| add(&data, "nrrnet", "10.231.7.0/29", c, &netns)).collect();
    let full = host_local("ADD", &data, "nrrnet", "10.231.7.0/29", "one-more", "eth0", &netns.path());
    assert!(full.unwrap_err().contains("no IP addresses available"), "the /29 is exhausted");
    let cache_entry = write_cache_entry(&cache, "nrrnet", "leak0", "eth0", &netns.path(), ips[0]);
    // IPv6 names, from the real plugin too.
    let ip6 = add(&data, "nrrnet6", "fd00:231:7::/125", "leak6", &netns);

    let scan = HostLocalStore::new(&data).scan();
    assert!(scan.anomalies.is_empty(), "{:?}", scan.anomalies);
    assert_eq!(scan.reservations.len(), 6);
    let r0 = scan.reservations.iter().find(|r| r.ip == ips[0]).unwrap();
    assert_eq!((r0.container_id.as_str(), r0.ifname.as_deref()), ("leak0", Some("eth0")));
    assert!(scan.reservations.iter().any(|r| r.ip == ip6 && r.network == "nrrnet6"));

    // leak0 and leak6 died; the others are alive in `netns`.
    let mut obs = died(&["leak0", "leak6"]);
    obs.live.push(LiveNetns {
        id: NetnsId::new(Some(netns.inode()), None, None),
        container_ids: cids[1..].to_vec(),
        ..LiveNetns::default()
    });
    let vs = verdicts(&data, &obs);
    let orphaned: Vec<IpAddr> = vs.iter().filter(|v| v.is_orphaned()).map(|v| v.reservation.ip).collect();
    assert_eq!(orphaned.len(), 2, "{vs:#?}");
    assert!(orphaned.contains(&ips[0]) && orphaned.contains(&ip6));

    let mut rel = releaser(&state, &[&data], Some(&cache), false);
    let records = rel.release_orphaned(&vs).unwrap();
    assert_eq!(records.len(), 2);
    for rec in &records {
        assert!(rec.outcome.released(), "{}", rec.outcome);
        assert!(!rec.verdict.reservation.path.exists());
    }
    let r0rec = records.iter().find(|r| r.verdict.reservation.ip == ips[0]).unwrap();
    assert_eq!(
        r0rec.outcome,
        Outcome::Released { cache_entries_removed: vec![cache_entry.clone()], cache_notes: vec![] }
    );
    assert!(!cache_entry.exists());
    // The plugin's own files are left alone; live reservations too.
    assert!(data.join("nrrnet/lock").exists() && data.join("nrrnet/last_reserved_ip.0").exists());
    for ip in &ips[1..] {
        assert!(data.join("nrrnet").join(ip.to_string()).exists());
    }
    // Journaled: each intent with its evidence, durable before its outcome
    // (a batch writes both intents, then both outcomes).
    let lines = journal_lines(&state);
    assert_eq!(lines.len(), 4);
    for intent in lines.iter().filter(|l| l["record"] == "intent") {
        assert_eq!(intent["verdict"]["status"], "orphaned");
        assert!(intent["verdict"]["evidence"][0]["text"].as_str().unwrap().contains("died"));
        let at = |pred: &dyn Fn(&serde_json::Value) -> bool| lines.iter().position(pred).unwrap();
        let i = at(&|l| l["record"] == "intent" && l["id"] == intent["id"]);
        let o = at(&|l| l["record"] == "outcome" && l["id"] == intent["id"]);
        assert!(i < o, "intent before its outcome");
        assert_eq!(lines[o]["outcome"]["result"], "released");
    }
    assert_eq!(lines.iter().filter(|l| l["record"] == "intent").count(), 2);
    assert!(rel.journal().pending().is_empty());

    // The exhausted range allocates again, and a repeat changes nothing.
    let again = host_local("ADD", &data, "nrrnet", "10.231.7.0/29", "new", "eth0", &netns.path()).unwrap().unwrap();
    assert_eq!(again, ips[0]);
    let second = rel.release(&records[0].verdict).unwrap();
    assert!(matches!(second.outcome, Outcome::OwnerChanged { .. } | Outcome::AlreadyGone), "{}", second.outcome);
    assert!(data.join("nrrnet").join(ips[0].to_string()).exists(), "the new owner's file stays");
}

#[test]
fn release_waits_for_the_plugins_lock() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let netns = Netns::new();
    let (_, v) = orphan(&data, "nrrlock", "10.231.8.0/29", "c1", &netns);

    // Another process holds the plugin's lock, as a running ADD would.
    let ready = tmp.path().join("ready");
    let mut holder = Command::new("flock")
        .arg("-x")
        .arg(data.join("nrrlock/lock"))
        .arg("-c")
        .arg(format!("touch {}; sleep 0.7", ready.display()))
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "flock holder never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let start = Instant::now();
    let rec = releaser(&tmp.path().join("state"), &[&data], None, false).release(&v).unwrap();
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(400), "did not wait for the lock: {waited:?}");
    assert!(holder.wait().unwrap().success());
    assert!(rec.outcome.released(), "{}", rec.outcome);
    assert!(!v.reservation.path.exists());
}

#[test]
fn an_owner_change_between_decision_and_release_is_never_released() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let state = tmp.path().join("state");
    let netns = Netns::new();
    let (_, v) = orphan(&data, "nrrown", "10.231.9.0/29", "old", &netns);

    // The plugin released it (DEL) and gave it to someone else.
    host_local("DEL", &data, "nrrown", "10.231.9.0/29", "old", "eth0", &netns.path()).unwrap();
    fs::write(&v.reservation.path, "new\r\neth0").unwrap();
    let mut rel = releaser(&state, &[&data], None, false);
    let rec = rel.release(&v).unwrap();
    assert_eq!(rec.outcome, Outcome::OwnerChanged { found: "new/eth0".into() });
    assert_eq!(fs::read_to_string(&v.reservation.path).unwrap(), "new\r\neth0");

    // Same owner, but a re-created file: not the one decided about either.
    fs::remove_file(&v.reservation.path).unwrap();
    fs::write(&v.reservation.path, "old\r\neth0").unwrap();
    let rec = rel.release(&v).unwrap();
    assert!(matches!(&rec.outcome, Outcome::OwnerChanged { found } if found.contains("re-created")), "{}", rec.outcome);
    assert!(v.reservation.path.exists());

    // Both were journaled with their outcome.
    let outcomes: Vec<_> = journal_lines(&state).into_iter().filter(|l| l["record"] == "outcome").collect();
    assert_eq!(outcomes.len(), 2);
    assert!(outcomes.iter().all(|o| o["outcome"]["result"] == "owner_changed"));
}

/// A data dir with one good reservation among garbage and hostile entries.
fn hostile_data_dir(root: &Path) -> (PathBuf, PathBuf) {
    let data = root.join("networks");
    let net = data.join("nrrbad");
    fs::create_dir_all(&net).unwrap();
    fs::write(net.join("lock"), "").unwrap();
    fs::write(net.join("10.231.10.2"), "good\r\neth0").unwrap();
    symlink("/etc/passwd", net.join("10.231.10.3")).unwrap();
    fs::create_dir(net.join("10.231.10.4")).unwrap();
    fs::write(net.join("10.231.10.5"), b"\x7fELF\x00\x01binary").unwrap();
    fs::write(net.join("10.231.10.6"), vec![b'x'; 8 * 1024 * 1024]).unwrap();
    fs::write(net.join("../x"), "a file named ../x from inside the network dir").unwrap();
    fs::write(net.join("not-an-ip"), "c9").unwrap();
    fs::write(net.join("10.231.10"), "c9").unwrap();
    fs::write(net.join("010.231.10.7"), "c9").unwrap();
    fs::write(net.join(std::ffi::OsStr::from_bytes(b"\xff\xfe")), "c9").unwrap();
    fs::write(net.join("10.231.10.8"), "").unwrap();
    let fifo = std::ffi::CString::new(net.join("10.231.10.9").as_os_str().as_bytes()).unwrap();
    // SAFETY: valid path; a FIFO a naive reader would block on forever.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    symlink("/etc", data.join("nrrlink")).unwrap();
    (data, net)
}

#[test]
fn garbage_and_hostile_entries_are_reported_and_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, net) = hostile_data_dir(tmp.path());
    let passwd_before = fs::read("/etc/passwd").unwrap();
    let before = snapshot(&data);

    let scan = HostLocalStore::new(&data).scan();
    assert_eq!(scan.reservations.len(), 1, "{:?}", scan.reservations);
    assert_eq!(scan.reservations[0].container_id, "good");
    let kind_of = |suffix: &[u8]| {
        scan.anomalies
            .iter()
            .find(|a| a.path.as_bytes().ends_with(suffix) || a.path.ends_with(&*String::from_utf8_lossy(suffix)))
            .map(|a| a.kind)
    };
    assert_eq!(kind_of(b"/10.231.10.3"), Some(AnomalyKind::Symlink));
    assert_eq!(kind_of(b"/10.231.10.4"), Some(AnomalyKind::Directory));
    assert_eq!(kind_of(b"/10.231.10.5"), Some(AnomalyKind::BinaryContent));
    assert_eq!(kind_of(b"/10.231.10.6"), Some(AnomalyKind::Oversized));
    assert_eq!(kind_of(b"networks/x"), Some(AnomalyKind::NotADirectory));
    assert_eq!(kind_of(b"/not-an-ip"), Some(AnomalyKind::UnparsableName));
    assert_eq!(kind_of(b"/10.231.10"), Some(AnomalyKind::UnparsableName));
    assert_eq!(kind_of(b"/010.231.10.7"), Some(AnomalyKind::UnparsableName));
    assert_eq!(kind_of(b"/10.231.10.8"), Some(AnomalyKind::EmptyContent));
    assert_eq!(kind_of(b"/10.231.10.9"), Some(AnomalyKind::NotRegularFile));
    assert_eq!(kind_of(b"/nrrlink"), Some(AnomalyKind::Symlink));
    assert_eq!(scan.anomalies.len(), 12, "{:#?}", scan.anomalies);

    // Forged orphaned verdicts aimed at the hostile entries, or outside the
    // store, are refused or found anomalous: nothing is touched.
    let good = scan.reservations[0].clone();
    let forged = |f: &dyn Fn(&mut Reservation)| {
        let mut r = good.clone();
        f(&mut r);
        let mut v = decide_one(&died(&[&r.container_id]), &r, SystemTime::now(), &policy());
        v.status = Status::Orphaned;
        v
    };
    let mut rel = releaser(&tmp.path().join("state"), &[&data], None, false);
    let cases: Vec<(Verdict, &str)> = vec![
        (
            forged(&|r| {
                r.ip = "10.231.10.3".parse().unwrap();
                r.path = net.join("10.231.10.3");
            }),
            "anomalous",
        ),
        (
            forged(&|r| {
                r.ip = "10.231.10.4".parse().unwrap();
                r.path = net.join("10.231.10.4");
            }),
            "anomalous",
        ),
        (
            forged(&|r| {
                r.ip = "10.231.10.9".parse().unwrap();
                r.path = net.join("10.231.10.9");
            }),
            "anomalous",
        ),
        (forged(&|r| r.path = PathBuf::from("/etc/passwd")), "refused"),
        (
            forged(&|r| {
                r.network = "..".into();
                r.path = data.join("../10.231.10.2");
            }),
            "refused",
        ),
        (
            forged(&|r| {
                r.network = "nrrlink".into();
                r.path = data.join("nrrlink/10.231.10.2");
            }),
            "anomalous",
        ),
        (forged(&|r| r.store = StoreRef::CniCache { dir: data.clone() }.into()), "refused"),
    ];
    for (v, expected) in &cases {
        let rec = rel.release(v).unwrap();
        let got = serde_json::to_value(&rec.outcome).unwrap()["result"].as_str().unwrap().to_owned();
        assert_eq!(got, *expected, "{}: {}", v.reservation.path.display(), rec.outcome);
    }
    // Only orphaned verdicts are acted on, and a refusal is not journaled.
    let journaled = journal_lines(&tmp.path().join("state")).len();
    let live_obs =
        Observations { live: vec![LiveNetns { addresses: vec![good.ip], ..LiveNetns::default() }], ..died(&["good"]) };
    let in_use = decide_one(&live_obs, &good, SystemTime::now(), &policy());
    assert_eq!(in_use.status, Status::Conflict, "{}", in_use.summary());
    assert!(matches!(rel.release(&in_use).unwrap().outcome, Outcome::Refused { .. }));
    assert_eq!(journal_lines(&tmp.path().join("state")).len(), journaled);
    assert!(good.path.exists());
    // A real release still works beside all that.
    let v = decide_one(&died(&["good"]), &good, SystemTime::now(), &policy());
    assert!(rel.release(&v).unwrap().outcome.released());
    let mut after = snapshot(&data);
    after.remove(b"nrrbad/10.231.10.2".as_slice());
    let mut expected = before;
    expected.remove(b"nrrbad/10.231.10.2".as_slice());
    assert_eq!(after, expected, "hostile entries changed");
    assert_eq!(fs::read("/etc/passwd").unwrap(), passwd_before);
}

/// Child side of the crash test: release with an abort right after the
/// intent is fsync'd. Runs only when the parent test starts it.
#[test]
#[ignore = "child process of journal_survives_a_crash_between_intent_and_unlink"]
fn crash_child_process() {
    let Ok(job) = std::env::var("NRR_CRASH_JOB") else { return };
    let job: serde_json::Value = serde_json::from_str(&job).unwrap();
    let verdict: Verdict = serde_json::from_value(job["verdict"].clone()).unwrap();
    let state = PathBuf::from(job["state"].as_str().unwrap());
    let data = PathBuf::from(job["data"].as_str().unwrap());
    let config = ReleaserConfig { abort_after_intent: true, host_local_dirs: vec![data], ..ReleaserConfig::default() };
    let mut rel = Releaser::open(&state, config).unwrap();
    let _ = rel.release(&verdict);
    unreachable!("the releaser aborts after the intent");
}

fn crash_between_intent_and_unlink(state: &Path, data: &Path, verdict: &Verdict) {
    let job = serde_json::json!({"verdict": verdict, "state": state, "data": data});
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["crash_child_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("NRR_CRASH_JOB", job.to_string())
        .output()
        .unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "child did not crash: {out:?}");
}

#[test]
fn journal_survives_a_crash_between_intent_and_unlink() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let netns = Netns::new();
    let ips: Vec<IpAddr> =
        ["a", "b", "c"].iter().map(|c| add(&data, "nrrcrash", "10.231.11.0/29", c, &netns)).collect();
    let obs = died(&["a", "b", "c"]);
    let v: Vec<Verdict> = ips.iter().map(|ip| verdict_for(&data, &obs, *ip)).collect();
    assert!(v.iter().all(Verdict::is_orphaned));

    // Three crashes, each leaving an fsync'd intent and an untouched file.
    let states: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("state{i}"))).collect();
    for (state, verdict) in states.iter().zip(&v) {
        crash_between_intent_and_unlink(state, &data, verdict);
        assert!(verdict.reservation.path.exists(), "crashed before the unlink");
    }
    // (a) Nothing else happened: the restart re-verifies and releases.
    // (b) The plugin released it and gave the IP to another container.
    fs::remove_file(&v[1].reservation.path).unwrap();
    fs::write(&v[1].reservation.path, "someone-else\r\neth0").unwrap();
    // (c) The owner turned out alive: its netns is live after all.
    let alive = Observations {
        live: vec![LiveNetns {
            id: NetnsId::new(Some(netns.inode()), None, None),
            container_ids: vec!["c".into()],
            ..LiveNetns::default()
        }],
        ..obs.clone()
    };

    let expected = [
        Outcome::Released { cache_entries_removed: vec![], cache_notes: vec![] },
        Outcome::OwnerChanged { found: "someone-else/eth0".into() },
    ];
    for (i, state) in states.iter().enumerate() {
        let mut rel = releaser(state, &[&data], None, false);
        assert_eq!(rel.journal().pending().len(), 1, "the intent survived the crash");
        let fresh_obs = if i == 2 { alive.clone() } else { obs.clone() };
        let mut calls = 0;
        let records = rel
            .recover(|r| {
                calls += 1;
                decide_one(&fresh_obs, r, SystemTime::now(), &policy())
            })
            .unwrap();
        assert_eq!(calls, 1, "re-verified from scratch");
        assert_eq!(records.len(), 1);
        match i {
            0 | 1 => assert_eq!(records[0].outcome, expected[i]),
            _ => assert!(
                matches!(records[0].outcome, Outcome::Kept { status: Status::InUse, .. }),
                "{}",
                records[0].outcome
            ),
        }
        assert!(rel.journal().pending().is_empty());
        drop(rel);
        // A second restart finds nothing to do: no double release.
        let mut rel = releaser(state, &[&data], None, false);
        assert!(rel.journal().pending().is_empty());
        assert!(rel.recover(|_| unreachable!("nothing pending")).unwrap().is_empty());
    }
    assert!(!v[0].reservation.path.exists());
    assert_eq!(fs::read_to_string(&v[1].reservation.path).unwrap(), "someone-else\r\neth0");
    assert!(v[2].reservation.path.exists());

    // Crash after the unlink (before the outcome): the restart finds it gone.
    let (_, vd) = orphan(&data, "nrrcrash", "10.231.11.0/29", "d", &netns);
    let state = tmp.path().join("state3");
    crash_between_intent_and_unlink(&state, &data, &vd);
    fs::remove_file(&vd.reservation.path).unwrap();
    let mut rel = releaser(&state, &[&data], None, false);
    let records = rel.recover(|r| decide_one(&died(&["d"]), r, SystemTime::now(), &policy())).unwrap();
    assert_eq!(records[0].outcome, Outcome::AlreadyGone);
}

#[test]
fn journal_survives_torn_and_garbage_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let data = tmp.path().join("networks");
    fs::create_dir_all(data.join("n")).unwrap();
    fs::write(data.join("n/10.0.0.2"), "c1\r\neth0").unwrap();
    let r = HostLocalStore::new(&data).scan().reservations.remove(0);
    let v = decide_one(&died(&["c1"]), &r, SystemTime::now(), &policy());
    {
        let mut journal = Journal::open(&state).unwrap();
        journal.record_intent(&v, false).unwrap();
    }
    // Garbage in the middle and a torn last line, as a crash leaves it.
    let path = state.join("journal.jsonl");
    let mut bytes = fs::read(&path).unwrap();
    bytes.splice(0..0, b"\x00\x01 garbage\n".iter().copied());
    bytes.extend_from_slice(br#"{"record":"outcome","id":"#);
    fs::write(&path, &bytes).unwrap();

    let mut rel = releaser(&state, &[&data], None, false);
    let warnings = rel.journal().warnings().to_vec();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[1].contains("torn"), "{warnings:?}");
    assert_eq!(rel.journal().pending().len(), 1, "the intent before the torn line is kept");
    let records = rel.recover(|r| decide_one(&died(&["c1"]), r, SystemTime::now(), &policy())).unwrap();
    assert!(records[0].outcome.released(), "{}", records[0].outcome);
    drop(rel);
    // Records written after the torn line start on a line of their own.
    let journal = Journal::open(&state).unwrap();
    assert!(journal.pending().is_empty());
    assert_eq!(journal.warnings().len(), 2);
    assert!(journal.warnings()[1].contains("not a journal record"), "{:?}", journal.warnings());
    // One releaser per state dir.
    assert!(Journal::open(&state).is_err());
}

#[test]
fn dry_run_journals_and_reports_but_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let cache = tmp.path().join("results");
    // No lock file: taking the lock would create one.
    fs::create_dir_all(data.join("nrrdry")).unwrap();
    fs::write(data.join("nrrdry/10.231.12.2"), "c1\r\neth0").unwrap();
    let entry = write_cache_entry(&cache, "nrrdry", "c1", "eth0", "/run/netns/gone", "10.231.12.2".parse().unwrap());
    let (data_before, cache_before) = (snapshot(&data), snapshot(&cache));

    let state = tmp.path().join("state");
    let mut rel = releaser(&state, &[&data], Some(&cache), true);
    let vs = verdicts(&data, &died(&["c1"]));
    let records = rel.release_orphaned(&vs).unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].outcome, Outcome::WouldRelease { cache_entries: vec![entry], cache_notes: vec![] });
    assert!(records[0].dry_run);
    assert_eq!(snapshot(&data), data_before);
    assert_eq!(snapshot(&cache), cache_before);
    let lines = journal_lines(&state);
    assert_eq!((lines[0]["dry_run"].as_bool(), lines[1]["outcome"]["result"].as_str()), (Some(true), Some("dry_run")));
}

#[test]
fn a_reviewed_report_is_released_exactly_after_re_verification() {
    let tmp = tempfile::tempdir().unwrap();
    let (data_a, data_b) = (tmp.path().join("a"), tmp.path().join("b"));
    let cache = tmp.path().join("results");
    for (dir, ip, cid) in [
        (&data_a, "10.231.13.2", "c1"),
        (&data_a, "10.231.13.3", "c2"),
        (&data_b, "fd00:231::2", "c3"),
        (&data_b, "fd00:231::3", "c4"),
    ] {
        fs::create_dir_all(dir.join("net")).unwrap();
        fs::write(dir.join("net").join(ip), format!("{cid}\r\neth0")).unwrap();
    }
    fs::create_dir_all(&cache).unwrap();
    fs::write(cache.join("garbage"), "{").unwrap();
    let (a, b) = (HostLocalStore::new(&data_a), HostLocalStore::new(&data_b));
    let stores: [&dyn ReservationStore; 2] = [&a, &b];
    let obs = died(&["c1", "c2", "c3"]);
    let report = scan_report(&stores, Some(&CniCache::new(&cache)), &obs, SystemTime::now(), &policy());
    assert_eq!(report.verdicts.len(), 4);
    assert_eq!(report.orphaned().count(), 3);
    assert_eq!(report.anomalies.len(), 1, "the cache's garbage is reported");
    assert_eq!(report.totals.len(), 3, "{:?}", report.totals);

    // The reviewer spares c2 by deleting its entry; c3's is pointed at a
    // data dir the releaser is not configured for.
    let mut json: serde_json::Value = serde_json::to_value(&report).unwrap();
    let list = json["verdicts"].as_array_mut().unwrap();
    list.retain(|v| v["reservation"]["container_id"] != "c2");
    for v in list.iter_mut().filter(|v| v["reservation"]["container_id"] == "c3") {
        v["reservation"]["store"]["data_dir"] = tmp.path().to_str().unwrap().into();
        v["reservation"]["path"] = tmp.path().join("net/fd00:231::2").to_str().unwrap().into();
    }
    let reviewed: ScanReport = serde_json::from_value(json).unwrap();
    // Since the review, c1 came back to life (its netns is live).
    let fresh = Observations {
        live: vec![LiveNetns {
            id: NetnsId::new(Some(1), Some(1), None),
            container_ids: vec!["c1".into()],
            ..LiveNetns::default()
        }],
        ..died(&["c2", "c3"])
    };
    let mut rel = releaser(&tmp.path().join("state"), &[&data_a, &data_b], None, false);
    let records =
        release_reviewed(&reviewed, &mut rel, |r| decide_one(&fresh, r, SystemTime::now(), &policy())).unwrap();
    let by_cid: BTreeMap<&str, &Outcome> =
        records.iter().map(|r| (r.verdict.reservation.container_id.as_str(), &r.outcome)).collect();
    assert_eq!(by_cid.len(), 2, "c2 was spared, c4 never orphaned: {by_cid:?}");
    assert!(matches!(by_cid["c1"], Outcome::Kept { status: Status::InUse, .. }), "{}", by_cid["c1"]);
    assert!(
        matches!(by_cid["c3"], Outcome::Refused { reason } if reason.contains("not one this releaser is configured for")),
        "{}",
        by_cid["c3"]
    );
    for (dir, ip) in
        [(&data_a, "10.231.13.2"), (&data_a, "10.231.13.3"), (&data_b, "fd00:231::2"), (&data_b, "fd00:231::3")]
    {
        assert!(dir.join("net").join(ip).exists(), "{ip} must stay");
    }
    // The untampered report releases c2 and c3.
    let records = release_reviewed(&report, &mut rel, |r| decide_one(&obs, r, SystemTime::now(), &policy())).unwrap();
    let released: Vec<&str> =
        records.iter().filter(|r| r.outcome.released()).map(|r| r.verdict.reservation.container_id.as_str()).collect();
    assert_eq!(released, ["c1", "c2", "c3"]);
    assert!(data_b.join("net/fd00:231::3").exists());
}

/// The journal rotates by size while running (not only at open): the file
/// and its one rotated predecessor stay bounded, and an intent still open
/// is carried across every rotation, so recovery after a restart finds it.
#[test]
fn journal_rotates_while_running_and_carries_open_intents() {
    const LIMIT: u64 = 64 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let data = tmp.path().join("networks");
    fs::create_dir_all(data.join("n")).unwrap();
    fs::write(data.join("n/10.0.0.2"), "c1\r\neth0").unwrap();
    fs::write(data.join("n/10.0.0.3"), "c2\r\neth0").unwrap();
    let reservations = HostLocalStore::new(&data).scan().reservations;
    let verdicts: Vec<Verdict> =
        reservations.iter().map(|r| decide_one(&died(&["c1", "c2"]), r, SystemTime::now(), &policy())).collect();
    let mut journal = Journal::open_with_limit(&state, LIMIT).unwrap();
    let open = journal.record_intent(&verdicts[0], false).unwrap();
    let would = Outcome::WouldRelease { cache_entries: Vec::new(), cache_notes: Vec::new() };
    let mut written = 0u64;
    let path = state.join("journal.jsonl");
    let rotated = state.join("journal.jsonl.1");
    while written < 8 * LIMIT {
        let before = fs::metadata(&path).unwrap().len();
        let intent = journal.record_intent(&verdicts[1], true).unwrap();
        journal.record_outcome(&intent.id, &would, None).unwrap();
        written += fs::metadata(&path).unwrap().len().saturating_sub(before);
        let size = fs::metadata(&path).unwrap().len();
        assert_eq!(size, journal.size(), "the journal's count matches the file");
        assert!(size <= LIMIT, "journal.jsonl is {size} bytes, over the {LIMIT} limit");
        if let Ok(meta) = fs::metadata(&rotated) {
            assert!(meta.len() <= LIMIT + 4096, "journal.jsonl.1 is {} bytes", meta.len());
        }
    }
    assert!(rotated.exists(), "rotated at least once");
    assert_eq!(journal.pending().iter().map(|i| &i.id).collect::<Vec<_>>(), [&open.id]);
    drop(journal);
    let journal = Journal::open(&state).unwrap();
    assert_eq!(journal.pending().iter().map(|i| &i.id).collect::<Vec<_>>(), [&open.id], "found again at start");
    assert!(journal.warnings().is_empty(), "{:?}", journal.warnings());
}

/// After a clean stop with nothing pending, a start reads only the last
/// line: garbage planted earlier in the file is not even seen. Without the
/// marker (a crash), the whole file is read, and the garbage is reported.
#[test]
fn a_clean_stop_lets_the_next_start_read_only_the_last_line() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let data = tmp.path().join("networks");
    fs::create_dir_all(data.join("n")).unwrap();
    fs::write(data.join("n/10.0.0.2"), "c1\r\neth0").unwrap();
    let r = HostLocalStore::new(&data).scan().reservations.remove(0);
    let v = decide_one(&died(&["c1"]), &r, SystemTime::now(), &policy());
    let path = state.join("journal.jsonl");
    {
        let mut journal = Journal::open(&state).unwrap();
        let intent = journal.record_intent(&v, false).unwrap();
        // Pending: no marker, the next start must find the intent.
        assert!(!journal.close_clean().unwrap());
        journal.record_outcome(&intent.id, &Outcome::AlreadyGone, None).unwrap();
        assert!(journal.close_clean().unwrap());
    }
    let mut bytes = b"garbage a crash once left\n".to_vec();
    bytes.extend(fs::read(&path).unwrap());
    fs::write(&path, &bytes).unwrap();
    {
        let mut journal = Journal::open(&state).unwrap();
        assert!(journal.pending().is_empty());
        assert!(journal.warnings().is_empty(), "only the last line was read: {:?}", journal.warnings());
        // A new intent, no clean stop (as after a crash): read in full.
        journal.record_intent(&v, false).unwrap();
    }
    let journal = Journal::open(&state).unwrap();
    assert_eq!(journal.pending().len(), 1, "the open intent is found");
    assert_eq!(journal.warnings().len(), 1, "{:?}", journal.warnings());
    assert!(journal.warnings()[0].contains("not a journal record"), "{:?}", journal.warnings());
}

/// Issue 10: the last look under the plugin's lock. The decision said
/// orphaned (its netns died), but the kernel, asked right before the
/// unlink, has the IP configured in a live netns: the file stays, and the
/// outcome says why, as a conflict.
#[test]
fn the_last_look_keeps_an_ip_configured_in_a_netns_now() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let netns = Netns::new();
    let (ip, v) = orphan(&data, "nrrlook", "10.231.11.0/29", "c1", &netns);
    // The IP lives in a netns (here: the container's own, the model missed it).
    let peer = unique("nrrv");
    let run = |args: &[&str]| assert!(Command::new("ip").args(args).status().unwrap().success(), "ip {args:?}");
    run(&["link", "add", &peer, "type", "veth", "peer", "name", "eth0", "netns", &netns.name]);
    let _peer = LinkGuard(peer);
    run(&["-n", &netns.name, "addr", "add", &format!("{ip}/29"), "dev", "eth0"]);
    let rec = releaser(&tmp.path().join("state"), &[&data], None, false).release(&v).unwrap();
    assert!(
        matches!(&rec.outcome, Outcome::LastLookKept { ip_configured: true, found } if found.contains("configured")),
        "{}",
        rec.outcome
    );
    assert!(v.reservation.path.exists(), "kept");
}

/// The last look also finds a CNI plugin of the container running now
/// (its binary in a CNI bin dir, `CNI_CONTAINERID` in its environment),
/// even one the ledger never saw.
#[test]
fn the_last_look_keeps_a_reservation_whose_cni_run_is_in_flight() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let netns = Netns::new();
    let (_, v) = orphan(&data, "nrrlook2", "10.231.12.0/29", "c2", &netns);
    let bin = tmp.path().join("cni-bin");
    fs::create_dir_all(&bin).unwrap();
    // The "plugin" is a copy of this test binary running the sleeper below
    // (the same on the host and in the qemu guests, whose /bin is busybox).
    fs::copy(std::env::current_exe().unwrap(), bin.join("nrrplugin")).unwrap();
    let mut plugin = Command::new(bin.join("nrrplugin"))
        .args(["--ignored", "--exact", "sleeper_child_process"])
        .env("NETREAP_TEST_SLEEPER", "1")
        .env("CNI_CONTAINERID", "c2")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut rel = releaser(&tmp.path().join("state"), &[&data], None, false);
    rel.set_last_look(Box::new(netreap::release::lastlook::KernelLook::new(
        Vec::new(),
        std::collections::HashSet::new(),
        std::collections::HashSet::new(),
        vec![bin.clone()],
    )));
    let rec = rel.release(&v).unwrap();
    let _ = plugin.kill();
    let _ = plugin.wait();
    assert!(
        matches!(&rec.outcome, Outcome::LastLookKept { ip_configured: false, found } if found.contains("running")),
        "{}",
        rec.outcome
    );
    assert!(v.reservation.path.exists(), "kept");
}

/// A host link, deleted on drop.
struct LinkGuard(String);

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

/// Child process of `the_last_look_keeps_a_reservation_whose_cni_run_is_in_flight`:
/// a long-running "plugin".
#[test]
#[ignore = "child process of the_last_look_keeps_a_reservation_whose_cni_run_is_in_flight"]
fn sleeper_child_process() {
    if std::env::var("NETREAP_TEST_SLEEPER").is_ok_and(|v| v == "1") {
        std::thread::sleep(Duration::from_secs(30));
    }
}

/// Counts its looks, checks the network's lock is held at each, and keeps
/// the one reservation whose IP it is told about.
struct GroupLook {
    lock: PathBuf,
    looks: std::sync::Arc<AtomicU32>,
    configured: IpAddr,
}

impl netreap::release::lastlook::LastLook for GroupLook {
    fn look(
        &mut self,
        asked: &[IpAddr],
    ) -> Result<netreap::release::lastlook::Sighting, netreap::release::lastlook::LookFound> {
        use std::os::fd::AsRawFd as _;
        assert!(asked.contains(&self.configured), "the look is asked about every IP of its group: {asked:?}");
        let probe = fs::File::open(&self.lock).unwrap();
        // SAFETY: a valid descriptor; LOCK_NB never blocks.
        let free = unsafe { libc::flock(probe.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        assert!(!free, "the last look runs while the network's lock is held");
        self.looks.fetch_add(1, Ordering::SeqCst);
        Ok(netreap::release::lastlook::Sighting::with_ip(self.configured, "a test netns".into()))
    }
}

/// A batch takes a network's lock once for its group of files and looks
/// at the kernel once, under that lock; each file is still judged on its
/// own (the one whose IP the look saw configured is kept), and the journal
/// records how long each part took.
#[test]
fn a_batch_locks_each_network_once_and_looks_once_under_the_lock() {
    if !real_plugin_possible() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("networks");
    let netns: Vec<Netns> = (0..3).map(|_| Netns::new()).collect();
    let cids = ["g1", "g2", "g3"];
    let ips: Vec<IpAddr> =
        netns.iter().zip(cids).map(|(n, cid)| add(&data, "nrrgroup", "10.231.13.0/28", cid, n)).collect();
    let all = verdicts(&data, &died(&cids));
    assert_eq!(all.iter().filter(|v| v.status == Status::Orphaned).count(), 3, "{all:#?}");
    let state = tmp.path().join("state");
    let mut rel = releaser(&state, &[&data], None, false);
    let looks = std::sync::Arc::new(AtomicU32::new(0));
    rel.set_last_look(Box::new(GroupLook {
        lock: data.join("nrrgroup/lock"),
        looks: looks.clone(),
        configured: ips[1],
    }));
    let records = rel.release_orphaned(&all).unwrap();
    assert_eq!(looks.load(Ordering::SeqCst), 1, "one look for the network's group");
    for (ip, cid) in ips.iter().zip(cids) {
        let rec = records.iter().find(|r| r.verdict.reservation.ip == *ip).unwrap();
        if *ip == ips[1] {
            assert!(matches!(rec.outcome, Outcome::LastLookKept { ip_configured: true, .. }), "{cid}: {}", rec.outcome);
            assert!(data.join("nrrgroup").join(ip.to_string()).exists(), "{cid} kept");
        } else {
            assert!(rec.outcome.released(), "{cid}: {}", rec.outcome);
            assert!(!data.join("nrrgroup").join(ip.to_string()).exists(), "{cid} released");
        }
    }
    let timed: Vec<serde_json::Value> =
        journal_lines(&state).into_iter().filter(|l| l["record"] == "outcome" && l["timings"].is_object()).collect();
    assert_eq!(timed.len(), 3, "every outcome of the batch carries its timings");
    assert!(timed.iter().all(|l| l["timings"]["look_us"].as_u64().is_some()), "{timed:?}");
}
