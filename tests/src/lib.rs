//! metronome-e2e
