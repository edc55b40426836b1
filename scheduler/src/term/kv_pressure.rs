//! KV pressure: KV-cache occupancy (fraction, 0..=1+) after admitting this job.
//!
//! With a capacity in tokens: `(used_frac * capacity + unreported reserved KV + job KV) /
//! capacity`, counting booked jobs the same way the KV filter does. Without one (the server
//! exports only a percentage) the reported `used_frac` is still a signal, so it is used as
//! is. No KV metric at all: unavailable.

use metronome_protocol::TermName;

use super::{Term, TermContext};
use crate::load::kv_tokens_in_use;

pub struct KvPressure;

impl Term for KvPressure {
    fn name(&self) -> TermName {
        TermName::KvPressure
    }

    fn raw(&self, ctx: &TermContext<'_>) -> Option<f64> {
        let kv = ctx.view.status.kv?;
        match kv.capacity_tokens {
            Some(cap) if cap > 0 => {
                let used = kv_tokens_in_use(kv.used_frac, cap, ctx.load.unreported_kv_tokens);
                Some((used + ctx.job.kv_tokens_on(ctx.view.worker_id()) as f64) / cap as f64)
            }
            _ => kv
                .used_frac
                .is_finite()
                .then_some(kv.used_frac.clamp(0.0, 1.0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::Ledger;
    use metronome_protocol::KvUsage;

    #[test]
    fn projects_occupancy_after_admission() {
        let j = job("m"); // 200 KV tokens
        let mut w = worker("w1");
        w.status.kv = Some(KvUsage {
            used_frac: 0.25,
            capacity_tokens: Some(10_000),
        });
        let mut l = Ledger::new();
        l.reserve("w1", "a", 800, 0).unwrap();
        assert_eq!(raw(&KvPressure, &j, &w, &l), Some(0.35));
    }

    #[test]
    fn partial_or_missing_metric() {
        let mut w = worker("w1");
        w.status.kv = Some(KvUsage {
            used_frac: 0.4,
            capacity_tokens: None,
        });
        assert_eq!(raw(&KvPressure, &job("m"), &w, &Ledger::new()), Some(0.4));
        w.status.kv = None;
        assert_eq!(raw(&KvPressure, &job("m"), &w, &Ledger::new()), None);
    }
}
