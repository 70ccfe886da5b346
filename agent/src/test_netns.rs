//! Test-only helpers for unit tests that make real network namespaces.

use std::{path::PathBuf, process::Command};

/// Runs `ip` (iproute2) and asserts it succeeded.
pub(crate) fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("runs ip (iproute2)");
    assert!(status.success(), "ip {args:?}: {status}");
}

/// A named netns (`ip netns add`), deleted on drop, so also when a test
/// fails. Its name is `{prefix}{pid}-{tag}`: each suite's own prefix.
pub(crate) struct TestNetns(pub(crate) String);

impl TestNetns {
    pub(crate) fn new(prefix: &str, tag: &str) -> Self {
        let name = format!("{prefix}{}-{tag}", std::process::id());
        ip(&["netns", "add", &name]);
        Self(name)
    }

    /// Where `ip netns` bind-mounts it.
    pub(crate) fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.0))
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}
