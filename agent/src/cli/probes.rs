//! `netreap probes`: what loads on this kernel, and why the others do not.

use anyhow::Context as _;
use netreap::kernel::probes::{ProbeState, Probes};

#[derive(Debug, clap::Args)]
pub struct ProbesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn main(args: &ProbesArgs) -> anyhow::Result<()> {
    let probes = Probes::survey().context("surveying the eBPF probes")?;
    if args.json {
        let report = serde_json::json!({ "offsets": format!("{:?}", probes.offsets), "probes": probes.status });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("kernel struct offsets from BTF: {:?}", probes.offsets);
    println!("{:<24} {:<42} {:<12} detail", "probe", "attach point", "state");
    for s in &probes.status {
        let (state, detail) = match &s.state {
            ProbeState::Active => ("active", s.spec.observes.to_owned()),
            ProbeState::Unavailable(reason) if s.spec.required => ("FAILED", reason.clone()),
            ProbeState::Unavailable(reason) => {
                ("unavailable", format!("{reason}; fallback: {}", s.spec.fallback))
            }
        };
        println!("{:<24} {:<42} {:<12} {detail}", s.spec.program, s.spec.attach.to_string(), state);
    }
    Ok(())
}
