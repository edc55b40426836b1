//! The hasher of the tables keyed by KV block hash ([`BlockHash`], a `u64`): the prefix
//! indexes look up to 256 of them per worker judged and per job placed or ended, so the
//! standard library's SipHash-1-3 was much of a prefix-aware decision's cost.
//!
//! **Why keyed.** Block hashes come from clients (a fingerprint published straight to NATS
//! may name any hashes), so an unkeyed hasher (FxHash: one multiply by a public constant)
//! would let a client choose keys that all land in one bucket and turn every lookup of a
//! worker's cache into a scan (collision flooding). Here each table draws its own two
//! 64-bit keys from the standard library's per-process random [`RandomState`], and a key
//! `k` hashes to the folded multiply (`lo ^ hi` of the 128-bit product) of `k ^ seed` by
//! the secret `multiplier`, folded once more by a fixed odd constant: where `k` lands
//! depends on both secret keys, and every bit of the result on every bit of `k`. This is
//! the construction of foldhash and of aHash's fallback for one integer; written here it
//! is a few lines instead of a dependency, and two multiplies per key.
//!
//! The keys decide where a block sits in a table, never what a lookup answers: nothing
//! iterates these tables in a way that reaches a result, so decisions stay deterministic.
//!
//! [`BlockHash`]: metronome_protocol::prefix::BlockHash

use std::hash::{BuildHasher, Hasher, RandomState};

/// Builds the hashers of one table, with its own random keys.
#[derive(Debug, Clone)]
pub struct BlockHashState {
    seed: u64,
    multiplier: u64,
}

impl BlockHashState {
    pub fn new() -> Self {
        let keys = RandomState::new();
        BlockHashState {
            seed: keys.hash_one(0x243f_6a88_85a3_08d3_u64),
            // Odd: a multiplier with trailing zero bits would drop the key's top bits.
            multiplier: keys.hash_one(0x1319_8a2e_0370_7344_u64) | 1,
        }
    }
}

impl Default for BlockHashState {
    fn default() -> Self {
        BlockHashState::new()
    }
}

impl BuildHasher for BlockHashState {
    type Hasher = BlockHasher;

    fn build_hasher(&self) -> BlockHasher {
        BlockHasher {
            acc: self.seed,
            multiplier: self.multiplier,
        }
    }
}

/// The low and high halves of the 128-bit product, folded.
#[inline]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    acc: u64,
    multiplier: u64,
}

impl Hasher for BlockHasher {
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.acc = folded_multiply(self.acc ^ n, self.multiplier);
    }

    /// Other keys than a `u64` (none in this crate): 8 bytes at a time, then the length.
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(word));
        }
        self.write_u64(bytes.len() as u64);
    }

    /// One more folded multiply, by a fixed odd constant: the first leaves the low bits
    /// of keys that differ only in their high bits spread as the multiplier's low bits
    /// happen to allow, and a table's bucket is its hash's low bits.
    #[inline]
    fn finish(&self) -> u64 {
        folded_multiply(self.acc, 0x9e37_79b9_7f4a_7c15)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tables_are_keyed_apart_and_a_key_hashes_alike_within_one() {
        let (a, b) = (BlockHashState::new(), BlockHashState::new());
        assert_eq!(a.hash_one(42u64), a.hash_one(42u64));
        assert_ne!(a.hash_one(42u64), b.hash_one(42u64));
        assert_ne!(a.hash_one(42u64), a.hash_one(43u64));
    }

    #[test]
    fn consecutive_and_strided_keys_spread_over_buckets_whatever_the_keys() {
        // Keys a client might pick to pile into one bucket: consecutive, or differing only
        // in their high or middle bits. Under each of many random keyings, their low 10
        // bits (a 1,024-bucket table) and top 7 bits (hashbrown's tag) stay spread: 4,096
        // keys thrown at random fill about 1,005 of 1,024 buckets and all 128 tags.
        let key_sets: [Vec<u64>; 4] = [
            (0..4_096u64).collect(),
            (0..4_096u64).map(|i| i << 52).collect(),
            (0..4_096u64).map(|i| i << 32).collect(),
            (0..4_096u64).map(|i| i << 20 | 0xabc).collect(),
        ];
        for _ in 0..64 {
            let state = BlockHashState::new();
            for keys in &key_sets {
                let buckets: HashSet<u64> =
                    keys.iter().map(|k| state.hash_one(k) & 1_023).collect();
                assert!(buckets.len() > 950, "{} buckets of 1,024", buckets.len());
                let tags: HashSet<u64> = keys.iter().map(|k| state.hash_one(k) >> 57).collect();
                assert!(tags.len() > 124, "{} tags of 128", tags.len());
            }
        }
    }
}
