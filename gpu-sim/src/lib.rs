//! metronome-gpu-sim
