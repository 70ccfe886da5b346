//! The real agent binary, run against a lab's directories.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use super::lab::Lab;

pub struct Agent {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub events: PathBuf,
    pub stderr: PathBuf,
}

/// The agent executable under test. Cargo sets `CARGO_BIN_EXE_netreap` for
/// tests and benches at run time too; `cargo xtask vm-test` sets it in the
/// guests.
#[must_use]
pub fn netreap_binary() -> PathBuf {
    match std::env::var_os("CARGO_BIN_EXE_netreap") {
        Some(path) => PathBuf::from(path),
        None => panic!("CARGO_BIN_EXE_netreap is not set: run through cargo test/bench or cargo xtask vm-test"),
    }
}

fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().expect("local addr")
}

/// Polls `cond` until it holds (returns how long it took) or `timeout`.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if cond() {
            return Some(start.elapsed());
        }
        if start.elapsed() > timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A plain HTTP/1.1 GET: (status, body), or None when the agent does not answer.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http_get_with(addr, path, &[], Duration::from_secs(5))
}

/// A plain HTTP/1.1 GET (`Connection: close`, with `headers`), each step
/// within `timeout`: (status, body), or None when the server does not
/// answer. A chunked body (a large /state) is decoded; one cut short (no
/// final chunk) is None, never a shorter body.
pub fn http_get_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (name, value) in headers {
        request.extend([name, ": ", value, "\r\n"]);
    }
    request.push_str("\r\n");
    s.write_all(request.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let end_of_head = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end_of_head]).ok()?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head.lines().skip(1).any(|l| {
        l.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("transfer-encoding") && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = &raw[end_of_head + 4..];
    let body = if chunked { dechunk(body)? } else { body.to_vec() };
    Some((code, String::from_utf8(body).ok()?))
}

/// The data of a chunked body, or None when it is malformed or cut short.
fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end_of_line = raw.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&raw[..end_of_line]).ok()?.split(';').next()?.trim();
        let size = usize::from_str_radix(size, 16).ok()?;
        raw = &raw[end_of_line + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

impl Agent {
    /// Starts `netreap run` on the lab's dirs with `extra` flags and waits
    /// until it is ready (first full reconcile done).
    pub fn start(lab: &Lab, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_wrapped(lab, &[], extra, env)
    }

    /// Like `start`, run through `wrapper` (e.g. `unshare --mount ...`):
    /// the agent binary and its arguments are appended to it.
    pub fn start_wrapped(lab: &Lab, wrapper: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_in(lab.dir.path(), &lab.netreap_dir_args(), wrapper, extra, env)
    }

    /// Starts `netreap run` (through `wrapper`, if any) with its events and
    /// log in `dir`, on the directories `dir_args` name (flags), and waits
    /// until it is ready.
    pub fn start_in(
        dir: &std::path::Path,
        dir_args: &[std::ffi::OsString],
        wrapper: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let addr = free_port();
        let events = dir.join("events.jsonl");
        let stderr = dir.join(format!("agent-{}.log", addr.port()));
        let log = std::fs::File::create(&stderr).expect("agent log");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(netreap_binary());
                c
            }
            None => Command::new(netreap_binary()),
        };
        cmd.arg("run")
            .args(dir_args)
            .arg("--events")
            .arg(&events)
            .arg("--metrics-addr")
            .arg(addr.to_string())
            .args(extra)
            .env("NETREAP_LOG", "info,netreap=debug")
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("agent starts");
        let mut agent = Self { child: Some(child), addr, events, stderr };
        let ready = wait_until(Duration::from_secs(30), || {
            agent.exited().is_none() && http_get(addr, "/readyz").is_some_and(|(c, _)| c == 200)
        });
        assert!(ready.is_some(), "agent not ready in 30 s; log:\n{}", agent.log());
        agent
    }

    /// Exit status if the process has ended.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        wait_until(timeout, || {
            status = self.exited();
            status.is_some()
        });
        status
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Every event line so far.
    pub fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.events)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    pub fn events_named(&self, name: &str) -> Vec<Value> {
        self.events().into_iter().filter(|e| e["event"] == name).collect()
    }

    /// The agent's process id, while it runs.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn state(&self) -> Value {
        http_get(self.addr, "/state").and_then(|(_, b)| serde_json::from_str(&b).ok()).unwrap_or(Value::Null)
    }

    pub fn metrics(&self) -> String {
        http_get(self.addr, "/metrics").map(|(_, b)| b).unwrap_or_default()
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = self.wait_exit(Duration::from_secs(15));
        if status.is_none() {
            let _ = self.child.as_mut().map(Child::kill);
        }
        self.child = None;
        status
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            if wait_until(Duration::from_secs(10), || c.try_wait().ok().flatten().is_some()).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
