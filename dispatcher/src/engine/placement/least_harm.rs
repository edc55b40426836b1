//! Least harm: when no worker admits a job without a predicted miss (or admits it only
//! where its first token comes late), whether it is placed anyway, where it does least
//! harm ([`metronome_scheduler::least_harm`]: fewest predicted misses of running jobs,
//! then the soonest first token).
//!
//! Two cases, each named in the decision it makes:
//! - A job of a tenant under its fair share trades up to `[fairness]
//!   light_tenant_traded_misses` predicted misses, most likely on the tenant holding more
//!   than its share ([`Engine::trade_for_a_tenant_under_its_share`]).
//! - A job waiting alone is placed at the last moment its predicted TTFT still fits its
//!   budget ([`Engine::place_at_the_last_moment`]).

use metronome_scheduler::policy::PolicyKind;
use metronome_scheduler::{least_harm, least_harm_within, Evaluation, WorkerView};

use super::filter::narrowed_or;
use super::Judged;
use crate::engine::Engine;
use crate::queue::tenant_of;

/// The TTFT a job of a tenant under its fair share may be traded a predicted miss for:
/// any (`INFINITY`) when no worker admits it and others wait too (the model is short of
/// capacity because another tenant holds more than its own, and waiting for room would
/// hand the lighter tenant's latency to the flood); `admitted_ttft / ratio` when it is
/// admitted only where its first token comes that late; `None` (no trade) otherwise.
pub(in crate::engine) fn trade_ceiling(
    admitted: bool,
    admitted_ttft_ms: Option<f64>,
    alone: bool,
    ratio: f64,
) -> Option<f64> {
    match (admitted, admitted_ttft_ms) {
        (false, _) if !alone => Some(f64::INFINITY),
        (true, Some(late)) if ratio > 0.0 => Some(late / ratio),
        _ => None,
    }
}

/// Whether a job with `remaining_ms` of its TTFT budget left, predicted to start in
/// `ttft_ms` where it does least harm, must go now: the next look may come `margin_ms`
/// later, when it no longer fits.
pub(in crate::engine) fn at_the_last_moment(
    remaining_ms: f64,
    ttft_ms: f64,
    margin_ms: f64,
) -> bool {
    remaining_ms - ttft_ms <= margin_ms
}

impl Engine {
    /// Replace the judgement of `judged` by a least-harm placement where one of the two
    /// cases applies, noting why; the workers that refused the job are listed then too.
    pub(in crate::engine) fn consider_least_harm(&self, model: &str, judged: &mut Judged) {
        let front = self.queues.get(model, judged.pos).expect("position exists");
        // Least harm, too, leaves out the workers that refused the job.
        let front_pool = self.without_refusers(model, &front.job.id);
        let harm_pool = narrowed_or(&front_pool, self.model_workers(model));
        let traded = self.trade_for_a_tenant_under_its_share(model, judged, harm_pool);
        if let Some((evaluation, note)) = traded {
            judged.evaluation = evaluation;
            judged.least_harm_note = Some(note);
        }
        if judged.evaluation.winner.is_none() {
            if let Some((evaluation, note)) =
                self.place_at_the_last_moment(model, judged, harm_pool)
            {
                judged.evaluation = evaluation;
                judged.least_harm_note = Some(note);
            }
        }
        if let (Some(_), Some((_, refused))) = (&judged.least_harm_note, front_pool) {
            judged.evaluation.rejected.extend(refused);
        }
    }

    /// A job of a tenant under its fair share, admitted nowhere while others wait too, or
    /// admitted only where its first token comes at least `[fairness]
    /// light_tenant_ttft_ratio` times later than elsewhere: placed where it does least
    /// harm within `light_tenant_traded_misses` predicted misses. In the fairness drill,
    /// at a flood's onset, the light tenant's job was admitted only where its predicted
    /// TTFT was 1.2 s; the worker that refused it would have started it in 0.17 s, taking
    /// one running job to 28.7 tok/s against a 30 tok/s floor.
    pub(in crate::engine) fn trade_for_a_tenant_under_its_share(
        &self,
        model: &str,
        judged: &Judged,
        harm_pool: &[WorkerView],
    ) -> Option<(Evaluation, String)> {
        if self.s.policy != PolicyKind::Metronome {
            return None;
        }
        let now = self.now_ms;
        let evaluation = &judged.evaluation;
        let admitted_ttft = evaluation
            .winner_score()
            .and_then(|c| c.prediction)
            .map(|p| p.ttft_ms);
        let ceiling = trade_ceiling(
            evaluation.winner.is_some(),
            admitted_ttft,
            self.queues.len(model) == 1,
            self.s.fairness.light_tenant_ttft_ratio,
        )?;
        let front = self.queues.get(model, judged.pos).expect("position exists");
        let share = self.runs_under_fair_share(model, tenant_of(&front.job), now)?;
        let traded = least_harm_within(
            &judged.request,
            harm_pool,
            judged.waiver.as_ref().map_or(&self.ledger, |w| &w.ledger),
            &self.s.scheduler,
            now,
            self.s.fairness.light_tenant_traded_misses,
            ceiling,
        );
        traded.winner.as_ref()?;
        let share_note = format!(
            "its tenant runs {} of the model's {} jobs, under its fair share ({:.1})",
            share.mine, share.total, share.share
        );
        let note = match admitted_ttft {
            None => format!(
                "placed where it does least harm: no worker admitted it without a predicted miss, and {share_note}"
            ),
            Some(late) => {
                let ttft = traded
                    .winner_score()
                    .and_then(|c| c.prediction)
                    .map_or(0.0, |p| p.ttft_ms);
                format!(
                    "placed where its first token comes sooner, at a predicted miss: the workers that admitted it would start it in {late:.0} ms, this one in {ttft:.0} ms, and {share_note}"
                )
            }
        };
        Some((traded, note))
    }

    /// A job no worker admits without a predicted miss, waiting alone: it waits while
    /// waiting can still pay off, and at the last moment its predicted TTFT still fits its
    /// budget (the next look may come a tick later) it is placed where it does least harm.
    /// Only alone: with others waiting, the model is short of capacity, and trading a
    /// running job's SLO for this one's only moves the miss while taking the room the next
    /// job needs.
    pub(in crate::engine) fn place_at_the_last_moment(
        &self,
        model: &str,
        judged: &Judged,
        harm_pool: &[WorkerView],
    ) -> Option<(Evaluation, String)> {
        if self.s.policy != PolicyKind::Metronome || self.queues.len(model) != 1 {
            return None;
        }
        let remaining = judged.request.ttft_remaining_ms?;
        let fallback = least_harm(
            &judged.request,
            harm_pool,
            &self.ledger,
            &self.s.scheduler,
            self.now_ms,
        );
        let ttft = fallback.winner_score().and_then(|c| c.prediction)?.ttft_ms;
        let margin = 2.0 * self.s.tick.as_secs_f64() * 1000.0;
        if !at_the_last_moment(remaining, ttft, margin) {
            return None;
        }
        let note = format!(
            "placed where it does least harm: no worker admitted it without a predicted miss, and {remaining:.0} ms were left of its TTFT budget (predicted TTFT {ttft:.0} ms)"
        );
        Some((fallback, note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_admitted_nowhere_may_trade_any_ttft_only_when_others_wait() {
        assert_eq!(trade_ceiling(false, None, false, 3.0), Some(f64::INFINITY));
        assert_eq!(trade_ceiling(false, None, true, 3.0), None);
    }

    #[test]
    fn an_admitted_job_trades_only_for_a_first_token_ratio_times_sooner() {
        assert_eq!(trade_ceiling(true, Some(1_200.0), true, 3.0), Some(400.0));
        assert_eq!(trade_ceiling(true, Some(1_200.0), false, 0.0), None);
        assert_eq!(trade_ceiling(true, None, false, 3.0), None);
    }

    #[test]
    fn a_lone_job_goes_where_it_does_least_harm_only_at_the_last_moment() {
        assert!(!at_the_last_moment(1_000.0, 500.0, 200.0));
        assert!(at_the_last_moment(1_000.0, 800.0, 200.0));
        assert!(at_the_last_moment(100.0, 800.0, 200.0));
    }
}
