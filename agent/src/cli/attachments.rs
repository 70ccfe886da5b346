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
    let mut attachments = state.get("attachments").cloned().unwrap_or(Value::Array(Vec::new()));
    name_pods(&mut attachments, &state["runtime"]);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&attachments)?);
        return Ok(());
    }
    let list = attachments.as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        println!("no CNI operation seen since the agent started");
    }
    for a in &list {
        let pod = a["pod"].as_str().map_or_else(String::new, |p| format!("  pod {p}"));
        println!(
            "{}{pod}  netns {} (inode {})  ifnames {}",
            a["container_id"].as_str().unwrap_or("?"),
            a["netns_path"].as_str().unwrap_or("-"),
            a["netns_inode"].as_u64().map_or_else(|| "?".to_owned(), |i| i.to_string()),
            a["ifnames"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(","))
                .unwrap_or_default(),
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

/// Adds `pod` ("namespace/name") to each attachment whose container the
/// runtime names (its current sandboxes, or those it listed before).
fn name_pods(attachments: &mut Value, runtime: &Value) {
    let pod_of = |id: &str| {
        let pod = runtime["sandboxes"][id].get("pod").or_else(|| runtime["departed"].get(id))?;
        Some(format!("{}/{}", pod["namespace"].as_str()?, pod["name"].as_str()?))
    };
    for a in attachments.as_array_mut().into_iter().flatten() {
        let Some(pod) = a["container_id"].as_str().and_then(pod_of) else { continue };
        if let Value::Object(m) = a {
            m.insert("pod".into(), Value::String(pod));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn attachments_name_the_pods_the_runtime_knows() {
        let mut attachments = json!([{ "container_id": "c1" }, { "container_id": "c2" }, { "container_id": "c3" }]);
        let runtime = json!({
            "sandboxes": { "c1": { "id": "c1", "state": "READY", "pod": { "namespace": "ns", "name": "web" } } },
            "departed": { "c2": { "namespace": "ns", "name": "old" } }
        });
        name_pods(&mut attachments, &runtime);
        assert_eq!(attachments[0]["pod"], "ns/web");
        assert_eq!(attachments[1]["pod"], "ns/old");
        assert!(attachments[2].get("pod").is_none());
        name_pods(&mut attachments, &Value::Null);
    }
}
