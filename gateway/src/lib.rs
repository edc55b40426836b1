//! metronome-gateway
