//! `netreap config`: print the default configuration, or check a file.

use std::path::PathBuf;

use netreap::config::Config;

#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct ConfigArgs {
    /// Print the default configuration as TOML, every key commented.
    #[arg(long)]
    pub print_default: bool,
    /// Parse and validate FILE; on error, name the key and exit non-zero.
    #[arg(long, value_name = "FILE")]
    pub check: Option<PathBuf>,
}

pub fn main(args: &ConfigArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.check {
        let config = Config::from_file(path)?;
        config.validate().map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))?;
        println!("{}: ok", path.display());
    } else {
        print!("{}", Config::default().to_commented_toml());
    }
    Ok(())
}
