//! deploy/daemonset.yaml run the way kubelet would run it, on this host,
//! with podman: the pod template is read from the manifest itself and
//! translated to `podman run` (privileged, hostPID, hostNetwork, every
//! hostPath mount with its propagation, the ConfigMap as a read-only
//! directory, env, args), and the probes are made as kubelet makes them
//! (HTTP GET on the node's address, with the manifest's timeouts).
//!
//! On real namespaces and Debian's CNI plugins it shows the agent in the
//! container loading its probes, releasing a leak made on the host, keeping
//! live pods (one of them in a netns bind-mounted only in a host directory
//! the container does not mount), and answering /metrics and /readyz.
//!
//! What differs from a cluster, and why:
//! - kube-apiserver does not run here: `NODE_NAME` (a fieldRef) is this
//!   host's name, and the ConfigMap is mounted as kubelet would project it.
//! - hostPaths that hold state (`/var/lib/cni`, `/var/lib/netreap`) and the
//!   runtime socket directories are re-rooted under a temp dir so the test never touches this machine's
//!   CNI state; the kernel's (`/proc`, `/sys/...`, `/run/netns`) are the
//!   real ones.
//! - podman here cannot raise rlimits (no CAP_SYS_RESOURCE) and crun does
//!   not support this host's hybrid cgroups: runc, with the limits given.
//!
//! Needs the image: run through `cargo xtask daemonset-test` (which builds
//! it with `cargo xtask image`), hence `#[ignore]` under a plain test run.
#![expect(clippy::expect_used, reason = "test helpers panic with context on a broken set-up")]

use netreap_testkit as support;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use netreap::cnirt::{Attachment, Network, Runtime};
use serde_json::{Value, json};
use support::{agent::wait_until, net::ip};

/// hostPaths re-rooted under the test's temp dir (state, not kernel views).
/// The runtime sockets' directories too: this machine's containerd (if one
/// runs) is not the pod's runtime here.
const REROOTED: &[&str] = &["/var/lib/cni", "/var/lib/netreap", "/run/containerd", "/var/run/crio"];
const DEBIAN_PLUGINS: &str = "/usr/lib/cni";

fn manifest(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An HTTP probe as kubelet makes it.
#[derive(Debug, Clone)]
struct Probe {
    kind: &'static str,
    path: String,
    port: u16,
    timeout: Duration,
    period: Duration,
    initial_delay: Duration,
    failure_threshold: u32,
}

/// The pod template, translated.
#[derive(Debug)]
struct PodmanRun {
    /// Arguments of `podman run`, the image and the container's args included.
    args: Vec<String>,
    probes: Vec<Probe>,
    grace: Duration,
    image: String,
}

fn str_at<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str().unwrap_or_else(|| panic!("{what}: expected a string, got {v}"))
}

/// Translates the `DaemonSet`'s pod template into `podman run` arguments.
#[expect(clippy::too_many_lines, reason = "one field of the pod spec after another, in the manifest's order")]
/// Anything the translation does not know is an error, never skipped: the
/// manifest and this test must not drift apart silently.
fn translate(daemonset: &Value, configmap: &Value, root: &Path, node_name: &str, name: &str) -> PodmanRun {
    let spec = &daemonset["spec"]["template"]["spec"];
    let containers = spec["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1, "one container in the pod template");
    let c = &containers[0];
    let mut args: Vec<String> = vec!["run".into(), "--detach".into(), "--name".into(), name.into()];
    args.push("--pull=never".into());
    if spec["hostPID"] == true {
        args.push("--pid=host".into());
    }
    if spec["hostNetwork"] == true {
        args.push("--network=host".into());
    }
    if c["securityContext"]["privileged"] == true {
        args.push("--privileged".into());
    }
    for (key, value) in c["securityContext"].as_object().into_iter().flatten() {
        assert_eq!(key, "privileged", "securityContext.{key} is not translated yet");
        let _ = value;
    }
    // Environment: plain values and the node name from the downward API.
    for env in c["env"].as_array().into_iter().flatten() {
        let key = str_at(&env["name"], "env name");
        let value = if let Some(v) = env["value"].as_str() {
            v.to_owned()
        } else {
            let field = str_at(&env["valueFrom"]["fieldRef"]["fieldPath"], "env fieldRef");
            assert_eq!(field, "spec.nodeName", "env {key}: fieldRef {field} is not translated");
            node_name.to_owned()
        };
        args.push("--env".into());
        args.push(format!("{key}={value}"));
    }
    // Volumes: hostPath (re-rooted when it holds state), configMap.
    let volumes: BTreeMap<&str, &Value> =
        spec["volumes"].as_array().expect("volumes").iter().map(|v| (str_at(&v["name"], "volume name"), v)).collect();
    for mount in c["volumeMounts"].as_array().expect("volumeMounts") {
        let volume = volumes[str_at(&mount["name"], "volumeMount name")];
        let target = str_at(&mount["mountPath"], "mountPath");
        let source = if let Some(host) = volume["hostPath"]["path"].as_str() {
            let source = match REROOTED.iter().find(|r| host == **r || host.starts_with(&format!("{r}/"))) {
                Some(_) => root.join(host.trim_start_matches('/')),
                None => PathBuf::from(host),
            };
            match volume["hostPath"]["type"].as_str() {
                Some("DirectoryOrCreate") => std::fs::create_dir_all(&source).expect("hostPath DirectoryOrCreate"),
                Some("Directory") => assert!(source.is_dir(), "hostPath {} must be a directory", source.display()),
                other => panic!("hostPath type {other:?} is not translated"),
            }
            source
        } else if let Some(cm) = volume["configMap"]["name"].as_str() {
            assert_eq!(cm, str_at(&configmap["metadata"]["name"], "ConfigMap name"), "the ConfigMap in deploy/");
            let dir = root.join("configmap").join(cm);
            std::fs::create_dir_all(&dir).expect("configMap dir");
            for (file, content) in configmap["data"].as_object().expect("ConfigMap data") {
                std::fs::write(dir.join(file), str_at(content, "ConfigMap value")).expect("ConfigMap file");
            }
            dir
        } else {
            panic!("volume {volume} is not translated");
        };
        let mut options = vec![if mount["readOnly"] == true { "ro" } else { "rw" }];
        options.push(match mount["mountPropagation"].as_str() {
            None | Some("None") => "rprivate",
            Some("HostToContainer") => "rslave",
            Some("Bidirectional") => "rshared",
            Some(other) => panic!("mountPropagation {other} is not translated"),
        });
        args.push("--volume".into());
        args.push(format!("{}:{target}:{}", source.display(), options.join(",")));
    }
    // Limits as kubelet sets them (cgroup) are left out: see the module doc.
    let ulimits = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"];
    args.extend(ulimits.iter().map(|s| (*s).to_owned()));
    let image = str_at(&c["image"], "image").to_owned();
    args.push(image.clone());
    args.extend(c["args"].as_array().expect("args").iter().map(|a| str_at(a, "arg").to_owned()));

    let ports: BTreeMap<&str, u16> = c["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| (str_at(&p["name"], "port name"), p["containerPort"].as_u64().expect("containerPort") as u16))
        .collect();
    let secs = |v: &Value, default: u64| Duration::from_secs(v.as_u64().unwrap_or(default));
    let probes = [("liveness", &c["livenessProbe"]), ("readiness", &c["readinessProbe"])]
        .into_iter()
        .filter(|(_, p)| !p.is_null())
        .map(|(kind, p)| {
            let get = &p["httpGet"];
            assert!(!get.is_null(), "{kind}Probe: only httpGet is translated");
            assert!(get["host"].is_null(), "{kind}Probe: host is not translated");
            let port = match &get["port"] {
                Value::String(name) => ports[name.as_str()],
                other => other.as_u64().expect("probe port") as u16,
            };
            // Kubernetes' defaults where the manifest leaves them out.
            Probe {
                kind,
                path: str_at(&get["path"], "probe path").to_owned(),
                port,
                timeout: secs(&p["timeoutSeconds"], 1),
                period: secs(&p["periodSeconds"], 10),
                initial_delay: secs(&p["initialDelaySeconds"], 0),
                failure_threshold: p["failureThreshold"].as_u64().unwrap_or(3) as u32,
            }
        })
        .collect();
    let grace = secs(&spec["terminationGracePeriodSeconds"], 30);
    PodmanRun { args, probes, grace, image }
}

/// One HTTP GET with a timeout, as kubelet's prober: (status, body).
fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Option<(u16, String)> {
    support::agent::http_get_with(addr, path, &[("User-Agent", "kube-probe/1.33")], timeout)
}

/// The agent's `/state`, asked on its local address.
fn local_state(local: SocketAddr) -> Option<Value> {
    http_get(local, "/state", Duration::from_secs(5)).and_then(|(_, b)| serde_json::from_str(&b).ok())
}

/// How `/state` judged a container's reservation: its status and summary.
fn verdict_in(state: &Value, container_id: &str) -> String {
    state["verdicts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["reservation"]["container_id"] == container_id)
        .map_or_else(|| "no verdict".into(), |v| format!("{} ({})", v["status"], v["summary"]))
}

/// The node's address: where kubelet probes a hostNetwork pod.
fn node_ip() -> std::net::Ipv4Addr {
    let out = Command::new("ip").args(["-4", "-o", "route", "get", "1.1.1.1"]).output().expect("ip route get");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "src")
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no source address in {text:?}"))
}

fn podman(args: &[&str]) -> std::process::Output {
    Command::new("podman").arg("--runtime").arg("runc").args(args).output().expect("run podman")
}

/// Everything the test made, removed on drop (even when it fails).
struct Scene {
    root: tempfile::TempDir,
    container: String,
    bridge: String,
    netns: Vec<String>,
    hidden_mounts: Vec<PathBuf>,
}

impl Drop for Scene {
    fn drop(&mut self) {
        let _ = podman(&["rm", "--force", "--time", "5", &self.container]);
        for m in &self.hidden_mounts {
            let _ = Command::new("umount").arg(m).status();
        }
        for ns in &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).status();
        let _ = &self.root;
    }
}

impl Scene {
    fn logs(&self) -> String {
        let out = podman(&["logs", &self.container]);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    fn events(&self, name: &str) -> Vec<Value> {
        let out = podman(&["logs", &self.container]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["event"] == name)
            .collect()
    }

    /// A named netns (in /run/netns, as runtimes make them).
    fn netns(&mut self) -> (String, PathBuf) {
        let name = support::unique("nrSds");
        ip(&["netns", "add", &name]);
        self.netns.push(name.clone());
        let path = PathBuf::from(format!("/run/netns/{name}"));
        (name, path)
    }

    /// A netns bind-mounted only under the test's temp dir (which the
    /// container does not mount): its /run/netns name is removed.
    fn hidden_netns(&mut self) -> PathBuf {
        let (name, path) = self.netns();
        let dir = self.root.path().join("hidden-netns");
        std::fs::create_dir_all(&dir).expect("hidden dir");
        let hidden = dir.join(&name);
        std::fs::write(&hidden, "").expect("mount point");
        let ok = Command::new("mount").arg("--bind").arg(&path).arg(&hidden).status().expect("mount").success();
        assert!(ok, "bind-mount the netns at {}", hidden.display());
        self.hidden_mounts.push(hidden.clone());
        ip(&["netns", "del", &name]);
        self.netns.retain(|n| *n != name);
        hidden
    }
}

#[test]
#[expect(clippy::too_many_lines, reason = "one scenario, step by step, as the issue lists it")]
#[ignore = "needs the image: run by `cargo xtask daemonset-test`"]
fn the_daemonset_pod_spec_runs_the_agent_in_a_container() {
    assert!(support::kernel_tests_possible(), "root and BTF are needed");
    assert!(Path::new(DEBIAN_PLUGINS).join("host-local").exists(), "containernetworking-plugins");
    let root = tempfile::Builder::new().prefix("nrS").tempdir().expect("temp dir");
    let node_name = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname").trim().to_owned();
    let container = format!("nrS-netreap-{}", std::process::id());
    let run = translate(&manifest("daemonset.yaml"), &manifest("configmap.yaml"), root.path(), &node_name, &container);
    eprintln!("podman --runtime runc {}", run.args.join(" "));
    let present = podman(&["image", "exists", &run.image]);
    assert!(present.status.success(), "image {} missing: run `cargo xtask image` first", run.image);

    let bridge = support::unique("nrSbr");
    let mut scene = Scene { root, container, bridge, netns: Vec::new(), hidden_mounts: Vec::new() };
    ip(&["link", "add", &scene.bridge, "type", "bridge"]);
    ip(&["link", "set", &scene.bridge, "up"]);
    let cni_root = scene.root.path().join("var/lib/cni");
    let data_dir = cni_root.join("networks");
    let runtime = Runtime { plugin_dirs: vec![PathBuf::from(DEBIAN_PLUGINS)], cache_dir: Some(cni_root.clone()) };
    let net = Network {
        name: "nrSdsnet".into(),
        plugins: vec![json!({
            "type": "bridge", "bridge": scene.bridge, "isGateway": false, "ipMasq": false,
            "ipam": { "type": "host-local", "dataDir": data_dir, "ranges": [[{ "subnet": "10.79.0.0/28" }]] }
        })],
    };
    let reserved = |container: &str| -> bool {
        std::fs::read_dir(data_dir.join(&net.name))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .any(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.starts_with(container)))
    };

    // A pod that lives through the whole test, attached before the agent starts.
    let (_, live_path) = scene.netns();
    let live = support::unique("nrSlive");
    runtime.add(&net, &Attachment { container_id: &live, netns: &live_path, ifname: "eth0" }).expect("ADD live");

    let started = Instant::now();
    let out = Command::new("podman").arg("--runtime").arg("runc").args(&run.args).output().expect("podman run");
    assert!(out.status.success(), "podman run: {}", String::from_utf8_lossy(&out.stderr));

    // Probes as kubelet makes them, on the node's address.
    let node = node_ip();
    let probe = |p: &Probe| http_get(SocketAddr::from((node, p.port)), &p.path, p.timeout);
    let readiness = run.probes.iter().find(|p| p.kind == "readiness").expect("a readinessProbe").clone();
    let liveness = run.probes.iter().find(|p| p.kind == "liveness").expect("a livenessProbe").clone();
    let ready_within = readiness.initial_delay + readiness.period * readiness.failure_threshold * 4;
    let ready = wait_until(ready_within, || probe(&readiness).is_some_and(|(s, _)| s == 200));
    assert!(ready.is_some(), "not ready within {ready_within:?} (readinessProbe); logs:\n{}", scene.logs());
    eprintln!("ready {:?} after podman run", started.elapsed());
    assert_eq!(probe(&liveness).map(|(s, _)| s), Some(200), "livenessProbe");

    // The probes loaded in the container (kernel tracepoints, from its /state).
    let local = SocketAddr::from(([127, 0, 0, 1], readiness.port));
    let state: Value = http_get(local, "/state", Duration::from_secs(5))
        .and_then(|(_, b)| serde_json::from_str(&b).ok())
        .expect("/state from the node (loopback)");
    let active: Vec<&str> = state["probes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["state"] == "active")
        .filter_map(|p| p["program"].as_str())
        .collect();
    eprintln!("probes active in the container: {active:?}");
    assert!(!active.is_empty(), "no probe active; /state probes: {}", state["probes"]);
    assert!(scene.logs().contains("probe active"), "the container's log names its probes");

    // A pod whose netns is bind-mounted only in a host dir the container
    // does not mount; then a leak made on the host (netns deleted, no DEL).
    let hidden_path = scene.hidden_netns();
    let hidden = support::unique("nrShid");
    runtime.add(&net, &Attachment { container_id: &hidden, netns: &hidden_path, ifname: "eth0" }).expect("ADD hidden");
    let (leak_name, leak_path) = scene.netns();
    let leak = support::unique("nrSleak");
    runtime.add(&net, &Attachment { container_id: &leak, netns: &leak_path, ifname: "eth0" }).expect("ADD leak");
    assert!(reserved(&leak) && reserved(&hidden) && reserved(&live));
    ip(&["netns", "del", &leak_name]);
    scene.netns.retain(|n| *n != leak_name);
    let deleted = Instant::now();
    let leak_gone = wait_until(Duration::from_secs(20), || !reserved(&leak));
    assert!(leak_gone.is_some(), "the host leak was not released by the container; logs:\n{}", scene.logs());
    eprintln!("host leak released {:?} after its netns was deleted", deleted.elapsed());
    let releases = scene.events("release");
    assert!(
        releases.iter().any(|r| r["container_id"] == leak.as_str() && r["outcome"] == "released"),
        "release event: {releases:#?}"
    );

    // Live pods stay, across resyncs (the ConfigMap's interval) and the
    // death above; /state says how the agent judged the hidden one.
    std::thread::sleep(Duration::from_secs(35));
    let state = local_state(local).expect("/state");
    let verdict_of = |id: &str| verdict_in(&state, id);
    eprintln!("live pod: {}", verdict_of(&live));
    eprintln!("pod in a netns mounted only at {}: {}", hidden_path.display(), verdict_of(&hidden));
    assert!(reserved(&live), "the live pod's reservation was kept");
    assert!(reserved(&hidden), "the hidden-netns pod's reservation was kept: {}", verdict_of(&hidden));

    // /metrics from the node's address (expose_metrics in the ConfigMap);
    // /state from it is refused (expose_state is off).
    let (status, metrics) = http_get(SocketAddr::from((node, readiness.port)), "/metrics", Duration::from_secs(5))
        .expect("/metrics answers");
    assert_eq!(status, 200);
    assert!(metrics.contains("netreap_build_info"), "{metrics}");
    assert!(metrics.contains("outcome=\"released\""), "the release is counted:\n{metrics}");
    let remote_state = http_get(SocketAddr::from((node, readiness.port)), "/state", Duration::from_secs(5));
    assert_eq!(remote_state.map(|(s, _)| s), Some(403), "/state stays local");

    // SIGTERM with the pod's grace period, as kubelet stops it.
    let grace = run.grace.as_secs().to_string();
    let stop = podman(&["stop", "--time", &grace, &scene.container]);
    assert!(stop.status.success(), "podman stop: {}", String::from_utf8_lossy(&stop.stderr));
    let inspect = podman(&["inspect", "--format", "{{.State.ExitCode}}", &scene.container]);
    assert_eq!(String::from_utf8_lossy(&inspect.stdout).trim(), "0", "clean exit on SIGTERM; logs:\n{}", scene.logs());
    assert!(scene.logs().contains("bye"), "flushed and detached");

    // Restarted (a rollout, or kubelet after a crash): the new agent starts
    // from the host's mount table and kernel alone, and keeps both pods.
    let start = podman(&["start", &scene.container]);
    assert!(start.status.success(), "podman start: {}", String::from_utf8_lossy(&start.stderr));
    let ready = wait_until(ready_within, || probe(&readiness).is_some_and(|(s, _)| s == 200));
    assert!(ready.is_some(), "not ready again after a restart; logs:\n{}", scene.logs());
    let state = local_state(local).expect("/state after the restart");
    let status_of = |id: &str| verdict_in(&state, id);
    eprintln!("after a restart, pod in the hidden netns: {}", status_of(&hidden));
    assert!(status_of(&live).starts_with("\"in_use\""), "live pod after a restart: {}", status_of(&live));
    assert!(status_of(&hidden).starts_with("\"in_use\""), "hidden-netns pod after a restart: {}", status_of(&hidden));
    assert!(reserved(&live) && reserved(&hidden), "both kept across the restart");
}
