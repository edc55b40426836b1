//! metronome-dispatcher
