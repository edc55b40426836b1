//! Redis key names and hash fields of the per-worker EWMAs written by worker-agents and
//! read by the dispatcher.

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "metronome";

/// `<prefix>:ewma:<worker_id>`: hash of [`EWMA_FIELDS`].
pub fn ewma_key(prefix: &str, worker_id: &str) -> String {
    format!("{prefix}:ewma:{worker_id}")
}

/// `<prefix>:ewma:*`: scan pattern for every worker's EWMA hash.
pub fn ewma_pattern(prefix: &str) -> String {
    format!("{prefix}:ewma:*")
}

/// `<prefix>:outlen:<model>:<worker_id>`: hash with one worker's output-length EWMA of its
/// model (fields `tokens`, `samples`, `updated_ms`). The dispatcher predicts a job's cost
/// from the median over the model's workers ([`output_len_of_key`]), so no single worker
/// (a minority of them) sets its model's prediction; each worker may write only its own.
pub fn output_len_key(prefix: &str, model: &str, worker_id: &str) -> String {
    format!("{prefix}:outlen:{model}:{worker_id}")
}

/// `<prefix>:outlen:*`: scan pattern for every worker's output-length hash.
pub fn output_len_pattern(prefix: &str) -> String {
    format!("{prefix}:outlen:*")
}

/// The model and worker id of an output-length key (`None`: another key, such as the
/// per-model key of earlier versions). Worker ids hold no `:`, model names may.
pub fn output_len_of_key<'k>(prefix: &str, key: &'k str) -> Option<(&'k str, &'k str)> {
    let rest = key.strip_prefix(prefix)?.strip_prefix(":outlen:")?;
    let (model, worker) = rest.rsplit_once(':')?;
    (!model.is_empty() && crate::names::is_worker_id(worker)).then_some((model, worker))
}

/// `<prefix>:perf:<worker_id>`: JSON of the worker's fitted performance model (the
/// recursive-least-squares state), so a restarted agent resumes where it stopped.
pub fn perf_key(prefix: &str, worker_id: &str) -> String {
    format!("{prefix}:perf:{worker_id}")
}

pub const FIELD_TTFT_MS: &str = "ttft_ms";
pub const FIELD_TPOT_MS: &str = "tpot_ms";
pub const FIELD_TOK_S: &str = "tok_s";
pub const FIELD_E2E_MS: &str = "e2e_ms";
pub const FIELD_SAMPLES: &str = "samples";
pub const FIELD_UPDATED_MS: &str = "updated_ms";
pub const FIELD_ALPHA: &str = "alpha";
pub const FIELD_TOKENS: &str = "tokens";

/// The EWMA fields, in the order the update script takes them.
pub const EWMA_FIELDS: [&str; 4] = [FIELD_TTFT_MS, FIELD_TPOT_MS, FIELD_TOK_S, FIELD_E2E_MS];

/// The Redis function library of the EWMA update (Redis 7 functions). The leading
/// dispatcher loads it (`FUNCTION LOAD REPLACE`, on every new connection, so a restarted
/// Redis gets it back); worker-agents call it with `FCALL` and may run no Lua of their
/// own, so none can hold Redis busy for the other roles. It runs under the caller's ACL:
/// a worker updates only its own EWMA hash and its model's output length.
///
/// [`EWMA_UPDATE_FUNCTION`]: KEYS the worker's EWMA hash and the model's output-length
/// hash; ARGV now_ms, alpha, half_life_ms, the number of EWMA fields, the names of the
/// samples, updated-ms and alpha fields, the EWMA field names, one value per field ('' for
/// no sample of it), then the output-length field and its value. Bounded work: one pass
/// over the fields given.
pub const EWMA_LIBRARY: &str = r#"#!lua name=metronome

local function update_ewma(keys, args)
  local now = tonumber(args[1])
  local base = tonumber(args[2])
  local half = tonumber(args[3])
  local nfields = tonumber(args[4])
  if now == nil or base == nil or half == nil or nfields == nil or nfields < 0 or nfields > 16 then
    return redis.error_reply('bad arguments')
  end

  local function alpha_eff(updated)
    if updated == nil then return 1 end
    local dt = now - updated
    if dt < 0 then dt = 0 end
    local a = 1 - (1 - base) * math.pow(0.5, dt / half)
    if a < base then a = base end
    if a > 1 then a = 1 end
    return a
  end

  -- Numbers handed to redis.call are truncated to integers: format floats as strings.
  local function num(x) return string.format('%.17g', x) end

  local function update(key, fields, values)
    local any = false
    for i = 1, #fields do
      if tonumber(values[i]) ~= nil then any = true end
    end
    if not any then return end
    local old = redis.call('HMGET', key, args[5], args[6], unpack(fields))
    local samples = tonumber(old[1]) or 0
    local a = alpha_eff(tonumber(old[2]))
    for i = 1, #fields do
      local x = tonumber(values[i])
      if x ~= nil then
        local prev = tonumber(old[i + 2])
        local v = x
        if prev ~= nil then v = prev + a * (x - prev) end
        redis.call('HSET', key, fields[i], num(v))
      end
    end
    redis.call('HSET', key, args[5], samples + 1, args[6], num(now), args[7], num(a))
  end

  local fields, values = {}, {}
  for i = 1, nfields do
    fields[i] = args[7 + i]
    values[i] = args[7 + nfields + i]
  end
  update(keys[1], fields, values)
  update(keys[2], { args[8 + 2 * nfields] }, { args[9 + 2 * nfields] })
  return 1
end

redis.register_function('metronome_ewma_update', update_ewma)
"#;

/// The function of [`EWMA_LIBRARY`] a worker-agent calls (`FCALL <name> 2 <keys> <args>`).
pub const EWMA_UPDATE_FUNCTION: &str = "metronome_ewma_update";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_length_key_names_its_model_and_worker() {
        let key = output_len_key("m", "org/model:v2", "n1-gpu0");
        assert_eq!(key, "m:outlen:org/model:v2:n1-gpu0");
        assert_eq!(
            output_len_of_key("m", &key),
            Some(("org/model:v2", "n1-gpu0"))
        );
        // The shared per-model key of earlier versions, and other prefixes, are not one.
        assert_eq!(output_len_of_key("m", "m:outlen:model"), None);
        assert_eq!(output_len_of_key("m", "x:outlen:model:w"), None);
    }
}
