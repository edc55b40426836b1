//! The API key format: `mtk_` followed by 64 hex digits (32 bytes from the operating
//! system's CSPRNG, `ring::rand::SystemRandom`). The configuration stores only a key's
//! SHA-256 (`[[keys]] sha256 = ...`): a plain hash suffices because the key has 256 bits of
//! entropy, so it cannot be guessed from its hash (a slow password hash protects only
//! guessable secrets). A key's public id is the first 12 hex digits of its hash: safe to
//! log. Pure; authentication itself is [`crate::auth`].

use ring::rand::SecureRandom;

/// Prefix of every key: recognisable in a leaked-secret scan, and in a config file where
/// the key was pasted instead of its hash.
pub const KEY_PREFIX: &str = "mtk_";
/// Random bytes in a key.
const KEY_RANDOM_BYTES: usize = 32;
/// Hex digits of the hash that make a key's public id.
const KEY_ID_HEX: usize = 12;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new key from the operating system's CSPRNG.
pub fn generate_key() -> Result<String, ring::error::Unspecified> {
    let mut bytes = [0u8; KEY_RANDOM_BYTES];
    ring::rand::SystemRandom::new().fill(&mut bytes)?;
    Ok(format!("{KEY_PREFIX}{}", hex(&bytes)))
}

pub(crate) fn digest(key: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// The SHA-256 of `key`, as stored in `[[keys]] sha256`.
pub fn key_sha256(key: &str) -> String {
    hex(&digest(key))
}

pub(crate) fn parse_sha256(s: &str) -> Option<[u8; 32]> {
    if !is_sha256_hex(s) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Whether `s` is 64 lowercase hex digits: the form of `[[keys]] sha256`.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The public id of a key, from its hash: safe to log.
pub fn key_id(sha256_hex: &str) -> &str {
    &sha256_hex[..KEY_ID_HEX.min(sha256_hex.len())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_distinct_prefixed_and_hash_to_valid_entries() {
        let a = generate_key().unwrap();
        let b = generate_key().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with(KEY_PREFIX) && a.len() == KEY_PREFIX.len() + 64);
        assert!(is_sha256_hex(&key_sha256(&a)));
        assert_eq!(
            key_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(key_id(&key_sha256("abc")), "ba7816bf8f01");
    }
}
