//! End-to-end reclaim scenarios with the real CNI plugins and the real agent.

mod support;

use support::{
    kernel_tests_possible,
    lab::{Lab, cni_plugins_present},
};

#[test]
fn lab_drives_real_plugins() {
    if !kernel_tests_possible() || !cni_plugins_present() {
        return;
    }
    let lab = Lab::new("10.251.9.0/29");
    let net = lab.network("labnet", "host-local", &[]);
    let pod = lab.pod();
    let result = lab.add(&net, &pod).expect("ADD succeeds");
    let ip = result["ips"][0]["address"].as_str().expect("an address").to_owned();
    assert!(ip.starts_with("10.251.9."), "{ip}");
    assert_eq!(lab.reservations("labnet").len(), 1);
    assert!(lab.runtime.cache_path(&net, &pod.attachment()).unwrap().exists());
    lab.del(&net, &pod).expect("DEL succeeds");
    assert!(lab.reservations("labnet").is_empty());
    let failing = lab.network("failnet", "host-local", &["failing"]);
    let pod2 = lab.pod();
    assert!(lab.add(&failing, &pod2).is_err());
    assert!(!lab.runtime.cache_path(&failing, &pod2.attachment()).unwrap().exists(), "no cache after a failed ADD");
    assert_eq!(lab.reservations("failnet").len(), 1, "host-local keeps the IP: the leak");
    assert!(lab.del(&failing, &pod2).is_err());
    assert_eq!(lab.reservations("failnet").len(), 1, "a failed DEL stops the chain: still leaked");
}
