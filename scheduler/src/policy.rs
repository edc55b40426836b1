//! Scheduling policies: Metronome's own and the conventional balancers it is compared with.
//!
//! The baselines behave like ordinary load balancers: no admission control. Only the
//! eligibility filters apply (fresh heartbeat, serves the model, healthy, not draining);
//! the concurrency cap, KV headroom and SLO floor are ignored, so a baseline always picks
//! someone when any worker serves the model. Each baseline's [`Evaluation`] still lists
//! all seven terms of every candidate (scored exactly as Metronome would), so decisions of
//! different policies can be compared term by term. The baseline's pick comes first in the
//! candidate list; the others follow in Metronome's order.
//!
//! Determinism: baselines choose among the candidates ordered by worker id (never by the
//! order of the `workers` slice), and randomness comes from a splitmix64 generator seeded
//! by the caller and kept in [`PolicyState`], so a run is replayable from its seed.

use serde::{Deserialize, Serialize};

use crate::evaluate::{rank, Evaluation};
use crate::{evaluate, filter, JobRequest, Ledger, SchedulerConfig, WorkerView};

/// Which policy decides.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Admission control and scored selection ([`evaluate()`]).
    Metronome,
    /// Each eligible worker in turn, by worker id.
    RoundRobin,
    /// Fewest active requests (reservations included); ties by worker id.
    LeastConnections,
    /// Uniformly random eligible worker.
    Random,
    /// Two distinct random eligible workers; the one with fewer active requests.
    PowerOfTwo,
    /// The worker holding the longest cached prefix of the job's prompt, unless that
    /// worker is overloaded against the least-loaded one ([`prefix_affinity_pick`]).
    PrefixAffinity,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::Metronome,
        PolicyKind::RoundRobin,
        PolicyKind::LeastConnections,
        PolicyKind::Random,
        PolicyKind::PowerOfTwo,
        PolicyKind::PrefixAffinity,
    ];

    /// snake_case name, as in configuration and in `Decision::policy`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Metronome => "metronome",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastConnections => "least_connections",
            PolicyKind::Random => "random",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::PrefixAffinity => "prefix_affinity",
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.as_str()).collect();
                format!("unknown policy {s:?}, expected one of {}", names.join(", "))
            })
    }
}

/// Mutable state of the baseline policies: the round-robin cursor and a seeded PRNG.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyState {
    cursor: u64,
    rng: u64,
}

impl PolicyState {
    pub fn new(seed: u64) -> Self {
        PolicyState {
            cursor: 0,
            rng: seed,
        }
    }

    /// splitmix64 (Steele, Lea & Flood 2014): tiny, full-period, good enough to spread picks.
    fn next_u64(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform index in `0..n` (Lemire's multiply-shift, no modulo bias worth the name).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// [`PolicyKind::PrefixAffinity`] leaves the longest cached prefix for the least-loaded
/// worker when the first has more than this many active requests beyond the second's...
pub const AFFINITY_ABS_IMBALANCE: u32 = 8;
/// ... and more than this many times the second's.
pub const AFFINITY_REL_IMBALANCE: f64 = 1.5;

/// The prefix-affinity baseline's pick among `(cached tokens, active requests)` per
/// candidate, given in worker-id order: the cache-aware routing of SGLang's router and
/// vllm-router (`cache_aware`), and the prefix scorer of llm-d, reduced to their rule.
///
/// - The candidate with the most cached tokens of the prompt (by the same estimate of each
///   worker's cache the leader keeps, [`crate::PrefixIndex`]), ties to fewer active
///   requests, then to the lower worker id.
/// - Unless the load is imbalanced, as SGLang's router judges it: the best holder has
///   more than [`AFFINITY_ABS_IMBALANCE`] active requests beyond the least-loaded
///   candidate's *and* more than [`AFFINITY_REL_IMBALANCE`] times as many (SGLang's
///   router defaults to a gap of 32 to 64 and a ratio of 1.1 to 1.5, by version, for real
///   servers' batches of hundreds; 8 suits the simulator's batches of tens). Then, or when
///   no candidate holds any of the prompt, the least-loaded candidate (least connections,
///   ties to the lower worker id).
///
/// No admission control, like every baseline: a held prefix wins however slow its
/// worker would serve it, up to the imbalance bound.
pub fn prefix_affinity_pick(cands: &[(u32, u32)]) -> Option<usize> {
    let least = (0..cands.len()).min_by_key(|&i| cands[i].1)?;
    // max_by_key keeps the last maximum; reversing keeps the first (lowest worker id).
    let best = (0..cands.len())
        .rev()
        .max_by_key(|&i| (cands[i].0, std::cmp::Reverse(cands[i].1)))?;
    let (cached, active) = cands[best];
    let least_active = cands[least].1;
    let imbalanced = active > least_active.saturating_add(AFFINITY_ABS_IMBALANCE)
        && f64::from(active) > AFFINITY_REL_IMBALANCE * f64::from(least_active);
    Some(if cached == 0 || imbalanced {
        least
    } else {
        best
    })
}

/// Decide with `kind`. For [`PolicyKind::Metronome`] this is exactly [`evaluate()`].
pub fn choose(
    kind: PolicyKind,
    state: &mut PolicyState,
    job: &JobRequest,
    workers: &[WorkerView],
    ledger: &Ledger,
    config: &SchedulerConfig,
    now_ms: u64,
) -> Evaluation {
    if kind == PolicyKind::Metronome {
        return evaluate(job, workers, ledger, config, now_ms);
    }
    let ranked = rank(&filter::ELIGIBILITY, job, workers, ledger, config, now_ms);
    let cands = &ranked.candidates;
    let pick = if cands.is_empty() {
        None
    } else {
        // Candidate indices in worker-id order: the baselines' view of the pool.
        let mut by_id: Vec<usize> = (0..cands.len()).collect();
        by_id.sort_by(|&a, &b| cands[a].worker_id().cmp(cands[b].worker_id()));
        let active = |i: usize| cands[i].load.effective_active;
        Some(match kind {
            PolicyKind::Metronome => unreachable!("handled above"),
            PolicyKind::RoundRobin => {
                let i = (state.cursor % by_id.len() as u64) as usize;
                state.cursor = state.cursor.wrapping_add(1);
                by_id[i]
            }
            PolicyKind::LeastConnections => {
                // by_id is sorted, and min_by_key keeps the first minimum: ties go to the
                // lowest worker id.
                *by_id.iter().min_by_key(|&&i| active(i)).expect("non-empty")
            }
            PolicyKind::Random => by_id[state.below(by_id.len())],
            PolicyKind::PrefixAffinity => {
                let held: Vec<(u32, u32)> = by_id
                    .iter()
                    .map(|&i| (job.cached_on(cands[i].worker_id()).tokens, active(i)))
                    .collect();
                by_id[prefix_affinity_pick(&held).expect("non-empty")]
            }
            PolicyKind::PowerOfTwo => {
                if by_id.len() == 1 {
                    by_id[0]
                } else {
                    let a = state.below(by_id.len());
                    let mut b = state.below(by_id.len() - 1);
                    if b >= a {
                        b += 1;
                    }
                    let (a, b) = (by_id[a], by_id[b]);
                    if active(b) < active(a) {
                        b
                    } else {
                        a
                    }
                }
            }
        })
    };
    let mut candidates = Vec::with_capacity(cands.len());
    if let Some(p) = pick {
        candidates.push(cands[p].to_score());
    }
    candidates.extend(
        ranked
            .order
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| Some(i) != pick)
            .map(|i| cands[i].to_score()),
    );
    Evaluation {
        winner: pick.map(|p| cands[p].worker_id().to_owned()),
        candidates,
        scoring: crate::evaluate::scoring(config),
        rejected: ranked.rejected,
        cost: job.cost_estimate(),
        winner_stall_ms: pick.map_or(0.0, |p| cands[p].forecast.stall_ms),
        affinity: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use metronome_protocol::RejectionCode;

    fn pool(n: usize) -> Vec<WorkerView> {
        (0..n).map(|i| worker(&format!("w{i}"))).collect()
    }

    fn pick(
        kind: PolicyKind,
        state: &mut PolicyState,
        workers: &[WorkerView],
        ledger: &Ledger,
    ) -> String {
        choose(
            kind,
            state,
            &job("m"),
            workers,
            ledger,
            &SchedulerConfig::default(),
            NOW,
        )
        .winner
        .unwrap()
    }

    #[test]
    fn names_round_trip() {
        for k in PolicyKind::ALL {
            assert_eq!(k.as_str().parse::<PolicyKind>(), Ok(k));
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        assert!("fastest".parse::<PolicyKind>().is_err());
    }

    #[test]
    fn metronome_is_evaluate() {
        let workers = pool(3);
        let config = SchedulerConfig::default();
        let e = choose(
            PolicyKind::Metronome,
            &mut PolicyState::new(1),
            &job("m"),
            &workers,
            &Ledger::new(),
            &config,
            NOW,
        );
        assert_eq!(
            e,
            evaluate(&job("m"), &workers, &Ledger::new(), &config, NOW)
        );
    }

    #[test]
    fn round_robin_cycles_by_worker_id_whatever_the_slice_order() {
        let mut workers = pool(3);
        workers.reverse();
        let mut s = PolicyState::new(0);
        let picks: Vec<String> = (0..4)
            .map(|_| pick(PolicyKind::RoundRobin, &mut s, &workers, &Ledger::new()))
            .collect();
        assert_eq!(picks, ["w0", "w1", "w2", "w0"]);
    }

    #[test]
    fn baselines_ignore_admission_control_but_not_health() {
        let mut workers = pool(2);
        workers[0].status.active = 99; // far past its cap of 4
        workers[1].status.healthy = false;
        for kind in [
            PolicyKind::RoundRobin,
            PolicyKind::LeastConnections,
            PolicyKind::Random,
            PolicyKind::PowerOfTwo,
        ] {
            let e = choose(
                kind,
                &mut PolicyState::new(7),
                &job("m"),
                &workers,
                &Ledger::new(),
                &SchedulerConfig::default(),
                NOW,
            );
            assert_eq!(e.winner.as_deref(), Some("w0"), "{kind}");
            assert_eq!(e.rejected[0].code, RejectionCode::Unhealthy);
            assert_eq!(
                e.scoring,
                crate::evaluate::scoring(&SchedulerConfig::default())
            );
        }
        let e = evaluate(
            &job("m"),
            &workers,
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        );
        assert_eq!(e.winner, None);
    }

    #[test]
    fn least_connections_counts_reservations() {
        let workers = pool(3);
        let mut l = Ledger::new();
        l.reserve("w0", "a", 1, NOW).unwrap();
        l.reserve("w1", "b", 1, NOW).unwrap();
        assert_eq!(
            pick(
                PolicyKind::LeastConnections,
                &mut PolicyState::new(0),
                &workers,
                &l
            ),
            "w2"
        );
    }

    #[test]
    fn random_policies_are_replayable_and_cover_the_pool() {
        for kind in [PolicyKind::Random, PolicyKind::PowerOfTwo] {
            let workers = pool(4);
            let run = |seed| {
                let mut s = PolicyState::new(seed);
                (0..64)
                    .map(|_| pick(kind, &mut s, &workers, &Ledger::new()))
                    .collect::<Vec<_>>()
            };
            let a = run(42);
            assert_eq!(a, run(42));
            for w in &workers {
                assert!(
                    a.contains(&w.status.worker_id),
                    "{kind} never picked {}",
                    w.status.worker_id
                );
            }
        }
    }

    fn with_cached(on: &[(&str, u32)]) -> JobRequest {
        job("m").with_prefix(crate::PrefixLookup::new(
            metronome_protocol::decision::PrefixSource::Placements,
            on.iter().map(|&(w, tokens)| {
                (
                    w.to_string(),
                    crate::prefix_index::Cached {
                        tokens,
                        shared_tokens: 0,
                    },
                )
            }),
        ))
    }

    fn affinity(job: &JobRequest, workers: &[WorkerView]) -> String {
        choose(
            PolicyKind::PrefixAffinity,
            &mut PolicyState::new(0),
            job,
            workers,
            &Ledger::new(),
            &SchedulerConfig::default(),
            NOW,
        )
        .winner
        .unwrap()
    }

    #[test]
    fn prefix_affinity_picks_the_longest_cached_prefix() {
        let mut workers = pool(4);
        workers.reverse();
        // w0 is the least loaded; w2 holds the longest prefix, w1 a shorter one.
        workers[1].status.active = 3; // w2
        workers[2].status.active = 1; // w1
        let held = with_cached(&[("w1", 64), ("w2", 96)]);
        assert_eq!(affinity(&held, &workers), "w2");
        // Without a prefix anywhere: least connections.
        assert_eq!(affinity(&job("m"), &workers), "w0");
        // Equal prefixes: the less loaded of the holders, then the lower id.
        let tie = with_cached(&[("w1", 96), ("w2", 96)]);
        assert_eq!(affinity(&tie, &workers), "w1");
        workers[1].status.active = 1;
        assert_eq!(affinity(&tie, &workers), "w1");
    }

    #[test]
    fn prefix_affinity_falls_back_to_the_least_loaded_under_imbalance() {
        let mut workers = pool(3);
        workers[0].status.active = 2;
        workers[1].status.active = 2 + AFFINITY_ABS_IMBALANCE;
        workers[2].status.active = 5;
        let held = with_cached(&[("w1", 512), ("w2", 16)]);
        // At the bound: still the holder of the longest prefix.
        assert_eq!(affinity(&held, &workers), "w1");
        // One more: the least-loaded worker, even over w2's shorter prefix.
        workers[1].status.active += 1;
        assert_eq!(affinity(&held, &workers), "w0");
        // An absolute gap above the bound but within the relative one keeps affinity.
        for w in &mut workers {
            w.status.active += 30;
        }
        assert_eq!(affinity(&held, &workers), "w1");
    }

    #[test]
    fn power_of_two_prefers_the_less_loaded_of_its_pair() {
        let mut workers = pool(2);
        workers[0].status.active = 3;
        let mut s = PolicyState::new(5);
        for _ in 0..16 {
            assert_eq!(
                pick(PolicyKind::PowerOfTwo, &mut s, &workers, &Ledger::new()),
                "w1"
            );
        }
    }
}
