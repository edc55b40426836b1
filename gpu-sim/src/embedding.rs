//! `POST /v1/embeddings` as vLLM serves it for a pooling model: each input is prefilled
//! on the simulated GPU like any prompt (it takes its place in the batch and its KV blocks,
//! and is cached as a prefix), and its vector is ready when its prefill is: it writes no
//! tokens.
//!
//! - Request: `input` (a string, an array of strings, an array of token ids or an array of
//!   token-id arrays), `encoding_format` (`float`, the default, or `base64`: the vector's
//!   little-endian `f32` bytes, which the official OpenAI clients ask for), `dimensions`
//!   (1 to [`MAX_DIMENSIONS`], [`DEFAULT_DIMENSIONS`] when absent), and the extension
//!   `metronome_prompt_tokens` (each input's exact token count).
//! - Response (OpenAI's shape): `{"object": "list", "data": [{"object": "embedding",
//!   "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`.
//! - Vectors are deterministic: unit length, drawn from a stream seeded by the server's seed
//!   and the input, so the same input always gets the same vector and different inputs
//!   get different ones.

use base64::Engine as _;
use metronome_protocol::prefix::{fit_to_count, text_token_ids, EMPTY_PROMPT_TOKEN};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use serde_json::{json, Value};

/// Dimensions of a vector when the request names none.
pub const DEFAULT_DIMENSIONS: u32 = 384;
/// Most dimensions a request may ask for.
pub const MAX_DIMENSIONS: u32 = 4096;

/// Folded into the seed so vectors never repeat the text generator's stream.
const STREAM_SALT: u64 = 0x656d_6265_6464_696e;

#[derive(Clone, Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: String,
    #[serde(default)]
    pub input: Value,
    #[serde(default)]
    pub encoding_format: Option<String>,
    #[serde(default)]
    pub dimensions: Option<u32>,
    #[serde(default)]
    pub metronome_prompt_tokens: Option<u32>,
}

/// One input: its token ids and the text that seeds its vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingInput {
    pub token_ids: Vec<u32>,
    pub key: String,
}

/// How the vectors are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Float,
    Base64,
}

/// A request that cannot be served: the message and the field at fault.
pub type Invalid = (String, &'static str);

impl EmbeddingRequest {
    /// The inputs, each with its token ids.
    pub fn inputs(&self) -> Result<Vec<EmbeddingInput>, Invalid> {
        let invalid = || {
            (
                "`input` must be a string, an array of strings, an array of token ids or an array of token-id arrays, and not empty".to_string(),
                "input",
            )
        };
        let ids = |items: &[Value]| -> Result<Vec<u32>, Invalid> {
            items
                .iter()
                .map(|i| {
                    i.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(invalid)
                })
                .collect()
        };
        let text = |s: &str| EmbeddingInput {
            token_ids: text_token_ids(s),
            key: s.to_string(),
        };
        let tokens = |t: Vec<u32>| EmbeddingInput {
            key: format!("{t:?}"),
            token_ids: if t.is_empty() {
                vec![EMPTY_PROMPT_TOKEN]
            } else {
                t
            },
        };
        let inputs = match &self.input {
            Value::String(s) => vec![text(s)],
            Value::Array(items) if items.is_empty() => return Err(invalid()),
            Value::Array(items) if items.iter().all(Value::is_string) => items
                .iter()
                .map(|i| text(i.as_str().unwrap_or_default()))
                .collect(),
            Value::Array(items) if items.iter().all(Value::is_number) => vec![tokens(ids(items)?)],
            Value::Array(items) if items.iter().all(Value::is_array) => items
                .iter()
                .map(|i| Ok(tokens(ids(i.as_array().map_or(&[][..], Vec::as_slice))?)))
                .collect::<Result<_, Invalid>>()?,
            _ => return Err(invalid()),
        };
        Ok(match self.metronome_prompt_tokens {
            Some(n) => inputs
                .into_iter()
                .map(|i| EmbeddingInput {
                    token_ids: fit_to_count(i.token_ids, n),
                    key: i.key,
                })
                .collect(),
            None => inputs,
        })
    }

    pub fn encoding(&self) -> Result<Encoding, Invalid> {
        match self.encoding_format.as_deref() {
            None | Some("float") => Ok(Encoding::Float),
            Some("base64") => Ok(Encoding::Base64),
            Some(other) => Err((
                format!("`encoding_format` must be `float` or `base64`, not `{other}`"),
                "encoding_format",
            )),
        }
    }

    pub fn dimensions(&self) -> Result<u32, Invalid> {
        match self.dimensions {
            None => Ok(DEFAULT_DIMENSIONS),
            Some(d) if (1..=MAX_DIMENSIONS).contains(&d) => Ok(d),
            Some(_) => Err((
                format!("`dimensions` must be from 1 to {MAX_DIMENSIONS}"),
                "dimensions",
            )),
        }
    }
}

/// The unit vector of one input.
pub fn vector(seed: u64, key: &str, dimensions: u32) -> Vec<f32> {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ crate::text::fnv1a(key.as_bytes()) ^ STREAM_SALT);
    let mut v: Vec<f32> = (0..dimensions)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::EPSILON);
    for x in &mut v {
        *x /= norm;
    }
    v
}

/// The OpenAI response for `vectors`, in input order.
pub fn response(
    id: &str,
    created: u64,
    model: &str,
    vectors: &[Vec<f32>],
    encoding: Encoding,
    prompt_tokens: u32,
) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = match encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({
        "id": id, "object": "list", "created": created, "model": model, "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> EmbeddingRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn inputs_take_every_openai_shape() {
        let one = request(json!({"model": "m", "input": "abcdefgh"}));
        assert_eq!(one.inputs().unwrap().len(), 1);
        assert_eq!(one.inputs().unwrap()[0].token_ids.len(), 2);
        let many = request(json!({"model": "m", "input": ["a", "b", "c"]}));
        assert_eq!(many.inputs().unwrap().len(), 3);
        let ids = request(json!({"model": "m", "input": [1, 2, 3]}));
        assert_eq!(ids.inputs().unwrap()[0].token_ids, vec![1, 2, 3]);
        let batches = request(json!({"model": "m", "input": [[1], [2, 3]]}));
        assert_eq!(batches.inputs().unwrap()[1].token_ids, vec![2, 3]);
        let exact = request(json!({"model": "m", "input": "a", "metronome_prompt_tokens": 50}));
        assert_eq!(exact.inputs().unwrap()[0].token_ids.len(), 50);
        for bad in [json!(5), json!([]), json!([1, "a"]), json!(null)] {
            let r = request(json!({"model": "m", "input": bad}));
            assert_eq!(r.inputs().unwrap_err().1, "input", "{bad}");
        }
    }

    #[test]
    fn vectors_are_unit_length_and_follow_the_input() {
        let a = vector(42, "hello", 64);
        assert_eq!(a.len(), 64);
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        assert_eq!(a, vector(42, "hello", 64));
        assert_ne!(a, vector(42, "hello!", 64));
        assert_ne!(a, vector(43, "hello", 64));
    }

    #[test]
    fn base64_holds_the_little_endian_floats() {
        let v = vec![vec![1.0f32, -0.5]];
        let r = response("e", 0, "m", &v, Encoding::Base64, 3);
        let text = r["data"][0]["embedding"].as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .unwrap();
        assert_eq!(
            bytes,
            [1.0f32.to_le_bytes(), (-0.5f32).to_le_bytes()].concat()
        );
        assert_eq!(r["usage"], json!({"prompt_tokens": 3, "total_tokens": 3}));
        let f = response("e", 0, "m", &v, Encoding::Float, 3);
        assert_eq!(f["data"][0]["embedding"], json!([1.0, -0.5]));
    }
}
