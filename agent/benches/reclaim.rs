//! Issues 6 and 13: what reclaiming costs and how fast it is, against the
//! kernel's own limits. Real namespaces, Debian's bridge + host-local
//! plugins, the real agent binary (release build: cargo builds it for
//! `cargo bench`).
//!
//! `cargo bench -p netreap --bench reclaim [-- latency overhead scale burst
//! down rest]` (root; no item named means all). Prints one table with the
//! goals beside the figures and merges them into target/bench/reclaim.json.
//!
//! 1. latency: 200 leaked reservations (ADD, then `ip netns del`, no DEL):
//!    `ip netns del` -> file gone, beside `ip netns del` -> `RTM_DELNSID` on a
//!    plain listener for the same netns; the agent's share is the difference,
//!    and its parts (netlink receive, decide, journal fsync, lock, re-read,
//!    last look, unlink, directory fsync; from the events and the journal).
//! 2. overhead: 300 pod cycles (netns add, ADD, DEL, netns del) without the
//!    agent (half before, half after: drift cancels) and with it, on 1 and 4
//!    pod workers, with `probes.attribution` off (the default) and on.
//! 3. scale: 100,000 reservation files over 10 networks, 3 % orphaned:
//!    scan + classification in this process, time and peak RSS.
//! 4. burst: 1,000 namespaces with reservations deleted by one `ip -batch`:
//!    time until every file is gone; lost records and resyncs.
//! 5. down: 100 leaks made while the agent was down (it saw the pods, was
//!    stopped, their netns were deleted): agent start -> last release.
//! 6. rest: 5,000 live pods (netns, veth on one of 5 bridges, address,
//!    host-local file): agent CPU per minute at rest, RSS.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]
#![allow(clippy::cast_precision_loss, reason = "counts and KiB shown as f64 are far below 2^52")]

use netreap_testkit as support;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ffi::CStr,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::Command,
    sync::mpsc,
    time::{Duration, Instant, SystemTime},
};

use netreap::{
    engine::{
        Binding, BindingSource, CniOp, DeadNetns, LiveNetns, NetnsId, NetnsName, Observations, Policy, Status, decide,
    },
    ipam::{ReservationStore, hostlocal::HostLocalStore, scan_all},
};
use serde_json::{Value, json};
use support::{
    agent::{Agent, wait_until},
    lab::{Lab, Pod, cni_plugins_present},
    net::{ip_batch, plain_nsid_listener},
};

const LEAKS: usize = 200;
const CYCLES: usize = 300;
const SCALE_FILES: usize = 100_000;
const SCALE_NETWORKS: usize = 10;
const BURST: usize = 1_000;
const DOWN_LEAKS: usize = 100;
const REST_PODS: usize = 5_000;
const REST_SECONDS: u64 = 60;
/// Pods per bridge in the rest item (a bridge has at most 1,024 ports).
const PODS_PER_BRIDGE: usize = 1_000;
const ITEMS: [&str; 6] = ["latency", "overhead", "scale", "burst", "down", "rest"];

/// Info, not the tests' debug: logging is part of the cost being measured,
/// and a production agent runs at info.
const AGENT_ENV: &[(&str, &str)] = &[("NETREAP_LOG", "info")];

// ---------------------------------------------------------------- helpers

/// File deletions in `dir` (`IN_DELETE`), stamped when read: a thread
/// blocked on inotify sees an unlink within microseconds, where a stat loop
/// would add its own period to every sample.
fn deletions(dir: &Path) -> mpsc::Receiver<(String, SystemTime)> {
    use std::os::unix::ffi::OsStrExt as _;
    // SAFETY: plain syscalls on a descriptor this thread owns.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    assert!(fd >= 0, "inotify_init1: {}", std::io::Error::last_os_error());
    let mut cpath = dir.as_os_str().as_bytes().to_vec();
    cpath.push(0);
    // SAFETY: cpath is NUL-terminated.
    let wd = unsafe { libc::inotify_add_watch(fd, cpath.as_ptr().cast(), libc::IN_DELETE) };
    assert!(wd >= 0, "inotify_add_watch {}: {}", dir.display(), std::io::Error::last_os_error());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            // SAFETY: buf is writable for its length.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            let at = SystemTime::now();
            if n <= 0 {
                return;
            }
            let mut off = 0usize;
            while off + size_of::<libc::inotify_event>() <= n as usize {
                // SAFETY: the kernel wrote a whole event header here; read_unaligned copes with any alignment.
                let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name_at = off + size_of::<libc::inotify_event>();
                let name_bytes = &buf[name_at..name_at + ev.len as usize];
                let name = CStr::from_bytes_until_nul(name_bytes)
                    .map(|c| String::from_utf8_lossy(c.to_bytes()).into_owned())
                    .unwrap_or_default();
                if tx.send((name, at)).is_err() {
                    // SAFETY: our descriptor.
                    unsafe { libc::close(fd) };
                    return;
                }
                off = name_at + ev.len as usize;
            }
        }
    });
    rx
}

/// nsid of every named netns, as `ip netns list` shows it ("name (id: N)").
fn nsids() -> HashMap<String, i32> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(" (id: ")?;
            Some((name.to_owned(), rest.trim_end_matches(')').parse().ok()?))
        })
        .collect()
}

/// The agent child of this process (the support wrapper keeps its `Child`).
fn agent_pid() -> u32 {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((head, tail)) = stat.rsplit_once(") ") else {
                return false;
            };
            head.ends_with("(netreap") && tail.split_whitespace().nth(1).and_then(|p| p.parse().ok()) == Some(me)
        })
        .expect("the agent is a child of this process")
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("agent stat");
    let tail = stat.rsplit_once(") ").expect("stat format").1;
    let f: Vec<u64> = tail.split_whitespace().map(|s| s.parse().unwrap_or(0)).collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // Fields 14 and 15 of stat(5); the tail starts at field 3.
    (f[11] + f[12]) as f64 / hz
}

/// A `Vm*` line of /proc/PID/status, in KiB.
fn vm_kib(pid: &str, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim_start_matches(':').trim().trim_end_matches(" kB").parse().ok())
        .unwrap_or(0)
}

/// Nearest-rank percentile, `per_mille` of 1000.
fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    let i = ((sorted.len() - 1) * per_mille).div_ceil(1000);
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// p50, p99, max in ms.
fn dist(mut v: Vec<Duration>) -> Value {
    if v.is_empty() {
        return json!({ "n": 0 });
    }
    v.sort_unstable();
    json!({
        "n": v.len(),
        "p50_ms": ms(percentile(&v, 500)),
        "p99_ms": ms(percentile(&v, 990)),
        "max_ms": ms(*v.last().expect("samples")),
    })
}

fn since(t0: SystemTime, t: SystemTime) -> Duration {
    t.duration_since(t0).unwrap_or_default()
}

fn agent_counters(agent: &Agent) -> Value {
    let dropped: u64 = agent.events_named("records_dropped").iter().map(|e| e["dropped"].as_u64().unwrap_or(0)).sum();
    let stats = &agent.state()["model"]["stats"];
    json!({
        "records_dropped_events": agent.events_named("records_dropped").len(),
        "records_dropped": dropped,
        "model_overruns": stats["overruns"],
        "model_resyncs": stats["resyncs"],
        "model_deaths_dropped": stats["deaths_dropped"],
        "model_deaths": stats["deaths"],
    })
}

fn verdict_count(agent: &Agent, status: &str) -> usize {
    agent.state()["verdicts"].as_array().map_or(0, |v| v.iter().filter(|v| v["status"] == status).count())
}

fn release_latencies(agent: &Agent) -> Vec<Duration> {
    agent
        .events_named("release")
        .iter()
        .filter(|e| e["outcome"] == "released")
        .filter_map(|e| e["death_to_release_seconds"].as_f64())
        .map(Duration::from_secs_f64)
        .collect()
}

fn ip_files(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().parse::<IpAddr>().is_ok()).count()
    })
}

/// ADD `pods` on two threads (this machine has two cores).
fn add_all(lab: &Lab, net: &netreap::cnirt::Network, pods: &[Pod]) -> Vec<String> {
    let half = pods.len().div_ceil(2);
    std::thread::scope(|s| {
        let jobs: Vec<_> = pods
            .chunks(half)
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|p| {
                            let r = lab.add(net, p).expect("CNI ADD");
                            let cidr = r["ips"][0]["address"].as_str().expect("an address");
                            cidr.split('/').next().expect("ip").to_owned()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        jobs.into_iter().flat_map(|j| j.join().expect("ADD thread")).collect()
    })
}

// ---------------------------------------------------------------- 1 latency

fn latency() -> Value {
    let lab = Lab::new("10.249.0.0/24");
    let net = lab.network("nrblat", "host-local", &[]);
    let agent = Agent::start(&lab, &[], AGENT_ENV);
    let mut pods: Vec<Pod> = (0..LEAKS).map(|_| lab.pod()).collect();
    let ips = add_all(&lab, &net, &pods);
    // The agent has seen every ADD finish: what a node looks like when a
    // sandbox dies long after its ADD.
    let caught_up = wait_until(Duration::from_mins(1), || verdict_count(&agent, "in_use") == LEAKS);
    assert!(caught_up.is_some(), "agent never saw all {LEAKS} pods in use");
    let ids = nsids();
    let gone = deletions(&lab.data_dir.join("nrblat"));
    let kernel = plain_nsid_listener();
    let (mut kernel_v, mut release_v, mut share_v) = (Vec::new(), Vec::new(), Vec::new());
    // IP -> when the plain listener heard the kernel's RTM_DELNSID.
    let mut kernel_at: HashMap<String, SystemTime> = HashMap::new();
    // IP -> when the bench saw its file go.
    let mut removed_at: HashMap<String, SystemTime> = HashMap::new();
    let mut missing_nsid = 0;
    for (pod, ip) in pods.iter_mut().zip(&ips) {
        let nsid = ids.get(&pod.name).copied();
        let t0 = SystemTime::now();
        pod.delete_netns();
        let released = loop {
            let (name, at) = gone.recv_timeout(Duration::from_secs(10)).expect("reservation released within 10 s");
            if name == *ip {
                break at;
            }
        };
        release_v.push(since(t0, released));
        removed_at.insert(ip.clone(), released);
        let Some(nsid) = nsid else {
            missing_nsid += 1;
            continue;
        };
        let died = loop {
            match kernel.recv_timeout(Duration::from_secs(5)) {
                Ok((n, at)) if n == nsid => break Some(at),
                Ok(_) => {}
                Err(_) => break None,
            }
        };
        if let Some(died) = died {
            kernel_at.insert(ip.clone(), died);
            kernel_v.push(since(t0, died));
            share_v.push(since(died, released));
        } else {
            missing_nsid += 1;
        }
    }
    // The last release event is written just after its unlink.
    wait_until(Duration::from_secs(2), || release_latencies(&agent).len() >= LEAKS);
    let parts = release_parts(&agent, &lab.state_dir, &kernel_at, &removed_at);
    json!({
        "leaks": LEAKS,
        "parts": parts,
        "kernel_netns_del_to_delnsid": dist(kernel_v),
        "netns_del_to_file_removed": dist(release_v),
        "agent_share_after_delnsid": dist(share_v),
        "agent_reported_death_to_release": dist(release_latencies(&agent)),
        "samples_without_kernel_time": missing_nsid,
        "counters": agent_counters(&agent),
    })
}

/// The parts of the release path after the kernel's RTM_DELNSID, per
/// release: netlink receive (the plain listener's time to the agent's own
/// time of death), decide (death to the batch's intent), then what the
/// journal's outcome records (intent fsync, lock, re-read, last look,
/// unlink, directory fsync). Distributions over the released leaks.
fn release_parts(
    agent: &Agent,
    state_dir: &Path,
    kernel_at: &HashMap<String, SystemTime>,
    removed_at: &HashMap<String, SystemTime>,
) -> Value {
    let parse_time = |v: &Value| v.as_str().and_then(|t| humantime::parse_rfc3339(t).ok());
    let journal = std::fs::read_to_string(state_dir.join("journal.jsonl")).unwrap_or_default();
    let lines: Vec<Value> = journal.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    // Intent id -> (IP, when the intent was made, the agent's time of
    // death). The death's time is the verdict's own evidence, in
    // nanoseconds: an event's `time` is printed to the millisecond, and
    // taking it less `death_to_release_seconds` put the death up to 1 ms
    // early (0.5 ms on average: decide read that much too long, and the
    // netlink receive too short, cut at zero).
    let intents: HashMap<&str, (String, SystemTime, Option<SystemTime>)> = lines
        .iter()
        .filter(|l| l["record"] == "intent")
        .filter_map(|l| {
            let ip = l["verdict"]["reservation"]["ip"].as_str()?.to_owned();
            let died = l["verdict"]["evidence"].as_array().and_then(|facts| {
                facts.iter().find(|f| f["fact"] == "bound_netns_died").and_then(|f| parse_time(&f["died_at"]))
            });
            Some((l["id"].as_str()?, (ip, parse_time(&l["at"])?, died)))
        })
        .collect();
    // Without that evidence (not expected here): the event's time less
    // `death_to_release_seconds`, to the millisecond.
    let mut event_died: HashMap<String, SystemTime> = HashMap::new();
    for e in agent.events_named("release").iter().filter(|e| e["outcome"] == "released") {
        if let (Some(ip), Some(at), Some(lat)) =
            (e["ip"].as_str(), parse_time(&e["time"]), e["death_to_release_seconds"].as_f64())
        {
            event_died.insert(ip.to_owned(), at - Duration::from_secs_f64(lat));
        }
    }
    let names = [
        "intent_fsync_us",
        "intent_wait_us",
        "handoff_us",
        "lock_us",
        "reread_us",
        "look_us",
        "unlink_us",
        "unlinked_us",
        "dir_fsync_us",
    ];
    let mut timed: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    let (mut receive, mut decide_v, mut seen_v, mut untimed_v) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for l in lines.iter().filter(|l| l["record"] == "outcome" && l["outcome"]["result"] == "released") {
        let Some((ip, intent_at, died)) = l["id"].as_str().and_then(|id| intents.get(id)) else { continue };
        if let (Some(kernel), Some(died)) = (kernel_at.get(ip), died.as_ref().or_else(|| event_died.get(ip))) {
            receive.push(died.duration_since(*kernel).unwrap_or_default());
            decide_v.push(intent_at.duration_since(*died).unwrap_or_default());
        }
        // The intent's time plus the path to its unlink, against the
        // bench's inotify: what the share holds after the unlink.
        if let (Some(us), Some(removed)) = (l["timings"]["unlinked_us"].as_u64(), removed_at.get(ip))
            && us > 0
        {
            seen_v.push(removed.duration_since(*intent_at + Duration::from_micros(us)).unwrap_or_default());
        }
        // Per release, what the timed parts leave of intent -> unlink (a
        // sum of medians is not the median of the sums).
        let part = |name: &str| l["timings"][name].as_u64().unwrap_or(0);
        if part("unlinked_us") > 0 {
            let timed: u64 =
                ["handoff_us", "lock_us", "reread_us", "look_us", "intent_wait_us", "unlink_us"].map(part).iter().sum();
            untimed_v.push(Duration::from_micros(part("unlinked_us").saturating_sub(timed)));
        }
        for name in names {
            if let Some(us) = l["timings"][name].as_u64() {
                timed.entry(name).or_default().push(Duration::from_micros(us));
            }
        }
    }
    let mut out = serde_json::Map::new();
    out.insert("netlink_receive".into(), dist(receive));
    out.insert("decide_to_intent".into(), dist(decide_v));
    out.insert("seen_after_unlink".into(), dist(seen_v));
    out.insert("untimed".into(), dist(untimed_v));
    for (name, v) in timed {
        out.insert(name.trim_end_matches("_us").to_owned(), dist(v));
    }
    Value::Object(out)
}

// ---------------------------------------------------------------- 2 overhead

fn cycles(lab: &Lab, net: &netreap::cnirt::Network, n: usize, workers: usize) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for w in 0..workers {
            let share = n / workers + usize::from(w < n % workers);
            s.spawn(move || {
                for _ in 0..share {
                    let mut pod = lab.pod();
                    lab.add(net, &pod).expect("CNI ADD");
                    lab.del(net, &pod).expect("CNI DEL");
                    pod.delete_netns();
                }
            });
        }
    });
    start.elapsed()
}

/// The agent's flags for a probe set: a config file naming
/// `probes.attribution` (the file is the only place to set it).
fn attribution_flags(lab: &Lab, attribution: bool) -> Vec<String> {
    let path = lab.dir.path().join(format!("netreap-attribution-{attribution}.toml"));
    std::fs::write(&path, format!("[probes]\nattribution = {attribution}\n")).expect("config file");
    vec!["--config".to_owned(), path.to_string_lossy().into_owned()]
}

/// `CYCLES` pod cycles on `workers` threads without the agent (half before,
/// half after: drift cancels) and with it, with or without the syscall
/// tracepoints (`probes.attribution`).
fn overhead_run(workers: usize, attribution: bool) -> Value {
    // A longer churn for a look at how the cost grows with the agent's
    // history (profiling): NETREAP_BENCH_CYCLES.
    let cycles_with: usize = std::env::var("NETREAP_BENCH_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(CYCLES);
    let lab = Lab::new("10.249.4.0/24");
    let net = lab.network("nrbcyc", "host-local", &[]);
    // Page cache and the plugins' first runs out of the way.
    cycles(&lab, &net, 10, workers);
    let before = cycles(&lab, &net, CYCLES / 2, workers);
    let flags = attribution_flags(&lab, attribution);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = Agent::start(&lab, &flags, AGENT_ENV);
    let pid = agent_pid();
    std::thread::sleep(Duration::from_millis(500));
    // Startup (probe load, BTF parsing) apart from steady state.
    let hwm_ready_kib = vm_kib(&pid.to_string(), "VmHWM");
    let cpu0 = cpu_seconds(pid);
    let with = cycles(&lab, &net, cycles_with, workers);
    // Let it finish what the last cycles gave it before reading its clock.
    let mut last = cpu_seconds(pid);
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(250));
        let now = cpu_seconds(pid);
        if (now - last).abs() < f64::EPSILON {
            break;
        }
        last = now;
    }
    let cpu = cpu_seconds(pid) - cpu0;
    let hwm_kib = vm_kib(&pid.to_string(), "VmHWM");
    let rss_kib = vm_kib(&pid.to_string(), "VmRSS");
    let counters = agent_counters(&agent);
    drop(agent);
    let after = cycles(&lab, &net, CYCLES / 2, workers);
    let without = before + after;
    let rate_without = CYCLES as f64 / without.as_secs_f64();
    let rate_with = cycles_with as f64 / with.as_secs_f64();
    json!({
        "workers": workers,
        "attribution": attribution,
        "cycles": cycles_with,
        "without_agent_s": without.as_secs_f64(),
        "with_agent_s": with.as_secs_f64(),
        "cycles_per_s_without": rate_without,
        "cycles_per_s_with": rate_with,
        "throughput_ratio": rate_with / rate_without,
        "agent_cpu_s_per_1000_cycles": cpu / cycles_with as f64 * 1000.0,
        "agent_peak_rss_mib": hwm_kib as f64 / 1024.0,
        "agent_rss_end_mib": rss_kib as f64 / 1024.0,
        "agent_peak_rss_at_ready_mib": hwm_ready_kib as f64 / 1024.0,
        "counters": counters,
    })
}

/// 1 and 4 pod workers, each without and with the syscall tracepoints.
fn overhead() -> Value {
    let runs: Vec<Value> = [(1, false), (1, true), (4, false), (4, true)]
        .into_iter()
        .map(|(workers, attribution)| {
            eprintln!("reclaim: overhead, {workers} worker(s), attribution {attribution}...");
            overhead_run(workers, attribution)
        })
        .collect();
    json!({ "runs": runs })
}

// ---------------------------------------------------------------- 3 scale

/// 100,000 files: `SCALE_NETWORKS` networks, each pod attached to all of
/// them (ifname netN), so 10,000 pods; 3 % of pods dead (their netns seen to
/// die), the rest live with their addresses and cache bindings, every ADD
/// seen by the probes. The observations the agent would hand the engine.
/// Writes every dirty page back (sync), in seconds. On a node the files
/// were written by ADDs over hours; the bench's are seconds old, so the
/// scan is not measured while the kernel writes back 100k new inodes.
fn write_back() -> f64 {
    let t = Instant::now();
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    t.elapsed().as_secs_f64()
}

fn scale(scratch: &Path) -> Value {
    let pods = SCALE_FILES / SCALE_NETWORKS;
    let dead_every = 33; // ~3 %
    let data = scratch.join("networks");
    let _ = std::fs::remove_dir_all(&data);
    // Files get their mtime now: the ADDs "ran" just before, the deaths
    // come after the files (a netns that died before its reservation was
    // made is no evidence against it).
    let t_file = SystemTime::now();
    let created = Instant::now();
    let ip_of =
        |net: usize, pod: usize| IpAddr::V4(Ipv4Addr::new(10, 200 + net as u8, (pod >> 8) as u8, (pod & 0xff) as u8));
    let cid = |pod: usize| format!("{pod:08x}{}", "c".repeat(56));
    for net in 0..SCALE_NETWORKS {
        let dir = data.join(format!("net{net}"));
        std::fs::create_dir_all(&dir).expect("network dir");
        for pod in 0..pods {
            std::fs::write(dir.join(ip_of(net, pod).to_string()), format!("{}\r\nnet{net}", cid(pod)))
                .expect("reservation");
        }
        std::fs::write(dir.join("last_reserved_ip.0"), ip_of(net, pods - 1).to_string()).expect("last");
        std::fs::write(dir.join("lock"), "").expect("lock");
    }
    let create_s = created.elapsed().as_secs_f64();
    let writeback_s = write_back();

    let mut obs = Observations { watching_since: Some(t_file - Duration::from_mins(1)), ..Observations::default() };
    for pod in 0..pods {
        let id = NetnsId::new(Some(4_026_600_000 + pod as u64), Some(pod as i32), None);
        let path = PathBuf::from(format!("/run/netns/cni-{pod:08x}"));
        let addresses: Vec<IpAddr> = (0..SCALE_NETWORKS).map(|n| ip_of(n, pod)).collect();
        if pod % dead_every == 0 {
            obs.dead.push(DeadNetns {
                id,
                died_at: SystemTime::now(),
                container_ids: vec![cid(pod)],
                addresses,
                paths: vec![path.clone()],
            });
        } else {
            obs.live.push(LiveNetns { id, container_ids: vec![cid(pod)], addresses, paths: vec![path.clone()] });
        }
        obs.bindings.push(Binding {
            container_id: cid(pod),
            netns: NetnsName::Path(path),
            source: BindingSource::CniCache,
            seen_at: t_file,
        });
        obs.cni_ops.push(CniOp {
            container_id: Some(cid(pod).into()),
            container_id_truncated: false,
            command: "ADD".into(),
            plugin: "bridge".into(),
            started_at: t_file - Duration::from_secs(1),
            finished_at: Some(t_file),
            exit_code: Some(0),
        });
    }

    // Peak RSS from here on: reset the high-water mark (clear_refs 5).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let base_kib = vm_kib("self", "VmRSS");
    let store = HostLocalStore::new(&data);
    let t = Instant::now();
    let scan = scan_all(&[&store as &dyn ReservationStore]);
    let scan_t = t.elapsed();
    assert_eq!(scan.reservations.len(), SCALE_FILES, "every file scanned: {:?}", scan.anomalies.first());
    let scan_hwm_kib = vm_kib("self", "VmHWM").saturating_sub(base_kib);

    // A guard from when the engine searched linearly (quadratic; it uses an
    // index now): time a sample first and run the whole set only when it
    // stays within ~20 s, else project from a 10 % sample (the
    // per-reservation cost is flat).
    let policy = Policy::default();
    let now = SystemTime::now();
    let sample = SCALE_FILES / 10;
    let t = Instant::now();
    let sampled = decide(&obs, &scan.reservations[..sample], now, &policy);
    let orphaned_in_sample = sampled.iter().filter(|v| v.status == Status::Orphaned).count();
    drop(sampled);
    let per = t.elapsed() / sample as u32;
    let projected = per * SCALE_FILES as u32;
    let (decide_t, measured, orphaned) = if projected < Duration::from_secs(20) {
        let t = Instant::now();
        let verdicts = decide(&obs, &scan.reservations, now, &policy);
        let took = t.elapsed();
        let orphaned = verdicts.iter().filter(|v| v.status == Status::Orphaned).count();
        (took, true, Some(orphaned))
    } else {
        (projected, false, None)
    };
    let hwm_kib = vm_kib("self", "VmHWM").saturating_sub(base_kib);
    let _ = std::fs::remove_dir_all(&data);
    json!({
        "files": SCALE_FILES,
        "networks": SCALE_NETWORKS,
        "pods": pods,
        "dead_pods": pods.div_ceil(dead_every),
        "create_s": create_s,
        "writeback_before_scan_s": writeback_s,
        "scan_s": scan_t.as_secs_f64(),
        "classify_s": decide_t.as_secs_f64(),
        "classify_measured": measured,
        "classify_per_reservation_us": per.as_secs_f64() * 1e6,
        "orphaned": orphaned,
        "classify_sample": sample,
        "orphaned_in_sample": orphaned_in_sample,
        "orphaned_expected": pods.div_ceil(dead_every) * SCALE_NETWORKS,
        "scan_and_classify_s": (scan_t + decide_t).as_secs_f64(),
        "scan_peak_rss_delta_mib": scan_hwm_kib as f64 / 1024.0,
        "peak_rss_delta_mib": hwm_kib as f64 / 1024.0,
    })
}

// ---------------------------------------------------------------- 4 burst

fn burst() -> Value {
    let lab = Lab::new("10.249.8.0/22");
    let net = lab.network("nrbburst", "host-local", &[]);
    let agent = Agent::start(&lab, &[], AGENT_ENV);
    let pid = agent_pid();
    let setup = Instant::now();
    let mut pods: Vec<Pod> = (0..BURST).map(|_| lab.pod()).collect();
    let ips = add_all(&lab, &net, &pods);
    let caught_up = wait_until(Duration::from_mins(3), || verdict_count(&agent, "in_use") == BURST);
    assert!(caught_up.is_some(), "agent never saw all {BURST} pods in use");
    let setup_s = setup.elapsed().as_secs_f64();
    let ids = nsids();
    let ours: HashSet<i32> = pods.iter().filter_map(|p| ids.get(&p.name).copied()).collect();
    let dir = lab.data_dir.join("nrbburst");
    let gone = deletions(&dir);
    let kernel = plain_nsid_listener();
    let mut batch = String::new();
    for p in &pods {
        let _ = writeln!(batch, "netns del {}", p.name);
    }
    let t0 = SystemTime::now();
    ip_batch(&batch);
    let batch_done = since(t0, SystemTime::now());
    for p in &mut pods {
        p.mark_deleted();
    }
    let mut wanted: HashSet<String> = ips.into_iter().collect();
    let mut last_release = None;
    // When each release was seen, in order: the shape of the burst.
    let mut released_at: Vec<f64> = Vec::with_capacity(BURST);
    let deadline = Instant::now() + Duration::from_mins(1);
    while !wanted.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((name, at)) = gone.recv_timeout(left) else {
            break;
        };
        if wanted.remove(&name) {
            last_release = Some(since(t0, at));
            released_at.push(since(t0, at).as_secs_f64());
        }
    }
    let unreleased = wanted.len();
    let mut kernel_seen = 0;
    let mut last_kernel = None;
    while kernel_seen < ours.len() {
        let Ok((n, at)) = kernel.recv_timeout(Duration::from_secs(5)) else {
            break;
        };
        if ours.contains(&n) {
            kernel_seen += 1;
            last_kernel = Some(since(t0, at));
        }
    }
    // Counters after the agent has reconciled once more (resyncs included).
    std::thread::sleep(Duration::from_millis(500));
    json!({
        "namespaces": BURST,
        "setup_s": setup_s,
        "ip_batch_s": batch_done.as_secs_f64(),
        "all_released_s": last_release.map(|d| d.as_secs_f64()),
        "released_s_at_count": burst_shape(&released_at),
        "intent_batches": intent_batches(&lab.state_dir),
        "unreleased_after_60s": unreleased,
        "remaining_files": ip_files(&dir),
        "kernel_last_delnsid_s": last_kernel.map(|d| d.as_secs_f64()),
        "kernel_delnsid_seen": kernel_seen,
        "nsids_known": ours.len(),
        "agent_reported_death_to_release": dist(release_latencies(&agent)),
        "agent_peak_rss_mib": vm_kib(&pid.to_string(), "VmHWM") as f64 / 1024.0,
        "counters": agent_counters(&agent),
    })
}

/// When the 1st, 100th, 250th, 500th, 750th and last release were seen.
fn burst_shape(released_at: &[f64]) -> Value {
    let at = |n: usize| released_at.get(n.saturating_sub(1)).copied();
    json!({
        "1": at(1),
        "100": at(100),
        "250": at(250),
        "500": at(500),
        "750": at(750),
        "last": released_at.last().copied(),
    })
}

/// How many batches the journal's intents came in (one write each).
fn intent_batches(state_dir: &Path) -> usize {
    let journal = std::fs::read_to_string(state_dir.join("journal.jsonl")).unwrap_or_default();
    let batches: HashSet<String> = journal
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["record"] == "intent")
        .filter_map(|l| l["at"].as_str().map(str::to_owned))
        .collect();
    batches.len()
}

// ---------------------------------------------------------------- 5 down

/// `DOWN_LEAKS` pods the agent saw made; the agent stops (SIGTERM); their
/// netns are deleted with no DEL (the leaks); the agent starts again: time
/// from its start to the last release.
fn down() -> Value {
    let lab = Lab::new("10.249.12.0/24");
    let net = lab.network("nrbdown", "host-local", &[]);
    let agent = Agent::start(&lab, &[], AGENT_ENV);
    let mut pods: Vec<Pod> = (0..DOWN_LEAKS).map(|_| lab.pod()).collect();
    let ips = add_all(&lab, &net, &pods);
    let caught_up = wait_until(Duration::from_mins(1), || verdict_count(&agent, "in_use") == DOWN_LEAKS);
    assert!(caught_up.is_some(), "agent never saw all {DOWN_LEAKS} pods in use");
    // Its knowledge (bindings, nsids) is saved each second it changed.
    std::thread::sleep(Duration::from_secs(2));
    drop(agent);
    let mut batch = String::new();
    for p in &pods {
        let _ = writeln!(batch, "netns del {}", p.name);
    }
    ip_batch(&batch);
    for p in &mut pods {
        p.mark_deleted();
    }
    let dir = lab.data_dir.join("nrbdown");
    let gone = deletions(&dir);
    let t0 = SystemTime::now();
    let agent = Agent::start(&lab, &[], AGENT_ENV);
    let ready = since(t0, SystemTime::now());
    let mut wanted: HashSet<String> = ips.into_iter().collect();
    let mut last_release = None;
    let deadline = Instant::now() + Duration::from_mins(1);
    while !wanted.is_empty() {
        let Ok((name, at)) = gone.recv_timeout(deadline.saturating_duration_since(Instant::now())) else { break };
        if wanted.remove(&name) {
            last_release = Some(since(t0, at));
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for e in agent.events_named("release").iter().filter(|e| e["outcome"] == "released") {
        *reasons.entry(e["reason"].as_str().unwrap_or("?").to_owned()).or_default() += 1;
    }
    json!({
        "leaks": DOWN_LEAKS,
        "agent_ready_s": ready.as_secs_f64(),
        "last_release_s": last_release.map(|d| d.as_secs_f64()),
        "unreleased_after_60s": wanted.len(),
        "remaining_files": ip_files(&dir),
        "release_reasons": reasons,
        "counters": agent_counters(&agent),
    })
}

// ---------------------------------------------------------------- 6 rest

/// A host bridge, deleted on drop.
struct BridgeGuard(String);

impl Drop for BridgeGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

/// `REST_PODS` live pods (netns, veth on a bridge, address, host-local
/// file; `PODS_PER_BRIDGE` per bridge): once the agent has seen them all in
/// use, its CPU over `REST_SECONDS` with nothing happening, and its memory.
fn rest() -> Value {
    // A smaller node for a quick look (profiling): NETREAP_BENCH_REST_PODS.
    let rest_pods: usize =
        std::env::var("NETREAP_BENCH_REST_PODS").ok().and_then(|v| v.parse().ok()).unwrap_or(REST_PODS);
    let lab = Lab::new("10.249.16.0/24");
    let bridges = rest_pods.div_ceil(PODS_PER_BRIDGE);
    let mut guards = Vec::new();
    let mut nets = Vec::new();
    for b in 0..bridges {
        let name = format!("nrBrest{b}");
        let run =
            |args: &[&str]| assert!(Command::new("ip").args(args).status().is_ok_and(|s| s.success()), "ip {args:?}");
        run(&["link", "add", &name, "type", "bridge"]);
        guards.push(BridgeGuard(name.clone()));
        run(&["link", "set", &name, "up"]);
        let mut conf = lab.bridge_conf("host-local");
        conf["bridge"] = json!(name);
        conf["ipam"]["ranges"] = json!([[{ "subnet": format!("10.{}.0.0/21", 120 + b) }]]);
        nets.push(netreap::cnirt::Network { name: format!("nrbrest{b}"), plugins: vec![conf] });
    }
    let agent = Agent::start(&lab, &[], AGENT_ENV);
    let pid = agent_pid();
    let setup = Instant::now();
    let cpu_setup0 = cpu_seconds(pid);
    let mut pods: Vec<Pod> = (0..rest_pods).map(|_| lab.pod()).collect();
    std::thread::scope(|s| {
        let jobs: Vec<_> = pods
            .chunks(PODS_PER_BRIDGE)
            .zip(&nets)
            .collect::<Vec<_>>()
            .chunks(bridges.div_ceil(2))
            .map(|part| {
                let part = part.to_vec();
                let lab = &lab;
                s.spawn(move || {
                    for (chunk, net) in part {
                        for p in chunk {
                            lab.add(net, p).expect("CNI ADD");
                        }
                    }
                })
            })
            .collect();
        for j in jobs {
            j.join().expect("ADD thread");
        }
    });
    // Polled slowly: /state of 5,000 verdicts is work for the agent.
    let deadline = Instant::now() + Duration::from_mins(10);
    let mut in_use = 0;
    while Instant::now() < deadline {
        in_use = verdict_count(&agent, "in_use");
        if in_use == rest_pods {
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    let setup_s = setup.elapsed().as_secs_f64();
    let cpu_setup = cpu_seconds(pid) - cpu_setup0;
    // Settle, then a minute of nothing.
    std::thread::sleep(Duration::from_secs(5));
    let cpu0 = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(REST_SECONDS));
    let cpu_rest = cpu_seconds(pid) - cpu0;
    let rss_kib = vm_kib(&pid.to_string(), "VmRSS");
    let hwm_kib = vm_kib(&pid.to_string(), "VmHWM");
    let counters = agent_counters(&agent);
    drop(agent);
    let mut batch = String::new();
    for p in &pods {
        let _ = writeln!(batch, "netns del {}", p.name);
    }
    ip_batch(&batch);
    for p in &mut pods {
        p.mark_deleted();
    }
    drop(guards);
    json!({
        "pods": rest_pods,
        "bridges": bridges,
        "in_use_seen": in_use,
        "setup_s": setup_s,
        "agent_cpu_s_during_setup": cpu_setup,
        "agent_cpu_s_per_min_at_rest": cpu_rest * 60.0 / REST_SECONDS as f64,
        "agent_rss_mib": rss_kib as f64 / 1024.0,
        "agent_peak_rss_mib": hwm_kib as f64 / 1024.0,
        "counters": counters,
    })
}

// ---------------------------------------------------------------- report

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn line(out: &mut String, what: &str, goal: &str, measured: &str, ok: Option<bool>) {
    let verdict = match ok {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "-",
    };
    let _ = writeln!(out, "| {what} | {goal} | {measured} | {verdict} |");
}

fn dist_text(v: &Value) -> String {
    format!("p50 {:.2} / p99 {:.2} / max {:.2} ms", f(&v["p50_ms"]), f(&v["p99_ms"]), f(&v["max_ms"]))
}

/// The table, each goal (issue 13) beside its figure.
#[expect(clippy::too_many_lines, reason = "one row per measure, in the order printed")]
fn table(items: &BTreeMap<String, Value>) -> String {
    let mut out = String::from("| measure | goal | measured | |\n|---|---|---|---|\n");
    if let Some(l) = items.get("latency") {
        let share = &l["agent_share_after_delnsid"];
        line(
            &mut out,
            &format!("1. kernel: `ip netns del` -> RTM_DELNSID ({LEAKS} netns)"),
            "-",
            &dist_text(&l["kernel_netns_del_to_delnsid"]),
            None,
        );
        line(
            &mut out,
            "1. `ip netns del` -> reservation file removed",
            "-",
            &dist_text(&l["netns_del_to_file_removed"]),
            None,
        );
        line(
            &mut out,
            "1. agent's share (removed - RTM_DELNSID)",
            "p50 < 1 / p99 < 2 ms",
            &dist_text(share),
            Some(f(&share["p50_ms"]) < 1.0 && f(&share["p99_ms"]) < 2.0),
        );
        let parts = [
            ("netlink_receive", "netlink receive (plain listener -> agent's death time)"),
            ("decide_to_intent", "decide (death -> batch intent written)"),
            ("intent_fsync", "journal fsync (intents, beside lock + look; outcomes: same kind)"),
            ("intent_wait", "the unlink's wait for the intents' fsync"),
            ("handoff", "intents' write + hand-off to the store work"),
            ("lock", "lock (open + flock)"),
            ("reread", "re-read + compare"),
            ("look", "last look (under the lock)"),
            ("unlink", "unlink"),
            ("unlinked", "intents' write -> unlink done (all of the above)"),
            ("untimed", "intents' write -> unlink done less its timed parts, per release"),
            ("seen_after_unlink", "unlink done -> the bench sees it (inotify)"),
            ("dir_fsync", "directory fsync"),
        ];
        for (key, what) in parts {
            if l["parts"][key].is_object() {
                line(&mut out, &format!("1. part: {what}"), "-", &dist_text(&l["parts"][key]), None);
            }
        }
    }
    if let Some(runs) = items.get("overhead").and_then(|o| o["runs"].as_array()) {
        for o in runs {
            let setting = format!(
                "{} worker{}, attribution {}",
                o["workers"],
                if o["workers"] == 1 { "" } else { "s" },
                if o["attribution"] == true { "on" } else { "off" }
            );
            line(
                &mut out,
                &format!("2. throughput with/without agent ({} cycles, {setting})", o["cycles"]),
                ">= 0.99",
                &format!(
                    "{:.3} ({:.1} vs {:.1} cycles/s)",
                    f(&o["throughput_ratio"]),
                    f(&o["cycles_per_s_with"]),
                    f(&o["cycles_per_s_without"])
                ),
                Some(f(&o["throughput_ratio"]) >= 0.99),
            );
            line(
                &mut out,
                &format!("2. agent CPU per 1000 cycles ({setting})"),
                "< 0.5 s",
                &format!("{:.2} s", f(&o["agent_cpu_s_per_1000_cycles"])),
                Some(f(&o["agent_cpu_s_per_1000_cycles"]) < 0.5),
            );
            line(
                &mut out,
                &format!("2. agent peak RSS, VmHWM ({setting})"),
                "-",
                &format!("{:.1} MiB", f(&o["agent_peak_rss_mib"])),
                None,
            );
        }
    }
    if let Some(s) = items.get("scale") {
        let measured = s["classify_measured"].as_bool().unwrap_or(false);
        line(
            &mut out,
            "3. 100k files / 10 networks: scan + classify",
            "< 0.3 s",
            &format!(
                "{:.2} s (scan {:.2} s, classify {:.2} s{})",
                f(&s["scan_and_classify_s"]),
                f(&s["scan_s"]),
                f(&s["classify_s"]),
                if measured { "" } else { " projected from 10,000" }
            ),
            Some(f(&s["scan_and_classify_s"]) < 0.3),
        );
        line(
            &mut out,
            "3. 100k: scan + classify peak memory (VmHWM delta)",
            "< 64 MiB",
            &format!("{:.1} MiB", f(&s["peak_rss_delta_mib"])),
            Some(f(&s["peak_rss_delta_mib"]) < 64.0),
        );
    }
    if let Some(b) = items.get("burst") {
        let all = b["all_released_s"].as_f64().filter(|_| b["unreleased_after_60s"] == 0);
        line(
            &mut out,
            &format!("4. burst: {BURST} netns deleted at once -> all released"),
            "< 2 s",
            &all.map_or_else(|| format!("{} left after 60 s", b["unreleased_after_60s"]), |s| format!("{s:.2} s")),
            Some(all.is_some_and(|s| s < 2.0)),
        );
        line(
            &mut out,
            "4. kernel: last RTM_DELNSID of the burst",
            "-",
            &b["kernel_last_delnsid_s"]
                .as_f64()
                .map_or("-".into(), |s| format!("{s:.2} s ({} seen)", b["kernel_delnsid_seen"])),
            None,
        );
        let c = &b["counters"];
        line(
            &mut out,
            "4. records lost / overruns / resyncs",
            "0 or recovered",
            &format!("{} / {} / {}", c["records_dropped"], c["model_overruns"], c["model_resyncs"]),
            Some(c["records_dropped"] == 0 || b["unreleased_after_60s"] == 0),
        );
        line(
            &mut out,
            "4. burst: agent peak RSS (VmHWM)",
            "< 32 MiB",
            &format!("{:.1} MiB", f(&b["agent_peak_rss_mib"])),
            Some(f(&b["agent_peak_rss_mib"]) < 32.0),
        );
    }
    if let Some(d) = items.get("down") {
        let last = d["last_release_s"].as_f64().filter(|_| d["unreleased_after_60s"] == 0);
        line(
            &mut out,
            &format!("5. {DOWN_LEAKS} leaks made while the agent was down: agent start -> last release"),
            "-",
            &last.map_or_else(
                || format!("{} left after 60 s", d["unreleased_after_60s"]),
                |s| format!("{s:.2} s (ready after {:.2} s)", f(&d["agent_ready_s"])),
            ),
            Some(last.is_some()),
        );
    }
    if let Some(r) = items.get("rest") {
        line(
            &mut out,
            &format!("6. {} live pods: agent CPU per minute at rest", r["pods"]),
            "-",
            &format!("{:.2} s ({} of them seen in use)", f(&r["agent_cpu_s_per_min_at_rest"]), r["in_use_seen"]),
            None,
        );
        line(
            &mut out,
            &format!("6. {} live pods: agent RSS / peak (VmRSS / VmHWM)", r["pods"]),
            "-",
            &format!("{:.1} / {:.1} MiB", f(&r["agent_rss_mib"]), f(&r["agent_peak_rss_mib"])),
            None,
        );
    }
    out
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("reclaim: skipped, needs root (namespaces, eBPF probes)");
        return;
    }
    // `cargo test --benches` runs us without --bench: stay quick there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("reclaim: run with `cargo bench` to measure");
        return;
    }
    let asked: Vec<String> = std::env::args().skip(1).filter(|a| ITEMS.contains(&a.as_str())).collect();
    let run = |item: &str| asked.is_empty() || asked.iter().any(|a| a == item);
    if ["latency", "overhead", "burst", "down", "rest"].iter().any(|i| run(i))
        && !(support::kernel_tests_possible() && cni_plugins_present())
    {
        println!("reclaim: skipped, needs BTF and /usr/lib/cni/{{bridge,host-local}}");
        return;
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&target).expect("target/bench");
    let json_path = target.join("reclaim.json");
    // Items not run this time keep their last figures (each has its own stamp).
    let mut results: BTreeMap<String, Value> = std::fs::read_to_string(&json_path)
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .and_then(|v| serde_json::from_value(v["items"].clone()).ok())
        .unwrap_or_default();
    let uname = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let stamp = || SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut current = BTreeMap::new();
    for item in ITEMS.iter().filter(|i| run(i)) {
        eprintln!("reclaim: {item}...");
        let t = Instant::now();
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let mut v = match *item {
            "latency" => latency(),
            "overhead" => overhead(),
            "scale" => scale(&target),
            "burst" => burst(),
            "down" => down(),
            _ => rest(),
        };
        v["unix_time"] = json!(stamp());
        v["loadavg_before"] = json!(load.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
        v["took_s"] = json!(t.elapsed().as_secs_f64());
        eprintln!("reclaim: {item} took {:.1} s", t.elapsed().as_secs_f64());
        current.insert((*item).to_owned(), v.clone());
        results.insert((*item).to_owned(), v);
    }
    let doc = json!({
        "kernel": uname,
        "cpus": std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        "unix_time": stamp(),
        "items": results,
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc).expect("json")).expect("write reclaim.json");
    println!();
    println!("netreap reclaim benchmarks (issues 6, 13), Linux {uname}, {} CPUs", doc["cpus"]);
    print!("{}", table(&current));
    println!("figures: {}", json_path.display());
}
