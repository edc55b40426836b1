//! What admitting one job on one worker would do, predicted from the worker's performance
//! model ([`crate::perf`]) and what the ledger knows of the jobs running there.
//!
//! With `s` streams on the worker before admission (its reported work plus unreported
//! reservations), `c` context tokens held by them, `q` prompt tokens still waiting for
//! prefill and a job of `p` prompt tokens expected to write `L` tokens:
//!
//! - the job's TTFT is `ttft_base + prefill_per_token · (u + q) + ttft_per_stream · s`,
//!   where `u ≤ p` is the part of the prompt the worker does not hold in its prefix cache
//!   ([`JobRequest::prefill_tokens_on`]; `u = p` for a job without a prefix fingerprint);
//! - every stream then decodes at one token per
//!   `step = step_base + step_per_stream · s + step_per_ktok · (c + p + L/2) / 1000`;
//! - the job's prefill stalls every running stream for `stall_per_prefill_token · u`;
//! - the job itself, once running, stands still while later admissions are prefilled, for
//!   the stall they most likely charge if they go on as they recently have
//!   ([`crate::StallOutlook::likely_stall_ms`]): its expected average is its output over its
//!   decode plus that stall. The admission filter judges the rate at the batch it joins
//!   (`1000 / step`): later admissions are held to every running job's floor on their own.
//!
//! A reservation whose floor is waived ([`crate::Ledger::waive_floor`]) is predicted like
//! any other but never counted below its floor.
//!
//! Floors are judged at `step + step_error`, the worker's decode fit's recent mean absolute
//! error per token ([`PerfCoefficients::step_error_ms`]), for the job and for every running
//! job; the predictions recorded stay at `step`.
//!
//! A running job `i` with expected output `Lᵢ`, already charged `σᵢ` ms of stall by
//! admissions after it, is predicted to average `1000 · Lᵢ / (Lᵢ · step + σᵢ + stall)`
//! tokens/s over its decode: the step is the one after admission (conservative: the batch
//! is at its largest for the rest of its life) and its whole stall history counts, because
//! its SLO judges its whole decode, not the next token.
//!
//! Context: the worker's reported KV usage when it reports capacity in tokens (its own
//! count of cached tokens), otherwise the ledger's estimate `prompt + L/2` per job. Either
//! way unreported reservations are added from the ledger.

use metronome_protocol::{PerfCoefficients, Prediction};

use crate::ledger::{JobProfile, StallOutlook};
use crate::load::kv_tokens_in_use;
use crate::{JobRequest, Ledger, SchedulerConfig, WorkerLoad, WorkerView};

/// The effect on one running job.
#[derive(Debug, Clone, PartialEq)]
pub struct RunningImpact {
    pub job_id: String,
    /// Predicted whole-decode average rate once the new job is admitted.
    pub tok_s: f64,
    /// The floor it was promised.
    pub min_tok_s: f64,
}

/// The forecast for one job on one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Forecast {
    /// The coefficients predicted with (the worker's fitted ones, or the prior).
    pub coefficients: PerfCoefficients,
    /// Streams before admission.
    pub streams_before: u32,
    /// Context tokens held by those streams.
    pub context_tokens: f64,
    /// Prompt tokens waiting for prefill ahead of the job.
    pub pending_prefill_tokens: f64,
    /// Predicted time to first token once assigned, ms.
    pub ttft_ms: f64,
    /// Predicted decode step after admission, ms.
    pub step_ms: f64,
    /// The job's own decode rate at the batch it joins, tokens/s (`1000 / step`).
    pub decode_tok_s: f64,
    /// The step admission judges rate floors at, ms: the predicted step plus the decode
    /// fit's recent error ([`PerfCoefficients::step_error_ms`]).
    pub judged_step_ms: f64,
    /// The job's expected whole-decode average, tokens/s: `decode_tok_s` less the stall the
    /// admissions after it most likely charge.
    pub expected_tok_s: f64,
    /// Stall the job's prefill imposes on each running stream, ms.
    pub stall_ms: f64,
    /// The running job with the lowest predicted rate after admission.
    pub worst_running: Option<RunningImpact>,
    /// The running job whose rate, judged at [`Forecast::judged_step_ms`], falls furthest
    /// below its own floor, if any does (its `tok_s` is the judged rate).
    pub worst_violation: Option<RunningImpact>,
    /// Running jobs whose judged rate falls below their floor.
    pub violations: u32,
    /// Sum of their shortfalls below their floors, tokens/s.
    pub shortfall_tok_s: f64,
}

impl Forecast {
    pub fn of(
        job: &JobRequest,
        view: &WorkerView,
        load: &WorkerLoad,
        ledger: &Ledger,
        config: &SchedulerConfig,
    ) -> Forecast {
        let status = &view.status;
        let coefficients = status
            .perf
            .filter(coefficients_usable)
            .unwrap_or_else(|| config.perf_prior.coefficients());
        let default_output = job.predicted_output();
        let mut ledger_context = 0.0;
        let mut unreported_context = 0.0;
        let mut unreported_prompt = 0.0;
        // Prompt tokens still to prefill ahead of a job placed now, from the jobs booked
        // here: each one's prompt, scaled by the share of its predicted TTFT still to
        // come. Fresher than the heartbeat's count (up to a heartbeat interval old, and a
        // long prompt long done would still count there); used only when every booking
        // carries its prediction and nothing runs there that is not booked.
        let mut booked_pending = Some(0.0);
        let mut unreported_pending = 0.0;
        for r in ledger.reservations_on(&status.worker_id) {
            let (prompt, prefill, out) = r.profile.map_or((0.0, 0.0, default_output), |p| {
                let prefill = p.prompt_tokens.saturating_sub(p.cached_tokens);
                (
                    f64::from(p.prompt_tokens),
                    f64::from(prefill),
                    p.protected_output,
                )
            });
            let context = prompt + out / 2.0;
            ledger_context += context;
            if !status.in_flight.contains(&r.job_id) {
                unreported_context += context;
                unreported_prompt += prefill;
            }
            booked_pending = match (booked_pending, r.profile) {
                (Some(sum), Some(p)) if p.decoding_from_ms > 0 && load.now_ms > 0 => {
                    let span = p.decoding_from_ms.saturating_sub(r.reserved_ms).max(1) as f64;
                    let left = p.decoding_from_ms.saturating_sub(load.now_ms) as f64 / span;
                    let pending = prefill * left.min(1.0);
                    if !status.in_flight.contains(&r.job_id) {
                        unreported_pending += pending;
                    }
                    Some(sum + pending)
                }
                _ => None,
            };
        }
        // What the heartbeat reported still to prefill, less what the worker can have
        // prefilled since at its fitted speed: a floor under the bookings' estimate. The
        // bookings count a prompt as prefilled once its predicted TTFT has passed; when the
        // server runs behind its predictions (a burst queued there, a fit still learning)
        // they would call a worker with seconds of prefill queued free, and every later
        // prediction there would build on that.
        let since_heartbeat_ms = load.now_ms.saturating_sub(view.last_seen_ms) as f64;
        let reported_left = (status.prefill_pending_tokens as f64
            - since_heartbeat_ms / coefficients.prefill_per_token_ms.max(1e-6))
        .max(0.0);
        let booked_pending = booked_pending.map(|b: f64| b.max(reported_left + unreported_pending));
        // The booked count stands only when the ledger knows everything the worker runs.
        let booked_everything = load.reported_active <= ledger.reserved_count(&status.worker_id);
        // The context a decode step reads: every stream attends to its own whole context,
        // a cached prefix shared with other streams included, and that is what the fit
        // learnt the context slope on (the agent's per-stream sum). The KV in use counts a
        // block shared by many streams once, so on a GPU serving one system prompt to
        // twenty streams it said a fraction of what attention reads: the step came out
        // fast, admission packed the fast GPUs to the floor, and their streams ran under it
        // (policy lab, `shared_prefix` at 250 % on the mixed cluster: half the requests
        // missed their rate floor). So the bookings' sum stands when they cover the
        // worker; otherwise the KV in use plus what it has not reported, at least the
        // bookings'.
        let reported_kv = status.kv.and_then(|kv| {
            kv.capacity_tokens
                .map(|c| kv_tokens_in_use(kv.used_frac, c, 0))
        });
        let context_tokens = match reported_kv {
            Some(kv) if !booked_everything => (kv + unreported_context).max(ledger_context),
            _ => ledger_context,
        };
        let pending_prefill_tokens = booked_pending
            .filter(|_| booked_everything)
            .unwrap_or(status.prefill_pending_tokens as f64 + unreported_prompt);
        let streams_before = load.effective_active;
        let s = f64::from(streams_before);
        // The whole prompt is context for every decode step; only its uncached part is
        // prefilled, so only that part delays the first token and stalls the streams.
        let p = f64::from(job.prompt_tokens);
        let prefill = f64::from(job.prefill_tokens_on(&status.worker_id));
        let c = &coefficients;
        let ttft_ms = c.ttft_base_ms
            + c.prefill_per_token_ms * (prefill + pending_prefill_tokens)
            + c.ttft_per_stream_ms * s;
        let step_ms = (c.step_base_ms
            + c.step_per_stream_ms * s
            + c.step_per_ktok_ms * (context_tokens + p + default_output / 2.0) / 1000.0)
            .max(1e-3);
        let stall_ms = c.stall_per_prefill_token_ms * prefill;
        // Floors are judged a prediction error slower than predicted: judged at the
        // prediction itself, a stream is let down to exactly its floor, and the half of
        // the predictions that come out slow put it under.
        let judged_step_ms = step_ms + c.step_error_ms;
        // The worst are kept as borrowed job ids and named once at the end: this loop runs
        // for every reservation of every candidate of every decision, and copying a job id
        // into each impact it builds was a measurable share of a decision's cost.
        let mut worst_running: Option<(&str, f64, f64)> = None;
        let mut worst_violation: Option<(f64, &str, f64, f64)> = None;
        let mut violations = 0u32;
        let mut shortfall_tok_s = 0.0;
        for r in ledger.reservations_on(&status.worker_id) {
            if r.job_id == job.job_id {
                continue;
            }
            let (out, floor) = r.profile.map_or((default_output, job.slo.min_tok_s), |p| {
                (
                    written_at_least(&p, r.stall_ms, step_ms, load.now_ms),
                    p.min_tok_s,
                )
            });
            let out = out.max(1.0);
            let rate_at = |step: f64| 1000.0 * out / (out * step + r.stall_ms + stall_ms);
            let predicted = rate_at(step_ms);
            if worst_running.is_none_or(|(_, w, _)| predicted < w) {
                worst_running = Some((&r.job_id, predicted, floor));
            }
            if r.floor_waived {
                continue;
            }
            let tok_s = rate_at(judged_step_ms);
            let shortfall = floor - tok_s;
            if shortfall > 0.0 {
                violations += 1;
                shortfall_tok_s += shortfall;
            }
            if shortfall > 0.0 && worst_violation.is_none_or(|(s, ..)| shortfall > s) {
                worst_violation = Some((shortfall, &r.job_id, tok_s, floor));
            }
        }
        let impact = |job_id: &str, tok_s: f64, min_tok_s: f64| RunningImpact {
            job_id: job_id.to_owned(),
            tok_s,
            min_tok_s,
        };
        let worst_running = worst_running.map(|(j, t, f)| impact(j, t, f));
        let worst_violation = worst_violation.map(|(_, j, t, f)| impact(j, t, f));
        Forecast {
            coefficients,
            streams_before,
            context_tokens,
            pending_prefill_tokens,
            ttft_ms,
            step_ms,
            decode_tok_s: 1000.0 / step_ms,
            judged_step_ms,
            expected_tok_s: expected_rate(
                step_ms,
                &load.stall_outlook,
                default_output,
                job.slo.min_tok_s,
            ),
            stall_ms,
            worst_running,
            worst_violation,
            violations,
            shortfall_tok_s,
        }
    }

    /// The prediction as a decision records it.
    pub fn prediction(&self) -> Prediction {
        Prediction {
            ttft_ms: self.ttft_ms,
            decode_tok_s: self.expected_tok_s,
            step_tok_s: Some(self.decode_tok_s),
            worst_running_tok_s: self.worst_running.as_ref().map(|w| w.tok_s),
            streams_after: self.streams_before.saturating_add(1),
            model_samples: self.coefficients.samples,
            stall_ms: Some(self.stall_ms),
        }
    }

    /// Predicted time the job occupies the worker: first token, then every expected
    /// output token at the predicted step.
    pub fn service_ms(&self, job: &JobRequest) -> f64 {
        self.ttft_ms + job.predicted_output() * self.step_ms
    }
}

/// The whole-decode rate a job admitted now can expect: its decode at `step_ms`, standing
/// still for the stall the admissions after it most likely charge
/// ([`StallOutlook::likely_stall_ms`]), but never for more than its stall budget, the stall
/// that would take it to its floor: admission refuses any later prefill that would charge
/// it more. Without that cap a short job on a prefill-heavy worker is predicted far below
/// what it gets, for the protection it gets is exactly what makes it meet its floor.
fn expected_rate(step_ms: f64, outlook: &StallOutlook, output: f64, floor_tok_s: f64) -> f64 {
    let out = output.max(1.0);
    let decode_ms = intervals(out) * step_ms;
    let stall_ms = outlook.likely_stall_ms(decode_ms);
    let budget_ms = if floor_tok_s > 0.0 {
        (out * 1000.0 / floor_tok_s - decode_ms).max(0.0)
    } else {
        f64::INFINITY
    };
    1000.0 * out / (decode_ms + stall_ms.min(budget_ms))
}

/// Decode steps between a job's first and last token: what its tokens/s is measured over
/// (`output tokens / (last token − first token)`, the load generator's definition). At
/// least one, so a one-token job has a finite rate.
fn intervals(output: f64) -> f64 {
    (output - 1.0).max(1.0)
}

/// The output a running job is judged on: its expected length, or, once it has been
/// decoding for longer than that length takes, what it has written by now plus the token
/// still to come (it has not finished, so it is longer than expected). Written tokens are
/// counted from the decode time since its predicted first token, less the stall charged to
/// it, at `step_ms` (the step after this admission, at least any step it ran at): an
/// undercount, so the job is never judged longer than it can be. At most its `max_tokens`.
///
/// Why: the stall charged to a job grows with its life, and judging a long job on a short
/// expected length divides that stall by too few tokens; every GPU running one would then
/// turn work away for a job with room to spare (seen when clients ask for a large
/// `max_tokens` whatever they write, so every job is expected to write the mean).
fn written_at_least(p: &JobProfile, stall_ms: f64, step_ms: f64, now_ms: u64) -> f64 {
    let expected = p.protected_output;
    if p.decoding_from_ms == 0 || now_ms <= p.decoding_from_ms || step_ms <= 0.0 {
        return expected;
    }
    let decoding = (now_ms - p.decoding_from_ms) as f64 - stall_ms.max(0.0);
    let written = (decoding / step_ms).floor().max(0.0) + 1.0;
    let bound = if p.max_tokens > 0 {
        f64::from(p.max_tokens)
    } else {
        f64::INFINITY
    };
    expected.max(written.min(bound))
}

/// The soonest a job of one model could see its first token: its prefill on the fastest of
/// the model's workers with nothing else to do. A job that has waited so long that even this
/// would miss its TTFT target is already late, wherever it goes.
#[derive(Debug, Clone, Default)]
pub struct IdleTtft {
    /// `(ttft_base_ms, prefill_per_token_ms)` of each worker with usable coefficients.
    workers: Vec<(f64, f64)>,
}

impl IdleTtft {
    pub fn of<'a>(workers: impl IntoIterator<Item = &'a WorkerView>) -> IdleTtft {
        IdleTtft {
            workers: workers
                .into_iter()
                .filter_map(|w| w.status.perf)
                .filter(coefficients_usable)
                .map(|c| (c.ttft_base_ms, c.prefill_per_token_ms))
                .collect(),
        }
    }

    /// Lowest predicted TTFT of a `prompt_tokens` prompt; 0 when no worker has
    /// coefficients (nothing is known, so nothing is assumed).
    pub fn ttft_ms(&self, prompt_tokens: u32) -> f64 {
        let p = f64::from(prompt_tokens);
        self.workers
            .iter()
            .map(|(base, per_token)| base + per_token * p)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0)
    }
}

/// A heartbeat's coefficients are used only when every one is a finite number >= 0 and
/// the step takes time; anything else (a buggy or hostile agent) falls back to the prior.
fn coefficients_usable(c: &PerfCoefficients) -> bool {
    let all = [
        c.step_base_ms,
        c.step_per_stream_ms,
        c.step_per_ktok_ms,
        c.stall_per_prefill_token_ms,
        c.ttft_base_ms,
        c.prefill_per_token_ms,
        c.ttft_per_stream_ms,
        c.step_error_ms,
    ];
    all.iter().all(|v| v.is_finite() && *v >= 0.0) && c.step_base_ms > 0.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::JobProfile;
    use crate::testutil::*;

    #[test]
    fn idle_ttft_is_the_fastest_workers_prefill() {
        let mut fast = worker("fast");
        fast.status.perf = Some(coefficients());
        let mut slow = worker("slow");
        slow.status.perf = Some(PerfCoefficients {
            prefill_per_token_ms: 1.0,
            ..coefficients()
        });
        let mut garbage = worker("garbage");
        garbage.status.perf = Some(PerfCoefficients {
            ttft_base_ms: -5.0,
            ..coefficients()
        });
        let unknown = worker("unknown");
        let idle = IdleTtft::of([&slow, &fast, &garbage, &unknown]);
        let c = coefficients();
        let expected = c.ttft_base_ms + c.prefill_per_token_ms * 1_000.0;
        assert!((idle.ttft_ms(1_000) - expected).abs() < 1e-9);
        assert_eq!(IdleTtft::of([&unknown]).ttft_ms(1_000), 0.0);
    }

    fn coefficients() -> PerfCoefficients {
        PerfCoefficients {
            step_base_ms: 20.0,
            step_per_stream_ms: 1.0,
            step_per_ktok_ms: 0.0,
            stall_per_prefill_token_ms: 0.2,
            ttft_base_ms: 10.0,
            prefill_per_token_ms: 0.1,
            ttft_per_stream_ms: 2.0,
            step_error_ms: 0.0,
            samples: 12,
        }
    }

    fn forecast(view: &WorkerView, ledger: &Ledger, j: &JobRequest) -> Forecast {
        let config = SchedulerConfig::default();
        let load = WorkerLoad::of(view, ledger, &config);
        Forecast::of(j, view, &load, ledger, &config)
    }

    #[test]
    fn an_idle_worker_gives_the_job_its_single_stream_speed() {
        let mut w = worker("w1");
        w.status.perf = Some(coefficients());
        w.status.kv = None;
        let f = forecast(&w, &Ledger::new(), &job("m")); // 100 prompt tokens, 50 out
        assert_eq!(f.streams_before, 0);
        assert!((f.ttft_ms - 20.0).abs() < 1e-9, "{f:?}"); // 10 + 0.1 * 100
        assert!((f.step_ms - 20.0).abs() < 1e-9);
        assert!((f.decode_tok_s - 50.0).abs() < 1e-9);
        assert!((f.stall_ms - 20.0).abs() < 1e-9);
        assert_eq!(f.worst_running, None);
        assert_eq!(f.prediction().model_samples, 12);
        assert_eq!(f.prediction().streams_after, 1);
    }

    #[test]
    fn a_cached_prefix_is_not_prefilled_but_still_decoded_over() {
        use crate::{Cached, PrefixLookup};
        use metronome_protocol::PrefixSource;
        let mut w = worker("w1");
        w.status.perf = Some(PerfCoefficients {
            step_per_ktok_ms: 1.0,
            ..coefficients()
        });
        w.status.kv = None;
        let mut j = job("m");
        j.prompt_tokens = 1_000;
        let full = forecast(&w, &Ledger::new(), &j);
        let cached = Cached {
            tokens: 960,
            shared_tokens: 0,
        };
        let j = j.with_prefix(PrefixLookup::new(
            PrefixSource::Placements,
            [("w1".to_string(), cached), ("w2".to_string(), cached)],
        ));
        let hit = forecast(&w, &Ledger::new(), &j);
        // 40 tokens prefilled instead of 1,000: 10 + 0.1 * 40; stall 0.2 * 40.
        assert!((hit.ttft_ms - 14.0).abs() < 1e-9, "{hit:?}");
        assert!((full.ttft_ms - 110.0).abs() < 1e-9, "{full:?}");
        assert!((hit.stall_ms - 8.0).abs() < 1e-9);
        assert_eq!(
            hit.step_ms, full.step_ms,
            "the cached tokens are context all the same"
        );
    }

    #[test]
    fn the_recorded_rate_expects_the_stall_the_admissions_most_likely_charge() {
        let mut w = worker("w1");
        w.status.perf = Some(coefficients());
        w.status.kv = None;
        let config = SchedulerConfig::default();
        // The worker admitted 5 jobs in the last instant, each stalling its streams 100 ms:
        // 5 admissions per 10 s, a stall share of 5 %. Nothing runs there any more.
        let mut l = Ledger::new();
        for i in 0..5 {
            let id = format!("done{i}");
            l.reserve("w1", &id, 10, 2_000).unwrap();
            l.charge_stall("w1", &id, 100.0, 2_000);
            l.release(&id);
        }
        let load = WorkerLoad::at(&w, &l, &config, 2_000);
        assert!((load.stall_outlook.stall_fraction() - 0.05).abs() < 1e-12);
        // A 50-token job decodes 49 steps of 20 ms, ~1 s stretched: 0.52 admissions
        // expected, none most likely; its rate is the step's.
        let f = Forecast::of(&job("m"), &w, &load, &l, &config);
        let decode = 49.0 * f.step_ms;
        assert!(
            (f.expected_tok_s - 1000.0 * 50.0 / decode).abs() < 1e-9,
            "{f:?}"
        );
        // A 500-token job decodes ~10 s stretched: 5.2 expected, 5 most likely, 500 ms.
        let mut long = job("m");
        long.predicted_output_tokens = 500.0;
        long.max_tokens = 500;
        let f = Forecast::of(&long, &w, &load, &l, &config);
        let decode = 499.0 * f.step_ms;
        let expected = 1000.0 * 500.0 / (decode + 500.0);
        assert!((f.expected_tok_s - expected).abs() < 1e-9, "{f:?}");
        assert!(f.expected_tok_s < f.decode_tok_s * 500.0 / 499.0);
        let p = f.prediction();
        assert_eq!(
            p.decode_tok_s, f.expected_tok_s,
            "the record expects the stalls"
        );
        assert_eq!(
            p.step_tok_s,
            Some(f.decode_tok_s),
            "the filter's rate is kept beside it"
        );
    }

    #[test]
    fn prefill_ahead_comes_from_the_bookings_when_they_cover_the_worker() {
        let mut w = worker("w1");
        w.status.perf = Some(coefficients());
        w.status.kv = None;
        // The heartbeat, a second old, still counts a long prompt since prefilled.
        w.status.prefill_pending_tokens = 5_000;
        w.last_seen_ms = NOW + 100 - 1_000;
        w.status.active = 1;
        w.status.in_flight = vec!["a".into()];
        let mut l = Ledger::new();
        let booked = JobProfile {
            prompt_tokens: 1_000,
            cached_tokens: 0,
            protected_output: 100.0,
            min_tok_s: 30.0,
            max_tokens: 100,
            decoding_from_ms: NOW + 200, // placed at NOW, first token predicted at +200
        };
        l.reserve_profiled("w1", "a", 1_100, booked, NOW).unwrap();
        let config = SchedulerConfig::default();
        let load = WorkerLoad::at(&w, &l, &config, NOW + 100);
        let f = Forecast::of(&job("m"), &w, &load, &l, &config);
        assert!(
            (f.pending_prefill_tokens - 500.0).abs() < 1e-9,
            "half of its TTFT is left: {f:?}"
        );
        // A job the ledger does not know runs there too: the heartbeat's count stands.
        w.status.active = 2;
        let load = WorkerLoad::at(&w, &l, &config, NOW + 100);
        let f = Forecast::of(&job("m"), &w, &load, &l, &config);
        assert_eq!(f.pending_prefill_tokens, 5_000.0);
    }

    #[test]
    fn a_worker_behind_its_predictions_keeps_the_prefill_its_heartbeat_reports() {
        let mut w = worker("w1");
        w.status.perf = Some(coefficients()); // 0.1 ms per prompt token
        w.status.kv = None;
        // Two jobs booked 3 s ago, predicted to have started decoding long since; the
        // heartbeat, 100 ms old, says 5,000 of their prompt tokens still wait.
        w.status.prefill_pending_tokens = 5_000;
        w.status.active = 2;
        w.status.in_flight = vec!["a".into(), "b".into()];
        w.last_seen_ms = NOW + 3_000 - 100;
        let mut l = Ledger::new();
        for id in ["a", "b"] {
            let booked = JobProfile {
                prompt_tokens: 3_000,
                cached_tokens: 0,
                protected_output: 10.0,
                min_tok_s: 30.0,
                max_tokens: 10,
                decoding_from_ms: NOW + 400,
            };
            l.reserve_profiled("w1", id, 3_010, booked, NOW).unwrap();
        }
        // A third, not yet reported, just booked: all of its prompt is still ahead.
        let fresh = JobProfile {
            prompt_tokens: 1_000,
            cached_tokens: 0,
            protected_output: 10.0,
            min_tok_s: 30.0,
            max_tokens: 10,
            decoding_from_ms: NOW + 3_000 + 500,
        };
        l.reserve_profiled("w1", "c", 1_010, fresh, NOW + 3_000)
            .unwrap();
        let config = SchedulerConfig::default();
        let load = WorkerLoad::at(&w, &l, &config, NOW + 3_000);
        let f = Forecast::of(&job("m"), &w, &load, &l, &config);
        // 5,000 reported, less 100 ms at 0.1 ms per token, plus the unreported 1,000.
        assert!(
            (f.pending_prefill_tokens - 5_000.0).abs() < 1e-9,
            "{}",
            f.pending_prefill_tokens
        );
    }

    #[test]
    fn the_expected_rate_never_falls_below_the_floor_admission_keeps() {
        // Stalls at the share's ceiling would predict 1000/20 × 0.2 = 10 tok/s; later
        // admissions may only stall the job down to its floor.
        let heavy = StallOutlook {
            admissions_per_ms: 0.01,
            mean_stall_ms: 95.0,
        };
        let r = expected_rate(20.0, &heavy, 100.0, 30.0);
        assert!((r - 30.0).abs() < 1e-9, "{r}");
        // No stall: the per-interval rate, 100 tokens over 99 steps.
        let r = expected_rate(20.0, &StallOutlook::default(), 100.0, 30.0);
        assert!((r - 1000.0 * 100.0 / (99.0 * 20.0)).abs() < 1e-9, "{r}");
    }

    #[test]
    fn running_jobs_pay_for_the_batch_and_the_stall() {
        let mut w = worker("w1");
        w.status.perf = Some(coefficients());
        w.status.kv = None;
        let mut l = Ledger::new();
        let short = JobProfile {
            prompt_tokens: 500,
            protected_output: 10.0,
            min_tok_s: 30.0,
            ..Default::default()
        };
        let long = JobProfile {
            prompt_tokens: 500,
            protected_output: 400.0,
            min_tok_s: 30.0,
            ..Default::default()
        };
        l.reserve_profiled("w1", "short", 1_000, short, NOW)
            .unwrap();
        l.reserve_profiled("w1", "long", 1_000, long, NOW).unwrap();
        l.charge_stall("w1", "long", 100.0, NOW); // short already stalled by long's prefill
        let f = forecast(&w, &l, &job("m"));
        assert_eq!(f.streams_before, 2);
        // Unreported reservations: their prompts are still to prefill.
        assert_eq!(f.pending_prefill_tokens, 1_000.0);
        assert!((f.ttft_ms - (10.0 + 0.1 * 1_100.0 + 4.0)).abs() < 1e-9);
        assert!((f.step_ms - 22.0).abs() < 1e-9);
        // short: 1000 * 10 / (10 * 22 + 100 + 20) = 29.4 < 30; long: 1000*400/(8800+20) = 45.4
        let v = f.worst_violation.as_ref().unwrap();
        assert_eq!(v.job_id, "short");
        assert!((v.tok_s - 10_000.0 / 340.0).abs() < 1e-9);
        assert_eq!(f.worst_running.as_ref().unwrap().job_id, "short");
        assert_eq!(f.violations, 1);
        assert!((f.shortfall_tok_s - (30.0 - 10_000.0 / 340.0)).abs() < 1e-9);
        // With short's floor waived it is predicted the same but counted below no floor.
        let mut waived = l.clone();
        waived.waive_floor("short");
        let g = forecast(&w, &waived, &job("m"));
        assert_eq!(g.worst_running, f.worst_running);
        assert_eq!(
            (g.worst_violation, g.violations, g.shortfall_tok_s),
            (None, 0, 0.0)
        );
        assert_eq!(
            forecast(&w, &l, &job("m")),
            f,
            "the ledger of record is untouched"
        );
    }

    #[test]
    fn every_stream_reads_its_own_context_even_where_they_share_a_cached_prefix() {
        let mut w = worker("w1"); // 10 000 KV tokens
        w.status.perf = Some(PerfCoefficients {
            step_per_ktok_ms: 1.0,
            ..coefficients()
        });
        // Ten streams of one 2,000-token system prompt and a 100-token question: the
        // server holds the prompt once, 3,000 tokens in use, while each stream attends to
        // all 2,100 of its own.
        w.status.kv.as_mut().unwrap().used_frac = 0.3;
        let mut l = Ledger::new();
        for i in 0..10 {
            let id = format!("s{i}");
            let profile = JobProfile {
                prompt_tokens: 2_100,
                cached_tokens: 2_000,
                protected_output: 100.0,
                min_tok_s: 30.0,
                ..Default::default()
            };
            l.reserve_profiled("w1", &id, 2_200, profile, NOW).unwrap();
            w.status.in_flight.push(id);
        }
        w.status.active = 10;
        w.status.prefill_pending_tokens = 40;
        let f = forecast(&w, &l, &job("m"));
        // Each booking's prompt and half its expected output.
        assert!((f.context_tokens - 10.0 * 2_150.0).abs() < 1e-9, "{f:?}");
        // step: 20 + 1 * 10 + 1.0 * (21 500 + 100 + 25) / 1000
        assert!((f.step_ms - 51.625).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn reported_jobs_are_not_pending_and_kv_usage_bounds_the_context_of_unbooked_work() {
        let mut w = worker("w1"); // 10 000 KV tokens
        w.status.perf = Some(PerfCoefficients {
            step_per_ktok_ms: 1.0,
            ..coefficients()
        });
        w.status.kv.as_mut().unwrap().used_frac = 0.3;
        // Two jobs run, one of them not booked here (adopted from an earlier leader).
        w.status.in_flight = vec!["a".into(), "adopted".into()];
        w.status.active = 2;
        w.status.prefill_pending_tokens = 40;
        let mut l = Ledger::new();
        let profile = JobProfile {
            prompt_tokens: 500,
            protected_output: 100.0,
            min_tok_s: 30.0,
            ..Default::default()
        };
        l.reserve_profiled("w1", "a", 600, profile, NOW).unwrap();
        let f = forecast(&w, &l, &job("m"));
        assert_eq!(f.pending_prefill_tokens, 40.0);
        // The KV in use (3,000) stands for what the bookings do not cover (550).
        assert!((f.context_tokens - 3_000.0).abs() < 1e-9, "{f:?}");
        // step: 20 + 1 * 2 + 1.0 * (3000 + 100 + 25) / 1000
        assert!((f.step_ms - 25.125).abs() < 1e-9, "{f:?}");
        // The bookings when they say more than the KV in use.
        w.status.kv.as_mut().unwrap().used_frac = 0.01;
        let f = forecast(&w, &l, &job("m"));
        assert!((f.context_tokens - 550.0).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn unusable_coefficients_fall_back_to_the_prior() {
        let mut w = worker("w1");
        w.status.perf = Some(PerfCoefficients {
            step_per_stream_ms: f64::NAN,
            ..coefficients()
        });
        let f = forecast(&w, &Ledger::new(), &job("m"));
        assert_eq!(
            f.coefficients,
            SchedulerConfig::default().perf_prior.coefficients()
        );
        w.status.perf = Some(PerfCoefficients {
            step_base_ms: 0.0,
            ..coefficients()
        });
        assert_eq!(
            forecast(&w, &Ledger::new(), &job("m")).coefficients.samples,
            0
        );
    }
}
