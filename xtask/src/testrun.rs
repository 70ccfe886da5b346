//! Runs `cargo test`, passing its output through, and closes with one plain
//! summary line over every test binary: `N passed, N failed, N skipped`.
//! A test that returned early because the machine lacks something prints
//! the skip marker (`testkit/src/lib.rs`): it counts as skipped, not passed.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
};

use crate::BuildError;

/// Totals over every `test result:` line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
}

impl Totals {
    /// Adds one libtest closing line, e.g.
    /// `test result: ok. 8 passed; 0 failed; 1 ignored; 0 measured; ...`.
    pub fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else { return };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else { continue };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                _ => {}
            }
        }
    }
}

/// What a skipping test prints (on stderr), before its reason.
pub const SKIP_MARKER: &str = "netreap-test-skip:";

/// `cargo test <extra>` in `root`; prints the summary line last.
pub fn cargo_test(root: &Path, extra: &[String]) -> Result<(), BuildError> {
    let mut child = Command::new("cargo")
        .current_dir(root)
        .arg("test")
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| BuildError::Spawn { program: "cargo".into(), source })?;
    // stderr passes through on its own thread, the skip reasons counted.
    let stderr = child.stderr.take().map(|err| {
        std::thread::spawn(move || {
            let mut reasons = Vec::new();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if let Some(reason) = line.trim().strip_prefix(SKIP_MARKER) {
                    reasons.push(reason.trim().to_owned());
                }
            }
            reasons
        })
    });
    let mut totals = Totals::default();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
            totals.add_line(&line);
        }
    }
    let status = child.wait().map_err(|source| BuildError::Spawn { program: "cargo".into(), source })?;
    let skipped = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    let passed = totals.passed.saturating_sub(skipped.len() as u64);
    println!("\n{passed} passed, {} failed, {} skipped", totals.failed, totals.ignored + skipped.len() as u64);
    for reason in &skipped {
        println!("  skipped (returned early): {reason}");
    }
    if status.success() {
        Ok(())
    } else {
        Err(BuildError::Failed { command: format!("cargo test {}", extra.join(" ")), status: status.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_libtest_closing_lines() {
        let mut t = Totals::default();
        t.add_line("test result: ok. 8 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.74s");
        t.add_line("test result: FAILED. 2 passed; 3 failed; 0 ignored; 0 measured; 0 filtered out");
        t.add_line("running 3 tests");
        assert_eq!(t, Totals { passed: 10, failed: 3, ignored: 1 });
    }
}
