//! A CNI lab on this host: a bridge the test creates, host-local data and
//! cache dirs in a tempdir, the real Debian plugins plus a few test plugins
//! (failing, slow), and pods (named network namespaces) attached the way a
//! runtime does. Everything is removed on drop, even when a test fails.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use netreap::cnirt::{Attachment, CniError, Network, Runtime};
use serde_json::{Value, json};

use super::unique;

pub const DEBIAN_PLUGINS: &str = "/usr/lib/cni";

/// CNI plugin binaries from Debian's containernetworking-plugins.
pub fn cni_plugins_present() -> bool {
    let ok = ["bridge", "host-local"].iter().all(|p| Path::new(DEBIAN_PLUGINS).join(p).is_file());
    ok || super::skip("Debian's containernetworking-plugins are not installed (cargo xtask test installs them)")
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).status().is_ok_and(|s| s.success())
}

/// Test plugins, as shell scripts.
const FAILING_PLUGIN: &str = r#"#!/bin/sh
# Fails ADD and DEL, like the chained plugin of containerd #12130.
cat >/dev/null
echo '{"cniVersion":"1.0.0","code":999,"msg":"injected failure"}'
exit 1
"#;

/// An IPAM wrapper: host-local does the work, then the plugin sleeps for the
/// seconds written in $LAB/slow-ipam-seconds (IPAM done, address not yet
/// configured: an ADD in flight).
const SLOW_IPAM_PLUGIN: &str = r#"#!/bin/sh
in=$(cat)
out=$(printf '%s' "$in" | /usr/lib/cni/host-local)
rc=$?
if [ "$CNI_COMMAND" = ADD ]; then sleep "$(cat "$(dirname "$0")/../slow-ipam-seconds" 2>/dev/null || echo 0)"; fi
printf '%s' "$out"
exit $rc
"#;

/// A chained plugin that passes prevResult through after sleeping for the
/// seconds in $LAB/slow-chain-seconds (address configured, cache not written).
const SLOW_CHAIN_PLUGIN: &str = r#"#!/bin/sh
in=$(cat)
if [ "$CNI_COMMAND" = ADD ]; then
  sleep "$(cat "$(dirname "$0")/../slow-chain-seconds" 2>/dev/null || echo 0)"
  printf '%s' "$in" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("prevResult", {})))'
fi
exit 0
"#;

pub struct Lab {
    pub dir: tempfile::TempDir,
    pub bridge: String,
    pub subnet: String,
    pub runtime: Runtime,
    pub data_dir: PathBuf,
    pub cache_dir: PathBuf,
    pub state_dir: PathBuf,
}

impl Lab {
    /// A lab whose bridge network uses `subnet` (e.g. "10.251.3.0/29").
    pub fn new(subnet: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let bridge = unique("nrbr");
        assert!(ip(&["link", "add", &bridge, "type", "bridge"]), "create bridge {bridge}");
        assert!(ip(&["link", "set", &bridge, "up"]), "bridge up");
        let plugins = dir.path().join("plugins");
        std::fs::create_dir_all(&plugins).expect("plugins dir");
        for (name, body) in
            [("failing", FAILING_PLUGIN), ("slow-ipam", SLOW_IPAM_PLUGIN), ("slow-chain", SLOW_CHAIN_PLUGIN)]
        {
            let path = plugins.join(name);
            std::fs::write(&path, body).expect("write plugin");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        let data_dir = dir.path().join("networks");
        let cache_dir = dir.path().join("cache");
        let state_dir = dir.path().join("state");
        for d in [&data_dir, &cache_dir, &state_dir] {
            std::fs::create_dir_all(d).expect("lab dir");
        }
        let runtime =
            Runtime { plugin_dirs: vec![plugins, PathBuf::from(DEBIAN_PLUGINS)], cache_dir: Some(cache_dir.clone()) };
        Self { dir, bridge, subnet: subnet.to_owned(), runtime, data_dir, cache_dir, state_dir }
    }

    /// The bridge plugin's config with `ipam_type` (host-local or slow-ipam).
    pub fn bridge_conf(&self, ipam_type: &str) -> Value {
        json!({
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": false,
            "ipMasq": false,
            "ipam": {
                "type": ipam_type,
                "dataDir": self.data_dir,
                "ranges": [[{ "subnet": self.subnet }]]
            }
        })
    }

    /// A network named `name` with `plugins` after the bridge.
    pub fn network(&self, name: &str, ipam_type: &str, chained: &[&str]) -> Network {
        let mut plugins = vec![self.bridge_conf(ipam_type)];
        plugins.extend(chained.iter().map(|t| json!({ "type": t })));
        Network { name: name.to_owned(), plugins }
    }

    pub fn set_delay(&self, which: &str, seconds: u32) {
        std::fs::write(self.dir.path().join(format!("{which}-seconds")), seconds.to_string()).expect("delay file");
    }

    /// Reservation files of a network: (ip, container id).
    pub fn reservations(&self, network: &str) -> Vec<(String, String)> {
        let Ok(entries) = std::fs::read_dir(self.data_dir.join(network)) else { return Vec::new() };
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

    /// The flags that point netreap at this lab's directories.
    pub fn netreap_dir_args(&self) -> Vec<std::ffi::OsString> {
        vec![
            "--host-local-dir".into(),
            self.data_dir.clone().into(),
            "--cni-cache-dir".into(),
            self.cache_dir.join("results").into(),
            "--state-dir".into(),
            self.state_dir.clone().into(),
            // Only runs of binaries in these dirs count as CNI runs.
            "--cni-bin-dir".into(),
            self.plugin_dir().into(),
            "--cni-bin-dir".into(),
            DEBIAN_PLUGINS.into(),
        ]
    }

    /// The lab's own test plugins (failing, slow-ipam, slow-chain).
    pub fn plugin_dir(&self) -> PathBuf {
        self.dir.path().join("plugins")
    }

    pub fn pod(&self) -> Pod {
        let name = unique("nrpod");
        assert!(ip(&["netns", "add", &name]), "create netns {name}");
        Pod {
            container_id: format!("{}{}", unique("ctr"), "0".repeat(40)),
            path: PathBuf::from(format!("/var/run/netns/{name}")),
            name,
            deleted: false,
        }
    }

    pub fn add(&self, net: &Network, pod: &Pod) -> Result<Value, CniError> {
        self.runtime.add(net, &pod.attachment())
    }

    pub fn del(&self, net: &Network, pod: &Pod) -> Result<(), CniError> {
        self.runtime.del(net, &pod.attachment())
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).status();
    }
}

/// A pod sandbox: a named netns and a container ID.
pub struct Pod {
    pub name: String,
    pub path: PathBuf,
    pub container_id: String,
    deleted: bool,
}

impl Pod {
    pub fn attachment(&self) -> Attachment<'_> {
        Attachment { container_id: &self.container_id, netns: &self.path, ifname: "eth0" }
    }

    /// The netns was removed by other means.
    pub fn mark_deleted(&mut self) {
        self.deleted = true;
    }

    /// Destroys the netns (no CNI DEL): what a runtime does after a failed teardown.
    pub fn delete_netns(&mut self) {
        assert!(ip(&["netns", "del", &self.name]), "delete netns {}", self.name);
        self.deleted = true;
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
        }
    }
}
