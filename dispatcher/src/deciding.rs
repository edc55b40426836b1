//! The deciding loop: the async shell around the [`Engine`] state machine. It feeds the
//! engine its inputs with the time they are applied at (events from the term's tasks, the
//! periodic tick), asks it to look at the waiting jobs after every batch, and performs the
//! effects the engine returns: outcomes go to the [`Publisher`], acknowledgements to
//! JetStream, off the loop, fair-share counters and queue snapshots to their writers
//! ([`Writers`]).
//!
//! Invariants: the engine reads no clock and does no I/O, so everything that decides is
//! in [`crate::engine`] and can be driven by a test or the policy lab in simulated time;
//! this loop stops the term once the lease is stale, before another decision is made.

use std::sync::Arc;

use async_nats::jetstream::message::Acker;
use async_nats::jetstream::AckKind;
use metronome_protocol::time::unix_ms;
use metronome_protocol::QueueSnapshot;
use metronome_scheduler::FairnessSnapshot;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::engine::{Effect, Engine, Event};
use crate::publish::Publisher;

/// Inputs applied before the queues are looked at again: bounded so the tick still runs
/// under sustained load.
const BATCH: usize = 4096;

/// Where the engine's snapshots go: the writers of the fair-share counters
/// ([`crate::fairness_store`]) and of the queue snapshots ([`crate::queue_store`]) watch
/// these, and end once they are dropped (with the loop).
pub struct Writers {
    pub fairness: watch::Sender<FairnessSnapshot>,
    pub queues: watch::Sender<Vec<QueueSnapshot>>,
}

/// Run `engine` until `token` is cancelled, the input channel closes or the lease goes
/// stale (then `token` is cancelled for the rest of the term).
pub async fn run(
    mut engine: Engine,
    publisher: Publisher,
    writers: Writers,
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
            perform(engine.take_effects(), &publisher, &writers);
            token.cancel();
            break;
        }
        engine.dispatch_if_changed(unix_ms());
        perform(engine.take_effects(), &publisher, &writers);
    }
    engine.finish();
    perform(engine.take_effects(), &publisher, &writers);
}

/// Hand each effect to whoever carries it out, in order.
pub fn perform(effects: Vec<Effect>, publisher: &Publisher, writers: &Writers) {
    for effect in effects {
        match effect {
            Effect::Publish(outcome) => publisher.send(outcome),
            Effect::Ack(acker) => ack_later(acker),
            Effect::Progress(ackers) => progress_later(ackers),
            // The engine hands out only changed values; nobody listening (the writer
            // ended with its term) is no error.
            Effect::PersistFairness(snapshot) => {
                writers.fairness.send_replace(snapshot);
            }
            Effect::PublishQueues(snapshots) => {
                writers.queues.send_replace(snapshots);
            }
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
