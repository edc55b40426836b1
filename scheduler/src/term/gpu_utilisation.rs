//! GPU utilisation (fraction, 0..=1) from NVML: a tie-breaker that notices a GPU busy with
//! work the scheduler does not see (another tenant, a long prefill). Unavailable when the
//! host has no NVML.

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct GpuUtilisation;

impl Term for GpuUtilisation {
    fn name(&self) -> TermName {
        TermName::GpuUtilisation
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        let g = ctx.view.status.gpu?;
        g.util_frac
            .is_finite()
            .then_some(g.util_frac.clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;
    use metronome_protocol::GpuStats;

    #[test]
    fn is_the_nvml_figure_when_present() {
        let mut w = worker("w1");
        assert_eq!(raw(&GpuUtilisation, &job("m"), &w, &Ledger::new()), None);
        w.status.gpu = Some(GpuStats {
            util_frac: 0.8,
            mem_used_bytes: 1,
            mem_total_bytes: 2,
        });
        assert_eq!(
            raw(&GpuUtilisation, &job("m"), &w, &Ledger::new()),
            Some(0.8)
        );
    }
}
