//! Which exec records are CNI plugin runs. The kernel reports any process
//! whose environment carries `CNI_COMMAND`; only an exec of a binary inside
//! a configured CNI bin dir, by root, is believed. Anything else could pin
//! reservations forever (a forged ADD) or point a victim's binding at a
//! netns about to die (a forged CNI_NETNS), so it is an anomaly: counted and
//! reported, and it changes nothing in the ledger.

use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use super::events::{CniExec, KernelEvent};

/// Why an exec record is not believed as a CNI run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum CniRunAnomaly {
    #[error("{binary} is not inside a CNI bin dir")]
    OutsideBinDirs { binary: String },
    /// `..` or `.` components, or a relative path: it cannot be placed
    /// without the caller's cwd and mount table, so it is not believed.
    #[error("{binary} is not a plain absolute path")]
    UncheckablePath { binary: String },
    #[error("the binary path was longer than the kernel's buffer")]
    PathTruncated { binary: String },
    #[error("{binary} ran as uid {uid}, not root")]
    NotRoot { binary: String, uid: u32 },
}

impl CniRunAnomaly {
    /// Metric label.
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::OutsideBinDirs { .. } => "outside_bin_dirs",
            Self::UncheckablePath { .. } => "uncheckable_path",
            Self::PathTruncated { .. } => "path_truncated",
            Self::NotRoot { .. } => "not_root",
        }
    }

    #[must_use]
    pub fn binary(&self) -> &str {
        match self {
            Self::OutsideBinDirs { binary }
            | Self::UncheckablePath { binary }
            | Self::PathTruncated { binary }
            | Self::NotRoot { binary, .. } => binary,
        }
    }
}

/// The configured CNI bin dirs, compared by path components (no file
/// system access: in a container the paths are the host's).
#[derive(Debug, Clone)]
pub struct CniRunFilter {
    bin_dirs: Vec<PathBuf>,
}

impl CniRunFilter {
    #[must_use]
    pub fn new(bin_dirs: &[PathBuf]) -> Self {
        Self { bin_dirs: bin_dirs.iter().map(|d| d.components().collect()).collect() }
    }

    /// Ok for every event that is not a CNI exec, and for a CNI exec of a
    /// binary in a bin dir by root; the anomaly otherwise. Call it before
    /// the ledger sees the event, and give the ledger only what it admits.
    pub fn admit(&self, event: &KernelEvent) -> Result<(), CniRunAnomaly> {
        match event {
            KernelEvent::CniExec { exec, .. } => self.admit_exec(exec),
            _ => Ok(()),
        }
    }

    fn admit_exec(&self, exec: &CniExec) -> Result<(), CniRunAnomaly> {
        let binary = exec.binary.value.clone();
        if exec.binary.truncated {
            return Err(CniRunAnomaly::PathTruncated { binary });
        }
        let path = Path::new(&binary);
        let plain = path.is_absolute()
            && path.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
            // Path::components hides "a/./b" and "a//b": compare the text too.
            && !binary.contains("/./")
            && !binary.ends_with("/.");
        if !plain {
            return Err(CniRunAnomaly::UncheckablePath { binary });
        }
        // The binary itself must be below the dir, not the dir.
        if !self.bin_dirs.iter().any(|dir| path.starts_with(dir) && path != dir) {
            return Err(CniRunAnomaly::OutsideBinDirs { binary });
        }
        if exec.uid != 0 {
            return Err(CniRunAnomaly::NotRoot { binary, uid: exec.uid });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::events::{CniValue, EnvScanVariant, Task};

    fn exec(binary: &str, uid: u32) -> KernelEvent {
        let v = |s: &str| CniValue { value: s.into(), truncated: false };
        KernelEvent::CniExec {
            task: Task { ktime_ns: 1, pid: 5, tgid: 5, comm: "x".into(), cgroup_id: 1 },
            exec: CniExec {
                binary: v(binary),
                command: v("DEL"),
                container_id: Some(v("c1")),
                netns: None,
                ifname: None,
                cni_args: None,
                env_scan_limited: false,
                env_scanned: 4,
                uid,
                scan_variant: EnvScanVariant::BpfLoop,
                nested_in: None,
            },
        }
    }

    fn filter() -> CniRunFilter {
        CniRunFilter::new(&["/opt/cni/bin", "/usr/lib/cni"].map(PathBuf::from))
    }

    #[test]
    fn root_runs_of_binaries_in_the_bin_dirs_are_admitted() {
        assert_eq!(filter().admit(&exec("/opt/cni/bin/bridge", 0)), Ok(()));
        assert_eq!(filter().admit(&exec("/usr/lib/cni/host-local", 0)), Ok(()));
        assert_eq!(filter().admit(&exec("/opt/cni/bin/sub/dir/plugin", 0)), Ok(()));
    }

    #[test]
    fn everything_else_is_an_anomaly_with_its_reason() {
        let f = filter();
        let reason = |b: &str, uid| f.admit(&exec(b, uid)).map_err(|e| e.reason());
        assert_eq!(reason("/bin/sh", 0), Err("outside_bin_dirs"));
        assert_eq!(reason("/tmp/usr/lib/cni/bridge", 0), Err("outside_bin_dirs"));
        assert_eq!(reason("/opt/cni/binx/bridge", 0), Err("outside_bin_dirs"), "a sibling with the same prefix");
        assert_eq!(reason("/opt/cni/bin", 0), Err("outside_bin_dirs"), "the dir itself");
        assert_eq!(reason("/opt/cni/bin/../../../tmp/evil", 0), Err("uncheckable_path"));
        assert_eq!(reason("/opt/cni/bin/./bridge", 0), Err("uncheckable_path"));
        assert_eq!(reason("bridge", 0), Err("uncheckable_path"));
        assert_eq!(reason("./opt/cni/bin/bridge", 0), Err("uncheckable_path"));
        assert_eq!(reason("/opt/cni/bin/bridge", 1000), Err("not_root"));
        let KernelEvent::CniExec { task, mut exec } = exec("/opt/cni/bin/bridge", 0) else { unreachable!() };
        exec.binary.truncated = true;
        assert_eq!(f.admit(&KernelEvent::CniExec { task, exec }).map_err(|e| e.reason()), Err("path_truncated"));
    }

    #[test]
    fn other_events_pass() {
        let exit = KernelEvent::CniExit {
            task: Task { ktime_ns: 1, pid: 5, tgid: 5, comm: "x".into(), cgroup_id: 1 },
            exit: crate::kernel::events::CniExit::from_wait_status(0),
        };
        assert_eq!(filter().admit(&exit), Ok(()));
    }
}
