//! Test support shared by netreap's integration tests and benchmarks: a
//! dev-only crate, so each test binary links what it uses and nothing is
//! compiled twice or marked dead.
#![expect(clippy::expect_used, reason = "test support: a broken set-up panics with its context")]
#![expect(clippy::missing_panics_doc, reason = "every helper panics on a broken set-up; that is how tests fail")]
#![expect(clippy::must_use_candidate, reason = "helpers are called for their effect on the lab as often as for values")]

pub mod agent;
pub mod containerd;
pub mod kube;
pub mod lab;
pub mod net;

use std::time::{Duration, Instant};

use netreap::kernel::{events::KernelEvent, probes::Probes, stream::KernelStream};

/// The marker `cargo xtask test` counts: a test that returned early
/// because the machine lacks something is reported as skipped, never as
/// passed.
pub const SKIP_MARKER: &str = "netreap-test-skip:";

/// A test cannot run here, for `reason`. Under CI (`CI=true`, set by
/// `.ci/run`) that is a failure: CI machines are root with every package
/// installed, so a test that would skip there hides a broken set-up.
/// Elsewhere it prints the marker and returns false (the caller returns).
pub fn skip(reason: &str) -> bool {
    assert!(!std::env::var("CI").is_ok_and(|v| v == "true" || v == "1"), "this test must run under CI, but: {reason}");
    eprintln!("{SKIP_MARKER} {reason}");
    false
}

/// Kernel tests need root and BTF; on these machines CI is root, so they run.
/// Elsewhere they say why they skip.
pub fn kernel_tests_possible() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("needs root (CAP_BPF, CAP_SYS_ADMIN) to load eBPF probes");
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        return skip("kernel has no BTF (/sys/kernel/btf/vmlinux)");
    }
    true
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// Loaded probes and their stream; keep `probes` alive while reading.
pub struct Watch {
    pub probes: Probes,
    pub stream: KernelStream,
    /// Events read but not yet looked at (a batch may hold several).
    pending: std::collections::VecDeque<KernelEvent>,
}

pub fn watch() -> Watch {
    watch_with(Probes::load().expect("probes load on this kernel"))
}

/// Probes with the bpf_loop scan (where the kernel has it) and with the
/// tail-call scan that 5.10 runs: both must report the same runs.
pub fn both_scans() -> Vec<(&'static str, Watch)> {
    let mut out = Vec::new();
    let primary = Probes::load().expect("probes load on this kernel");
    let name = primary.implementation("netreap_cni_exec").expect("an environment scan is active");
    out.push((name, watch_with(primary)));
    if name != "tail_calls" {
        let tail = Probes::load_variants().expect("the tail-call scan loads on this kernel");
        assert_eq!(tail.implementation("netreap_cni_exec"), Some("tail_calls"));
        out.push(("tail_calls", watch_with(tail)));
    }
    out
}

/// A watch on probes loaded some other way (e.g. [`Probes::load_variants`]).
pub fn watch_with(mut probes: Probes) -> Watch {
    let stream = KernelStream::new(&mut probes).expect("ring buffer stream");
    Watch { probes, stream, pending: std::collections::VecDeque::new() }
}

impl Watch {
    /// Reads events until `pred` matches one (returned with those skipped
    /// before it) or `timeout` passes (panics with what was seen).
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        what: &str,
        mut pred: impl FnMut(&KernelEvent) -> bool,
    ) -> (KernelEvent, Vec<KernelEvent>) {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            while let Some(event) = self.pending.pop_front() {
                if pred(&event) {
                    return (event, seen);
                }
                seen.push(event);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting for {what}; saw {} events: {seen:#?}", seen.len());
            // A DEL's exec record does not wake the reader before the run's
            // exit (as the agent's tick, read what is there every 50 ms).
            let batch = match tokio::time::timeout(left.min(Duration::from_millis(50)), self.stream.next_batch()).await
            {
                Ok(batch) => batch.expect("ring buffer readable"),
                Err(_) => self.stream.pending(),
            };
            self.pending.extend(batch.into_iter().map(|r| r.expect("kernel records decode")));
        }
    }
}

/// A unique name for links and namespaces this test run creates.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}{}x{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed))
}
