//! The latest result of each probe, written by the probe loops ([`crate::probe`]) and read
//! by the heartbeat; its own module so that the shared state can hold it without
//! importing the probes, which read the shared state.

use std::sync::Mutex;

use metronome_protocol::GpuStats;

use crate::metrics_scrape::ServerLoad;

/// The latest result of each probe.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Probed {
    pub healthy: bool,
    pub load: ServerLoad,
    /// The lifecycle's count of jobs that ended on the server when `load` was read: the jobs that ended since are
    /// still in its running count.
    pub ended_at_scrape: u64,
    pub gpu: Option<GpuStats>,
}

/// Shared between the probe loops (writers) and the heartbeat (reader).
#[derive(Default)]
pub(crate) struct ProbeCache {
    latest: Mutex<Probed>,
}

impl ProbeCache {
    pub fn latest(&self) -> Probed {
        self.latest.lock().map(|p| *p).unwrap_or_default()
    }

    /// Record that the model server stopped answering; whether it was healthy until now.
    pub fn mark_unhealthy(&self) -> bool {
        let mut was = false;
        self.update(|p| {
            was = p.healthy;
            p.healthy = false;
        });
        was
    }

    pub fn update(&self, f: impl FnOnce(&mut Probed)) {
        if let Ok(mut p) = self.latest.lock() {
            f(&mut p);
        }
    }
}
