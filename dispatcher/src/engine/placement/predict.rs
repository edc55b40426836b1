//! Prediction: what a job is expected to cost, the input every worker's forecast starts
//! from.
//!
//! A job is judged as a [`JobRequest`]: its prompt, its predicted output (the model's
//! output length given `max_tokens`, fitted from this term's completions), its SLO and the
//! TTFT budget its wait has left. The scheduling core turns it into one forecast per worker
//! ([`metronome_scheduler::Forecast::of`]: the job's prefill behind the worker's pending
//! prefill, its decode rate beside the worker's running jobs, the stall it imposes on
//! them), from which the filters admit and the terms score.
//!
//! **Cached prefixes.** A job with a prefix fingerprint (`Job::prefix`) is judged with
//! what each worker of its model holds of its prompt: what the worker's model server says
//! (its KV events, forwarded by its agent: [`metronome_scheduler::ReportedCaches`]) where
//! that report is live, else this leader's estimate from its own placements
//! ([`metronome_scheduler::PrefixIndex`]); each figure names its source. The
//! request carries the per-worker figures ([`JobRequest::prefix`]) and each worker's
//! forecast charges only the uncached rest as prefill (its TTFT, the stall it imposes on
//! the running streams, the prefill later placements wait behind), and counts as new KV
//! only what a running job there does not already hold. The admission filters and the
//! score then see the cheaper placement without change: a worker holding the prefix but
//! unable to meet the SLO is still refused. A job without a fingerprint is judged
//! exactly as before.

use metronome_protocol::prefix::PrefixFingerprint;
use metronome_protocol::{CompletionEvent, Job, PrefixSource, Slo};
use metronome_scheduler::{Cached, JobProfile, JobRequest, OutputLength, PrefixLookup};

use super::order::waited_ms;
use super::Judged;
use crate::engine::Engine;
use crate::queue::QueuedJob;

impl Engine {
    /// Expected output tokens of `job`: none for a job that generates nothing (an
    /// embedding: its cost is its prefill alone), else its model's output model when it
    /// has seen a completion, else the model's output-length EWMA, else `max_tokens`
    /// (nothing known, so the worst case).
    pub(in crate::engine) fn predicted_output(&self, job: &Job) -> f64 {
        if !job.endpoint.generates() {
            return 0.0;
        }
        match self.output_models.get(&job.model) {
            Some(m) if m.samples() > 0 => m.predict(job.max_tokens),
            _ => self
                .output_len
                .get(&job.model)
                .copied()
                .filter(|p| p.is_finite())
                .map_or(f64::from(job.max_tokens), |p| {
                    p.clamp(0.0, f64::from(job.max_tokens))
                }),
        }
    }

    /// Fit the model's output length from a completed job this leader assigned (its
    /// `max_tokens` is in the body it holds).
    pub(in crate::engine) fn learn_output_length(&mut self, event: &CompletionEvent) {
        let Some(a) = self.assigned.get(&event.job_id) else {
            return;
        };
        let (model, max_tokens) = (a.job.model.clone(), a.job.max_tokens);
        let prior = self.output_len.get(&model).copied().unwrap_or(f64::NAN);
        self.output_models
            .entry(model)
            .or_insert_with(|| OutputLength::new(prior))
            .observe(max_tokens, event.output_tokens);
    }

    /// What the job at the front of a placement asks of a worker: its prompt, its predicted
    /// output ([`Engine::predicted_output`]), its SLO and the TTFT budget its wait has
    /// left. Every worker's forecast starts from this request.
    pub(in crate::engine) fn request_of(&self, model: &str, job: &QueuedJob) -> (JobRequest, Slo) {
        let predicted = self.predicted_output(&job.job);
        let slo = self.s.scheduler.slo_for(model, job.job.slo.as_ref());
        let waited = waited_ms(job, slo.ttft_ms, self.now_ms);
        let request = JobRequest::from_job(&job.job, predicted, slo).waited(waited);
        let request = match &job.job.prefix {
            Some(fingerprint) => {
                request.with_prefix(self.cached_prefix(model, fingerprint, &job.job))
            }
            None => request,
        };
        (request, slo)
    }

    /// What each worker of `model` holds of `job`'s prompt: by its model server's KV
    /// events where its report is live, else by this leader's placements. Of the tokens
    /// the events name, those a running job there also uses (which take no new KV) come
    /// from the placements: the events say what is cached, not who uses it.
    fn cached_prefix(
        &self,
        model: &str,
        fingerprint: &PrefixFingerprint,
        job: &Job,
    ) -> PrefixLookup {
        let on = self
            .workers
            .iter()
            .filter(|w| w.status.model == model)
            .map(|w| {
                let id = w.worker_id();
                let placed = || self.prefix_index.cached(id, fingerprint, job.prompt_tokens);
                match self
                    .reported_caches
                    .cached(id, fingerprint, job.prompt_tokens, self.now_ms)
                {
                    // Nothing held: no shared blocks to look up (at a thousand workers the
                    // second index's lookups, each a cache miss, cost as much again).
                    Some(0) => (id, Cached::default(), PrefixSource::Events),
                    Some(tokens) => {
                        let cached = Cached {
                            tokens,
                            shared_tokens: placed().shared_tokens.min(tokens),
                        };
                        (id, cached, PrefixSource::Events)
                    }
                    None => (id, placed(), PrefixSource::Placements),
                }
            });
        PrefixLookup::by_worker(on)
    }

    /// The profile a placed job is protected with while it runs (its floor, against the
    /// stalls later admissions charge it): at a length it is unlikely to fall short of,
    /// since a job that ends sooner than expected has less time to absorb those stalls;
    /// decoding from its predicted first token on the chosen worker, after prefilling
    /// what that worker does not hold of its prompt (the prefill later placements there
    /// wait behind: its cached tokens are not).
    pub(in crate::engine) fn protected_profile(&self, model: &str, judged: &Judged) -> JobProfile {
        let request = &judged.request;
        let decoding_from_ms = judged
            .evaluation
            .winner_score()
            .and_then(|c| c.prediction)
            .map_or(0, |p| self.now_ms.saturating_add(p.ttft_ms.max(0.0) as u64));
        let protect = self
            .output_models
            .get(model)
            .filter(|m| m.samples() > 0)
            .map_or(request.predicted_output(), |m| {
                m.predict_low(request.max_tokens)
                    .min(request.predicted_output())
            });
        let cached_tokens = judged
            .evaluation
            .winner
            .as_deref()
            .map_or(0, |w| request.cached_on(w).tokens);
        // A job that writes nothing (an embedding) has no decode rate to protect: later
        // admissions may stall it (they delay its answer, which its TTFT target bounds).
        let min_tok_s = if request.max_tokens == 0 {
            0.0
        } else {
            judged.slo.min_tok_s
        };
        JobProfile {
            prompt_tokens: request.prompt_tokens,
            cached_tokens,
            protected_output: protect,
            min_tok_s,
            max_tokens: request.max_tokens,
            decoding_from_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use metronome_protocol::{CompletionEvent, CompletionOutcome, PROTOCOL_VERSION};

    use crate::engine::testing::{body, engine, queued, T0};

    fn completion(id: &str, output_tokens: u32) -> CompletionEvent {
        CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: id.into(),
            worker_id: "w".into(),
            model: "m".into(),
            epoch: 7,
            attempt: 1,
            outcome: CompletionOutcome::Done,
            streamed: true,
            error: None,
            prompt_tokens: 100,
            output_tokens,
            ttft_ms: Some(30.0),
            tpot_ms: Some(20.0),
            e2e_ms: 1_000.0,
            finished_ms: T0,
            job: None,
        }
    }

    #[test]
    fn nothing_known_predicts_max_tokens_and_the_ewma_is_bounded_by_it() {
        let mut e = engine(|_| {});
        let j = body("a", "m", None, 100, 400, T0);
        assert_eq!(e.predicted_output(&j), 400.0);
        e.output_len.insert("m".into(), 150.0);
        assert_eq!(e.predicted_output(&j), 150.0);
        e.output_len.insert("m".into(), 9_000.0);
        assert_eq!(e.predicted_output(&j), 400.0);
    }

    #[test]
    fn an_embedding_is_predicted_to_write_nothing_even_once_outputs_are_known() {
        let mut e = engine(|_| {});
        let mut j = body("a", "m", None, 100, 400, T0);
        j.endpoint = metronome_protocol::Endpoint::Embedding;
        j.max_tokens = 0;
        assert_eq!(e.predicted_output(&j), 0.0);
        e.output_len.insert("m".into(), 150.0);
        assert_eq!(e.predicted_output(&j), 0.0);
        let (request, _) = e.request_of("m", &queued(j, T0));
        assert_eq!(request.predicted_output(), 0.0);
        assert_eq!(request.kv_tokens(), 100);
    }

    #[test]
    fn completions_of_assigned_jobs_fit_the_output_model() {
        let mut e = engine(|_| {});
        let j = body("a", "m", None, 100, 1_000, T0);
        e.assigned.insert(
            "a".into(),
            crate::engine::AssignedJob {
                job: std::sync::Arc::new(j.clone()),
                attempt: 1,
                seq: 1,
                deadline_ms: T0 + 60_000,
                worker_id: None,
            },
        );
        e.learn_output_length(&completion("a", 200));
        let predicted = e.predicted_output(&j);
        assert!(predicted < 1_000.0, "{predicted}");
    }

    #[test]
    fn the_request_carries_the_ttft_budget_its_wait_has_left() {
        let e = engine(|_| {});
        let mut j = body("a", "m", None, 100, 10, T0);
        j.submitted_ms = T0;
        let (request, slo) = e.request_of("m", &queued(j, T0));
        assert_eq!(request.prompt_tokens, 100);
        assert_eq!(request.ttft_remaining_ms, Some(slo.ttft_ms as f64));
    }
}
