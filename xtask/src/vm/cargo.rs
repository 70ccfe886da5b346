//! The project's own test binaries: `cargo test -p netreap --no-run` builds
//! them (incrementally, in the normal target dir, so the host build is not
//! disturbed) and its JSON messages name the executables.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use super::VmError;
use crate::Workspace;

pub const PACKAGE: &str = "netreap";

/// A test executable and the cargo target it was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestBinary {
    /// `lib`, `bin`, `test`.
    pub kind: String,
    /// Target name: `netreap`, `probes`, `reclaim`, ...
    pub name: String,
    pub path: PathBuf,
}

#[derive(Debug, Clone, Default)]
pub struct Artifacts {
    pub tests: Vec<TestBinary>,
    /// The `netreap` executable itself (for `netreap probes` / `netreap run`).
    pub netreap: Option<PathBuf>,
}

/// Builds the test binaries of the agent and returns where they are.
pub fn build(ws: &Workspace) -> Result<Artifacts, VmError> {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&ws.root)
        .args(["test", "-p", PACKAGE, "--no-run", "--message-format=json-render-diagnostics"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let out = cmd.output().map_err(|source| VmError::spawn("cargo", source))?;
    if !out.status.success() {
        return Err(VmError::Failed { command: format!("{cmd:?}"), detail: out.status.to_string() });
    }
    let artifacts = parse(&String::from_utf8_lossy(&out.stdout));
    if artifacts.netreap.is_none() || artifacts.tests.is_empty() {
        return Err(VmError::Plan("cargo named no netreap executable or no test binaries".into()));
    }
    Ok(artifacts)
}

/// Reads cargo's `compiler-artifact` messages (one JSON object a line).
/// xtask has no JSON crate (std only), so this picks the few fields it needs.
#[must_use]
pub fn parse(messages: &str) -> Artifacts {
    let mut artifacts = Artifacts::default();
    for line in messages.lines() {
        if !line.contains(r#""reason":"compiler-artifact""#) {
            continue;
        }
        let Some(executable) = string_field(line, "executable") else { continue };
        let Some(target) = line.find(r#""target":{"#).map(|at| &line[at..]) else { continue };
        let kind = target
            .find(r#""kind":[""#)
            .and_then(|at| string_at(&target[at + r#""kind":["#.len()..]))
            .unwrap_or_default();
        let name = string_field(target, "name").unwrap_or_default();
        let is_test = line.find(r#""profile":{"#).is_some_and(|at| {
            let profile = &line[at..];
            let end = profile.find('}').unwrap_or(profile.len());
            profile[..end].contains(r#""test":true"#)
        });
        if is_test {
            artifacts.tests.push(TestBinary { kind, name, path: PathBuf::from(executable) });
        } else if kind == "bin" && name == PACKAGE {
            artifacts.netreap = Some(PathBuf::from(executable));
        }
    }
    artifacts
}

/// The string value of the first `"key":"..."` in `json`.
fn string_field(json: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\":");
    let at = json.find(&pat)? + pat.len();
    string_at(&json[at..])
}

/// Decodes the JSON string literal `s` starts with (escapes: `\\`, `\"`, `\/`).
fn string_at(s: &str) -> Option<String> {
    let mut chars = s.strip_prefix('"')?.chars();
    let mut out = String::new();
    loop {
        match chars.next()? {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MESSAGES: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/agent#netreap@0.1.0","manifest_path":"/w/agent/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"probes","src_path":"/w/agent/tests/probes.rs","edition":"2024","doc":false,"doctest":false,"test":true},"profile":{"opt_level":"0","debuginfo":2,"debug_assertions":true,"overflow_checks":true,"test":true},"features":[],"filenames":["/w/target/debug/deps/probes-fd98"],"executable":"/w/target/debug/deps/probes-fd98","fresh":true}
{"reason":"compiler-artifact","package_id":"x","manifest_path":"/w/agent/Cargo.toml","target":{"kind":["bin"],"crate_types":["bin"],"name":"netreap","src_path":"/w/agent/src/main.rs","edition":"2024","doc":true,"doctest":false,"test":true},"profile":{"opt_level":"0","debuginfo":2,"debug_assertions":true,"overflow_checks":true,"test":false},"features":[],"filenames":["/w/target/debug/netreap"],"executable":"/w/target/debug/netreap","fresh":true}
{"reason":"compiler-artifact","package_id":"x","manifest_path":"/w/agent/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"netreap","src_path":"/w/agent/src/lib.rs","edition":"2024","doc":true,"doctest":true,"test":true},"profile":{"opt_level":"0","debuginfo":2,"debug_assertions":true,"overflow_checks":true,"test":true},"features":[],"filenames":["/w/target/debug/deps/netreap-e0e2"],"executable":"/w/target/debug/deps/netreap-e0e2","fresh":true}
{"reason":"compiler-artifact","package_id":"y","manifest_path":"/w/x/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"libc","src_path":"/r/lib.rs","edition":"2015","doc":true,"doctest":true,"test":true},"profile":{"opt_level":"0","debuginfo":0,"debug_assertions":true,"overflow_checks":true,"test":false},"features":[],"filenames":["/w/target/debug/deps/liblibc.rlib"],"executable":null,"fresh":true}
{"reason":"build-finished","success":true}"#;

    #[test]
    fn picks_test_executables_and_the_agent_binary() {
        let a = parse(MESSAGES);
        assert_eq!(a.netreap, Some(PathBuf::from("/w/target/debug/netreap")));
        assert_eq!(a.tests.len(), 2);
        assert_eq!(
            a.tests[0],
            TestBinary { kind: "test".into(), name: "probes".into(), path: "/w/target/debug/deps/probes-fd98".into() }
        );
        assert_eq!((a.tests[1].kind.as_str(), a.tests[1].name.as_str()), ("lib", "netreap"));
    }

    #[test]
    fn string_literals_unescape() {
        assert_eq!(string_at(r#""a\"b\\c" tail"#), Some(r#"a"b\c"#.to_owned()));
        assert_eq!(string_at("null"), None);
    }
}
