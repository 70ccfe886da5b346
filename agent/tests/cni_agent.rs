//! The agent's CNI-run filter end to end: a forged `CNI_COMMAND=DEL` from a
//! process that is not a CNI plugin is reported (event, metric, log) and
//! changes nothing the agent shows. Host only (an agent start and /state
//! polling under emulation prove nothing more than tests/cni_ledger.rs).

#![allow(clippy::unwrap_used, reason = "tests panic with context")]

mod support;

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
