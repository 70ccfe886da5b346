//! One module per subcommand.

pub mod probes;
pub mod run;
