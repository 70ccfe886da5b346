//! The real containerd (Debian's 1.6.20 with runc), started by the test under
//! its own root, state dir and socket in a tempdir, with an offline pause
//! image (a static binary imported with `ctr`: no registry is reachable) and
//! a CNI chain of Debian's bridge + host-local and a test plugin whose DEL
//! can be made to fail. Pods are driven through the CRI with netreap's own
//! client. Everything is stopped and removed on drop, even when a test fails.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use netreap::runtime::{CriClient, api};
use serde_json::json;

use super::{agent::wait_until, unique};

/// Tools the harness needs (installed by `cargo xtask test`).
const TOOLS: &[(&str, &str)] = &[
    ("/usr/bin/containerd", "containerd"),
    ("/usr/bin/ctr", "containerd"),
    ("/usr/sbin/runc", "runc"),
    ("/usr/bin/containerd-shim-runc-v2", "containerd"),
    ("/usr/bin/gcc", "gcc"),
    ("/usr/bin/python3", "python3"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("/usr/lib/cni/host-local", "containernetworking-plugins"),
    ("/usr/lib/cni/loopback", "containernetworking-plugins"),
];

/// The last plugin of the chain: passes the result through on ADD; on DEL
/// fails with the message in `<dir>/del-error` when that file exists.
/// containerd 1.6 treats a DEL error containing "not found" as success and
/// removes the netns: the plugins before it never run their DEL.
const FLAKY_PLUGIN: &str = r#"#!/bin/sh
in=$(cat)
dir=$(dirname "$0")/..
case "$CNI_COMMAND" in
ADD)
  printf '%s' "$in" | /usr/bin/python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["prevResult"]))'
  ;;
DEL)
  if [ -f "$dir/del-error" ]; then
    printf '{"cniVersion":"1.0.0","code":999,"msg":"%s"}' "$(cat "$dir/del-error")"
    exit 1
  fi
  ;;
VERSION)
  echo '{"cniVersion":"1.0.0","supportedVersions":["0.3.1","0.4.0","1.0.0"]}'
  ;;
esac
exit 0
"#;

const PAUSE_C: &str = r"
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, done);
    signal(SIGTERM, done);
    for (;;) pause();
}
";

pub const PAUSE_IMAGE: &str = "nrc.local/pause:1";

fn run(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub struct Containerd {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    /// The CNI network's name (the host-local directory).
    pub network: String,
    pub bridge: String,
    /// host-local's dataDir.
    pub data_dir: PathBuf,
    /// netreap's CNI cache dir and state dir (containerd's libcni cache is
    /// the host's /var/lib/cni: netreap is not shown it here).
    pub cache_dir: PathBuf,
    pub state_dir: PathBuf,
    child: Option<Child>,
    rt: tokio::runtime::Runtime,
    client: Option<CriClient>,
}

/// A pod sandbox made through the CRI.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    pub name: String,
    pub namespace: String,
}

impl Containerd {
    /// Starts containerd with a bridge network on `subnet`.
    pub fn start(subnet: &str) -> Self {
        for (file, package) in TOOLS {
            assert!(Path::new(file).exists(), "{file} is missing: install Debian's {package} (cargo xtask test does)");
        }
        let dir = tempfile::Builder::new().prefix("nrC").tempdir().expect("tempdir");
        let d = dir.path();
        let bridge = unique("nrCbr");
        let network = unique("nrCnet");
        let bin = d.join("cni-bin");
        let conf = d.join("cni-conf");
        for sub in [&bin, &conf] {
            std::fs::create_dir_all(sub).expect("mkdir");
        }
        for p in ["bridge", "host-local", "loopback"] {
            std::os::unix::fs::symlink(Path::new("/usr/lib/cni").join(p), bin.join(p)).expect("symlink plugin");
        }
        let flaky = bin.join("nrc-flaky");
        std::fs::write(&flaky, FLAKY_PLUGIN).expect("write plugin");
        std::fs::set_permissions(&flaky, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let data_dir = d.join("ipam");
        let cache_dir = d.join("netreap-cache");
        let state_dir = d.join("netreap-state");
        for sub in [&data_dir, &cache_dir, &state_dir] {
            std::fs::create_dir_all(sub).expect("mkdir");
        }
        let conflist = json!({
            "cniVersion": "1.0.0",
            "name": network,
            "plugins": [
                {
                    "type": "bridge", "bridge": bridge, "isGateway": false, "ipMasq": false,
                    "ipam": { "type": "host-local", "dataDir": data_dir, "ranges": [[{ "subnet": subnet }]] }
                },
                { "type": "nrc-flaky" }
            ]
        });
        std::fs::write(conf.join("10-nrc.conflist"), conflist.to_string()).expect("conflist");
        let socket = d.join("containerd.sock");
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # CAP_SYS_RESOURCE is missing here: runc may not lower oom_score_adj.
  restrict_oom_score_adj = true
  disable_apparmor = true
  # The pods' netns bind mounts live in this tempdir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"#,
            root = d.join("root").display(),
            state = d.join("state").display(),
            socket = socket.display(),
            d = d.display(),
            bin = bin.display(),
            conf = conf.display(),
        );
        std::fs::write(d.join("config.toml"), config).expect("containerd config");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
        let mut me =
            Self { dir, socket, network, bridge, data_dir, cache_dir, state_dir, child: None, rt, client: None };
        me.spawn();
        me.import_pause_image();
        me
    }

    /// Starts (again) the containerd process and connects.
    pub fn spawn(&mut self) {
        let d = self.dir.path();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(d.join("containerd.log")).expect("log");
        let child = Command::new("/usr/bin/containerd")
            .arg("--config")
            .arg(d.join("config.toml"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        self.child = Some(child);
        let up = wait_until(Duration::from_secs(20), || self.socket.exists());
        assert!(up.is_some(), "containerd did not create {} in 20 s; log:\n{}", self.socket.display(), self.log());
        let socket = self.socket.clone();
        let client = self.rt.block_on(async {
            for _ in 0..100 {
                if let Ok(c) = CriClient::connect(&socket).await
                    && c.version().await.is_ok()
                {
                    return Some(c);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None
        });
        self.client = Some(client.unwrap_or_else(|| panic!("containerd's CRI does not answer; log:\n{}", self.log())));
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    fn import_pause_image(&self) {
        let d = self.dir.path().join("image");
        std::fs::create_dir_all(d.join("layer")).expect("mkdir");
        std::fs::write(d.join("pause.c"), PAUSE_C).expect("pause.c");
        run(
            Command::new("/usr/bin/gcc")
                .args(["-static", "-Os", "-o"])
                .arg(d.join("layer/pause"))
                .arg(d.join("pause.c")),
            "build the static pause binary",
        );
        run(
            Command::new("tar").arg("-C").arg(d.join("layer")).arg("-cf").arg(d.join("layer.tar")).arg("pause"),
            "tar layer",
        );
        let out = Command::new("sha256sum").arg(d.join("layer.tar")).output().expect("sha256sum");
        let sha = String::from_utf8_lossy(&out.stdout).split_whitespace().next().expect("digest").to_owned();
        let config = json!({
            "architecture": "amd64", "os": "linux",
            "config": { "Entrypoint": ["/pause"] },
            "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{sha}")] }
        });
        std::fs::write(d.join("config.json"), config.to_string()).expect("image config");
        let manifest = json!([{ "Config": "config.json", "RepoTags": [PAUSE_IMAGE], "Layers": ["layer.tar"] }]);
        std::fs::write(d.join("manifest.json"), manifest.to_string()).expect("manifest");
        run(
            Command::new("tar").arg("-cf").arg(d.join("image.tar")).arg("-C").arg(&d).args([
                "manifest.json",
                "config.json",
                "layer.tar",
            ]),
            "tar image",
        );
        run(
            Command::new("/usr/bin/ctr")
                .arg("--address")
                .arg(&self.socket)
                .args(["-n", "k8s.io", "images", "import"])
                .arg(d.join("image.tar")),
            "ctr images import",
        );
    }

    pub fn client(&self) -> CriClient {
        self.client.clone().expect("connected")
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// RunPodSandbox in namespace "nrc".
    pub fn run_pod(&self, name: &str) -> Sandbox {
        let config = self.pod_config(name);
        let mut rpc = self.client().rpc();
        let response = self
            .block_on(
                rpc.run_pod_sandbox(api::RunPodSandboxRequest { config: Some(config), runtime_handler: String::new() }),
            )
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}; containerd log:\n{}", self.log()));
        Sandbox { id: response.into_inner().pod_sandbox_id, name: name.to_owned(), namespace: "nrc".to_owned() }
    }

    fn pod_config(&self, name: &str) -> api::PodSandboxConfig {
        let logs = self.dir.path().join("logs").join(name);
        std::fs::create_dir_all(&logs).expect("log dir");
        api::PodSandboxConfig {
            metadata: Some(api::PodSandboxMetadata {
                name: name.to_owned(),
                uid: format!("uid-{name}"),
                namespace: "nrc".to_owned(),
                attempt: 0,
            }),
            hostname: name.to_owned(),
            log_directory: logs.display().to_string(),
            linux: Some(api::LinuxPodSandboxConfig::default()),
            ..Default::default()
        }
    }

    pub fn stop_pod(&self, id: &str) -> Result<(), tonic::Status> {
        let mut rpc = self.client().rpc();
        self.block_on(rpc.stop_pod_sandbox(api::StopPodSandboxRequest { pod_sandbox_id: id.to_owned() })).map(|_| ())
    }

    pub fn remove_pod(&self, id: &str) -> Result<(), tonic::Status> {
        let mut rpc = self.client().rpc();
        self.block_on(rpc.remove_pod_sandbox(api::RemovePodSandboxRequest { pod_sandbox_id: id.to_owned() }))
            .map(|_| ())
    }

    /// The verbose status `info` map (what netreap parses).
    pub fn status_info(&self, id: &str) -> std::collections::HashMap<String, String> {
        self.block_on(self.client().sandbox_status(id)).expect("PodSandboxStatus").info
    }

    pub fn state(&self, id: &str) -> i32 {
        self.block_on(self.client().sandbox_status(id)).expect("PodSandboxStatus").status.expect("status").state
    }

    /// From now on the last plugin's DEL fails with `message` (None: succeeds).
    pub fn fail_del_with(&self, message: Option<&str>) {
        let flag = self.dir.path().join("del-error");
        match message {
            Some(m) => std::fs::write(flag, m).expect("del-error flag"),
            None => {
                let _ = std::fs::remove_file(flag);
            }
        }
    }

    /// Reservation files of the network: (ip, container id).
    pub fn reservations(&self) -> Vec<(String, String)> {
        let Ok(entries) = std::fs::read_dir(self.data_dir.join(&self.network)) else { return Vec::new() };
        let mut out: Vec<(String, String)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.parse::<std::net::IpAddr>().ok()?;
                let content = std::fs::read_to_string(e.path()).ok()?;
                Some((name, content.lines().next().unwrap_or_default().trim().to_owned()))
            })
            .collect();
        out.sort();
        out
    }

    pub fn reserved_by(&self, id: &str) -> bool {
        self.reservations().iter().any(|(_, c)| c == id)
    }

    /// Flags for netreap: this containerd's socket and the IPAM directories.
    pub fn netreap_args(&self) -> Vec<std::ffi::OsString> {
        vec![
            "--cri-socket".into(),
            self.socket.clone().into(),
            "--host-local-dir".into(),
            self.data_dir.clone().into(),
            "--cni-cache-dir".into(),
            self.cache_dir.clone().into(),
            "--state-dir".into(),
            self.state_dir.clone().into(),
            // containerd runs the plugins from its own bin dir: only runs of
            // binaries in a CNI bin dir count.
            "--cni-bin-dir".into(),
            self.dir.path().join("cni-bin").into(),
            "--cni-bin-dir".into(),
            "/usr/lib/cni".into(),
        ]
    }

    /// SIGKILL containerd and remove its socket (the shims and pods live on).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
        self.client = None;
    }

    /// Processes started for this containerd (shims) by pid: those whose
    /// command line names this tempdir.
    fn our_processes(&self) -> Vec<i32> {
        let needle = self.dir.path().to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
        entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle.as_str()))
            })
            .collect()
    }

    fn teardown(&mut self) {
        if self.child.is_none() {
            self.spawn();
        }
        self.fail_del_with(None);
        if let Ok(list) = self.block_on(self.client().list_sandboxes()) {
            for s in list {
                let _ = self.stop_pod(&s.id);
                let _ = self.remove_pod(&s.id);
            }
        }
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            if wait_until(Duration::from_secs(10), || c.try_wait().ok().flatten().is_some()).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for pid in self.our_processes() {
            // SAFETY: a shim this harness's containerd started (named by our tempdir).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // Mounts left under the tempdir (rootfs, netns), deepest first.
        let prefix = self.dir.path().to_string_lossy().into_owned();
        let mut mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4).map(str::to_owned))
            .filter(|m| m.starts_with(&prefix))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = Command::new("umount").args(["-l", &m]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).status();
        // The CRI's parent cgroups (empty once its pods are gone; rmdir of a
        // cgroup still in use by anyone fails, which is what we want).
        if let Ok(controllers) = std::fs::read_dir("/sys/fs/cgroup") {
            for c in controllers.filter_map(Result::ok) {
                let _ = std::fs::remove_dir(c.path().join("k8s.io"));
            }
        }
        let _ = std::fs::remove_dir("/sys/fs/cgroup/k8s.io");
        // libcni's cache of this network in the host's /var/lib/cni.
        if let Ok(entries) = std::fs::read_dir("/var/lib/cni/results") {
            for e in entries.filter_map(Result::ok) {
                if e.file_name().to_string_lossy().starts_with(&format!("{}-", self.network)) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.teardown();
    }
}
