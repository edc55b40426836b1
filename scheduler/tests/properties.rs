//! Invariants of the scheduling core, checked on generated pools:
//! the winner passes every filter; the decision does not depend on the order of the
//! workers; reserving only winners never takes a worker past its cap; an EWMA stays within
//! the range of its samples; N simultaneous jobs on N idle equal workers land on N distinct
//! workers; re-scoring a recorded decision reproduces it; a refusal that
//! [`filter::refuses_every_job_of_the_model`] names refuses every job of the model.
//! Baseline policies pick a worker that passes the eligibility filters whenever one exists,
//! whatever the order of the workers.

use metronome_protocol::{
    AffinityOutcome, CandidateScore, Decision, GpuStats, KvUsage, Outcome, PrefixSource,
    WorkerStatus, DECISION_VERSION,
};
use metronome_scheduler::filter::{self, FilterContext};
use metronome_scheduler::policy::{choose, PolicyKind, PolicyState};
use metronome_scheduler::prefix_index::Cached;
use metronome_scheduler::{
    evaluate, ewma, rescore, EwmaSnapshot, Forecast, JobRequest, Ledger, PrefixLookup,
    SchedulerConfig, WorkerLoad, WorkerView,
};
use proptest::prelude::*;

const NOW: u64 = 10_000_000;

#[derive(Debug, Clone)]
struct WorkerSpec {
    healthy: bool,
    draining: bool,
    other_model: bool,
    max_concurrency: u32,
    active: u32,
    queued: u32,
    kv: Option<(f64, Option<u64>)>,
    gpu: Option<f64>,
    ewma: Option<(f64, f64, u64)>,
    heartbeat_age_ms: u64,
    /// Reservations on this worker: (kv tokens, listed in the heartbeat's in_flight).
    reservations: Vec<(u64, bool)>,
}

fn worker_spec() -> impl Strategy<Value = WorkerSpec> {
    (
        (
            prop::bool::weighted(0.9),
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.15),
        ),
        (0u32..8, 0u32..10, 0u32..5),
        prop::option::of((0.0f64..1.0, prop::option::of(1_000u64..50_000))),
        prop::option::of(0.0f64..1.0),
        prop::option::of((1.0f64..2_000.0, 1.0f64..100.0, 0u64..3)),
        prop_oneof![4 => 0u64..3_000, 1 => 3_000u64..10_000],
        prop::collection::vec((1u64..5_000, any::<bool>()), 0..5),
    )
        .prop_map(
            |(
                (healthy, draining, other_model),
                (max_concurrency, active, queued),
                kv,
                gpu,
                ewma,
                age,
                reservations,
            )| {
                WorkerSpec {
                    healthy,
                    draining,
                    other_model,
                    max_concurrency,
                    active,
                    queued,
                    kv,
                    gpu,
                    ewma,
                    heartbeat_age_ms: age,
                    reservations,
                }
            },
        )
}

fn build(specs: &[WorkerSpec]) -> (Vec<WorkerView>, Ledger) {
    let mut ledger = Ledger::new();
    let workers = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let id = format!("w{i:02}");
            let mut in_flight = Vec::new();
            for (k, (kv, listed)) in s.reservations.iter().enumerate() {
                let job = format!("{id}-r{k}");
                ledger.reserve(&id, &job, *kv, NOW - 100).unwrap();
                if *listed {
                    in_flight.push(job);
                }
            }
            WorkerView {
                status: WorkerStatus {
                    v: 1,
                    worker_id: id,
                    model: if s.other_model {
                        "other".into()
                    } else {
                        "m".into()
                    },
                    node: None,
                    gpu_index: None,
                    healthy: s.healthy,
                    draining: s.draining,
                    max_concurrency: s.max_concurrency,
                    active: s.active,
                    queued: s.queued,
                    in_flight,
                    kv: s.kv.map(|(used_frac, capacity_tokens)| KvUsage {
                        used_frac,
                        capacity_tokens,
                    }),
                    gpu: s.gpu.map(|util_frac| GpuStats {
                        util_frac,
                        mem_used_bytes: 0,
                        mem_total_bytes: 1,
                    }),
                    prefill_pending_tokens: 0,
                    perf: None,
                    decoding: None,
                    seq: 1,
                    sent_ms: NOW,
                    max_epoch: 0,
                },
                last_seen_ms: NOW - s.heartbeat_age_ms,
                ewma: s.ewma.map(|(ttft_ms, tpot_ms, samples)| EwmaSnapshot {
                    ttft_ms,
                    tpot_ms,
                    tok_s: 1000.0 / tpot_ms,
                    e2e_ms: ttft_ms + 100.0 * tpot_ms,
                    samples,
                    updated_ms: NOW,
                }),
                not_provisioned: None,
            }
        })
        .collect();
    (workers, ledger)
}

/// A job, fingerprinted in half the cases, with part of its prompt cached on some workers
/// (so prefix affinity takes part in the decisions the properties check).
fn job_strategy() -> impl Strategy<Value = JobRequest> {
    let held = prop::collection::btree_map(0usize..10, 1u32..4_000, 0..5);
    (
        1u32..4_000,
        1u32..2_000,
        0.0f64..3_000.0,
        prop::option::of(held),
    )
        .prop_map(|(prompt_tokens, max_tokens, pred, held)| JobRequest {
            job_id: "job".into(),
            model: "m".into(),
            prompt_tokens,
            max_tokens,
            predicted_output_tokens: pred,
            slo: metronome_protocol::Slo {
                ttft_ms: 2_000,
                min_tok_s: 30.0,
            },
            ttft_remaining_ms: Some(2_000.0),
            prefix: held.map(|held| {
                PrefixLookup::new(
                    PrefixSource::Placements,
                    held.into_iter().map(|(w, tokens)| {
                        let tokens = tokens.min(prompt_tokens.saturating_sub(1));
                        (
                            format!("w{w:02}"),
                            Cached {
                                tokens,
                                shared_tokens: 0,
                            },
                        )
                    }),
                )
            }),
        })
}

/// A job without a prefix fingerprint.
fn plain_job_strategy() -> impl Strategy<Value = JobRequest> {
    job_strategy().prop_map(|job| JobRequest {
        prefix: None,
        ..job
    })
}

fn config_strategy() -> impl Strategy<Value = SchedulerConfig> {
    (
        1.0f64..200.0,
        0.0f64..2.0,
        0.0f64..0.3,
        prop::array::uniform7(0.0f64..2.0),
    )
        .prop_map(|(slo, per_stream, headroom, w)| {
            let mut c = SchedulerConfig {
                kv_headroom_frac: headroom,
                default_max_concurrency: 3,
                ..SchedulerConfig::default()
            };
            c.slo.min_tok_s = slo;
            c.perf_prior.step_per_stream_ms = per_stream;
            c.weights.active_requests = w[0];
            c.weights.queue_depth = w[1];
            c.weights.latency_ewma = w[2];
            c.weights.job_cost = w[3];
            c.weights.throughput_ewma = w[4];
            c.weights.kv_pressure = w[5];
            c.weights.gpu_utilisation = w[6];
            c
        })
}

fn passes_admission(
    job: &JobRequest,
    view: &WorkerView,
    ledger: &Ledger,
    config: &SchedulerConfig,
) -> bool {
    let load = WorkerLoad::of(view, ledger, config);
    let forecast = std::cell::OnceCell::from(Forecast::of(job, view, &load, ledger, config));
    let ctx = FilterContext {
        job,
        view,
        load: &load,
        ledger,
        forecast: &forecast,
        config,
        now_ms: NOW,
    };
    filter::apply(&filter::ADMISSION, &ctx).is_ok()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_winner_passes_every_filter(
        specs in prop::collection::vec(worker_spec(), 0..12),
        job in job_strategy(),
        config in config_strategy(),
    ) {
        let (workers, ledger) = build(&specs);
        let e = evaluate(&job, &workers, &ledger, &config, NOW);
        prop_assert_eq!(e.candidates.len() + e.rejected.len(), workers.len());
        prop_assert_eq!(e.winner.is_some(), !e.candidates.is_empty());
        for w in &workers {
            let eligible = passes_admission(&job, w, &ledger, &config);
            let listed = e.candidates.iter().any(|c| c.worker_id == w.status.worker_id);
            prop_assert_eq!(eligible, listed, "worker {}", w.status.worker_id);
        }
        if let Some(winner) = &e.winner {
            prop_assert_eq!(&e.candidates[0].worker_id, winner);
            let view = workers.iter().find(|w| &w.status.worker_id == winner).unwrap();
            prop_assert!(passes_admission(&job, view, &ledger, &config));
            // The lowest total wins, unless prefix affinity gave the job to a holder of the
            // prompt: then the decision's affinity record names the winner, chosen, and the
            // winner holds more of the prompt than the best-scored candidate.
            let best = e.candidates.iter().min_by(|a, b| a.total.total_cmp(&b.total)).unwrap();
            let cached = |c: &CandidateScore| c.cached_prefix.map_or(0, |p| p.tokens);
            if best.total < e.candidates[0].total {
                let record = e.affinity.as_ref().filter(|a| a.outcome == AffinityOutcome::Chosen);
                prop_assert!(record.is_some(), "promoted without a chosen record: {:?}", e.affinity);
                prop_assert!(cached(&e.candidates[0]) > cached(best));
            }
            if let Some(a) = e.affinity.as_ref().filter(|a| a.outcome == AffinityOutcome::Chosen) {
                prop_assert_eq!(&a.worker_id, winner);
            }
            for c in &e.candidates[1..] {
                prop_assert!(c.total >= best.total);
                for t in &c.terms(&e.scoring) {
                    prop_assert!((0.0..=1.0).contains(&t.normalised), "{:?}", t);
                    prop_assert_eq!(t.available, t.raw.is_some());
                }
            }
        }
    }

    #[test]
    fn a_refusal_for_every_job_of_the_model_refuses_every_job_of_the_model(
        specs in prop::collection::vec(worker_spec(), 0..12),
        a in job_strategy(),
        b in job_strategy(),
        b_waited in prop::option::of(0.0f64..2_000.0),
        config in config_strategy(),
    ) {
        // What lets the engine skip the jobs behind a head that every worker refused with
        // such a code: a job of another size, SLO budget or wait meets the same refusal.
        let (workers, ledger) = build(&specs);
        let b = JobRequest { ttft_remaining_ms: b_waited, ..b };
        let ea = evaluate(&a, &workers, &ledger, &config, NOW);
        let eb = evaluate(&b, &workers, &ledger, &config, NOW);
        for r in &ea.rejected {
            if filter::refuses_every_job_of_the_model(r.code) {
                let same = eb.rejected.iter().find(|x| x.worker_id == r.worker_id);
                prop_assert_eq!(same.map(|x| x.code), Some(r.code), "worker {}", r.worker_id);
            }
        }
        let saturated = ea.rejected.len() == workers.len()
            && ea.rejected.iter().all(|r| filter::refuses_every_job_of_the_model(r.code));
        if saturated {
            prop_assert!(eb.winner.is_none());
        }
        // The cheap look says the same, with the same code for each worker.
        let cheap = filter::refused_whatever_the_job(&filter::ADMISSION, &a, &workers, &ledger, &config, NOW);
        prop_assert_eq!(cheap.is_some(), saturated);
        if let Some(codes) = cheap {
            for (w, code) in workers.iter().zip(codes) {
                let r = ea.rejected.iter().find(|r| r.worker_id == w.status.worker_id);
                prop_assert_eq!(r.map(|r| r.code), Some(code), "worker {}", w.status.worker_id);
            }
        }
    }

    #[test]
    fn the_decision_ignores_worker_order(
        // Each generated worker appears 1 to 3 times, so exact ties (broken by active count
        // and worker id) are common.
        (specs, shuffled) in (prop::collection::vec(worker_spec(), 1..6), 1usize..4).prop_flat_map(|(base, copies)| {
            let specs: Vec<WorkerSpec> = base.iter().flat_map(|s| std::iter::repeat_n(s.clone(), copies)).collect();
            let order: Vec<usize> = (0..specs.len()).collect();
            (Just(specs), Just(order).prop_shuffle())
        }),
        job in job_strategy(),
        config in config_strategy(),
    ) {
        let (workers, ledger) = build(&specs);
        let permuted: Vec<WorkerView> = shuffled.iter().map(|&i| workers[i].clone()).collect();
        let a = evaluate(&job, &workers, &ledger, &config, NOW);
        let b = evaluate(&job, &permuted, &ledger, &config, NOW);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn reserving_winners_never_overcommits(
        specs in prop::collection::vec(worker_spec(), 1..8),
        jobs in prop::collection::vec((job_strategy(), prop::option::of(any::<prop::sample::Index>())), 1..40),
        config in config_strategy(),
    ) {
        // Start from workers within their caps (the property is about what the scheduler adds).
        let specs: Vec<WorkerSpec> = specs
            .into_iter()
            .map(|mut s| {
                let cap = config.max_concurrency(s.max_concurrency);
                s.active = s.active.min(cap);
                s.reservations.clear();
                s
            })
            .collect();
        let (workers, mut ledger) = build(&specs);
        let mut booked: Vec<String> = Vec::new();
        for (n, (mut job, release)) in jobs.into_iter().enumerate() {
            // Interleave completions so capacity frees up and is reused.
            if let Some(ix) = release {
                if !booked.is_empty() {
                    let j = booked.swap_remove(ix.index(booked.len()));
                    prop_assert!(ledger.release(&j).is_some());
                }
            }
            job.job_id = format!("job-{n}");
            let e = evaluate(&job, &workers, &ledger, &config, NOW);
            if let Some(w) = e.winner {
                ledger.reserve(&w, &job.job_id, job.kv_tokens(), NOW).unwrap();
                booked.push(job.job_id);
            }
            for w in &workers {
                let load = WorkerLoad::of(w, &ledger, &config);
                prop_assert!(
                    load.effective_active <= load.max_concurrency,
                    "{} at {} > cap {}", w.status.worker_id, load.effective_active, load.max_concurrency
                );
            }
        }
    }

    #[test]
    fn ewma_stays_within_its_samples(
        samples in prop::collection::vec((-1e6f64..1e6, 0.0f64..10_000.0), 1..50),
        base_alpha in 0.0f64..=1.0,
        half_life in prop_oneof![Just(0.0), 1.0f64..10_000.0],
    ) {
        let mut value: Option<f64> = None;
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for (sample, dt) in samples {
            lo = lo.min(sample);
            hi = hi.max(sample);
            let alpha = ewma::decayed_alpha(base_alpha, half_life, dt);
            prop_assert!((0.0..=1.0).contains(&alpha));
            let next = ewma::update(value, sample, alpha);
            if let Some(prev) = value {
                prop_assert!(next >= prev.min(sample) && next <= prev.max(sample));
            }
            prop_assert!(next >= lo && next <= hi, "{} outside [{}, {}]", next, lo, hi);
            value = Some(next);
        }
    }

    #[test]
    fn a_burst_lands_on_distinct_idle_workers(
        n in 2usize..=16,
        template in worker_spec(),
        // Prefix-free: a burst of one cached prompt goes to its holder, up to a fair share.
        job in plain_job_strategy(),
        config in config_strategy(),
        order in Just((0..16usize).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        // N identical, idle, healthy workers with room for every job of the burst.
        let mut spec = template;
        spec.healthy = true;
        spec.draining = false;
        spec.other_model = false;
        spec.active = 0;
        spec.queued = 0;
        spec.heartbeat_age_ms = 0;
        spec.reservations.clear();
        spec.max_concurrency = spec.max_concurrency.max(1);
        if spec.kv.is_some() {
            spec.kv = Some((0.0, Some(1_000_000)));
        }
        let (workers, mut ledger) = build(&vec![spec; n]);
        let workers: Vec<WorkerView> =
            order.iter().filter(|&&i| i < n).map(|&i| workers[i].clone()).collect();
        let mut winners = std::collections::BTreeSet::new();
        for k in 0..n {
            let job = JobRequest { job_id: format!("burst-{k}"), ..job.clone() };
            let e = evaluate(&job, &workers, &ledger, &config, NOW);
            let w = e.winner.expect("an idle worker is eligible");
            ledger.reserve(&w, &job.job_id, job.kv_tokens(), NOW).unwrap();
            prop_assert!(winners.insert(w.clone()), "{} chosen twice", w);
        }
        prop_assert_eq!(winners.len(), n);
    }

    #[test]
    fn baselines_pick_an_eligible_worker_whatever_the_order(
        (specs, shuffled) in prop::collection::vec(worker_spec(), 1..12).prop_flat_map(|specs| {
            let order: Vec<usize> = (0..specs.len()).collect();
            (Just(specs), Just(order).prop_shuffle())
        }),
        job in job_strategy(),
        config in config_strategy(),
        seed in any::<u64>(),
    ) {
        let (workers, ledger) = build(&specs);
        let permuted: Vec<WorkerView> = shuffled.iter().map(|&i| workers[i].clone()).collect();
        for kind in PolicyKind::ALL {
            let a = choose(kind, &mut PolicyState::new(seed), &job, &workers, &ledger, &config, NOW);
            let b = choose(kind, &mut PolicyState::new(seed), &job, &permuted, &ledger, &config, NOW);
            prop_assert_eq!(&a, &b, "{}", kind);
            let eligible: Vec<&WorkerView> = workers
                .iter()
                .filter(|w| {
                    let load = WorkerLoad::of(w, &ledger, &config);
                    let forecast = std::cell::OnceCell::from(Forecast::of(&job, w, &load, &ledger, &config));
                    let ctx = FilterContext { job: &job, view: w, load: &load, ledger: &ledger, forecast: &forecast, config: &config, now_ms: NOW };
                    filter::apply(&filter::ELIGIBILITY, &ctx).is_ok()
                })
                .collect();
            if kind != PolicyKind::Metronome {
                prop_assert_eq!(a.winner.is_some(), !eligible.is_empty(), "{}", kind);
                prop_assert_eq!(a.candidates.len(), eligible.len(), "{}", kind);
            }
            if let Some(w) = &a.winner {
                prop_assert!(eligible.iter().any(|e| &e.status.worker_id == w), "{}", kind);
                prop_assert_eq!(&a.candidates[0].worker_id, w);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `rescore` is what `metronome replay` re-decides with: from a decision's recorded
    /// candidates (read back from JSON, as the replay reads them) it must reproduce the
    /// decision under its own weights, and under other weights give exactly what the live
    /// evaluation gives with those weights (weights change no filter).
    #[test]
    fn rescoring_recorded_candidates_matches_live_evaluation(
        specs in prop::collection::vec(worker_spec(), 0..10),
        job in job_strategy(),
        config in config_strategy(),
        other in config_strategy(),
    ) {
        let (workers, ledger) = build(&specs);
        let e = evaluate(&job, &workers, &ledger, &config, NOW);
        let recorded: Vec<CandidateScore> =
            serde_json::from_str(&serde_json::to_string(&e.candidates).unwrap()).unwrap();
        prop_assert_eq!(&rescore(&recorded, &config.weights, config.affinity_max_share), &e.candidates);
        let reweighted = SchedulerConfig { weights: other.weights.clone(), ..config.clone() };
        let live = evaluate(&job, &workers, &ledger, &reweighted, NOW);
        prop_assert_eq!(rescore(&recorded, &other.weights, other.affinity_max_share), live.candidates);
    }

    /// Replay from a whole record, in either form: a decision written compactly (version 3)
    /// or as version 2 wrote it (every term an object with its weight) reads back to the
    /// same candidates and weights, and re-scoring them under the recorded weights gives
    /// the decision's own totals and order, bit for bit.
    #[test]
    fn a_recorded_decision_in_either_form_rescores_to_itself(
        specs in prop::collection::vec(worker_spec(), 0..10),
        job in job_strategy(),
        config in config_strategy(),
    ) {
        let (workers, ledger) = build(&specs);
        let e = evaluate(&job, &workers, &ledger, &config, NOW);
        let decision = record(&e);
        let compact = serde_json::to_value(&decision).unwrap();
        prop_assert_eq!(compact["v"].as_u64(), Some(u64::from(DECISION_VERSION)));
        // Version 2 records predate prefix fingerprints (no cached tokens per candidate) and
        // the placements affinity bounds (none recorded per candidate).
        let old = job.prefix.is_none().then(|| version_2(&decision));
        let unrecorded: Vec<_> = e
            .candidates
            .iter()
            .map(|c| CandidateScore { recent_placements: None, ..c.clone() })
            .collect();
        let forms = std::iter::once((compact, &e.candidates)).chain(old.map(|o| (o, &unrecorded)));
        for (json, expected) in forms {
            let read: Decision = serde_json::from_value(json).unwrap();
            prop_assert_eq!(&read.candidates, expected);
            let weights = read.scoring.map(|s| metronome_scheduler::Weights::from_array(s.weights));
            if let Some(w) = weights {
                prop_assert_eq!(w, config.weights.clone());
                prop_assert_eq!(&rescore(&read.candidates, &config.weights, config.affinity_max_share), expected);
            } else {
                prop_assert!(e.candidates.is_empty());
            }
        }
    }
}

/// The decision record of an evaluation, as the dispatcher writes one.
fn record(e: &metronome_scheduler::Evaluation) -> Decision {
    Decision {
        v: DECISION_VERSION,
        job_id: "job".into(),
        model: Some("m".into()),
        outcome: Outcome::Assigned,
        attempt: 1,
        reason: None,
        reason_code: None,
        worker_id: e.winner.clone(),
        cost: Some(e.cost.clone()),
        scoring: Some(e.scoring),
        candidates: e.candidates.clone(),
        rejected: e.rejected.clone(),
        slo: None,
        retry_after_ms: None,
        affinity: None,
        policy: "metronome".into(),
        queue_wait_ms: 0,
        decision_latency_us: 0,
        epoch: 1,
        dispatcher_id: "d".into(),
        decided_ms: NOW,
        tenant: None,
        priority: None,
        fair_counter: None,
    }
}

/// `d` as a version-2 dispatcher wrote it: every candidate's terms as objects carrying their
/// weight and contribution, no `scoring`.
fn version_2(d: &Decision) -> serde_json::Value {
    let mut json = serde_json::to_value(d).unwrap();
    let scoring = d.scoring.unwrap_or_default();
    let candidates: Vec<serde_json::Value> = d
        .candidates
        .iter()
        .map(|c| {
            serde_json::json!({
                "worker_id": c.worker_id,
                "total": c.total,
                "terms": c.terms(&scoring),
                "prediction": c.prediction,
            })
        })
        .collect();
    let map = json.as_object_mut().unwrap();
    map.remove("scoring");
    map.insert("v".into(), 2.into());
    map.insert("candidates".into(), candidates.into());
    json
}
