//! The CNI ledger from real plugin runs seen by the real probes, through
//! the same filter the agent applies before its ledger: a failed chained
//! ADD (containerd #12130) binds its container to its netns, and processes
//! that only claim to be CNI runs change nothing. Runs in the qemu guests
//! (no latency bounds), with both environment scans where the kernel has
//! bpf_loop.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]
#![allow(clippy::unwrap_used, reason = "tests panic with context")]

use netreap_testkit as support;

use std::{
    os::unix::{fs::MetadataExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use netreap::{
    kernel::{cni_runs::CniRunFilter, events::KernelEvent},
    ledger::{Guess, Ledger, NetnsResolver, StatResolver},
};
use support::{
    Watch, both_scans, kernel_tests_possible,
    lab::{DEBIAN_PLUGINS, Lab, cni_plugins_present},
    runtime, unique,
};

const WAIT: Duration = Duration::from_secs(20);

fn wall(ktime_ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ktime_ns)
}

/// The agent's path for one record: the filter, then the ledger.
fn feed(filter: &CniRunFilter, ledger: &mut Ledger, event: &KernelEvent) {
    if filter.admit(event).is_ok() {
        ledger.observe(event, wall, &StatResolver::default());
    }
}

fn filter_for(lab: &Lab) -> CniRunFilter {
    CniRunFilter::new(&[lab.plugin_dir(), PathBuf::from(DEBIAN_PLUGINS)])
}

fn preconditions() -> bool {
    if !kernel_tests_possible() {
        return false;
    }
    assert!(cni_plugins_present(), "Debian's containernetworking-plugins are needed (cargo xtask test installs them)");
    true
}

/// Reads records into the ledger until `done` holds for it.
async fn feed_until(
    w: &mut Watch,
    filter: &CniRunFilter,
    ledger: &mut Ledger,
    what: &str,
    done: impl Fn(&Ledger) -> bool,
) {
    w.wait_for(WAIT, what, |e| {
        feed(filter, ledger, e);
        done(ledger)
    })
    .await;
}

#[test]
fn a_failed_chained_add_binds_its_container_to_its_netns() {
    if !preconditions() {
        return;
    }
    let _quiet = QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    runtime().block_on(async {
        for (i, (scan, mut w)) in both_scans().into_iter().enumerate() {
            let lab = Lab::new(&format!("10.253.{}.0/29", 20 + i));
            let pod = lab.pod();
            let inode = std::fs::metadata(&pod.path).expect("pod netns").ino();
            // bridge + host-local succeed, then the chained plugin fails ADD.
            let net = lab.network(&unique("nrEnet"), "host-local", &["failing"]);
            assert!(lab.add(&net, &pod).is_err(), "the chained plugin fails ADD");
            assert_eq!(lab.reservations(&net.name).len(), 1, "host-local kept the IP (the leak)");

            let filter = filter_for(&lab);
            let mut ledger = Ledger::new();
            let failing = lab.plugin_dir().join("failing").display().to_string();
            let cid = pod.container_id.clone();
            feed_until(&mut w, &filter, &mut ledger, "the failing plugin's exit", |l| {
                l.get(&cid).is_some_and(|a| a.operations.iter().any(|op| op.plugin == failing && !op.in_flight()))
            })
            .await;
            let a = ledger.get(&cid).unwrap();
            assert_eq!(a.netns_inode, Some(inode), "{scan}: bound to the pod's netns");
            assert_eq!(a.netns_path.as_deref(), Some(pod.path.to_str().unwrap()), "{scan}");
            let op = a.operations.iter().find(|op| op.plugin == failing).unwrap();
            assert_eq!(op.command, "ADD", "{scan}");
            assert_eq!(op.result(), "failure", "{scan}");
            let bridge = a.operations.iter().find(|op| op.plugin.ends_with("/bridge")).expect("bridge ADD recorded");
            assert_eq!(bridge.result(), "success", "{scan}");
            assert!(!a.in_flight(), "{scan}: nothing in flight once the plugins exited");
        }
    });
}

/// Resolves as the agent does, noting whose runs it resolved.
#[derive(Default)]
struct Noting {
    inner: StatResolver,
    pids: std::cell::RefCell<Vec<u32>>,
}

impl NetnsResolver for Noting {
    fn inode_of(&self, path: &str, pid: Option<u32>) -> Option<u64> {
        self.inner.inode_of(path, pid)
    }

    fn resolve(&self, path: &str, pid: Option<u32>, guess: Guess) -> (Option<u64>, Option<i32>) {
        self.pids.borrow_mut().extend(pid);
        self.inner.resolve(path, pid, guess)
    }
}

/// A real ADD and DEL (bridge, which runs host-local for the same
/// operation): the kernel reports each host-local run nested in its bridge
/// run, and the ledger binds the container to its netns (inode and the
/// kernel's nsid) with the bridge runs' resolutions only, one per
/// operation.
#[test]
fn a_nested_ipam_run_takes_its_plugins_resolution() {
    if !preconditions() {
        return;
    }
    let _quiet = QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    runtime().block_on(async {
        for (i, (scan, mut w)) in both_scans().into_iter().enumerate() {
            let lab = Lab::new(&format!("10.253.{}.0/29", 26 + i));
            let pod = lab.pod();
            let inode = std::fs::metadata(&pod.path).expect("pod netns").ino();
            let net = lab.network(&unique("nrEnet"), "host-local", &[]);
            lab.add(&net, &pod).expect("a real ADD");
            lab.del(&net, &pod).expect("a real DEL");
            let filter = filter_for(&lab);
            let mut ledger = Ledger::new();
            let resolver = Noting::default();
            let cid = pod.container_id.clone();
            let mut nested = Vec::new();
            w.wait_for(WAIT, "the real runs' exits", |e| {
                if filter.admit(e).is_ok() {
                    if let KernelEvent::CniExec { task, exec } = e
                        && exec.container_id.as_ref().is_some_and(|c| c.value == cid)
                    {
                        nested.push((task.tgid, exec.nested_in));
                    }
                    ledger.observe(e, wall, &resolver);
                }
                ledger.get(&cid).is_some_and(|a| a.operations.len() >= 4 && !a.in_flight())
            })
            .await;
            let a = ledger.get(&cid).unwrap();
            let ops: Vec<(&str, &str, u32)> = a
                .operations
                .iter()
                .map(|op| (op.command.as_str(), op.plugin.rsplit('/').next().unwrap_or_default(), op.pid))
                .collect();
            let [
                ("ADD", "bridge", add),
                ("ADD", "host-local", add_ipam),
                ("DEL", "bridge", del),
                ("DEL", "host-local", del_ipam),
            ] = ops[..]
            else {
                panic!("{scan}: bridge and its host-local, ADD then DEL: {ops:?}");
            };
            assert_eq!(nested, [(add, None), (add_ipam, Some(add)), (del, None), (del_ipam, Some(del))], "{scan}");
            let resolving: Vec<u32> =
                resolver.pids.borrow().iter().copied().filter(|p| [add, add_ipam, del, del_ipam].contains(p)).collect();
            // The DEL names the path the ADD resolved: it keeps that binding.
            assert_eq!(resolving, [add], "{scan}: only the bridge's ADD resolved");
            let fd = std::fs::File::open(&pod.path).expect("opens the pod's netns");
            let nsid = netreap::netlink::query::Querier::open()
                .expect("a socket")
                .nsid_of(std::os::fd::AsRawFd::as_raw_fd(&fd), false)
                .expect("asks");
            assert!(nsid.is_some(), "{scan}: the ADD's resolution gave the netns an nsid");
            assert_eq!((a.netns_inode, a.netns_nsid), (Some(inode), nsid), "{scan}");
            // Dated by the last run that bound it: the ADD's host-local,
            // with the bridge's resolution; the DELs left it as it was.
            let add_ipam_started = a.operations[1].started_at;
            assert_eq!(a.netns_bound_at, Some(add_ipam_started), "{scan}: dated by the ADD's nested run");
        }
    });
}

/// Runs `binary` with a forged DEL of `container` and waits for it.
fn forge(binary: &Path, args: &[&str], container: &str, netns: &str, uid: Option<u32>) -> u32 {
    let mut cmd = Command::new(binary);
    cmd.args(args)
        .env_clear()
        .env("CNI_COMMAND", "DEL")
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", DEBIAN_PLUGINS)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    let pid = child.id();
    child.wait().expect("forged run exits");
    pid
}

#[test]
fn forged_cni_runs_change_nothing_in_the_ledger() {
    if !preconditions() {
        return;
    }
    let _quiet = QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    runtime().block_on(async {
        let (_, mut w) = both_scans().into_iter().next().expect("a scan");
        let lab = Lab::new("10.253.24.0/29");
        let pod = lab.pod();
        let net = lab.network(&unique("nrEnet"), "host-local", &[]);
        lab.add(&net, &pod).expect("a real ADD");
        let filter = filter_for(&lab);
        let mut ledger = Ledger::new();
        let cid = pod.container_id.clone();
        feed_until(&mut w, &filter, &mut ledger, "the real ADD's runs", |l| {
            l.get(&cid).is_some_and(|a| a.operations.len() >= 2 && !a.in_flight())
        })
        .await;
        // Other tests of this binary run plugins at the same time: compare
        // the victim's record, and look for the forged runs everywhere.
        let before = ledger.get(&cid).cloned();

        // A copy of a real plugin outside the bin dirs, a shell, and a real
        // plugin in a bin dir run by a user other than root.
        let elsewhere = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(elsewhere.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let copy = elsewhere.path().join("bridge");
        std::fs::copy(Path::new(DEBIAN_PLUGINS).join("bridge"), &copy).expect("copy bridge");
        let other_netns = format!("/var/run/netns/{}", unique("nrEgone"));
        let forged = [
            (copy.clone(), vec![], None, "outside_bin_dirs"),
            (PathBuf::from("/bin/sh"), vec!["-c", "exit 0"], None, "outside_bin_dirs"),
            (Path::new(DEBIAN_PLUGINS).join("loopback"), vec![], Some(65534), "not_root"),
        ];
        for (binary, args, uid, reason) in forged {
            let pid = forge(&binary, &args, &cid, &other_netns, uid);
            let mut anomaly = None;
            w.wait_for(WAIT, "the forged run's exit", |e| {
                if let KernelEvent::CniExec { task, .. } = e
                    && task.tgid == pid
                {
                    anomaly = Some(filter.admit(e));
                }
                feed(&filter, &mut ledger, e);
                matches!(e, KernelEvent::CniExit { task, .. } if task.tgid == pid)
            })
            .await;
            let anomaly = anomaly.unwrap_or_else(|| panic!("{}: no exec record", binary.display()));
            assert_eq!(anomaly.map_err(|a| a.reason()), Err(reason), "{}", binary.display());
            assert_eq!(ledger.get(&cid).cloned(), before, "{}: the victim's record is unchanged", binary.display());
            let traces: Vec<_> = ledger
                .attachments()
                .filter(|a| {
                    a.netns_path.as_deref() == Some(other_netns.as_str()) || a.operations.iter().any(|op| op.pid == pid)
                })
                .collect();
            assert!(traces.is_empty(), "{}: the forged run left {traces:#?}", binary.display());
            assert!(!ledger.is_running(pid), "{}: not in flight", binary.display());
        }
        assert_eq!(ledger.unattributed_runs().count(), 0);
    });
}

/// Whether `stream`'s records hold the exec of `pid` with `command`.
fn holds_exec(records: &[KernelEvent], pid: u32, command: &str) -> bool {
    records
        .iter()
        .any(|e| matches!(e, KernelEvent::CniExec { task, exec } if task.tgid == pid && exec.command.value == command))
}

/// An ADD's exec record wakes the reader while the run is still going (its
/// CNI_NETNS is resolved while the netns surely lives); a DEL's waits in the
/// ring, readable by whoever reads it (the agent, before each decision),
/// and comes at the latest with the run's exit.
#[test]
fn an_add_is_read_at_its_exec_and_a_del_is_readable_before_its_exit() {
    if !preconditions() {
        return;
    }
    let _quiet = QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    runtime().block_on(async {
        let mut w = support::watch();
        let cid = format!("{}{}", unique("nrEwake"), "0".repeat(40));
        let run = |command: &str| {
            // Killed below; long enough to outlast a slow emulated guest.
            Command::new("/bin/sleep")
                .arg("120")
                .env_clear()
                .env("CNI_COMMAND", command)
                .env("CNI_CONTAINERID", &cid)
                .env("CNI_NETNS", "/var/run/netns/nrEwake")
                .stdin(Stdio::null())
                .spawn()
                .expect("sleep runs")
        };

        let mut add = run("ADD");
        let deadline = std::time::Instant::now() + WAIT;
        let mut seen = Vec::new();
        while !holds_exec(&seen, add.id(), "ADD") {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Ok(batch) = tokio::time::timeout(left, w.stream.next_batch()).await else {
                panic!("the ADD's exec record woke no reader within {WAIT:?}; read {seen:#?}");
            };
            seen.extend(batch.expect("ring buffer readable").into_iter().flatten());
        }
        assert!(add.try_wait().expect("wait").is_none(), "read only after the ADD ended");
        add.kill().expect("kill");
        add.wait().expect("reap");

        let mut del = run("DEL");
        let deadline = std::time::Instant::now() + WAIT;
        let mut seen = Vec::new();
        while !holds_exec(&seen, del.id(), "DEL") {
            assert!(std::time::Instant::now() < deadline, "the DEL's exec record was not in the ring; read {seen:#?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
            seen.extend(w.stream.pending().into_iter().flatten());
        }
        assert!(del.try_wait().expect("wait").is_none(), "readable only after the DEL ended");
        del.kill().expect("kill");
        del.wait().expect("reap");
    });
}

/// Tests of this binary that need a ring no other test of it writes to:
/// a wake-up is only attributable to a record when nothing else was written.
static QUIET: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What one try of the nested-run scenario showed.
enum NestedTry {
    /// Other records woke the reader while the nested run's were unread.
    Noisy,
    Proved,
}

/// A nested run (a plugin's child with the parent's CNI_COMMAND,
/// CNI_CONTAINERID and CNI_NETNS, as bridge execs host-local) writes its
/// exec and exit records without a wake-up: they are read with its parent's
/// exit, which wakes the reader, and before it. A child naming another
/// container is an outer run: its records wake the reader at once.
#[test]
fn a_nested_runs_records_are_read_with_its_parents_exit() {
    if !preconditions() {
        return;
    }
    let _quiet = QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    runtime().block_on(async {
        for (scan, mut w) in both_scans() {
            // Anything else on the node (pod cycles of a benchmark) may wake
            // the reader in the window: such a try proves nothing, and is
            // tried again; a node never quiet for a second fails the test
            // (it proved nothing: a pass by skipping would hide that).
            let mut tries = 0;
            while matches!(nested_try(&mut w, scan).await, NestedTry::Noisy) {
                tries += 1;
                assert!(tries < 20, "{scan}: other records woke the reader in each of {tries} tries");
            }
        }
    });
}

async fn nested_try(w: &mut Watch, scan: &str) -> NestedTry {
    use std::io::Write as _;
    let cid = format!("{}{}", unique("nrEnest"), "0".repeat(40));
    let other = format!("{}{}", unique("nrEother"), "0".repeat(40));
    let netns = "/var/run/netns/nrEnest";
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("nested-ran");
    // The parent waits for a line before each child (so each one's records
    // are told apart), and for the end of its input before it exits.
    let mut parent = Command::new("/bin/sh")
        .args([
            "-c",
            &format!("read a; CNI_CONTAINERID={other} /bin/true; read b; /bin/touch {}; read c", marker.display()),
        ])
        .env_clear()
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", &cid)
        .env("CNI_NETNS", netns)
        .stdin(Stdio::piped())
        .spawn()
        .expect("sh runs");
    let parent_pid = parent.id();
    let mut input = parent.stdin.take().expect("piped stdin");
    let mut seen: Vec<KernelEvent> = Vec::new();
    let next = async |w: &mut Watch, seen: &mut Vec<KernelEvent>, what: &str| {
        let Ok(batch) = tokio::time::timeout(WAIT, w.stream.next_batch()).await else {
            panic!("{scan}: {what} woke no reader within {WAIT:?}; read {seen:#?}");
        };
        let batch: Vec<KernelEvent> = batch.expect("ring buffer readable").into_iter().flatten().collect();
        seen.extend(batch.iter().cloned());
        batch
    };
    let exec_of = |e: &KernelEvent, container: &str| match e {
        KernelEvent::CniExec { task, exec }
            if task.tgid != parent_pid && exec.container_id.as_ref().is_some_and(|c| c.value == container) =>
        {
            Some(task.tgid)
        }
        _ => None,
    };
    let exit_of = |e: &KernelEvent, pid: u32| matches!(e, KernelEvent::CniExit { task, .. } if task.tgid == pid);

    // The outer ADD's exec wakes the reader.
    while !holds_exec(&seen, parent_pid, "ADD") {
        next(w, &mut seen, "the outer ADD's exec").await;
    }

    // A child for another container: its exec and exit each wake.
    writeln!(input, "go").expect("parent reads");
    let mut other_pid = None;
    while !other_pid.is_some_and(|p| seen.iter().any(|e| exit_of(e, p))) {
        let batch = next(w, &mut seen, "a child run for another container").await;
        other_pid = other_pid.or_else(|| batch.iter().find_map(|e| exec_of(e, &other)));
    }

    // The nested child: nothing it writes may wake the reader, from its
    // exec until well after its exit (its file is made between the two).
    seen.clear();
    writeln!(input, "go").expect("parent reads");
    let mut window = std::time::Instant::now() + WAIT;
    let mut nested_pid = None;
    loop {
        if marker.exists() {
            window = window.min(std::time::Instant::now() + Duration::from_millis(500));
        }
        let left = window.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        let step = left.min(Duration::from_millis(20));
        let Ok(batch) = tokio::time::timeout(step, w.stream.next_batch()).await else { continue };
        let batch: Vec<KernelEvent> = batch.expect("ring buffer readable").into_iter().flatten().collect();
        let Some(pid) = batch.iter().find_map(|e| exec_of(e, &cid)) else {
            // Woken by others before the nested run wrote: not its doing.
            continue;
        };
        nested_pid = Some(pid);
        assert!(
            !batch.iter().all(|e| exec_of(e, &cid).is_some() || exit_of(e, pid)),
            "{scan}: the nested run's records woke the reader before its parent's exit: {batch:#?}"
        );
        break;
    }
    assert!(marker.exists(), "{scan}: the nested run did not run within {WAIT:?}");
    if nested_pid.is_some() {
        drop(input);
        parent.wait().expect("reap");
        return NestedTry::Noisy;
    }

    // Its parent's exit wakes the reader and brings them, before it.
    drop(input);
    parent.wait().expect("reap");
    while !seen.iter().any(|e| exit_of(e, parent_pid)) {
        next(w, &mut seen, "the outer ADD's exit").await;
    }
    let at = |pred: &dyn Fn(&KernelEvent) -> bool| seen.iter().position(pred);
    let exec = at(&|e| exec_of(e, &cid).is_some()).unwrap_or_else(|| panic!("{scan}: no nested exec in {seen:#?}"));
    let pid = exec_of(&seen[exec], &cid).expect("an exec");
    let exit = at(&|e| exit_of(e, pid)).unwrap_or_else(|| panic!("{scan}: no nested exit in {seen:#?}"));
    let parent_exit = at(&|e| exit_of(e, parent_pid)).expect("the parent's exit");
    assert!(exec < exit && exit < parent_exit, "{scan}: nested exec, its exit, then the parent's exit: {seen:#?}");
    NestedTry::Proved
}

/// A nested run whose parent is killed outlives it: its exec record is read
/// with the parent's exit, and its own exit wakes the reader (it was
/// re-parented, so it is nested no longer).
#[test]
fn a_nested_run_that_outlives_its_killed_parent_wakes_the_reader_at_its_exit() {
    if !preconditions() {
        return;
    }
    let _quiet = QUIET.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    runtime().block_on(async {
        for (scan, mut w) in both_scans() {
            let cid = format!("{}{}", unique("nrEorphan"), "0".repeat(40));
            let mut parent = Command::new("/bin/sh")
                .args(["-c", "/bin/sleep 3 & read a"])
                .env_clear()
                .env("CNI_COMMAND", "ADD")
                .env("CNI_CONTAINERID", &cid)
                .env("CNI_NETNS", "/var/run/netns/nrEorphan")
                .stdin(Stdio::piped())
                .spawn()
                .expect("sh runs");
            let parent_pid = parent.id();
            let deadline = std::time::Instant::now() + WAIT;
            let child = loop {
                if let Some(pid) = child_named(parent_pid, "sleep") {
                    break pid;
                }
                assert!(std::time::Instant::now() < deadline, "{scan}: sh started no sleep within {WAIT:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            };
            parent.kill().expect("kill");
            parent.wait().expect("reap");
            let (_, before) = w
                .wait_for(
                    WAIT,
                    "the killed parent's exit",
                    |e| matches!(e, KernelEvent::CniExit { task, .. } if task.tgid == parent_pid),
                )
                .await;
            assert!(
                holds_exec(&before, child, "ADD"),
                "{scan}: the child's exec is read with its parent's exit: {before:#?}"
            );
            let mut seen = Vec::new();
            while !seen.iter().any(|e| matches!(e, KernelEvent::CniExit { task, .. } if task.tgid == child)) {
                let Ok(batch) = tokio::time::timeout(WAIT, w.stream.next_batch()).await else {
                    panic!("{scan}: the orphaned child's exit woke no reader within {WAIT:?}; read {seen:#?}");
                };
                seen.extend(batch.expect("ring buffer readable").into_iter().flatten());
            }
        }
    });
}

/// A child of `parent` whose comm is `comm`, from /proc.
fn child_named(parent: u32, comm: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim);
        (field("PPid:") == Some(parent.to_string().as_str()) && field("Name:") == Some(comm)).then_some(pid)
    })
}
