//! metronome-scheduler
