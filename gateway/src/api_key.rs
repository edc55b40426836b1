//! The API key format, as the gateway checks it: generation, hashing and the shapes are
//! the protocol's ([`metronome_protocol::api_keys`], shared with `metronome keys`): `mtk_`
//! followed by 64 hex digits (32 bytes from the operating system's CSPRNG). The
//! configuration and the `api_keys` bucket store only a key's SHA-256: a plain hash
//! suffices because the key has 256 bits of entropy, so it cannot be guessed from its hash
//! (a slow password hash protects only guessable secrets). A key's public id is the first
//! 12 hex digits of its hash: safe to log. Pure; authentication itself is [`crate::auth`].

pub use metronome_protocol::api_keys::{
    generate_key, is_sha256_hex, key_sha256, KEY_ID_HEX, KEY_PREFIX,
};

pub(crate) fn digest(key: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
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
