//! netreap's eBPF programs. One object; the agent's probe table decides
//! which programs load on the running kernel.
#![no_std]
#![no_main]

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
