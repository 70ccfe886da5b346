//! Boots a kernel with the initramfs under qemu's software emulation (TCG:
//! `-enable-kvm` fails on these machines) and streams its serial console.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use super::{VmError, kernels::Kernel, report};

pub const QEMU: &str = "qemu-system-x86_64";
/// After the result line the guest only powers off; give it this long.
const POWEROFF_GRACE: Duration = Duration::from_secs(30);

/// How a boot ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// qemu exited (the guest powered off, or panicked with -no-reboot).
    Exited(String),
    /// The bound passed; qemu was killed.
    TimedOut,
}

pub struct Boot {
    pub console: Vec<String>,
    pub end: End,
    pub elapsed: Duration,
}

/// Boots `kernel` with `initrd`, printing each console line prefixed with
/// `tag`, until qemu exits or `bound` passes.
pub fn boot(kernel: &Kernel, initrd: &Path, tag: &str, bound: Duration) -> Result<Boot, VmError> {
    let mut cmd = Command::new(QEMU);
    cmd.args(["-accel", "tcg", "-cpu", "max", "-m", "1024", "-smp", "2"])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 panic=-1 quiet"])
        // No terminal on stdin: qemu would put it in raw mode.
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|source| VmError::spawn(QEMU, source))?;
    let (tx, rx) = mpsc::channel::<String>();
    for pipe in [
        child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child.stderr.take().map(|p| Box::new(p) as _),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        thread::spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut buf = Vec::new();
            // Bytes, not UTF-8 lines: the console may carry anything.
            while reader.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
                let line = printable(&String::from_utf8_lossy(&buf));
                buf.clear();
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);

    let mut console = Vec::new();
    let mut deadline = start + bound;
    let mut end = None;
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                println!("{tag} | {line}");
                if line.contains(report::RESULT) {
                    deadline = deadline.min(Instant::now() + POWEROFF_GRACE);
                }
                console.push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Our own child: kill it by its handle.
                let _ = child.kill();
                end = Some(End::TimedOut);
                break;
            }
        }
    }
    let status = child.wait().map_err(|source| VmError::spawn(QEMU, source))?;
    let end = end.unwrap_or_else(|| End::Exited(status.to_string()));
    Ok(Boot { console, end, elapsed: start.elapsed() })
}

/// The line without terminal control: the BIOS clears the screen and the
/// agent's logs are coloured, which would litter CI logs and artifacts.
fn printable(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            // CSI: ESC [ params... final byte in '@'..='~'.
            '\u{1b}' if chars.peek() == Some(&'[') => {
                chars.next();
                while chars.next().is_some_and(|p| !('@'..='~').contains(&p)) {}
            }
            // Any other escape: drop ESC and the one character after it.
            '\u{1b}' => {
                chars.next();
            }
            '\t' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn terminal_control_is_removed() {
        assert_eq!(printable("\u{1b}c\u{1b}[?7l\u{1b}[2JNETREAP-VM-KERNEL: 6.1\r\n"), "NETREAP-VM-KERNEL: 6.1");
        assert_eq!(printable("\u{1b}[2m2026\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m x\ty"), "2026  INFO x\ty");
    }
}
