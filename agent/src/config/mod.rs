//! The agent's configuration: every key, its default and its meaning, in
//! one place.
//!
//! Layers, lowest first: the defaults below, a TOML file (`--config FILE`),
//! then environment variables and flags (a flag beats its variable). Unknown
//! keys and bad values are refused at start with a message naming the key.
//! `netreap config --print-default` prints the defaults as a commented file.

use std::{
    fmt::Write as _,
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// Smallest accepted `events_max_bytes`: a few lines must fit in a file.
pub const MIN_EVENTS_MAX_BYTES: u64 = 4096;
/// Largest accepted `events_keep`: each rotation renames every kept file.
pub const MAX_EVENTS_KEEP: u32 = 100;
/// Smallest accepted `resync_interval`: a full re-read is not free.
pub const MIN_RESYNC_INTERVAL: Duration = Duration::from_secs(1);

/// Largest accepted `release_lock_timeout`: releases of every network wait
/// behind the one being tried.
pub const MAX_RELEASE_LOCK_TIMEOUT: Duration = Duration::from_mins(1);

const MIB: u64 = 1024 * 1024;

/// The typed configuration. `Config::default()` is the documented default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// host-local IPAM data directories (`dataDir`); each holds one
    /// directory per network with one file per reserved IP.
    pub host_local_dirs: Vec<PathBuf>,
    /// libcni's cached results directory (files
    /// `<network>-<containerID>-<ifname>`, written after a successful ADD).
    pub cni_cache_dir: PathBuf,
    /// Directories of CNI plugin binaries. Only an exec of a binary inside
    /// one of them, run as root, counts as a CNI run; any other process
    /// carrying CNI_COMMAND is a reported anomaly that changes nothing.
    pub cni_bin_dirs: Vec<PathBuf>,
    /// netreap's own state: the journal of release intents.
    pub state_dir: PathBuf,
    /// Rotate the journal past this size (the open intents are carried).
    #[serde(with = "byte_size")]
    pub journal_max_bytes: u64,
    /// Longest wait for a host-local network's lock before a release gives
    /// up (and retries later, with back-off).
    #[serde(with = "human_duration")]
    pub release_lock_timeout: Duration,
    /// Decide and report, but release nothing.
    pub dry_run: bool,
    /// Event stream destination: `-` for stdout, or a file path.
    pub events: String,
    /// Rotate the event file before it would exceed this size.
    #[serde(with = "byte_size")]
    pub events_max_bytes: u64,
    /// Rotated event files kept (`<events>.1` .. `<events>.N`); 0 keeps none.
    pub events_keep: u32,
    /// Address of the HTTP server (/metrics, /healthz, /readyz, /state).
    pub metrics_addr: SocketAddr,
    /// Serve /metrics to clients beyond loopback.
    pub expose_metrics: bool,
    /// Serve /state (every pod IP and container of the node) to clients
    /// beyond loopback.
    pub expose_state: bool,
    /// This node's Kubernetes name; enables the optional API evidence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// kubeconfig file(s) for the Kubernetes API on a plain host; in a pod
    /// the service account is used without it. Neither: the source is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<PathBuf>,
    /// A reservation younger than this is in use whatever else is seen: the
    /// CNI ADD that made it may still be running.
    #[serde(with = "human_duration")]
    pub in_flight_grace: Duration,
    /// A reservation never seen bound to a netns is orphaned only when older
    /// than this (and its IP is in no live netns).
    #[serde(with = "human_duration")]
    pub orphan_grace: Duration,
    /// Full re-read of every source of evidence, to catch anything missed.
    #[serde(with = "human_duration")]
    pub resync_interval: Duration,
    /// Log filter (tracing `EnvFilter` syntax, e.g. `info,netreap=debug`).
    pub log: String,
    /// The mount table where netns bind mounts are discovered. In a
    /// container with hostPID, the host's is `/proc/1/mountinfo`.
    pub mountinfo: PathBuf,
    /// The container runtime's CRI socket (optional evidence). Unset: the
    /// first of /run/containerd/containerd.sock, /var/run/crio/crio.sock
    /// that exists; "none": do not ask the runtime.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cri_socket: Option<PathBuf>,
    /// Which eBPF probes load (`[probes]`).
    pub probes: ProbesConfig,
}

/// The `[probes]` table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProbesConfig {
    /// Load the syscall tracepoints (unshare, clone, clone3, setns), which
    /// name the task that made or entered a netns. Off: creation is seen by
    /// task_newtask and netlink; death and the CNI ledger do not need them.
    /// They put every task of the node on the kernel's syscall-tracing slow
    /// path (see the README's benchmarks).
    pub attribution: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            host_local_dirs: vec![PathBuf::from("/var/lib/cni/networks")],
            cni_cache_dir: PathBuf::from("/var/lib/cni/results"),
            cni_bin_dirs: ["/opt/cni/bin", "/usr/lib/cni", "/usr/libexec/cni"].map(PathBuf::from).to_vec(),
            state_dir: PathBuf::from("/var/lib/netreap"),
            journal_max_bytes: 16 * MIB,
            release_lock_timeout: Duration::from_secs(5),
            dry_run: false,
            events: "-".to_owned(),
            events_max_bytes: 64 * MIB,
            events_keep: 5,
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9742)),
            expose_metrics: false,
            expose_state: false,
            node_name: None,
            kubeconfig: None,
            in_flight_grace: Duration::from_secs(30),
            orphan_grace: Duration::from_mins(10),
            resync_interval: Duration::from_secs(30),
            log: "info".to_owned(),
            mountinfo: PathBuf::from("/proc/self/mountinfo"),
            cri_socket: None,
            probes: ProbesConfig::default(),
        }
    }
}

/// Each key with the comment `--print-default` writes above it, and the
/// environment variable and flag that override it. Kept in field order; a
/// test checks it names every field.
const KEYS: &[(&str, &str, &str)] = &[
    (
        "host_local_dirs",
        "host-local IPAM data directories (the plugin's dataDir); each holds one\n\
         directory per network with one file per reserved IP.",
        "NETREAP_HOST_LOCAL_DIRS (comma-separated), --host-local-dir (repeatable)",
    ),
    (
        "cni_cache_dir",
        "libcni's cached results (files <network>-<containerID>-<ifname>, written\n\
         only after a whole chain's ADD succeeded).",
        "NETREAP_CNI_CACHE_DIR, --cni-cache-dir",
    ),
    (
        "cni_bin_dirs",
        "Directories of CNI plugin binaries (the runtime's CNI bin dirs). Only an\n\
         exec of a binary inside one of them, by root, counts as a CNI run; any\n\
         other process carrying CNI_COMMAND is a reported anomaly (metric\n\
         cni_exec_anomalies, event cni_exec_anomaly) that changes no verdict.",
        "NETREAP_CNI_BIN_DIRS (comma-separated), --cni-bin-dir (repeatable)",
    ),
    ("state_dir", "netreap's own state: the journal of release intents.", "NETREAP_STATE_DIR, --state-dir"),
    (
        "journal_max_bytes",
        "Rotate the journal (<state_dir>/journal.jsonl) past this size, at start and\n\
         while running; open intents are carried over, the old file is kept as\n\
         journal.jsonl.1. The state dir holds at most about twice this.",
        "NETREAP_JOURNAL_MAX_BYTES, --journal-max-bytes",
    ),
    (
        "release_lock_timeout",
        "Longest wait for a host-local network's lock (held by the plugin while it\n\
         allocates). Past it the release is reported as lock_busy, naming the holder,\n\
         and retried with back-off; other networks' releases go on meanwhile.",
        "NETREAP_RELEASE_LOCK_TIMEOUT, --release-lock-timeout",
    ),
    ("dry_run", "Decide and report (events, metrics), but release nothing.", "NETREAP_DRY_RUN, --dry-run[=BOOL]"),
    (
        "events",
        "Where the JSON event stream goes: \"-\" for stdout, or a file (appended to,\n\
         rotated by size). Schema: docs/events.md.",
        "NETREAP_EVENTS, --events",
    ),
    (
        "events_max_bytes",
        "Rotate the event file before it would exceed this size: bytes, or a string\n\
         with a unit (\"512KiB\", \"64MiB\", \"1GiB\"). Not applied to stdout.",
        "NETREAP_EVENTS_MAX_BYTES, --events-max-bytes",
    ),
    (
        "events_keep",
        "Rotated event files kept (<events>.1 newest .. <events>.N oldest); 0 keeps\n\
         none (the file starts over).",
        "NETREAP_EVENTS_KEEP, --events-keep",
    ),
    (
        "metrics_addr",
        "Listen address of /metrics, /healthz, /readyz and /state. Loopback by\n\
         default; \"0.0.0.0:9742\" lets kubelet probe /healthz and /readyz on the\n\
         node's address (hostNetwork). /metrics and /state still answer loopback\n\
         clients only unless expose_metrics / expose_state say otherwise.",
        "NETREAP_METRICS_ADDR, --metrics-addr",
    ),
    (
        "expose_metrics",
        "Serve /metrics to clients beyond loopback (a Prometheus scraping the node).",
        "NETREAP_EXPOSE_METRICS, --expose-metrics[=BOOL]",
    ),
    (
        "expose_state",
        "Serve /state to clients beyond loopback. It lists every pod IP and container\n\
         of the node: leave it off unless something off-node must read it.",
        "NETREAP_EXPOSE_STATE, --expose-state[=BOOL]",
    ),
    (
        "node_name",
        "This node's Kubernetes name: its pods (spec.nodeName) are evidence that can\n\
         only keep an IP (a pod reporting it, a Pending pod a CNI run named).",
        "NODE_NAME, --node-name",
    ),
    (
        "kubeconfig",
        "kubeconfig for the Kubernetes API on a plain host (a KUBECONFIG-style list\n\
         is merged). In a pod the service account is used without it. With neither,\n\
         the Kubernetes source (pods, Events, whereabouts) is off: `netreap sources`.",
        "KUBECONFIG, --kubeconfig",
    ),
    (
        "in_flight_grace",
        "A reservation younger than this is pending: the CNI ADD that made it may\n\
         still be running. Not needed (and not applied) when the probes saw that ADD\n\
         and know whether it is in flight. Durations: \"30s\", \"10m\", \"1h 30m\".",
        "NETREAP_IN_FLIGHT_GRACE, --in-flight-grace",
    ),
    (
        "orphan_grace",
        "A reservation never seen bound to a netns is orphaned only when older than\n\
         this and its IP is in no live netns. Must be >= in_flight_grace.",
        "NETREAP_ORPHAN_GRACE, --orphan-grace",
    ),
    (
        "resync_interval",
        "Full re-read of every source of evidence, to catch anything an event missed.",
        "NETREAP_RESYNC_INTERVAL, --resync-interval",
    ),
    ("log", "Log filter for stderr (tracing EnvFilter syntax, e.g. \"info,netreap=debug\").", "NETREAP_LOG, --log"),
    (
        "mountinfo",
        "The mount table where netns bind mounts (/run/netns/...) are discovered. In a\n\
         container with hostPID, use the host's: \"/proc/1/mountinfo\".",
        "NETREAP_MOUNTINFO, --mountinfo",
    ),
    (
        "cri_socket",
        "The container runtime's CRI socket: its sandbox list is a second witness\n\
         (a reason to keep; with the kernel's word, evidence to release). Unset: the\n\
         first of /run/containerd/containerd.sock, /var/run/crio/crio.sock that exists\n\
         (looked for again until one appears); \"none\": do not ask the runtime.",
        "NETREAP_CRI_SOCKET, --cri-socket",
    ),
    (
        "probes",
        "eBPF probes. attribution: also load the syscall tracepoints (unshare, clone,\n\
         clone3, setns), which name the task that made or entered each netns, at the\n\
         price of every syscall of the node taking the kernel's tracing slow path.\n\
         Off: creation is seen by task_newtask and netlink; death (RTM_DELNSID) and\n\
         the CNI ledger (sched tracepoints) need no syscall probe.",
        "NETREAP_PROBES_ATTRIBUTION, --probes-attribution",
    ),
];

/// Example shown (commented out) for `cri_socket`.
const CRI_SOCKET_EXAMPLE: &str = "cri_socket = \"/run/containerd/containerd.sock\"";

/// Example shown (commented out) for keys whose default is "unset".
const NODE_NAME_EXAMPLE: &str = "node_name = \"worker-1\"";
const KUBECONFIG_EXAMPLE: &str = "kubeconfig = \"/etc/kubernetes/kubelet.conf\"";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("config file {}{}: {message}", .path.display(), location(*.line, .key.as_deref()))]
    Parse { path: PathBuf, key: Option<String>, line: Option<usize>, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
}

fn location(line: Option<usize>, key: Option<&str>) -> String {
    let mut out = String::new();
    if let Some(line) = line {
        let _ = write!(out, ", line {line}");
    }
    if let Some(key) = key {
        let _ = write!(out, ", key `{key}`");
    }
    out
}

impl ConfigError {
    /// The configuration key the error is about, when known.
    #[must_use]
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Read { .. } => None,
            Self::Parse { key, .. } => key.as_deref(),
            Self::Invalid { key, .. } => Some(key),
        }
    }
}

impl Config {
    /// Reads and parses `path` (not validated: flags may still change it).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::from_toml(&text, path)
    }

    /// Parses TOML text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| {
            let (line, key) = e.span().map_or((None, None), |span| key_at(text, span.start));
            ConfigError::Parse { path: origin.to_path_buf(), key, line, message: e.message().trim().to_owned() }
        })
    }

    /// Defaults, then the file named by `--config`, then env and flags; then
    /// [`Config::validate`]. What `netreap run` starts with.
    pub fn load(flags: &ConfigFlags) -> Result<Self, ConfigError> {
        let mut config = match &flags.config {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        flags.apply(&mut config);
        config.validate()?;
        Ok(config)
    }

    /// Checks what types alone cannot; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        for dir in &self.host_local_dirs {
            if !dir.is_absolute() {
                return invalid("host_local_dirs", format!("{} is not an absolute path", dir.display()));
            }
        }
        if self.cni_bin_dirs.is_empty() {
            return invalid("cni_bin_dirs", "empty: no CNI run would be believed; name the CNI bin dirs".to_owned());
        }
        for dir in &self.cni_bin_dirs {
            if !dir.is_absolute() {
                return invalid("cni_bin_dirs", format!("{} is not an absolute path", dir.display()));
            }
        }
        for (key, dir) in [("cni_cache_dir", &self.cni_cache_dir), ("state_dir", &self.state_dir)] {
            if !dir.is_absolute() {
                return invalid(key, format!("{} is not an absolute path", dir.display()));
            }
        }
        if self.journal_max_bytes < crate::release::journal::MIN_ROTATE_BYTES {
            return invalid(
                "journal_max_bytes",
                format!(
                    "{} bytes is below the minimum of {}",
                    self.journal_max_bytes,
                    crate::release::journal::MIN_ROTATE_BYTES
                ),
            );
        }
        if self.release_lock_timeout > MAX_RELEASE_LOCK_TIMEOUT {
            return invalid(
                "release_lock_timeout",
                format!("{} is above the maximum of 1m", humantime::format_duration(self.release_lock_timeout)),
            );
        }
        if self.events.is_empty() {
            return invalid("events", "empty; use \"-\" for stdout or a file path".to_owned());
        }
        if self.events_max_bytes < MIN_EVENTS_MAX_BYTES {
            return invalid(
                "events_max_bytes",
                format!("{} bytes is below the minimum of {MIN_EVENTS_MAX_BYTES}", self.events_max_bytes),
            );
        }
        if self.events_keep > MAX_EVENTS_KEEP {
            return invalid("events_keep", format!("{} is above the maximum of {MAX_EVENTS_KEEP}", self.events_keep));
        }
        if self.node_name.as_deref().is_some_and(str::is_empty) {
            return invalid("node_name", "empty; leave it out instead".to_owned());
        }
        if self.orphan_grace < self.in_flight_grace {
            return invalid(
                "orphan_grace",
                format!(
                    "{} is shorter than in_flight_grace ({})",
                    humantime::format_duration(self.orphan_grace),
                    humantime::format_duration(self.in_flight_grace)
                ),
            );
        }
        if self.resync_interval < MIN_RESYNC_INTERVAL {
            return invalid(
                "resync_interval",
                format!("{} is below the minimum of 1s", humantime::format_duration(self.resync_interval)),
            );
        }
        if let Some(socket) = &self.cri_socket
            && !socket.is_absolute()
            && socket.as_os_str() != crate::runtime::socket::OFF
        {
            return invalid("cri_socket", format!("{} is neither an absolute path nor \"none\"", socket.display()));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&self.log) {
            return invalid("log", format!("{:?}: {e}", self.log));
        }
        Ok(())
    }

    /// This configuration as TOML with a comment above every key: the text
    /// of `netreap config --print-default` when called on the default.
    #[must_use]
    pub fn to_commented_toml(&self) -> String {
        let table = toml::Table::try_from(self).unwrap_or_default();
        let mut out = String::from(
            "# netreap configuration (TOML). Every key is optional; shown with its default.\n\
             # Precedence: flags > environment > this file > defaults.\n\
             # Check a file with `netreap config --check FILE`.\n",
        );
        for (key, doc, overrides) in KEYS {
            out.push('\n');
            for line in doc.lines() {
                let _ = writeln!(out, "# {line}");
            }
            let _ = writeln!(out, "# Overridden by: {overrides}.");
            match table.get(*key) {
                Some(value) => {
                    let _ = writeln!(out, "{key} = {value}");
                }
                None if *key == "node_name" => {
                    let _ = writeln!(out, "# {NODE_NAME_EXAMPLE}");
                }
                None if *key == "kubeconfig" => {
                    let _ = writeln!(out, "# {KUBECONFIG_EXAMPLE}");
                }
                None if *key == "cri_socket" => {
                    let _ = writeln!(out, "# {CRI_SOCKET_EXAMPLE}");
                }
                None => {}
            }
        }
        out
    }
}

/// The line (1-based) holding byte `offset` of `text`, and the key written
/// on it (`key = ...`), so an error names the key even when the parser's own
/// message does not (a bad value).
fn key_at(text: &str, offset: usize) -> (Option<usize>, Option<String>) {
    let offset = offset.min(text.len());
    let Some(before) = text.get(..offset) else { return (None, None) };
    let line_no = before.matches('\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next().unwrap_or("");
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches(|c| c == '"' || c == '\'').to_owned())
        .filter(|k| !k.is_empty() && !k.starts_with('#') && !k.starts_with('['));
    (Some(line_no), key)
}

mod flags;
mod units;

pub use flags::ConfigFlags;
use units::{byte_size, human_duration};
pub use units::{parse_byte_size, parse_duration};

#[cfg(test)]
mod tests;
