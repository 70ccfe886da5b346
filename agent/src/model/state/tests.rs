//! Unit tests of the model state machine.
