//! Runs a [`Plan`] in the kernel this process runs on: inside a guest (as
//! `xtask vm-test --guest PLAN`, started by the initramfs's /init) or on the
//! host for `--kernel host`. It prints every outcome as a marker line (see
//! [`super::report`]) as soon as it is known, so a guest that hangs later
//! still leaves its results on the console.

use std::{
    io::{BufRead as _, BufReader, Read},
    path::Path,
    process::{Child, Command, ExitCode, ExitStatus, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use super::{
    plan::{Plan, Step},
    report::{self, ProbeRow, Report, Status, StepOutcome},
};

/// Bound on one test binary, well inside the VM's own bound (the backstop),
/// so a binary that hangs is named as a failed step with libtest's "has been
/// running for over 60 seconds" lines above it, and the later steps still run.
/// `tests/model.rs` took 74-178 s under TCG on this machine kind (its 1,300
/// and 300 netns tests): 3 minutes timed it out on a slow day.
const STEP_TIMEOUT: Duration = Duration::from_mins(5);
/// Once the binary has exited, how long its pipe may stay open: a stray
/// grandchild holding stdout must not keep the step waiting.
const PIPE_GRACE: Duration = Duration::from_secs(2);
/// Loading the probes parses the kernel's BTF: slow under emulation.
const EVENTS_TIMEOUT: Duration = Duration::from_mins(2);

/// Guest entry point: read the plan, run it, exit 0 only when all passed.
pub fn main(plan_path: &Path) -> ExitCode {
    let plan = match std::fs::read_to_string(plan_path)
        .map_err(|e| e.to_string())
        .and_then(|t| Plan::parse(&t).map_err(|e| e.to_string()))
    {
        Ok(plan) => plan,
        Err(e) => {
            println!("{}cannot read the plan {}: {e}", report::NOTE, plan_path.display());
            println!("{}fail", report::RESULT);
            return ExitCode::FAILURE;
        }
    };
    if run(&plan).passed() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}

/// Runs every step, printing marker lines; returns what it printed.
pub fn run(plan: &Plan) -> Report {
    let mut report = Report { release: kernel_release(), ..Report::default() };
    println!("{}{}", report::KERNEL, report.release);
    let mut probes: Vec<ProbeRow> = Vec::new();
    // The agent the test binaries run (netreap-testkit reads it from
    // CARGO_BIN_EXE_netreap, which cargo sets on the host).
    let mut agent: Option<&Path> = None;
    for step in &plan.steps {
        let outcome = match step {
            Step::Preconditions => preconditions(),
            Step::Probes { netreap } => {
                agent = Some(netreap);
                let (outcome, lines) = probes_report(netreap);
                for l in &lines {
                    println!("{}{l}", report::PROBE);
                }
                probes = report::probe_rows(&lines);
                report.probes = lines;
                outcome
            }
            Step::Events { netreap } => events(netreap, &probes),
            Step::Test { label, binary, args, must_pass, skips } => {
                once_more_after_a_timeout(label, || test_binary(label, binary, args, must_pass, skips, agent))
            }
            Step::Skip { label, reason } => StepOutcome::skip(label, reason),
        };
        println!("{}", outcome.line());
        report.steps.push(outcome);
    }
    let ok = report.steps.iter().all(|s| s.status != Status::Fail);
    report.result = Some(ok);
    println!("{}{}", report::RESULT, if ok { "pass" } else { "fail" });
    report
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|e| format!("? ({e})"), |s| s.trim().to_owned())
}

/// The tests return early (and count as passed) without root or BTF: make
/// that a failure here instead of a silent pass.
fn preconditions() -> StepOutcome {
    let label = "preconditions (root, BTF, netns)";
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status.lines().any(|l| l.strip_prefix("Uid:").is_some_and(|u| u.split_whitespace().nth(1) == Some("0")));
    let mut missing = Vec::new();
    if !root {
        missing.push("euid 0".to_owned());
    }
    for p in ["/sys/kernel/btf/vmlinux", "/proc/self/ns/net"] {
        if !Path::new(p).exists() {
            missing.push(p.to_owned());
        }
    }
    if missing.is_empty() {
        StepOutcome::check(label, true, "root, /sys/kernel/btf/vmlinux")
    } else {
        StepOutcome::check(label, false, format!("missing {}: the kernel tests would skip", missing.join(", ")))
    }
}

/// `netreap probes`: fails when the report cannot be made or a required
/// probe failed.
fn probes_report(netreap: &Path) -> (StepOutcome, Vec<String>) {
    let label = "netreap probes";
    let mut lines = Vec::new();
    let status = run_streaming(Command::new(netreap).arg("probes"), STEP_TIMEOUT, |l| lines.push(l.to_owned()));
    let rows = report::probe_rows(&lines);
    let outcome = match status {
        Ok(Some(s)) if s.success() && !rows.is_empty() => {
            let failed: Vec<&str> = rows.iter().filter(|r| r.state == "FAILED").map(|r| r.attach.as_str()).collect();
            let active = rows.iter().filter(|r| r.active()).count();
            // `netreap_cni_exec: environment scan: bpf_loop` (or tail_calls ...).
            let scan = lines
                .iter()
                .find_map(|l| l.split_once("environment scan: ").map(|(_, v)| v.split(' ').next().unwrap_or("")))
                .unwrap_or("")
                .to_owned();
            if !failed.is_empty() {
                StepOutcome::check(label, false, format!("required probes failed: {}", failed.join(", ")))
            } else if scan != "bpf_loop" && scan != "tail_calls" {
                StepOutcome::check(label, false, format!("no CNI environment scan named (got {scan:?})"))
            } else {
                StepOutcome::check(
                    label,
                    true,
                    format!("{active}/{} probes active, environment scan {scan}", rows.len()),
                )
            }
        }
        Ok(Some(s)) => StepOutcome::check(label, false, format!("{s}, {} probe rows", rows.len())),
        Ok(None) => StepOutcome::check(label, false, format!("timed out after {}s", STEP_TIMEOUT.as_secs())),
        Err(e) => StepOutcome::check(label, false, e),
    };
    (outcome, lines)
}

/// Runs a step; one that hangs past [`STEP_TIMEOUT`] runs once more: a
/// guest under software emulation has stalled a whole binary once in many
/// runs, with every test passing on every other run. The first timeout
/// stays on the record: a note line here, and in the step's note when the
/// second run passes; a second timeout fails the step.
fn once_more_after_a_timeout(label: &str, run: impl Fn() -> (StepOutcome, bool)) -> StepOutcome {
    let (outcome, timed_out) = run();
    if !timed_out {
        return outcome;
    }
    println!(
        "{}{label}: timed out after {}s (the lines above show which tests were still running); running it once more",
        report::NOTE,
        STEP_TIMEOUT.as_secs()
    );
    let (mut second, _) = run();
    second.note = format!("{} (the first run timed out after {}s)", second.note, STEP_TIMEOUT.as_secs());
    second
}

/// One run of a libtest binary; counts come from its `test result:` line.
/// Also says whether it timed out.
fn test_binary(
    label: &str,
    binary: &Path,
    args: &[String],
    must_pass: &[String],
    skips: &[(String, String)],
    agent: Option<&Path>,
) -> (StepOutcome, bool) {
    let mut cmd = Command::new(binary);
    cmd.args(args).env("RUST_BACKTRACE", "1");
    if let Some(agent) = agent {
        cmd.env("CARGO_BIN_EXE_netreap", agent);
    }
    for (name, why) in skips {
        println!("{}{label}: skipping {name}: {why}", report::NOTE);
        cmd.args(["--skip", name]);
    }
    let mut ok_tests: Vec<String> = Vec::new();
    let mut totals: Option<(u32, u32)> = None;
    let status = run_streaming(&mut cmd, STEP_TIMEOUT, |line| {
        println!("{line}");
        if let Some(name) = line.strip_prefix("test ").and_then(|l| l.strip_suffix(" ... ok")) {
            ok_tests.push(name.to_owned());
        }
        if let Some(counts) = libtest_counts(line) {
            let (p, f) = totals.unwrap_or((0, 0));
            totals = Some((p + counts.0, f + counts.1));
        }
    });
    let (passed, failed) = totals.unwrap_or((0, 0));
    let outcome = |ok: bool, note: String| StepOutcome {
        label: label.to_owned(),
        status: if ok { Status::Pass } else { Status::Fail },
        passed,
        failed: if ok { failed } else { failed.max(1) },
        skipped: skips.len() as u32,
        note,
    };
    let status = match status {
        Ok(Some(s)) => s,
        Ok(None) => return (outcome(false, format!("timed out after {}s", STEP_TIMEOUT.as_secs())), true),
        Err(e) => return (outcome(false, e), false),
    };
    if !status.success() || totals.is_none() {
        return (outcome(false, format!("{status}")), false);
    }
    let absent: Vec<&str> = must_pass.iter().map(String::as_str).filter(|m| !ok_tests.iter().any(|t| t == m)).collect();
    if !absent.is_empty() {
        return (outcome(false, format!("required tests did not pass: {}", absent.join(", "))), false);
    }
    if passed == 0 {
        return (outcome(false, "no test ran".into()), false);
    }
    (outcome(true, format!("{passed} passed")), false)
}

/// `test result: ok. 4 passed; 1 failed; 0 ignored; ...` -> (4, 1).
fn libtest_counts(line: &str) -> Option<(u32, u32)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let count = |what: &str| {
        rest.split(';').find_map(|part| {
            part.trim().rsplit_once(' ').filter(|(_, w)| *w == what)?.0.rsplit(' ').next()?.parse().ok()
        })
    };
    Some((count("passed")?, count("failed")?))
}

/// Runs `cmd` with stdout piped to `on_line`, stderr inherited; `Ok(None)`
/// when it ran past `timeout` (it is then killed). Ends when the child has
/// exited and its pipe closed, or [`PIPE_GRACE`] after the exit.
fn run_streaming(
    cmd: &mut Command,
    timeout: Duration,
    mut on_line: impl FnMut(&str),
) -> Result<Option<ExitStatus>, String> {
    let mut child =
        cmd.stdout(Stdio::piped()).stdin(Stdio::null()).spawn().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let rx = lines_of(child.stdout.take());
    let deadline = Instant::now() + timeout;
    let mut exited: Option<(ExitStatus, Instant)> = None;
    loop {
        if exited.is_none() {
            match child.try_wait() {
                Ok(Some(status)) => exited = Some((status, Instant::now() + PIPE_GRACE)),
                Ok(None) => {}
                Err(e) => return Err(format!("waiting for {cmd:?}: {e}")),
            }
        }
        let until = exited.map_or(deadline, |(_, grace)| grace.min(deadline));
        let slice = until.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
        match rx.recv_timeout(slice) {
            Ok(line) => on_line(&line),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => match exited {
                Some((_, grace)) if Instant::now() >= grace => break,
                None if Instant::now() >= deadline => {
                    stop(&mut child);
                    return Ok(None);
                }
                Some(_) | None => {}
            },
        }
    }
    match exited {
        Some((status, _)) => Ok(Some(status)),
        None => child.wait().map(Some).map_err(|e| format!("waiting for {cmd:?}: {e}")),
    }
}

/// Lines of a pipe, read on a thread, ending when the pipe closes.
fn lines_of(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    if let Some(pipe) = pipe {
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    rx
}

/// Kills and reaps a child this runner started.
fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Event kinds a new netns must produce, given which probes are active.
fn expected_events(probes: &[ProbeRow]) -> Vec<&'static str> {
    let active = |program: &str| probes.iter().any(|r| r.program == program && r.active());
    let mut want = vec!["netns_entered"];
    if active("netreap_copy_net_ns") {
        want.push("netns_created");
    }
    if active("netreap_put_net") {
        want.push("netns_freed");
    }
    want
}

/// `netreap run` must report a netns made by `unshare -n` through each
/// active kind of probe: tracepoints always, fexit `copy_net_ns` (creation)
/// and fentry `__put_net` (death) where the kernel runs them. A new netns is
/// made every couple of seconds until one is seen, since when the probes
/// are attached is not known from outside. The syscall tracepoints (which
/// see `unshare`) load only with `probes.attribution`, so it is turned on.
fn events(netreap: &Path, probes: &[ProbeRow]) -> StepOutcome {
    let want = expected_events(probes);
    let label = format!("netreap run events ({})", want.join(", "));
    // Dry run on empty private dirs, metrics on a free port: the check must
    // not touch this machine's reservations or collide with another agent.
    let scratch = std::env::temp_dir().join(format!("netreap-vm-events-{}", std::process::id()));
    let dirs = ["networks", "cache", "state"].map(|d| scratch.join(d));
    if let Some(e) = dirs.iter().find_map(|d| std::fs::create_dir_all(d).err()) {
        return StepOutcome::check(&label, false, format!("cannot create {}: {e}", scratch.display()));
    }
    let spawned = Command::new(netreap)
        .args(["run", "--dry-run", "--events", "-", "--metrics-addr", "127.0.0.1:0"])
        .args(["--probes-attribution", "true"])
        .arg("--host-local-dir")
        .arg(&dirs[0])
        .arg("--cni-cache-dir")
        .arg(&dirs[1])
        .arg("--state-dir")
        .arg(&dirs[2])
        .env_remove("NETREAP_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut agent = match spawned {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&scratch);
            return StepOutcome::check(&label, false, format!("cannot run {}: {e}", netreap.display()));
        }
    };
    let events = lines_of(agent.stdout.take());
    let logs = lines_of(agent.stderr.take());
    let result = watch_for(&mut agent, &events, &want);
    stop(&mut agent);
    let _ = std::fs::remove_dir_all(&scratch);
    match result {
        Ok(inode) => StepOutcome::check(&label, true, format!("netns {inode}: {}", want.join(" + "))),
        Err(why) => {
            let logs: Vec<String> = logs.try_iter().collect();
            let tail = logs.len().saturating_sub(20);
            for l in &logs[tail..] {
                println!("netreap run: {l}");
            }
            StepOutcome::check(&label, false, why)
        }
    }
}

fn watch_for(agent: &mut Child, events: &mpsc::Receiver<String>, want: &[&str]) -> Result<u64, String> {
    let deadline = Instant::now() + EVENTS_TIMEOUT;
    let mut inodes: Vec<u64> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    while Instant::now() < deadline {
        if let Ok(Some(status)) = agent.try_wait() {
            return Err(format!("netreap run exited early: {status}"));
        }
        inodes.push(new_netns()?);
        let pause = Instant::now() + Duration::from_secs(2);
        while let Ok(line) = events.recv_timeout(pause.saturating_duration_since(Instant::now())) {
            seen.push(line);
        }
        let complete = inodes.iter().find(|&&ino| want.iter().all(|ev| seen.iter().any(|l| is_event(l, ev, ino))));
        if let Some(&ino) = complete {
            return Ok(ino);
        }
    }
    let got: Vec<String> = want
        .iter()
        .map(|ev| format!("{ev}: {}", inodes.iter().filter(|&&i| seen.iter().any(|l| is_event(l, ev, i))).count()))
        .collect();
    Err(format!(
        "no netns of {} made by unshare was seen through all of them within {}s ({}; {} lines read)",
        inodes.len(),
        EVENTS_TIMEOUT.as_secs(),
        got.join(", "),
        seen.len()
    ))
}

/// Makes a netns that lives as long as `readlink` and returns its inode.
fn new_netns() -> Result<u64, String> {
    let out = Command::new("unshare")
        .args(["-n", "readlink", "/proc/self/ns/net"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .strip_prefix("net:[")
        .and_then(|s| s.strip_suffix(']'))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("unshare -n readlink: {} {text:?} {}", out.status, String::from_utf8_lossy(&out.stderr)))
}

/// Is `line` (a JSON event) of kind `event` about netns `inode`?
fn is_event(line: &str, event: &str, inode: u64) -> bool {
    if !line.contains(&format!(r#""event":"{event}""#)) {
        return false;
    }
    let key = r#""netns_inode":"#;
    line.match_indices(key).any(|(at, _)| {
        let digits: String = line[at + key.len()..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse() == Ok(inode)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtest_summary_counts() {
        assert_eq!(
            libtest_counts(
                "test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 38 filtered out; finished in 0.01s"
            ),
            Some((4, 0))
        );
        assert_eq!(libtest_counts("test result: FAILED. 3 passed; 2 failed; 0 ignored"), Some((3, 2)));
        assert_eq!(libtest_counts("running 4 tests"), None);
    }

    #[test]
    fn a_grandchild_holding_stdout_does_not_hold_the_step() {
        let start = Instant::now();
        let mut lines = Vec::new();
        let status =
            run_streaming(Command::new("sh").args(["-c", "sleep 6 & echo hi"]), Duration::from_secs(20), |l| {
                lines.push(l.to_owned());
            });
        assert!(matches!(status, Ok(Some(s)) if s.success()), "{status:?}");
        assert_eq!(lines, ["hi"]);
        assert!(start.elapsed() < Duration::from_secs(5), "returned {:?} after the exit", start.elapsed());
    }

    #[test]
    fn a_binary_past_its_bound_is_stopped() {
        let status = run_streaming(Command::new("sleep").arg("10"), Duration::from_millis(300), |_| {});
        assert!(matches!(status, Ok(None)), "{status:?}");
    }

    #[test]
    fn events_match_kind_and_exact_inode() {
        let line = r#"{"event":"netns_entered","netns_inode":4026532281,"previous_netns_inode":4026531840,"time":"x","via":"unshare"}"#;
        assert!(is_event(line, "netns_entered", 4_026_532_281));
        assert!(!is_event(line, "netns_entered", 4_026_531_840), "previous_netns_inode is not the netns");
        assert!(!is_event(line, "netns_entered", 402_653_228));
        assert!(!is_event(line, "netns_freed", 4_026_532_281));
    }

    #[test]
    fn trampolines_add_their_events_when_active() {
        let row = |program: &str, state: &str| ProbeRow {
            program: program.into(),
            attach: String::new(),
            state: state.into(),
        };
        assert_eq!(expected_events(&[row("netreap_copy_net_ns", "unavailable")]), ["netns_entered"]);
        assert_eq!(
            expected_events(&[row("netreap_copy_net_ns", "active"), row("netreap_put_net", "active")]),
            ["netns_entered", "netns_created", "netns_freed"]
        );
    }
}
