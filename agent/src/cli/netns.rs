//! `netreap netns`: every network namespace on the node, with its
//! interfaces, addresses, age and creator. One-shot: discovers, dumps,
//! prints; the running agent serves the same JSON on its state endpoint.

use std::{fmt::Write as _, time::Duration};

use anyhow::Context as _;
use netreap::model::{ModelSnapshot, NetnsView, Watcher, WatcherConfig};

#[derive(Debug, clap::Args)]
pub struct NetnsArgs {
    /// Print the model snapshot as JSON (the state endpoint's format).
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: &NetnsArgs) -> anyhow::Result<()> {
    let snapshot = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(async {
            let (watcher, _deaths) = Watcher::start(WatcherConfig::default()).await?;
            let snapshot = watcher.snapshot().await?;
            watcher.stop().await?;
            anyhow::Ok(snapshot)
        })
        .context("building the netns model")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!("{}", render(&snapshot));
    }
    Ok(())
}

fn age(secs: u64) -> String {
    humantime::format_duration(Duration::from_secs(secs)).to_string()
}

fn title(n: &NetnsView, taken_at: std::time::SystemTime) -> String {
    let inode = n.inode.map_or_else(|| "?".to_owned(), |i| i.to_string());
    let nsid = n.nsid.map_or_else(|| "-".to_owned(), |i| i.to_string());
    let state = match (n.host, n.alive) {
        (true, _) => "host".to_owned(),
        (false, true) => "alive".to_owned(),
        (false, false) => format!("dead ({:?})", n.death_source),
    };
    format!("netns {inode}  nsid {nsid}  {state}  age {}", age(n.age_secs(taken_at)))
}

fn render_one(out: &mut String, n: &NetnsView, taken_at: std::time::SystemTime) -> std::fmt::Result {
    writeln!(out, "{}", title(n, taken_at))?;
    if let Some(c) = &n.creator {
        writeln!(out, "  created by   {}[{}] via {:?}", c.comm, c.pid, c.via)?;
    }
    for m in &n.bind_mounts {
        writeln!(out, "  mounted at   {}", m.display())?;
    }
    if n.process_count > 0 {
        let sample: Vec<String> = n.processes.iter().map(|p| format!("{}[{}]", p.comm, p.pid)).collect();
        writeln!(out, "  processes    {} ({})", n.process_count, sample.join(", "))?;
    }
    for i in &n.interfaces {
        let name = i.name.as_deref().unwrap_or("?");
        let kind = i.kind.as_deref().unwrap_or("-");
        let state = if i.up { "up" } else { "down" };
        let peer = i.link.as_ref().map_or(String::new(), |l| {
            let place = match l.netns {
                Some(r) if r.host => "host".to_owned(),
                Some(r) => format!("netns {}", r.inode.map_or_else(|| "?".to_owned(), |x| x.to_string())),
                None => "unresolved netns".to_owned(),
            };
            format!("  -> {}#{} in {place}", l.ifname.as_deref().unwrap_or("?"), l.ifindex)
        });
        writeln!(out, "  if {:>4} {name:<16} {kind:<8} {state}{peer}", i.ifindex)?;
    }
    for a in &n.addresses {
        writeln!(
            out,
            "  addr         {}/{} on {} ({:?})",
            a.ip,
            a.prefix_len,
            a.ifname.as_deref().unwrap_or("?"),
            a.scope
        )?;
    }
    for r in &n.host_routes {
        writeln!(out, "  host route   {r}")?;
    }
    Ok(())
}

/// The human-readable table: one block per netns.
fn render(s: &ModelSnapshot) -> String {
    let mut out = String::new();
    for n in &s.netns {
        // Writing to a String cannot fail.
        let _ = render_one(&mut out, n, s.taken_at);
        out.push('\n');
    }
    let alive = s.alive().filter(|n| !n.host).count();
    let _ =
        writeln!(out, "{alive} live netns besides the host's; {} nsids assigned by this run", s.stats.nsids_assigned);
    out
}
