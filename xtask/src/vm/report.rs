//! What one kernel's run found. The guest prints it as marker lines on its
//! console while it runs; the host parses them back out of the console, so a
//! guest and a `--kernel host` run end in the same [`Report`].
//!
//! Every marker line carries its prefix, so a kernel message that lands
//! between two lines cannot corrupt what is parsed.

use std::{fmt::Write as _, time::Duration};

pub const KERNEL: &str = "NETREAP-VM-KERNEL: ";
/// One line of `netreap probes` output.
pub const PROBE: &str = "NETREAP-VM-PROBE| ";
pub const STEP: &str = "NETREAP-VM-STEP: ";
pub const NOTE: &str = "NETREAP-VM-NOTE: ";
pub const RESULT: &str = "NETREAP-VM-RESULT: ";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    /// Not run here, with a printed reason; never counted as a pass.
    Skip,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail => "fail",
            Self::Skip => "skip",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "pass" => Some(Self::Pass),
            "fail" => Some(Self::Fail),
            "skip" => Some(Self::Skip),
            _ => None,
        }
    }
}

/// One step of the plan: a test binary, the probes report or the event check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepOutcome {
    pub label: String,
    pub status: Status,
    /// Tests (or checks) that passed and failed in this step.
    pub passed: u32,
    pub failed: u32,
    /// Tests of this step left out here (reasons printed as notes).
    pub skipped: u32,
    pub note: String,
}

impl StepOutcome {
    pub fn check(label: &str, ok: bool, note: impl Into<String>) -> Self {
        let status = if ok { Status::Pass } else { Status::Fail };
        Self {
            label: label.to_owned(),
            status,
            passed: u32::from(ok),
            failed: u32::from(!ok),
            skipped: 0,
            note: note.into(),
        }
    }

    pub fn skip(label: &str, reason: &str) -> Self {
        Self {
            label: label.to_owned(),
            status: Status::Skip,
            passed: 0,
            failed: 0,
            skipped: 0,
            note: reason.to_owned(),
        }
    }

    /// The marker line. `|` separates fields, so it is replaced inside them.
    pub fn line(&self) -> String {
        format!(
            "{STEP}{} passed={} failed={} skipped={} | {} | {}",
            self.status.as_str(),
            self.passed,
            self.failed,
            self.skipped,
            clean(&self.label),
            clean(&self.note)
        )
    }

    fn parse(rest: &str) -> Option<Self> {
        let mut parts = rest.splitn(3, " | ");
        let head = parts.next()?;
        let label = parts.next()?.trim().to_owned();
        let note = parts.next().unwrap_or("").trim().to_owned();
        let mut words = head.split_whitespace();
        let status = Status::parse(words.next()?)?;
        let mut count = |key: &str| words.next()?.strip_prefix(key)?.parse().ok();
        let passed = count("passed=")?;
        let failed = count("failed=")?;
        let skipped = count("skipped=")?;
        Some(Self { label, status, passed, failed, skipped, note })
    }
}

fn clean(s: &str) -> String {
    s.replace(['|', '\n', '\r'], "/")
}

/// A row of the `netreap probes` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeRow {
    pub program: String,
    /// e.g. `fentry __put_net`.
    pub attach: String,
    /// `active`, `unavailable` or `FAILED`.
    pub state: String,
}

impl ProbeRow {
    #[must_use]
    pub fn active(&self) -> bool {
        self.state == "active"
    }
}

/// Rows of the `netreap probes` text table: program, two words of attach
/// point (`tracepoint cat/name`, `fentry fn`), state, detail.
#[must_use]
pub fn probe_rows(lines: &[String]) -> Vec<ProbeRow> {
    lines
        .iter()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let state = *w.get(3)?;
            (w[0].starts_with("netreap_") && matches!(state, "active" | "unavailable" | "FAILED")).then(|| ProbeRow {
                program: w[0].to_owned(),
                attach: format!("{} {}", w[1], w[2]),
                state: state.to_owned(),
            })
        })
        .collect()
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// `uname -r` of the kernel the tests ran in.
    pub release: String,
    /// `netreap probes` output, verbatim.
    pub probes: Vec<String>,
    pub steps: Vec<StepOutcome>,
    pub notes: Vec<String>,
    /// The runner's own verdict line; absent when it never finished.
    pub result: Option<bool>,
}

impl Report {
    /// Pulls the marker lines out of a console transcript.
    #[must_use]
    pub fn parse(console: &[String]) -> Self {
        let mut report = Self::default();
        for line in console {
            // Markers may follow stray output on the same line.
            let Some(at) = line.find("NETREAP-VM-") else { continue };
            let line = &line[at..];
            if let Some(rest) = line.strip_prefix(KERNEL) {
                rest.trim().clone_into(&mut report.release);
            } else if let Some(rest) = line.strip_prefix(PROBE) {
                report.probes.push(rest.to_owned());
            } else if let Some(rest) = line.strip_prefix(STEP) {
                match StepOutcome::parse(rest) {
                    Some(step) => report.steps.push(step),
                    None => report.notes.push(format!("unparsable step line: {line}")),
                }
            } else if let Some(rest) = line.strip_prefix(NOTE) {
                report.notes.push(rest.trim().to_owned());
            } else if let Some(rest) = line.strip_prefix(RESULT) {
                report.result = Some(rest.trim() == "pass");
            }
        }
        report
    }

    /// Passed only when the runner said so, finished, and no step failed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.result == Some(true) && !self.steps.is_empty() && self.steps.iter().all(|s| s.status != Status::Fail)
    }

    /// (tests passed, tests failed, skipped: whole binaries plus single tests).
    #[must_use]
    pub fn totals(&self) -> (u32, u32, u32) {
        let passed = self.steps.iter().map(|s| s.passed).sum();
        let failed = self.steps.iter().map(|s| s.failed).sum();
        let skipped = self.steps.iter().map(|s| s.skipped + u32::from(s.status == Status::Skip)).sum();
        (passed, failed, skipped)
    }

    /// `8/10 active`, plus what is not active.
    #[must_use]
    pub fn probes_summary(&self) -> String {
        let rows = probe_rows(&self.probes);
        if rows.is_empty() {
            return "no report".to_owned();
        }
        let active = rows.iter().filter(|r| r.active()).count();
        let off: Vec<&str> = rows.iter().filter(|r| !r.active()).map(|r| r.attach.as_str()).collect();
        if off.is_empty() {
            format!("{active}/{} active (all)", rows.len())
        } else {
            format!("{active}/{} active; not: {}", rows.len(), off.join(", "))
        }
    }
}

/// One row of the summary: the kernel asked for, its report, wall time.
pub struct Row<'a> {
    pub kernel: &'a str,
    pub report: &'a Report,
    pub elapsed: Duration,
    /// Why the run failed outside the report (timeout, no result line).
    pub problem: Option<&'a str>,
}

/// The summary table printed at the end of `vm-test`.
#[must_use]
pub fn table(rows: &[Row<'_>]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<6} {:<28} {:<62} {:>6} {:>6} {:>7} {:>7}  result",
        "kernel", "release", "probes", "passed", "failed", "skipped", "time"
    );
    for r in rows {
        let (passed, failed, skipped) = r.report.totals();
        let verdict = match r.problem {
            Some(p) => format!("FAIL ({p})"),
            None if r.report.passed() => "pass".to_owned(),
            None => "FAIL".to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<6} {:<28} {:<62} {passed:>6} {failed:>6} {skipped:>7} {:>6}s  {verdict}",
            r.kernel,
            if r.report.release.is_empty() { "?" } else { &r.report.release },
            r.report.probes_summary(),
            r.elapsed.as_secs()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBES: &str = "\
kernel struct offsets from BTF: KernelOffsets { task_nsproxy: 3064 }
probe                    attach point                               state        detail
netreap_exit_unshare     tracepoint syscalls/sys_exit_unshare       active       unshare(CLONE_NEWNET): the new netns
netreap_copy_net_ns      fexit copy_net_ns                          unavailable  the kernel refuses BPF trampolines (EPERM: lockdown, or no CONFIG_DYNAMIC_FTRACE_WITH_DIRECT_CALLS); fallback: syscall tracepoints
netreap_put_net          fentry __put_net                           active       the exact moment a netns's last reference drops";

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_owned).collect()
    }

    #[test]
    fn probe_rows_read_the_state_column() {
        let rows = probe_rows(&lines(PROBES));
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[1].attach, "fexit copy_net_ns");
        assert_eq!(rows[1].state, "unavailable");
        assert!(rows[2].active());
    }

    #[test]
    fn marker_lines_round_trip_through_a_noisy_console() {
        let step = StepOutcome {
            label: "probes | all".into(),
            status: Status::Pass,
            passed: 6,
            failed: 0,
            skipped: 1,
            note: "ok".into(),
        };
        let mut console = vec![format!("{KERNEL}6.1.0-56-cloud-amd64"), "[    1.2] random: crng init done".into()];
        console.extend(PROBES.lines().map(|l| format!("{PROBE}{l}")));
        console.push(format!("[ 3.4] veth: noise{}", step.line()));
        console.push(StepOutcome::skip("telemetry", "not kernel-facing").line());
        console.push(format!("{RESULT}pass"));
        let r = Report::parse(&console);
        assert_eq!(r.release, "6.1.0-56-cloud-amd64");
        assert_eq!(r.probes.len(), PROBES.lines().count());
        assert_eq!(r.steps[0].label, "probes / all");
        assert_eq!(r.steps[0].passed, 6);
        assert_eq!(r.steps[1].status, Status::Skip);
        assert!(r.passed());
        assert_eq!(r.totals(), (6, 0, 2));
        assert_eq!(r.probes_summary(), "2/3 active; not: fexit copy_net_ns");
    }

    #[test]
    fn no_result_line_or_a_failed_step_is_a_failure() {
        let mut r = Report::parse(&[StepOutcome::check("x", true, "").line()]);
        assert!(!r.passed(), "the runner never said it finished");
        r.result = Some(true);
        assert!(r.passed());
        r.steps.push(StepOutcome::check("y", false, "boom"));
        assert!(!r.passed());
    }
}
