use clap::Parser;

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml(text, Path::new("test.toml"))
}

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    flags: ConfigFlags,
}

#[test]
fn printed_default_parses_back_to_the_default_and_is_valid() {
    let text = Config::default().to_commented_toml();
    assert_eq!(parse(&text).expect("valid in this test"), Config::default(), "{text}");
    Config::default().validate().expect("valid in this test");
    assert!(text.contains("\n# Log filter"), "{text}");
    assert!(text.contains("in_flight_grace = \"30s\"\n"), "{text}");
    assert!(text.contains("orphan_grace = \"10m\"\n"), "{text}");
    assert!(text.contains("events_max_bytes = \"64MiB\"\n"), "{text}");
    assert!(text.contains("# node_name = \"worker-1\"\n"), "{text}");
    assert!(text.contains("# kubeconfig = \"/etc/kubernetes/kubelet.conf\"\n"), "{text}");
}

#[test]
fn every_field_is_documented_in_order() {
    let full = Config {
        node_name: Some("n".into()),
        kubeconfig: Some("/etc/k.conf".into()),
        cri_socket: Some("/s.sock".into()),
        ..Config::default()
    };
    let fields: Vec<String> = toml::Table::try_from(&full).expect("valid in this test").keys().cloned().collect();
    let documented: Vec<&str> = KEYS.iter().map(|(k, _, _)| *k).collect();
    let mut sorted = documented.clone();
    sorted.sort_unstable();
    // toml::Table sorts its keys; compare as sets, then check the text.
    assert_eq!(fields, sorted);
    let text = full.to_commented_toml();
    for key in documented {
        assert!(text.contains(&format!("\n{key} = ")), "{key} missing in\n{text}");
    }
}

#[test]
fn an_empty_file_is_the_default() {
    assert_eq!(parse("").expect("valid in this test"), Config::default());
}

#[test]
fn an_unknown_key_is_refused_by_name() {
    let err = parse("dry_run = true\nresync_intervall = \"5s\"\n").expect_err("must be refused");
    let msg = err.to_string();
    assert!(msg.contains("resync_intervall"), "{msg}");
    assert!(msg.contains("unknown field"), "{msg}");
    assert!(msg.contains("line 2"), "{msg}");
    assert!(msg.starts_with("config file test.toml"), "{msg}");
    assert_eq!(err.key(), Some("resync_intervall"));
}

#[test]
fn a_bad_duration_is_refused_by_key() {
    let err = parse("\n\nin_flight_grace = \"3 fortnights\"\n").expect_err("must be refused");
    let msg = err.to_string();
    assert!(msg.contains("key `in_flight_grace`"), "{msg}");
    assert!(msg.contains("invalid duration \"3 fortnights\""), "{msg}");
    assert!(msg.contains("line 3"), "{msg}");
}

#[test]
fn bad_types_and_sizes_are_refused_by_key() {
    for (text, key) in [
        ("dry_run = \"yes\"", "dry_run"),
        ("events_max_bytes = \"64 parsecs\"", "events_max_bytes"),
        ("events_max_bytes = -1", "events_max_bytes"),
        ("metrics_addr = \"localhost\"", "metrics_addr"),
        ("host_local_dirs = \"/one/string\"", "host_local_dirs"),
    ] {
        let err = parse(text).expect_err("must be refused");
        assert_eq!(err.key(), Some(key), "{text}: {err}");
    }
}

#[test]
fn sizes_accept_units() {
    assert_eq!(parse("events_max_bytes = \"512KiB\"").expect("valid in this test").events_max_bytes, 512 * 1024);
    assert_eq!(parse("events_max_bytes = 8192").expect("valid in this test").events_max_bytes, 8192);
    assert_eq!(parse_byte_size("1G"), Ok(1024 * MIB));
    assert!(parse_byte_size("99999999999999999999G").is_err());
}

#[test]
fn validation_names_the_key() {
    let cases = [
        ("state_dir = \"relative\"", "state_dir"),
        ("host_local_dirs = [\"/ok\", \"nope\"]", "host_local_dirs"),
        ("cni_bin_dirs = [\"opt/cni/bin\"]", "cni_bin_dirs"),
        ("cni_bin_dirs = []", "cni_bin_dirs"),
        ("events = \"\"", "events"),
        ("events_max_bytes = 10", "events_max_bytes"),
        ("events_keep = 1000", "events_keep"),
        ("orphan_grace = \"5s\"", "orphan_grace"),
        ("resync_interval = \"10ms\"", "resync_interval"),
        ("log = \"netreap=loud\"", "log"),
        ("node_name = \"\"", "node_name"),
    ];
    for (text, key) in cases {
        let err = parse(text).expect("valid in this test").validate().expect_err("must be refused");
        assert_eq!(err.key(), Some(key), "{text}: {err}");
        assert!(err.to_string().contains(&format!("`{key}`")), "{err}");
    }
}

#[test]
fn flags_override_the_file() {
    let dir = tempfile::tempdir().expect("valid in this test");
    let file = dir.path().join("netreap.toml");
    std::fs::write(
        &file,
        "dry_run = true\nevents = \"/var/log/netreap.jsonl\"\norphan_grace = \"20m\"\nhost_local_dirs = [\"/a\"]\n",
    )
    .expect("valid in this test");
    let cli = Cli::try_parse_from([
        "netreap".as_ref(),
        "--config".as_ref(),
        file.as_os_str(),
        "--dry-run=false".as_ref(),
        "--orphan-grace".as_ref(),
        "1h".as_ref(),
        "--host-local-dir".as_ref(),
        "/b".as_ref(),
        "--host-local-dir".as_ref(),
        "/c".as_ref(),
        "--events-max-bytes".as_ref(),
        "1MiB".as_ref(),
    ])
    .expect("valid in this test");
    let config = Config::load(&cli.flags).expect("valid in this test");
    assert!(!config.dry_run, "flag beats file");
    assert_eq!(config.orphan_grace, Duration::from_hours(1));
    assert_eq!(config.host_local_dirs, [PathBuf::from("/b"), PathBuf::from("/c")]);
    assert_eq!(config.events_max_bytes, MIB);
    assert_eq!(config.events, "/var/log/netreap.jsonl", "file beats default");
    assert_eq!(config.resync_interval, Duration::from_secs(30), "default stays");

    let bare = Cli::try_parse_from(["netreap", "--dry-run", "--in-flight-grace", "45s"]).expect("valid in this test");
    let mut config = Config::default();
    bare.flags.apply(&mut config);
    assert!(config.dry_run, "--dry-run alone means true");
    assert_eq!(config.in_flight_grace, Duration::from_secs(45));
}

#[test]
fn a_bad_flag_value_is_refused_by_clap() {
    let err = Cli::try_parse_from(["netreap", "--resync-interval", "often"]).expect_err("must be refused").to_string();
    assert!(err.contains("--resync-interval"), "{err}");
    assert!(err.contains("invalid duration"), "{err}");
}

#[test]
fn an_invalid_merged_config_is_refused_at_load() {
    let cli = Cli::try_parse_from(["netreap", "--orphan-grace", "1s"]).expect("valid in this test");
    let err = Config::load(&cli.flags).expect_err("must be refused");
    assert_eq!(err.key(), Some("orphan_grace"), "{err}");
}

#[test]
fn an_empty_node_name_from_the_downward_api_means_unset() {
    let mut config = Config::default();
    ConfigFlags { node_name: Some(String::new()), ..ConfigFlags::default() }.apply(&mut config);
    assert_eq!(config.node_name, None);
}

/// The `config.toml` block of deploy/configmap.yaml (a YAML literal block
/// indented by four spaces), so the shipped `ConfigMap` cannot drift from
/// the schema.
#[test]
fn the_deployed_configmap_is_a_valid_config() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/configmap.yaml");
    let yaml = std::fs::read_to_string(&path).expect("deploy/configmap.yaml");
    let mut block = String::new();
    for line in yaml
        .lines()
        .skip_while(|l| l.trim() != "config.toml: |")
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
    {
        block.push_str(line.get(4..).unwrap_or(""));
        block.push('\n');
    }
    assert!(block.contains("metrics_addr"), "config.toml block not found in {}", path.display());
    let config = Config::from_toml(&block, &path).unwrap_or_else(|e| panic!("{e}"));
    config.validate().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.metrics_addr.port(), 9742, "the DaemonSet's probes and port use 9742");
}

#[test]
fn a_missing_file_names_the_path() {
    let err = Config::from_file(Path::new("/nonexistent/netreap.toml")).expect_err("must be refused");
    assert!(err.to_string().contains("/nonexistent/netreap.toml"), "{err}");
}
