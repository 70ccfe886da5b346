//! What netreap tells the world: the JSON event stream, logs, metrics and
//! the HTTP endpoints (health, readiness, state).

pub mod clock;
pub mod event;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod state_stream;
pub mod stream;
