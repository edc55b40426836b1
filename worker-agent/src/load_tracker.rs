//! What this agent has sent to its model server, as the features of its performance model.
//!
//! The tracker knows every job the agent has started on the model server: its prompt
//! tokens (and how many of them the server holds cached, whose prefill it skips: every
//! "prompt tokens prefilled" below counts only the rest), whether it has produced its first
//! token and how many tokens it has generated since. From the event sequence (`started` when the request is sent, `first_token`,
//! `tokens` per relayed chunk, `finished` or `remove`) it keeps:
//!
//! - the time integrals of the number of decoding streams (jobs past their first token, not
//!   finished) and of their context tokens (prompt + generated): each integral accumulates
//!   `value × dt` before every change, so it is exact for the piecewise-constant load;
//! - the prefill span of every prompt: from when it was sent, or when the prompt sent
//!   before it had its first token if that was later, to its first token.
//!
//! A job's features are then differences of these between two marks of its own life, the
//! job's decode window being its first token → its last token (or its end, if it streamed
//! one token): the time-averaged streams beside it (itself included, so ≥ 1), their
//! time-averaged context, and the prompt tokens prefilled during the window (prefills its
//! decode stood still for). At start it records the streams decoding and the prompt tokens
//! still waiting for their prefill (what its own first token waits behind). These are the
//! signals [`PerfSample`] describes; the measured latencies come from the runner's
//! `measure` and are passed in.
//!
//! The prompt tokens prefilled during a window are each prompt's tokens spread evenly over
//! its prefill span, counted for the part of the span inside the window. A prompt still
//! prefilling when the window closes counts for the time it has been prefilling at the
//! recent prefill speed (the spans' tokens per ms), queued behind the prompts sent before it.
//! Why not the prompt tokens *sent* during the window: a server prefills a long prompt over
//! many steps (vLLM's chunked prefill takes 2,048 tokens or so a step), so a short job that
//! ends one chunk into it was charged all of it, while a prompt sent just before a job's
//! first token but prefilled during its decode was charged nothing. Both errors at once
//! trapped a live decode fit within its first jobs (`bench-results/fit-trap/`).
//!
//! Pure: no I/O, no clock (every event takes `now`), so every sequence replays exactly.
//! Invariants: the running totals (decoding streams, their context, pending prefill) are
//! the sums over the jobs tracked, whatever the order of `finished`/`remove`; time never
//! runs backwards (an event older than the last one counts as happening at the last one,
//! as two runners may take the tracker's lock out of order).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use metronome_protocol::LiveDecode;
use metronome_scheduler::perf::PerfSample;

/// What the runner measured about a finished job (see `runner::measure`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Measured {
    /// The server's prompt token count (the job's estimate when it sent none).
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// From the agent taking the job to its first token.
    pub ttft_ms: Option<f64>,
    /// (last token − first token) / (output − 1).
    pub tpot_ms: Option<f64>,
}

/// The integrals and counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Mark {
    at_ms: f64,
    streams_integral: f64,
    context_integral: f64,
    /// Instantaneous values, for a window of zero length.
    streams: u64,
    context: u64,
}

#[derive(Debug, Clone)]
struct Tracked {
    prompt_tokens: u64,
    /// Of them, those the server holds cached: it prefills only the rest.
    cached_tokens: u64,
    sent_ms: f64,
    /// Its place in the order the requests were sent: ties of `sent_ms` are common (the
    /// agent sends several in one millisecond) and the server takes them in this order.
    sent_order: u64,
    generated: u64,
    streams_at_start: u64,
    prefill_ahead_tokens: u64,
    first: Option<Mark>,
    last: Option<Mark>,
}

impl Tracked {
    /// The prompt tokens the server prefills: those it does not hold cached.
    fn prefill_tokens(&self) -> u64 {
        self.prompt_tokens - self.cached_tokens
    }
}

/// The load this agent put on its model server, and each job's share of it.
#[derive(Debug, Default)]
pub struct LoadTracker {
    /// Times are ms since the first event.
    origin: Option<Instant>,
    last_ms: f64,
    /// Jobs past their first token, not finished.
    decoding: u64,
    /// Prompt + generated tokens of the decoding jobs.
    context: u64,
    /// Prompt tokens of jobs without a first token.
    pending_prefill: u64,
    /// ∫ decoding dt, stream·ms.
    streams_integral: f64,
    /// ∫ context dt, token·ms.
    context_integral: f64,
    /// Prefill spans that a decoding job's window may still overlap, oldest first.
    spans: VecDeque<PrefillSpan>,
    /// When the latest prefill ended (the latest first token).
    prefill_free_ms: f64,
    /// Recent prefill spans' decayed milliseconds and tokens: the prefill speed.
    prefill_ms: f64,
    prefill_tokens: f64,
    /// Requests sent so far (the next one's `sent_order`).
    sent_count: u64,
    jobs: HashMap<String, Tracked>,
}

/// One prompt's prefill: its tokens, taken as spread evenly over `from_ms..to_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PrefillSpan {
    /// Its request's place in the order sent (`Tracked::sent_order`).
    sent_order: u64,
    from_ms: f64,
    to_ms: f64,
    tokens: f64,
}

impl PrefillSpan {
    /// Its tokens prefilled within `from..to`.
    fn tokens_within(&self, from: f64, to: f64) -> f64 {
        let overlap = self.to_ms.min(to) - self.from_ms.max(from);
        let length = self.to_ms - self.from_ms;
        if length <= 0.0 {
            // Prefilled at one instant: inside the window or not.
            return if self.to_ms > from && self.to_ms <= to {
                self.tokens
            } else {
                0.0
            };
        }
        self.tokens * (overlap / length).clamp(0.0, 1.0)
    }
}

/// Tokens a stream must have written past its first before its rate is reported
/// ([`LoadTracker::live_decode`]): over fewer, one step's jitter or a prefill it stood still
/// for is most of the measurement.
pub const LIVE_DECODE_MIN_TOKENS: u64 = 16;

/// Weight kept by the prefill speed's sums at each new span: it follows about the last 20
/// prompts.
const PREFILL_SPEED_KEEP: f64 = 0.95;

impl LoadTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// The job's request was sent to the model server.
    /// `cached_tokens` of its `prompt_tokens` are in the server's prefix cache: it prefills
    /// only the rest, so only the rest counts as prefill (ahead of later prompts, beside
    /// decoding streams, in its own TTFT's features), while the whole prompt is context.
    pub fn started(&mut self, job: &str, prompt_tokens: u32, cached_tokens: u32, now: Instant) {
        self.advance(now);
        if self.jobs.contains_key(job) {
            self.forget(job);
        }
        let prompt = u64::from(prompt_tokens);
        let cached = u64::from(cached_tokens).min(prompt);
        self.jobs.insert(
            job.to_string(),
            Tracked {
                prompt_tokens: prompt,
                cached_tokens: cached,
                sent_ms: self.last_ms,
                sent_order: self.sent_count,
                generated: 0,
                streams_at_start: self.decoding,
                prefill_ahead_tokens: self.pending_prefill,
                first: None,
                last: None,
            },
        );
        self.pending_prefill += prompt - cached;
        self.sent_count += 1;
    }

    /// The job produced its first token: its prefill is over, it decodes from now on.
    pub fn first_token(&mut self, job: &str, now: Instant) {
        self.advance(now);
        let Some(t) = self.jobs.get_mut(job) else {
            return;
        };
        if t.first.is_some() {
            return;
        }
        self.pending_prefill -= t.prefill_tokens();
        self.decoding += 1;
        self.context += t.prompt_tokens + t.generated;
        // Its prefill began when it was sent or when the last prompt sent before it had
        // its first token, whichever was later: a server prefills in arrival order (the
        // order sent, not the send time: the agent sends several in one millisecond). Not at
        // the latest first token of any prompt: a short prompt sent later can finish its
        // prefill in the same step as this one's last chunk and be delivered first, and
        // this one's whole prefill would then be squeezed into the milliseconds between
        // the two, inside the short one's decode.
        let from_ms = self
            .spans
            .iter()
            .filter(|s| s.sent_order < t.sent_order)
            .map(|s| s.to_ms)
            .fold(t.sent_ms, f64::max);
        let span = PrefillSpan {
            sent_order: t.sent_order,
            from_ms,
            to_ms: self.last_ms,
            tokens: t.prefill_tokens() as f64,
        };
        t.first = Some(Mark {
            at_ms: self.last_ms,
            streams_integral: self.streams_integral,
            context_integral: self.context_integral,
            streams: self.decoding,
            context: self.context,
        });
        self.prefill_free_ms = self.last_ms;
        if span.tokens > 0.0 {
            self.prefill_ms = self.prefill_ms * PREFILL_SPEED_KEEP + (span.to_ms - span.from_ms);
            self.prefill_tokens = self.prefill_tokens * PREFILL_SPEED_KEEP + span.tokens;
            self.spans.push_back(span);
        }
        self.prune_spans();
    }

    /// A relayed chunk carried `n` generated tokens (the first one implies `first_token`).
    pub fn tokens(&mut self, job: &str, n: u32, now: Instant) {
        if self.jobs.get(job).is_some_and(|t| t.first.is_none()) {
            self.first_token(job, now);
        }
        self.advance(now);
        let mark = self.mark();
        let Some(t) = self.jobs.get_mut(job) else {
            return;
        };
        t.generated += u64::from(n);
        self.context += u64::from(n);
        t.last = Some(Mark {
            context: self.context,
            ..mark
        });
    }

    /// The job completed: forget it and return its sample (`None` for a job that never
    /// produced a token, or one this tracker never saw start).
    pub fn finished(&mut self, job: &str, measured: &Measured, now: Instant) -> Option<PerfSample> {
        self.advance(now);
        let end_now = self.mark();
        let t = self.forget(job)?;
        let first = t.first?;
        let end = t.last.unwrap_or(end_now);
        let span = end.at_ms - first.at_ms;
        let (streams, context) = if span > 0.0 {
            (
                (end.streams_integral - first.streams_integral) / span,
                (end.context_integral - first.context_integral) / span,
            )
        } else {
            (end.streams as f64, end.context as f64)
        };
        Some(PerfSample {
            prompt_tokens: measured.prompt_tokens,
            cached_tokens: u32::try_from(t.cached_tokens)
                .unwrap_or(u32::MAX)
                .min(measured.prompt_tokens),
            output_tokens: measured.output_tokens,
            ttft_ms: measured.ttft_ms,
            tpot_ms: measured.tpot_ms,
            streams_at_start: t.streams_at_start as f64,
            prefill_ahead_tokens: t.prefill_ahead_tokens as f64,
            mean_decode_streams: streams.max(1.0),
            mean_context_tokens: context.max(0.0),
            stall_prefill_tokens: self.prefilled_within(first.at_ms, end.at_ms),
        })
    }

    /// The job failed or was cancelled: forget it without a sample.
    pub fn remove(&mut self, job: &str, now: Instant) {
        self.advance(now);
        self.forget(job);
    }

    /// The streams decoding at `now` and the slowest measured one's rate: its tokens after
    /// the first over the time since it (a stream is measured once it has written
    /// [`LIVE_DECODE_MIN_TOKENS`] past its first). `None` while nothing decodes.
    pub fn live_decode(&self, now: Instant) -> Option<LiveDecode> {
        if self.decoding == 0 {
            return None;
        }
        let now_ms = self.ms_at(now);
        let mut measured = 0u32;
        let mut slowest = f64::INFINITY;
        for t in self.jobs.values() {
            let Some(first) = t.first else {
                continue;
            };
            let written = t.generated.saturating_sub(1);
            let span_ms = now_ms - first.at_ms;
            if written < LIVE_DECODE_MIN_TOKENS || span_ms <= 0.0 {
                continue;
            }
            measured += 1;
            slowest = slowest.min(written as f64 * 1000.0 / span_ms);
        }
        Some(LiveDecode {
            streams: u32::try_from(self.decoding).unwrap_or(u32::MAX),
            measured,
            slowest_tok_s: if measured > 0 { slowest } else { 0.0 },
        })
    }

    /// Prompt tokens of the held jobs still waiting for their first token.
    pub fn pending_prefill_tokens(&self) -> u64 {
        self.pending_prefill
    }

    /// Jobs decoding now.
    pub fn decoding_streams(&self) -> u64 {
        self.decoding
    }

    /// Context tokens (prompt + generated) of the jobs decoding now.
    pub fn decoding_context_tokens(&self) -> u64 {
        self.context
    }

    /// Jobs tracked (started, not finished).
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    fn mark(&self) -> Mark {
        Mark {
            at_ms: self.last_ms,
            streams_integral: self.streams_integral,
            context_integral: self.context_integral,
            streams: self.decoding,
            context: self.context,
        }
    }

    /// Prompt tokens prefilled within `from..to` (`to` at most now): the finished spans'
    /// share of it, and the prompts still waiting for their first token, queued in the order
    /// they were sent from the end of the last prefill, at the recent prefill speed (none
    /// counted before any prefill has been seen).
    fn prefilled_within(&self, from: f64, to: f64) -> f64 {
        if to <= from {
            return 0.0;
        }
        let done: f64 = self.spans.iter().map(|s| s.tokens_within(from, to)).sum();
        if self.prefill_tokens <= 0.0 {
            return done;
        }
        let ms_per_token = self.prefill_ms / self.prefill_tokens;
        let mut waiting: Vec<(u64, f64, f64)> = self
            .jobs
            .values()
            .filter(|t| t.first.is_none() && t.prefill_tokens() > 0)
            .map(|t| (t.sent_order, t.sent_ms, t.prefill_tokens() as f64))
            .collect();
        // In the order sent, not the map's (which differs from one tracker to the next:
        // the same jobs gave different samples, and the policy lab different results
        // from one run to the next).
        waiting.sort_by_key(|w| w.0);
        let mut free_ms = self.prefill_free_ms;
        let mut pending = 0.0;
        for (sent_order, sent_ms, tokens) in waiting {
            let from_ms = sent_ms.max(free_ms);
            if from_ms >= to {
                break;
            }
            // Not finished by now, so at least until now: never projected to end sooner.
            let to_ms = (from_ms + tokens * ms_per_token).max(self.last_ms);
            let span = PrefillSpan {
                sent_order,
                from_ms,
                to_ms,
                tokens,
            };
            pending += span.tokens_within(from, to);
            free_ms = to_ms;
        }
        done + pending
    }

    /// Drop the spans that ended before every decoding job's window began: no window still
    /// open or yet to open can overlap them.
    fn prune_spans(&mut self) {
        let oldest_window = self
            .jobs
            .values()
            .filter_map(|t| t.first.map(|m| m.at_ms))
            .fold(self.last_ms, f64::min);
        while self.spans.front().is_some_and(|s| s.to_ms < oldest_window) {
            self.spans.pop_front();
        }
    }

    /// Take a job out of the running totals.
    fn forget(&mut self, job: &str) -> Option<Tracked> {
        let t = self.jobs.remove(job)?;
        if t.first.is_some() {
            self.decoding -= 1;
            self.context -= t.prompt_tokens + t.generated;
        } else {
            self.pending_prefill -= t.prefill_tokens();
        }
        Some(t)
    }

    /// `now` in ms since the first event, never before the last one (the last one's time
    /// before any event).
    fn ms_at(&self, now: Instant) -> f64 {
        self.origin.map_or(self.last_ms, |origin| {
            let since = now.saturating_duration_since(origin);
            // Whole milliseconds stay exact (as_secs_f64() * 1e3 would round 55 ms).
            (since.as_secs() as f64 * 1e3 + f64::from(since.subsec_nanos()) / 1e6).max(self.last_ms)
        })
    }

    /// Accumulate the integrals up to `now`.
    fn advance(&mut self, now: Instant) {
        self.origin.get_or_insert(now);
        let now_ms = self.ms_at(now);
        let dt = now_ms - self.last_ms;
        self.streams_integral += self.decoding as f64 * dt;
        self.context_integral += self.context as f64 * dt;
        self.last_ms = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct Clock(Instant);
    impl Clock {
        fn at(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }
    }

    fn measured(prompt: u32, output: u32) -> Measured {
        Measured {
            prompt_tokens: prompt,
            output_tokens: output,
            ttft_ms: Some(10.0),
            tpot_ms: Some(5.0),
        }
    }

    #[test]
    fn two_overlapping_jobs_give_the_exact_integrals() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        // A: prompt 100, first token at 10, then one token every 10 ms up to 50 (5 tokens).
        t.started("a", 100, 0, c.at(0));
        t.tokens("a", 1, c.at(10));
        // B: prompt 200, sent at 20 while A decodes, first token at 30, last at 60.
        t.started("b", 200, 0, c.at(20));
        assert_eq!(t.pending_prefill_tokens(), 200);
        t.tokens("a", 1, c.at(20));
        t.tokens("a", 1, c.at(30));
        t.tokens("b", 1, c.at(30));
        t.tokens("a", 1, c.at(40));
        t.tokens("b", 1, c.at(40));
        t.tokens("a", 1, c.at(50));
        let a = t.finished("a", &measured(100, 5), c.at(55)).unwrap();
        t.tokens("b", 1, c.at(60));
        let b = t.finished("b", &measured(200, 3), c.at(70)).unwrap();

        // A's window 10..50 (40 ms): streams 1 on 10..30, 2 on 30..50 → (20 + 40) / 40.
        assert_eq!(a.mean_decode_streams, 1.5);
        // A's context: 101 on 10..20, 102 on 20..30; from 30 A + B: 103+201 on 30..40,
        // 104+202 on 40..50 → (1010 + 1020 + 3040 + 3060) / 40.
        assert_eq!(
            a.mean_context_tokens,
            (1010.0 + 1020.0 + 3040.0 + 3060.0) / 40.0
        );
        assert_eq!(a.streams_at_start, 0.0);
        assert_eq!(a.prefill_ahead_tokens, 0.0);
        assert_eq!(
            a.stall_prefill_tokens, 200.0,
            "B's prompt was prefilled during A's decode"
        );
        assert_eq!(
            (a.prompt_tokens, a.output_tokens, a.ttft_ms, a.tpot_ms),
            (100, 5, Some(10.0), Some(5.0))
        );

        // B's window 30..60: streams 2 on 30..55 (A finished at 55), 1 on 55..60.
        assert_eq!(b.mean_decode_streams, (2.0 * 25.0 + 5.0) / 30.0);
        // B's context: 304 on 30..40, 306 on 40..50, 307 on 50..55 (A's 5th token), then
        // 202 alone on 55..60.
        assert_eq!(
            b.mean_context_tokens,
            (3040.0 + 3060.0 + 307.0 * 5.0 + 202.0 * 5.0) / 30.0
        );
        assert_eq!(b.streams_at_start, 1.0, "A was decoding when B was sent");
        assert_eq!(b.prefill_ahead_tokens, 0.0);
        assert_eq!(b.stall_prefill_tokens, 0.0);
        assert!(t.is_empty());
    }

    #[test]
    fn a_job_waits_behind_the_prompts_ahead_and_stalls_a_decoding_one() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        t.started("long", 50, 0, c.at(0));
        t.first_token("long", c.at(5));
        t.tokens("long", 1, c.at(5));
        t.started("p1", 300, 0, c.at(10));
        t.started("p2", 700, 0, c.at(11));
        assert_eq!(t.pending_prefill_tokens(), 1_000);
        t.tokens("long", 1, c.at(20));
        t.tokens("p1", 1, c.at(25));
        t.tokens("p2", 1, c.at(30));
        let p2 = t.finished("p2", &measured(700, 1), c.at(31)).unwrap();
        assert_eq!(p2.prefill_ahead_tokens, 300.0, "p1 was still waiting");
        assert_eq!(p2.streams_at_start, 1.0);
        // One token: a zero-length window, read at that token (long, p1, p2 decode).
        assert_eq!(p2.mean_decode_streams, 3.0);
        assert_eq!(p2.mean_context_tokens, (52 + 301 + 701) as f64);
        t.tokens("long", 1, c.at(40));
        // A job started after the window is not a stall of `long`.
        t.started("late", 10_000, 0, c.at(45));
        let long = t.finished("long", &measured(50, 3), c.at(50)).unwrap();
        assert_eq!(long.stall_prefill_tokens, 1_000.0);
        assert_eq!(t.pending_prefill_tokens(), 10_000);
    }

    /// A tracker whose first prompt set the prefill speed: 1,000 tokens in 100 ms.
    fn warmed(c: &Clock) -> LoadTracker {
        let mut t = LoadTracker::new();
        t.started("warm", 1_000, 0, c.at(0));
        t.tokens("warm", 1, c.at(100));
        t.remove("warm", c.at(100));
        t
    }

    #[test]
    fn a_prompt_counts_for_the_part_of_its_prefill_inside_the_window() {
        let c = Clock(Instant::now());
        let mut t = warmed(&c);
        // `late` is sent before `early`'s first token, so it queues behind that prefill
        // and is prefilled during `early`'s decode (it was charged nothing when counting
        // the prompts sent during the window).
        t.started("early", 100, 0, c.at(200));
        t.started("late", 400, 0, c.at(205));
        t.tokens("early", 1, c.at(210));
        t.tokens("late", 1, c.at(250));
        // `short` starts decoding at 260; a 4,000-token prompt is sent at 270 and is still
        // prefilling when `short` ends at 290: 20 ms of it at 0.1 ms a token, 200 tokens
        // (not the 4,000 sent).
        t.started("short", 10, 0, c.at(259));
        t.tokens("short", 1, c.at(260));
        t.started("huge", 4_000, 0, c.at(270));
        t.tokens("short", 1, c.at(290));
        let short = t.finished("short", &measured(10, 2), c.at(290)).unwrap();
        assert!(
            (short.stall_prefill_tokens - 200.0).abs() < 1e-6,
            "{}",
            short.stall_prefill_tokens
        );
        // `early`'s window 210..300: all of `late` (prefilled 210..250), `short`'s 10 tokens
        // (259..260) and 300 of `huge` by then (queued behind `short`, from 270).
        t.tokens("early", 1, c.at(300));
        let early = t.finished("early", &measured(100, 2), c.at(300)).unwrap();
        assert!(
            (early.stall_prefill_tokens - 710.0).abs() < 1e-6,
            "{}",
            early.stall_prefill_tokens
        );
        // Once `huge` has its first token its measured span counts instead: 270..700 for
        // 4,000 tokens, of which `late`'s window 250..400 holds 130 ms; `short`'s 10 too.
        t.tokens("late", 1, c.at(400));
        t.tokens("huge", 1, c.at(700));
        let late = t.finished("late", &measured(400, 2), c.at(700)).unwrap();
        let expected = 10.0 + 4_000.0 * 130.0 / 430.0;
        assert!(
            (late.stall_prefill_tokens - expected).abs() < 1e-6,
            "{} vs {expected}",
            late.stall_prefill_tokens
        );
    }

    /// Two prompts sent in the same millisecond are projected in the order they were sent.
    /// `short` decodes from 260 to 290; at 270 a 4,000-token prompt is sent, then a
    /// 100-token one, both still prefilling at 290 at 0.1 ms a token: the long one first,
    /// so 200 of its tokens fall in the window. Projected the other way round, the short
    /// one (taken to last at least until now) would fill the window with its 100. Each
    /// tracker's map orders its jobs differently, so many trackers must agree.
    #[test]
    fn prompts_sent_together_are_projected_in_the_order_sent() {
        for _ in 0..32 {
            let c = Clock(Instant::now());
            let mut t = warmed(&c);
            t.started("short", 10, 0, c.at(259));
            t.tokens("short", 1, c.at(260));
            t.started("long", 4_000, 0, c.at(270));
            t.started("brief", 100, 0, c.at(270));
            t.tokens("short", 1, c.at(290));
            let short = t.finished("short", &measured(10, 2), c.at(290)).unwrap();
            assert!(
                (short.stall_prefill_tokens - 200.0).abs() < 1e-6,
                "{}",
                short.stall_prefill_tokens
            );
        }
    }

    /// A live worker's second job (stop 31, `local-gpu0`): a 201-token prompt sent while a
    /// 4,808-token one was prefilling finished its prefill in the same server step as the
    /// long one's last chunk, was delivered first, and decoded 24 tokens at 17 ms each with
    /// no stall. Counting the long prompt's prefill from the latest first token instead of
    /// the last one sent before it squeezed all 4,743 of its tokens into the short job's
    /// decode, and the decode fit's base step fell to 0.2 ms.
    #[test]
    fn a_prompt_delivered_after_a_later_one_keeps_its_own_prefill_span() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        t.started("long", 4_800, 0, c.at(0));
        t.started("short", 200, 0, c.at(100));
        t.tokens("short", 1, c.at(800));
        t.tokens("long", 1, c.at(802));
        t.tokens("short", 1, c.at(1_000));
        t.tokens("short", 1, c.at(1_200));
        let short = t.finished("short", &measured(200, 3), c.at(1_200)).unwrap();
        // `long` prefilled over 0..802: 2 ms of it inside `short`'s window 800..1200.
        let expected = 4_800.0 * 2.0 / 802.0;
        assert!(
            (short.stall_prefill_tokens - expected).abs() < 1e-6,
            "{} vs {expected}",
            short.stall_prefill_tokens
        );
        // A prompt sent after both starts its span at the latest first token before it.
        t.started("next", 1_000, 0, c.at(1_300));
        t.tokens("next", 1, c.at(1_400));
        t.tokens("long", 1, c.at(1_500));
        t.tokens("long", 1, c.at(1_600));
        let long = t
            .finished("long", &measured(4_800, 3), c.at(1_600))
            .unwrap();
        assert!(
            (long.stall_prefill_tokens - 1_000.0).abs() < 1e-6,
            "{long:?}"
        );
    }

    #[test]
    fn removal_keeps_totals_consistent() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        t.started("a", 100, 0, c.at(0));
        t.started("b", 40, 0, c.at(1));
        t.tokens("a", 3, c.at(2));
        assert_eq!(
            (t.decoding_streams(), t.decoding_context_tokens()),
            (1, 103)
        );
        assert_eq!(t.pending_prefill_tokens(), 40);
        // A failed job without a token and a cancelled one while decoding: no sample, and
        // every total returns to what the remaining jobs hold.
        t.started("c", 7, 0, c.at(3));
        t.remove("b", c.at(4));
        assert_eq!(t.pending_prefill_tokens(), 7);
        t.remove("a", c.at(5));
        assert_eq!((t.decoding_streams(), t.decoding_context_tokens()), (0, 0));
        assert_eq!(t.len(), 1);
        assert_eq!(t.finished("a", &measured(100, 3), c.at(6)), None);
        // A job that finished without a token has no sample either.
        assert_eq!(t.finished("c", &measured(7, 0), c.at(6)), None);
        assert_eq!(t.pending_prefill_tokens(), 0);
        assert!(t.is_empty());
        // Events of unknown jobs change nothing.
        t.tokens("ghost", 1, c.at(7));
        t.first_token("ghost", c.at(7));
        t.remove("ghost", c.at(7));
        assert_eq!((t.decoding_streams(), t.pending_prefill_tokens()), (0, 0));
    }

    #[test]
    fn a_restarted_job_replaces_its_earlier_run_and_time_never_runs_backwards() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        t.started("a", 100, 0, c.at(10));
        t.tokens("a", 1, c.at(20));
        t.started("a", 100, 0, c.at(30));
        assert_eq!((t.decoding_streams(), t.pending_prefill_tokens()), (0, 100));
        t.tokens("a", 1, c.at(40));
        // An event stamped before the last one counts at the last one.
        t.tokens("a", 1, c.at(35));
        t.tokens("a", 1, c.at(50));
        let s = t.finished("a", &measured(100, 3), c.at(50)).unwrap();
        assert_eq!(s.mean_decode_streams, 1.0);
        assert_eq!(s.mean_context_tokens, (101.0 * 0.0 + 102.0 * 10.0) / 10.0);
    }

    #[test]
    fn a_prompt_sent_in_the_same_millisecond_prefills_after_the_one_sent_before_it() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        // Two prompts sent in one millisecond: the server prefills A, then B.
        t.started("a", 1_000, 0, c.at(0));
        t.started("b", 1_000, 0, c.at(0));
        t.tokens("a", 1, c.at(100));
        // B's prefill ran from A's first token to its own, all of it inside A's decode
        // window (100..300); taken from its send time it would be half outside.
        t.tokens("b", 1, c.at(200));
        t.tokens("a", 1, c.at(300));
        let a = t.finished("a", &measured(1_000, 2), c.at(300)).unwrap();
        assert_eq!(a.stall_prefill_tokens, 1_000.0);
    }

    #[test]
    fn a_cached_prefix_counts_as_context_but_not_as_prefill() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        // A decodes from 10; B's 2,100-token prompt, 2,000 of them cached, is sent at 20
        // and has its first token at 30; C, sent at 25, waits behind B's 100.
        t.started("a", 100, 0, c.at(0));
        t.tokens("a", 1, c.at(10));
        t.started("b", 2_100, 2_000, c.at(20));
        assert_eq!(t.pending_prefill_tokens(), 100);
        t.started("c", 300, 0, c.at(25));
        assert_eq!(t.pending_prefill_tokens(), 400);
        t.tokens("b", 1, c.at(30));
        assert_eq!(t.pending_prefill_tokens(), 300);
        // The whole prompt is context for every decode step.
        assert_eq!(t.decoding_context_tokens(), 101 + 2_101);
        t.tokens("c", 1, c.at(40));
        t.tokens("a", 1, c.at(50));
        let a = t.finished("a", &measured(100, 2), c.at(50)).unwrap();
        assert_eq!(
            a.stall_prefill_tokens, 400.0,
            "B's uncached 100 and C's 300 were prefilled during A's decode"
        );
        t.tokens("c", 1, c.at(60));
        let cs = t.finished("c", &measured(300, 2), c.at(60)).unwrap();
        assert_eq!(cs.prefill_ahead_tokens, 100.0, "B's uncached tokens only");
        t.tokens("b", 1, c.at(70));
        let b = t.finished("b", &measured(2_100, 2), c.at(70)).unwrap();
        assert_eq!((b.prompt_tokens, b.cached_tokens), (2_100, 2_000));
        assert_eq!(t.pending_prefill_tokens(), 0);
    }

    #[test]
    fn a_cached_count_above_the_prompt_is_the_whole_prompt() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        t.started("a", 100, 500, c.at(0));
        assert_eq!(t.pending_prefill_tokens(), 0);
        t.tokens("a", 1, c.at(10));
        t.tokens("a", 1, c.at(20));
        let a = t.finished("a", &measured(100, 2), c.at(20)).unwrap();
        assert_eq!(a.cached_tokens, 100);
    }

    #[test]
    fn live_decode_reports_the_streams_and_the_slowest_measured_rate() {
        let c = Clock(Instant::now());
        let mut t = LoadTracker::new();
        assert_eq!(t.live_decode(c.at(0)), None, "nothing decodes");
        t.started("fast", 100, 0, c.at(0));
        t.started("slow", 100, 0, c.at(0));
        t.started("new", 100, 0, c.at(0));
        t.tokens("fast", 1, c.at(100));
        t.tokens("slow", 1, c.at(100));
        t.tokens("new", 1, c.at(900));
        // By 1,100 ms: fast wrote 40 past its first in 1 s, slow 20, new 2 (not measured).
        t.tokens("fast", 40, c.at(1_000));
        t.tokens("slow", 20, c.at(1_000));
        t.tokens("new", 2, c.at(1_000));
        let live = t.live_decode(c.at(1_100)).unwrap();
        assert_eq!((live.streams, live.measured), (3, 2));
        assert!((live.slowest_tok_s - 20.0).abs() < 1e-9, "{live:?}");
        // A stream that stops writing is seen slowing down.
        let later = t.live_decode(c.at(2_100)).unwrap();
        assert!((later.slowest_tok_s - 10.0).abs() < 1e-9, "{later:?}");
        t.finished("slow", &measured(100, 21), c.at(2_100));
        t.finished("fast", &measured(100, 41), c.at(2_100));
        t.finished("new", &measured(100, 3), c.at(2_100));
        assert_eq!(t.live_decode(c.at(2_200)), None);
    }
}
