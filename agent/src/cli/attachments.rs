//! `netreap attachments`: the attachment ledger of the running agent
//! (container <-> netns <-> CNI operations, failed ones included), read
//! from its state endpoint.

use std::{net::SocketAddr, time::Duration};

use anyhow::Context as _;
use http_body_util::{BodyExt as _, Empty};
use hyper::{Request, StatusCode, header::HOST};
use hyper_util::rt::TokioIo;
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

/// How long the agent has to answer, connection and document together.
const STATE_TIMEOUT: Duration = Duration::from_secs(10);

/// The agent's /state document. A large one is streamed (chunked), so it
/// is read with hyper's HTTP/1 client, not parsed by hand.
fn fetch_state(addr: SocketAddr) -> anyhow::Result<Value> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        tokio::time::timeout(STATE_TIMEOUT, async {
            let stream = tokio::net::TcpStream::connect(addr).await?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            let connection = tokio::spawn(connection);
            let request = Request::get("/state").header(HOST, addr.to_string()).body(Empty::<bytes::Bytes>::new())?;
            let response = sender.send_request(request).await?;
            anyhow::ensure!(response.status() == StatusCode::OK, "state endpoint answered: {}", response.status());
            let body = response.into_body().collect().await?.to_bytes();
            connection.abort();
            Ok(serde_json::from_slice(&body)?)
        })
        .await
        .context("no answer in time")?
    })
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

    /// Answers one request on a loopback listener with `response`.
    fn serve_once(response: Vec<u8>) -> SocketAddr {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = [0u8; 1024];
            let _ = conn.read(&mut request);
            conn.write_all(&response).unwrap();
        });
        addr
    }

    #[test]
    fn a_streamed_state_is_read_whole() {
        // The agent streams a /state over 64 KiB in chunks.
        let doc = json!({ "attachments": [{ "container_id": "c".repeat(70_000) }] }).to_string();
        let (first, rest) = doc.split_at(40_000);
        let mut response =
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        for chunk in [first, rest] {
            response.extend(format!("{:x}\r\n{chunk}\r\n", chunk.len()).into_bytes());
        }
        response.extend(b"0\r\n\r\n");
        let state = fetch_state(serve_once(response)).unwrap();
        assert_eq!(state["attachments"][0]["container_id"].as_str().map(str::len), Some(70_000));
    }

    #[test]
    fn an_error_status_is_an_error() {
        let response = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n".to_vec();
        let err = fetch_state(serve_once(response)).unwrap_err();
        assert!(err.to_string().contains("503"), "{err}");
    }
}
