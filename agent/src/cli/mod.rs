//! One module per subcommand.

pub mod config;
pub mod probes;
pub mod run;
