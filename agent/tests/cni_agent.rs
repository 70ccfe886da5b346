//! The agent's CNI-run filter end to end: a forged `CNI_COMMAND=DEL` from a
//! process that is not a CNI plugin is reported (event, metric, log) and
//! changes nothing the agent shows. Host only (an agent start and /state
//! polling under emulation prove nothing more than tests/cni_ledger.rs).

#![allow(clippy::unwrap_used, reason = "tests panic with context")]

use netreap_testkit as support;

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use support::{
    agent::{Agent, wait_until},
    kernel_tests_possible,
    lab::{Lab, cni_plugins_present},
    unique,
};

fn attachment(agent: &Agent, cid: &str) -> Option<Value> {
    agent.state()["attachments"].as_array()?.iter().find(|a| a["container_id"] == cid).cloned()
}

#[test]
fn a_forged_del_is_an_anomaly_that_changes_nothing() {
    if !kernel_tests_possible() {
        return;
    }
    assert!(cni_plugins_present(), "Debian's containernetworking-plugins are needed (cargo xtask test installs them)");
    let lab = Lab::new("10.253.30.0/29");
    let agent = Agent::start(&lab, &[], &[]);
    let pod = lab.pod();
    let net = lab.network(&unique("nrEnet"), "host-local", &[]);
    lab.add(&net, &pod).expect("a real ADD");
    let cid = pod.container_id.clone();
    let seen = wait_until(Duration::from_secs(10), || {
        attachment(&agent, &cid).is_some_and(|a| a["operations"].as_array().is_some_and(|ops| ops.len() >= 2))
    });
    assert!(seen.is_some(), "the real ADD reached the ledger; log:\n{}", agent.log());
    let before = attachment(&agent, &cid).unwrap();

    let status = Command::new("/bin/sh")
        .args(["-c", "exit 0"])
        .env_clear()
        .env("CNI_COMMAND", "DEL")
        .env("CNI_CONTAINERID", &cid)
        .env("CNI_NETNS", "/var/run/netns/nrEforged")
        .stdin(Stdio::null())
        .status()
        .expect("sh runs");
    assert!(status.success());

    let anomaly = |e: &Value| e["container_id"] == cid.as_str() && e["anomaly"]["binary"] == "/bin/sh";
    let reported = wait_until(Duration::from_secs(10), || agent.events_named("cni_exec_anomaly").iter().any(anomaly));
    assert!(reported.is_some(), "a cni_exec_anomaly event; log:\n{}", agent.log());
    let event = agent.events_named("cni_exec_anomaly").into_iter().find(anomaly).unwrap();
    assert_eq!(event["anomaly"]["reason"], "outside_bin_dirs", "{event}");
    assert_eq!(event["command"], "DEL");
    let metrics = agent.metrics();
    assert!(
        metrics.lines().any(|l| l.starts_with("netreap_cni_exec_anomalies_total{reason=\"outside_bin_dirs\"}")),
        "{metrics}"
    );
    assert!(agent.log().contains("not a CNI run, ignored: /bin/sh"), "{}", agent.log());
    // /state is rendered at most once a second: give it two.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(attachment(&agent, &cid).unwrap(), before, "the forged DEL changed nothing");
}

/// `netreap probes` names the environment scan that runs, and `--variants`
/// loads the older kernels' one here with its limit. (In the qemu guests
/// the runner's own `netreap probes` step checks the scan is named.)
#[test]
fn netreap_probes_names_the_environment_scan() {
    if !kernel_tests_possible() {
        return;
    }
    let probes = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_netreap")).arg("probes").args(args).output().expect("netreap runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let plain = probes(&[]);
    assert!(
        plain.contains("netreap_cni_exec: environment scan: bpf_loop\n")
            || plain.contains("netreap_cni_exec: environment scan: tail_calls (bpf_loop not used: "),
        "{plain}"
    );
    let variants = probes(&["--variants"]);
    assert!(variants.contains("netreap_cni_exec: environment scan: tail_calls"), "{variants}");
    assert!(variants.contains("limits: reads the first 4,352 environment strings"), "{variants}");
    let json: Value = serde_json::from_str(&probes(&["--json", "--variants"])).expect("JSON");
    let exec = json["probes"].as_array().unwrap().iter().find(|p| p["program"] == "netreap_cni_exec").unwrap();
    assert_eq!(exec["implementation"]["active"], "tail_calls", "{exec}");
}
