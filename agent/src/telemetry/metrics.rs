//! Prometheus metrics: one registry, typed update methods, text exposition.
//!
//! Every metric is prefixed `netreap_`. Label values are the vocabulary of
//! the module that reports them (verdicts `in_use`, `pending`, `orphaned`,
//! `conflict`; CNI commands `ADD`, `DEL`, `CHECK`, `GC`, ...): they are
//! bounded sets, never IPs or container IDs, so cardinality stays small.

use std::{fmt::Write as _, sync::Arc, time::Duration};

use prometheus_client::{
    encoding::{EncodeLabelSet, text},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// Upper bounds (seconds) of the netns death -> release latency buckets:
/// 1 ms (netlink-speed release) up to a minute (a release held back by a
/// grace period or a slow IPAM store); beyond that lands in `+Inf`.
pub const DEATH_TO_RELEASE_BUCKETS: [f64; 15] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Content type of [`Metrics::encode`] (Prometheus text format 0.0.4).
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Content type of [`Metrics::encode_openmetrics`].
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReservationLabels {
    network: String,
    verdict: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReleaseLabels {
    reason: String,
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CniLabels {
    command: String,
    result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

struct Inner {
    registry: Registry,
    reservations: Family<ReservationLabels, Gauge>,
    releases: Family<ReleaseLabels, Counter>,
    conflicts: Counter,
    netns_alive: Gauge,
    netns_destroyed: Counter,
    cni_operations: Family<CniLabels, Counter>,
    cni_exec_anomalies: Family<ReasonLabels, Counter>,
    cni_env_scans_limited: Counter,
    ringbuf_drops: Counter,
    resyncs: Family<SourceLabels, Counter>,
    death_to_release: Histogram,
    api_staleness: Family<SourceLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    sandboxes_stuck: Gauge,
    source_active: Family<SourceLabels, Gauge>,
}

/// The agent's metrics. Cloning is cheap (one `Arc`); all clones update the
/// same registry, so hand one to each module that reports.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    /// Metrics whose `build_info` carries this crate's version.
    fn default() -> Self {
        Self::new(env!("CARGO_PKG_VERSION"))
    }
}

impl Metrics {
    /// A fresh registry; `version` goes into `netreap_build_info{version}`.
    #[must_use]
    pub fn new(version: &str) -> Self {
        let mut registry = Registry::with_prefix("netreap");
        let reservations = Family::<ReservationLabels, Gauge>::default();
        registry.register(
            "reservations",
            "IP reservations found in the IPAM stores, by network and current verdict",
            reservations.clone(),
        );
        let releases = Family::<ReleaseLabels, Counter>::default();
        registry.register("releases", "Reservation releases attempted, by reason and outcome", releases.clone());
        let conflicts = Counter::default();
        registry.register(
            "conflicts",
            "IPs found configured in a live netns of another owner than the reservation's (reported, never released)",
            conflicts.clone(),
        );
        let netns_alive = Gauge::default();
        registry.register("netns_alive", "Network namespaces currently known alive", netns_alive.clone());
        let netns_destroyed = Counter::default();
        registry.register("netns_destroyed", "Network namespaces seen destroyed", netns_destroyed.clone());
        let cni_operations = Family::<CniLabels, Counter>::default();
        registry.register(
            "cni_operations",
            "CNI plugin runs seen in the kernel, by command and result",
            cni_operations.clone(),
        );
        let cni_exec_anomalies = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "cni_exec_anomalies",
            "Processes carrying CNI_COMMAND that are not CNI plugin runs (not a binary in a CNI bin dir, \
             or not root), by reason; they change nothing",
            cni_exec_anomalies.clone(),
        );
        let cni_env_scans_limited = Counter::default();
        registry.register(
            "cni_env_scans_limited",
            "CNI runs whose environment the kernel could not read to its end (kept as unknown, in flight)",
            cni_env_scans_limited.clone(),
        );
        let ringbuf_drops = Counter::default();
        registry.register(
            "ringbuf_drops",
            "Kernel records lost because the eBPF ring buffer was full (each loss forces a resync)",
            ringbuf_drops.clone(),
        );
        let resyncs = Family::<SourceLabels, Counter>::default();
        registry.register("resyncs", "Full re-reads of a source of evidence, by source", resyncs.clone());
        let death_to_release = Histogram::new(DEATH_TO_RELEASE_BUCKETS);
        registry.register(
            "netns_death_to_release_seconds",
            "Time from a netns's death to the release of the reservation it held",
            death_to_release.clone(),
        );
        let sandboxes_stuck = Gauge::default();
        registry.register(
            "sandboxes_stuck",
            "Sandboxes the container runtime lists NOTREADY while their netns is alive (their IPs are kept)",
            sandboxes_stuck.clone(),
        );
        let source_active = Family::<SourceLabels, Gauge>::default();
        registry.register(
            "source_active",
            "Whether an optional source of evidence answers (1) or not (0), by source",
            source_active.clone(),
        );
        let api_staleness = Family::<SourceLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "kube_view_staleness_seconds",
            "How long a Kubernetes API view (pods of this node, whereabouts IPPools) has not been known current (0 while its watch is healthy)",
            api_staleness.clone(),
        );
        // A gauge fixed at 1 rather than an OpenMetrics `info`: the classic
        // Prometheus text format has no info type.
        let build_info = Family::<BuildLabels, Gauge>::default();
        registry.register("build_info", "Build of the running agent (always 1)", build_info.clone());
        build_info.get_or_create(&BuildLabels { version: version.to_owned() }).set(1);

        Self {
            inner: Arc::new(Inner {
                registry,
                reservations,
                releases,
                conflicts,
                netns_alive,
                netns_destroyed,
                cni_operations,
                cni_exec_anomalies,
                cni_env_scans_limited,
                ringbuf_drops,
                resyncs,
                death_to_release,
                api_staleness,
                sandboxes_stuck,
                source_active,
            }),
        }
    }

    /// Sets the number of reservations of one network with one verdict.
    pub fn set_reservations(&self, network: &str, verdict: &str, count: u64) {
        let labels = ReservationLabels { network: network.to_owned(), verdict: verdict.to_owned() };
        self.inner.reservations.get_or_create(&labels).set(gauge_value(count));
    }

    /// Replaces every reservation count at once (after a reconcile), so a
    /// network or verdict that vanished does not linger with a stale value.
    pub fn replace_reservations<'a, I>(&self, counts: I)
    where
        I: IntoIterator<Item = (&'a str, &'a str, u64)>,
    {
        // No await between clear and set: a scrape never sees a half state
        // on the agent's single-threaded runtime.
        self.inner.reservations.clear();
        for (network, verdict, count) in counts {
            self.set_reservations(network, verdict, count);
        }
    }

    /// One release attempt: `reason` (e.g. `netns_died`, `orphan_grace`),
    /// `outcome` (e.g. `released`, `already_gone`, `owner_changed`, `error`,
    /// `dry_run`).
    pub fn release(&self, reason: &str, outcome: &str) {
        let labels = ReleaseLabels { reason: reason.to_owned(), outcome: outcome.to_owned() };
        self.inner.releases.get_or_create(&labels).inc();
    }

    /// One conflict detected.
    pub fn conflict(&self) {
        self.inner.conflicts.inc();
    }

    /// How stale a Kubernetes API view is (`source`: pods, ippools).
    pub fn set_kube_staleness(&self, source: &str, staleness: Duration) {
        self.inner
            .api_staleness
            .get_or_create(&SourceLabels { source: source.to_owned() })
            .set(staleness.as_secs_f64());
    }

    /// The number of network namespaces currently alive.
    pub fn set_netns_alive(&self, count: u64) {
        self.inner.netns_alive.set(gauge_value(count));
    }

    /// One network namespace seen destroyed.
    pub fn netns_destroyed(&self) {
        self.inner.netns_destroyed.inc();
    }

    /// One CNI plugin run: `command` (`ADD`, `DEL`, `CHECK`, `GC`, ...),
    /// `result` (e.g. `ok`, `error`, `signaled`).
    pub fn cni_operation(&self, command: &str, result: &str) {
        let labels = CniLabels { command: command.to_owned(), result: result.to_owned() };
        self.inner.cni_operations.get_or_create(&labels).inc();
    }

    /// One exec record not believed as a CNI run (`reason`: outside_bin_dirs,
    /// not_root, uncheckable_path, path_truncated).
    pub fn cni_exec_anomaly(&self, reason: &str) {
        self.inner.cni_exec_anomalies.get_or_create(&ReasonLabels { reason: reason.to_owned() }).inc();
    }

    /// One CNI exec record whose environment scan stopped early.
    pub fn cni_env_scan_limited(&self) {
        self.inner.cni_env_scans_limited.inc();
    }

    /// `count` more kernel records lost to a full ring buffer.
    pub fn ringbuf_drops(&self, count: u64) {
        self.inner.ringbuf_drops.inc_by(count);
    }

    /// One full re-read of `source` (`netlink`, `host_local`, `cni_cache`,
    /// `procfs`, `runtime`, `kubernetes`: the `source` of the `resync` event).
    pub fn resync(&self, source: &str) {
        self.inner.resyncs.get_or_create(&SourceLabels { source: source.to_owned() }).inc();
    }

    /// Time from a netns's death to the release of its reservation.
    pub fn observe_death_to_release(&self, latency: Duration) {
        self.inner.death_to_release.observe(latency.as_secs_f64());
    }

    /// The number of stuck sandboxes (NOTREADY with a live netns).
    pub fn set_sandboxes_stuck(&self, count: u64) {
        self.inner.sandboxes_stuck.set(gauge_value(count));
    }

    /// Whether an optional source (`cri`, `kubernetes`) answers.
    pub fn set_source_active(&self, source: &str, active: bool) {
        self.inner.source_active.get_or_create(&SourceLabels { source: source.to_owned() }).set(i64::from(active));
    }

    /// The exposition in the `OpenMetrics` text format (ends with `# EOF`).
    #[must_use]
    pub fn encode_openmetrics(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail, and our label sets are plain
        // strings; an error here would be a bug in the encoder.
        if let Err(e) = text::encode(&mut out, &self.inner.registry) {
            tracing::error!("encoding metrics failed: {e}");
        }
        out
    }

    /// The exposition in the Prometheus text format 0.0.4.
    ///
    /// prometheus-client only writes `OpenMetrics`, which differs in two ways
    /// that matter to a classic parser: a counter's HELP/TYPE lines name the
    /// family without `_total` while its samples carry it, and the text ends
    /// with `# EOF`. Both are rewritten here.
    #[must_use]
    pub fn encode(&self) -> String {
        openmetrics_to_prometheus(&self.encode_openmetrics())
    }
}

/// Gauges hold i64; counts beyond it are clamped (not reachable in practice).
fn gauge_value(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

fn openmetrics_to_prometheus(open: &str) -> String {
    let mut out = String::with_capacity(open.len());
    let mut pending_help: Option<&str> = None;
    for line in open.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            // Held until the TYPE line tells whether the name needs `_total`.
            if let Some(help) = pending_help.replace(rest) {
                let _ = writeln!(out, "# HELP {help}");
            }
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let suffix = if kind == "counter" && !name.ends_with("_total") { "_total" } else { "" };
            if let Some(help) = pending_help.take() {
                let help_text = help.strip_prefix(name).map_or(help, str::trim_start);
                let _ = writeln!(out, "# HELP {name}{suffix} {help_text}");
            }
            let _ = writeln!(out, "# TYPE {name}{suffix} {kind}");
        } else if line != "# EOF" && !line.starts_with("# UNIT ") {
            // (`# EOF` and `# UNIT` are not part of the 0.0.4 format; no
            // metric here has a unit.)
            if let Some(help) = pending_help.take() {
                let _ = writeln!(out, "# HELP {help}");
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    if let Some(help) = pending_help {
        let _ = writeln!(out, "# HELP {help}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_get_total_on_help_and_type_in_prometheus_format() {
        let m = Metrics::new("1.2.3");
        m.release("netns_died", "released");
        let text = m.encode();
        assert!(text.contains("# HELP netreap_releases_total Reservation releases"), "{text}");
        assert!(text.contains("# TYPE netreap_releases_total counter\n"), "{text}");
        assert!(text.contains("netreap_releases_total{reason=\"netns_died\",outcome=\"released\"} 1\n"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        let open = m.encode_openmetrics();
        assert!(open.contains("# TYPE netreap_releases counter\n"), "{open}");
        assert!(open.ends_with("# EOF\n"), "{open}");
    }

    #[test]
    fn replace_reservations_drops_vanished_series() {
        let m = Metrics::default();
        m.set_reservations("podnet", "orphaned", 3);
        m.replace_reservations([("podnet", "in_use", 7)]);
        let text = m.encode();
        assert!(text.contains("netreap_reservations{network=\"podnet\",verdict=\"in_use\"} 7"), "{text}");
        assert!(!text.contains("orphaned"), "{text}");
    }

    #[test]
    fn histogram_buckets_span_a_millisecond_to_a_minute() {
        let m = Metrics::default();
        m.observe_death_to_release(Duration::from_millis(3));
        let text = m.encode();
        assert!(text.contains("netreap_netns_death_to_release_seconds_bucket{le=\"0.001\"} 0"), "{text}");
        assert!(text.contains("netreap_netns_death_to_release_seconds_bucket{le=\"0.005\"} 1"), "{text}");
        assert!(text.contains("netreap_netns_death_to_release_seconds_bucket{le=\"60.0\"} 1"), "{text}");
        assert!(text.contains("netreap_netns_death_to_release_seconds_count 1"), "{text}");
    }
}
