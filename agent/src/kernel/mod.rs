//! Evidence from the kernel's probes: BTF offsets, the probe table and
//! loader, ring-buffer decoding and the async record stream.

pub mod btf;
pub mod cni_runs;
pub mod events;
pub mod probes;
pub mod stream;
pub mod tracefs;
