//! iproute2 and a plain nsid listener, for tests and benchmarks.

use std::{
    io::Write as _,
    process::{Command, Stdio},
    sync::mpsc,
    time::SystemTime,
};

use netreap::netlink::{
    Message, RECV_BUFFER, RtnlSocket, SocketOptions,
    wire::{self, consts::RTNLGRP_NSID},
};

/// Runs `ip ARGS`, panicking with its stderr on failure.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// Runs many `ip` commands in one process (`ip -force -batch -`): every
/// command runs; any failure fails the call, with ip's stderr.
pub fn ip_batch(commands: &str) {
    let mut child = Command::new("ip")
        .args(["-force", "-batch", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ip -batch");
    child.stdin.take().expect("stdin").write_all(commands.as_bytes()).expect("feed ip -batch");
    let out = child.wait_with_output().expect("ip -batch");
    assert!(out.status.success(), "ip -batch: {}", String::from_utf8_lossy(&out.stderr));
}

/// A plain `RTNLGRP_NSID` listener: when the kernel says each nsid died.
/// The kernel's own teardown time, to compare netreap's against.
pub fn plain_nsid_listener() -> mpsc::Receiver<(i32, SystemTime)> {
    let socket = RtnlSocket::open(&SocketOptions {
        groups: vec![RTNLGRP_NSID],
        listen_all_nsid: false,
        receive_buffer: 8 << 20,
        nonblocking: false,
    })
    .expect("plain netlink listener");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; RECV_BUFFER];
        while let Ok(Some(d)) = socket.recv(&mut buf) {
            let at = SystemTime::now();
            for (h, p) in wire::messages(&buf[..d.len]).flatten() {
                if let Ok(Message::DelNsid { nsid: Some(n) }) = wire::decode(&h, p)
                    && tx.send((n, at)).is_err()
                {
                    return;
                }
            }
        }
    });
    rx
}
