//! `netreap probes`: what loads on this kernel, and why the others do not.

use anyhow::Context as _;
use netreap::kernel::probes::{Implementation, ProbeState, Probes};

#[derive(Debug, clap::Args)]
pub struct ProbesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Load the older kernels' variants (the tail-call environment scan)
    /// even where the kernel accepts the newer programs.
    #[arg(long)]
    pub variants: bool,
}

pub fn main(args: &ProbesArgs) -> anyhow::Result<()> {
    let probes =
        if args.variants { Probes::load_variants() } else { Probes::survey() }.context("surveying the eBPF probes")?;
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
            ProbeState::Unavailable(reason) => ("unavailable", format!("{reason}; fallback: {}", s.spec.fallback)),
        };
        println!("{:<24} {:<42} {:<12} {detail}", s.spec.program, s.spec.attach.to_string(), state);
    }
    for s in &probes.status {
        if let Some(i) = &s.implementation {
            print_implementation(s.spec.program, i);
        }
    }
    Ok(())
}

/// Which implementation of a probe with variants runs, and what it costs.
fn print_implementation(program: &str, i: &Implementation) {
    match (i.active, &i.primary_refused) {
        (Some(active), None) => println!("{program}: environment scan: {active}"),
        (Some(active), Some(why)) => {
            println!("{program}: environment scan: {active} (bpf_loop not used: {why})");
        }
        (None, _) => println!("{program}: environment scan: NONE"),
    }
    if let Some(why) = &i.variant_refused {
        println!("  tail_calls refused: {why}");
    }
    if let Some(note) = i.note {
        let label = if i.active.is_some() { "limits" } else { "lost" };
        println!("  {label}: {note}");
    }
}
