//! Wall-clock helper for the I/O edges. The scheduling core never reads a clock: callers
//! pass `now_ms` in, so every decision can be replayed.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
