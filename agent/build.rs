//! Builds the eBPF object with the same builder as `cargo xtask build-ebpf`
//! (installing rust-src and bpf-linker on first use) and hands its path to
//! the agent, which embeds it. NETREAP_EBPF_OBJECT=<file> skips the build.

use std::{env, fs, path::PathBuf};

use xtask::{Workspace, ebpf};

fn main() {
    println!("cargo:rerun-if-env-changed=NETREAP_EBPF_OBJECT");
    let Some(out) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        panic!("cargo sets OUT_DIR for build scripts");
    };
    let object = if let Some(prebuilt) = env::var_os("NETREAP_EBPF_OBJECT") {
        PathBuf::from(prebuilt)
    } else {
        // This crate's directory as cargo gives it now (a moved checkout).
        let ws = env::var_os("CARGO_MANIFEST_DIR")
            .map_or_else(Workspace::locate, |dir| Workspace::of_member(&PathBuf::from(dir)));
        for path in ebpf::source_paths(&ws) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
        match ebpf::build(&ws) {
            Ok(object) => object,
            Err(e) => panic!("building the eBPF programs failed: {e}"),
        }
    };
    let dest = out.join("netreap-ebpf.o");
    if let Err(e) = fs::copy(&object, &dest) {
        panic!("cannot copy {} to {}: {e}", object.display(), dest.display());
    }
}
