//! API keys and tenants: who is calling, what they may use, and whether their limits admit
//! one more request.
//!
//! Keys and their hashes are [`crate::api_key`]'s. A presented key is hashed and compared
//! with every stored hash in constant time
//! (`subtle`), with no early exit, so the time taken says nothing about which stored hash
//! is nearest. Logs carry a key's public id and the tenant, never the key.
//!
//! Keys come from two places: the configuration file's `[[keys]]` (read at start) and the
//! `api_keys` bucket that `metronome keys` writes ([`crate::key_store`] watches it and hands
//! every change to [`Auth::set_live_keys`]), so a key created or revoked there takes
//! effect at once. A hash in both is the bucket's record (revoked if either says so). A
//! file's key is revoked live by a revocation of its id in the bucket
//! ([`metronome_protocol::api_keys::Revocation`], what `metronome keys revoke` stores for an
//! id the bucket has no record of); deleting the revocation lets the key in again. A
//! bucket key's tenant has the configuration's limits and models when the file names it,
//! else every model without limits.
//!
//! Invariants: the key text is never logged, echoed in an error, or kept after hashing;
//! without `allow_anonymous`, a request without a configured key is refused with 401. With
//! it, a request without `Authorization` or with a bearer token that is no configured key
//! is served as tenant `anonymous` (OpenAI clients always send some key, `api_key="unused"`
//! in a demo), never as another tenant; a revoked key or a header that is not `Bearer` is
//! refused with 401 either way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use axum::http::{header, HeaderMap};
use metronome_protocol::api_keys::{KeyRecord, Revocation};
use metronome_protocol::{Priority, ANONYMOUS_TENANT};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::api_key::{digest, generate_key, key_id, key_sha256, parse_sha256};
use crate::config::{Config, TenantConfig};
use crate::error::ApiError;
use crate::limits::{Refusal, TenantLimiter};
use crate::metrics::Metrics;

/// Keys and tenants from the `api_keys` bucket, replaced whole on every change.
#[derive(Debug, Default)]
struct LiveKeys {
    keys: Vec<StoredKey>,
    /// Indices in [`Auth::keys`] (the file's keys) revoked by a [`Revocation`].
    revoked_file_keys: Vec<usize>,
    /// Tenants the configuration does not name, kept across changes so their limiters
    /// (none, today) and their identity survive a key being added beside them.
    tenants: HashMap<String, Arc<Tenant>>,
}

/// Why a request could not be authenticated (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization` header, and anonymous access is off.
    Missing,
    /// An `Authorization` header that is not `Bearer <key>`.
    Malformed,
    /// No configured key has this hash.
    Invalid,
    /// The key is configured but revoked.
    Revoked,
}

impl AuthFailure {
    pub fn reason(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Malformed => "malformed",
            AuthFailure::Invalid => "invalid",
            AuthFailure::Revoked => "revoked",
        }
    }

    /// The 401; it never contains the presented key.
    pub fn into_api_error(self) -> ApiError {
        ApiError::unauthorized(match self {
            AuthFailure::Missing => "missing API key: send `Authorization: Bearer <key>`",
            AuthFailure::Malformed => "malformed Authorization header: expected `Bearer <key>`",
            AuthFailure::Invalid => "incorrect API key provided",
            AuthFailure::Revoked => "this API key has been revoked",
        })
    }
}

/// Why a request may not open the operator console.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorRefusal {
    /// No usable key (401).
    Auth(AuthFailure),
    /// A valid key that is not an operator's (403).
    NotOperator,
}

/// The password of an HTTP Basic credential (`base64(user:password)`); the user name is
/// ignored, so an operator can type anything there.
fn basic_password(encoded: &str) -> Option<String> {
    use base64::Engine as _;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (_, password) = text.split_once(':')?;
    Some(password.to_string())
}

impl Tenant {
    fn new(config: TenantConfig) -> Arc<Tenant> {
        Arc::new(Tenant {
            limiter: Mutex::new(TenantLimiter::new(&config.rate_limits(), 0)),
            config,
        })
    }
}

/// A tenant as served: its configuration and its buckets.
#[derive(Debug)]
struct Tenant {
    config: TenantConfig,
    limiter: Mutex<TenantLimiter>,
}

#[derive(Debug, Clone)]
struct StoredKey {
    hash: [u8; 32],
    /// The hash in lower-case hex, as revocations name it.
    sha256: String,
    tenant: Arc<Tenant>,
    revoked: bool,
    operator: bool,
    id: String,
    priority: Priority,
}

/// The authenticated caller of one request.
#[derive(Debug, Clone)]
pub struct Caller {
    tenant: Arc<Tenant>,
    /// The tenant's name (written into the job).
    pub tenant_name: String,
    /// Public id of the key used; `None` for an anonymous caller.
    pub key_id: Option<String>,
    /// The highest priority class the caller may ask for (its default class).
    pub priority: Priority,
}

/// Keys, tenants and their limiters, built once from a validated configuration.
#[derive(Debug)]
pub struct Auth {
    tenants: Vec<Arc<Tenant>>,
    /// The configuration file's keys.
    keys: Vec<StoredKey>,
    /// The `api_keys` bucket's keys.
    live: RwLock<LiveKeys>,
    /// The tenant of requests without a key, when anonymous access is on.
    anonymous: Option<Arc<Tenant>>,
    /// Origin of the monotonic milliseconds the limiters run on.
    origin: Instant,
}

impl Auth {
    /// From a configuration that passed [`Config::validate`] (keys of unknown tenants and
    /// malformed hashes are skipped, which validation makes impossible).
    pub fn new(config: &Config) -> Auth {
        let mut tenants: Vec<TenantConfig> = config.tenants.clone();
        let mut anonymous = None;
        if config.allow_anonymous {
            anonymous = Some(
                match tenants.iter().position(|t| t.name == ANONYMOUS_TENANT) {
                    Some(i) => i,
                    None => {
                        tenants.push(TenantConfig::unlimited(ANONYMOUS_TENANT));
                        tenants.len() - 1
                    }
                },
            );
        }
        let tenants: Vec<Arc<Tenant>> = tenants.into_iter().map(Tenant::new).collect();
        let keys = config
            .keys
            .iter()
            .filter_map(|k| {
                Some(StoredKey {
                    hash: parse_sha256(&k.sha256)?,
                    sha256: k.sha256.clone(),
                    tenant: tenants.iter().find(|t| t.config.name == k.tenant)?.clone(),
                    revoked: k.revoked,
                    operator: k.operator,
                    id: key_id(&k.sha256).to_string(),
                    priority: k.priority.unwrap_or(Priority::Interactive),
                })
            })
            .collect();
        Auth {
            anonymous: anonymous.map(|i| tenants[i].clone()),
            tenants,
            keys,
            live: RwLock::default(),
            origin: Instant::now(),
        }
    }

    /// Serve exactly `records` (the `api_keys` bucket's valid records) beside the
    /// configuration's keys, and refuse every key a revocation in `revocations` covers,
    /// from the next request on.
    pub fn set_live_keys<'a>(
        &self,
        records: impl IntoIterator<Item = &'a KeyRecord>,
        revocations: &[Revocation],
    ) {
        let covered = |sha256: &str| revocations.iter().any(|r| r.covers(sha256));
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        let mut keys = Vec::new();
        for r in records {
            let Some(hash) = parse_sha256(&r.sha256) else {
                continue;
            };
            let tenant = match self.tenants.iter().find(|t| t.config.name == r.tenant) {
                Some(t) => t.clone(),
                None => live
                    .tenants
                    .entry(r.tenant.clone())
                    .or_insert_with(|| Tenant::new(TenantConfig::unlimited(&r.tenant)))
                    .clone(),
            };
            // A hash also in the file stays revoked if the file revoked it.
            let revoked_in_file = self.keys.iter().any(|k| k.hash == hash && k.revoked);
            keys.push(StoredKey {
                hash,
                sha256: r.sha256.clone(),
                tenant,
                revoked: r.revoked || revoked_in_file || covered(&r.sha256),
                operator: r.operator,
                id: r.id().to_string(),
                priority: r.priority.unwrap_or(Priority::Interactive),
            });
        }
        live.keys = keys;
        let revoked_file_keys: Vec<usize> = (0..self.keys.len())
            .filter(|&i| !self.keys[i].revoked && covered(&self.keys[i].sha256))
            .collect();
        for &i in &revoked_file_keys {
            if !live.revoked_file_keys.contains(&i) {
                tracing::info!(key_id = %self.keys[i].id, tenant = %self.keys[i].tenant.config.name, "a key of the configuration file is revoked through the api_keys bucket");
            }
        }
        live.revoked_file_keys = revoked_file_keys;
    }

    /// Keys served from the `api_keys` bucket (revoked ones included).
    pub fn live_key_count(&self) -> usize {
        self.live
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys
            .len()
    }

    /// Milliseconds since this `Auth` was built (monotonic).
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// Whether any request can be served at all (a key or anonymous access).
    pub fn admits_anyone(&self) -> bool {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        self.anonymous.is_some() || self.keys.iter().chain(&live.keys).any(|k| !k.revoked)
    }

    /// Who sends `headers`.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, AuthFailure> {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return match &self.anonymous {
                Some(tenant) => Ok(self.caller(tenant, None, Priority::Interactive)),
                None => Err(AuthFailure::Missing),
            };
        };
        let value = value.to_str().map_err(|_| AuthFailure::Malformed)?.trim();
        let (scheme, key) = value.split_once(' ').ok_or(AuthFailure::Malformed)?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthFailure::Malformed);
        }
        let Some(stored) = self.find(key.trim()) else {
            return match &self.anonymous {
                Some(tenant) => Ok(self.caller(tenant, None, Priority::Interactive)),
                None => Err(AuthFailure::Invalid),
            };
        };
        if stored.revoked {
            return Err(AuthFailure::Revoked);
        }
        Ok(self.caller(&stored.tenant, Some(stored.id.clone()), stored.priority))
    }

    /// The stored key whose hash is `key`'s (the bucket's record over the file's). Every
    /// stored hash is compared, whatever matches, so the time taken does not depend on
    /// where (or whether) the key is found.
    fn find(&self, key: &str) -> Option<StoredKey> {
        let presented = digest(key);
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        let mut found = u64::MAX;
        for (i, stored) in self.keys.iter().chain(&live.keys).enumerate() {
            found.conditional_assign(&(i as u64), stored.hash.ct_eq(&presented));
        }
        let i = usize::try_from(found).unwrap_or(usize::MAX);
        let mut stored = self.keys.iter().chain(&live.keys).nth(i).cloned()?;
        if live.revoked_file_keys.contains(&i) {
            stored.revoked = true;
        }
        Some(stored)
    }

    /// Whether `headers` may open the operator console: anyone when anonymous access is
    /// on (the console then shows what any anonymous caller could learn from NATS on a
    /// loopback demo), otherwise only an unrevoked key marked `operator`. The key comes as
    /// `Authorization: Bearer <key>` (scripts) or as the password of HTTP Basic (a browser,
    /// whose own prompt then sends it with every request of the page, the event stream
    /// included).
    pub fn operator(&self, headers: &HeaderMap) -> Result<Option<String>, OperatorRefusal> {
        if self.anonymous.is_some() {
            return Ok(None);
        }
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(OperatorRefusal::Auth(AuthFailure::Missing));
        };
        let value = value
            .to_str()
            .map_err(|_| OperatorRefusal::Auth(AuthFailure::Malformed))?
            .trim();
        let (scheme, credential) = value
            .split_once(' ')
            .ok_or(OperatorRefusal::Auth(AuthFailure::Malformed))?;
        let key = if scheme.eq_ignore_ascii_case("bearer") {
            credential.trim().to_string()
        } else if scheme.eq_ignore_ascii_case("basic") {
            basic_password(credential.trim())
                .ok_or(OperatorRefusal::Auth(AuthFailure::Malformed))?
        } else {
            return Err(OperatorRefusal::Auth(AuthFailure::Malformed));
        };
        let stored = self
            .find(&key)
            .ok_or(OperatorRefusal::Auth(AuthFailure::Invalid))?;
        if stored.revoked {
            return Err(OperatorRefusal::Auth(AuthFailure::Revoked));
        }
        if !stored.operator {
            return Err(OperatorRefusal::NotOperator);
        }
        Ok(Some(stored.id.clone()))
    }

    fn caller(&self, tenant: &Arc<Tenant>, key_id: Option<String>, priority: Priority) -> Caller {
        Caller {
            tenant: tenant.clone(),
            tenant_name: tenant.config.name.clone(),
            key_id,
            priority,
        }
    }

    /// Whether `caller`'s tenant may use `model`.
    pub fn allows_model(&self, caller: &Caller, model: &str) -> bool {
        caller.tenant.config.models.allows(model)
    }

    /// Charge one request of `tokens` to `caller`'s tenant at `now_ms`.
    pub fn admit(&self, caller: &Caller, now_ms: u64, tokens: u64) -> Result<(), Refusal> {
        caller
            .tenant
            .limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit(now_ms, tokens)
    }
}

/// [`Auth::authenticate`] as an HTTP answer, counting failures.
pub fn authenticate(
    auth: &Auth,
    metrics: &Metrics,
    headers: &HeaderMap,
) -> Result<Caller, ApiError> {
    match auth.authenticate(headers) {
        Ok(caller) => Ok(caller),
        Err(failure) => {
            metrics.auth_failure(failure.reason());
            tracing::debug!(reason = failure.reason(), "request not authenticated");
            Err(failure.into_api_error())
        }
    }
}

/// The tenant's model check as an HTTP answer (403), counted.
pub fn check_model(
    auth: &Auth,
    metrics: &Metrics,
    caller: &Caller,
    model: &str,
) -> Result<(), ApiError> {
    if auth.allows_model(caller, model) {
        return Ok(());
    }
    metrics.tenant_rejection(&caller.tenant_name, "model_not_allowed");
    Err(ApiError::model_not_allowed(model))
}

/// The request's priority class: the one asked for in `header_value`, which may not be
/// above what the caller's key allows (403, counted), or else the key's own.
pub fn priority(
    metrics: &Metrics,
    caller: &Caller,
    header_value: Option<&str>,
) -> Result<Priority, ApiError> {
    let Some(asked) = header_value else {
        return Ok(caller.priority);
    };
    let asked = Priority::parse(asked.trim()).ok_or_else(|| {
        ApiError::invalid_field(
            crate::headers::HEADER_PRIORITY,
            format!(
                "`{}` must be `interactive` or `batch`",
                crate::headers::HEADER_PRIORITY
            ),
        )
    })?;
    if asked.rank() < caller.priority.rank() {
        metrics.tenant_rejection(&caller.tenant_name, "priority_not_allowed");
        return Err(ApiError::priority_not_allowed(asked, caller.priority));
    }
    Ok(asked)
}

/// Charge one request of `tokens` to the caller's tenant now, or the 429, counted.
pub fn charge(
    auth: &Auth,
    metrics: &Metrics,
    caller: &Caller,
    tokens: u64,
) -> Result<(), ApiError> {
    auth.admit(caller, auth.now_ms(), tokens).map_err(|refusal| {
        metrics.tenant_rejection(&caller.tenant_name, refusal.reason());
        tracing::debug!(tenant = %caller.tenant_name, reason = refusal.reason(), "tenant limit reached");
        ApiError::rate_limited(&refusal)
    })?;
    metrics.tenant_tokens_admitted(&caller.tenant_name, tokens);
    Ok(())
}

/// What `keys create` produces: the key (shown once) and the configuration to add.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub key: String,
    pub sha256: String,
    /// A `[[keys]]` entry.
    pub key_toml: String,
    /// A `[[tenants]]` entry, for a tenant not configured yet.
    pub tenant_toml: String,
}

/// A new key for `tenant` and the configuration lines for it. `tenant` is validated as a
/// whole configuration would be, so what is printed is accepted when added.
pub fn create_key(
    tenant: &TenantConfig,
    note: Option<&str>,
    operator: bool,
) -> Result<NewKey, String> {
    let key = generate_key()?;
    let sha256 = key_sha256(&key);
    let entry = crate::config::KeyConfig {
        tenant: tenant.name.clone(),
        sha256: sha256.clone(),
        note: note.map(String::from),
        revoked: false,
        priority: None,
        operator,
    };
    let config = Config {
        tenants: vec![tenant.clone()],
        keys: vec![entry.clone()],
        ..Config::default()
    };
    if let Err(errors) = config.validate() {
        return Err(errors
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("; "));
    }
    #[derive(serde::Serialize)]
    struct Tenants<'a> {
        tenants: [&'a TenantConfig; 1],
    }
    #[derive(serde::Serialize)]
    struct Keys<'a> {
        keys: [&'a crate::config::KeyConfig; 1],
    }
    Ok(NewKey {
        key,
        key_toml: render(&Keys { keys: [&entry] }),
        tenant_toml: render(&Tenants { tenants: [tenant] }),
        sha256,
    })
}

fn render<T: serde::Serialize>(value: &T) -> String {
    toml::to_string(value).unwrap_or_else(|e| format!("# cannot render: {e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{KeyConfig, ModelList};
    use axum::http::HeaderValue;

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
        );
        h
    }

    #[test]
    fn a_revocation_by_id_refuses_the_files_key_until_it_is_deleted() {
        let auth = Auth::new(&config(
            &[("acme", "mtk_a", false), ("beta", "mtk_b", false)],
            false,
        ));
        let revocation = Revocation {
            v: 1,
            id: key_id(&key_sha256("mtk_a")).to_string(),
            revoked_ms: 1,
        };
        auth.set_live_keys(Vec::<&KeyRecord>::new(), std::slice::from_ref(&revocation));
        assert_eq!(
            auth.authenticate(&bearer("mtk_a")).unwrap_err(),
            AuthFailure::Revoked
        );
        assert!(auth.authenticate(&bearer("mtk_b")).is_ok(), "another key");
        // A bucket key covered by it is refused too.
        let live = KeyRecord {
            v: 1,
            tenant: "beta".into(),
            sha256: key_sha256("mtk_a"),
            note: None,
            revoked: false,
            operator: false,
            priority: None,
            created_ms: 1,
            revoked_ms: None,
        };
        auth.set_live_keys([&live], std::slice::from_ref(&revocation));
        assert_eq!(
            auth.authenticate(&bearer("mtk_a")).unwrap_err(),
            AuthFailure::Revoked
        );
        auth.set_live_keys(Vec::<&KeyRecord>::new(), &[]);
        assert_eq!(
            auth.authenticate(&bearer("mtk_a")).unwrap().tenant_name,
            "acme"
        );
    }

    fn config(keys: &[(&str, &str, bool)], anonymous: bool) -> Config {
        Config {
            allow_anonymous: anonymous,
            tenants: vec![
                TenantConfig {
                    models: ModelList::Only(vec!["m1".into()]),
                    ..TenantConfig::unlimited("acme")
                },
                TenantConfig::unlimited("beta"),
            ],
            keys: keys
                .iter()
                .map(|(tenant, key, revoked)| KeyConfig {
                    tenant: tenant.to_string(),
                    sha256: key_sha256(key),
                    note: None,
                    revoked: *revoked,
                    priority: None,
                    operator: false,
                })
                .collect(),
            ..Config::default()
        }
    }

    #[test]
    fn a_request_may_lower_its_priority_class_but_not_raise_it() {
        let mut c = config(&[("acme", "k-int", false), ("beta", "k-bat", false)], true);
        c.keys[1].priority = Some(Priority::Batch);
        let auth = Auth::new(&c);
        let metrics = Metrics::default();
        let int = auth.authenticate(&bearer("k-int")).unwrap();
        let bat = auth.authenticate(&bearer("k-bat")).unwrap();
        let anon = auth.authenticate(&HeaderMap::new()).unwrap();
        assert_eq!(
            priority(&metrics, &int, None).unwrap(),
            Priority::Interactive
        );
        assert_eq!(
            priority(&metrics, &anon, None).unwrap(),
            Priority::Interactive
        );
        assert_eq!(
            priority(&metrics, &int, Some("batch")).unwrap(),
            Priority::Batch
        );
        assert_eq!(priority(&metrics, &bat, None).unwrap(), Priority::Batch);
        assert_eq!(
            priority(&metrics, &bat, Some(" batch ")).unwrap(),
            Priority::Batch
        );
        let raised = priority(&metrics, &bat, Some("interactive")).unwrap_err();
        assert_eq!(raised.status.as_u16(), 403);
        assert_eq!(raised.body()["error"]["code"], "priority_not_allowed");
        let bad = priority(&metrics, &int, Some("urgent")).unwrap_err();
        assert_eq!(bad.status.as_u16(), 400);
        assert_eq!(
            bad.body()["error"]["param"],
            crate::headers::HEADER_PRIORITY
        );
    }

    #[test]
    fn keys_map_to_their_tenants_and_everything_else_is_refused() {
        let c = config(
            &[
                ("acme", "k-a", false),
                ("beta", "k-b", false),
                ("beta", "k-old", true),
            ],
            false,
        );
        c.validate().unwrap();
        let auth = Auth::new(&c);
        assert_eq!(
            auth.authenticate(&bearer("k-a")).unwrap().tenant_name,
            "acme"
        );
        let b = auth.authenticate(&bearer("k-b")).unwrap();
        assert_eq!(b.tenant_name, "beta");
        assert_eq!(b.key_id.as_deref(), Some(key_id(&key_sha256("k-b"))));
        assert_eq!(
            auth.authenticate(&bearer("k-c")).unwrap_err(),
            AuthFailure::Invalid
        );
        assert_eq!(
            auth.authenticate(&bearer("k-old")).unwrap_err(),
            AuthFailure::Revoked
        );
        assert_eq!(
            auth.authenticate(&HeaderMap::new()).unwrap_err(),
            AuthFailure::Missing
        );
        let mut basic = HeaderMap::new();
        basic.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k-a"));
        assert_eq!(
            auth.authenticate(&basic).unwrap_err(),
            AuthFailure::Malformed
        );
        let mut lower = HeaderMap::new();
        lower.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer k-a"),
        );
        assert!(
            auth.authenticate(&lower).is_ok(),
            "the scheme is case-insensitive"
        );
    }

    #[test]
    fn anonymous_only_without_a_header_and_only_when_enabled() {
        let auth = Auth::new(&config(&[("acme", "k-a", false)], true));
        let anon = auth.authenticate(&HeaderMap::new()).unwrap();
        assert_eq!(anon.tenant_name, ANONYMOUS_TENANT);
        assert_eq!(anon.key_id, None);
        assert!(auth.allows_model(&anon, "anything"));
        assert_eq!(
            auth.authenticate(&bearer("unused")).unwrap().tenant_name,
            ANONYMOUS_TENANT,
            "an unknown key is anonymous, never another tenant"
        );
        assert_eq!(
            auth.authenticate(&bearer("k-a")).unwrap().tenant_name,
            "acme"
        );
        let auth = Auth::new(&config(&[("acme", "k-old", true)], true));
        assert_eq!(
            auth.authenticate(&bearer("k-old")).unwrap_err(),
            AuthFailure::Revoked,
            "a revoked key is refused even with anonymous access"
        );
        let closed = Auth::new(&config(&[], false));
        assert!(!closed.admits_anyone());
        assert!(auth.admits_anyone());
    }

    #[test]
    fn models_are_checked_per_tenant() {
        let auth = Auth::new(&config(
            &[("acme", "k-a", false), ("beta", "k-b", false)],
            false,
        ));
        let a = auth.authenticate(&bearer("k-a")).unwrap();
        let b = auth.authenticate(&bearer("k-b")).unwrap();
        assert!(auth.allows_model(&a, "m1") && !auth.allows_model(&a, "m2"));
        assert!(auth.allows_model(&b, "m2"), "\"*\" allows every model");
    }

    #[test]
    fn errors_never_contain_the_key() {
        for f in [
            AuthFailure::Missing,
            AuthFailure::Malformed,
            AuthFailure::Invalid,
            AuthFailure::Revoked,
        ] {
            let e = f.into_api_error();
            assert_eq!(e.status.as_u16(), 401);
            assert_eq!(e.code, Some("invalid_api_key"));
            assert!(!e.message.contains("mtk_"));
        }
    }

    #[test]
    fn created_entries_parse_back_into_a_valid_configuration() {
        let tenant = TenantConfig {
            models: ModelList::Only(vec!["a".into(), "b".into()]),
            requests_per_second: Some(5.0),
            ..TenantConfig::unlimited("acme")
        };
        let new = create_key(&tenant, Some("ci"), false).unwrap();
        let text = format!("{}\n{}", new.tenant_toml, new.key_toml);
        assert!(!text.contains(&new.key));
        let c = Config::from_toml(&text, "t").unwrap();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.tenants, vec![tenant]);
        let auth = Auth::new(&c);
        assert_eq!(
            auth.authenticate(&bearer(&new.key)).unwrap().tenant_name,
            "acme"
        );
        assert!(create_key(&TenantConfig::unlimited("bad name"), None, false).is_err());
    }
}
