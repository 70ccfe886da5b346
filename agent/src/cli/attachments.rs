//! `netreap attachments`: the attachment ledger of the running agent
//! (container <-> netns <-> CNI operations, failed ones included), read
//! from its state endpoint.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::Context as _;
use netreap::config::{Config, ConfigFlags};
use serde_json::Value;

#[derive(Debug, clap::Args)]
pub struct AttachmentsArgs {
    #[command(flatten)]
    pub config: ConfigFlags,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn fetch_state(addr: SocketAddr) -> anyhow::Result<Value> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET /state HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").context("malformed HTTP response")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "state endpoint answered: {}", head.lines().next().unwrap_or(""));
    Ok(serde_json::from_str(body)?)
}

pub fn main(args: &AttachmentsArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config).context("configuration")?;
    let state = fetch_state(config.metrics_addr).with_context(|| {
        format!(
            "no running agent answers on {}: the ledger lives in `netreap run` (start it, or pass --metrics-addr)",
            config.metrics_addr
        )
    })?;
    let attachments = state.get("attachments").cloned().unwrap_or(Value::Array(Vec::new()));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&attachments)?);
        return Ok(());
    }
    let list = attachments.as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        println!("no CNI operation seen since the agent started");
    }
    for a in &list {
        println!(
            "{}  netns {} (inode {})  ifnames {}",
            a["container_id"].as_str().unwrap_or("?"),
            a["netns_path"].as_str().unwrap_or("-"),
            a["netns_inode"].as_u64().map_or_else(|| "?".to_owned(), |i| i.to_string()),
            a["ifnames"].as_array().map(|v| v.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(",")).unwrap_or_default(),
        );
        for op in a["operations"].as_array().into_iter().flatten() {
            let exit = &op["exit"];
            let exit = match (exit["exit_code"].as_i64(), exit["signal"].as_i64()) {
                (Some(code), _) => format!("exit {code}"),
                (None, Some(sig)) => format!("signal {sig}"),
                _ => "in flight or unknown".to_owned(),
            };
            println!(
                "    {:<6} {:<40} pid {:<8} {}",
                op["command"].as_str().unwrap_or("?"),
                op["plugin"].as_str().unwrap_or("?"),
                op["pid"].as_u64().unwrap_or(0),
                exit
            );
        }
    }
    Ok(())
}
