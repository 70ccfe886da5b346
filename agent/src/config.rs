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

/// Flags and environment variables that override the file. Flatten into a
/// subcommand's args with `#[command(flatten)]`.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ConfigFlags {
    /// TOML configuration file (`netreap config --print-default` shows every key).
    #[arg(long, env = "NETREAP_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// host-local data directory (repeatable; replaces the file's list).
    #[arg(long = "host-local-dir", env = "NETREAP_HOST_LOCAL_DIRS", value_delimiter = ',', value_name = "DIR")]
    pub host_local_dirs: Vec<PathBuf>,
    /// libcni cached results directory.
    #[arg(long, env = "NETREAP_CNI_CACHE_DIR", value_name = "DIR")]
    pub cni_cache_dir: Option<PathBuf>,
    /// CNI plugin bin directory (repeatable; replaces the file's list).
    #[arg(long = "cni-bin-dir", env = "NETREAP_CNI_BIN_DIRS", value_delimiter = ',', value_name = "DIR")]
    pub cni_bin_dirs: Vec<PathBuf>,
    /// netreap's state directory (journal).
    #[arg(long, env = "NETREAP_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Rotate the journal past this size (bytes, or e.g. `16MiB`).
    #[arg(long, env = "NETREAP_JOURNAL_MAX_BYTES", value_name = "SIZE", value_parser = parse_byte_size)]
    pub journal_max_bytes: Option<u64>,
    /// Longest wait for a host-local network's lock (e.g. `5s`).
    #[arg(long, env = "NETREAP_RELEASE_LOCK_TIMEOUT", value_name = "DURATION", value_parser = parse_duration)]
    pub release_lock_timeout: Option<Duration>,
    /// Decide and report, release nothing (`--dry-run` alone means true).
    #[arg(
        long,
        env = "NETREAP_DRY_RUN",
        num_args = 0..=1,
        default_missing_value = "true",
        value_name = "BOOL",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub dry_run: Option<bool>,
    /// Event stream: `-` for stdout, or a file.
    #[arg(long, env = "NETREAP_EVENTS", value_name = "PATH")]
    pub events: Option<String>,
    /// Rotate the event file at this size (bytes, or e.g. `64MiB`).
    #[arg(long, env = "NETREAP_EVENTS_MAX_BYTES", value_name = "SIZE", value_parser = parse_byte_size)]
    pub events_max_bytes: Option<u64>,
    /// Rotated event files kept.
    #[arg(long, env = "NETREAP_EVENTS_KEEP", value_name = "N")]
    pub events_keep: Option<u32>,
    /// Listen address of /metrics, /healthz, /readyz, /state.
    #[arg(long, env = "NETREAP_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve /metrics beyond loopback (`--expose-metrics` alone means true).
    #[arg(
        long,
        env = "NETREAP_EXPOSE_METRICS",
        num_args = 0..=1,
        default_missing_value = "true",
        value_name = "BOOL",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub expose_metrics: Option<bool>,
    /// Serve /state beyond loopback (`--expose-state` alone means true).
    #[arg(
        long,
        env = "NETREAP_EXPOSE_STATE",
        num_args = 0..=1,
        default_missing_value = "true",
        value_name = "BOOL",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub expose_state: Option<bool>,
    /// This node's Kubernetes name.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// kubeconfig for the Kubernetes API (in a pod: not needed).
    #[arg(long, env = "KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Reservations younger than this are in use (e.g. `30s`).
    #[arg(long, env = "NETREAP_IN_FLIGHT_GRACE", value_name = "DURATION", value_parser = parse_duration)]
    pub in_flight_grace: Option<Duration>,
    /// Never-bound reservations are orphaned only past this age (e.g. `10m`).
    #[arg(long, env = "NETREAP_ORPHAN_GRACE", value_name = "DURATION", value_parser = parse_duration)]
    pub orphan_grace: Option<Duration>,
    /// Full resync period (e.g. `30s`).
    #[arg(long, env = "NETREAP_RESYNC_INTERVAL", value_name = "DURATION", value_parser = parse_duration)]
    pub resync_interval: Option<Duration>,
    /// Log filter (e.g. `info,netreap=debug`).
    #[arg(long, env = "NETREAP_LOG", value_name = "FILTER")]
    pub log: Option<String>,
    /// Mount table for netns discovery (the host's: `/proc/1/mountinfo`).
    #[arg(long, env = "NETREAP_MOUNTINFO", value_name = "FILE")]
    pub mountinfo: Option<PathBuf>,
    /// CRI socket of the container runtime (`none`: do not ask it).
    #[arg(long, env = "NETREAP_CRI_SOCKET", value_name = "PATH")]
    pub cri_socket: Option<PathBuf>,
    /// Also load the syscall tracepoints (`probes.attribution`: `true` or `false`).
    #[arg(
        long,
        env = "NETREAP_PROBES_ATTRIBUTION",
        value_name = "BOOL",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub probes_attribution: Option<bool>,
}

impl ConfigFlags {
    /// Overwrites the keys given by a flag or an environment variable.
    pub fn apply(&self, config: &mut Config) {
        if !self.host_local_dirs.is_empty() {
            config.host_local_dirs.clone_from(&self.host_local_dirs);
        }
        set(&mut config.cni_cache_dir, self.cni_cache_dir.as_ref());
        if !self.cni_bin_dirs.is_empty() {
            config.cni_bin_dirs.clone_from(&self.cni_bin_dirs);
        }
        set(&mut config.state_dir, self.state_dir.as_ref());
        set(&mut config.journal_max_bytes, self.journal_max_bytes.as_ref());
        set(&mut config.release_lock_timeout, self.release_lock_timeout.as_ref());
        set(&mut config.dry_run, self.dry_run.as_ref());
        set(&mut config.events, self.events.as_ref());
        set(&mut config.events_max_bytes, self.events_max_bytes.as_ref());
        set(&mut config.events_keep, self.events_keep.as_ref());
        set(&mut config.metrics_addr, self.metrics_addr.as_ref());
        set(&mut config.expose_metrics, self.expose_metrics.as_ref());
        set(&mut config.expose_state, self.expose_state.as_ref());
        // The downward API sets NODE_NAME to "" when the field is missing:
        // that means "not on Kubernetes", not a node called "".
        if let Some(name) = self.node_name.as_ref().filter(|n| !n.is_empty()) {
            config.node_name = Some(name.clone());
        }
        if let Some(path) = self.kubeconfig.as_ref().filter(|p| !p.as_os_str().is_empty()) {
            config.kubeconfig = Some(path.clone());
        }
        set(&mut config.in_flight_grace, self.in_flight_grace.as_ref());
        set(&mut config.orphan_grace, self.orphan_grace.as_ref());
        set(&mut config.resync_interval, self.resync_interval.as_ref());
        set(&mut config.log, self.log.as_ref());
        set(&mut config.mountinfo, self.mountinfo.as_ref());
        if let Some(socket) = &self.cri_socket {
            config.cri_socket = Some(socket.clone());
        }
        set(&mut config.probes.attribution, self.probes_attribution.as_ref());
    }
}

fn set<T: Clone>(slot: &mut T, value: Option<&T>) {
    if let Some(value) = value {
        slot.clone_from(value);
    }
}

/// Parses `30s`, `10m`, `1h 30m` (humantime).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("invalid duration {text:?}: {e} (examples: \"30s\", \"10m\", \"1h 30m\")"))
}

/// Parses a size: bytes (`4096`), or with a binary unit (`512KiB`, `64MiB`,
/// `1GiB`; `K`, `M`, `G` mean the same).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    let bad = || format!("invalid size {text:?} (examples: 4096, \"512KiB\", \"64MiB\", \"1GiB\")");
    let number: u64 = number.parse().map_err(|_| bad())?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1024,
        "M" | "MiB" => MIB,
        "G" | "GiB" => 1024 * MIB,
        _ => return Err(bad()),
    };
    number.checked_mul(factor).ok_or_else(bad)
}

/// Durations as humantime strings (`"30s"`, `"10m"`).
mod human_duration {
    use std::time::Duration;

    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&humantime::format_duration(*value).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_duration(&text).map_err(D::Error::custom)
    }
}

/// Sizes as an integer of bytes or a string with a unit; written back with
/// the largest unit that divides them exactly.
mod byte_size {
    use std::fmt;

    use serde::{Deserializer, Serializer, de};

    use super::MIB;

    #[expect(clippy::trivially_copy_pass_by_ref, reason = "the signature serde's `with` requires")]
    pub fn serialize<S: Serializer>(value: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        let units = [(1024 * MIB, "GiB"), (MIB, "MiB"), (1024, "KiB")];
        match units.iter().find(|(factor, _)| *value > 0 && value.is_multiple_of(*factor)) {
            Some((factor, unit)) => serializer.serialize_str(&format!("{}{unit}", value / factor)),
            None => serializer.serialize_u64(*value),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_any(Visitor)
    }

    struct Visitor;

    impl de::Visitor<'_> for Visitor {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a size in bytes, or a string such as \"64MiB\"")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom(format!("invalid size {v}: negative")))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            super::parse_byte_size(v).map_err(E::custom)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        flags: ConfigFlags,
    }

    #[test]
    fn printed_default_parses_back_to_the_default_and_is_valid() {
        let text = Config::default().to_commented_toml();
        assert_eq!(parse(&text).expect("valid in this test"), Config::default(), "{text}");
        Config::default().validate().expect("valid in this test");
        assert!(text.contains("\n# Log filter"), "{text}");
        assert!(text.contains("in_flight_grace = \"30s\"\n"), "{text}");
        assert!(text.contains("orphan_grace = \"10m\"\n"), "{text}");
        assert!(text.contains("events_max_bytes = \"64MiB\"\n"), "{text}");
        assert!(text.contains("# node_name = \"worker-1\"\n"), "{text}");
        assert!(text.contains("# kubeconfig = \"/etc/kubernetes/kubelet.conf\"\n"), "{text}");
    }

    #[test]
    fn every_field_is_documented_in_order() {
        let full = Config {
            node_name: Some("n".into()),
            kubeconfig: Some("/etc/k.conf".into()),
            cri_socket: Some("/s.sock".into()),
            ..Config::default()
        };
        let fields: Vec<String> = toml::Table::try_from(&full).expect("valid in this test").keys().cloned().collect();
        let documented: Vec<&str> = KEYS.iter().map(|(k, _, _)| *k).collect();
        let mut sorted = documented.clone();
        sorted.sort_unstable();
        // toml::Table sorts its keys; compare as sets, then check the text.
        assert_eq!(fields, sorted);
        let text = full.to_commented_toml();
        for key in documented {
            assert!(text.contains(&format!("\n{key} = ")), "{key} missing in\n{text}");
        }
    }

    #[test]
    fn an_empty_file_is_the_default() {
        assert_eq!(parse("").expect("valid in this test"), Config::default());
    }

    #[test]
    fn an_unknown_key_is_refused_by_name() {
        let err = parse("dry_run = true\nresync_intervall = \"5s\"\n").expect_err("must be refused");
        let msg = err.to_string();
        assert!(msg.contains("resync_intervall"), "{msg}");
        assert!(msg.contains("unknown field"), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");
        assert!(msg.starts_with("config file test.toml"), "{msg}");
        assert_eq!(err.key(), Some("resync_intervall"));
    }

    #[test]
    fn a_bad_duration_is_refused_by_key() {
        let err = parse("\n\nin_flight_grace = \"3 fortnights\"\n").expect_err("must be refused");
        let msg = err.to_string();
        assert!(msg.contains("key `in_flight_grace`"), "{msg}");
        assert!(msg.contains("invalid duration \"3 fortnights\""), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");
    }

    #[test]
    fn bad_types_and_sizes_are_refused_by_key() {
        for (text, key) in [
            ("dry_run = \"yes\"", "dry_run"),
            ("events_max_bytes = \"64 parsecs\"", "events_max_bytes"),
            ("events_max_bytes = -1", "events_max_bytes"),
            ("metrics_addr = \"localhost\"", "metrics_addr"),
            ("host_local_dirs = \"/one/string\"", "host_local_dirs"),
        ] {
            let err = parse(text).expect_err("must be refused");
            assert_eq!(err.key(), Some(key), "{text}: {err}");
        }
    }

    #[test]
    fn sizes_accept_units() {
        assert_eq!(parse("events_max_bytes = \"512KiB\"").expect("valid in this test").events_max_bytes, 512 * 1024);
        assert_eq!(parse("events_max_bytes = 8192").expect("valid in this test").events_max_bytes, 8192);
        assert_eq!(parse_byte_size("1G"), Ok(1024 * MIB));
        assert!(parse_byte_size("99999999999999999999G").is_err());
    }

    #[test]
    fn validation_names_the_key() {
        let cases = [
            ("state_dir = \"relative\"", "state_dir"),
            ("host_local_dirs = [\"/ok\", \"nope\"]", "host_local_dirs"),
            ("cni_bin_dirs = [\"opt/cni/bin\"]", "cni_bin_dirs"),
            ("cni_bin_dirs = []", "cni_bin_dirs"),
            ("events = \"\"", "events"),
            ("events_max_bytes = 10", "events_max_bytes"),
            ("events_keep = 1000", "events_keep"),
            ("orphan_grace = \"5s\"", "orphan_grace"),
            ("resync_interval = \"10ms\"", "resync_interval"),
            ("log = \"netreap=loud\"", "log"),
            ("node_name = \"\"", "node_name"),
        ];
        for (text, key) in cases {
            let err = parse(text).expect("valid in this test").validate().expect_err("must be refused");
            assert_eq!(err.key(), Some(key), "{text}: {err}");
            assert!(err.to_string().contains(&format!("`{key}`")), "{err}");
        }
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().expect("valid in this test");
        let file = dir.path().join("netreap.toml");
        std::fs::write(
            &file,
            "dry_run = true\nevents = \"/var/log/netreap.jsonl\"\norphan_grace = \"20m\"\nhost_local_dirs = [\"/a\"]\n",
        )
        .expect("valid in this test");
        let cli = Cli::try_parse_from([
            "netreap".as_ref(),
            "--config".as_ref(),
            file.as_os_str(),
            "--dry-run=false".as_ref(),
            "--orphan-grace".as_ref(),
            "1h".as_ref(),
            "--host-local-dir".as_ref(),
            "/b".as_ref(),
            "--host-local-dir".as_ref(),
            "/c".as_ref(),
            "--events-max-bytes".as_ref(),
            "1MiB".as_ref(),
        ])
        .expect("valid in this test");
        let config = Config::load(&cli.flags).expect("valid in this test");
        assert!(!config.dry_run, "flag beats file");
        assert_eq!(config.orphan_grace, Duration::from_hours(1));
        assert_eq!(config.host_local_dirs, [PathBuf::from("/b"), PathBuf::from("/c")]);
        assert_eq!(config.events_max_bytes, MIB);
        assert_eq!(config.events, "/var/log/netreap.jsonl", "file beats default");
        assert_eq!(config.resync_interval, Duration::from_secs(30), "default stays");

        let bare =
            Cli::try_parse_from(["netreap", "--dry-run", "--in-flight-grace", "45s"]).expect("valid in this test");
        let mut config = Config::default();
        bare.flags.apply(&mut config);
        assert!(config.dry_run, "--dry-run alone means true");
        assert_eq!(config.in_flight_grace, Duration::from_secs(45));
    }

    #[test]
    fn a_bad_flag_value_is_refused_by_clap() {
        let err =
            Cli::try_parse_from(["netreap", "--resync-interval", "often"]).expect_err("must be refused").to_string();
        assert!(err.contains("--resync-interval"), "{err}");
        assert!(err.contains("invalid duration"), "{err}");
    }

    #[test]
    fn an_invalid_merged_config_is_refused_at_load() {
        let cli = Cli::try_parse_from(["netreap", "--orphan-grace", "1s"]).expect("valid in this test");
        let err = Config::load(&cli.flags).expect_err("must be refused");
        assert_eq!(err.key(), Some("orphan_grace"), "{err}");
    }

    #[test]
    fn an_empty_node_name_from_the_downward_api_means_unset() {
        let mut config = Config::default();
        ConfigFlags { node_name: Some(String::new()), ..ConfigFlags::default() }.apply(&mut config);
        assert_eq!(config.node_name, None);
    }

    /// The `config.toml` block of deploy/configmap.yaml (a YAML literal block
    /// indented by four spaces), so the shipped `ConfigMap` cannot drift from
    /// the schema.
    #[test]
    fn the_deployed_configmap_is_a_valid_config() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/configmap.yaml");
        let yaml = std::fs::read_to_string(&path).expect("deploy/configmap.yaml");
        let mut block = String::new();
        for line in yaml
            .lines()
            .skip_while(|l| l.trim() != "config.toml: |")
            .skip(1)
            .take_while(|l| l.is_empty() || l.starts_with("    "))
        {
            block.push_str(line.get(4..).unwrap_or(""));
            block.push('\n');
        }
        assert!(block.contains("metrics_addr"), "config.toml block not found in {}", path.display());
        let config = Config::from_toml(&block, &path).unwrap_or_else(|e| panic!("{e}"));
        config.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.metrics_addr.port(), 9742, "the DaemonSet's probes and port use 9742");
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let err = Config::from_file(Path::new("/nonexistent/netreap.toml")).expect_err("must be refused");
        assert!(err.to_string().contains("/nonexistent/netreap.toml"), "{err}");
    }
}
