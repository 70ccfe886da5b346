//! One module per subcommand.

pub mod attachments;
pub mod config;
pub mod demo;
pub mod netns;
pub mod probes;
pub mod release;
pub mod run;
pub mod scan;
pub mod sources;
