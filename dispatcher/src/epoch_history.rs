//! The highest epoch on record: what a new term's epoch must exceed besides its lease
//! revision, read from what only dispatchers write.
//!
//! A term's epoch is its lease's creation revision, lifted above every earlier epoch when
//! the `leader` bucket was rebuilt and its revisions start again (`leader::term_epoch`).
//! The earlier epochs used to come from the workers' heartbeats (`max_epoch`): one
//! heartbeat claiming 2^64-1 made the next leader's epoch 18446744073709551615, after
//! which no agent could tell a deposed leader's assignments from the current one's. The
//! record is now the DECISIONS stream, whose subjects only dispatchers may publish: every
//! assignment's decision carries its epoch, and the latest decision is the latest term's.
//! A worker's claim is never believed; one above the record is counted
//! (`epoch_claims_above_record_total`) and logged.
//!
//! Bounded by design: only the latest decision is read. What it misses (a deposed
//! leader's late decision stored after its successor's last one, in a bucket rebuilt at
//! the same time) at worst leaves agents refusing the new term's work until they restart.

use async_nats::jetstream;
use metronome_protocol::names::STREAM_DECISIONS;

/// The epoch of the latest decision on record (0: none).
pub async fn highest_on_record(js: &jetstream::Context) -> Result<u64, String> {
    #[derive(serde::Deserialize)]
    struct Epoch {
        #[serde(default)]
        epoch: u64,
    }
    let mut stream = js
        .get_stream(STREAM_DECISIONS)
        .await
        .map_err(|e| format!("DECISIONS: {e}"))?;
    let last = stream
        .info()
        .await
        .map_err(|e| format!("DECISIONS info: {e}"))?
        .state
        .last_sequence;
    if last == 0 {
        return Ok(0);
    }
    match stream.get_raw_message(last).await {
        Ok(m) => Ok(serde_json::from_slice::<Epoch>(&m.payload)
            .map(|d| d.epoch)
            .unwrap_or(0)),
        // Removed since (age limit, purge): nothing later is on record.
        Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => Ok(0),
        Err(e) => Err(format!("the latest decision: {e}")),
    }
}
