//! A minimal CNI runtime, the way containerd/libcni drives plugins: ADD runs
//! a network's plugins in order, each given the previous result
//! (`prevResult`), and writes the libcni result cache only when the whole
//! chain succeeded; DEL runs them in reverse. Used by the demo and the
//! end-to-end tests to drive the real plugins from Debian.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::{Value, json};

/// CNI spec version the Debian plugins (v1.1.1) speak.
pub const CNI_VERSION: &str = "1.0.0";

#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("plugin {plugin} not found in {dirs:?}")]
    NotFound { plugin: String, dirs: Vec<PathBuf> },
    #[error("{command} {plugin}: exit {code:?}: {message}")]
    Plugin { command: String, plugin: String, code: Option<i32>, message: String },
    #[error("running {plugin}: {source}")]
    Spawn { plugin: String, source: std::io::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("network config: {0}")]
    Config(String),
}

/// A network: a name and its chain of plugin configs (a conflist).
#[derive(Debug, Clone)]
pub struct Network {
    pub name: String,
    pub plugins: Vec<Value>,
}

impl Network {
    /// From conflist JSON: `{"name":..., "plugins":[...]}`.
    pub fn from_conflist(conflist: &Value) -> Result<Self, CniError> {
        let name = conflist["name"].as_str().ok_or_else(|| CniError::Config("no name".into()))?.to_owned();
        let plugins = conflist["plugins"].as_array().ok_or_else(|| CniError::Config("no plugins".into()))?.clone();
        if plugins.iter().any(|p| p["type"].as_str().is_none()) {
            return Err(CniError::Config("every plugin needs a type".into()));
        }
        Ok(Self { name, plugins })
    }

    #[must_use]
    pub fn conflist(&self) -> Value {
        json!({ "cniVersion": CNI_VERSION, "name": self.name, "plugins": self.plugins })
    }
}

/// One attachment's identity, as a runtime passes it to plugins.
#[derive(Debug, Clone)]
pub struct Attachment<'a> {
    pub container_id: &'a str,
    pub netns: &'a Path,
    pub ifname: &'a str,
}

/// Where plugins are and where the result cache goes.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub plugin_dirs: Vec<PathBuf>,
    /// libcni's cache dir (`<dir>/results/<network>-<container>-<ifname>`);
    /// None writes no cache.
    pub cache_dir: Option<PathBuf>,
}

impl Runtime {
    fn find(&self, plugin: &str) -> Result<PathBuf, CniError> {
        self.plugin_dirs
            .iter()
            .map(|d| d.join(plugin))
            .find(|p| p.is_file())
            .ok_or_else(|| CniError::NotFound { plugin: plugin.to_owned(), dirs: self.plugin_dirs.clone() })
    }

    fn invoke(
        &self,
        command: &str,
        net: &Network,
        plugin_conf: &Value,
        at: &Attachment<'_>,
        prev_result: Option<&Value>,
    ) -> Result<Value, CniError> {
        let plugin = plugin_conf["type"].as_str().unwrap_or_default().to_owned();
        let binary = self.find(&plugin)?;
        let mut conf = plugin_conf.clone();
        conf["name"] = json!(net.name);
        conf["cniVersion"] = json!(CNI_VERSION);
        if let Some(prev) = prev_result {
            conf["prevResult"] = prev.clone();
        }
        let cni_path = std::env::join_paths(&self.plugin_dirs).unwrap_or_default();
        let mut child = Command::new(&binary)
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", at.container_id)
            .env("CNI_NETNS", at.netns)
            .env("CNI_IFNAME", at.ifname)
            .env("CNI_PATH", cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| CniError::Spawn { plugin: plugin.clone(), source })?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(conf.to_string().as_bytes());
        }
        let out = child.wait_with_output().map_err(|source| CniError::Spawn { plugin: plugin.clone(), source })?;
        let stdout: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if !out.status.success() {
            let message = stdout["msg"]
                .as_str()
                .map_or_else(|| String::from_utf8_lossy(&out.stderr).trim().to_owned(), str::to_owned);
            return Err(CniError::Plugin { command: command.to_owned(), plugin, code: out.status.code(), message });
        }
        Ok(stdout)
    }

    /// ADD: every plugin in order; the cache is written only when all succeeded.
    pub fn add(&self, net: &Network, at: &Attachment<'_>) -> Result<Value, CniError> {
        let mut result: Option<Value> = None;
        for plugin in &net.plugins {
            let out = self.invoke("ADD", net, plugin, at, result.as_ref())?;
            if !out.is_null() {
                result = Some(out);
            }
        }
        let result = result.unwrap_or(Value::Null);
        self.write_cache(net, at, &result)?;
        Ok(result)
    }

    /// DEL: every plugin in reverse order, with the cached result as
    /// prevResult when there is one. Like libcni, the first error stops the
    /// chain: the plugins before it never hear the DEL (so IPAM keeps the IP).
    pub fn del(&self, net: &Network, at: &Attachment<'_>) -> Result<(), CniError> {
        let cached = self.read_cache(net, at);
        for plugin in net.plugins.iter().rev() {
            self.invoke("DEL", net, plugin, at, cached.as_ref())?;
        }
        if let Some(path) = self.cache_path(net, at) {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }

    #[must_use]
    pub fn cache_path(&self, net: &Network, at: &Attachment<'_>) -> Option<PathBuf> {
        self.cache_dir
            .as_ref()
            .map(|d| d.join("results").join(format!("{}-{}-{}", net.name, at.container_id, at.ifname)))
    }

    fn read_cache(&self, net: &Network, at: &Attachment<'_>) -> Option<Value> {
        let bytes = std::fs::read(self.cache_path(net, at)?).ok()?;
        let cached: Value = serde_json::from_slice(&bytes).ok()?;
        Some(cached["result"].clone()).filter(|r| !r.is_null())
    }

    fn write_cache(&self, net: &Network, at: &Attachment<'_>, result: &Value) -> Result<(), CniError> {
        let Some(path) = self.cache_path(net, at) else { return Ok(()) };
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        std::fs::create_dir_all(&dir).map_err(|source| CniError::Io { path: dir.clone(), source })?;
        // The fields of libcni's cachedInfo (kind cniCacheV1).
        let config = base64_encode(net.conflist().to_string().as_bytes());
        let entry = json!({
            "kind": "cniCacheV1",
            "containerId": at.container_id,
            "config": config,
            "ifName": at.ifname,
            "networkName": net.name,
            "netns": at.netns,
            "result": result,
        });
        std::fs::write(&path, entry.to_string()).map_err(|source| CniError::Io { path, source })
    }
}

/// Standard base64 (libcni stores `config` as Go's []byte JSON encoding).
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_vectors() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn conflist_needs_name_and_typed_plugins() {
        assert!(Network::from_conflist(&json!({"plugins": []})).is_err());
        assert!(Network::from_conflist(&json!({"name": "n", "plugins": [{}]})).is_err());
        let n = Network::from_conflist(&json!({"name": "n", "plugins": [{"type": "bridge"}]})).unwrap();
        assert_eq!(n.conflist()["plugins"][0]["type"], "bridge");
    }
}
