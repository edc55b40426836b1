//! metronome-loadgen
