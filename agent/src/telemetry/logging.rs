//! tracing to stderr with an env filter; aya's `log` records join it.

use tracing_subscriber::EnvFilter;

/// Environment variable holding the log filter (e.g. `info,netreap=debug`).
pub const LOG_ENV: &str = "NETREAP_LOG";

pub fn init(default_level: &str) {
    let filter = EnvFilter::try_from_env(LOG_ENV).unwrap_or_else(|_| EnvFilter::new(default_level));
    let _ = tracing_log::LogTracer::init();
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
