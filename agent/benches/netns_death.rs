//! Time from `ip netns del` to the model marking that netns dead, over 200
//! namespaces with veths, beside the kernel's own teardown time in the
//! same run (`ip netns del` -> `RTM_DELNSID` on a plain listener).
//!
//! `cargo bench -p netreap --bench netns_death` (root). Not a test: it
//! prints a table and asserts nothing beyond every death being seen.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]

use std::{
    collections::HashMap,
    fmt::Write as _,
    process::Command,
    time::{Duration, SystemTime},
};

use netreap::model::{ModelStats, Watcher, WatcherConfig};

use netreap_testkit as support;

use support::net::{ip, ip_batch, plain_nsid_listener};

const NAMESPACES: usize = 200;

/// Deletes whatever namespaces are left, even after a panic.
struct Cleanup(Vec<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// Nearest-rank percentile, `per_mille` of 1000.
fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    let i = ((sorted.len() - 1) * per_mille).div_ceil(1000);
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn row(name: &str, mut v: Vec<Duration>) {
    v.sort_unstable();
    let mean = v.iter().sum::<Duration>() / v.len() as u32;
    println!(
        "{name:<44} {:>9} {:>9} {:>9} {:>9}",
        ms(percentile(&v, 500)),
        ms(percentile(&v, 990)),
        ms(mean),
        ms(*v.last().expect("samples"))
    );
}

fn report(kernel: Vec<Duration>, model: Vec<Duration>, overhead: Vec<Duration>, stats: &ModelStats) {
    println!();
    println!("netns death latency, {NAMESPACES} namespaces with a veth pair each (ms)");
    println!("{:<44} {:>9} {:>9} {:>9} {:>9}", "", "p50", "p99", "mean", "max");
    row("kernel: ip netns del -> RTM_DELNSID (plain)", kernel);
    row("model:  ip netns del -> marked dead", model);
    row("model after kernel (same death)", overhead);
    println!(
        "deaths={} dropped={} overruns={} corrections={}",
        stats.deaths,
        stats.deaths_dropped,
        stats.overruns,
        stats.corrections.total()
    );
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("netns_death: skipped, needs root to create network namespaces");
        return;
    }
    // `cargo bench` passes --bench; `cargo test --benches` runs us with no
    // such flag: stay quick there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("netns_death: run with `cargo bench` to measure");
        return;
    }
    let prefix = format!("nrb{}x", std::process::id() % 100_000);
    let names: Vec<String> = (0..NAMESPACES).map(|i| format!("{prefix}{i}")).collect();
    let _cleanup = Cleanup(names.clone());
    let kernel_deaths = plain_nsid_listener();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let config = WatcherConfig { resync_interval: Duration::from_hours(1), ..WatcherConfig::default() };
        let (watcher, mut deaths) = Watcher::start(config).await.expect("model starts");
        // Each netns with a veth pair to the host, as a pod has.
        let mut setup = String::new();
        for (i, n) in names.iter().enumerate() {
            let _ = writeln!(setup, "netns add {n}\nlink add {prefix}h{i} type veth peer name eth0 netns {n}");
        }
        ip_batch(&setup);
        for n in &names {
            ip(&["-n", n, "addr", "add", "10.100.0.2/24", "dev", "eth0"]);
        }
        let inodes: Vec<u32> = names
            .iter()
            .map(|n| {
                use std::os::unix::fs::MetadataExt as _;
                std::fs::metadata(format!("/run/netns/{n}")).expect("netns mount").ino() as u32
            })
            .collect();
        let nsids: HashMap<u32, i32> = loop {
            let s = watcher.snapshot().await.expect("snapshot");
            let found: HashMap<u32, i32> = inodes
                .iter()
                .filter_map(|&i| {
                    s.live_by_inode(i).filter(|v| !v.addresses.is_empty()).and_then(|v| Some((i, v.nsid?)))
                })
                .collect();
            if found.len() == inodes.len() {
                break found;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };

        let (mut kernel, mut model, mut overhead) = (Vec::new(), Vec::new(), Vec::new());
        for (name, inode) in names.iter().zip(&inodes) {
            let nsid = nsids[inode];
            let t0 = SystemTime::now();
            ip(&["netns", "del", name]);
            let death = loop {
                let d = tokio::time::timeout(Duration::from_secs(10), deaths.recv())
                    .await
                    .expect("death seen within 10 s")
                    .expect("model running");
                if d.inode == Some(*inode) {
                    break d;
                }
            };
            let kernel_at = loop {
                let (n, at) = kernel_deaths.recv_timeout(Duration::from_secs(10)).expect("RTM_DELNSID seen");
                if n == nsid {
                    break at;
                }
            };
            let since = |t: SystemTime| t.duration_since(t0).unwrap_or_default();
            kernel.push(since(kernel_at));
            model.push(since(death.at));
            overhead.push(death.at.duration_since(kernel_at).unwrap_or_default());
        }
        let stats = watcher.snapshot().await.expect("snapshot").stats;
        watcher.stop().await.expect("stop");
        report(kernel, model, overhead, &stats);
    });
}
