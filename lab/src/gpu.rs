//! One simulated GPU in simulated time: the simulator's engine, stepped back to back while
//! it has work, each step's tokens delivered when the step ends (as the simulator's server
//! loop does: a sequence added during a step joins the next one).

use metronome_gpu_sim::block_pool::KvEvent;
use metronome_gpu_sim::cost::StepShape;
use metronome_gpu_sim::engine::{Emitted, Engine, EngineStats, SeqId};
use metronome_gpu_sim::SimGpuConfig;

/// A GPU and the step it is running.
pub struct Gpu {
    engine: Engine,
    /// End of the step in progress, its tokens and the part of its time spent on prefill
    /// (what every decoding sequence of the step stood still for).
    running: Option<(f64, Vec<Emitted>, f64)>,
    /// Simulated milliseconds spent stepping.
    pub busy_ms: f64,
}

impl Gpu {
    /// A GPU whose engine records each admission's cached prompt tokens, and its prefix
    /// cache's KV events when `kv_events` (a reporting agent reads them).
    pub fn new(config: &SimGpuConfig, kv_events: bool) -> Gpu {
        let mut engine = Engine::with_kv_events(config.engine_params(), kv_events);
        engine.record_prefix_hits();
        Gpu {
            engine,
            running: None,
            busy_ms: 0.0,
        }
    }

    /// Each sequence admitted since the last call, with its prompt tokens found cached.
    pub fn take_prefix_hits(&mut self) -> Vec<(SeqId, u32)> {
        self.engine.take_prefix_hits()
    }

    /// The prefix cache's KV events since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.engine.take_kv_events()
    }

    /// Queue a sequence. A request the cache can never hold is refused, as the server does.
    pub fn add(&mut self, id: SeqId, prompt_tokens: u32, output_tokens: u32) -> bool {
        self.engine.add(id, prompt_tokens, output_tokens).is_ok()
    }

    /// Queue a sequence whose prompt is `token_ids`: the engine's prefix cache (the
    /// simulator's block pool) reuses the blocks it holds and prefills only the rest.
    pub fn add_prompt(&mut self, id: SeqId, token_ids: Vec<u32>, output_tokens: u32) -> bool {
        self.engine.add_prompt(id, token_ids, output_tokens).is_ok()
    }

    /// Start the next step at `now_ms` if none is running and there is work; the time it
    /// ends, for the caller to come back then.
    pub fn kick(&mut self, now_ms: f64) -> Option<f64> {
        if self.running.is_some() || !self.engine.has_work() {
            return None;
        }
        let outcome = self.engine.step();
        if outcome.is_idle() {
            return None;
        }
        let ms = outcome.duration.as_secs_f64() * 1000.0;
        let cost = self.engine.params().cost;
        let stall_ms = cost.step_ms(outcome.shape)
            - cost.step_ms(StepShape {
                prefill_tokens: 0,
                decode_seqs: outcome.shape.decode_seqs.max(1),
                ..outcome.shape
            });
        self.busy_ms += ms;
        let end = now_ms + ms;
        self.running = Some((end, outcome.tokens, stall_ms.max(0.0)));
        Some(end)
    }

    /// The step that ended: its tokens and its prefill time. The sequences it finished
    /// leave the batch now, as the server's gauges show them leave on delivery.
    pub fn finish_step(&mut self) -> (Vec<Emitted>, f64) {
        self.engine.retire_finished();
        self.running
            .take()
            .map(|(_, t, s)| (t, s))
            .unwrap_or_default()
    }

    /// Whether the GPU has anything running or waiting.
    pub fn has_work(&self) -> bool {
        self.running.is_some() || self.engine.has_work()
    }

    /// What the server's `/metrics` would say now.
    pub fn stats(&self) -> EngineStats {
        self.engine.stats()
    }

    /// KV capacity in tokens (what the agent reports from the server's cache config).
    pub fn capacity_tokens(&self) -> u64 {
        self.engine.params().capacity_tokens()
    }
}
