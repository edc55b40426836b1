//! Throughput EWMA: the worker's per-request output tokens/s. Higher is better, so the term
//! is inverted when normalised (the fastest candidate scores 0). Unavailable until the
//! worker has EWMA samples.

use metronome_protocol::TermName;

use super::{Term, TermContext};

pub struct ThroughputEwma;

impl Term for ThroughputEwma {
    fn name(&self) -> TermName {
        TermName::ThroughputEwma
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        ctx.view.ewma_with_samples()?.rate_estimate_tok_s()
    }

    fn higher_is_better(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;

    #[test]
    fn is_the_rate_and_prefers_higher() {
        let mut w = worker("w1");
        assert_eq!(raw(&ThroughputEwma, &job("m"), &w, &Ledger::new()), None);
        w.ewma = Some(ewma(100.0, 20.0));
        assert_eq!(
            raw(&ThroughputEwma, &job("m"), &w, &Ledger::new()),
            Some(50.0)
        );
        assert!(ThroughputEwma.higher_is_better());
    }
}
