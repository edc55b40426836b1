//! The arrival plan: the list of requests of a run, each with its send time (seconds after
//! the run starts) and its token counts, computed before anything is sent.
//!
//! Computing the whole plan up front keeps the open loop honest (send times never depend on
//! responses) and makes a run reproducible: the same spec and seed give the same plan.
//! Invariants: `at_s` is non-decreasing, ids are `0..n` in plan order, token counts >= 1.
//!
//! Poisson arrivals draw exponential gaps (`-ln(1 - U) / rate`) from a ChaCha8 stream
//! seeded with `seed`; lengths come from separate streams of the same seed, so changing a
//! length distribution does not move the arrival times.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::dist::LengthDist;
use crate::error::LoadError;
use crate::prefixes::{multi_turn_plan, shared_prefix_plan, MultiTurn};
use crate::request::PlannedRequest;
use crate::spec::{LoadSpec, Workload};
use crate::trace::{load_trace, trace_stats, TraceRequest};

/// Builds the plan of a (validated) spec. Reads the trace file for trace workloads.
pub fn plan_requests(spec: &LoadSpec) -> Result<Vec<PlannedRequest>, LoadError> {
    spec.validate().map_err(LoadError::Invalid)?;
    Ok(match &spec.workload {
        Workload::Trace {
            path,
            time_scale,
            rate_rps,
            start_offset_s,
        } => {
            let trace = load_trace(path)?;
            let scaling = match (time_scale, rate_rps) {
                (_, Some(r)) => TraceScaling::Rate(*r),
                (Some(t), None) => TraceScaling::TimeScale(*t),
                (None, None) => TraceScaling::TimeScale(1.0),
            };
            trace_plan(
                &trace,
                *start_offset_s,
                spec.limit,
                scaling,
                spec.duration_s,
            )
        }
        Workload::Poisson {
            prompt_tokens,
            output_tokens,
            ..
        } if !spec.tenants.is_empty() => {
            let rates: Vec<f64> = spec.tenants.iter().map(|t| t.rate_rps).collect();
            tenants_plan(
                &rates,
                spec.seed,
                spec.limit,
                spec.duration_s,
                prompt_tokens,
                output_tokens,
            )
        }
        Workload::Poisson {
            rate_rps,
            prompt_tokens,
            output_tokens,
        } => poisson_plan(
            *rate_rps,
            spec.seed,
            spec.limit,
            spec.duration_s,
            prompt_tokens,
            output_tokens,
        ),
        Workload::SharedPrefix {
            rate_rps,
            groups,
            users_per_group,
            prefix_tokens,
            question_tokens,
            output_tokens,
        } => shared_prefix_plan(
            *rate_rps,
            *groups,
            *users_per_group,
            *prefix_tokens,
            question_tokens,
            output_tokens,
            spec.seed,
            spec.limit,
            spec.duration_s,
        ),
        Workload::MultiTurn {
            rate_rps,
            turns,
            system_tokens,
            user_tokens,
            output_tokens,
            think_s,
        } => multi_turn_plan(
            &MultiTurn {
                rate_rps: *rate_rps,
                turns: *turns,
                system_tokens: *system_tokens,
                user_tokens: *user_tokens,
                output_tokens: *output_tokens,
                think_s: *think_s,
            },
            spec.seed,
            spec.limit,
            spec.duration_s,
        ),
    })
}

/// How trace time maps to run time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TraceScaling {
    /// Multiply every offset by this factor.
    TimeScale(f64),
    /// Rescale so the mean arrival rate (over the selected requests) is this many req/s.
    Rate(f64),
}

/// Selects and rescales trace requests (order documented on [`Workload::Trace`]).
pub fn trace_plan(
    trace: &[TraceRequest],
    start_offset_s: f64,
    limit: Option<usize>,
    scaling: TraceScaling,
    duration_s: Option<f64>,
) -> Vec<PlannedRequest> {
    let mut selected: Vec<TraceRequest> = trace
        .iter()
        .filter(|r| r.offset_s >= start_offset_s)
        .copied()
        .collect();
    if let Some(n) = limit {
        selected.truncate(n);
    }
    let Some(first) = selected.first().map(|r| r.offset_s) else {
        return Vec::new();
    };
    let factor = match scaling {
        TraceScaling::TimeScale(t) => t,
        TraceScaling::Rate(target) => {
            let mean = trace_stats(&selected).mean_rate_rps;
            if mean > 0.0 {
                mean / target
            } else {
                1.0
            }
        }
    };
    selected
        .iter()
        .map(|r| (r.offset_s - first) * factor)
        .zip(selected.iter())
        .take_while(|(at, _)| duration_s.is_none_or(|d| *at < d))
        .enumerate()
        .map(|(i, (at_s, r))| PlannedRequest {
            id: i as u64,
            at_s,
            prompt_tokens: r.prompt_tokens.max(1),
            output_tokens: r.output_tokens.max(1),
            tenant: None,
            messages: Vec::new(),
        })
        .collect()
}

/// Poisson arrivals at `rate_rps` until `limit` requests or `duration_s` seconds, whichever
/// comes first (at least one of them must be set, else the plan is empty).
pub fn poisson_plan(
    rate_rps: f64,
    seed: u64,
    limit: Option<usize>,
    duration_s: Option<f64>,
    prompt: &LengthDist,
    output: &LengthDist,
) -> Vec<PlannedRequest> {
    if (limit.is_none() && duration_s.is_none()) || !rate_rps.is_finite() || rate_rps <= 0.0 {
        return Vec::new();
    }
    let mut arrivals = ChaCha8Rng::seed_from_u64(seed);
    arrivals.set_stream(0);
    let mut prompts = ChaCha8Rng::seed_from_u64(seed);
    prompts.set_stream(1);
    let mut outputs = ChaCha8Rng::seed_from_u64(seed);
    outputs.set_stream(2);
    let mut plan = Vec::new();
    let mut t = 0.0;
    loop {
        if limit.is_some_and(|n| plan.len() >= n) {
            break;
        }
        let u: f64 = arrivals.random();
        t += -(1.0 - u).ln() / rate_rps;
        if duration_s.is_some_and(|d| t >= d) {
            break;
        }
        plan.push(PlannedRequest {
            id: plan.len() as u64,
            at_s: t,
            prompt_tokens: prompt.sample(&mut prompts),
            output_tokens: output.sample(&mut outputs),
            tenant: None,
            messages: Vec::new(),
        });
    }
    plan
}

/// One Poisson stream per tenant (at `rates[i]`, tenant `i`), merged by arrival time and
/// numbered `0..n` in that order; `limit` applies to the merged plan. Each tenant's stream
/// has its own seed (derived from `seed` and its index), so adding a tenant does not move
/// the arrivals of the others.
pub fn tenants_plan(
    rates: &[f64],
    seed: u64,
    limit: Option<usize>,
    duration_s: Option<f64>,
    prompt: &LengthDist,
    output: &LengthDist,
) -> Vec<PlannedRequest> {
    let mut plan: Vec<PlannedRequest> = rates
        .iter()
        .enumerate()
        .flat_map(|(i, &rate)| {
            let tenant_seed = seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            poisson_plan(rate, tenant_seed, limit, duration_s, prompt, output)
                .into_iter()
                .map(move |r| PlannedRequest {
                    tenant: Some(i),
                    ..r
                })
        })
        .collect();
    // Stable: equal times keep tenant order, so the plan is reproducible.
    plan.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    if let Some(n) = limit {
        plan.truncate(n);
    }
    for (i, r) in plan.iter_mut().enumerate() {
        r.id = i as u64;
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(n: u32) -> LengthDist {
        LengthDist::Fixed(n)
    }

    #[test]
    fn poisson_mean_gap_matches_rate() {
        let plan = poisson_plan(20.0, 3, Some(20_000), None, &fixed(1), &fixed(1));
        assert_eq!(plan.len(), 20_000);
        let mean_gap = plan.last().unwrap().at_s / plan.len() as f64;
        // 1/rate = 50 ms; with 20k samples the standard error is ~0.35 ms.
        assert!((mean_gap - 0.05).abs() < 0.0025, "mean gap {mean_gap}");
        assert!(plan.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(plan.iter().enumerate().all(|(i, r)| r.id == i as u64));
    }

    #[test]
    fn tenants_get_their_own_rates_merged_in_time_order() {
        let plan = tenants_plan(&[20.0, 2.0], 5, None, Some(500.0), &fixed(3), &fixed(4));
        let count = |t| plan.iter().filter(|r| r.tenant == Some(t)).count() as f64;
        // 10 000 and 1 000 expected arrivals: within 5 % (over 3 standard errors).
        assert!((count(0) / 10_000.0 - 1.0).abs() < 0.05, "{}", count(0));
        assert!((count(1) / 1_000.0 - 1.0).abs() < 0.1, "{}", count(1));
        assert!(plan.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(plan.iter().enumerate().all(|(i, r)| r.id == i as u64));
        // Tenant 1's arrivals do not depend on whether tenant 0 floods.
        let alone = tenants_plan(&[20.0, 2.0], 5, None, Some(50.0), &fixed(3), &fixed(4));
        let quieter = tenants_plan(&[1.0, 2.0], 5, None, Some(50.0), &fixed(3), &fixed(4));
        let times = |p: &[PlannedRequest]| -> Vec<f64> {
            p.iter()
                .filter(|r| r.tenant == Some(1))
                .map(|r| r.at_s)
                .collect()
        };
        assert_eq!(times(&alone), times(&quieter));
        let limited = tenants_plan(&[20.0, 2.0], 5, Some(7), None, &fixed(3), &fixed(4));
        assert_eq!(limited.len(), 7);
    }

    #[test]
    fn poisson_is_deterministic_per_seed() {
        let d: LengthDist = "lognormal:mean=100,sigma=1".parse().unwrap();
        let a = poisson_plan(5.0, 11, Some(500), None, &d, &d);
        let b = poisson_plan(5.0, 11, Some(500), None, &d, &d);
        let c = poisson_plan(5.0, 12, Some(500), None, &d, &d);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn poisson_arrivals_do_not_depend_on_lengths() {
        let a = poisson_plan(5.0, 1, Some(100), None, &fixed(10), &fixed(10));
        let b = poisson_plan(
            5.0,
            1,
            Some(100),
            None,
            &"uniform:1,999".parse().unwrap(),
            &fixed(3),
        );
        let ta: Vec<f64> = a.iter().map(|r| r.at_s).collect();
        let tb: Vec<f64> = b.iter().map(|r| r.at_s).collect();
        assert_eq!(ta, tb);
    }

    #[test]
    fn poisson_duration_bounds_the_plan() {
        let plan = poisson_plan(50.0, 1, None, Some(2.0), &fixed(1), &fixed(1));
        assert!(plan.iter().all(|r| r.at_s < 2.0));
        assert!(plan.len() > 30 && plan.len() < 200, "{}", plan.len());
        let capped = poisson_plan(50.0, 1, Some(5), Some(2.0), &fixed(1), &fixed(1));
        assert_eq!(capped.len(), 5);
        assert!(poisson_plan(50.0, 1, None, None, &fixed(1), &fixed(1)).is_empty());
    }

    fn trace() -> Vec<TraceRequest> {
        [0.0, 1.0, 3.0, 4.0, 8.0]
            .iter()
            .enumerate()
            .map(|(i, &t)| TraceRequest {
                offset_s: t,
                prompt_tokens: 10 * (i as u32 + 1),
                output_tokens: i as u32 + 1,
            })
            .collect()
    }

    #[test]
    fn trace_time_scale() {
        let p = trace_plan(&trace(), 0.0, None, TraceScaling::TimeScale(0.5), None);
        let at: Vec<f64> = p.iter().map(|r| r.at_s).collect();
        assert_eq!(at, vec![0.0, 0.5, 1.5, 2.0, 4.0]);
        assert_eq!(p[4].prompt_tokens, 50);
    }

    #[test]
    fn trace_rate_rescale_keeps_shape() {
        // Mean rate of the trace: 4 gaps over 8 s = 0.5 req/s; target 2 req/s = 4x faster.
        let p = trace_plan(&trace(), 0.0, None, TraceScaling::Rate(2.0), None);
        let at: Vec<f64> = p.iter().map(|r| r.at_s).collect();
        assert_eq!(at, vec![0.0, 0.25, 0.75, 1.0, 2.0]);
    }

    #[test]
    fn trace_offset_limit_duration() {
        let p = trace_plan(&trace(), 1.0, Some(3), TraceScaling::TimeScale(1.0), None);
        let at: Vec<f64> = p.iter().map(|r| r.at_s).collect();
        assert_eq!(at, vec![0.0, 2.0, 3.0]);
        assert_eq!(p[0].prompt_tokens, 20);
        assert_eq!(p[0].id, 0);
        let d = trace_plan(&trace(), 0.0, None, TraceScaling::TimeScale(1.0), Some(4.0));
        assert_eq!(d.len(), 3);
        assert!(trace_plan(&trace(), 100.0, None, TraceScaling::TimeScale(1.0), None).is_empty());
    }
}
