//! One scheduling decision: filter → score → normalise → select.
//!
//! Normalisation is min-max per term across the candidates of this decision, so every term
//! lands in [0, 1] whatever its unit, 0 being the best candidate on that term. When all
//! available values are equal the term is 0 for everyone: it cannot tell them apart, so it
//! must not move anyone's total.
//!
//! **Unavailable signals.** A candidate without a signal (no EWMA samples yet, no KV metric,
//! no NVML) gets `available = false`, `raw = None` and, as its normalised value, the *mean
//! of the normalised values of the candidates that have the signal* (0 when none has it).
//! The unknown worker is assumed to be typical of those we know: 0 would make "no data" the
//! best possible score and favour every worker whose agent lacks a metric; 1 would starve
//! new workers, which can only earn EWMA samples by being picked; a fixed 0.5 would be a
//! penalty or a bonus depending on how the known candidates happen to spread. The mean is
//! summed in fixed point so the result is exactly the same in any candidate order.
//!
//! **Selection.** The lowest total wins; ties break by effective active count, then by
//! worker id, so the decision never depends on the order of `workers`. [`evaluate()`] is
//! pure: reservations in the ledger count as active work and as used KV, but the ledger is
//! not touched; the caller reserves the winner.

use std::cell::OnceCell;

use metronome_protocol::decision::JobCostEstimate;
use metronome_protocol::{Affinity, CandidateScore, Rejection, Scoring, TermName};

use crate::affinity::{self, Refused, Seat};
use crate::filter::{self, Filter, FilterContext};
use crate::forecast::Forecast;
use crate::term::{self, TermContext};
use crate::{JobRequest, Ledger, SchedulerConfig, Weights, WorkerLoad, WorkerView};

const TERMS: usize = TermName::ALL.len();

/// The outcome of one decision, with every number that led to it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Evaluation {
    /// The chosen worker; `None` when no worker is eligible (the job waits).
    pub winner: Option<String>,
    /// Every eligible worker with its seven terms, best first.
    pub candidates: Vec<CandidateScore>,
    /// The weights the candidates were scored with (once, not per candidate).
    pub scoring: Scoring,
    /// Every ineligible worker with its reason, ordered by worker id.
    pub rejected: Vec<Rejection>,
    /// The job's size as the decision saw it.
    pub cost: JobCostEstimate,
    /// Prefill stall the job is predicted to impose on each job already running on the
    /// winner, ms (0 without a winner): the caller charges it to them in the ledger.
    pub winner_stall_ms: f64,
    /// Prefix affinity, when a worker held more of the prompt than the score's choice
    /// ([`crate::affinity`]).
    #[serde(default)]
    pub affinity: Option<Affinity>,
}

impl Evaluation {
    /// The winner's score (the first candidate when there is a winner).
    pub fn winner_score(&self) -> Option<&CandidateScore> {
        let w = self.winner.as_deref()?;
        self.candidates.iter().find(|c| c.worker_id == w)
    }
}

/// Decide where `job` runs among `workers`, counting the reservations in `ledger`.
pub fn evaluate(
    job: &JobRequest,
    workers: &[WorkerView],
    ledger: &Ledger,
    config: &SchedulerConfig,
    now_ms: u64,
) -> Evaluation {
    let mut ranked = rank(&filter::ADMISSION, job, workers, ledger, config, now_ms);
    let affinity = apply_affinity(&mut ranked, job, config.affinity_max_share);
    let best = ranked.best().next();
    let winner = best.map(|c| c.worker_id().to_owned());
    let winner_stall_ms = best.map_or(0.0, |c| c.forecast.stall_ms);
    let candidates = ranked.best().map(Candidate::to_score).collect();
    Evaluation {
        winner,
        candidates,
        scoring: scoring(config),
        rejected: ranked.rejected,
        cost: job.cost_estimate(),
        winner_stall_ms,
        affinity,
    }
}

/// Prefix affinity over a ranking: the candidate it promotes goes first.
fn apply_affinity(ranked: &mut Ranked<'_>, job: &JobRequest, max_share: f64) -> Option<Affinity> {
    // A job without a fingerprint is placed by the score alone.
    job.prefix.as_ref()?;
    let seats: Vec<Seat<'_>> = ranked
        .best()
        .map(|c| Seat {
            worker_id: c.worker_id(),
            cached_tokens: job.cached_on(c.worker_id()).tokens,
            cost_ms: c.forecast.prediction().prefill_cost_ms(),
            placed: c.load.recent_placements,
        })
        .collect();
    let refused: Vec<Refused<'_>> = ranked
        .rejected
        .iter()
        .map(|r| Refused {
            worker_id: &r.worker_id,
            cached_tokens: job.cached_on(&r.worker_id).tokens,
            code: r.code.as_str(),
            reason: &r.reason,
        })
        .filter(|r| r.cached_tokens > 0 && r.code != "wrong_model")
        .collect();
    let verdict = affinity::decide(&seats, &refused, max_share);
    if let Some(i) = verdict.promote {
        let promoted = ranked.order.remove(i);
        ranked.order.insert(0, promoted);
    }
    verdict.record
}

/// Rank recorded candidates again under other `weights`: the normalise → select half of
/// [`evaluate()`], from the raw term values a decision recorded instead of live workers.
///
/// Normalisation runs across the candidates given (so dropping one re-normalises the rest,
/// as a filter would have), with the same unavailable-signal rule and the same tie-breaks
/// (the `active_requests` raw value is the effective active count). With a decision's own
/// candidates and weights it reproduces that decision's totals and order exactly; this is
/// what `metronome replay` re-decides with. A term missing from a record counts as
/// unavailable. Prefix affinity is applied again with `affinity_max_share` (0: off; a
/// recorded decision's own is in its [`Affinity`] record) from the recorded cached tokens,
/// predictions and recent placements (a decision of an older dispatcher, whose predictions
/// lack the stall, is compared on its job cost term, and one without placements is bounded
/// on its active counts, as that dispatcher did).
pub fn rescore(
    candidates: &[CandidateScore],
    weights: &Weights,
    affinity_max_share: f64,
) -> Vec<CandidateScore> {
    let mut recorded: Vec<Recorded<'_>> = candidates
        .iter()
        .map(|c| Recorded {
            score: c,
            raw: c.raw.map(|v| v.filter(|v| v.is_finite())),
            normalised: [0.0; TERMS],
        })
        .collect();
    normalise(&mut recorded);
    let w = weights.as_array();
    let totals: Vec<f64> = recorded
        .iter()
        .map(|r| r.normalised.iter().zip(w.iter()).map(|(n, w)| n * w).sum())
        .collect();
    let keys = recorded
        .iter()
        .enumerate()
        .map(|(i, r)| {
            // The raw active count is a u32 stored as f64: the cast is exact.
            let active = r.raw[0].map_or(0, |a| a as u32);
            (totals[i], active, i as u32)
        })
        .collect();
    let mut order = best_first(keys, |i| &recorded[i].score.worker_id);
    let job_cost = TermName::JobCost.index();
    let seats: Vec<Seat<'_>> = order
        .iter()
        .map(|&i| {
            let r = &recorded[i as usize];
            Seat {
                worker_id: &r.score.worker_id,
                cached_tokens: r.score.cached_prefix.map_or(0, |c| c.tokens),
                // The fallback only where the stall was not recorded: a recorded prediction
                // whose prefill cost is not finite stays unpredicted, as it was live.
                cost_ms: match r.score.prediction {
                    Some(p) if p.stall_ms.is_some() => p.prefill_cost_ms(),
                    _ => r.raw[job_cost],
                },
                // An older dispatcher bounded the running requests instead: its record is
                // judged as it judged it.
                placed: r
                    .score
                    .recent_placements
                    .unwrap_or_else(|| r.raw[0].unwrap_or(0.0)),
            }
        })
        .collect();
    if let Some(i) = affinity::decide(&seats, &[], affinity_max_share).promote {
        let promoted = order.remove(i);
        order.insert(0, promoted);
    }
    order
        .into_iter()
        .map(|i| {
            let r = &recorded[i as usize];
            CandidateScore {
                worker_id: r.score.worker_id.clone(),
                total: totals[i as usize],
                raw: r.raw,
                normalised: r.normalised,
                prediction: r.score.prediction,
                cached_prefix: r.score.cached_prefix,
                recent_placements: r.score.recent_placements,
            }
        })
        .collect()
}

/// A recorded candidate being re-scored.
struct Recorded<'a> {
    score: &'a CandidateScore,
    raw: [Option<f64>; TERMS],
    normalised: [f64; TERMS],
}

impl Normalise for Recorded<'_> {
    fn raw(&self) -> &[Option<f64>; TERMS] {
        &self.raw
    }
    fn normalised_mut(&mut self) -> &mut [f64; TERMS] {
        &mut self.normalised
    }
}

/// One eligible worker during a decision.
#[derive(Debug, Clone)]
pub(crate) struct Candidate<'a> {
    pub view: &'a WorkerView,
    pub load: WorkerLoad,
    pub forecast: Forecast,
    raw: [Option<f64>; TERMS],
    normalised: [f64; TERMS],
    pub total: f64,
    /// What the worker holds of the job's prompt, as the decision records it.
    job_cached: Option<metronome_protocol::CachedPrefix>,
}

impl Candidate<'_> {
    pub fn worker_id(&self) -> &str {
        &self.view.status.worker_id
    }

    /// The candidate as a decision records it: its raw and normalised terms as arrays
    /// (the weights are the decision's, recorded once).
    pub fn to_score(&self) -> CandidateScore {
        CandidateScore {
            worker_id: self.view.status.worker_id.clone(),
            total: self.total,
            raw: self.raw,
            normalised: self.normalised,
            prediction: Some(self.forecast.prediction()),
            cached_prefix: self.job_cached,
            recent_placements: Some(self.load.recent_placements),
        }
    }
}

/// Filtered, scored, normalised and ranked workers.
pub(crate) struct Ranked<'a> {
    /// Eligible workers, in the order of the input slice.
    pub candidates: Vec<Candidate<'a>>,
    /// Indices into `candidates`, best first. Sorting small indices instead of the
    /// candidates themselves keeps the sort cheap and allocation-free.
    pub order: Vec<u32>,
    /// Ordered by worker id.
    pub rejected: Vec<Rejection>,
}

impl<'a> Ranked<'a> {
    /// Candidates best first.
    pub fn best(&self) -> impl Iterator<Item = &Candidate<'a>> + '_ {
        self.order.iter().map(|&i| &self.candidates[i as usize])
    }
}

pub(crate) fn rank<'a>(
    filters: &[&dyn Filter],
    job: &JobRequest,
    workers: &'a [WorkerView],
    ledger: &Ledger,
    config: &SchedulerConfig,
    now_ms: u64,
) -> Ranked<'a> {
    let mut candidates = Vec::with_capacity(workers.len());
    let mut rejected = Vec::new();
    for view in workers {
        let load = WorkerLoad::at(view, ledger, config, now_ms);
        // Forecast only where a filter or the score needs it: a worker refused before the
        // prediction filters (at its cap, stale, draining) costs no forecast.
        let forecast = OnceCell::new();
        let fctx = FilterContext {
            job,
            view,
            load: &load,
            ledger,
            forecast: &forecast,
            config,
            now_ms,
        };
        if let Err(r) = filter::apply(filters, &fctx) {
            rejected.push(r);
            continue;
        }
        let forecast = forecast
            .into_inner()
            .unwrap_or_else(|| Forecast::of(job, view, &load, ledger, config));
        let tctx = TermContext {
            job,
            view,
            load: &load,
            forecast: &forecast,
            config,
        };
        let raw = term::ALL.map(|t| t.raw(&tctx).filter(|v| v.is_finite()));
        candidates.push(Candidate {
            view,
            load,
            forecast,
            raw,
            normalised: [0.0; TERMS],
            total: 0.0,
            job_cached: job.cached_prefix_on(view.worker_id()),
        });
    }
    normalise(&mut candidates);
    let weights = config.weights.as_array();
    for c in &mut candidates {
        c.total = c
            .normalised
            .iter()
            .zip(weights.iter())
            .map(|(n, w)| n * w)
            .sum();
    }
    let keys = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (c.total, c.load.effective_active, i as u32))
        .collect();
    let order = best_first(keys, |i| candidates[i].worker_id());
    rejected.sort_unstable_by(|a, b| a.worker_id.cmp(&b.worker_id));
    Ranked {
        candidates,
        order,
        rejected,
    }
}

/// The weights of `config` as a decision records them.
pub fn scoring(config: &SchedulerConfig) -> Scoring {
    Scoring {
        weights: config.weights.as_array(),
    }
}

/// Indices best first from `(total, effective active, index)` keys: lowest total, then
/// fewest active, then worker id.
fn best_first<'a>(mut keys: Vec<(f64, u32, u32)>, id: impl Fn(usize) -> &'a str) -> Vec<u32> {
    // Sort compact keys, not the candidates: 16-byte moves and the id comparison only on
    // exact ties. The order is total (worker ids are unique), so an unstable sort is
    // deterministic.
    keys.sort_unstable_by(|a, b| {
        a.0.total_cmp(&b.0)
            .then(a.1.cmp(&b.1))
            .then_with(|| id(a.2 as usize).cmp(id(b.2 as usize)))
    });
    keys.into_iter().map(|k| k.2).collect()
}

/// Fixed-point scale for the order-independent mean: 2^32, far finer than any weight, and
/// a u64 sum of values <= 2^32 cannot overflow below 2^32 candidates.
const FIXED_ONE: f64 = 4_294_967_296.0;

/// Something with raw term values to normalise: a live candidate, or a recorded one being
/// re-scored.
trait Normalise {
    fn raw(&self) -> &[Option<f64>; TERMS];
    fn normalised_mut(&mut self) -> &mut [f64; TERMS];
}

impl Normalise for Candidate<'_> {
    fn raw(&self) -> &[Option<f64>; TERMS] {
        &self.raw
    }
    fn normalised_mut(&mut self) -> &mut [f64; TERMS] {
        &mut self.normalised
    }
}

fn normalise<C: Normalise>(candidates: &mut [C]) {
    for (i, t) in term::ALL.iter().enumerate() {
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in candidates.iter().filter_map(|c| c.raw()[i]) {
            min = min.min(v);
            max = max.max(v);
        }
        let span = max - min;
        let invert = t.higher_is_better();
        let mut sum_fixed: u64 = 0;
        let mut available: u64 = 0;
        for c in candidates.iter_mut() {
            if let Some(v) = c.raw()[i] {
                let n = if span > 0.0 && span.is_finite() {
                    let n = if invert {
                        (max - v) / span
                    } else {
                        (v - min) / span
                    };
                    n.clamp(0.0, 1.0)
                } else {
                    0.0
                };
                c.normalised_mut()[i] = n;
                // `+ 0.5` then truncate: rounding without a libm call.
                sum_fixed = sum_fixed.saturating_add((n * FIXED_ONE + 0.5) as u64);
                available += 1;
            }
        }
        let neutral = if available == 0 {
            0.0
        } else {
            (sum_fixed as f64 / available as f64 / FIXED_ONE).clamp(0.0, 1.0)
        };
        for c in candidates.iter_mut().filter(|c| c.raw()[i].is_none()) {
            c.normalised_mut()[i] = neutral;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use metronome_protocol::{GpuStats, RejectionCode, TermScore};

    fn term(c: &CandidateScore, name: TermName) -> TermScore {
        c.term(name, &scoring(&SchedulerConfig::default()))
    }

    #[test]
    fn picks_the_least_loaded_and_explains_everyone() {
        let mut busy = worker("a");
        busy.status.active = 2;
        let idle = worker("b");
        let mut stale = worker("c");
        stale.last_seen_ms = 0;
        let workers = [busy, idle, stale];
        let e = evaluate(
            &job("m"),
            &workers,
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        );
        assert_eq!(e.winner.as_deref(), Some("b"));
        let ids: Vec<&str> = e.candidates.iter().map(|c| c.worker_id.as_str()).collect();
        assert_eq!(ids, ["b", "a"]);
        assert_eq!(e.rejected.len(), 1);
        assert_eq!(e.rejected[0].code, RejectionCode::StaleHeartbeat);
        assert_eq!(e.cost.kv_tokens, 200);
        assert_eq!(e.scoring, scoring(&SchedulerConfig::default()));
        for c in &e.candidates {
            let terms = c.terms(&e.scoring);
            let names: Vec<TermName> = terms.iter().map(|t| t.term).collect();
            assert_eq!(names, TermName::ALL);
            let sum: f64 = terms.iter().map(|t| t.contribution).sum();
            assert_eq!(
                sum, c.total,
                "the total is the contributions summed in term order"
            );
        }
        let a = term(&e.candidates[1], TermName::ActiveRequests);
        assert_eq!((a.raw, a.normalised, a.available), (Some(2.0), 1.0, true));
    }

    #[test]
    fn equal_values_normalise_to_zero() {
        let workers = [worker("a"), worker("b")];
        let e = evaluate(
            &job("m"),
            &workers,
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        );
        for c in &e.candidates {
            assert_eq!(c.total, 0.0);
        }
        assert_eq!(e.winner.as_deref(), Some("a"), "tie broken by worker id");
    }

    #[test]
    fn unavailable_terms_get_the_mean_of_the_known() {
        let mut a = worker("a");
        a.status.gpu = Some(GpuStats {
            util_frac: 0.2,
            mem_used_bytes: 0,
            mem_total_bytes: 1,
        });
        let mut b = worker("b");
        b.status.gpu = Some(GpuStats {
            util_frac: 0.9,
            mem_used_bytes: 0,
            mem_total_bytes: 1,
        });
        let c = worker("c"); // no NVML
        let e = evaluate(
            &job("m"),
            &[a, b, c],
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        );
        let by_id = |id: &str| e.candidates.iter().find(|c| c.worker_id == id).unwrap();
        let g = term(by_id("c"), TermName::GpuUtilisation);
        assert_eq!((g.raw, g.available, g.normalised), (None, false, 0.5));
        assert_eq!(term(by_id("a"), TermName::GpuUtilisation).normalised, 0.0);
        assert_eq!(e.winner.as_deref(), Some("a"));
        // Nobody has EWMAs: the term is neutral (0) for all and says so.
        let l = term(by_id("a"), TermName::LatencyEwma);
        assert_eq!((l.raw, l.available, l.normalised), (None, false, 0.0));
    }

    #[test]
    fn throughput_is_inverted() {
        let mut fast = worker("a");
        fast.ewma = Some(ewma(100.0, 10.0));
        let mut slow = worker("b");
        slow.ewma = Some(ewma(100.0, 40.0));
        let e = evaluate(
            &job("m"),
            &[slow, fast],
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        );
        assert_eq!(e.winner.as_deref(), Some("a"));
        assert_eq!(
            term(&e.candidates[0], TermName::ThroughputEwma).normalised,
            0.0
        );
        assert_eq!(
            term(&e.candidates[1], TermName::ThroughputEwma).normalised,
            1.0
        );
    }

    #[test]
    fn no_eligible_worker_means_no_winner() {
        let mut w = worker("a");
        w.status.model = "other".into();
        let e = evaluate(
            &job("m"),
            &[w],
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        );
        assert_eq!(e.winner, None);
        assert!(e.candidates.is_empty());
        assert_eq!(e.rejected[0].code, RejectionCode::WrongModel);
        assert_eq!(e.winner_score(), None);
    }

    #[test]
    fn a_burst_spreads_over_idle_workers() {
        let workers: Vec<WorkerView> = (0..4).map(|i| worker(&format!("w{i}"))).collect();
        let config = SchedulerConfig::default();
        let mut ledger = Ledger::new();
        let mut winners = Vec::new();
        for n in 0..4 {
            let mut j = job("m");
            j.job_id = format!("job-{n}");
            let e = evaluate(&j, &workers, &ledger, &config, NOW);
            let w = e.winner.unwrap();
            ledger.reserve(&w, &j.job_id, j.kv_tokens(), NOW).unwrap();
            winners.push(w);
        }
        assert_eq!(winners, ["w0", "w1", "w2", "w3"]);
    }
}
