//! The flags and environment variables that override the file, and how
//! they are laid over it.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use super::{Config, parse_byte_size, parse_duration};

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
