//! `metronome explain <job-id>`: the story of one job, told from the records the system
//! already keeps: every decision on `decisions.<tenant>.<job_id>` (one per attempt that reached an
//! outcome), the worker's completion event on `events.done.<worker_id>`, and the final
//! result on `results.<tenant>.<job_id>.<publisher>.final`.
//!
//! Pure: [`Story`] holds the records, [`Story::summary`] derives the numbers (winner,
//! margin over the runner-up, predicted against measured, SLO met or not) and
//! [`Story::render`] writes the text. Fetching lives in `source.rs`.

use serde::Serialize;

use metronome_protocol::{
    CandidateScore, CompletionEvent, CompletionOutcome, Decision, FinalResult, Outcome, Prediction,
    Slo, TermName, TermScore,
};

use crate::fmt::{self, Table};

/// Every record of one job, oldest first.
#[derive(Debug, Clone, Serialize)]
pub struct Story {
    pub job_id: String,
    /// Decisions on `decisions.<job_id>`, in stream order (one per attempt with an outcome).
    pub decisions: Vec<Decision>,
    /// Completion events of the job, in stream order (a refused attempt, then the real one).
    pub completions: Vec<CompletionEvent>,
    /// The final result, when still in the RESULTS stream.
    pub result: Option<FinalResult>,
}

/// What the last decision predicted next to what the worker measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub outcome: Outcome,
    pub attempts: usize,
    pub winner: Option<String>,
    pub winner_total: Option<f64>,
    pub runner_up: Option<String>,
    /// Runner-up total minus winner total (lower totals win, so this is ≥ 0).
    pub margin: Option<f64>,
    pub queue_wait_ms: u64,
    pub slo: Option<Slo>,
    pub predicted: Option<Prediction>,
    pub actual: Option<Actual>,
    /// Whether the measured job met its SLO; `None` when either side is unknown.
    pub slo_met: Option<bool>,
}

/// What the worker measured, from the completion event of the winning attempt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Actual {
    pub outcome: CompletionOutcome,
    pub ttft_ms: Option<f64>,
    /// Queue wait plus the worker's TTFT: the time to first token the client felt, give or
    /// take the hops between the components.
    pub ttft_from_submission_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    /// `1000 / tpot_ms`.
    pub tok_s: Option<f64>,
    pub e2e_ms: f64,
    pub output_tokens: u32,
    pub error: Option<String>,
}

impl Story {
    /// The decision that ended the story (the latest attempt).
    pub fn last(&self) -> Option<&Decision> {
        self.decisions.last()
    }

    /// The completion event of the latest decision's attempt on its winner. An event of an
    /// earlier attempt never stands in for it: that run is not the one the decision made.
    fn completion(&self) -> Option<&CompletionEvent> {
        let last = self.last()?;
        self.completions.iter().rev().find(|c| {
            c.attempt == last.attempt && Some(c.worker_id.as_str()) == last.worker_id.as_deref()
        })
    }

    /// The numbers of the story; `None` when no decision exists.
    pub fn summary(&self) -> Option<Summary> {
        let d = self.last()?;
        let winner = winner(d);
        let runner_up =
            winner.and_then(|w| d.candidates.iter().find(|c| c.worker_id != w.worker_id));
        let actual = self.completion().map(|c| Actual {
            outcome: c.outcome,
            ttft_ms: c.ttft_ms,
            ttft_from_submission_ms: c.ttft_ms.map(|t| t + d.queue_wait_ms as f64),
            tpot_ms: c.tpot_ms,
            tok_s: c.tpot_ms.and_then(fmt::tok_s_from_tpot),
            e2e_ms: c.e2e_ms,
            output_tokens: c.output_tokens,
            error: c.error.clone(),
        });
        let slo_met = match (&d.slo, &actual) {
            (Some(slo), Some(a)) if a.outcome == CompletionOutcome::Done => {
                match (a.ttft_from_submission_ms, a.tok_s) {
                    (Some(t), Some(r)) => Some(t <= slo.ttft_ms as f64 && r >= slo.min_tok_s),
                    // One output token: no decode rate to hold to the floor.
                    (Some(t), None) => Some(t <= slo.ttft_ms as f64),
                    _ => None,
                }
            }
            (Some(_), Some(_)) => Some(false),
            _ => None,
        };
        Some(Summary {
            outcome: d.outcome,
            attempts: self.decisions.len(),
            winner: d.worker_id.clone(),
            winner_total: winner.map(|w| w.total),
            runner_up: runner_up.map(|r| r.worker_id.clone()),
            margin: winner.zip(runner_up).map(|(w, r)| r.total - w.total),
            queue_wait_ms: d.queue_wait_ms,
            slo: d.slo,
            predicted: winner.and_then(|w| w.prediction),
            actual,
            slo_met,
        })
    }

    /// The story in words and tables, for people.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if self.decisions.is_empty() {
            out.push_str(&format!(
                "Job {}: no decision recorded (unknown id, or older than the DECISIONS stream keeps).\n",
                self.job_id
            ));
            return out;
        }
        let n = self.decisions.len();
        for (i, d) in self.decisions.iter().enumerate() {
            if n > 1 {
                out.push_str(&format!("── decision {} of {n} ──\n", i + 1));
            }
            render_decision(&mut out, d);
            out.push('\n');
        }
        self.render_outcome(&mut out);
        out
    }

    fn render_outcome(&self, out: &mut String) {
        let Some(s) = self.summary() else { return };
        let Some(d) = self.last() else { return };
        if d.outcome != Outcome::Assigned {
            // The decision already said why; a rejected or expired job never ran.
            if let Some(r) = &self.result {
                render_result(out, r);
            }
            return;
        }
        for c in &self.completions {
            if c.attempt != d.attempt {
                out.push_str(&format!(
                    "Earlier attempt {} on {}: {}{}\n",
                    c.attempt,
                    c.worker_id,
                    format!("{:?}", c.outcome).to_lowercase(),
                    c.error
                        .as_ref()
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default()
                ));
            }
        }
        match &s.actual {
            None => out.push_str(
                "What happened: no completion event found yet (still running, or older than the EVENTS stream keeps).\n",
            ),
            Some(a) => {
                out.push_str(&format!(
                    "What happened on {} (attempt {}):\n",
                    d.worker_id.as_deref().unwrap_or("?"),
                    d.attempt
                ));
                let p = s.predicted;
                let mut t = Table::new(["", "predicted", "measured"]);
                t.row([
                    "TTFT on the worker".to_string(),
                    p.map(|p| fmt::ms(p.ttft_ms)).unwrap_or_else(|| "n/a".into()),
                    a.ttft_ms.map(fmt::ms).unwrap_or_else(|| "n/a".into()),
                ]);
                t.row([
                    "TTFT from submission".to_string(),
                    p.map(|p| fmt::ms(p.ttft_ms + d.queue_wait_ms as f64))
                        .unwrap_or_else(|| "n/a".into()),
                    a.ttft_from_submission_ms
                        .map(fmt::ms)
                        .unwrap_or_else(|| "n/a".into()),
                ]);
                t.row([
                    "decode rate".to_string(),
                    fmt::tok_s(p.map(|p| p.decode_tok_s)),
                    match a.tpot_ms {
                        Some(tpot) => format!("{} (tpot {})", fmt::tok_s(a.tok_s), fmt::ms(tpot)),
                        None => "n/a".into(),
                    },
                ]);
                t.row(["end-to-end".to_string(), "-".into(), fmt::ms(a.e2e_ms)]);
                let mut outcome = format!("{:?}, {} output tokens", a.outcome, a.output_tokens)
                    .to_lowercase();
                if let Some(e) = &a.error {
                    outcome.push_str(&format!(" ({e})"));
                }
                t.row(["outcome".to_string(), "-".into(), outcome]);
                out.push_str(&t.render("  "));
                if let (Some(slo), Some(met)) = (s.slo, s.slo_met) {
                    out.push_str(&format!(
                        "  SLO {}: first token within {} of submission, at least {:.1} tok/s\n",
                        if met { "met" } else { "MISSED" },
                        fmt::ms(slo.ttft_ms as f64),
                        slo.min_tok_s
                    ));
                }
            }
        }
        if let Some(r) = &self.result {
            render_result(out, r);
        }
    }
}

/// Who the job was for and where its tenant stood in the fair queue, when the decision
/// says (older decisions carry none of it). The counter is what the dispatcher ordered
/// tenants by: the lowest waiting one is served next.
fn fairness_line(d: &Decision) -> Option<String> {
    if d.tenant.is_none() && d.priority.is_none() && d.fair_counter.is_none() {
        return None;
    }
    let tenant = match d.tenant.as_deref() {
        Some("") | None => "(none)".to_string(),
        Some(t) => t.to_string(),
    };
    let priority = d.priority.map_or("n/a", |p| p.as_str());
    let counter = match d.fair_counter {
        Some(c) => format!(
            "{c:.0} weighted tokens{}",
            if d.outcome == Outcome::Assigned {
                " (after this job's charge)"
            } else {
                ""
            }
        ),
        None => "n/a".into(),
    };
    Some(format!(
        "  tenant {tenant}, priority {priority}, fair-share counter {counter}\n"
    ))
}

/// The candidate that won: the decision's worker, else the best-scored candidate.
fn winner(d: &Decision) -> Option<&CandidateScore> {
    match &d.worker_id {
        Some(w) => d.candidates.iter().find(|c| &c.worker_id == w),
        None => None,
    }
}

fn render_decision(out: &mut String, d: &Decision) {
    let model = d.model.as_deref().unwrap_or("(unreadable)");
    let headline = match d.outcome {
        Outcome::Assigned => format!(
            "assigned to {} on attempt {}",
            d.worker_id.as_deref().unwrap_or("?"),
            d.attempt
        ),
        Outcome::Rejected => format!("REJECTED on attempt {}", d.attempt),
        Outcome::Expired => format!(
            "EXPIRED on attempt {}: it waited past its deadline without an eligible worker",
            d.attempt
        ),
    };
    out.push_str(&format!("Job {} (model {model}): {headline}\n", d.job_id));
    out.push_str(&format!(
        "  decided {} by dispatcher {} (epoch {}, policy {}) in {} µs\n",
        fmt::utc(d.decided_ms),
        d.dispatcher_id,
        d.epoch,
        d.policy,
        d.decision_latency_us
    ));
    if let Some(line) = fairness_line(d) {
        out.push_str(&line);
    }
    if let Some(reason) = &d.reason {
        let code = d
            .reason_code
            .as_deref()
            .map(|c| format!(" [{c}]"))
            .unwrap_or_default();
        let label = if d.outcome == Outcome::Assigned {
            "note"
        } else {
            "reason"
        };
        out.push_str(&format!("  {label}: {reason}{code}\n"));
    }
    match &d.slo {
        Some(slo) => out.push_str(&format!(
            "  SLO: first token within {} of submission, at least {:.1} tok/s\n",
            fmt::ms(slo.ttft_ms as f64),
            slo.min_tok_s
        )),
        None => out.push_str("  SLO: none recorded\n"),
    }
    if let Some(c) = &d.cost {
        out.push_str(&format!(
            "  job: {} prompt tokens, max {} output, {:.0} output predicted, {} KV tokens reserved\n",
            c.prompt_tokens, c.max_tokens, c.predicted_output_tokens, c.kv_tokens
        ));
    }
    out.push_str(&if d.queue_wait_ms >= 10_000 {
        format!(
            "  waited in queue: {} ({} ms)\n",
            fmt::ms(d.queue_wait_ms as f64),
            d.queue_wait_ms
        )
    } else {
        format!("  waited in queue: {} ms\n", d.queue_wait_ms)
    });

    if let Some(a) = &d.affinity {
        out.push_str(&format!("  prefix affinity: {}\n", affinity(a)));
    }

    if d.candidates.is_empty() {
        out.push_str("\nCandidates: none eligible\n");
    } else {
        out.push_str(&format!(
            "\nCandidates ({}, lowest total wins):\n",
            d.candidates.len()
        ));
        for (i, c) in d.candidates.iter().enumerate() {
            let mark = if Some(&c.worker_id) == d.worker_id.as_ref() {
                "  ← winner"
            } else {
                ""
            };
            out.push_str(&format!(
                "  #{} {}  total {:.3}{mark}\n",
                i + 1,
                c.worker_id,
                c.total
            ));
            if let Some(p) = &c.prediction {
                out.push_str(&format!("     predicted: {}\n", prediction(p)));
            }
            if let Some(cached) = &c.cached_prefix {
                out.push_str(&format!(
                    "     cached prefix: {} prompt tokens not prefilled (from {})\n",
                    cached.tokens,
                    cached.source.as_str()
                ));
            }
            out.push_str(&terms_table(&d.terms_of(c)).render("     "));
        }
    }
    if !d.rejected.is_empty() {
        out.push_str(&format!("\nNot eligible ({}):\n", d.rejected.len()));
        let mut t = Table::new(["worker", "code", "reason"]);
        for r in &d.rejected {
            let mut reason = r.reason.clone();
            if let Some(p) = &r.prediction {
                reason.push_str(&format!(" (predicted {})", prediction(p)));
            }
            t.row([r.worker_id.clone(), code(r.code), reason]);
        }
        out.push_str(&t.render("  "));
    }
    if d.outcome == Outcome::Assigned {
        if let Some(w) = winner(d) {
            let runner_up = d.candidates.iter().find(|c| c.worker_id != w.worker_id);
            out.push_str(&match runner_up {
                Some(r) => format!(
                    "\nWinner: {} with total {:.3}, {:.3} ahead of the runner-up {} ({:.3})\n",
                    w.worker_id,
                    w.total,
                    r.total - w.total,
                    r.worker_id,
                    r.total
                ),
                None => format!(
                    "\nWinner: {} with total {:.3}, the only eligible worker\n",
                    w.worker_id, w.total
                ),
            });
        }
    }
}

fn code(c: metronome_protocol::RejectionCode) -> String {
    serde_json::to_value(c)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{c:?}"))
}

fn prediction(p: &Prediction) -> String {
    let mut s = format!(
        "TTFT {}, {} for this job",
        fmt::ms(p.ttft_ms),
        fmt::tok_s(Some(p.decode_tok_s))
    );
    if let Some(w) = p.worst_running_tok_s {
        s.push_str(&format!(", slowest running job {}", fmt::tok_s(Some(w))));
    }
    if let (Some(stall), 2..) = (p.stall_ms, p.streams_after) {
        s.push_str(&format!(
            ", its prefill stalls each running stream {}",
            fmt::ms(stall)
        ));
    }
    s.push_str(&format!(
        ", {} streams after admission, model fitted on {} samples",
        p.streams_after, p.model_samples
    ));
    if p.model_samples == 0 {
        s.push_str(" (prior only)");
    }
    s
}

/// The raw value of a term with its unit.
fn raw(term: TermName, v: Option<f64>) -> String {
    let Some(v) = v else {
        return "n/a".into();
    };
    match term {
        TermName::ActiveRequests | TermName::QueueDepth => format!("{v:.0} req"),
        TermName::LatencyEwma | TermName::JobCost => fmt::ms(v),
        TermName::ThroughputEwma => fmt::tok_s(Some(v)),
        TermName::KvPressure | TermName::GpuUtilisation => fmt::pct(Some(v)),
    }
}

fn terms_table(terms: &[TermScore]) -> Table {
    let mut t = Table::new(["term", "raw", "normalised", "weight", "contribution"]);
    for s in terms {
        let mut contribution = format!("{:.3}", s.contribution);
        if !s.available {
            contribution.push_str("  (signal unavailable)");
        }
        t.row([
            s.term.as_str().to_string(),
            raw(s.term, s.raw),
            format!("{:.3}", s.normalised),
            format!("{:.2}", s.weight),
            contribution,
        ]);
    }
    t
}

fn render_result(out: &mut String, r: &FinalResult) {
    match &r.error {
        Some(e) => {
            let code = serde_json::to_value(e.code)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            out.push_str(&format!("Final result: error {code}: {}\n", e.message));
        }
        None => out.push_str(&format!(
            "Final result: ok from {}, {} prompt + {} completion tokens in {} chunks{}\n",
            r.worker_id.as_deref().unwrap_or("?"),
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            r.chunks,
            r.e2e_ms
                .map(|e| format!(", {} end to end", fmt::ms(e)))
                .unwrap_or_default()
        )),
    }
}

/// The JSON form of a story: the records as stored plus the derived summary.
pub fn to_json(story: &Story) -> serde_json::Value {
    serde_json::json!({
        "job_id": story.job_id,
        "summary": story.summary(),
        "decisions": story.decisions,
        "completions": story.completions,
        "result": story.result,
    })
}

/// A decision's prefix-affinity record in one line.
fn affinity(a: &metronome_protocol::Affinity) -> String {
    let held = format!(
        "{} holds {} cached prompt tokens",
        a.worker_id, a.cached_tokens
    );
    match a.outcome {
        metronome_protocol::AffinityOutcome::Chosen => {
            let chosen = format!(
                "{held}, chosen over the score's choice (at most {}× an even share)",
                a.max_share
            );
            match &a.reason {
                // A refused worker held more of the prompt.
                Some(reason) => format!("{chosen}; {reason}"),
                None => chosen,
            }
        }
        metronome_protocol::AffinityOutcome::Overridden => format!(
            "{held}, overridden: {} [{}]",
            a.reason.as_deref().unwrap_or("no reason recorded"),
            a.reason_code.as_deref().unwrap_or("-")
        ),
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Fixed records shared by the view tests.
    use metronome_protocol::*;

    /// Every term at weight 1 but GPU utilisation at 0.5.
    pub fn scoring() -> Scoring {
        let mut weights = [1.0; TERM_COUNT];
        weights[TermName::GpuUtilisation.index()] = 0.5;
        Scoring { weights }
    }

    /// Every term available at `10 × scale` (normalised `scale`) but GPU utilisation
    /// (unavailable, normalised 0.5).
    pub fn candidate(worker: &str, scale: f64, ttft: f64, tok_s: f64) -> CandidateScore {
        let gpu = TermName::GpuUtilisation.index();
        let mut raw = [Some(10.0 * scale); TERM_COUNT];
        let mut normalised = [scale; TERM_COUNT];
        raw[gpu] = None;
        normalised[gpu] = 0.5;
        let weights = scoring().weights;
        CandidateScore {
            worker_id: worker.into(),
            total: normalised.iter().zip(weights).map(|(n, w)| n * w).sum(),
            raw,
            normalised,
            prediction: Some(Prediction {
                ttft_ms: ttft,
                decode_tok_s: tok_s,
                step_tok_s: None,
                worst_running_tok_s: Some(tok_s - 2.0),
                streams_after: 3,
                model_samples: 240,
                stall_ms: Some(12.0),
            }),
            cached_prefix: None,
            recent_placements: None,
        }
    }

    pub fn assigned() -> Decision {
        Decision {
            v: DECISION_VERSION,
            job_id: "job-1".into(),
            model: Some("llama-3.1-8b".into()),
            outcome: Outcome::Assigned,
            attempt: 1,
            reason: None,
            reason_code: None,
            worker_id: Some("n1-gpu1".into()),
            cost: Some(metronome_protocol::decision::JobCostEstimate {
                prompt_tokens: 12,
                max_tokens: 64,
                predicted_output_tokens: 48.0,
                kv_tokens: 76,
            }),
            scoring: Some(scoring()),
            candidates: vec![
                candidate("n1-gpu1", 0.1, 120.0, 45.0),
                candidate("n1-gpu0", 0.2, 180.0, 38.0),
            ],
            rejected: vec![Rejection {
                worker_id: "n1-gpu2".into(),
                code: RejectionCode::AtConcurrencyCap,
                reason: "8 running + 0 reserved >= cap 8".into(),
                prediction: None,
            }],
            slo: Some(Slo {
                ttft_ms: 2000,
                min_tok_s: 30.0,
            }),
            policy: "metronome".into(),
            queue_wait_ms: 15,
            retry_after_ms: None,
            affinity: None,
            decision_latency_us: 42,
            epoch: 7,
            dispatcher_id: "d1".into(),
            decided_ms: 1_709_210_096_789,
            tenant: None,
            priority: None,
            fair_counter: None,
        }
    }

    pub fn done(worker: &str, attempt: u32) -> CompletionEvent {
        CompletionEvent {
            v: 1,
            job_id: "job-1".into(),
            worker_id: worker.into(),
            model: "llama-3.1-8b".into(),
            epoch: 7,
            attempt,
            outcome: CompletionOutcome::Done,
            streamed: true,
            error: None,
            prompt_tokens: 12,
            output_tokens: 64,
            ttft_ms: Some(135.0),
            tpot_ms: Some(25.0),
            e2e_ms: 1710.0,
            finished_ms: 1_709_210_098_500,
            job: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use metronome_protocol::{ErrorCode, ResultError, Usage};

    fn story() -> Story {
        Story {
            job_id: "job-1".into(),
            decisions: vec![assigned()],
            completions: vec![done("n1-gpu1", 1)],
            result: Some(FinalResult {
                v: 1,
                job_id: "job-1".into(),
                worker_id: Some("n1-gpu1".into()),
                response: None,
                error: None,
                usage: Usage {
                    prompt_tokens: 12,
                    completion_tokens: 64,
                    total_tokens: 76,
                },
                chunks: 65,
                ttft_ms: Some(140.0),
                e2e_ms: Some(1720.0),
            }),
        }
    }

    #[test]
    fn the_tenant_its_class_and_counter_are_told_when_recorded() {
        let mut st = story();
        assert!(
            !st.render().contains("fair-share"),
            "none recorded: no line"
        );
        st.decisions[0].tenant = Some("acme".into());
        st.decisions[0].priority = Some(metronome_protocol::Priority::Batch);
        st.decisions[0].fair_counter = Some(12_345.4);
        let text = st.render();
        assert!(
            text.contains(
                "  tenant acme, priority batch, fair-share counter 12345 weighted tokens (after this job's charge)\n"
            ),
            "{text}"
        );
        st.decisions[0].outcome = Outcome::Rejected;
        st.decisions[0].tenant = Some(String::new());
        st.decisions[0].fair_counter = None;
        let text = st.render();
        assert!(
            text.contains("tenant (none), priority batch, fair-share counter n/a\n"),
            "{text}"
        );
    }

    #[test]
    fn summary_derives_margin_prediction_and_slo() {
        let s = story().summary().unwrap();
        assert_eq!(s.winner.as_deref(), Some("n1-gpu1"));
        assert_eq!(s.runner_up.as_deref(), Some("n1-gpu0"));
        // Six terms at weight 1 plus GPU 0.25: 0.6 + 0.25 against 1.2 + 0.25.
        assert!((s.margin.unwrap() - 0.6).abs() < 1e-9, "{:?}", s.margin);
        assert_eq!(s.predicted.unwrap().ttft_ms, 120.0);
        let a = s.actual.unwrap();
        assert_eq!(a.tok_s, Some(40.0));
        assert_eq!(a.ttft_from_submission_ms, Some(150.0));
        assert_eq!(s.slo_met, Some(true));
    }

    #[test]
    fn a_slow_decode_misses_the_slo() {
        let mut st = story();
        st.completions[0].tpot_ms = Some(50.0); // 20 tok/s under a 30 tok/s floor.
        assert_eq!(st.summary().unwrap().slo_met, Some(false));
        assert!(st.render().contains("SLO MISSED"));
    }

    #[test]
    fn text_names_winner_terms_rejections_and_outcome() {
        let text = story().render();
        for needle in [
            "Job job-1 (model llama-3.1-8b): assigned to n1-gpu1 on attempt 1",
            "decided 2024-02-29 12:34:56.789Z by dispatcher d1 (epoch 7, policy metronome)",
            "SLO: first token within 2000 ms of submission, at least 30.0 tok/s",
            "waited in queue: 15 ms\n",
            "#1 n1-gpu1  total 0.850  ← winner",
            "predicted: TTFT 120 ms, 45.0 tok/s for this job",
            "n1-gpu2  at_concurrency_cap  8 running + 0 reserved >= cap 8",
            "Winner: n1-gpu1 with total 0.850, 0.600 ahead of the runner-up n1-gpu0 (1.450)",
            "What happened on n1-gpu1 (attempt 1):",
            "SLO met",
            "Final result: ok from n1-gpu1, 12 prompt + 64 completion tokens in 65 chunks",
            "(signal unavailable)",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        for term in TermName::ALL {
            assert!(
                text.contains(term.as_str()),
                "term {term:?} missing:\n{text}"
            );
        }
        // Measured next to predicted: TTFT 120 ms predicted, 135 ms measured; 40 tok/s.
        let ttft_line = text
            .lines()
            .find(|l| l.contains("TTFT on the worker"))
            .unwrap();
        assert!(
            ttft_line.contains("120 ms") && ttft_line.contains("135 ms"),
            "{ttft_line}"
        );
        let rate = text.lines().find(|l| l.contains("decode rate")).unwrap();
        assert!(
            rate.contains("45.0 tok/s") && rate.contains("40.0 tok/s (tpot 25 ms)"),
            "{rate}"
        );
    }

    #[test]
    fn a_candidates_cached_prefix_is_shown_when_recorded() {
        let mut s = story();
        assert!(!s.render().contains("cached prefix"));
        let d = s.decisions.last_mut().unwrap();
        d.candidates[0].cached_prefix = Some(metronome_protocol::CachedPrefix {
            tokens: 1_024,
            source: metronome_protocol::PrefixSource::Placements,
        });
        let text = s.render();
        assert!(
            text.contains("cached prefix: 1024 prompt tokens not prefilled (from placements)"),
            "{text}"
        );
        // A worker whose model server reports its cache: the figure names the events.
        let d = s.decisions.last_mut().unwrap();
        d.candidates[0].cached_prefix = Some(metronome_protocol::CachedPrefix {
            tokens: 2_000,
            source: metronome_protocol::PrefixSource::Events,
        });
        let text = s.render();
        assert!(
            text.contains("cached prefix: 2000 prompt tokens not prefilled (from events)"),
            "{text}"
        );
    }

    #[test]
    fn a_prefix_affinity_record_is_shown_with_its_reason() {
        let mut s = story();
        assert!(!s.render().contains("prefix affinity"));
        let d = s.decisions.last_mut().unwrap();
        d.affinity = Some(metronome_protocol::Affinity {
            worker_id: "n1-gpu3".into(),
            cached_tokens: 2_000,
            outcome: metronome_protocol::AffinityOutcome::Overridden,
            reason_code: Some("fair_share".into()),
            reason: Some("n1-gpu3 would have taken 5.0 of the last ~10 s's placements, above 1.5 times an even share".into()),
            max_share: 1.5,
        });
        let text = s.render();
        assert!(
            text.contains(
                "prefix affinity: n1-gpu3 holds 2000 cached prompt tokens, overridden: n1-gpu3 would have taken 5.0 of the last ~10 s's placements, above 1.5 times an even share [fair_share]"
            ),
            "{text}"
        );
        let d = s.decisions.last_mut().unwrap();
        let a = d.affinity.as_mut().unwrap();
        a.outcome = metronome_protocol::AffinityOutcome::Chosen;
        a.reason_code = None;
        a.reason = None;
        let text = s.render();
        assert!(
            text.contains("holds 2000 cached prompt tokens, chosen over the score's choice (at most 1.5× an even share)\n"),
            "{text}"
        );
        let a = s.decisions.last_mut().unwrap().affinity.as_mut().unwrap();
        a.reason = Some("n1-gpu0 holds more (2400 cached prompt tokens) but is not eligible: unhealthy (unhealthy)".into());
        let text = s.render();
        assert!(
            text.contains("an even share); n1-gpu0 holds more (2400 cached prompt tokens) but is not eligible"),
            "{text}"
        );
    }

    #[test]
    fn a_rejected_job_says_why_and_never_claims_a_run() {
        let mut d = assigned();
        d.outcome = Outcome::Rejected;
        d.worker_id = None;
        d.candidates.clear();
        d.reason = Some("the admission queue of llama-3.1-8b is full (512 jobs)".into());
        d.reason_code = Some("queue_full".into());
        let st = Story {
            job_id: "job-1".into(),
            decisions: vec![d],
            completions: vec![],
            result: Some(FinalResult {
                v: 1,
                job_id: "job-1".into(),
                worker_id: None,
                response: None,
                error: Some(ResultError {
                    code: ErrorCode::QueueFull,
                    message: "queue full".into(),
                }),
                usage: Usage::default(),
                chunks: 0,
                ttft_ms: None,
                e2e_ms: None,
            }),
        };
        let text = st.render();
        assert!(text.contains("REJECTED on attempt 1"), "{text}");
        assert!(
            text.contains(
                "reason: the admission queue of llama-3.1-8b is full (512 jobs) [queue_full]"
            ),
            "{text}"
        );
        assert!(text.contains("Candidates: none eligible"), "{text}");
        assert!(
            text.contains("Final result: error queue_full: queue full"),
            "{text}"
        );
        assert!(!text.contains("What happened"), "{text}");
        assert!(!text.contains("Winner"), "{text}");
    }

    #[test]
    fn an_expired_job_lists_why_every_worker_was_ineligible() {
        let mut d = assigned();
        d.outcome = Outcome::Expired;
        d.worker_id = None;
        d.candidates.clear();
        d.queue_wait_ms = 30_000;
        d.reason = Some("no eligible worker before the deadline".into());
        d.reason_code = Some("deadline_exceeded".into());
        let text = Story {
            job_id: "job-1".into(),
            decisions: vec![d],
            completions: vec![],
            result: None,
        }
        .render();
        assert!(
            text.contains("EXPIRED on attempt 1: it waited past its deadline"),
            "{text}"
        );
        assert!(
            text.contains("waited in queue: 30.0 s (30000 ms)"),
            "{text}"
        );
        assert!(text.contains("at_concurrency_cap"), "{text}");
    }

    #[test]
    fn several_attempts_are_told_in_order_and_the_last_one_counts() {
        let mut first = assigned();
        first.worker_id = Some("n1-gpu0".into());
        let mut second = assigned();
        second.attempt = 2;
        second.reason = Some("rescued: n1-gpu0 stopped heartbeating".into());
        let mut refused = done("n1-gpu0", 1);
        refused.outcome = CompletionOutcome::Refused;
        let st = Story {
            job_id: "job-1".into(),
            decisions: vec![first, second],
            completions: vec![refused, done("n1-gpu1", 2)],
            result: None,
        };
        let text = st.render();
        let one = text.find("── decision 1 of 2 ──").unwrap();
        let two = text.find("── decision 2 of 2 ──").unwrap();
        assert!(one < two);
        assert!(
            text.contains("note: rescued: n1-gpu0 stopped heartbeating"),
            "{text}"
        );
        assert!(
            text.contains("Earlier attempt 1 on n1-gpu0: refused"),
            "{text}"
        );
        let s = st.summary().unwrap();
        assert_eq!(s.attempts, 2);
        assert_eq!(s.actual.unwrap().outcome, CompletionOutcome::Done);
    }

    #[test]
    fn an_unknown_job_has_no_summary() {
        let st = Story {
            job_id: "nope".into(),
            decisions: vec![],
            completions: vec![],
            result: None,
        };
        assert!(st.summary().is_none());
        assert!(st.render().contains("no decision recorded"));
    }

    #[test]
    fn json_carries_records_and_summary() {
        let v = to_json(&story());
        assert_eq!(v["summary"]["winner"], "n1-gpu1");
        // The records as stored: the compact form, weights once, terms as arrays.
        assert_eq!(
            v["decisions"][0]["scoring"]["terms"]
                .as_array()
                .unwrap()
                .len(),
            7
        );
        assert_eq!(
            v["decisions"][0]["candidates"][0]["raw"]
                .as_array()
                .unwrap()
                .len(),
            7
        );
        assert_eq!(v["completions"][0]["ttft_ms"], 135.0);
        let back: Vec<Decision> = serde_json::from_value(v["decisions"].clone()).unwrap();
        assert_eq!(back[0], assigned());
    }
}
