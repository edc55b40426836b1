//! KV headroom, reservations included: a job may occupy `prompt + max_tokens` KV tokens
//! (less the cached prefix blocks a running job on the worker already holds,
//! [`crate::JobRequest::kv_tokens_on`]),
//! and a full KV cache makes the model server preempt running requests (the worst latency
//! cliff). Admit only while
//!
//! `used_frac * capacity + unreported reserved KV + job KV <= capacity * (1 - kv_headroom_frac)`.
//!
//! Only reservations the worker has not listed yet are added: listed ones are in its
//! reported usage. When the worker reports no KV capacity in tokens, this filter cannot
//! judge and passes; the `kv_pressure` term then says the signal is unavailable or partial.

use metronome_protocol::RejectionCode;

use super::{Filter, FilterContext};
use crate::load::kv_tokens_in_use;

pub struct KvHeadroom;

/// Whether `job` could fit on `view` once everything running there had finished: `None`
/// when the worker reports no KV capacity in tokens (then nobody can tell). A job that fits
/// no worker even empty will never be placed, and waiting for one only holds its client.
pub fn fits_when_empty(
    view: &crate::WorkerView,
    job: &crate::JobRequest,
    config: &crate::SchedulerConfig,
) -> Option<bool> {
    let capacity = view.status.kv?.capacity_tokens?;
    let limit = capacity as f64 * (1.0 - config.kv_headroom_frac);
    Some(job.kv_tokens() as f64 <= limit)
}

impl Filter for KvHeadroom {
    fn code(&self) -> RejectionCode {
        RejectionCode::InsufficientKv
    }

    fn check(&self, ctx: &FilterContext<'_>) -> Result<(), String> {
        let Some(kv) = ctx.view.status.kv else {
            return Ok(());
        };
        let Some(capacity) = kv.capacity_tokens else {
            return Ok(());
        };
        let used = kv_tokens_in_use(kv.used_frac, capacity, ctx.load.unreported_kv_tokens);
        let need_tokens = ctx.job.kv_tokens_on(ctx.view.worker_id());
        let need = need_tokens as f64;
        let limit = capacity as f64 * (1.0 - ctx.config.kv_headroom_frac);
        if used + need > limit {
            Err(format!(
                "insufficient KV: {:.0} used + {} reserved + {} needed > {:.0} usable of {} tokens ({}% kept free)",
                used - ctx.load.unreported_kv_tokens as f64,
                ctx.load.unreported_kv_tokens,
                need_tokens,
                limit,
                capacity,
                ctx.config.kv_headroom_frac * 100.0
            ))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use crate::{Ledger, SchedulerConfig};
    use metronome_protocol::KvUsage;

    #[test]
    fn a_job_fits_when_empty_only_within_the_usable_capacity() {
        let config = SchedulerConfig::default(); // 5 % headroom
        let j = job("m"); // 200 KV tokens
        let mut w = worker("w1");
        w.status.kv = None;
        assert_eq!(fits_when_empty(&w, &j, &config), None, "no KV reported");
        w.status.kv = Some(KvUsage {
            used_frac: 0.0,
            capacity_tokens: None,
        });
        assert_eq!(
            fits_when_empty(&w, &j, &config),
            None,
            "no capacity reported"
        );
        w.status.kv = Some(KvUsage {
            used_frac: 1.0,
            capacity_tokens: Some(211),
        });
        assert_eq!(
            fits_when_empty(&w, &j, &config),
            Some(true),
            "full now, fits empty"
        );
        w.status.kv = Some(KvUsage {
            used_frac: 0.0,
            capacity_tokens: Some(210),
        });
        assert_eq!(
            fits_when_empty(&w, &j, &config),
            Some(false),
            "199.5 usable"
        );
    }

    #[test]
    fn rejects_when_reservations_fill_the_cache() {
        let config = SchedulerConfig::default(); // 5 % headroom: 9 500 of 10 000 usable
        let j = job("m"); // 200 KV tokens
        let mut w = worker("w1");
        w.status.kv = Some(KvUsage {
            used_frac: 0.5,
            capacity_tokens: Some(10_000),
        });
        let mut l = Ledger::new();
        l.reserve("w1", "a", 4_300, 0).unwrap();
        assert_eq!(
            check(&KvHeadroom, &j, &w, &l, &config),
            Ok(()),
            "9 500 exactly fits"
        );
        l.reserve("w1", "b", 1, 0).unwrap();
        assert_eq!(
            check(&KvHeadroom, &j, &w, &l, &config),
            Err("insufficient KV: 5000 used + 4301 reserved + 200 needed > 9500 usable of 10000 tokens (5% kept free)".into())
        );
        // Once the worker lists the jobs, their KV is part of used_frac and not added again.
        w.status.in_flight = vec!["a".into(), "b".into()];
        assert_eq!(check(&KvHeadroom, &j, &w, &l, &config), Ok(()));
    }

    #[test]
    fn unknown_capacity_passes() {
        let mut w = worker("w1");
        w.status.kv = None;
        assert_eq!(check_default(&KvHeadroom, &job("m"), &w), Ok(()));
        w.status.kv = Some(KvUsage {
            used_frac: 0.99,
            capacity_tokens: None,
        });
        assert_eq!(check_default(&KvHeadroom, &job("m"), &w), Ok(()));
    }

    #[test]
    fn a_job_larger_than_the_cache_never_fits() {
        let mut j = job("m");
        j.prompt_tokens = 20_000;
        assert!(check_default(&KvHeadroom, &j, &worker("w1")).is_err());
    }
}
