//! API keys managed live: a watch on the `api_keys` bucket (what `metronome keys
//! create|revoke` writes), so a new key is served and a revoked one refused as soon as
//! the change reaches this gateway, without a restart.
//!
//! The watch replays every stored record, then follows changes; after each one the whole
//! set of valid records is handed to [`Auth::set_live_keys`]. A record that does not parse
//! or check ([`KeyRecord::check`]) is left out, logged and counted, never fatal; a deleted
//! or purged record is forgotten. The watch is re-established after any error. When a
//! re-watch replays the bucket, a record deleted meanwhile does not come back: the set is
//! rebuilt from the replay.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use metronome_protocol::api_keys::KeyRecord;
use tokio_util::sync::CancellationToken;

use crate::auth::Auth;
use crate::metrics::Metrics;

/// Apply one entry of the watch to `records`.
fn apply_entry(records: &mut BTreeMap<String, KeyRecord>, entry: &kv::Entry, metrics: &Metrics) {
    match entry.operation {
        kv::Operation::Put => {
            let record = serde_json::from_slice::<KeyRecord>(&entry.value)
                .map_err(|e| e.to_string())
                .and_then(|r| r.check(&entry.key).map(|()| r));
            match record {
                Ok(r) => {
                    records.insert(entry.key.clone(), r);
                }
                Err(reason) => {
                    records.remove(&entry.key);
                    metrics.malformed_message("api_keys_bucket");
                    tracing::warn!(
                        revision = entry.revision,
                        %reason,
                        "ignoring a key record in the api_keys bucket"
                    );
                }
            }
        }
        kv::Operation::Delete | kv::Operation::Purge => {
            records.remove(&entry.key);
        }
    }
}

/// Follow the `api_keys` bucket until `shutdown`, keeping `auth`'s live keys current.
pub fn spawn_watcher(
    store: kv::Store,
    auth: Arc<Auth>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match store.watch_with_history(">").await {
                Ok(mut watch) => {
                    // Rebuilt from the replay: a record deleted while not watching is gone.
                    let mut records = BTreeMap::new();
                    let mut replayed = false;
                    loop {
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            item = watch.next() => match item {
                                Some(Ok(entry)) => {
                                    apply_entry(&mut records, &entry, &metrics);
                                    // During the replay, apply once it is complete (the
                                    // last replayed entry has `delta` 0), not per record.
                                    if replayed || entry.delta == 0 {
                                        replayed = true;
                                        auth.set_live_keys(records.values());
                                        tracing::debug!(keys = records.len(), "live API keys updated");
                                    }
                                }
                                Some(Err(error)) => {
                                    tracing::warn!(%error, "api_keys bucket watch failed; watching again");
                                    break;
                                }
                                None => {
                                    tracing::warn!("api_keys bucket watch ended; watching again");
                                    break;
                                }
                            }
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot watch the api_keys bucket; retrying");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    })
}
