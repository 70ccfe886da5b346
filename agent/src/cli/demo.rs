//! `netreap demo`: a self-contained demonstration on real namespaces and
//! Debian's real CNI plugins. It makes the leak of containerd #12130 (a
//! chained plugin fails ADD and DEL, the runtime removes the netns, host-local
//! keeps the IP), runs the real agent, and shows each leak released on the
//! kernel's evidence while a live pod's address is kept. Everything it makes
//! (a bridge, namespaces, a temp dir) is removed at the end.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use netreap::cnirt::{Attachment, Network, Runtime};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Leaked pods to make (each a failed ADD/DEL whose netns is removed).
    #[arg(long, default_value_t = 3)]
    pub leaks: u32,
    /// Where Debian's CNI plugins are (containernetworking-plugins).
    #[arg(long, default_value = "/usr/lib/cni")]
    pub cni_bin_dir: PathBuf,
}

const FAILING_PLUGIN: &str = "#!/bin/sh\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"code\":999,\"msg\":\"demo: injected failure\"}'\nexit 1\n";

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("ip").args(args).status().context("running ip (iproute2)")?;
    if !status.success() {
        bail!("ip {} failed", args.join(" "));
    }
    Ok(())
}

/// Removes what the demo made, whatever happens.
struct Cleanup {
    bridge: String,
    netns: Vec<String>,
    agent: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
            let _ = agent.wait();
        }
        for ns in &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).stderr(Stdio::null()).status();
    }
}

fn reservations(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.parse::<std::net::IpAddr>().ok()?;
            let owner = std::fs::read_to_string(e.path()).ok()?;
            Some((name, owner.lines().next().unwrap_or_default().to_owned()))
        })
        .collect();
    out.sort();
    out
}

pub fn main(args: &DemoArgs) -> anyhow::Result<()> {
    for plugin in ["bridge", "host-local"] {
        if !args.cni_bin_dir.join(plugin).is_file() {
            bail!(
                "{} not found: install Debian's containernetworking-plugins",
                args.cni_bin_dir.join(plugin).display()
            );
        }
    }
    let tmp = tempdir()?;
    let tag = std::process::id() % 100_000;
    let mut cleanup = Cleanup { bridge: format!("nrdemo{tag}"), netns: Vec::new(), agent: None };
    ip(&["link", "add", &cleanup.bridge, "type", "bridge"])?;
    ip(&["link", "set", &cleanup.bridge, "up"])?;
    let plugins = tmp.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    std::fs::write(plugins.join("failing"), FAILING_PLUGIN)?;
    std::fs::set_permissions(plugins.join("failing"), std::fs::Permissions::from_mode(0o755))?;
    let data = tmp.join("networks");
    let cache = tmp.join("cache");
    let runtime = Runtime { plugin_dirs: vec![plugins, args.cni_bin_dir.clone()], cache_dir: Some(cache.clone()) };
    let bridge = json!({
        "type": "bridge", "bridge": cleanup.bridge, "isGateway": false, "ipMasq": false,
        "ipam": { "type": "host-local", "dataDir": data, "ranges": [[{ "subnet": "10.246.0.0/28" }]] }
    });
    let good = Network { name: "demo".into(), plugins: vec![bridge.clone()] };
    let failing = Network { name: "demo".into(), plugins: vec![bridge, json!({ "type": "failing" })] };

    println!("== starting the agent (events below are its JSON stream, filtered)");
    let exe = std::env::current_exe().context("locating the netreap binary")?;
    let events = tmp.join("events.jsonl");
    std::fs::create_dir_all(&data)?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let agent = Command::new(exe)
        .args(["run", "--metrics-addr", &addr.to_string()])
        .arg("--host-local-dir")
        .arg(&data)
        .arg("--cni-cache-dir")
        .arg(cache.join("results"))
        .arg("--state-dir")
        .arg(tmp.join("state"))
        .arg("--events")
        .arg(&events)
        .env("NETREAP_LOG", "error")
        .spawn()
        .context("starting netreap run")?;
    cleanup.agent = Some(agent);
    if !wait(Duration::from_secs(30), || ready(addr)) {
        bail!("the agent did not become ready on {addr}");
    }

    let live = format!("nrdemo{tag}live");
    ip(&["netns", "add", &live])?;
    cleanup.netns.push(live.clone());
    let live_path = PathBuf::from(format!("/var/run/netns/{live}"));
    let live_id = format!("demo-live-{tag}");
    runtime.add(&good, &Attachment { container_id: &live_id, netns: &live_path, ifname: "eth0" })?;
    println!("== a live pod {live_id} in netns {live}: {:?}", reservations(&data.join("demo")));

    let mut not_released = 0;
    for i in 0..args.leaks {
        let ns = format!("nrdemo{tag}p{i}");
        ip(&["netns", "add", &ns])?;
        cleanup.netns.push(ns.clone());
        let path = PathBuf::from(format!("/var/run/netns/{ns}"));
        let id = format!("demo-leak-{tag}-{i}");
        let at = Attachment { container_id: &id, netns: &path, ifname: "eth0" };
        let add = runtime.add(&failing, &at).err().map(|e| e.to_string()).unwrap_or_default();
        let del = runtime.del(&failing, &at).err().map(|e| e.to_string()).unwrap_or_default();
        println!("== pod {id}: ADD failed ({add}); DEL failed ({del})");
        println!("   host-local still holds: {:?}", reservations(&data.join("demo")));
        let started = Instant::now();
        ip(&["netns", "del", &ns])?;
        cleanup.netns.retain(|n| n != &ns);
        let released = wait(Duration::from_secs(5), || reservations(&data.join("demo")).iter().all(|(_, c)| *c != id));
        if released {
            println!("   netns removed -> reservation released by netreap in {:?}", started.elapsed());
        } else {
            println!("   netns removed -> NOT released within 5 s (see the events below)");
            not_released += 1;
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    println!("== left in host-local: {:?} (the live pod's)", reservations(&data.join("demo")));
    println!("== the agent's events about reservations:");
    for line in std::fs::read_to_string(&events).unwrap_or_default().lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        match v["event"].as_str() {
            Some("netns_died") => println!("  netns_died  inode {} held {}", v["netns_inode"], v["addresses"]),
            Some("verdict_changed") => println!("  verdict     {} {} -> {}", v["ip"], v["from"], v["to"]),
            Some("release") => println!(
                "  release     {} of {}: {} ({}s after the death)\n              evidence: {}",
                v["ip"], v["container_id"], v["outcome"], v["death_to_release_seconds"], v["evidence"][0]
            ),
            _ => {}
        }
    }
    runtime.del(&good, &Attachment { container_id: &live_id, netns: &live_path, ifname: "eth0" })?;
    drop(cleanup);
    std::fs::remove_dir_all(&tmp).ok();
    if not_released > 0 {
        bail!("{not_released} leak(s) not released");
    }
    Ok(())
}

/// GET /readyz answers 200.
fn ready(addr: std::net::SocketAddr) -> bool {
    use std::io::{Read as _, Write as _};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.starts_with("HTTP/1.1 200")
}

fn wait(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

fn tempdir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("netreap-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
