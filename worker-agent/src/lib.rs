//! metronome-worker-agent
