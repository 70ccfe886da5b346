//! Real probes in this kernel: namespace creation and CNI plugin runs.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]
#![allow(clippy::unwrap_used, reason = "tests panic with context")]

use netreap_testkit as support;

use std::{
    os::unix::{fs::MetadataExt, fs::PermissionsExt, process::CommandExt as _},
    process::Command,
    time::Duration,
};

use netreap::kernel::events::{EnvScanVariant, KernelEvent, NetnsVia};
use support::{both_scans, kernel_tests_possible, runtime, unique, watch};

const WAIT: Duration = Duration::from_secs(10);

fn inode_of_pid(pid: i32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/net")).expect("process netns").ino()
}

/// A child made by a raw clone/clone3 with CLONE_NEWNET that waits to be killed.
struct Child(i32);

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: plain syscalls on our own child.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

fn park_child() -> ! {
    // Only async-signal-safe calls in the child of a multithreaded process.
    // Close every inherited fd first: a copy of another test thread's pipe
    // (a Command's exec-status pipe, a child's stdout) held by this paused
    // child would keep that thread's read from ever seeing EOF.
    // SAFETY: close_range on our own fd table; the child uses no fd.
    unsafe { libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) };
    loop {
        // SAFETY: pause has no preconditions.
        unsafe { libc::pause() };
    }
}

fn clone_newnet() -> Child {
    let flags = (libc::CLONE_NEWNET | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: fork-like clone (no new stack); the child only pauses.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    assert!(pid >= 0, "clone failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        park_child();
    }
    Child(pid as i32)
}

#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

fn clone3_newnet() -> Child {
    let args = CloneArgs { flags: libc::CLONE_NEWNET as u64, exit_signal: libc::SIGCHLD as u64, ..Default::default() };
    // SAFETY: fork-like clone3 (no new stack); the child only pauses.
    let pid = unsafe { libc::syscall(libc::SYS_clone3, &raw const args, std::mem::size_of::<CloneArgs>()) };
    assert!(pid >= 0, "clone3 failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        park_child();
    }
    Child(pid as i32)
}

#[test]
fn unshare_reports_the_new_netns_inode() {
    if !kernel_tests_possible() {
        return;
    }
    runtime().block_on(async {
        let mut w = watch();
        let mut child = Command::new("unshare").args(["-n", "sleep", "5"]).spawn().expect("unshare runs");
        let pid = child.id() as i32;
        let (event, _) = w.wait_for(WAIT, "unshare netns event", |e| {
            matches!(e, KernelEvent::NetnsEntered { task, via: NetnsVia::Unshare, .. } if task.tgid == pid as u32)
        })
        .await;
        let expected = inode_of_pid(pid);
        let _ = child.kill();
        let _ = child.wait();
        let KernelEvent::NetnsEntered { netns_inode, previous_netns_inode, task, .. } = event else { unreachable!() };
        assert_eq!(u64::from(netns_inode), expected, "event inode is /proc/PID/ns/net's inode");
        assert_eq!(u64::from(previous_netns_inode), netns_inode_of_self(), "came from the host netns");
        assert_eq!(task.comm, "unshare");
    });
}

fn netns_inode_of_self() -> u64 {
    std::fs::metadata("/proc/self/ns/net").expect("own netns").ino()
}

#[test]
fn clone_with_newnet_reports_the_childs_netns() {
    if !kernel_tests_possible() {
        return;
    }
    runtime().block_on(async {
        let mut w = watch();
        let child = clone_newnet();
        let (event, _) = w.wait_for(WAIT, "clone netns event", |e| {
            matches!(e, KernelEvent::NetnsEntered { task, via: NetnsVia::Clone, .. } if task.pid == child.0 as u32)
        })
        .await;
        let KernelEvent::NetnsEntered { netns_inode, .. } = event else { unreachable!() };
        assert_eq!(u64::from(netns_inode), inode_of_pid(child.0));
        assert_ne!(u64::from(netns_inode), netns_inode_of_self());
    });
}

#[test]
fn clone3_with_newnet_reports_the_childs_netns() {
    if !kernel_tests_possible() {
        return;
    }
    runtime().block_on(async {
        let mut w = watch();
        let child = clone3_newnet();
        let (event, _) = w.wait_for(WAIT, "clone3 netns event", |e| {
            matches!(e, KernelEvent::NetnsEntered { task, via: NetnsVia::Clone3, .. } if task.pid == child.0 as u32)
        })
        .await;
        let KernelEvent::NetnsEntered { netns_inode, .. } = event else { unreachable!() };
        assert_eq!(u64::from(netns_inode), inode_of_pid(child.0));
    });
}

#[test]
fn setns_reports_only_a_real_change() {
    if !kernel_tests_possible() {
        return;
    }
    let ns = unique("nrps");
    assert!(Command::new("ip").args(["netns", "add", &ns]).status().expect("ip runs").success());
    let cleanup = scopeguard(&ns);
    runtime().block_on(async {
        let mut w = watch();
        // nsenter into the host's own netns: setns succeeds but nothing changes.
        let mut same = Command::new("nsenter").args(["--net=/proc/1/ns/net", "true"]).spawn().expect("nsenter");
        let same_pid = same.id();
        let mut out = Command::new("ip").args(["netns", "exec", &ns, "sleep", "0.2"]).spawn().expect("ip netns exec");
        let pid = out.id();
        let (event, seen) = w
            .wait_for(
                WAIT,
                "setns event",
                |e| matches!(e, KernelEvent::NetnsEntered { task, via: NetnsVia::Setns, .. } if task.tgid == pid),
            )
            .await;
        let _ = out.wait();
        let _ = same.wait();
        let inode = std::fs::metadata(format!("/run/netns/{ns}")).expect("bind mount").ino();
        let KernelEvent::NetnsEntered { netns_inode, .. } = event else { unreachable!() };
        assert_eq!(u64::from(netns_inode), inode);
        assert!(
            !seen.iter().any(|e| matches!(e, KernelEvent::NetnsEntered { task, .. } if task.tgid == same_pid)),
            "setns into the same netns must not be reported"
        );
    });
    drop(cleanup);
}

/// Removes a named netns when dropped, even if the test failed.
struct NetnsGuard(String);
impl Drop for NetnsGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}
fn scopeguard(ns: &str) -> NetnsGuard {
    NetnsGuard(ns.to_owned())
}

/// A fake CNI plugin: a script that exits with $FAKE_EXIT.
fn fake_plugin(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("fake-cni");
    std::fs::write(&path, "#!/bin/sh\nexit ${FAKE_EXIT:-0}\n").expect("write plugin");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn run_plugin(plugin: &std::path::Path, command: &str, container: &str, netns: &str, exit: i32) -> u32 {
    let mut child = Command::new(plugin)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .env("FAKE_EXIT", exit.to_string())
        .spawn()
        .expect("plugin runs");
    let pid = child.id();
    let status = child.wait().expect("plugin exits");
    assert_eq!(status.code(), Some(exit));
    pid
}

#[test]
fn cni_plugin_runs_report_exec_and_exit() {
    if !kernel_tests_possible() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(dir.path());
    let container = unique("ctr");
    let netns = format!("/var/run/netns/{}", unique("nrcni"));
    runtime().block_on(async {
        for (scan, mut w) in both_scans() {
            for (command, exit) in [("ADD", 0), ("DEL", 7)] {
                let pid = run_plugin(&plugin, command, &container, &netns, exit);
                let (exec, _) = w
                    .wait_for(WAIT, "cni exec", |e| matches!(e, KernelEvent::CniExec { task, .. } if task.tgid == pid))
                    .await;
                let KernelEvent::CniExec { exec, .. } = exec else { unreachable!() };
                assert_eq!(exec.command.value, command, "{scan}");
                assert_eq!(exec.binary.value, plugin.to_string_lossy());
                assert_eq!(exec.container_id.expect("container id").value, container);
                assert_eq!(exec.netns.expect("netns").value, netns);
                assert_eq!(exec.ifname.expect("ifname").value, "eth0");
                let (exit_event, _) = w
                    .wait_for(WAIT, "cni exit", |e| matches!(e, KernelEvent::CniExit { task, .. } if task.tgid == pid))
                    .await;
                let KernelEvent::CniExit { exit: status, .. } = exit_event else { unreachable!() };
                assert_eq!(status.exit_code, Some(exit), "{scan}: {command} exit code");
            }
        }
    });
}

#[test]
fn non_cni_processes_are_filtered_in_the_kernel_and_long_values_are_flagged() {
    if !kernel_tests_possible() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(dir.path());
    runtime().block_on(async {
        let mut w = watch();
        // Same binary, no CNI_COMMAND: must produce nothing.
        let mut plain = Command::new(&plugin).env_clear().env("FAKE_EXIT", "0").spawn().expect("runs");
        let plain_pid = plain.id();
        plain.wait().expect("exits");
        // A long unrelated variable first (read in several chunks), then a
        // container id longer than the kernel's buffer.
        let long_id = "c".repeat(300);
        let mut cni = Command::new(&plugin)
            .env_clear()
            .env("AAA_FILLER", "x".repeat(1000))
            .env("CNI_COMMAND", "CHECK")
            .env("CNI_CONTAINERID", &long_id)
            .spawn()
            .expect("runs");
        let pid = cni.id();
        cni.wait().expect("exits");
        let (event, seen) =
            w.wait_for(WAIT, "cni exec", |e| matches!(e, KernelEvent::CniExec { task, .. } if task.tgid == pid)).await;
        assert!(
            !seen.iter().any(|e| e.task().tgid == plain_pid),
            "a process without CNI_COMMAND must produce no event"
        );
        let KernelEvent::CniExec { exec, .. } = event else { unreachable!() };
        assert_eq!(exec.command.value, "CHECK");
        let id = exec.container_id.expect("container id present");
        assert!(id.truncated, "a 300-byte id does not fit: flagged");
        assert!(long_id.starts_with(&id.value) && !id.value.is_empty(), "prefix kept");
        assert!(exec.netns.is_none(), "absent CNI_NETNS is None, not empty");
    });
}

/// Runs the fake plugin with CNI_ARGS set to `args` (raw bytes: they may be
/// hostile) and returns the pid.
fn run_with_cni_args(plugin: &std::path::Path, container: &str, args: &std::ffi::OsStr) -> u32 {
    let mut child = Command::new(plugin)
        .env_clear()
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", container)
        .env("CNI_ARGS", args)
        .env("FAKE_EXIT", "0")
        .spawn()
        .expect("plugin runs");
    let pid = child.id();
    child.wait().expect("plugin exits");
    pid
}

/// CNI_ARGS bytes, the pod they name, whether the kernel cuts them.
type CniArgsCase<'a> = (&'a [u8], Option<(&'a str, &'a str)>, bool);

#[test]
fn the_exec_record_carries_cni_args_which_name_the_pod() {
    use netreap::kube::agent::pod_of_cni_args_record;
    use std::os::unix::ffi::OsStrExt as _;
    if !kernel_tests_possible() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(dir.path());
    let container = unique("nrActr");
    let real = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=nra-ns;K8S_POD_NAME=nra-pod-0;K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
        "f".repeat(64),
        "0".repeat(36)
    );
    // Past the kernel's buffer, cut inside a long pod name.
    let long_name = format!("K8S_POD_NAMESPACE=nra-ns;K8S_POD_NAME={}", "p".repeat(500));
    let cut_after_name = format!("K8S_POD_NAMESPACE=nra-ns;K8S_POD_NAME=nra-pod-1;K8S_POD_UID={}", "u".repeat(500));
    runtime().block_on(async {
        for (scan, mut w) in both_scans() {
            let cases: [CniArgsCase; 6] = [
                (real.as_bytes(), Some(("nra-ns", "nra-pod-0")), false),
                (long_name.as_bytes(), None, true),
                (cut_after_name.as_bytes(), Some(("nra-ns", "nra-pod-1")), true),
                (b"no equals sign", None, false),
                (b"K8S_POD_NAMESPACE=nra-ns;K8S_POD_NAME=a;K8S_POD_NAME=b", None, false),
                (b"K8S_POD_NAMESPACE=nra-ns;K8S_POD_NAME=\xff\xfe", None, false),
            ];
            for (args, pod, truncated) in cases {
                let pid = run_with_cni_args(&plugin, &container, std::ffi::OsStr::from_bytes(args));
                let (exec, _) = w
                    .wait_for(WAIT, "cni exec", |e| matches!(e, KernelEvent::CniExec { task, .. } if task.tgid == pid))
                    .await;
                let KernelEvent::CniExec { exec, .. } = exec else { unreachable!() };
                let label = format!("{scan}: {}", String::from_utf8_lossy(args));
                let got = exec.cni_args.expect("CNI_ARGS is in the record");
                assert_eq!(got.truncated, truncated, "{label}");
                if !truncated {
                    assert_eq!(got.value.as_bytes(), String::from_utf8_lossy(args).as_bytes(), "{label}");
                }
                let expected = pod.map(|(ns, name)| (ns.to_owned(), name.to_owned()));
                assert_eq!(pod_of_cni_args_record(&got), expected, "{label}");
            }
        }
    });
}

/// Runs the fake plugin with `fillers` variables that sort before the CNI_
/// ones (Command orders the environment by name), so the CNI values come
/// after all of them. Returns the pid.
fn run_with_fillers(plugin: &std::path::Path, fillers: usize, container: &str) -> u32 {
    let mut cmd = Command::new(plugin);
    cmd.env_clear();
    for i in 0..fillers {
        cmd.env(format!("A{i:05}"), "filler");
    }
    cmd.env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", container)
        .env("CNI_NETNS", "/var/run/netns/nrEbig")
        .env("CNI_IFNAME", "eth0")
        .env("FAKE_EXIT", "0");
    let mut child = cmd.spawn().expect("plugin runs");
    let pid = child.id();
    assert!(child.wait().expect("plugin exits").success());
    pid
}

/// Variables the fake plugin gets besides the fillers.
const CNI_VARS: u32 = 5;

#[test]
fn a_300_string_environment_is_read_to_its_end() {
    if !kernel_tests_possible() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(dir.path());
    runtime().block_on(async {
        for (scan, mut w) in both_scans() {
            let container = unique("nrEctr");
            let pid = run_with_fillers(&plugin, 300, &container);
            let (event, _) = w
                .wait_for(WAIT, "cni exec", |e| matches!(e, KernelEvent::CniExec { task, .. } if task.tgid == pid))
                .await;
            let KernelEvent::CniExec { exec, .. } = event else { unreachable!() };
            assert!(!exec.env_scan_limited, "{scan}: 305 strings are within every scan's reach");
            assert_eq!(exec.env_scanned, 300 + CNI_VARS, "{scan}: every string was read");
            assert_eq!(exec.command.value, "ADD", "{scan}");
            assert_eq!(exec.container_id.expect("container id").value, container, "{scan}");
            assert_eq!(exec.netns.expect("netns").value, "/var/run/netns/nrEbig", "{scan}");
            assert_eq!(exec.ifname.expect("ifname").value, "eth0", "{scan}");
            assert_eq!(exec.uid, 0, "{scan}: run as root");
            let expected = if scan == "tail_calls" { EnvScanVariant::TailCalls } else { EnvScanVariant::BpfLoop };
            assert_eq!(exec.scan_variant, expected);
        }
    });
}

#[test]
fn an_environment_past_the_scan_limit_is_reported_as_limited_never_dropped() {
    if !kernel_tests_possible() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let plugin = fake_plugin(dir.path());
    // Past the tail-call chain (4,352 strings), and no more: each
    // string costs emulated time in the qemu guests.
    let fillers = 4500;
    runtime().block_on(async {
        for (scan, mut w) in both_scans() {
            let container = unique("nrEctr");
            let pid = run_with_fillers(&plugin, fillers, &container);
            let (event, _) = w
                .wait_for(WAIT, "cni exec", |e| matches!(e, KernelEvent::CniExec { task, .. } if task.tgid == pid))
                .await;
            let KernelEvent::CniExec { exec, .. } = event else { unreachable!() };
            if scan == "tail_calls" {
                // The chain ends before the CNI_ values: the run is still
                // reported, flagged, without the values it could not reach.
                assert!(exec.env_scan_limited, "tail_calls: the limit is said");
                assert!(exec.container_id.is_none() && exec.command.value.is_empty());
                assert_eq!(exec.env_scanned % 128, 0, "tail_calls: whole program runs of 128 steps");
                assert!(
                    (4000..4500).contains(&exec.env_scanned),
                    "tail_calls: read {} strings before the chain ended",
                    exec.env_scanned
                );
                eprintln!("tail_calls: the chain read {} strings", exec.env_scanned);
            } else {
                assert!(!exec.env_scan_limited, "{scan}: reads any environment to its end");
                assert_eq!(exec.env_scanned, fillers as u32 + CNI_VARS);
                assert_eq!(exec.container_id.expect("container id").value, container);
            }
        }
    });
}

#[test]
fn the_exec_record_carries_the_real_uid() {
    if !kernel_tests_possible() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let plugin = fake_plugin(dir.path());
    runtime().block_on(async {
        let mut w = watch();
        let mut child = Command::new(&plugin)
            .env_clear()
            .env("CNI_COMMAND", "DEL")
            .env("CNI_CONTAINERID", "nrEuid")
            .uid(65534)
            .gid(65534)
            .spawn()
            .expect("plugin runs as nobody");
        let pid = child.id();
        child.wait().expect("exits");
        let (event, _) =
            w.wait_for(WAIT, "cni exec", |e| matches!(e, KernelEvent::CniExec { task, .. } if task.tgid == pid)).await;
        let KernelEvent::CniExec { exec, .. } = event else { unreachable!() };
        assert_eq!(exec.uid, 65534);
    });
}

/// `probes.attribution = false`: no syscall tracepoint is attached, and a
/// clone(CLONE_NEWNET) is still reported, by task_newtask, naming the new
/// task and its netns.
#[test]
fn without_attribution_task_newtask_reports_the_childs_netns() {
    use netreap::kernel::probes::{ProbeOptions, ProbeSet, ProbeState, Probes};
    if !kernel_tests_possible() {
        return;
    }
    runtime().block_on(async {
        let probes = Probes::load_configured(ProbeOptions { attribution: false }).expect("probes load");
        for s in &probes.status {
            let active = matches!(s.state, ProbeState::Active);
            match s.spec.set {
                ProbeSet::Attribution => assert!(!active && !s.spec.required, "{} must be off", s.spec.program),
                ProbeSet::WithoutAttribution => assert!(active, "{} must load: {:?}", s.spec.program, s.state),
                ProbeSet::Always => {}
            }
        }
        let mut w = support::watch_with(probes);
        let child = clone_newnet();
        let (event, _) = w
            .wait_for(WAIT, "task_newtask netns event", |e| {
                matches!(e, KernelEvent::NetnsCreated { task, via: NetnsVia::TaskNewtask, .. } if task.pid == child.0 as u32)
            })
            .await;
        let KernelEvent::NetnsCreated { netns_inode, task, .. } = event else { unreachable!() };
        assert_eq!(u64::from(netns_inode), inode_of_pid(child.0), "the child's netns");
        assert_eq!(task.tgid, child.0 as u32, "the record names the new task");
        assert_ne!(u64::from(netns_inode), netns_inode_of_self());
    });
}
