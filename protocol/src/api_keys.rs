//! API keys managed live: what `metronome keys create|revoke` writes to the `api_keys`
//! bucket ([`crate::names::BUCKET_API_KEYS`]) and every gateway watches, so a new key is
//! accepted and a revoked one refused within a second, without a restart.
//!
//! The bucket's key is the API key's SHA-256 in lower-case hex, its value a [`KeyRecord`].
//! A key is `mtk_` and 64 hex digits (32 bytes from the operating system's CSPRNG); only its
//! hash is stored anywhere (256 random bits cannot be guessed from their hash), and the key
//! itself is shown once, when created. A revoked key keeps its record (`revoked: true`), so
//! `metronome keys list` still shows who it was for; deleting the record forgets the key.
//!
//! Keys in a gateway's configuration file (`[[keys]]`) keep working beside these, and are
//! revoked live the same way: the bucket has no record of such a key, so `metronome keys
//! revoke <id>` stores a [`Revocation`] of its id under `revoked.<id>`, and every gateway
//! refuses a configured key whose hash starts with a revoked id (deleting the revocation
//! lets it in again).

use serde::{Deserialize, Serialize};

use crate::job::check_tenant;
use crate::Priority;

/// Prefix of every key: recognisable in a leaked-secret scan, and in a config file where
/// the key was pasted instead of its hash.
pub const KEY_PREFIX: &str = "mtk_";
/// Hex digits of the hash that make a key's public id (what logs and `keys list` show).
pub const KEY_ID_HEX: usize = 12;
/// Version of [`KeyRecord`].
pub const KEY_RECORD_VERSION: u32 = 1;

/// One key in the `api_keys` bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub v: u32,
    /// The tenant the key acts for (a tenant token, [`check_tenant`]). Its models and
    /// limits are the gateway's `[[tenants]]` entry of that name; a tenant without one may
    /// use every model, without limits.
    pub tenant: String,
    /// SHA-256 of the key, 64 lower-case hex digits (also the bucket key).
    pub sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default)]
    pub revoked: bool,
    /// May open the gateway's operator console.
    #[serde(default)]
    pub operator: bool,
    /// The highest priority class the key may ask for (interactive when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    pub created_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_ms: Option<u64>,
}

impl KeyRecord {
    /// The key's public id: the first [`KEY_ID_HEX`] hex digits of its hash.
    pub fn id(&self) -> &str {
        &self.sha256[..KEY_ID_HEX.min(self.sha256.len())]
    }

    /// Why the record cannot be served, if it cannot: a malformed hash or tenant, or a
    /// bucket key that is not its hash (a record stored under another key would let
    /// whoever reads keys misname it).
    pub fn check(&self, bucket_key: &str) -> Result<(), String> {
        if self.v != KEY_RECORD_VERSION {
            return Err(format!("unknown key record version {}", self.v));
        }
        if !is_sha256_hex(&self.sha256) {
            return Err("sha256 is not 64 lower-case hex digits".into());
        }
        if bucket_key != self.sha256 {
            return Err("stored under another key than its sha256".into());
        }
        check_tenant(&self.tenant).map_err(|e| e.to_string())
    }
}

/// Prefix of the bucket keys of [`Revocation`]s (`revoked.<id>`); a key record's bucket
/// key is a bare hash, so the two never meet.
pub const REVOCATION_PREFIX: &str = "revoked.";

/// A revocation by id, for a key the bucket holds no record of (one in a gateway's
/// configuration file): every key whose hash starts with `id` is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revocation {
    pub v: u32,
    /// [`KEY_ID_HEX`] to 64 lower-case hex digits: a key's id, or its whole hash.
    pub id: String,
    pub revoked_ms: u64,
}

impl Revocation {
    /// Its bucket key: `revoked.<id>`.
    pub fn bucket_key(id: &str) -> String {
        format!("{REVOCATION_PREFIX}{id}")
    }

    /// Why the record cannot be applied, if it cannot: a malformed id, or a bucket key
    /// that is not its own.
    pub fn check(&self, bucket_key: &str) -> Result<(), String> {
        if self.v != KEY_RECORD_VERSION {
            return Err(format!("unknown revocation version {}", self.v));
        }
        if !is_key_id(&self.id) {
            return Err(format!(
                "id is not {KEY_ID_HEX} to 64 lower-case hex digits"
            ));
        }
        if bucket_key != Self::bucket_key(&self.id) {
            return Err("stored under another key than revoked.<id>".into());
        }
        Ok(())
    }

    /// Whether the key whose hash is `sha256_hex` is revoked by this record.
    pub fn covers(&self, sha256_hex: &str) -> bool {
        sha256_hex.starts_with(&self.id)
    }
}

/// Whether `s` names a key: [`KEY_ID_HEX`] to 64 lower-case hex digits.
pub fn is_key_id(s: &str) -> bool {
    (KEY_ID_HEX..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Whether `s` is 64 lower-case hex digits.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Lower-case hex of `bytes` (only the key functions, which need `ring`, use it).
#[cfg(feature = "nats")]
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new key from the operating system's CSPRNG.
#[cfg(feature = "nats")]
pub fn generate_key() -> Result<String, String> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| "the operating system's random source failed".to_string())?;
    Ok(format!("{KEY_PREFIX}{}", hex(&bytes)))
}

/// The SHA-256 of `key` in lower-case hex, as stored.
#[cfg(feature = "nats")]
pub fn key_sha256(key: &str) -> String {
    hex(ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> KeyRecord {
        KeyRecord {
            v: 1,
            tenant: "acme".into(),
            sha256: "ab".repeat(32),
            note: None,
            revoked: false,
            operator: false,
            priority: None,
            created_ms: 1,
            revoked_ms: None,
        }
    }

    #[test]
    fn a_record_is_checked_against_its_bucket_key() {
        let r = record();
        assert_eq!(r.id(), "abababababab");
        assert_eq!(r.check(&"ab".repeat(32)), Ok(()));
        assert!(r.check(&"cd".repeat(32)).is_err());
        let bad_tenant = KeyRecord {
            tenant: "a.b".into(),
            ..record()
        };
        assert!(bad_tenant.check(&"ab".repeat(32)).is_err());
        let round: KeyRecord = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(round, r);
    }

    #[test]
    fn a_revocation_covers_the_keys_its_id_begins() {
        let r = Revocation {
            v: 1,
            id: "abababababab".into(),
            revoked_ms: 1,
        };
        assert_eq!(r.check("revoked.abababababab"), Ok(()));
        assert!(r.check("abababababab").is_err());
        assert!(r.covers(&"ab".repeat(32)));
        assert!(!r.covers(&"cd".repeat(32)));
        for bad in ["ababab", "ABABABABABAB", &"ab".repeat(33)] {
            let r = Revocation {
                id: bad.to_string(),
                ..r.clone()
            };
            assert!(r.check(&Revocation::bucket_key(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_are_prefixed_random_and_hashed_to_hex() {
        let (a, b) = (generate_key().unwrap(), generate_key().unwrap());
        assert!(a.starts_with(KEY_PREFIX) && a.len() == KEY_PREFIX.len() + 64);
        assert_ne!(a, b);
        assert!(is_sha256_hex(&key_sha256(&a)));
        assert_eq!(
            key_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
