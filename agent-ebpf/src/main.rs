//! netreap's eBPF programs. One object; the agent's probe table decides
//! which programs load on the running kernel.
#![no_std]
#![no_main]
// BPF has no calls across programs worth their cost and the verifier needs
// helpers' bounds in the caller's frame: the helpers here are always inlined.
#![expect(clippy::inline_always, reason = "BPF helpers are inlined on purpose (verifier bounds, no call overhead)")]
// aya's program macros hand each context by value.
#![expect(clippy::needless_pass_by_value, reason = "aya's program macros pass contexts by value")]

mod cni;
mod emit;
mod kernel;
mod netns;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // eBPF programs cannot unwind; the verifier proves this is never reached.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
