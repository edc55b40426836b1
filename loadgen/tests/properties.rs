//! Properties of the pure parts: percentiles, summaries and plans.

use metronome_loadgen::stats::{percentile, sorted_finite};
use metronome_loadgen::{
    poisson_plan, summarize, trace_plan, ErrorKind, LengthDist, RequestRecord, Slo, TraceRequest,
    TraceScaling,
};
use proptest::prelude::*;

fn record() -> impl Strategy<Value = RequestRecord> {
    (
        any::<bool>(),
        0.0f64..100.0,
        0.0f64..5000.0,
        0.0f64..20_000.0,
        0u32..500,
        0u8..4,
    )
        .prop_map(|(ok, sent_s, ttft, decode, tokens, kind)| {
            let mut r = RequestRecord {
                ok,
                sent_s,
                scheduled_s: sent_s,
                ttft_ms: Some(ttft),
                e2e_ms: Some(ttft + decode),
                output_tokens: tokens,
                ..Default::default()
            };
            if !ok {
                r.error_kind = Some(
                    [
                        ErrorKind::Http,
                        ErrorKind::Dropped,
                        ErrorKind::Timeout,
                        ErrorKind::Stream,
                    ][kind as usize],
                );
            }
            r.derive_rates();
            r
        })
}

proptest! {
    #[test]
    fn percentile_is_an_observed_value_and_monotonic(
        v in prop::collection::vec(-1e6f64..1e6, 1..200),
        p in 0.0f64..100.0,
        q in 0.0f64..100.0,
    ) {
        let x = percentile(&v, p).unwrap();
        prop_assert!(v.contains(&x));
        let (lo, hi) = if p <= q { (p, q) } else { (q, p) };
        prop_assert!(percentile(&v, lo).unwrap() <= percentile(&v, hi).unwrap());
        let s = sorted_finite(&v);
        prop_assert_eq!(percentile(&v, 100.0), s.last().copied());
    }

    #[test]
    fn summary_counts_add_up(recs in prop::collection::vec(record(), 0..100), ttft in 0.0f64..5000.0, tok in 0.0f64..200.0) {
        let s = summarize(&recs, Slo { ttft_ms: ttft, tok_s: tok });
        prop_assert_eq!(s.count, recs.len());
        prop_assert_eq!(s.ok + s.errors, s.count);
        prop_assert!(s.good <= s.ok);
        prop_assert_eq!(s.errors_by_kind.values().sum::<usize>(), s.errors);
        prop_assert!((0.0..=1.0).contains(&s.goodput_share));
        if let (Some(p50), Some(p99)) = (s.e2e_ms.p50, s.e2e_ms.p99) {
            prop_assert!(p50 <= p99);
        }
        if let (Some(t), Some(e)) = (s.ttft_ms.p50, s.e2e_ms.max) {
            prop_assert!(t <= e);
        }
    }

    #[test]
    fn poisson_plans_are_ordered_and_bounded(rate in 0.1f64..1000.0, seed: u64, n in 1usize..300, d in 0.1f64..100.0) {
        let plan = poisson_plan(rate, seed, Some(n), Some(d), &LengthDist::Fixed(3), &"uniform:1,50".parse().unwrap());
        prop_assert!(plan.len() <= n);
        prop_assert!(plan.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        prop_assert!(plan.iter().all(|r| r.at_s < d && (1..=50).contains(&r.output_tokens)));
        prop_assert!(plan.iter().enumerate().all(|(i, r)| r.id == i as u64));
    }

    #[test]
    fn rate_rescale_hits_the_target_mean_rate(gaps in prop::collection::vec(0.001f64..10.0, 2..100), target in 0.1f64..100.0) {
        let mut t = 0.0;
        let trace: Vec<TraceRequest> = std::iter::once(0.0).chain(gaps.iter().copied()).map(|g| {
            t += g;
            TraceRequest { offset_s: t, prompt_tokens: 1, output_tokens: 1 }
        }).collect();
        let plan = trace_plan(&trace, 0.0, None, TraceScaling::Rate(target), None);
        prop_assert_eq!(plan.len(), trace.len());
        let rate = (plan.len() - 1) as f64 / plan.last().unwrap().at_s;
        prop_assert!((rate - target).abs() / target < 1e-6, "rate {} target {}", rate, target);
    }
}
