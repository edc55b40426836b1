//! The workers' prefix-cache reports, read from their streams into the engine
//! ([`Event::Cache`]).
//!
//! Two ordered consumers, created per term: `CACHE_SNAPSHOTS` from the last snapshot of
//! every worker (`DeliverPolicy::LastPerSubject`), `CACHE_DELTAS` from its first retained
//! delta. At takeover [`CacheFeed::backlog`] reads what both hold before the term decides
//! anything, so a new leader's first decisions already see every reporting worker's
//! cache; then [`CacheFeed::spawn`] follows them live. The engine orders what it gets by
//! run and sequence ([`metronome_scheduler::ReportedCaches`]), so reading a message twice
//! (a consumer recreated after an error) changes nothing.
//!
//! A message is believed only for the worker its subject names (only that worker may
//! publish there); one whose body names another worker, or that is malformed, is dropped
//! and counted.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use metronome_protocol::names::{
    cache_subject_worker, STREAM_CACHE_DELTAS, STREAM_CACHE_SNAPSHOTS, SUBJECT_CACHE_DELTAS_ALL,
    SUBJECT_CACHE_SNAPSHOTS_ALL,
};
use metronome_protocol::CacheUpdate;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::engine::Event;
use crate::metrics::Metrics;

/// How long a consumer that failed waits before it is created again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The two consumers' message streams.
pub struct CacheFeed {
    snapshots: consumer::pull::Ordered,
    deltas: consumer::pull::Ordered,
    /// Messages each still had to deliver when it was created (what the backlog reads).
    pending: (u64, u64),
}

async fn ordered(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
    policy: consumer::DeliverPolicy,
) -> Result<(consumer::pull::Ordered, u64), String> {
    let s = js
        .get_stream_no_info(stream)
        .await
        .map_err(|e| format!("{stream}: {e}"))?;
    let c = s
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: filter.to_string(),
            deliver_policy: policy,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("{stream}: {e}"))?;
    let pending = c.cached_info().num_pending;
    let messages = c.messages().await.map_err(|e| format!("{stream}: {e}"))?;
    Ok((messages, pending))
}

/// A report from one stored message, or `None` (dropped and counted) when its subject and
/// body disagree or it is not a valid report.
fn decode(message: &jetstream::Message, metrics: &Metrics) -> Option<CacheUpdate> {
    let subject_worker = cache_subject_worker(message.subject.as_str());
    let update = serde_json::from_slice::<CacheUpdate>(&message.payload)
        .ok()
        .filter(|u| u.validate().is_ok() && Some(u.worker_id.as_str()) == subject_worker);
    if update.is_none() {
        metrics.cache_updates_ignored_total.fetch_add(1, Relaxed);
        tracing::debug!(subject = %message.subject, "cache report dropped: malformed or naming another worker");
    }
    update
}

impl CacheFeed {
    /// Create both consumers: the latest snapshot of every worker, every retained delta.
    pub async fn open(js: &jetstream::Context) -> Result<CacheFeed, String> {
        let (snapshots, s) = ordered(
            js,
            STREAM_CACHE_SNAPSHOTS,
            SUBJECT_CACHE_SNAPSHOTS_ALL,
            consumer::DeliverPolicy::LastPerSubject,
        )
        .await?;
        let (deltas, d) = ordered(
            js,
            STREAM_CACHE_DELTAS,
            SUBJECT_CACHE_DELTAS_ALL,
            consumer::DeliverPolicy::All,
        )
        .await?;
        Ok(CacheFeed {
            snapshots,
            deltas,
            pending: (s, d),
        })
    }

    /// What both streams held when the consumers were created (snapshots first), read
    /// within `within`: a takeover applies these before it decides anything.
    pub async fn backlog(&mut self, within: Duration, metrics: &Metrics) -> Vec<CacheUpdate> {
        let deadline = tokio::time::Instant::now() + within;
        let mut out = Vec::new();
        for (messages, pending) in [
            (&mut self.snapshots, self.pending.0),
            (&mut self.deltas, self.pending.1),
        ] {
            let mut read = 0;
            while read < pending {
                let next = tokio::time::timeout_at(deadline, messages.next()).await;
                let Ok(Some(Ok(m))) = next else {
                    break;
                };
                read += 1;
                out.extend(decode(&m, metrics));
                if m.info().map(|i| i.pending).unwrap_or(0) == 0 {
                    break;
                }
            }
        }
        out
    }

    /// Follow both streams until `term` ends, each report to the engine. A consumer that
    /// fails is created again (from the start: the engine ignores what it already has).
    pub fn spawn(
        mut self,
        js: jetstream::Context,
        tx: mpsc::Sender<Event>,
        metrics: Arc<Metrics>,
        term: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    _ = term.cancelled() => return,
                    m = self.snapshots.next() => m,
                    m = self.deltas.next() => m,
                };
                match next {
                    Some(Ok(m)) => {
                        if let Some(update) = decode(&m, &metrics) {
                            if tx.send(Event::Cache(Box::new(update))).await.is_err() {
                                return;
                            }
                        }
                    }
                    failed => {
                        tracing::warn!(error = ?failed.and_then(|r| r.err()), "reading the workers' cache reports failed: reading them again");
                        loop {
                            tokio::select! {
                                _ = term.cancelled() => return,
                                _ = tokio::time::sleep(RETRY_AFTER) => {}
                            }
                            match CacheFeed::open(&js).await {
                                Ok(feed) => {
                                    self = feed;
                                    break;
                                }
                                Err(e) => tracing::warn!(error = %e, "cache report streams"),
                            }
                        }
                    }
                }
            }
        })
    }
}
