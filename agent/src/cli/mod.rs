//! One module per subcommand.

pub mod config;
pub mod netns;
pub mod probes;
pub mod run;
