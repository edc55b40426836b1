//! Leadership: one dispatcher decides at a time, holding a lease in the `leader` KV bucket.
//!
//! Candidates race to `create` the lease key; the winner's creation revision is its
//! *epoch* (stream sequences only grow, so a later leader always has a higher epoch). The
//! leader renews with a compare-and-set `update(key, value, last_revision)` well inside
//! the TTL. Invariant (self-fencing): the leader stops deciding as soon as its last
//! successful renewal is older than `fence_after_ms`, which is shorter than the TTL, so
//! it has stopped before the key can expire and a standby can create it again. A
//! renewal that finds another revision means the lease is gone: stop at once. Standbys
//! poll `create`, which succeeds only once the key has expired or been deleted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use bytes::Bytes;
use metronome_protocol::names::LEADER_KEY;
use tokio_util::sync::CancellationToken;

/// The epoch of a term whose lease was created at `revision`, given the highest epoch on
/// record (`workers_max`: the latest decision's, [`crate::epoch_history`]; never a worker's
/// claim). Normally the revision: revisions only grow, so it is above every earlier term's.
/// But a rebuilt `leader` bucket (memory storage after a restart, an operator's delete)
/// starts its revisions again, and agents refuse work of an epoch below one they have
/// seen: then the epoch is lifted above the record, by the revision, so later terms on the
/// new bucket keep growing.
pub fn term_epoch(revision: u64, workers_max: u64) -> u64 {
    if revision > workers_max {
        revision
    } else {
        workers_max.saturating_add(revision.max(1))
    }
}

pub use metronome_protocol::LeaseValue;

/// The term's epoch as the lease records it ([`LeaseValue::epoch`]): set once the term
/// knows it (after reading the workers' highest epochs), written by the renewer at once,
/// so agents can check an epoch they have not seen before against the lease
/// (`metronome_protocol::lease`).
#[derive(Debug, Default)]
pub struct EpochRecord {
    epoch: AtomicU64,
    changed: tokio::sync::Notify,
}

impl EpochRecord {
    /// Record `epoch` in the lease (renewed at once).
    pub fn set(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::SeqCst);
        self.changed.notify_one();
    }

    fn get(&self) -> Option<u64> {
        Some(self.epoch.load(Ordering::SeqCst)).filter(|e| *e > 0)
    }
}

/// Timing of the lease.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTiming {
    pub renew: Duration,
    pub fence_after: Duration,
    pub standby_poll: Duration,
}

/// Freshness of the lease as seen by the deciding loop: a cheap check before every
/// decision, so a leader that lost contact stops even between renewal attempts.
#[derive(Debug)]
pub struct Fence {
    base: Instant,
    last_renewed_ms: AtomicU64,
    fence_after_ms: u64,
}

impl Fence {
    fn new(fence_after: Duration) -> Arc<Fence> {
        Arc::new(Fence {
            base: Instant::now(),
            last_renewed_ms: AtomicU64::new(0),
            fence_after_ms: fence_after.as_millis() as u64,
        })
    }

    fn mark_renewed(&self) {
        self.last_renewed_ms
            .store(self.base.elapsed().as_millis() as u64, Ordering::Release);
    }

    /// True while the last successful renewal is recent enough to keep deciding.
    pub fn is_fresh(&self) -> bool {
        let now = self.base.elapsed().as_millis() as u64;
        now.saturating_sub(self.last_renewed_ms.load(Ordering::Acquire)) < self.fence_after_ms
    }
}

/// A held lease. `lost` is cancelled when the lease is gone or fenced; the holder must
/// stop deciding then.
pub struct Leadership {
    pub epoch: u64,
    pub fence: Arc<Fence>,
    pub lost: CancellationToken,
    /// What the lease says the term's epoch is.
    pub record: Arc<EpochRecord>,
    renewer: tokio::task::JoinHandle<Option<u64>>,
}

impl Leadership {
    /// Give the lease up (graceful shutdown): delete the key if it is still ours, so a
    /// standby takes over at once instead of waiting for the TTL.
    pub async fn resign(self, kv: &kv::Store) {
        self.lost.cancel();
        if let Ok(Some(revision)) = self.renewer.await {
            if let Err(error) = kv.delete_expect_revision(LEADER_KEY, Some(revision)).await {
                tracing::warn!(%error, "could not delete the lease on resign");
            }
        }
    }
}

/// Wait until this instance holds the lease (or `shutdown`): `None` on shutdown.
pub async fn acquire(
    kv: &kv::Store,
    dispatcher_id: &str,
    timing: LeaseTiming,
    shutdown: &CancellationToken,
) -> Option<Leadership> {
    let mut logged_standby = false;
    loop {
        // A lease that someone holds is seen with a read (a direct get, answered by any
        // copy) before a create is proposed: a standby's create that fails is a failed
        // proposal on the lease stream, four a second per standby, and on nats-server 2.9
        // a stream that had many of them took no write for about a minute after its
        // leader's node was lost (the drill kill-nats-leader). The create still decides.
        if let Ok(Some(entry)) = kv.entry(LEADER_KEY).await {
            if entry.operation == kv::Operation::Put {
                if !logged_standby {
                    tracing::info!(dispatcher_id, "another dispatcher leads; standing by");
                    logged_standby = true;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(timing.standby_poll) => {}
                }
                continue;
            }
        }
        let now = metronome_protocol::time::unix_ms();
        let value = lease_bytes(dispatcher_id, now, now, None);
        match kv.create(LEADER_KEY, value).await {
            Ok(revision) => {
                let fence = Fence::new(timing.fence_after);
                fence.mark_renewed();
                let lost = CancellationToken::new();
                let record = Arc::new(EpochRecord::default());
                let renewer = tokio::spawn(renew_loop(
                    kv.clone(),
                    dispatcher_id.to_string(),
                    now,
                    revision,
                    timing,
                    fence.clone(),
                    lost.clone(),
                    shutdown.clone(),
                    record.clone(),
                ));
                tracing::info!(epoch = revision, dispatcher_id, "acquired the leader lease");
                return Some(Leadership {
                    epoch: revision,
                    fence,
                    lost,
                    record,
                    renewer,
                });
            }
            Err(error) if error.kind() == kv::CreateErrorKind::AlreadyExists => {
                if !logged_standby {
                    tracing::info!(dispatcher_id, "another dispatcher leads; standing by");
                    logged_standby = true;
                }
            }
            Err(error) => tracing::warn!(%error, "could not try the leader lease"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(timing.standby_poll) => {}
        }
    }
}

/// Renew until the lease is lost, fenced or `shutdown`. Returns the last revision when
/// the lease was still ours at the end (so `resign` can delete it).
#[allow(clippy::too_many_arguments)]
async fn renew_loop(
    kv: kv::Store,
    dispatcher_id: String,
    acquired_ms: u64,
    mut revision: u64,
    timing: LeaseTiming,
    fence: Arc<Fence>,
    lost: CancellationToken,
    shutdown: CancellationToken,
    record: Arc<EpochRecord>,
) -> Option<u64> {
    let mut interval = tokio::time::interval(timing.renew);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    loop {
        tokio::select! {
            _ = lost.cancelled() => return Some(revision),
            _ = shutdown.cancelled() => return Some(revision),
            _ = interval.tick() => {}
            // The term's epoch became known: record it in the lease now, not a renewal
            // interval later (until then agents bound new epochs by the revision).
            _ = record.changed.notified() => {}
        }
        if !fence.is_fresh() {
            tracing::error!(
                epoch_revision = revision,
                "lease not renewed in time: fencing (no more decisions)"
            );
            lost.cancel();
            return None;
        }
        let value = lease_bytes(
            &dispatcher_id,
            acquired_ms,
            metronome_protocol::time::unix_ms(),
            record.get(),
        );
        let attempt =
            tokio::time::timeout(timing.renew, kv.update(LEADER_KEY, value, revision)).await;
        match attempt {
            Ok(Ok(next)) => {
                revision = next;
                fence.mark_renewed();
            }
            Ok(Err(error)) if error.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // An earlier renewal whose answer timed out may have been stored: then the
                // key holds this term's own value at a later revision, and the lease is
                // still ours (found by the hostile drill: under load the leader deposed
                // itself). Only this term writes its value (its id and acquisition time).
                match kv.entry(LEADER_KEY).await {
                    Ok(Some(entry))
                        if entry.operation == kv::Operation::Put
                            && is_this_term(&entry.value, &dispatcher_id, acquired_ms) =>
                    {
                        tracing::warn!(
                            revision = entry.revision,
                            "an earlier renewal was stored after its answer timed out: still leading"
                        );
                        revision = entry.revision;
                        continue;
                    }
                    _ => {
                        tracing::error!(%error, "the lease changed hands: stepping down");
                        lost.cancel();
                        return None;
                    }
                }
            }
            Ok(Err(error)) => tracing::warn!(%error, "lease renewal failed; will retry"),
            Err(_) => tracing::warn!("lease renewal timed out; will retry"),
        }
        if !fence.is_fresh() {
            tracing::error!("lease not renewed in time: fencing (no more decisions)");
            lost.cancel();
            return None;
        }
    }
}

/// Whether a lease value was written by the term of `dispatcher_id` that acquired the
/// lease at `acquired_ms`.
fn is_this_term(value: &[u8], dispatcher_id: &str, acquired_ms: u64) -> bool {
    serde_json::from_slice::<LeaseValue>(value)
        .is_ok_and(|v| v.dispatcher_id == dispatcher_id && v.acquired_ms == acquired_ms)
}

fn lease_bytes(
    dispatcher_id: &str,
    acquired_ms: u64,
    renewed_ms: u64,
    epoch: Option<u64>,
) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&LeaseValue {
            dispatcher_id: dispatcher_id.to_string(),
            acquired_ms,
            renewed_ms,
            epoch,
        })
        .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_terms_own_value_counts_as_still_ours() {
        let v = lease_bytes("a", 10, 99, Some(3));
        assert!(is_this_term(&v, "a", 10));
        assert!(
            !is_this_term(&v, "a", 11),
            "a later term of the same dispatcher"
        );
        assert!(!is_this_term(&v, "b", 10));
        assert!(!is_this_term(b"garbage", "a", 10));
    }

    #[test]
    fn the_epoch_is_the_revision_unless_workers_have_seen_higher() {
        assert_eq!(term_epoch(42, 41), 42);
        assert_eq!(term_epoch(42, 0), 42);
        // A rebuilt bucket: revisions restart below what agents hold.
        assert_eq!(term_epoch(1, 500), 501);
        assert!(
            term_epoch(2, 501) > 501,
            "the next term on the new bucket is higher still"
        );
        assert!(
            term_epoch(2, 500) > term_epoch(1, 500),
            "also when no agent saw the last term"
        );
    }
}
