//! `metronome replay`: re-decide recorded decisions under another scheduler configuration,
//! from the state each decision recorded, without touching the running system.
//!
//! Each assigned decision carries every candidate's raw term values and its prediction
//! (docs/PROTOCOL.md). Replaying one is the scheduler's own normalise → select
//! ([`metronome_scheduler::rescore`]) over those candidates, after re-judging the SLO
//! filters on the recorded predictions:
//!
//! - **Weights** are replayed exactly: with a decision's own weights the re-score must
//!   reproduce its totals and winner, or the decision is not replayable (a record written
//!   by other scoring code, or cut short).
//! - **SLOs** (`slo`, `model_slo`) are re-judged on the predictions, only in the direction
//!   the new configuration moves them: a tightened floor or TTFT target drops candidates
//!   whose prediction misses it; a loosened one would admit workers that were refused, and
//!   a refused worker's score terms are not on the record, so such a decision is not
//!   replayable. A job's own SLO request is not recorded either: the configured SLO of a
//!   model is taken as the loosest SLO recorded for it in the replayed window, and anything
//!   tighter as the job's own request, which the new configuration can only tighten.
//! - Every other setting (heartbeat timeout, concurrency default, KV headroom, performance
//!   prior, reservation TTL) is held as recorded: the decision keeps the eligibility and
//!   the predictions those settings produced, because their inputs are not on the record.
//!
//! Decisions are replayed independently, each from its own recorded state: a changed
//! placement is not carried into the load that later decisions saw.
//!
//! Pure: decisions and a configuration in, a [`Report`] out.

use std::collections::BTreeMap;

use serde::Serialize;

use metronome_protocol::{
    CandidateScore, Decision, Outcome, Prediction, RejectionCode, Slo, SloRequest,
};
use metronome_scheduler::{rescore, SchedulerConfig, Weights};

use metronome_readmodel::fmt::{self, Table};

/// The scheduler settings replay re-evaluates; the others are held as recorded.
pub const REPLAYED_SETTINGS: [&str; 3] = ["weights", "slo", "model_slo"];
/// The scheduler settings whose effect replay takes from the record.
pub const HELD_SETTINGS: [&str; 6] = [
    "heartbeat_timeout_ms",
    "default_max_concurrency",
    "kv_headroom_frac",
    "perf_prior",
    "perf_claim_floor",
    "reservation_ttl_ms",
];

/// How many changed placements the text report lists (`--json` lists them all).
const LISTED_CHANGES: usize = 20;

/// Relative tolerance when checking that recorded totals are reproduced: the record went
/// through JSON, whose decimal form of a float may be off by one unit in the last place.
const TOTAL_TOLERANCE: f64 = 1e-9;

/// What replaying a window of decisions found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Decisions read.
    pub decisions: usize,
    /// Decisions re-decided (the others are in `not_replayable`).
    pub replayed: usize,
    /// Re-decided to the same worker.
    pub unchanged: usize,
    /// Re-decided to another worker.
    pub changed: usize,
    /// No candidate left under the new SLO: the job would have waited at that moment.
    pub would_wait: usize,
    /// Decisions that could not be re-decided, counted by reason.
    pub not_replayable: Vec<NotReplayable>,
    /// Jobs and predicted work per worker, as recorded and as replayed (replayed decisions
    /// only), most moved first.
    pub workers: Vec<WorkerShift>,
    /// Predicted effect on the jobs that would move.
    pub effect: Effect,
    /// Every changed placement (including jobs that would wait), in decision order.
    pub changes: Vec<Change>,
    /// Settings re-evaluated and settings held as recorded.
    pub settings_replayed: Vec<String>,
    pub settings_held: Vec<String>,
}

/// One reason a decision could not be re-decided.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NotReplayable {
    pub reason: String,
    pub count: usize,
    /// The first job it applied to, to look at with `metronome explain`.
    pub example_job_id: String,
}

/// One worker's load, recorded and replayed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerShift {
    pub worker_id: String,
    pub recorded_jobs: usize,
    pub replayed_jobs: usize,
    /// Predicted tokens of those jobs (prompt + predicted output).
    pub recorded_tokens: f64,
    pub replayed_tokens: f64,
}

impl WorkerShift {
    pub fn job_change(&self) -> i64 {
        self.replayed_jobs as i64 - self.recorded_jobs as i64
    }
}

/// Means over the moved jobs of their recorded winner's prediction and their replayed
/// winner's prediction (jobs whose two predictions are both recorded).
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Effect {
    pub moved_jobs: usize,
    pub ttft_ms_recorded: Option<f64>,
    pub ttft_ms_replayed: Option<f64>,
    pub decode_tok_s_recorded: Option<f64>,
    pub decode_tok_s_replayed: Option<f64>,
}

/// One placement that would change.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub job_id: String,
    pub attempt: u32,
    pub model: String,
    pub decided_ms: u64,
    pub recorded_worker: String,
    /// `None`: no candidate is left, the job would wait.
    pub replayed_worker: Option<String>,
    pub recorded: Option<Prediction>,
    pub replayed: Option<Prediction>,
}

/// The result of re-deciding one decision: the new winner (`None`: the job would wait)
/// and its prediction.
struct Redecided {
    winner: Option<String>,
    prediction: Option<Prediction>,
}

/// Read the `[scheduler]` table of a TOML file (a dispatcher configuration works as it
/// is: its other keys are ignored); no table means the defaults. Every invalid field is
/// reported, each by its TOML path.
pub fn config_from_toml(text: &str) -> Result<SchedulerConfig, Vec<String>> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| vec![e.to_string()])?;
    let config: SchedulerConfig = match table.remove("scheduler") {
        None => SchedulerConfig::default(),
        Some(value) => value
            .try_into()
            .map_err(|e: toml::de::Error| vec![format!("[scheduler]: {e}")])?,
    };
    config.validate().map_err(|errors| {
        errors
            .into_iter()
            .map(|e| format!("scheduler.{e}"))
            .collect::<Vec<_>>()
    })?;
    Ok(config)
}

/// Re-decide `decisions` (oldest first) under `config`.
pub fn replay(decisions: &[Decision], config: &SchedulerConfig) -> Report {
    let bases = configured_slos(decisions);
    let mut report = Report {
        decisions: decisions.len(),
        replayed: 0,
        unchanged: 0,
        changed: 0,
        would_wait: 0,
        not_replayable: Vec::new(),
        workers: Vec::new(),
        effect: Effect::default(),
        changes: Vec::new(),
        settings_replayed: REPLAYED_SETTINGS.map(String::from).to_vec(),
        settings_held: HELD_SETTINGS.map(String::from).to_vec(),
    };
    let mut skipped: BTreeMap<String, NotReplayable> = BTreeMap::new();
    let mut load: BTreeMap<String, WorkerShift> = BTreeMap::new();
    let mut shift = |worker: &str, recorded: bool, tokens: f64| {
        let w = load
            .entry(worker.to_string())
            .or_insert_with(|| WorkerShift {
                worker_id: worker.to_string(),
                recorded_jobs: 0,
                replayed_jobs: 0,
                recorded_tokens: 0.0,
                replayed_tokens: 0.0,
            });
        if recorded {
            w.recorded_jobs += 1;
            w.recorded_tokens += tokens;
        } else {
            w.replayed_jobs += 1;
            w.replayed_tokens += tokens;
        }
    };
    for d in decisions {
        let outcome = redecide(d, config, &bases);
        let Redecided { winner, prediction } = match outcome {
            Ok(r) => r,
            Err(reason) => {
                skipped
                    .entry(reason.clone())
                    .or_insert_with(|| NotReplayable {
                        reason,
                        count: 0,
                        example_job_id: d.job_id.clone(),
                    })
                    .count += 1;
                continue;
            }
        };
        report.replayed += 1;
        let recorded_worker = d.worker_id.clone().expect("checked by redecide");
        let tokens = d.cost.as_ref().map_or(0.0, |c| {
            f64::from(c.prompt_tokens) + c.predicted_output_tokens
        });
        shift(&recorded_worker, true, tokens);
        if let Some(w) = &winner {
            shift(w, false, tokens);
        }
        if winner.as_deref() == Some(recorded_worker.as_str()) {
            report.unchanged += 1;
            continue;
        }
        if winner.is_some() {
            report.changed += 1;
        } else {
            report.would_wait += 1;
        }
        let recorded = d
            .candidates
            .iter()
            .find(|c| c.worker_id == recorded_worker)
            .and_then(|c| c.prediction);
        report.changes.push(Change {
            job_id: d.job_id.clone(),
            attempt: d.attempt,
            model: d.model.clone().unwrap_or_default(),
            decided_ms: d.decided_ms,
            recorded_worker,
            replayed_worker: winner,
            recorded,
            replayed: prediction,
        });
    }
    report.effect = effect(&report.changes);
    report.not_replayable = skipped.into_values().collect();
    report
        .not_replayable
        .sort_by(|a, b| b.count.cmp(&a.count).then(a.reason.cmp(&b.reason)));
    report.workers = load.into_values().collect();
    report.workers.sort_by(|a, b| {
        b.job_change()
            .abs()
            .cmp(&a.job_change().abs())
            .then(a.worker_id.cmp(&b.worker_id))
    });
    report
}

fn effect(changes: &[Change]) -> Effect {
    let pairs: Vec<(&Prediction, &Prediction)> = changes
        .iter()
        .filter_map(|c| Some((c.recorded.as_ref()?, c.replayed.as_ref()?)))
        .collect();
    let mean = |f: &dyn Fn(&(&Prediction, &Prediction)) -> f64| {
        (!pairs.is_empty()).then(|| pairs.iter().map(f).sum::<f64>() / pairs.len() as f64)
    };
    Effect {
        moved_jobs: pairs.len(),
        ttft_ms_recorded: mean(&|p| p.0.ttft_ms),
        ttft_ms_replayed: mean(&|p| p.1.ttft_ms),
        decode_tok_s_recorded: mean(&|p| p.0.decode_tok_s),
        decode_tok_s_replayed: mean(&|p| p.1.decode_tok_s),
    }
}

/// Per model, the configured SLO as the record shows it: the loosest SLO any of its jobs
/// was held to (a job's own request can only tighten the configured one).
fn configured_slos(decisions: &[Decision]) -> BTreeMap<String, Slo> {
    let mut bases: BTreeMap<String, Slo> = BTreeMap::new();
    for d in decisions {
        let (Some(model), Some(slo)) = (&d.model, d.slo) else {
            continue;
        };
        bases
            .entry(model.clone())
            .and_modify(|b| {
                b.ttft_ms = b.ttft_ms.max(slo.ttft_ms);
                b.min_tok_s = b.min_tok_s.min(slo.min_tok_s);
            })
            .or_insert(slo);
    }
    bases
}

/// What a decision's job would be held to under `config`: the new configured SLO of its
/// model, tightened by what the job asked for itself (read as the part of its recorded SLO
/// tighter than the model's configured one).
fn new_slo(config: &SchedulerConfig, model: &str, recorded: Slo, base: Slo) -> Slo {
    let own = SloRequest {
        ttft_ms: (recorded.ttft_ms < base.ttft_ms).then_some(recorded.ttft_ms),
        min_tok_s: (recorded.min_tok_s > base.min_tok_s).then_some(recorded.min_tok_s),
    };
    config.slo_for(model, Some(&own))
}

/// The SLO filters of the scheduler, judged on a recorded prediction: the job's own rate
/// and the running jobs' rates at or above the floor (running jobs held to the job's
/// floor: their own are not recorded), and the TTFT within what is left of the target
/// after the recorded queue wait. An idle worker passes both, as in the filters.
struct SloCheck {
    rate_ok: bool,
    ttft_ok: bool,
}

fn check_slo(p: &Prediction, slo: Slo, waited_ms: u64) -> SloCheck {
    let idle = p.streams_after <= 1;
    let floor = slo.min_tok_s;
    let rate_ok = idle
        || (p.step_tok_s.unwrap_or(p.decode_tok_s) >= floor
            && p.worst_running_tok_s.is_none_or(|r| r >= floor));
    let ttft_ok = idle || waited_ms >= slo.ttft_ms || p.ttft_ms <= (slo.ttft_ms - waited_ms) as f64;
    SloCheck { rate_ok, ttft_ok }
}

fn redecide(
    d: &Decision,
    config: &SchedulerConfig,
    bases: &BTreeMap<String, Slo>,
) -> Result<Redecided, String> {
    match d.outcome {
        Outcome::Assigned => {}
        Outcome::Rejected => {
            return Err(format!(
                "rejected before scheduling ({})",
                d.reason_code.as_deref().unwrap_or("no reason code")
            ))
        }
        Outcome::Expired => {
            return Err(
                "expired: no worker was eligible, so no candidate scores were recorded".into(),
            )
        }
    }
    if d.policy != "metronome" {
        return Err(format!(
            "decided by the {} policy, which does not score",
            d.policy
        ));
    }
    let Some(recorded_winner) = d.worker_id.as_deref() else {
        return Err("assigned without a recorded worker".into());
    };
    let note = d.reason.as_deref().unwrap_or("");
    // The engine's notes are the only record of these cases.
    if note.contains("placed where it does least harm") {
        return Err(
            "placed where it does least harm (chosen by predicted misses, not by score)".into(),
        );
    }
    if note.contains("without protecting the floors") {
        return Err(
            "judged without the floors of a tenant above its fair share (its running jobs' predicted rates were not held to their floor)".into(),
        );
    }
    if note.contains("candidates not listed") {
        return Err("candidates cut short by decision_max_candidates".into());
    }
    if d.candidates.is_empty() {
        return Err("no candidate scores recorded".into());
    }
    let Some(scoring) = d.scoring else {
        return Err("no weights recorded".into());
    };
    let Some(model) = d.model.as_deref() else {
        return Err("no model recorded".into());
    };
    let Some(recorded_slo) = d.slo else {
        return Err("no SLO recorded (written by an older dispatcher)".into());
    };

    // The record must reproduce itself before it can say anything about other weights.
    let recorded_weights = Weights::from_array(scoring.weights);
    let recorded_share = d.affinity.as_ref().map_or(0.0, |a| a.max_share);
    let again = rescore(&d.candidates, &recorded_weights, recorded_share);
    let reproduces = again[0].worker_id == recorded_winner
        && d.candidates.iter().all(|c| {
            again.iter().any(|a| {
                a.worker_id == c.worker_id
                    && (a.total - c.total).abs() <= TOTAL_TOLERANCE * c.total.abs().max(1.0)
            })
        });
    if !reproduces {
        return Err("the recorded scores do not reproduce the recorded winner".into());
    }

    let base = bases.get(model).copied().unwrap_or(recorded_slo);
    let slo = new_slo(config, model, recorded_slo, base);
    let tighter_rate = slo.min_tok_s > recorded_slo.min_tok_s;
    let tighter_ttft = slo.ttft_ms < recorded_slo.ttft_ms;
    let looser_rate = slo.min_tok_s < recorded_slo.min_tok_s;
    let looser_ttft = slo.ttft_ms > recorded_slo.ttft_ms;

    for r in &d.rejected {
        let loosened = match r.code {
            RejectionCode::BelowSloFloor => looser_rate,
            RejectionCode::TtftOverBudget => looser_ttft,
            _ => false,
        };
        if !loosened {
            continue;
        }
        let Some(p) = &r.prediction else {
            return Err(format!(
                "{} was refused by its SLO ({}) without a recorded prediction",
                r.worker_id,
                code_name(r.code)
            ));
        };
        let c = check_slo(p, slo, d.queue_wait_ms);
        if c.rate_ok && c.ttft_ok {
            return Err(
                "a worker refused by the SLO would be eligible under the new SLO, and a refused worker's score terms are not recorded"
                    .into(),
            );
        }
    }

    let mut kept: Vec<CandidateScore> = Vec::with_capacity(d.candidates.len());
    for c in &d.candidates {
        if tighter_rate || tighter_ttft {
            let Some(p) = &c.prediction else {
                return Err(format!(
                    "candidate {} has no recorded prediction to judge the new SLO on",
                    c.worker_id
                ));
            };
            let check = check_slo(p, slo, d.queue_wait_ms);
            if (tighter_rate && !check.rate_ok) || (tighter_ttft && !check.ttft_ok) {
                continue;
            }
        }
        kept.push(c.clone());
    }
    let ranked = rescore(&kept, &config.weights, config.affinity_max_share);
    Ok(Redecided {
        winner: ranked.first().map(|c| c.worker_id.clone()),
        prediction: ranked.first().and_then(|c| c.prediction),
    })
}

fn code_name(code: RejectionCode) -> String {
    serde_json::to_value(code)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

impl Report {
    /// The report for people: the counts, the load by worker, the predicted effect, why
    /// decisions were not replayable, and the first changed placements.
    pub fn render(&self, window: &str) -> String {
        let mut out = format!(
            "Replayed {} decisions from the last {window}: {} re-decided, {} not replayable\n",
            self.decisions,
            self.replayed,
            self.not_replayable.iter().map(|n| n.count).sum::<usize>()
        );
        out.push_str(&format!(
            "  placements that would change: {} of {}{}\n",
            self.changed + self.would_wait,
            self.replayed,
            if self.would_wait > 0 {
                format!(
                    " ({} to another worker, {} would wait: no worker left under the new SLO)",
                    self.changed, self.would_wait
                )
            } else {
                String::new()
            }
        ));
        out.push_str(&format!(
            "  re-evaluated: {}; held as recorded: {}\n",
            self.settings_replayed.join(", "),
            self.settings_held.join(", ")
        ));
        if !self.workers.is_empty() {
            out.push_str(
                "\nLoad by worker (replayed decisions; tokens = prompt + predicted output):\n",
            );
            let mut t = Table::new([
                "worker",
                "jobs recorded",
                "replayed",
                "change",
                "tokens recorded",
                "replayed",
            ]);
            for w in &self.workers {
                t.row([
                    w.worker_id.clone(),
                    w.recorded_jobs.to_string(),
                    w.replayed_jobs.to_string(),
                    format!("{:+}", w.job_change()),
                    format!("{:.0}", w.recorded_tokens),
                    format!("{:.0}", w.replayed_tokens),
                ]);
            }
            out.push_str(&t.render("  "));
        }
        if self.effect.moved_jobs > 0 {
            let e = &self.effect;
            out.push_str(&format!(
                "\nPredicted effect on the {} moved jobs (means of the recorded predictions):\n",
                e.moved_jobs
            ));
            let mut t = Table::new(["", "recorded winner", "replayed winner", "change"]);
            let diff = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| b - a);
            t.row([
                "TTFT".to_string(),
                opt_ms(e.ttft_ms_recorded),
                opt_ms(e.ttft_ms_replayed),
                diff(e.ttft_ms_recorded, e.ttft_ms_replayed)
                    .map_or("n/a".into(), |d| format!("{d:+.0} ms")),
            ]);
            t.row([
                "decode rate".to_string(),
                fmt::tok_s(e.decode_tok_s_recorded),
                fmt::tok_s(e.decode_tok_s_replayed),
                diff(e.decode_tok_s_recorded, e.decode_tok_s_replayed)
                    .map_or("n/a".into(), |d| format!("{d:+.1} tok/s")),
            ]);
            out.push_str(&t.render("  "));
        }
        if !self.not_replayable.is_empty() {
            out.push_str("\nNot replayable:\n");
            let mut t = Table::new(["count", "reason", "e.g. job"]);
            for n in &self.not_replayable {
                t.row([
                    n.count.to_string(),
                    n.reason.clone(),
                    n.example_job_id.clone(),
                ]);
            }
            out.push_str(&t.render("  "));
        }
        if !self.changes.is_empty() {
            let shown = self.changes.len().min(LISTED_CHANGES);
            out.push_str(&format!(
                "\nChanged placements ({shown} of {}{}):\n",
                self.changes.len(),
                if shown < self.changes.len() {
                    "; --json lists all"
                } else {
                    ""
                }
            ));
            let mut t = Table::new(["decided", "job", "from", "to", "TTFT", "decode rate"]);
            for c in &self.changes[..shown] {
                let pair = |f: fn(&Prediction) -> String| {
                    format!(
                        "{} → {}",
                        c.recorded.as_ref().map_or("n/a".into(), f),
                        c.replayed.as_ref().map_or("n/a".into(), f)
                    )
                };
                t.row([
                    fmt::utc_time(c.decided_ms),
                    c.job_id.clone(),
                    c.recorded_worker.clone(),
                    c.replayed_worker
                        .clone()
                        .unwrap_or_else(|| "(waits)".into()),
                    pair(|p| fmt::ms(p.ttft_ms)),
                    pair(|p| fmt::tok_s(Some(p.decode_tok_s))),
                ]);
            }
            out.push_str(&t.render("  "));
        }
        out
    }
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), fmt::ms)
}

/// Parse a window such as `90s`, `30m`, `1h`, `2d` into milliseconds.
pub fn parse_window(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{text:?} is not a window like 90s, 30m, 1h or 2d"))?;
    let unit_ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{text:?}: the unit must be s, m, h or d")),
    };
    n.checked_mul(unit_ms)
        .filter(|ms| *ms > 0)
        .ok_or_else(|| format!("{text:?} is not a positive window"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use metronome_protocol::decision::JobCostEstimate;
    use metronome_protocol::{Rejection, Scoring, TermName};

    const SLO: Slo = Slo {
        ttft_ms: 2_000,
        min_tok_s: 30.0,
    };

    fn prediction(ttft_ms: f64, decode_tok_s: f64, streams_after: u32) -> Prediction {
        Prediction {
            ttft_ms,
            decode_tok_s,
            step_tok_s: None,
            worst_running_tok_s: None,
            streams_after,
            model_samples: 10,
            stall_ms: None,
        }
    }

    /// A candidate as the dispatcher records it: raw values for active requests and KV
    /// pressure (the rest unavailable); `decision` scores them.
    fn raw(worker: &str, active: f64, kv: f64, p: Prediction) -> CandidateScore {
        let mut raw = [None; metronome_protocol::TERM_COUNT];
        raw[TermName::ActiveRequests.index()] = Some(active);
        raw[TermName::KvPressure.index()] = Some(kv);
        CandidateScore {
            worker_id: worker.into(),
            total: 0.0,
            raw,
            normalised: [0.0; metronome_protocol::TERM_COUNT],
            prediction: Some(p),
            cached_prefix: None,
            recent_placements: None,
        }
    }

    /// An assigned decision scored under `weights`, as the dispatcher would record it.
    fn decision(job: &str, candidates: &[CandidateScore], weights: &Weights) -> Decision {
        let scored = rescore(candidates, weights, 0.0);
        Decision {
            v: 1,
            job_id: job.into(),
            model: Some("m".into()),
            outcome: Outcome::Assigned,
            attempt: 1,
            reason: None,
            reason_code: None,
            worker_id: Some(scored[0].worker_id.clone()),
            cost: Some(JobCostEstimate {
                prompt_tokens: 10,
                max_tokens: 100,
                predicted_output_tokens: 40.0,
                kv_tokens: 110,
            }),
            scoring: Some(Scoring {
                weights: weights.as_array(),
            }),
            candidates: scored,
            rejected: Vec::new(),
            slo: Some(SLO),
            retry_after_ms: None,
            affinity: None,
            tenant: None,
            priority: None,
            fair_counter: None,
            policy: "metronome".into(),
            queue_wait_ms: 0,
            decision_latency_us: 10,
            epoch: 1,
            dispatcher_id: "d".into(),
            decided_ms: 1_000,
        }
    }

    /// `a` idle but with a fuller KV cache, `b` busier with an emptier one: the default
    /// weights (active requests 2.0) pick `a`; without the active-requests weight, `b`.
    fn contested(job: &str) -> Decision {
        decision(
            job,
            &[
                raw("a", 0.0, 0.5, prediction(100.0, 50.0, 1)),
                raw("b", 1.0, 0.1, prediction(150.0, 40.0, 2)),
            ],
            &Weights::default(),
        )
    }

    /// Both idle, `a` with the emptier KV cache: `a` under any weights.
    fn clear(job: &str) -> Decision {
        decision(
            job,
            &[
                raw("a", 0.0, 0.1, prediction(100.0, 50.0, 1)),
                raw("b", 0.0, 0.5, prediction(100.0, 50.0, 1)),
            ],
            &Weights::default(),
        )
    }

    fn config(weights: Weights) -> SchedulerConfig {
        SchedulerConfig {
            weights,
            ..SchedulerConfig::default()
        }
    }

    #[test]
    fn the_recorded_configuration_changes_nothing() {
        let decisions = vec![contested("j1"), clear("j2"), contested("j3")];
        let r = replay(&decisions, &SchedulerConfig::default());
        assert_eq!((r.decisions, r.replayed, r.unchanged), (3, 3, 3));
        assert_eq!((r.changed, r.would_wait), (0, 0));
        assert!(r.changes.is_empty() && r.not_replayable.is_empty());
        assert!(r.workers.iter().all(|w| w.job_change() == 0));
        assert_eq!(r.effect, Effect::default());
    }

    #[test]
    fn other_weights_move_exactly_the_contested_jobs() {
        let decisions = vec![contested("j1"), clear("j2"), contested("j3")];
        let weights = Weights {
            active_requests: 0.0,
            ..Weights::default()
        };
        let r = replay(&decisions, &config(weights));
        assert_eq!((r.replayed, r.unchanged, r.changed), (3, 1, 2));
        let moved: Vec<(&str, Option<&str>)> = r
            .changes
            .iter()
            .map(|c| (c.job_id.as_str(), c.replayed_worker.as_deref()))
            .collect();
        assert_eq!(moved, [("j1", Some("b")), ("j3", Some("b"))]);
        let by_id = |id: &str| r.workers.iter().find(|w| w.worker_id == id).unwrap();
        assert_eq!((by_id("a").recorded_jobs, by_id("a").replayed_jobs), (3, 1));
        assert_eq!((by_id("b").recorded_jobs, by_id("b").replayed_jobs), (0, 2));
        assert_eq!(by_id("b").replayed_tokens, 100.0);
        assert_eq!(r.effect.moved_jobs, 2);
        assert_eq!(r.effect.ttft_ms_recorded, Some(100.0));
        assert_eq!(r.effect.ttft_ms_replayed, Some(150.0));
        assert_eq!(r.effect.decode_tok_s_replayed, Some(40.0));
        let text = r.render("1h");
        assert!(
            text.contains("placements that would change: 2 of 3\n"),
            "{text}"
        );
        assert!(text.contains("100 ms → 150 ms"), "{text}");
    }

    #[test]
    fn a_tighter_floor_drops_candidates_whose_prediction_misses_it() {
        // Recorded winner `a` decodes at 50 tok/s beside another stream, `b` at 70.
        let mut d = decision(
            "j1",
            &[
                raw("a", 1.0, 0.1, prediction(100.0, 50.0, 2)),
                raw("b", 1.0, 0.5, prediction(100.0, 70.0, 2)),
            ],
            &Weights::default(),
        );
        assert_eq!(d.worker_id.as_deref(), Some("a"));
        let mut c = SchedulerConfig::default();
        c.slo.min_tok_s = 60.0;
        let r = replay(std::slice::from_ref(&d), &c);
        assert_eq!(r.changes[0].replayed_worker.as_deref(), Some("b"));
        // A floor neither meets: the job would wait.
        c.slo.min_tok_s = 80.0;
        let r = replay(std::slice::from_ref(&d), &c);
        assert_eq!((r.changed, r.would_wait), (0, 1));
        assert_eq!(r.changes[0].replayed_worker, None);
        // A tighter TTFT target after a 1.95 s wait: 100 ms no longer fits in 50 ms left.
        d.queue_wait_ms = 1_950;
        let mut c = SchedulerConfig::default();
        c.slo.ttft_ms = 2_000;
        let mut looser = d.clone();
        looser.slo = Some(Slo {
            ttft_ms: 3_000,
            ..SLO
        });
        let r = replay(&[looser], &c);
        assert_eq!(r.would_wait, 1, "{r:?}");
    }

    #[test]
    fn a_job_keeps_the_slo_it_asked_for() {
        // j2 asked for 45 tok/s; the model's configured floor reads as 30 (the loosest).
        let mut tight = contested("j2");
        tight.slo = Some(Slo {
            min_tok_s: 45.0,
            ..SLO
        });
        let decisions = vec![contested("j1"), tight];
        let r = replay(&decisions, &SchedulerConfig::default());
        assert_eq!(r.unchanged, 2, "{r:?}");
        // Raising the model's floor to 42 drops b (40 tok/s beside a stream) from j1's
        // candidates, but a, the recorded winner, is idle and passes any floor; j2 already
        // asked for more.
        let mut c = SchedulerConfig::default();
        c.slo.min_tok_s = 42.0;
        assert_eq!(replay(&decisions, &c).unchanged, 2);
    }

    #[test]
    fn a_looser_slo_that_would_admit_a_refused_worker_is_not_replayable() {
        let mut d = clear("j1");
        d.rejected.push(Rejection {
            worker_id: "c".into(),
            code: RejectionCode::BelowSloFloor,
            reason: "below SLO".into(),
            prediction: Some(prediction(100.0, 25.0, 3)),
        });
        let same = replay(std::slice::from_ref(&d), &SchedulerConfig::default());
        assert_eq!(same.unchanged, 1);
        let mut c = SchedulerConfig::default();
        c.slo.min_tok_s = 20.0;
        let r = replay(std::slice::from_ref(&d), &c);
        assert_eq!(r.replayed, 0);
        assert!(r.not_replayable[0].reason.contains("refused by the SLO"));
        // Loosened, but still too fast a floor for c: replayable.
        c.slo.min_tok_s = 28.0;
        assert_eq!(replay(&[d], &c).unchanged, 1);
    }

    #[test]
    fn decisions_without_what_replay_needs_are_counted_with_their_reason() {
        let mut rejected = clear("r");
        rejected.outcome = Outcome::Rejected;
        rejected.reason_code = Some("queue_full".into());
        let mut expired = clear("e");
        expired.outcome = Outcome::Expired;
        let mut baseline = clear("b");
        baseline.policy = "round_robin".into();
        let mut harm = clear("h");
        harm.reason = Some("placed where it does least harm: no worker admitted it".into());
        let mut waived = clear("w");
        waived.reason = Some("judged without protecting the floors of the jobs of tenants above their fair share (2.0 of the model's 6 running jobs): flood runs 4".into());
        let mut cut = clear("c");
        cut.reason = Some("3 more candidates not listed (decision_max_candidates = 2)".into());
        let mut tampered = clear("t");
        tampered.candidates[0].total = 5.0;
        let mut no_slo = clear("s");
        no_slo.slo = None;
        let decisions = [
            rejected, expired, baseline, harm, waived, cut, tampered, no_slo,
        ];
        let r = replay(&decisions, &SchedulerConfig::default());
        assert_eq!((r.decisions, r.replayed), (8, 0));
        let reasons: Vec<(&str, &str)> = r
            .not_replayable
            .iter()
            .map(|n| (n.example_job_id.as_str(), n.reason.as_str()))
            .collect();
        assert_eq!(reasons.len(), 8, "{reasons:?}");
        for (job, needle) in [
            ("r", "rejected before scheduling (queue_full)"),
            ("e", "expired"),
            ("b", "round_robin policy"),
            ("h", "least harm"),
            ("w", "above its fair share"),
            ("c", "decision_max_candidates"),
            ("t", "do not reproduce"),
            ("s", "no SLO recorded"),
        ] {
            assert!(
                reasons.iter().any(|(j, r)| *j == job && r.contains(needle)),
                "{job}: {needle} not in {reasons:?}"
            );
        }
        let text = r.render("1h");
        assert!(text.contains("Not replayable:"), "{text}");
    }

    #[test]
    fn the_scheduler_table_of_a_dispatcher_config_is_read() {
        let c = config_from_toml(
            "nats_url = \"nats://x:4222\"\npolicy = \"metronome\"\n[scheduler.weights]\nactive_requests = 0.5\n[scheduler.slo]\nmin_tok_s = 40.0\n",
        )
        .unwrap();
        assert_eq!(c.weights.active_requests, 0.5);
        assert_eq!(c.weights.job_cost, Weights::default().job_cost);
        assert_eq!(c.slo.min_tok_s, 40.0);
        assert_eq!(
            config_from_toml("policy = \"metronome\"\n").unwrap(),
            SchedulerConfig::default()
        );
        let errors = config_from_toml("[scheduler.weights]\njob_cost = -1.0\nkv_pressure = -2.0\n")
            .unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors[0].starts_with("scheduler.weights.job_cost:"),
            "{errors:?}"
        );
        let typo = config_from_toml("[scheduler.weights]\njobcost = 1.0\n").unwrap_err();
        assert!(typo[0].contains("jobcost"), "{typo:?}");
    }

    #[test]
    fn windows_parse_with_their_unit() {
        assert_eq!(parse_window("90s"), Ok(90_000));
        assert_eq!(parse_window("30m"), Ok(1_800_000));
        assert_eq!(parse_window("1h"), Ok(3_600_000));
        assert_eq!(parse_window("2d"), Ok(172_800_000));
        assert!(parse_window("1w").is_err());
        assert!(parse_window("h").is_err());
        assert!(parse_window("0s").is_err());
    }
}
