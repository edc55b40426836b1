//! GPU utilisation and memory of the agent's GPU, for the heartbeat.
//!
//! One trait, two implementations: [`NvmlProbe`] reads NVML through nvml-wrapper, [`NoGpu`]
//! reports nothing. Invariant: a probe that cannot read the GPU returns `None` ("the
//! signal is unavailable"), never an invented number; a missing NVML library is logged once,
//! not on every heartbeat.

use std::sync::atomic::{AtomicBool, Ordering};

use metronome_protocol::GpuStats;
use nvml_wrapper::Nvml;

/// Source of GPU figures. Held as `Arc<dyn GpuProbe>`.
pub trait GpuProbe: Send + Sync {
    /// Current figures, or `None` when unavailable.
    fn sample(&self) -> Option<GpuStats>;
    /// Short description for logs (`nvml gpu 0`, `unavailable: ...`).
    fn describe(&self) -> String;
}

/// No GPU figures at all (a host without a GPU, or the simulator).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoGpu;

impl GpuProbe for NoGpu {
    fn sample(&self) -> Option<GpuStats> {
        None
    }
    fn describe(&self) -> String {
        "no gpu probe".into()
    }
}

/// NVML-backed probe of one GPU index.
pub struct NvmlProbe {
    nvml: Option<Nvml>,
    index: u32,
    init_error: Option<String>,
    warned: AtomicBool,
}

impl NvmlProbe {
    /// Load NVML. On a host without the NVIDIA driver this does not fail: the probe then
    /// reports unavailable, and says why once.
    pub fn new(index: u32) -> Self {
        match Nvml::init() {
            Ok(nvml) => {
                tracing::info!(gpu_index = index, "NVML loaded; GPU figures come from NVML");
                NvmlProbe {
                    nvml: Some(nvml),
                    index,
                    init_error: None,
                    warned: AtomicBool::new(false),
                }
            }
            Err(e) => {
                tracing::warn!(gpu_index = index, error = %e, "NVML unavailable: heartbeats carry no GPU figures");
                NvmlProbe {
                    nvml: None,
                    index,
                    init_error: Some(e.to_string()),
                    warned: AtomicBool::new(true),
                }
            }
        }
    }

    /// Whether NVML loaded.
    pub fn is_available(&self) -> bool {
        self.nvml.is_some()
    }

    fn read(&self, nvml: &Nvml) -> Result<GpuStats, nvml_wrapper::error::NvmlError> {
        let device = nvml.device_by_index(self.index)?;
        let util = device.utilization_rates()?;
        let mem = device.memory_info()?;
        Ok(GpuStats {
            util_frac: f64::from(util.gpu.min(100)) / 100.0,
            mem_used_bytes: mem.used,
            mem_total_bytes: mem.total,
        })
    }
}

impl GpuProbe for NvmlProbe {
    fn sample(&self) -> Option<GpuStats> {
        let nvml = self.nvml.as_ref()?;
        match self.read(nvml) {
            Ok(stats) => {
                self.warned.store(false, Ordering::Relaxed);
                Some(stats)
            }
            Err(e) => {
                // Warn on the first failure of a run of failures, not every second.
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(gpu_index = self.index, error = %e, "reading NVML failed: GPU figures unavailable");
                }
                None
            }
        }
    }

    fn describe(&self) -> String {
        match &self.init_error {
            None => format!("nvml gpu {}", self.index),
            Some(e) => format!("unavailable: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_reports_nothing() {
        assert_eq!(NoGpu.sample(), None);
    }

    /// On a host without an NVIDIA driver (as in CI) NVML fails to load: the probe must say
    /// "unavailable" without panicking. On a GPU host it must return plausible figures.
    #[test]
    fn nvml_probe_degrades_cleanly_or_reads_real_figures() {
        let probe = NvmlProbe::new(0);
        match probe.sample() {
            None => assert!(
                !probe.is_available() || probe.describe().starts_with("nvml"),
                "{}",
                probe.describe()
            ),
            Some(s) => {
                assert!(probe.is_available());
                assert!((0.0..=1.0).contains(&s.util_frac));
                assert!(s.mem_total_bytes > 0 && s.mem_used_bytes <= s.mem_total_bytes);
            }
        }
        if !probe.is_available() {
            assert!(probe.describe().starts_with("unavailable"));
            assert_eq!(probe.sample(), None, "stays unavailable");
        }
    }
}
