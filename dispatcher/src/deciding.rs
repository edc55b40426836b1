//! The deciding loop: the async shell around the [`Engine`] state machine. It feeds the
//! engine its inputs with the time they are applied at (events from the term's tasks, the
//! periodic tick), asks it to look at the waiting jobs after every batch, and performs the
//! effects the engine returns: outcomes go to the [`Publisher`], acknowledgements to
//! JetStream, off the loop.
//!
//! Invariants: the engine reads no clock and does no I/O, so everything that decides is
//! in [`crate::engine`] and can be driven by a test or the policy lab in simulated time;
//! this loop stops the term once the lease is stale, before another decision is made.

use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use async_nats::jetstream::AckKind;
use metronome_protocol::time::unix_ms;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::{Effect, Engine};
use crate::event::Event;
use crate::publish::Publisher;

/// Inputs applied before the queues are looked at again: bounded so the tick still runs
/// under sustained load.
const BATCH: usize = 4096;

/// Run `engine` until `token` is cancelled, the input channel closes or the lease goes
/// stale (then `token` is cancelled for the rest of the term).
pub async fn run(
    mut engine: Engine,
    publisher: Publisher,
    tick: std::time::Duration,
    mut rx: mpsc::Receiver<Event>,
    token: CancellationToken,
) {
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = token.cancelled() => break,
            // Back-pressure: no new input while the publisher is behind.
            event = async { publisher.ready().await; rx.recv().await } => {
                let Some(event) = event else { break };
                engine.handle(event, unix_ms());
                // Apply what is already queued before re-evaluating.
                for _ in 0..BATCH {
                    match rx.try_recv() {
                        Ok(event) => engine.handle(event, unix_ms()),
                        Err(_) => break,
                    }
                }
            }
            _ = ticks.tick() => engine.tick(unix_ms()),
        }
        if !engine.is_fresh() {
            tracing::error!("lease is stale: no more decisions in this term");
            perform(engine.take_effects(), &publisher);
            token.cancel();
            break;
        }
        engine.dispatch_if_changed(unix_ms());
        perform(engine.take_effects(), &publisher);
    }
    engine.finish();
    perform(engine.take_effects(), &publisher);
}

/// Hand each effect to whoever carries it out, in order.
pub fn perform(effects: Vec<Effect>, publisher: &Publisher) {
    for effect in effects {
        match effect {
            Effect::Publish(outcome) => publisher.send(outcome),
            Effect::Ack(acker) => ack_later(acker),
            Effect::Progress(ackers) => progress_later(ackers),
        }
    }
}

/// Acknowledge a message off the deciding loop.
fn ack_later(acker: Arc<Acker>) {
    tokio::spawn(async move {
        if let Err(error) = acker.ack().await {
            tracing::warn!(%error, "acknowledging a message failed");
        }
    });
}

/// Extend waiting jobs' ack waits off the deciding loop.
fn progress_later(ackers: Vec<Arc<Acker>>) {
    tokio::spawn(async move {
        for acker in ackers {
            let _ = acker.ack_with(AckKind::Progress).await;
        }
    });
}
