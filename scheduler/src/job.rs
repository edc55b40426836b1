//! The job as the scheduler sees it: its model and its size in tokens.
//!
//! The size drives two things: the KV tokens to reserve (`prompt + max_tokens`, the most the
//! job can ever occupy) and the predicted output length used for the job-cost term (the
//! per-model output-length EWMA, never more than `max_tokens`).

use metronome_protocol::decision::{CachedPrefix, JobCostEstimate, PrefixSource};
use metronome_protocol::{Job, Slo};

use crate::prefix_index::Cached;
use serde::{Deserialize, Serialize};

/// One job to place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRequest {
    pub job_id: String,
    pub model: String,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Output tokens expected; capped at `max_tokens` wherever it is used.
    pub predicted_output_tokens: f64,
    /// The SLO the job is held to.
    pub slo: Slo,
    /// What is left of its TTFT target after the time it already waited, ms; `None` once
    /// that budget is spent (the job can no longer meet its TTFT anywhere, so only the
    /// jobs it would join are protected).
    pub ttft_remaining_ms: Option<f64>,
    /// What each worker holds of the job's prompt in its prefix cache, when the job
    /// carries a prefix fingerprint: its prefill there is only the uncached rest
    /// ([`JobRequest::prefill_tokens_on`]). `None`: every worker prefills all of it.
    #[serde(default)]
    pub prefix: Option<PrefixLookup>,
}

/// The cached part of one job's prompt on each worker that holds some of it, and where
/// each worker's figure comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefixLookup {
    /// Where the figures come from, for every worker not in `other_source`.
    pub source: PrefixSource,
    /// The workers holding part of the prompt, sorted by worker id.
    pub on: Vec<(String, Cached)>,
    /// The workers whose figure (held or not) comes from the other source, sorted: the
    /// fewer of the two, so a fleet where every worker reports (or none does) lists none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_source: Vec<String>,
}

fn other(source: PrefixSource) -> PrefixSource {
    match source {
        PrefixSource::Events => PrefixSource::Placements,
        PrefixSource::Placements => PrefixSource::Events,
    }
}

impl PrefixLookup {
    /// A lookup from `source` over the workers' figures (those holding nothing dropped).
    pub fn new(source: PrefixSource, on: impl IntoIterator<Item = (String, Cached)>) -> Self {
        let mut on: Vec<(String, Cached)> = on.into_iter().filter(|(_, c)| c.tokens > 0).collect();
        on.sort_by(|a, b| a.0.cmp(&b.0));
        PrefixLookup {
            source,
            on,
            other_source: Vec::new(),
        }
    }

    /// A lookup whose figures each name their own source (per worker: its id, its
    /// figure, where the figure comes from). An id is copied only where it is kept: a
    /// worker holding part of the prompt, or one whose figure has the other source.
    pub fn by_worker<S: AsRef<str> + Into<String>>(
        on: impl IntoIterator<Item = (S, Cached, PrefixSource)>,
    ) -> Self {
        let all: Vec<(S, Cached, PrefixSource)> = on.into_iter().collect();
        let events = all.iter().filter(|w| w.2 == PrefixSource::Events).count();
        let source = if 2 * events > all.len() {
            PrefixSource::Events
        } else {
            PrefixSource::Placements
        };
        let mut listed = Vec::new();
        let mut figures = Vec::new();
        for (w, c, s) in all {
            if s != source {
                listed.push(w.as_ref().to_owned());
            }
            if c.tokens > 0 {
                figures.push((w.into(), c));
            }
        }
        let mut lookup = PrefixLookup::new(source, figures);
        listed.sort();
        lookup.other_source = listed;
        lookup
    }

    /// What `worker_id` holds (nothing when it is not listed).
    pub fn on(&self, worker_id: &str) -> Cached {
        self.on
            .binary_search_by(|(w, _)| w.as_str().cmp(worker_id))
            .map_or(Cached::default(), |i| self.on[i].1)
    }

    /// Where `worker_id`'s figure comes from.
    pub fn source_on(&self, worker_id: &str) -> PrefixSource {
        if self
            .other_source
            .binary_search_by(|w| w.as_str().cmp(worker_id))
            .is_ok()
        {
            other(self.source)
        } else {
            self.source
        }
    }
}

impl JobRequest {
    /// Build from a wire job and a prediction of its output length (pass `max_tokens as
    /// f64` when no prediction exists: the worst case), held to `slo` with its whole TTFT
    /// budget left (see [`JobRequest::waited`]).
    pub fn from_job(job: &Job, predicted_output_tokens: f64, slo: Slo) -> Self {
        JobRequest {
            job_id: job.id.clone(),
            model: job.model.clone(),
            prompt_tokens: job.prompt_tokens,
            max_tokens: job.max_tokens,
            predicted_output_tokens,
            slo,
            ttft_remaining_ms: Some(slo.ttft_ms as f64),
            prefix: None,
        }
    }

    /// The same job with what each worker holds of its prompt.
    pub fn with_prefix(mut self, prefix: PrefixLookup) -> Self {
        self.prefix = Some(prefix);
        self
    }

    /// What `worker_id` holds of the prompt in its prefix cache.
    pub fn cached_on(&self, worker_id: &str) -> Cached {
        self.prefix
            .as_ref()
            .map_or(Cached::default(), |p| p.on(worker_id))
    }

    /// Prompt tokens `worker_id` would prefill: the prompt less what it holds.
    pub fn prefill_tokens_on(&self, worker_id: &str) -> u32 {
        self.prompt_tokens
            .saturating_sub(self.cached_on(worker_id).tokens)
    }

    /// New KV tokens the job can occupy on `worker_id` at its largest: [`Self::kv_tokens`]
    /// less the cached blocks a running job there already holds (shared, not allocated
    /// again). Cached blocks no job uses count in full: the server counts them free and
    /// allocates them again for this job.
    pub fn kv_tokens_on(&self, worker_id: &str) -> u64 {
        self.kv_tokens()
            .saturating_sub(u64::from(self.cached_on(worker_id).shared_tokens))
    }

    /// The cached part on `worker_id` as a decision records it; `None` for a job without
    /// a prefix fingerprint.
    pub fn cached_prefix_on(&self, worker_id: &str) -> Option<CachedPrefix> {
        self.prefix.as_ref().map(|p| CachedPrefix {
            tokens: p.on(worker_id).tokens,
            source: p.source_on(worker_id),
        })
    }

    /// The same job after waiting `waited_ms` since submission: its TTFT budget shrinks,
    /// and is gone (`None`) once the wait alone reaches the target.
    pub fn waited(mut self, waited_ms: u64) -> Self {
        self.ttft_remaining_ms =
            (waited_ms < self.slo.ttft_ms).then(|| (self.slo.ttft_ms - waited_ms) as f64);
        self
    }

    /// KV-cache tokens the job can occupy at its largest: prompt plus every output token.
    pub fn kv_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.max_tokens)
    }

    /// Predicted output tokens in `[0, max_tokens]`. A non-finite prediction means "no
    /// idea", so it takes the worst case, `max_tokens`.
    pub fn predicted_output(&self) -> f64 {
        let max = f64::from(self.max_tokens);
        let p = self.predicted_output_tokens;
        if p.is_finite() {
            p.clamp(0.0, max)
        } else {
            max
        }
    }

    /// The size record that goes into the decision.
    pub fn cost_estimate(&self) -> JobCostEstimate {
        JobCostEstimate {
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            predicted_output_tokens: self.predicted_output(),
            kv_tokens: self.kv_tokens(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(pred: f64) -> JobRequest {
        JobRequest {
            job_id: "j".into(),
            model: "m".into(),
            prompt_tokens: 100,
            max_tokens: 50,
            predicted_output_tokens: pred,
            slo: Slo {
                ttft_ms: 2_000,
                min_tok_s: 30.0,
            },
            ttft_remaining_ms: Some(2_000.0),
            prefix: None,
        }
    }

    #[test]
    fn a_worker_holding_part_of_the_prompt_prefills_the_rest() {
        let cached = |tokens, shared_tokens| Cached {
            tokens,
            shared_tokens,
        };
        let lookup = PrefixLookup::new(
            PrefixSource::Placements,
            [
                ("w2".to_string(), cached(64, 32)),
                ("w1".to_string(), cached(80, 0)),
                ("w3".to_string(), cached(0, 0)),
            ],
        );
        assert_eq!(lookup.on.len(), 2, "workers holding nothing are not listed");
        let j = job(1.0).with_prefix(lookup);
        assert_eq!(j.prefill_tokens_on("w1"), 20);
        assert_eq!(j.prefill_tokens_on("w2"), 36);
        assert_eq!(j.prefill_tokens_on("w3"), 100);
        assert_eq!(
            j.kv_tokens_on("w1"),
            150,
            "cached but unreferenced: allocated again"
        );
        assert_eq!(j.kv_tokens_on("w2"), 118);
        assert_eq!(
            j.cached_prefix_on("w3"),
            Some(CachedPrefix {
                tokens: 0,
                source: PrefixSource::Placements
            })
        );
        let plain = job(1.0);
        assert_eq!(plain.prefill_tokens_on("w1"), 100);
        assert_eq!(plain.cached_prefix_on("w1"), None);
    }

    #[test]
    fn each_worker_names_the_source_of_its_figure() {
        let held = Cached {
            tokens: 64,
            shared_tokens: 0,
        };
        let lookup = PrefixLookup::by_worker([
            ("w2".to_string(), held, PrefixSource::Events),
            ("w1".to_string(), held, PrefixSource::Placements),
            ("w3".to_string(), Cached::default(), PrefixSource::Events),
        ]);
        let j = job(1.0).with_prefix(lookup);
        let source = |w| j.cached_prefix_on(w).map(|c| (c.tokens, c.source));
        assert_eq!(source("w1"), Some((64, PrefixSource::Placements)));
        assert_eq!(source("w2"), Some((64, PrefixSource::Events)));
        assert_eq!(
            source("w3"),
            Some((0, PrefixSource::Events)),
            "events say: none"
        );
        // Only the minority's ids are listed (here the one estimated worker).
        assert_eq!(j.prefix.as_ref().unwrap().other_source, ["w1"]);
    }

    #[test]
    fn waiting_spends_the_ttft_budget() {
        let j = job(1.0);
        assert_eq!(j.clone().waited(500).ttft_remaining_ms, Some(1_500.0));
        assert_eq!(j.clone().waited(2_000).ttft_remaining_ms, None);
        assert_eq!(j.waited(u64::MAX).ttft_remaining_ms, None);
    }

    #[test]
    fn prediction_is_capped_at_max_tokens() {
        let c = job(80.0).cost_estimate();
        assert_eq!(c.predicted_output_tokens, 50.0);
        assert_eq!(c.kv_tokens, 150);
        assert_eq!(job(20.5).predicted_output(), 20.5);
        assert_eq!(job(-3.0).predicted_output(), 0.0);
        assert_eq!(job(f64::NAN).predicted_output(), 50.0);
    }

    #[test]
    fn kv_tokens_do_not_overflow() {
        let mut j = job(1.0);
        j.prompt_tokens = u32::MAX;
        j.max_tokens = u32::MAX;
        assert_eq!(j.kv_tokens(), 2 * u64::from(u32::MAX));
    }
}
