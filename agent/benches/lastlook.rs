//! The last look before an unlink, alone, at N netns: each netns has a
//! veth pair to the host (so an nsid, as a pod has) and an address, and the
//! model knows them all, as in the agent. Each look is timed as the
//! releaser times it (under a network's lock it asks every netns, the
//! mount table and /proc).
//!
//! `cargo bench -p netreap --bench lastlook [-- N...]` (root; default 200
//! and 1000). Not a test: it prints a table and asserts only that every
//! netns's address was seen.
#![expect(clippy::expect_used, reason = "bench set-up panics with context on a broken machine")]

use std::{
    collections::HashSet,
    fmt::Write as _,
    net::IpAddr,
    os::unix::fs::MetadataExt as _,
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use netreap::{
    discovery::{DiscoveryPaths, MountChanges, MountReader},
    release::lastlook::{DEFAULT_CNI_BIN_DIRS, KernelLook, LastLook},
};
use netreap_testkit::net::ip_batch;

const LOOKS: usize = 200;

/// Deletes the bench's namespaces and links, even after a panic.
struct Cleanup(Vec<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        use std::io::Write as _;
        let mut batch = String::new();
        for n in &self.0 {
            let _ = writeln!(batch, "netns del {n}");
        }
        let Ok(mut child) = Command::new("ip")
            .args(["-force", "-batch", "-"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
        else {
            return;
        };
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(batch.as_bytes());
        }
        let _ = child.wait();
    }
}

fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    let i = ((sorted.len() - 1) * per_mille).div_ceil(1000);
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// The address of bench netns `i`.
fn address(i: usize) -> IpAddr {
    IpAddr::from([10, 251, (i / 250) as u8, (i % 250 + 1) as u8])
}

fn nsids_of(names: &[String]) -> Vec<i32> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    let text = String::from_utf8_lossy(&out.stdout);
    let wanted: HashSet<&str> = names.iter().map(String::as_str).collect();
    text.lines()
        .filter(|l| l.split_whitespace().next().is_some_and(|n| wanted.contains(n)))
        .filter_map(|l| l.split("id: ").nth(1)?.trim_end_matches(')').trim().parse().ok())
        .collect()
}

fn bench(n: usize, size_index: usize) {
    // Named per run and size: a netns deleted by the previous run (or
    // size) takes its veth with it only when the kernel gets round to it.
    // (Link names: at most 15 bytes.)
    let run = std::process::id();
    let size_tag = char::from(b'a' + (size_index % 26) as u8);
    let names: Vec<String> = (0..n).map(|i| format!("nrblook{run}-{i}")).collect();
    let _cleanup = Cleanup(names.clone());
    let mut setup = String::new();
    for (i, name) in names.iter().enumerate() {
        let _ =
            writeln!(setup, "netns add {name}\nlink add nrk{run:x}{size_tag}{i} type veth peer name eth0 netns {name}");
    }
    ip_batch(&setup);
    for (i, name) in names.iter().enumerate() {
        let status = Command::new("ip")
            .args(["-n", name, "addr", "add", &format!("{}/32", address(i)), "dev", "eth0"])
            .status()
            .expect("ip addr add");
        assert!(status.success(), "ip -n {name} addr add");
    }
    let nsids = nsids_of(&names);
    assert_eq!(nsids.len(), n, "every bench netns has an nsid (its veth's link-netnsid)");
    let inodes: HashSet<u64> = names
        .iter()
        .map(|name| std::fs::metadata(format!("/run/netns/{name}")).expect("netns mount").ino())
        .chain(std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()))
        .collect();
    let bin_dirs = DEFAULT_CNI_BIN_DIRS.iter().map(Into::into).collect::<Vec<_>>();
    // As the daemon does: a new look per batch, the model's netns in it.
    let fresh = || {
        KernelLook::new(nsids.clone(), inodes.clone(), HashSet::new(), bin_dirs.clone())
            .with_mount_table(DiscoveryPaths::default())
    };
    let mut times = Vec::with_capacity(LOOKS);
    for round in 0..=LOOKS {
        let mut look = fresh();
        let t = Instant::now();
        let seen = look.look(&[address(n - 1)]).expect("the kernel answers");
        let took = t.elapsed();
        if round == 0 {
            // The first look opens what later ones keep: not counted.
            continue;
        }
        times.push(took);
        if round == 1 {
            assert!(!seen.where_configured(address(n - 1)).is_empty(), "the look saw the last bench netns's address");
        }
    }
    row(&format!("last look, {n} netns known"), times);

    // Each look after a change of the mount table (a tmpfs mounted or
    // unmounted, as each `ip netns del` changes it): the look reads it.
    let dir = tempfile::tempdir().expect("a temp dir");
    let mut toggle = MountToggle::new(dir.path());
    let mut times = Vec::with_capacity(LOOKS);
    for _ in 0..LOOKS {
        toggle.flip();
        let mut look = fresh();
        let t = Instant::now();
        look.look(&[address(n - 1)]).expect("the kernel answers");
        times.push(t.elapsed());
    }
    row(&format!("last look after a mount change, {n}"), times);

    // The table's read alone after a change: the text, and the kernel's
    // list (the text again where the kernel has no listmount).
    let paths = DiscoveryPaths::default();
    for (what, kernel) in [("text", false), ("listmount", true)] {
        let changes = Arc::new(MountChanges::default());
        changes.watching();
        let mut reader =
            if kernel { MountReader::new(Arc::clone(&changes)) } else { MountReader::text_only(Arc::clone(&changes)) };
        reader.mounts(&paths, false).expect("reads the mount table");
        let mut times = Vec::with_capacity(LOOKS);
        for _ in 0..LOOKS {
            toggle.flip();
            changes.changed();
            let t = Instant::now();
            let found = reader.mounts(&paths, false).expect("reads the mount table").len();
            times.push(t.elapsed());
            assert!(found >= n, "every bench netns is mounted");
        }
        let via = if reader.kernel_reads() > 0 { "listmount" } else { "text" };
        row(&format!("mount table read ({what}: {via}), {n}"), times);
    }
}

fn row(what: &str, mut times: Vec<Duration>) {
    times.sort_unstable();
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "{:<36} {:>9} {:>9} {:>9} {:>9}",
        what,
        ms(percentile(&times, 500)),
        ms(percentile(&times, 990)),
        ms(mean),
        ms(*times.last().expect("samples"))
    );
}

/// A tmpfs mounted and unmounted in turn on a directory: one change of
/// the mount table per flip. Unmounted on drop.
struct MountToggle {
    target: std::ffi::CString,
    mounted: bool,
}

impl MountToggle {
    fn new(dir: &std::path::Path) -> Self {
        use std::os::unix::ffi::OsStrExt as _;
        Self { target: std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("a path"), mounted: false }
    }

    fn flip(&mut self) {
        // SAFETY: NUL-terminated strings; a tmpfs on our own temp dir.
        let rc = unsafe {
            if self.mounted {
                libc::umount2(self.target.as_ptr(), libc::MNT_DETACH)
            } else {
                libc::mount(c"nrblook".as_ptr(), self.target.as_ptr(), c"tmpfs".as_ptr(), 0, std::ptr::null())
            }
        };
        assert!(rc == 0, "mount toggle: {}", std::io::Error::last_os_error());
        self.mounted = !self.mounted;
    }
}

impl Drop for MountToggle {
    fn drop(&mut self) {
        if self.mounted {
            // SAFETY: as in flip.
            unsafe { libc::umount2(self.target.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("lastlook: skipped, needs root (namespaces)");
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        println!("lastlook: run with `cargo bench` to measure");
        return;
    }
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![200, 1000] } else { sizes };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!();
    println!("last look before an unlink, {LOOKS} looks each (ms); loadavg before: {}", load.trim());
    println!("{:<36} {:>9} {:>9} {:>9} {:>9}", "", "p50", "p99", "mean", "max");
    for (size_index, n) in sizes.into_iter().enumerate() {
        bench(n, size_index);
    }
}
