//! The command line as a user meets it: a printing command whose reader
//! goes away (`netreap config --print-default | head -1`).

use std::{
    os::unix::process::ExitStatusExt as _,
    process::{Command, Stdio},
};

#[test]
fn a_printing_command_ends_quietly_when_its_reader_is_gone() {
    // A pipe whose read end is closed before the command writes: the write
    // fails with EPIPE every time.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_netreap"))
        .args(["config", "--print-default"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "a panic on a closed pipe: {stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
}
