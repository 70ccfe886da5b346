//! The Kubernetes side of the tests: a stand-in API server (no
//! kube-apiserver can be installed on these machines; see apiserver.py for
//! the conventions it enforces), a kubeconfig for it, a stand-in whereabouts
//! IPAM plugin run the way a runtime runs a CNI plugin, and sandboxes
//! (named netns with a veth) whose names start with this suite's prefix.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};

use super::{agent::wait_until, unique};

/// Every netns and link these tests make starts with it.
pub const PREFIX: &str = "nrK";
pub const NODE: &str = "nrk-node";
pub const WB_NAMESPACE: &str = "kube-system";
pub const IPPOOLS: &str = "/apis/whereabouts.cni.cncf.io/v1alpha1";

pub fn python_present() -> bool {
    let ok = Command::new("python3").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    ok || super::skip("python3 is needed for the stand-in API server (cargo xtask test installs it)")
}

/// The stand-in API server, a child process.
pub struct ApiServer {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub kubeconfig: PathBuf,
}

impl ApiServer {
    /// Starts it and writes a kubeconfig for it into `dir`.
    pub fn start(dir: &Path) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("apiserver.py");
        let port_file = dir.join(format!("apiserver-{}.port", unique(PREFIX)));
        let child = Command::new("python3")
            .arg(&script)
            .arg(&port_file)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 runs the stand-in API server");
        let mut port = None;
        wait_until(Duration::from_secs(10), || {
            port = std::fs::read_to_string(&port_file).ok().and_then(|p| p.trim().parse::<u16>().ok());
            port.is_some()
        });
        let port = port.expect("the stand-in API server wrote its port");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let kubeconfig = dir.join(format!("kubeconfig-{port}"));
        std::fs::write(&kubeconfig, kubeconfig_for(addr)).expect("write kubeconfig");
        Self { child: Some(child), addr, kubeconfig }
    }

    /// Kills it (the API going away).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One request; returns the status and the JSON body.
    pub fn request(&self, method: &str, path: &str, content_type: &str, body: Option<&Value>) -> (u16, Value) {
        request(self.addr, method, path, content_type, body).unwrap_or_else(|| panic!("{method} {path}: no answer"))
    }

    pub fn get(&self, path: &str) -> Value {
        let (code, v) = self.request("GET", path, "application/json", None);
        assert_eq!(code, 200, "GET {path}: {v}");
        v
    }

    pub fn create(&self, collection: &str, object: &Value) -> Value {
        let (code, v) = self.request("POST", collection, "application/json", Some(object));
        assert_eq!(code, 201, "POST {collection}: {v}");
        v
    }

    pub fn delete(&self, path: &str) {
        let (code, v) = self.request("DELETE", path, "application/json", None);
        assert_eq!(code, 200, "DELETE {path}: {v}");
    }

    /// Every request the server answered.
    pub fn log(&self) -> Vec<Value> {
        self.get("/_control/log").as_array().cloned().unwrap_or_default()
    }

    /// Before the next `method` on `path`, another writer applies `ops`.
    pub fn hook(&self, method: &str, path: &str, ops: &Value) {
        let (code, v) = self.request(
            "POST",
            "/_control/hook",
            "application/json",
            Some(&json!({
                "method": method, "path": path, "ops": ops,
            })),
        );
        assert_eq!(code, 200, "{v}");
    }

    pub fn pool_path(name: &str) -> String {
        format!("{IPPOOLS}/namespaces/{WB_NAMESPACE}/ippools/{name}")
    }

    /// An IPPool named the way whereabouts names it, empty.
    pub fn create_pool(&self, range: &str) -> String {
        let name = range.replace(['/', ':'], "-");
        self.create(
            &format!("{IPPOOLS}/namespaces/{WB_NAMESPACE}/ippools"),
            &json!({ "metadata": { "name": name }, "spec": { "range": range, "allocations": {} } }),
        );
        name
    }

    pub fn pool(&self, name: &str) -> Value {
        self.get(&Self::pool_path(name))
    }

    /// A pod of `node` in `phase` (with `ips` reported).
    pub fn create_pod(&self, namespace: &str, name: &str, node: &str, phase: &str, ips: &[&str]) {
        let pod_ips: Vec<Value> = ips.iter().map(|ip| json!({ "ip": ip })).collect();
        self.create(
            &format!("/api/v1/namespaces/{namespace}/pods"),
            &json!({
                "metadata": { "name": name, "namespace": namespace },
                "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "pause" }] },
                "status": { "phase": phase, "podIPs": pod_ips },
            }),
        );
    }

    /// Events whose `regarding` names `kind` `name`.
    pub fn events_regarding(&self, kind: &str, name: &str) -> Vec<Value> {
        self.get("/apis/events.k8s.io/v1/events")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e["regarding"]["kind"] == kind && e["regarding"]["name"] == name)
            .collect()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn kubeconfig_for(addr: SocketAddr) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: standin\n  cluster:\n    server: http://{addr}\n\
         users:\n- name: netreap\n  user: {{}}\ncontexts:\n- name: standin\n  context:\n    cluster: standin\n    \
         user: netreap\n    namespace: default\ncurrent-context: standin\n"
    )
}

fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: Option<&Value>,
) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    let text = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((code, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// A stand-in for the whereabouts IPAM plugin: on ADD it allocates the
/// lowest free offset of the pool the way whereabouts does (a JSON patch
/// that tests the pool's resourceVersion), writes the pod reference from
/// CNI_ARGS, creates the OverlappingRangeIPReservation, and prints a CNI
/// result. Run with CNI_* in its environment, so the kernel probes record
/// it like any CNI plugin run.
const WB_PLUGIN: &str = r#"#!/usr/bin/env python3
import ipaddress, json, os, sys, urllib.request
conf = json.load(sys.stdin)
api, pool = conf["apiserver"], conf["pool"]
args = dict(kv.split("=", 1) for kv in os.environ.get("CNI_ARGS", "").split(";") if "=" in kv)
podref = args.get("K8S_POD_NAMESPACE", "") + "/" + args.get("K8S_POD_NAME", "")
if not conf.get("write_podref", True):
    podref = ""
cid, ifname = os.environ["CNI_CONTAINERID"], os.environ["CNI_IFNAME"]
def call(method, path, body=None, ctype="application/json"):
    req = urllib.request.Request(api + path, method=method, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": ctype})
    with urllib.request.urlopen(req) as r:
        return json.load(r)
path = "/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/kube-system/ippools/" + pool
for attempt in range(20):
    p = call("GET", path)
    net = ipaddress.ip_network(p["spec"]["range"], strict=False)
    base = ipaddress.ip_address(p["spec"]["range"].split("/")[0])
    used = set(p["spec"].get("allocations") or {})
    offset = next(o for o in range(1, net.num_addresses - 1) if str(o) not in used)
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": p["metadata"]["resourceVersion"]},
           {"op": "add", "path": "/spec/allocations/%d" % offset, "value": {"id": cid, "podref": podref, "ifname": ifname}}]
    try:
        call("PATCH", path, ops, "application/json-patch+json")
        break
    except urllib.error.HTTPError as e:
        if e.code not in (409, 422):
            raise
ip = base + offset
call("POST", "/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/kube-system/overlappingrangeipreservations",
     {"metadata": {"name": str(ip).replace(":", "-")}, "spec": {"containerid": cid, "podref": podref, "ifname": ifname}})
print(json.dumps({"cniVersion": "1.0.0", "ips": [{"address": "%s/%d" % (ip, net.prefixlen)}]}))
"#;

/// The stand-in plugin, written into a test's dir.
pub struct WbPlugin {
    pub path: PathBuf,
}

impl WbPlugin {
    pub fn install(dir: &Path) -> Self {
        let path = dir.join("whereabouts");
        std::fs::write(&path, WB_PLUGIN).expect("write plugin");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod plugin");
        Self { path }
    }

    /// CNI ADD for `sandbox`, naming pod `namespace/name`; returns the IP.
    pub fn add(&self, api: &ApiServer, pool: &str, sandbox: &Sandbox, namespace: &str, name: &str) -> String {
        self.add_with(api, pool, sandbox, namespace, name, true)
    }

    /// CNI ADD; with `write_podref` false the allocation names no pod (only
    /// CNI_ARGS of the run does).
    pub fn add_with(
        &self,
        api: &ApiServer,
        pool: &str,
        sandbox: &Sandbox,
        namespace: &str,
        name: &str,
        write_podref: bool,
    ) -> String {
        let conf = json!({
            "cniVersion": "1.0.0", "name": "wbnet", "type": "whereabouts",
            "apiserver": format!("http://{}", api.addr), "pool": pool, "write_podref": write_podref,
        });
        let mut child = Command::new(&self.path)
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", &sandbox.container_id)
            .env("CNI_NETNS", &sandbox.path)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_ARGS", format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}"))
            .env("CNI_PATH", "/usr/lib/cni")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run the stand-in whereabouts plugin");
        child.stdin.take().expect("stdin").write_all(conf.to_string().as_bytes()).expect("config to plugin");
        let out = child.wait_with_output().expect("plugin output");
        assert!(out.status.success(), "plugin ADD failed: {}", String::from_utf8_lossy(&out.stdout));
        let result: Value = serde_json::from_slice(&out.stdout).expect("CNI result");
        let cidr = result["ips"][0]["address"].as_str().expect("an address");
        cidr.split('/').next().unwrap_or_default().to_owned()
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// A pod sandbox: a named netns (prefix nrK) and a container ID.
pub struct Sandbox {
    pub name: String,
    pub path: PathBuf,
    pub container_id: String,
    deleted: bool,
}

impl Sandbox {
    #[expect(clippy::new_without_default, reason = "new() makes a netns: not a default value")]
    pub fn new() -> Self {
        let name = unique(PREFIX);
        ip(&["netns", "add", &name]);
        let container_id = format!("{:0<64}", format!("{}c", unique("")));
        Self { path: PathBuf::from(format!("/var/run/netns/{name}")), name, container_id, deleted: false }
    }

    /// A veth into the netns with `address` on it (what the main plugin
    /// would have done with the IPAM result).
    pub fn configure(&self, address: &str) {
        let host = format!("{PREFIX}h{}", &self.name[PREFIX.len()..]);
        let host: String = host.chars().take(15).collect();
        ip(&["link", "add", &host, "type", "veth", "peer", "name", "eth0", "netns", &self.name]);
        ip(&["-n", &self.name, "addr", "add", &format!("{address}/24"), "dev", "eth0"]);
        ip(&["-n", &self.name, "link", "set", "eth0", "up"]);
    }

    /// Destroys the netns with no CNI DEL (a failed teardown).
    pub fn delete_netns(&mut self) {
        ip(&["netns", "del", &self.name]);
        self.deleted = true;
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
        }
    }
}
