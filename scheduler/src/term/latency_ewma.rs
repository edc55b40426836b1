//! Latency EWMA: the worker's time-to-first-token average in ms, the latency a client
//! feels first. Unavailable until the worker has completed a request.

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct LatencyEwma;

impl Term for LatencyEwma {
    fn name(&self) -> TermName {
        TermName::LatencyEwma
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        let e = ctx.view.ewma_with_samples()?;
        (e.ttft_ms.is_finite() && e.ttft_ms >= 0.0).then_some(e.ttft_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;

    #[test]
    fn is_the_ttft_average_when_sampled() {
        let mut w = worker("w1");
        assert_eq!(raw(&LatencyEwma, &job("m"), &w, &Ledger::new()), None);
        w.ewma = Some(ewma(120.0, 20.0));
        assert_eq!(
            raw(&LatencyEwma, &job("m"), &w, &Ledger::new()),
            Some(120.0)
        );
        w.ewma.as_mut().unwrap().samples = 0;
        assert_eq!(raw(&LatencyEwma, &job("m"), &w, &Ledger::new()), None);
    }
}
