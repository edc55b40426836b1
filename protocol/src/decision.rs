//! The Decision: one audit record per job outcome on `decisions.<tenant>.<job_id>`, with
//! every number that led to it, so "why was this request slow?" has an answer.
//!
//! **Two forms on the wire.** Records up to version 2 list every candidate's seven terms
//! as objects (`{"term", "raw", "normalised", "weight", "contribution", "available"}`):
//! about 900 bytes per candidate, most of it field names and numbers every candidate
//! repeats. Version 3 ([`DECISION_VERSION`], the form this crate writes) says the term
//! names and weights once per decision (`scoring`) and gives each candidate its raw and
//! normalised values as arrays in that order; `contribution` (`normalised × weight`) and
//! `available` (`raw` is not null) are derived, exactly as the dispatcher derived them.
//! Nothing is lost: every candidate's every term, its total and its prediction are still
//! recorded, and a compact record re-scores to the same totals bit for bit.
//!
//! [`Decision`] deserialises either form into the same value (the old per-term weights
//! become the decision's weights, read from its first candidate that lists terms: one
//! dispatcher wrote them from one configuration); a term name the reader does not know
//! is skipped, a term a record does not carry is unavailable. Serialising always writes
//! version 3.

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};

/// The version of the decision record this crate writes: 3, the compact form (the term
/// names and weights once per decision, each candidate's terms as arrays).
pub const DECISION_VERSION: u32 = 3;

/// How many score terms a decision records.
pub const TERM_COUNT: usize = TermName::ALL.len();

/// What happened to the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Sent to `worker_id`.
    Assigned,
    /// Refused: malformed, unknown model, queue full, cancelled.
    Rejected,
    /// Waited past its deadline without an eligible worker.
    Expired,
}

/// The seven score terms. Lower contributions are better for every term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TermName {
    /// Requests running on the worker, including reservations.
    ActiveRequests,
    /// Requests waiting inside the model server.
    QueueDepth,
    /// Time-to-first-token EWMA.
    LatencyEwma,
    /// Predicted service time of this job on this worker.
    JobCost,
    /// Per-request tokens/s EWMA (inverted: faster is lower).
    ThroughputEwma,
    /// KV-cache occupancy after admitting this job.
    KvPressure,
    /// GPU utilisation.
    GpuUtilisation,
}

impl TermName {
    /// Every term, in the order decisions list them.
    pub const ALL: [TermName; 7] = [
        TermName::ActiveRequests,
        TermName::QueueDepth,
        TermName::LatencyEwma,
        TermName::JobCost,
        TermName::ThroughputEwma,
        TermName::KvPressure,
        TermName::GpuUtilisation,
    ];

    /// The term's place in [`TermName::ALL`], and so in a candidate's arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The term named `name` (its snake_case name), if this build knows it.
    pub fn from_name(name: &str) -> Option<TermName> {
        TermName::ALL.into_iter().find(|t| t.as_str() == name)
    }

    /// snake_case name, as in JSON and in configuration keys.
    pub fn as_str(self) -> &'static str {
        match self {
            TermName::ActiveRequests => "active_requests",
            TermName::QueueDepth => "queue_depth",
            TermName::LatencyEwma => "latency_ewma",
            TermName::JobCost => "job_cost",
            TermName::ThroughputEwma => "throughput_ewma",
            TermName::KvPressure => "kv_pressure",
            TermName::GpuUtilisation => "gpu_utilisation",
        }
    }
}

/// One score term of one candidate, in full: what `metronome explain` shows. A record
/// stores the raw and normalised values ([`CandidateScore`]) and the weight once per
/// decision ([`Scoring`]); [`CandidateScore::terms`] puts them back together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TermScore {
    pub term: TermName,
    /// The measured value in its own unit (`None` when the signal is unavailable).
    pub raw: Option<f64>,
    /// The value mapped to [0, 1] across the candidates of this decision.
    pub normalised: f64,
    /// Configured weight.
    pub weight: f64,
    /// `normalised * weight`: this term's share of the total.
    pub contribution: f64,
    /// False when the worker did not report the signal (no NVML, no metrics, no samples
    /// yet). An unavailable term contributes a neutral value and says so.
    pub available: bool,
}

/// The terms a decision scored with: their weights, in [`TermName::ALL`] order. Written
/// once per decision as `{"terms": [names], "weights": [numbers]}`, the names giving the
/// order of every candidate's `raw` and `normalised` arrays.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Scoring {
    pub weights: [f64; TERM_COUNT],
}

impl Scoring {
    /// The weight of one term.
    pub fn weight(&self, term: TermName) -> f64 {
        self.weights[term.index()]
    }
}

impl Serialize for Scoring {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut s = serializer.serialize_struct("Scoring", 2)?;
        s.serialize_field("terms", &TermName::ALL)?;
        s.serialize_field("weights", &self.weights)?;
        s.end()
    }
}

impl<'de> Deserialize<'de> for Scoring {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        wire::ScoringIn::deserialize(deserializer).map(|s| s.weights())
    }
}

/// One eligible worker and its score: every term's raw and normalised value, in
/// [`TermName::ALL`] order (the order of its decision's [`Scoring`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateScore {
    pub worker_id: String,
    /// Sum of contributions (`normalised × weight`, summed in term order). Lowest wins.
    pub total: f64,
    /// The measured value of each term in its own unit; `None` when the worker did not
    /// report the signal (the term is unavailable and says so).
    pub raw: [Option<f64>; TERM_COUNT],
    /// Each term's value mapped to [0, 1] across the candidates of the decision (an
    /// unavailable term: the mean of the others').
    pub normalised: [f64; TERM_COUNT],
    /// What the dispatcher predicted for the job on this worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction: Option<crate::Prediction>,
    /// The job's prompt tokens this worker was believed to hold in its prefix cache, which
    /// the prediction did not charge as prefill; absent when the job carried no prefix
    /// fingerprint (and in records of older dispatchers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_prefix: Option<CachedPrefix>,
    /// Jobs placed on this worker over the last ~10 s, each weighted by `exp(−age / 10 s)`:
    /// the share prefix affinity's fair-share bound compares. Absent in records of older
    /// dispatchers, whose bound compared running requests (the `active_requests` term).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recent_placements: Option<f64>,
}

/// Prompt tokens a worker was believed to hold in its prefix cache when a job was judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedPrefix {
    /// Prompt tokens whose prefill the worker would skip (0: none of the prefix is there).
    pub tokens: u32,
    /// Where the figure comes from.
    pub source: PrefixSource,
}

/// Where a worker's cached-prefix figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixSource {
    /// The leader's estimate from its own placements, evicted as the server would evict.
    Placements,
    /// The model server's own KV cache events.
    Events,
}

impl PrefixSource {
    /// The source as it is serialised.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixSource::Placements => "placements",
            PrefixSource::Events => "events",
        }
    }
}

impl<'de> Deserialize<'de> for CandidateScore {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        wire::candidate(deserializer)
    }
}

impl CandidateScore {
    /// One term in full, under the decision's weights.
    pub fn term(&self, term: TermName, scoring: &Scoring) -> TermScore {
        let i = term.index();
        let weight = scoring.weights[i];
        TermScore {
            term,
            raw: self.raw[i],
            normalised: self.normalised[i],
            weight,
            contribution: self.normalised[i] * weight,
            available: self.raw[i].is_some(),
        }
    }

    /// Every term in full, in [`TermName::ALL`] order, under the decision's weights.
    pub fn terms(&self, scoring: &Scoring) -> [TermScore; TERM_COUNT] {
        TermName::ALL.map(|t| self.term(t, scoring))
    }
}

/// Prefix affinity in one decision: the candidate holding more of the job's prompt than the
/// score's choice, and whether it was given the job ([`AffinityOutcome`]). Absent when no
/// worker held more of the prompt than the score's choice (or the job carried no prefix
/// fingerprint, or the policy has no affinity).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Affinity {
    /// The worker holding the most of the prompt (the candidate given the job, when a
    /// worker holding more was not eligible: see [`Affinity::reason`]).
    pub worker_id: String,
    /// The prompt tokens it holds.
    pub cached_tokens: u32,
    pub outcome: AffinityOutcome,
    /// Why it was overridden: `cost` (its predicted prefill cost, ms, is higher than the
    /// score's choice's), `fair_share` (it would take more than `max_share` times an even
    /// share of the candidates' recent placements) or the code it was rejected with (an admission
    /// or SLO rule: `below_slo_floor`, `ttft_over_budget`, `at_concurrency_cap`...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_code: Option<String>,
    /// The same in words, with the numbers compared; for `chosen`, the worker that held
    /// more of the prompt but was not eligible, with its rejection, if there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The fair-share bound the decision applied (`scheduler.affinity_max_share`).
    pub max_share: f64,
}

/// Whether the worker holding the prompt got the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityOutcome {
    /// It won over the score's choice.
    Chosen,
    /// The score's choice stands (see [`Affinity::reason_code`]).
    Overridden,
}

/// Why a worker was not eligible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionCode {
    Unhealthy,
    StaleHeartbeat,
    WrongModel,
    Draining,
    AtConcurrencyCap,
    InsufficientKv,
    /// The job's own predicted decode rate, or that of a job already running there, would
    /// fall below its SLO floor.
    BelowSloFloor,
    /// The job's predicted time to first token would exceed what is left of its TTFT target.
    TtftOverBudget,
    /// The worker refused this job on an earlier attempt: it is not given the job again
    /// while another worker of the model can take it.
    RefusedJob,
    /// The worker's heartbeat claims another model than its worker id was provisioned
    /// for, a concurrency cap above its provisioned ceiling, or an id never provisioned.
    NotProvisioned,
}

impl RejectionCode {
    /// The code as it is serialised (snake case), for metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionCode::Unhealthy => "unhealthy",
            RejectionCode::StaleHeartbeat => "stale_heartbeat",
            RejectionCode::WrongModel => "wrong_model",
            RejectionCode::Draining => "draining",
            RejectionCode::AtConcurrencyCap => "at_concurrency_cap",
            RejectionCode::InsufficientKv => "insufficient_kv",
            RejectionCode::BelowSloFloor => "below_slo_floor",
            RejectionCode::TtftOverBudget => "ttft_over_budget",
            RejectionCode::RefusedJob => "refused_job",
            RejectionCode::NotProvisioned => "not_provisioned",
        }
    }
}

/// A worker that was filtered out, with the reason in words and numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejection {
    pub worker_id: String,
    pub code: RejectionCode,
    pub reason: String,
    /// The prediction that decided an SLO rejection.
    #[serde(default)]
    pub prediction: Option<crate::Prediction>,
}

/// The job's size as the dispatcher saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobCostEstimate {
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Output tokens expected: the model's output length given `max_tokens`, learned from
    /// its completed jobs (the output-length EWMA until one completed), at most max_tokens.
    pub predicted_output_tokens: f64,
    /// KV tokens reserved for the job.
    pub kv_tokens: u64,
}

/// One audit record. Serialised in the compact form (version 3); deserialised from either
/// form (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "wire::DecisionIn")]
pub struct Decision {
    /// The version the record was read as (or is built for): written as
    /// [`DECISION_VERSION`] whatever it holds, since the form written is always that one.
    #[serde(serialize_with = "write_version")]
    pub v: u32,
    pub job_id: String,
    /// `None` only when the message was too malformed to name one.
    pub model: Option<String>,
    pub outcome: Outcome,
    /// Dispatch attempt this record belongs to.
    pub attempt: u32,
    /// Why the job was rejected or expired, or a note on an assignment (e.g. a rescue).
    #[serde(default)]
    pub reason: Option<String>,
    /// Machine-readable form of `reason` (`queue_full`, `unknown_model`, `malformed_job`…).
    #[serde(default)]
    pub reason_code: Option<String>,
    /// The winner, when assigned.
    #[serde(default)]
    pub worker_id: Option<String>,
    #[serde(default)]
    pub cost: Option<JobCostEstimate>,
    /// The terms and weights the candidates were scored with; `None` when nothing was
    /// scored (a rejection before any evaluation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scoring: Option<Scoring>,
    /// Every eligible worker with its terms, best first.
    #[serde(default)]
    pub candidates: Vec<CandidateScore>,
    /// Every ineligible worker with its reason.
    #[serde(default)]
    pub rejected: Vec<Rejection>,
    /// The SLO the job was held to (its model's, tightened by the job's own request).
    #[serde(default)]
    pub slo: Option<crate::Slo>,
    /// For a job answered at once because its deadline could not be met: when capacity is
    /// predicted to be free for it (the gateway's `Retry-After`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// Prefix affinity, when a worker held more of the job's prompt than the score's choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Scheduling policy that decided (`metronome`, `least_connections`…).
    pub policy: String,
    /// Time the job spent in the admission queue.
    pub queue_wait_ms: u64,
    /// Time to evaluate and commit this decision, in microseconds.
    pub decision_latency_us: u64,
    /// Leader epoch.
    pub epoch: u64,
    /// Which dispatcher instance decided.
    pub dispatcher_id: String,
    pub decided_ms: u64,
    /// The job's tenant (`None` for a job submitted without one).
    #[serde(default)]
    pub tenant: Option<String>,
    /// The job's priority class.
    #[serde(default)]
    pub priority: Option<crate::Priority>,
    /// The tenant's fair-share service counter for this model when the decision was made
    /// (weighted tokens, after this job's charge when it was assigned): the tenant with the
    /// lowest counter among those waiting is served next.
    #[serde(default)]
    pub fair_counter: Option<f64>,
}

impl Decision {
    /// Every term of `candidate` in full, under this decision's weights (0 where the record
    /// carries none).
    pub fn terms_of(&self, candidate: &CandidateScore) -> [TermScore; TERM_COUNT] {
        candidate.terms(&self.scoring.unwrap_or_default())
    }

    /// The candidate `worker_id` was judged as (the winner's, given the winner's id).
    pub fn candidate_on(&self, worker_id: &str) -> Option<&CandidateScore> {
        self.candidates.iter().find(|c| c.worker_id == worker_id)
    }
}

fn write_version<S: Serializer>(_: &u32, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u32(DECISION_VERSION)
}

/// The record as read, in either form, before the candidates' terms are put in
/// [`TermName::ALL`] order.
mod wire {
    use serde::Deserialize;

    use super::{
        CandidateScore, Decision, JobCostEstimate, Outcome, Rejection, Scoring, TermName,
        TERM_COUNT,
    };

    #[derive(Deserialize)]
    pub struct DecisionIn {
        v: u32,
        job_id: String,
        model: Option<String>,
        outcome: Outcome,
        attempt: u32,
        #[serde(default)]
        reason: Option<String>,
        #[serde(default)]
        reason_code: Option<String>,
        #[serde(default)]
        worker_id: Option<String>,
        #[serde(default)]
        cost: Option<JobCostEstimate>,
        #[serde(default)]
        scoring: Option<ScoringIn>,
        #[serde(default)]
        candidates: Vec<CandidateIn>,
        #[serde(default)]
        rejected: Vec<Rejection>,
        #[serde(default)]
        slo: Option<crate::Slo>,
        #[serde(default)]
        retry_after_ms: Option<u64>,
        #[serde(default)]
        affinity: Option<super::Affinity>,
        policy: String,
        queue_wait_ms: u64,
        decision_latency_us: u64,
        epoch: u64,
        dispatcher_id: String,
        decided_ms: u64,
        #[serde(default)]
        tenant: Option<String>,
        #[serde(default)]
        priority: Option<crate::Priority>,
        #[serde(default)]
        fair_counter: Option<f64>,
    }

    /// Version 3's `scoring`: term names, and weights in the same order.
    #[derive(Deserialize)]
    pub struct ScoringIn {
        #[serde(default)]
        terms: Vec<String>,
        #[serde(default)]
        weights: Vec<f64>,
    }

    impl ScoringIn {
        /// The weights by name, in [`TermName::ALL`] order (0 for a term not given).
        pub fn weights(&self) -> Scoring {
            let mut weights = [0.0; TERM_COUNT];
            for (col, w) in columns(&self.terms).iter().zip(&self.weights) {
                if let Some(i) = col {
                    weights[*i] = *w;
                }
            }
            Scoring { weights }
        }
    }

    /// A candidate of either form: `raw` and `normalised` arrays (version 3) or a `terms`
    /// list of objects (up to version 2).
    #[derive(Deserialize)]
    struct CandidateIn {
        worker_id: String,
        total: f64,
        #[serde(default)]
        raw: Vec<Option<f64>>,
        #[serde(default)]
        normalised: Vec<f64>,
        #[serde(default)]
        terms: Vec<TermIn>,
        #[serde(default)]
        prediction: Option<crate::Prediction>,
        #[serde(default)]
        cached_prefix: Option<super::CachedPrefix>,
        #[serde(default)]
        recent_placements: Option<f64>,
    }

    impl CandidateIn {
        /// The candidate with its terms in [`TermName::ALL`] order: a version-2 candidate's
        /// by their names, a version-3 candidate's by `columns`.
        fn into_score(self, columns: &[Option<usize>]) -> CandidateScore {
            let mut raw = [None; TERM_COUNT];
            let mut normalised = [0.0; TERM_COUNT];
            if self.terms.is_empty() {
                for (col, v) in columns.iter().zip(&self.raw) {
                    if let Some(i) = col {
                        raw[*i] = *v;
                    }
                }
                for (col, v) in columns.iter().zip(&self.normalised) {
                    if let Some(i) = col {
                        normalised[*i] = *v;
                    }
                }
            } else {
                for t in &self.terms {
                    if let Some(name) = TermName::from_name(&t.term) {
                        raw[name.index()] = t.raw;
                        normalised[name.index()] = t.normalised;
                    }
                }
            }
            CandidateScore {
                worker_id: self.worker_id,
                total: self.total,
                raw,
                normalised,
                prediction: self.prediction,
                cached_prefix: self.cached_prefix,
                recent_placements: self.recent_placements,
            }
        }
    }

    /// A candidate read on its own (outside a decision): version-3 arrays are in
    /// [`TermName::ALL`] order; version-2 terms by name (their weights are the decision's
    /// business and are dropped).
    pub fn candidate<'de, D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> Result<CandidateScore, D::Error> {
        let columns: Vec<Option<usize>> = (0..TERM_COUNT).map(Some).collect();
        CandidateIn::deserialize(deserializer).map(|c| c.into_score(&columns))
    }

    /// One term of a version-2 candidate (`contribution` and `available` are derived).
    #[derive(Deserialize)]
    struct TermIn {
        term: String,
        #[serde(default)]
        raw: Option<f64>,
        #[serde(default)]
        normalised: f64,
        #[serde(default)]
        weight: f64,
    }

    /// Where each column of a version-3 record goes in [`TermName::ALL`] order: its names
    /// when it gives them, else the order itself.
    fn columns(names: &[String]) -> Vec<Option<usize>> {
        if names.is_empty() {
            return (0..TERM_COUNT).map(Some).collect();
        }
        names
            .iter()
            .map(|n| TermName::from_name(n).map(TermName::index))
            .collect()
    }

    impl From<DecisionIn> for Decision {
        fn from(d: DecisionIn) -> Decision {
            let columns = columns(d.scoring.as_ref().map_or(&[][..], |s| &s.terms));
            let mut weights = [0.0; TERM_COUNT];
            let recorded = match &d.scoring {
                Some(s) => {
                    weights = s.weights().weights;
                    true
                }
                // Version 2: every term carried its weight; the first candidate that lists
                // terms gives them.
                None => match d.candidates.iter().find(|c| !c.terms.is_empty()) {
                    Some(c) => {
                        for t in &c.terms {
                            if let Some(name) = TermName::from_name(&t.term) {
                                weights[name.index()] = t.weight;
                            }
                        }
                        true
                    }
                    None => false,
                },
            };
            let candidates: Vec<CandidateScore> = d
                .candidates
                .into_iter()
                .map(|c| c.into_score(&columns))
                .collect();
            Decision {
                v: d.v,
                job_id: d.job_id,
                model: d.model,
                outcome: d.outcome,
                attempt: d.attempt,
                reason: d.reason,
                reason_code: d.reason_code,
                worker_id: d.worker_id,
                cost: d.cost,
                scoring: (recorded || !candidates.is_empty()).then_some(Scoring { weights }),
                candidates,
                rejected: d.rejected,
                slo: d.slo,
                retry_after_ms: d.retry_after_ms,
                affinity: d.affinity,
                policy: d.policy,
                queue_wait_ms: d.queue_wait_ms,
                decision_latency_us: d.decision_latency_us,
                epoch: d.epoch,
                dispatcher_id: d.dispatcher_id,
                decided_ms: d.decided_ms,
                tenant: d.tenant,
                priority: d.priority,
                fair_counter: d.fair_counter,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RejectionCode;

    #[test]
    fn a_term_index_is_its_place_in_all() {
        for (i, t) in super::TermName::ALL.into_iter().enumerate() {
            assert_eq!(t.index(), i);
            assert_eq!(super::TermName::from_name(t.as_str()), Some(t));
        }
        assert_eq!(super::TermName::from_name("no_such_term"), None);
    }

    #[test]
    fn a_rejection_code_label_is_its_serialised_name() {
        for code in [
            RejectionCode::Unhealthy,
            RejectionCode::StaleHeartbeat,
            RejectionCode::WrongModel,
            RejectionCode::Draining,
            RejectionCode::AtConcurrencyCap,
            RejectionCode::InsufficientKv,
            RejectionCode::BelowSloFloor,
            RejectionCode::TtftOverBudget,
            RejectionCode::RefusedJob,
            RejectionCode::NotProvisioned,
        ] {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json.trim_matches('"'), code.as_str());
        }
    }
}
