//! `metronome keys create|list|revoke`: API keys in the `api_keys` bucket, which every
//! gateway watches ([`metronome_protocol::api_keys`]), so a key created or revoked here is
//! served or refused within a second, without a restart.
//!
//! `create` prints the key once (only its SHA-256 is stored); `revoke` marks the record
//! revoked (kept, so `list` still says whose it was); `list` shows every record, and with a
//! gateway's URL each tenant's requests and admitted tokens from that gateway's `/metrics`
//! (one gateway's counts since it started: the usage it knows). Keys in a gateway's
//! configuration file are not listed here, as the bucket does not know them; `revoke` of an
//! id the bucket has no record of stores a revocation of that id
//! ([`metronome_protocol::api_keys::Revocation`]), which every gateway applies to the keys
//! of its configuration file, and `list` shows it.

use async_nats::jetstream::kv;
use futures::StreamExt;
use metronome_protocol::api_keys::{
    generate_key, is_key_id, is_sha256_hex, key_sha256, KeyRecord, Revocation, KEY_ID_HEX,
    KEY_RECORD_VERSION, REVOCATION_PREFIX,
};
use metronome_protocol::names::BUCKET_API_KEYS;
use metronome_protocol::{check_tenant, prometheus, time::unix_ms, Priority};
use serde::Serialize;

use crate::CliError;
use metronome_readmodel::source::Nats;

/// A tenant's usage as one gateway counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Usage {
    pub requests: f64,
    pub admitted_tokens: f64,
}

/// One row of `keys list`.
#[derive(Debug, Clone, Serialize)]
pub struct KeyRow {
    pub id: String,
    #[serde(flatten)]
    pub record: KeyRecord,
    /// The tenant's usage at the gateway asked, when one was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A key just created: the key itself (shown once) and its record.
#[derive(Debug, Clone, Serialize)]
pub struct Created {
    pub key: String,
    pub id: String,
    pub tenant: String,
}

async fn bucket(nats: &Nats) -> Result<kv::Store, CliError> {
    nats.js.get_key_value(BUCKET_API_KEYS).await.map_err(|e| {
        CliError::Nats(format!(
            "bucket {BUCKET_API_KEYS}: {e} (start a gateway or dispatcher once: they create it)"
        ))
    })
}

/// Create a key for `tenant` and store its record.
pub async fn create(
    nats: &Nats,
    tenant: &str,
    note: Option<String>,
    operator: bool,
    priority: Option<Priority>,
) -> Result<Created, CliError> {
    check_tenant(tenant).map_err(|e| CliError::Usage(e.to_string()))?;
    let key = generate_key().map_err(CliError::Usage)?;
    let sha256 = key_sha256(&key);
    let record = KeyRecord {
        v: KEY_RECORD_VERSION,
        tenant: tenant.to_string(),
        sha256: sha256.clone(),
        note,
        revoked: false,
        operator,
        priority,
        created_ms: unix_ms(),
        revoked_ms: None,
    };
    let body = serde_json::to_vec(&record).map_err(|e| CliError::Usage(e.to_string()))?;
    bucket(nats)
        .await?
        .create(&sha256, body.into())
        .await
        .map_err(|e| CliError::Nats(format!("storing the key: {e}")))?;
    Ok(Created {
        id: record.id().to_string(),
        key,
        tenant: tenant.to_string(),
    })
}

/// Every stored value whose bucket key `wanted` accepts, with its key.
async fn entries(
    nats: &Nats,
    wanted: impl Fn(&str) -> bool,
) -> Result<Vec<(String, bytes::Bytes)>, CliError> {
    let store = bucket(nats).await?;
    let mut keys = store
        .keys()
        .await
        .map_err(|e| CliError::Nats(format!("listing keys: {e}")))?;
    let mut out = Vec::new();
    while let Some(key) = keys.next().await {
        let key = key.map_err(|e| CliError::Nats(format!("listing keys: {e}")))?;
        if !wanted(&key) {
            continue;
        }
        if let Some(value) = store
            .get(&key)
            .await
            .map_err(|e| CliError::Nats(format!("reading key {key}: {e}")))?
        {
            out.push((key, value));
        }
    }
    Ok(out)
}

fn malformed() {
    eprintln!("metronome: skipping a malformed record in the {BUCKET_API_KEYS} bucket");
}

/// Every key record, by tenant then id.
pub async fn records(nats: &Nats) -> Result<Vec<KeyRecord>, CliError> {
    let mut out = Vec::new();
    for (key, value) in entries(nats, |k| !k.starts_with(REVOCATION_PREFIX)).await? {
        match serde_json::from_slice::<KeyRecord>(&value) {
            Ok(r) if r.check(&key).is_ok() => out.push(r),
            _ => malformed(),
        }
    }
    out.sort_by(|a, b| (&a.tenant, a.id()).cmp(&(&b.tenant, b.id())));
    Ok(out)
}

/// Every revocation by id (of keys in gateways' configuration files), by id.
pub async fn revocations(nats: &Nats) -> Result<Vec<Revocation>, CliError> {
    let mut out = Vec::new();
    for (key, value) in entries(nats, |k| k.starts_with(REVOCATION_PREFIX)).await? {
        match serde_json::from_slice::<Revocation>(&value) {
            Ok(r) if r.check(&key).is_ok() => out.push(r),
            _ => malformed(),
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// What `revoke` revoked.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Revoked {
    /// A key of the bucket: its record, now revoked.
    Record(KeyRecord),
    /// An id the bucket has no record of: the revocation stored for the gateways'
    /// configuration files.
    Configured(Revocation),
}

/// Revoke the key whose id (at least [`KEY_ID_HEX`] hex digits of its hash) or whole hash
/// is `id`: its record when the bucket has one; otherwise a [`Revocation`] of the id, which
/// every gateway applies to its configuration file's keys. A usage error when several
/// records match.
pub async fn revoke(nats: &Nats, id: &str) -> Result<Revoked, CliError> {
    let id = id.trim().to_ascii_lowercase();
    if !is_key_id(&id) {
        return Err(CliError::Usage(format!(
            "{id:?} is not a key id: give {KEY_ID_HEX} to 64 hex digits of its hash, as `metronome keys list` or a gateway's log shows"
        )));
    }
    let matching: Vec<KeyRecord> = records(nats)
        .await?
        .into_iter()
        .filter(|r| r.sha256.starts_with(&id))
        .collect();
    let mut record = match matching.as_slice() {
        [one] => one.clone(),
        [] => return revoke_configured(nats, id).await.map(Revoked::Configured),
        _ => {
            return Err(CliError::Usage(format!(
                "{} keys start with {id}: give more of the hash",
                matching.len()
            )))
        }
    };
    debug_assert!(is_sha256_hex(&record.sha256));
    if !record.revoked {
        record.revoked = true;
        record.revoked_ms = Some(unix_ms());
        let body = serde_json::to_vec(&record).map_err(|e| CliError::Usage(e.to_string()))?;
        bucket(nats)
            .await?
            .put(&record.sha256, body.into())
            .await
            .map_err(|e| CliError::Nats(format!("storing the revocation: {e}")))?;
    }
    Ok(Revoked::Record(record))
}

/// Store the revocation of `id` (already checked), or return the one stored before.
async fn revoke_configured(nats: &Nats, id: String) -> Result<Revocation, CliError> {
    if let Some(earlier) = revocations(nats).await?.into_iter().find(|r| r.id == id) {
        return Ok(earlier);
    }
    let revocation = Revocation {
        v: KEY_RECORD_VERSION,
        revoked_ms: unix_ms(),
        id,
    };
    let body = serde_json::to_vec(&revocation).map_err(|e| CliError::Usage(e.to_string()))?;
    bucket(nats)
        .await?
        .put(Revocation::bucket_key(&revocation.id), body.into())
        .await
        .map_err(|e| CliError::Nats(format!("storing the revocation: {e}")))?;
    Ok(revocation)
}

/// Each tenant's usage in a gateway's `/metrics` text.
pub fn usage_of(metrics: &str, tenant: &str) -> Usage {
    let get = |name: &str| prometheus::value(metrics, name, &[("tenant", tenant)]).unwrap_or(0.0);
    Usage {
        requests: get("metronome_gateway_tenant_requests_total"),
        admitted_tokens: get("metronome_gateway_tenant_admitted_tokens_total"),
    }
}

/// The rows of `list`, with usage from `metrics` when given.
pub fn rows(records: Vec<KeyRecord>, metrics: Option<&str>) -> Vec<KeyRow> {
    records
        .into_iter()
        .map(|record| KeyRow {
            id: record.id().to_string(),
            usage: metrics.map(|m| usage_of(m, &record.tenant)),
            record,
        })
        .collect()
}

/// The revocations of configuration-file keys, after `list`'s table.
pub fn revocations_table(revocations: &[Revocation]) -> String {
    if revocations.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nrevoked keys of gateways' configuration files:\n");
    for r in revocations {
        out.push_str(&format!("{:<13} revoked\n", r.id));
    }
    out
}

/// `list` as a table.
pub fn table(rows: &[KeyRow]) -> String {
    if rows.is_empty() {
        return format!("no keys in the {BUCKET_API_KEYS} bucket\n");
    }
    let with_usage = rows.iter().any(|r| r.usage.is_some());
    let mut out = format!(
        "{:<13} {:<20} {:<8} {:<9} {:<11}",
        "ID", "TENANT", "STATE", "OPERATOR", "PRIORITY"
    );
    if with_usage {
        out.push_str(&format!(" {:>9} {:>12}", "REQUESTS", "TOKENS"));
    }
    out.push_str(" NOTE\n");
    for r in rows {
        let state = if r.record.revoked {
            "revoked"
        } else {
            "active"
        };
        let priority = r.record.priority.unwrap_or(Priority::Interactive);
        out.push_str(&format!(
            "{:<13} {:<20} {:<8} {:<9} {:<11}",
            r.id,
            r.record.tenant,
            state,
            if r.record.operator { "yes" } else { "no" },
            priority.as_str()
        ));
        if with_usage {
            let u = r.usage.unwrap_or_default();
            out.push_str(&format!(" {:>9} {:>12}", u.requests, u.admitted_tokens));
        }
        out.push(' ');
        out.push_str(r.record.note.as_deref().unwrap_or(""));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tenant: &str, revoked: bool) -> KeyRecord {
        KeyRecord {
            v: 1,
            tenant: tenant.into(),
            sha256: "0123456789ab".repeat(5) + "cdef",
            note: Some("ci".into()),
            revoked,
            operator: false,
            priority: None,
            created_ms: 1,
            revoked_ms: None,
        }
    }

    #[test]
    fn the_table_shows_state_and_the_gateways_usage() {
        let metrics = "metronome_gateway_tenant_requests_total{tenant=\"acme\"} 7\n\
                       metronome_gateway_tenant_admitted_tokens_total{tenant=\"acme\"} 1200\n";
        let rows = rows(
            vec![record("acme", false), record("zeta", true)],
            Some(metrics),
        );
        assert_eq!(
            rows[0].usage,
            Some(Usage {
                requests: 7.0,
                admitted_tokens: 1200.0
            })
        );
        assert_eq!(rows[1].usage, Some(Usage::default()));
        let t = table(&rows);
        assert!(t.contains("0123456789ab  acme"), "{t}");
        assert!(t.contains("revoked"), "{t}");
        assert!(t.contains("1200"), "{t}");
        assert!(!table(&super::rows(vec![record("acme", false)], None)).contains("REQUESTS"));
    }
}
