//! API keys managed live: a watch on the `api_keys` bucket (what `metronome keys
//! create|revoke` writes), so a new key is served and a revoked one refused as soon as
//! the change reaches this gateway, without a restart.
//!
//! The watch replays every stored record, then follows changes; after each one the whole
//! set of valid records, and of revocations by id (`revoked.<id>`, which revoke keys of the
//! configuration file), is handed to [`Auth::set_live_keys`]. A record that does not parse
//! or check ([`KeyRecord::check`], [`Revocation::check`]) is left out, logged and counted,
//! never fatal; a deleted or purged record is forgotten.
//!
//! The bucket is opened by the watch, not at start-up: a gateway may not create streams,
//! so one started before any dispatcher of a version that creates the bucket serves its
//! configuration file's keys alone, and watches the bucket from the moment it exists. The
//! order in which dispatchers and gateways are upgraded does not matter. The watch is re-established after any error. When a
//! re-watch replays the bucket, a record deleted meanwhile does not come back: the set is
//! rebuilt from the replay.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use metronome_protocol::api_keys::{KeyRecord, Revocation, REVOCATION_PREFIX};
use metronome_protocol::names::BUCKET_API_KEYS;
use tokio_util::sync::CancellationToken;

use crate::auth::Auth;
use crate::metrics::Metrics;

/// The bucket as last seen: key records and revocations by id, by bucket key.
#[derive(Default)]
struct Seen {
    records: BTreeMap<String, KeyRecord>,
    revocations: BTreeMap<String, Revocation>,
}

impl Seen {
    fn put(&mut self, key: &str, value: &[u8]) -> Result<(), String> {
        if key.starts_with(REVOCATION_PREFIX) {
            let r = serde_json::from_slice::<Revocation>(value).map_err(|e| e.to_string())?;
            r.check(key)?;
            self.revocations.insert(key.to_string(), r);
        } else {
            let r = serde_json::from_slice::<KeyRecord>(value).map_err(|e| e.to_string())?;
            r.check(key)?;
            self.records.insert(key.to_string(), r);
        }
        Ok(())
    }

    fn remove(&mut self, key: &str) {
        self.records.remove(key);
        self.revocations.remove(key);
    }

    fn hand_to(&self, auth: &Auth) {
        let revocations: Vec<Revocation> = self.revocations.values().cloned().collect();
        auth.set_live_keys(self.records.values(), &revocations);
    }
}

/// Apply one entry of the watch to `seen`.
fn apply_entry(seen: &mut Seen, entry: &kv::Entry, metrics: &Metrics) {
    match entry.operation {
        kv::Operation::Put => {
            seen.remove(&entry.key);
            if let Err(reason) = seen.put(&entry.key, &entry.value) {
                metrics.malformed_message("api_keys_bucket");
                tracing::warn!(
                    revision = entry.revision,
                    %reason,
                    "ignoring a key record in the api_keys bucket"
                );
            }
        }
        kv::Operation::Delete | kv::Operation::Purge => seen.remove(&entry.key),
    }
}

/// Follow the `api_keys` bucket until `shutdown`, keeping `auth`'s live keys current.
pub fn spawn_watcher(
    js: jetstream::Context,
    auth: Arc<Auth>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut missing_since_start = false;
        loop {
            let store = match js.get_key_value(BUCKET_API_KEYS).await {
                Ok(store) => store,
                Err(error) => {
                    // Said once, not every half second while it lasts.
                    if !missing_since_start {
                        tracing::warn!(%error, "cannot open the api_keys bucket: serving the configuration file's keys only until it exists (a dispatcher creates it)");
                        missing_since_start = true;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                    continue;
                }
            };
            if missing_since_start {
                tracing::info!("the api_keys bucket exists now: serving its keys");
                missing_since_start = false;
            }
            match store.watch_with_history(">").await {
                Ok(mut watch) => {
                    // Rebuilt from the replay: a record deleted while not watching is gone.
                    let mut seen = Seen::default();
                    let mut replayed = false;
                    loop {
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            item = watch.next() => match item {
                                Some(Ok(entry)) => {
                                    apply_entry(&mut seen, &entry, &metrics);
                                    // During the replay, apply once it is complete (the
                                    // last replayed entry has `delta` 0), not per record.
                                    if replayed || entry.delta == 0 {
                                        replayed = true;
                                        seen.hand_to(&auth);
                                        tracing::debug!(keys = seen.records.len(), revocations = seen.revocations.len(), "live API keys updated");
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
