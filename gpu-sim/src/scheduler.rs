//! The scheduler task of one simulated GPU: it owns the pure [`Engine`] behind a mutex and
//! runs vLLM's engine loop against the wall clock — step, wait the step's simulated
//! duration, deliver the step's tokens — while HTTP handlers submit and abort sequences.
//!
//! Invariants: the mutex is never held across an `.await`; tokens of a step are delivered
//! only once the step's time has passed; a request whose handle is dropped (client gone)
//! is aborted and its KV freed before the next step; steps are scheduled back to back on a
//! running clock (`next start = previous end`) so timer overshoot does not accumulate into
//! a slower GPU, and the clock restarts from `now` after the engine was idle.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::SimGpuConfig;
use crate::engine::{Engine, EngineError, EngineStats, SeqId};
use crate::kv_publisher::KvEventSender;
use crate::metrics::RequestMetrics;

/// Most the running clock may fall behind `now` before it is reset. A real GPU does not slow
/// down when its host's CPU is busy, so late wake-ups (timer rounding, a loaded 2-core CI
/// machine) are caught up by running the next steps without sleeping; the bound keeps a
/// process that was stalled for long from replaying seconds of steps in one burst.
const MAX_CATCH_UP: Duration = Duration::from_millis(50);

/// What a request's handle receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqEvent {
    /// The sequence produced token `index` (0-based); `finished` marks its last token.
    Token { index: u32, finished: bool },
}

/// Why a request could not be submitted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the simulated GPU is shutting down")]
    Closed,
}

struct Sink {
    tx: mpsc::UnboundedSender<SeqEvent>,
    arrived: Instant,
    last_token_at: Option<Instant>,
    stopped_early: bool,
}

struct State {
    engine: Engine,
    sinks: HashMap<SeqId, Sink>,
    next_id: SeqId,
    requests: RequestMetrics,
    closed: bool,
}

/// One simulated GPU's shared state.
pub struct Gpu {
    config: SimGpuConfig,
    state: Mutex<State>,
    wake: Notify,
    /// Where each step's KV cache events go, when the GPU publishes them.
    kv_events: Option<KvEventSender>,
}

impl Gpu {
    pub fn new(config: SimGpuConfig) -> Arc<Self> {
        Gpu::with_kv_events(config, None)
    }

    /// A GPU that sends its prefix cache's events, one batch per step, to `kv_events`.
    pub fn with_kv_events(config: SimGpuConfig, kv_events: Option<KvEventSender>) -> Arc<Self> {
        let engine = Engine::with_kv_events(config.engine_params(), kv_events.is_some());
        Arc::new(Gpu {
            kv_events,
            config,
            state: Mutex::new(State {
                engine,
                sinks: HashMap::new(),
                next_id: 1,
                requests: RequestMetrics::default(),
                closed: false,
            }),
            wake: Notify::new(),
        })
    }

    pub fn config(&self) -> &SimGpuConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent engine state (every mutation is
        // completed before the guard drops), so keep serving rather than poison everyone.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> EngineStats {
        self.lock().engine.stats()
    }

    /// Read the engine counters and request histograms together.
    pub fn with_metrics<T>(&self, f: impl FnOnce(EngineStats, &RequestMetrics) -> T) -> T {
        let st = self.lock();
        f(st.engine.stats(), &st.requests)
    }

    /// Queue a sequence of `prompt_tokens` anonymous prompt tokens (sharing no cached
    /// prefix) generating `output_tokens` tokens. `stopped_early` says the request ends
    /// before its `max_tokens` (finish reason `stop`), for the success counter.
    pub fn submit(
        self: &Arc<Self>,
        prompt_tokens: u32,
        output_tokens: u32,
        stopped_early: bool,
    ) -> Result<Submission, SubmitError> {
        self.submit_seq(
            SeqPrompt::Anonymous(prompt_tokens),
            output_tokens,
            stopped_early,
        )
    }

    /// Queue a sequence whose prompt is `token_ids` (its prefix can be served from and
    /// added to the prefix cache); otherwise as [`Gpu::submit`].
    pub fn submit_prompt(
        self: &Arc<Self>,
        token_ids: Vec<u32>,
        output_tokens: u32,
        stopped_early: bool,
    ) -> Result<Submission, SubmitError> {
        self.submit_seq(SeqPrompt::Tokens(token_ids), output_tokens, stopped_early)
    }

    fn submit_seq(
        self: &Arc<Self>,
        prompt: SeqPrompt,
        output_tokens: u32,
        stopped_early: bool,
    ) -> Result<Submission, SubmitError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut st = self.lock();
            if st.closed {
                return Err(SubmitError::Closed);
            }
            let id = st.next_id;
            match prompt {
                SeqPrompt::Anonymous(n) => st.engine.add(id, n, output_tokens)?,
                SeqPrompt::Tokens(ids) => st.engine.add_prompt(id, ids, output_tokens)?,
            }
            st.next_id += 1;
            st.sinks.insert(
                id,
                Sink {
                    tx,
                    arrived: Instant::now(),
                    last_token_at: None,
                    stopped_early,
                },
            );
            id
        };
        self.wake.notify_one();
        Ok(Submission {
            id,
            rx,
            guard: AbortOnDrop {
                gpu: Arc::clone(self),
                id,
                armed: true,
            },
        })
    }

    /// Drop every cached prefix (vLLM's `POST /reset_prefix_cache`); `false` while any
    /// sequence holds KV blocks.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut st = self.lock();
        let done = st.engine.reset_prefix_cache();
        self.publish_kv_events(&mut st.engine);
        done
    }

    /// Prompt tokens of `token_ids` the prefix cache holds right now.
    pub fn cached_prefix_tokens(&self, token_ids: &[u32]) -> u32 {
        self.lock().engine.cached_prefix_tokens(token_ids)
    }

    fn publish_kv_events(&self, engine: &mut Engine) {
        if let Some(sender) = &self.kv_events {
            sender.send(engine.take_kv_events());
        }
    }

    fn abort(&self, id: SeqId) {
        let mut st = self.lock();
        if st.sinks.remove(&id).is_some() {
            st.requests.aborted += 1;
        }
        if st.engine.abort(id) {
            tracing::debug!(model = %self.config.model, seq_id = id, "sequence aborted, KV freed");
        }
    }

    /// One step under the lock: returns the step's duration and the events to deliver.
    fn step(
        &self,
        start: Instant,
    ) -> (
        Duration,
        bool,
        Vec<(mpsc::UnboundedSender<SeqEvent>, SeqEvent)>,
    ) {
        let mut st = self.lock();
        let outcome = st.engine.step();
        // Events leave when the step is scheduled, as vLLM's scheduler takes them after
        // each schedule (`KVCacheManager.take_events`).
        self.publish_kv_events(&mut st.engine);
        if outcome.is_idle() {
            return (Duration::ZERO, true, Vec::new());
        }
        let delivered_at = start + outcome.duration;
        if !outcome.preempted.is_empty() {
            tracing::debug!(model = %self.config.model, preempted = ?outcome.preempted, "KV cache full, preempted (recompute)");
        }
        let mut deliveries = Vec::with_capacity(outcome.tokens.len());
        let State {
            sinks, requests, ..
        } = &mut *st;
        for t in &outcome.tokens {
            let Some(sink) = sinks.get_mut(&t.id) else {
                continue;
            };
            match sink.last_token_at {
                None => requests
                    .ttft
                    .observe((delivered_at - sink.arrived).as_secs_f64()),
                Some(last) => requests.tpot.observe((delivered_at - last).as_secs_f64()),
            }
            sink.last_token_at = Some(delivered_at);
            deliveries.push((
                sink.tx.clone(),
                SeqEvent::Token {
                    index: t.index,
                    finished: t.finished,
                },
            ));
            if t.finished {
                let sink = sinks.remove(&t.id).expect("sink exists");
                requests
                    .e2e
                    .observe((delivered_at - sink.arrived).as_secs_f64());
                if sink.stopped_early {
                    requests.finished_stop += 1;
                } else {
                    requests.finished_length += 1;
                }
            }
        }
        (outcome.duration, false, deliveries)
    }

    fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        // Dropping the senders ends every open stream.
        let ids: Vec<SeqId> = st.sinks.drain().map(|(id, _)| id).collect();
        for id in ids {
            st.engine.abort(id);
        }
    }

    /// The engine loop; returns when `shutdown` fires.
    pub async fn drive(self: Arc<Self>, shutdown: CancellationToken) {
        let mut clock: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let start = match clock {
                Some(end_of_last) if end_of_last + MAX_CATCH_UP >= now => end_of_last,
                _ => now,
            };
            let (duration, idle, deliveries) = self.step(start);
            if idle {
                clock = None;
                tokio::select! {
                    _ = self.wake.notified() => continue,
                    _ = shutdown.cancelled() => break,
                }
            }
            let end = start + duration;
            if duration.is_zero() {
                // Zero-delay mode: let handlers run between steps.
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    _ = tokio::time::sleep_until(end) => {}
                    _ = shutdown.cancelled() => break,
                }
            }
            clock = Some(end);
            for (tx, event) in deliveries {
                // A closed receiver is a client that left; its handle aborts the sequence.
                let _ = tx.send(event);
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        self.close();
    }
}

/// A prompt as the engine receives it.
enum SeqPrompt {
    /// Only a length: shares nothing with any other prompt.
    Anonymous(u32),
    /// Token ids: reuses and fills the prefix cache.
    Tokens(Vec<u32>),
}

/// Aborts the sequence when dropped before it finished.
struct AbortOnDrop {
    gpu: Arc<Gpu>,
    id: SeqId,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.gpu.abort(self.id);
        }
    }
}

/// A submitted sequence: its events, and an abort on drop.
pub struct Submission {
    pub id: SeqId,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    guard: AbortOnDrop,
}

impl Submission {
    /// The next event; `None` when the GPU shut down before the sequence finished.
    pub async fn next(&mut self) -> Option<SeqEvent> {
        let event = self.rx.recv().await;
        if let Some(SeqEvent::Token { finished: true, .. }) = event {
            self.guard.armed = false;
        }
        event
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(speed: f64) -> SimGpuConfig {
        SimGpuConfig {
            speed,
            kv_read_ms_per_token: 0.0,
            ..SimGpuConfig::new("m")
        }
    }

    /// A GPU with its engine loop running, the token that stops it and the loop's task.
    fn driven(speed: f64) -> (Arc<Gpu>, CancellationToken, tokio::task::JoinHandle<()>) {
        driven_with(config(speed))
    }

    fn driven_with(
        config: SimGpuConfig,
    ) -> (Arc<Gpu>, CancellationToken, tokio::task::JoinHandle<()>) {
        let gpu = Gpu::new(config);
        let shutdown = CancellationToken::new();
        let driver = tokio::spawn(Arc::clone(&gpu).drive(shutdown.clone()));
        (gpu, shutdown, driver)
    }

    /// Run one request to completion on tokio's paused clock; returns the time it took.
    async fn timed_request(speed: f64, prompt: u32, output: u32) -> (Duration, EngineStats) {
        let (gpu, shutdown, driver) = driven(speed);
        let started = Instant::now();
        let mut submission = gpu.submit(prompt, output, false).unwrap();
        let mut tokens = 0;
        while let Some(SeqEvent::Token { finished, .. }) = submission.next().await {
            tokens += 1;
            if finished {
                break;
            }
        }
        assert_eq!(tokens, output);
        let elapsed = started.elapsed();
        shutdown.cancel();
        driver.await.unwrap();
        (elapsed, gpu.stats())
    }

    #[tokio::test(start_paused = true)]
    async fn steps_are_paced_by_their_simulated_duration() {
        // Prefill step: 16.7 + 100 * 0.16 = 32.7 ms; then 59 decode steps of 16.7 ms.
        let (elapsed, stats) = timed_request(1.0, 100, 60).await;
        let simulated = Duration::from_secs_f64(stats.busy_seconds_total);
        assert!((stats.busy_seconds_total - (0.0327 + 59.0 * 0.0167)).abs() < 1e-9);
        // The running clock does not accumulate the timer's 1 ms rounding.
        assert!(
            elapsed >= simulated && elapsed <= simulated + Duration::from_millis(1),
            "{elapsed:?} vs {simulated:?}"
        );
    }

    /// Time to first token of the same 2,000-token prompt sent twice, one after the other.
    async fn repeated_prompt_ttft(enable_prefix_caching: bool) -> [Duration; 2] {
        let (gpu, shutdown, driver) = driven_with(SimGpuConfig {
            enable_prefix_caching,
            ..config(1.0)
        });
        let prompt: Vec<u32> = (0..2000).collect();
        let mut ttft = [Duration::ZERO; 2];
        for t in &mut ttft {
            let started = Instant::now();
            let mut submission = gpu.submit_prompt(prompt.clone(), 1, false).unwrap();
            assert!(submission.next().await.is_some());
            *t = started.elapsed();
        }
        shutdown.cancel();
        driver.await.unwrap();
        ttft
    }

    #[tokio::test(start_paused = true)]
    async fn a_repeated_prompt_skips_the_prefill_of_its_cached_prefix() {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        // Calibrated card: 16.7 ms + 2,000 * 0.16 ms = 336.7 ms of prefill, then 124 of the
        // 125 full blocks (1,984 tokens) come from the cache: 16.7 + 16 * 0.16 = 19.26 ms.
        let [first, second] = repeated_prompt_ttft(true).await;
        assert!((ms(first) - 336.7).abs() <= 1.0, "{first:?}");
        assert!((ms(second) - 19.26).abs() <= 1.0, "{second:?}");
        let [first, second] = repeated_prompt_ttft(false).await;
        assert!((ms(first) - 336.7).abs() <= 1.0, "{first:?}");
        assert!((ms(second) - 336.7).abs() <= 1.0, "caching off: {second:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn half_speed_takes_twice_as_long() {
        let (fast, _) = timed_request(1.0, 500, 200).await;
        let (slow, _) = timed_request(0.5, 500, 200).await;
        let ratio = slow.as_secs_f64() / fast.as_secs_f64();
        assert!((ratio - 2.0).abs() < 0.01, "{ratio}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_sequence_counts_as_running_until_its_last_token_is_delivered() {
        // Decode steps take 16.7 ms. Halfway through the last one the GPU is computing
        // that token, so `/metrics` must not read idle; once it is delivered, it does.
        let (gpu, shutdown, driver) = driven(1.0);
        let mut submission = gpu.submit(100, 2, false).unwrap();
        let first = submission.next().await;
        assert!(matches!(
            first,
            Some(SeqEvent::Token {
                finished: false,
                ..
            })
        ));
        tokio::time::sleep(Duration::from_millis(8)).await;
        assert_eq!(gpu.stats().running, 1);
        assert!(gpu.stats().used_blocks > 0);
        let last = submission.next().await;
        assert!(matches!(last, Some(SeqEvent::Token { finished: true, .. })));
        // The loop steps again, retiring it, in the same poll that delivered the token.
        assert_eq!(gpu.stats().running, 0);
        assert_eq!(gpu.stats().used_blocks, 0);
        shutdown.cancel();
        driver.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_submission_aborts_it() {
        let (gpu, shutdown, driver) = driven(1.0);
        let mut submission = gpu.submit(100, 1000, false).unwrap();
        submission.next().await.unwrap();
        assert_eq!(gpu.stats().running, 1);
        assert!(gpu.stats().used_blocks > 0);
        drop(submission);
        assert_eq!(gpu.stats().running, 0);
        assert_eq!(gpu.stats().used_blocks, 0);
        gpu.with_metrics(|_, requests| assert_eq!(requests.aborted, 1));
        shutdown.cancel();
        driver.await.unwrap();
        assert!(matches!(gpu.submit(1, 1, false), Err(SubmitError::Closed)));
    }
}
