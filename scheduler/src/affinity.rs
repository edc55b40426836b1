//! Prefix affinity: the worker that already holds a job's prompt gets the job when the
//! predictions say it costs less there, up to a fair share of the load.
//!
//! **Why a stage of its own.** The score compares candidates on every signal at once by
//! normalising each term across them ([`crate::evaluate`]): a term's spread always maps to
//! [0, 1], whatever its size. That keeps the score steady on prefix-free traffic, but it
//! erases the size of a cached prefix's saving: on the simulator's calibration a cached
//! 2,000-token prefix saves ~320 ms of prefill plus the same stall on every stream already
//! running there, while one more running request slows the job's decode by ~0.2 ms a token
//! (~35 ms over 200 tokens); normalised, both are one full spread, and the running count
//! weighs twice the job cost. So the score alone sends a cached prompt to the worker with
//! one request fewer, scatters each prefix over every worker, and caches thrash: the hit
//! rate stays close to least connections'.
//!
//! **The rule.** After scoring, the candidate holding the most of the prompt (more than the
//! score's choice holds) is compared with the score's choice in the one unit both
//! predictions share, milliseconds: it gets the job when
//!
//! - its predicted prefill cost ([`Prediction::prefill_cost_ms`]: the time to first token,
//!   prefilling only the uncached tokens behind what waits there, plus the stall that
//!   prefill imposes on every stream already running) is no higher than the score's
//!   choice's, and
//! - it would not take more than `max_share` times an even share of the candidates' recent
//!   placements: `placed + 1 ≤ ⌈max_share · (Σ placed + 1) / candidates⌉`, `placed` the
//!   jobs placed there over the last ~10 s, each weighted by `exp(−age / 10 s)`
//!   ([`crate::Ledger::recent_placements`]). This bounds hot spots (every request of one
//!   popular prefix on one GPU) while a popular prefix's holder still takes its share;
//!   past the bound the score's choice gets the job, and the prefix is cached there too.
//!
//! **Why placements and not running requests.** A hot spot is a share of the requests
//! (what the benchmark's overload check measures). The running count also moves with how
//! long each job runs, and by a request or two at light load: bounded on it, a group's
//! holder running two more than the others lost its next request to a cache miss
//! elsewhere, up to 8 times in 300 requests of the policy lab's `shared_prefix` at 70 %
//! load.
//! How loaded the holder is stays the business of the cost comparison (its prefill waits
//! behind what is queued there) and of the admission filters.
//!
//! **Why prefill and not the whole job cost.** A cached prefix changes only the prefill:
//! the decode is the same tokens at the batch the job joins. The job cost term adds the
//! whole decode (expected output × step), where one more running stream costs a few ms a
//! token; over a few hundred tokens that outweighs a prefix's saving, so with it the holder
//! lost to any worker running one request fewer and the prefix was prefilled again
//! elsewhere. The decode rate is not left unguarded: the admission filters hold the job and
//! every stream already running to their rate floors before affinity sees a candidate.
//!
//! The admission filters ran before: a holder that cannot meet the SLO, is at its cap or
//! lacks KV room is not a candidate at all, and the decision names it with its rejection
//! code. So the SLO rules still decide; affinity only chooses among the places that keep
//! them. A job without a prefix fingerprint, or whose prompt no candidate holds more of than
//! the score's choice, is placed by the score alone: prefix-free traffic is unchanged.
//!
//! Every decision where a worker held more of the prompt than the score's choice records
//! it ([`Affinity`]): chosen, or overridden with the reason (`cost`, `fair_share`, or the
//! rejection code) and the numbers compared. When a candidate was chosen although a
//! refused worker held more, the record names the candidate and its reason the refused
//! worker with its rejection.
//!
//! Pure: the inputs are the decision's own figures, so `metronome replay` re-applies it to a
//! recorded decision ([`crate::rescore`]).

#[cfg(doc)]
use metronome_protocol::Prediction;
use metronome_protocol::{Affinity, AffinityOutcome};

/// The default bound on the share of requests affinity may give one worker: 1.5 times an
/// even share, the hot-spot bound the benchmark's overload check holds placements to.
pub const DEFAULT_MAX_SHARE: f64 = 1.5;

/// One candidate as affinity sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seat<'a> {
    pub worker_id: &'a str,
    /// Prompt tokens it holds.
    pub cached_tokens: u32,
    /// Predicted prefill cost there, ms ([`Prediction::prefill_cost_ms`]; `None`: not
    /// predicted).
    pub cost_ms: Option<f64>,
    /// Jobs placed there lately ([`crate::Ledger::recent_placements`]: a count decaying
    /// over ~10 s).
    pub placed: f64,
}

/// A worker that was not a candidate but held the prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refused<'a> {
    pub worker_id: &'a str,
    pub cached_tokens: u32,
    /// Its rejection code, as serialised.
    pub code: &'a str,
    /// Its rejection reason in words.
    pub reason: &'a str,
}

/// What affinity decided: the seat to place first (an index into the seats given), and the
/// record.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub promote: Option<usize>,
    pub record: Option<Affinity>,
}

/// Apply the rule to `seats`, best first by the score, with the refused workers that hold
/// part of the prompt. `max_share` 0 turns affinity off.
pub fn decide(seats: &[Seat<'_>], refused: &[Refused<'_>], max_share: f64) -> Verdict {
    let none = Verdict {
        promote: None,
        record: None,
    };
    if max_share <= 0.0 || !max_share.is_finite() {
        return none;
    }
    let Some(choice) = seats.first() else {
        return none;
    };
    // The most cached tokens; ties to the better score (the earlier seat).
    let holder = seats
        .iter()
        .enumerate()
        .rev()
        .max_by_key(|(_, s)| s.cached_tokens)
        .map(|(i, _)| i)
        .expect("non-empty");
    let verdict = among_candidates(seats, holder, max_share);
    // A refused worker holding more than every candidate: the admission or SLO rule that
    // refused it is what the decision says overrode affinity.
    let refused_best = refused
        .iter()
        .filter(|r| r.cached_tokens > seats[holder].cached_tokens)
        .filter(|r| r.cached_tokens > choice.cached_tokens)
        .max_by(|a, b| {
            a.cached_tokens
                .cmp(&b.cached_tokens)
                .then_with(|| b.worker_id.cmp(a.worker_id))
        });
    match (refused_best, verdict.promote) {
        // A candidate holding part of the prompt was given the job: the record names it,
        // and says that a worker holding more was not eligible.
        (Some(r), Some(_)) => Verdict {
            promote: verdict.promote,
            record: verdict.record.map(|chosen| Affinity {
                reason: Some(format!(
                    "{} holds more ({} cached prompt tokens) but is not eligible: {} ({})",
                    r.worker_id, r.cached_tokens, r.reason, r.code
                )),
                ..chosen
            }),
        },
        (Some(r), None) => Verdict {
            promote: None,
            record: Some(Affinity {
                worker_id: r.worker_id.to_string(),
                cached_tokens: r.cached_tokens,
                outcome: AffinityOutcome::Overridden,
                reason_code: Some(r.code.to_string()),
                reason: Some(format!("not eligible: {}", r.reason)),
                max_share,
            }),
        },
        (None, _) => verdict,
    }
}

/// The rule among the candidates: `holder` (the most cached tokens) against the score's
/// choice (the first seat).
fn among_candidates(seats: &[Seat<'_>], holder: usize, max_share: f64) -> Verdict {
    let (choice, seat) = (&seats[0], &seats[holder]);
    if holder == 0 || seat.cached_tokens <= choice.cached_tokens {
        return Verdict {
            promote: None,
            record: None,
        };
    }
    let record = |outcome, code: Option<&str>, reason: Option<String>| Affinity {
        worker_id: seat.worker_id.to_string(),
        cached_tokens: seat.cached_tokens,
        outcome,
        reason_code: code.map(str::to_string),
        reason,
        max_share,
    };
    let (cost, choice_cost) = (
        seat.cost_ms.unwrap_or(f64::INFINITY),
        choice.cost_ms.unwrap_or(f64::INFINITY),
    );
    if cost > choice_cost {
        return Verdict {
            promote: None,
            record: Some(record(
                AffinityOutcome::Overridden,
                Some("cost"),
                Some(format!(
                    "predicted prefill cost {cost:.0} ms on {} against {choice_cost:.0} ms on {}",
                    seat.worker_id, choice.worker_id
                )),
            )),
        };
    }
    let bound = share_bound(seats, max_share);
    if seat.placed + 1.0 > bound {
        return Verdict {
            promote: None,
            record: Some(record(
                AffinityOutcome::Overridden,
                Some("fair_share"),
                Some(format!(
                    "{} would have taken {:.1} of the last ~10 s's placements, above {max_share} times an even share of {} candidates' ({bound})",
                    seat.worker_id,
                    seat.placed + 1.0,
                    seats.len()
                )),
            )),
        };
    }
    Verdict {
        promote: Some(holder),
        record: Some(record(AffinityOutcome::Chosen, None, None)),
    }
}

/// Most recent placements one candidate may have with this one:
/// `⌈max_share · (Σ placed + 1) / candidates⌉`, a whole number, so the first placements of
/// a fresh system, where every share is a fraction of one job, are not all overridden.
fn share_bound(seats: &[Seat<'_>], max_share: f64) -> f64 {
    let total: f64 = seats.iter().map(|s| s.placed.max(0.0)).sum::<f64>() + 1.0;
    let even = total / seats.len() as f64;
    (max_share * even).ceil()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(id: &str, cached: u32, cost: f64, placed: f64) -> Seat<'_> {
        Seat {
            worker_id: id,
            cached_tokens: cached,
            cost_ms: Some(cost),
            placed,
        }
    }

    #[test]
    fn the_holder_wins_when_it_costs_less_within_its_share() {
        let seats = [seat("a", 0, 5_000.0, 2.0), seat("b", 2_000, 4_700.0, 3.0)];
        let v = decide(&seats, &[], 1.5);
        assert_eq!(v.promote, Some(1));
        let r = v.record.unwrap();
        assert_eq!((r.worker_id.as_str(), r.cached_tokens), ("b", 2_000));
        assert_eq!((r.outcome, r.reason_code), (AffinityOutcome::Chosen, None));
    }

    #[test]
    fn a_dearer_holder_is_overridden_on_cost() {
        // A slow GPU holding the prefix behind a long prefill queue: it reaches the first
        // token later than the fast one prefilling the whole prompt.
        let seats = [seat("fast", 0, 400.0, 1.0), seat("slow", 2_000, 700.0, 1.0)];
        let v = decide(&seats, &[], 1.5);
        assert_eq!(v.promote, None);
        let r = v.record.unwrap();
        assert_eq!(r.outcome, AffinityOutcome::Overridden);
        assert_eq!(r.reason_code.as_deref(), Some("cost"));
        assert!(r.reason.unwrap().contains("700 ms on slow"));
    }

    #[test]
    fn a_holder_past_its_share_of_the_recent_placements_is_overridden() {
        // 4 candidates, 8 recent placements + this one: an even share is 2.25, the bound
        // ⌈3.375⌉ = 4.
        let seats = [
            seat("a", 0, 5_000.0, 1.0),
            seat("b", 0, 5_000.0, 1.0),
            seat("c", 0, 5_000.0, 2.0),
            seat("d", 2_000, 4_000.0, 4.0),
        ];
        let v = decide(&seats, &[], 1.5);
        assert_eq!(v.promote, None);
        assert_eq!(v.record.unwrap().reason_code.as_deref(), Some("fair_share"));
        let reason = decide(&seats, &[], 1.5).record.unwrap().reason.unwrap();
        assert!(
            reason.starts_with("d would have taken 5.0 of the last ~10 s's placements"),
            "{reason}"
        );
        // One fewer placed there: 4 with this one is within the bound.
        let mut within = seats;
        within[3].placed = 3.0;
        within[2].placed = 3.0;
        assert_eq!(decide(&within, &[], 1.5).promote, Some(3));
        // Decayed counts are fractions: 3.4 placed there, 4.4 with this one, is past it.
        within[3].placed = 3.4;
        assert_eq!(decide(&within, &[], 1.5).promote, None);
    }

    #[test]
    fn a_fresh_system_gives_the_holder_its_first_jobs() {
        // Nothing placed yet anywhere (or long ago): the bound is one whole job, and the
        // holder takes it.
        let seats = [seat("a", 0, 5_000.0, 0.0), seat("b", 2_000, 4_000.0, 0.0)];
        assert_eq!(decide(&seats, &[], 1.5).promote, Some(1));
        // Its second in a row, with the other idle: 2 against ⌈1.5 · 2 / 2⌉ = 2, within.
        let seats = [seat("a", 0, 5_000.0, 0.0), seat("b", 2_000, 4_000.0, 1.0)];
        assert_eq!(decide(&seats, &[], 1.5).promote, Some(1));
    }

    #[test]
    fn nothing_to_record_when_the_choice_holds_as_much() {
        let seats = [
            seat("a", 2_000, 5_000.0, 1.0),
            seat("b", 2_000, 4_000.0, 0.0),
        ];
        assert_eq!(
            decide(&seats, &[], 1.5),
            Verdict {
                promote: None,
                record: None
            }
        );
        let plain = [seat("a", 0, 5_000.0, 1.0), seat("b", 0, 4_000.0, 0.0)];
        assert_eq!(decide(&plain, &[], 1.5).record, None);
    }

    #[test]
    fn a_refused_holder_is_named_with_its_rejection() {
        let seats = [seat("a", 0, 5_000.0, 1.0), seat("b", 160, 4_900.0, 1.0)];
        let refused = [Refused {
            worker_id: "c",
            cached_tokens: 2_000,
            code: "below_slo_floor",
            reason: "decode 21 tok/s below the 30 tok/s floor",
        }];
        // c is not a candidate: the SLO rules decide. Among the candidates, b holds a
        // little of the prompt and costs less, so it wins; the record names b, chosen,
        // and says why c, holding more, did not get the job.
        let v = decide(&seats, &refused, 1.5);
        assert_eq!(v.promote, Some(1));
        let r = v.record.unwrap();
        assert_eq!((r.worker_id.as_str(), r.cached_tokens), ("b", 160));
        assert_eq!((r.outcome, r.reason_code), (AffinityOutcome::Chosen, None));
        let reason = r.reason.unwrap();
        assert!(
            reason.starts_with(
                "c holds more (2000 cached prompt tokens) but is not eligible: decode 21 tok/s"
            ),
            "{reason}"
        );
        assert!(reason.ends_with("(below_slo_floor)"), "{reason}");
        // With no candidate holding any of it, the record names c as overriding affinity.
        let plain = [seat("a", 0, 5_000.0, 1.0), seat("b", 0, 4_900.0, 1.0)];
        let v = decide(&plain, &refused, 1.5);
        assert_eq!(v.promote, None);
        let r = v.record.unwrap();
        assert_eq!(
            (r.worker_id.as_str(), r.outcome),
            ("c", AffinityOutcome::Overridden)
        );
        assert_eq!(r.reason_code.as_deref(), Some("below_slo_floor"));
    }

    #[test]
    fn off_at_zero() {
        let seats = [seat("a", 0, 5_000.0, 2.0), seat("b", 2_000, 4_700.0, 3.0)];
        assert_eq!(decide(&seats, &[], 0.0).promote, None);
        assert_eq!(decide(&seats, &[], 0.0).record, None);
    }
}
