//! What netreap tells the world: the JSON event stream and logs.

pub mod clock;
pub mod logging;
pub mod stream;
