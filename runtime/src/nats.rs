//! How every binary connects to NATS: one [`NatsAuth`] block of settings (user and
//! password or a `.creds` file, TLS trust and client certificate), read the same way by the gateway, the
//! dispatcher, the worker-agent, the CLI and the load generator, and turned into
//! [`async_nats::ConnectOptions`] by [`NatsAuth::connect_options`].
//!
//! Why a per-user inbox prefix: nats-server authorises subscriptions by subject, and every
//! request/reply (each JetStream API call, each pull of a consumer) answers on the caller's
//! inbox. With the shared `_INBOX.>` any identity allowed to subscribe there could read the
//! replies of every other one, such as the assignments pulled by another worker. So a
//! connection with a user answers on `_INBOX.<user>.>` (`protocol::names::inbox_prefix`) and the server
//! grants each user only its own (see `protocol::permissions`).
//!
//! A `.creds` file (what `nsc` writes for a user of an operator-mode server: the user's JWT
//! and its nkey seed) authenticates by signing the server's nonce with the seed; the
//! permissions are in the JWT, written by whoever issued it. Such a user has no name of
//! ours, so its inbox is the shared `_INBOX.>` unless `user` names the per-user prefix the
//! JWT's permissions grant (`user` then needs no password).
//!
//! Secrets never reach a log or `--check-config`: `Debug` and `Serialize` print the
//! password as `"<redacted>"`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize, Serializer};

/// Environment variables read by [`NatsAuth::apply_env`], the same for every binary.
pub const ENV_USER: &str = "METRONOME_NATS_USER";
pub const ENV_PASSWORD: &str = "METRONOME_NATS_PASSWORD";
pub const ENV_PASSWORD_FILE: &str = "METRONOME_NATS_PASSWORD_FILE";
pub const ENV_CA: &str = "METRONOME_NATS_CA";
pub const ENV_CERT: &str = "METRONOME_NATS_CERT";
pub const ENV_KEY: &str = "METRONOME_NATS_KEY";
pub const ENV_CREDS: &str = "METRONOME_NATS_CREDS";

/// Credentials and TLS settings of one NATS connection (the `[nats_auth]` table of each
/// binary's configuration). Every field is optional: none set is an anonymous, plain-text
/// connection, as on a development loopback.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsAuth {
    /// User name in the server's `authorization` block (`METRONOME_NATS_USER`).
    pub user: Option<String>,
    /// Its password (`METRONOME_NATS_PASSWORD`); prefer `password_file`.
    #[serde(serialize_with = "redacted")]
    pub password: Option<String>,
    /// A file holding the password (`METRONOME_NATS_PASSWORD_FILE`), so no secret sits in
    /// a world-readable config or in the process environment.
    pub password_file: Option<PathBuf>,
    /// A NATS `.creds` file (user JWT and nkey seed, as `nsc` writes it) for an
    /// operator-mode server (`METRONOME_NATS_CREDS`); instead of a password.
    pub creds_file: Option<PathBuf>,
    /// PEM file of the CA that signed the server's certificate (`METRONOME_NATS_CA`);
    /// setting it requires TLS.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for servers that verify clients (`METRONOME_NATS_CERT`).
    pub cert_file: Option<PathBuf>,
    /// Its PEM private key (`METRONOME_NATS_KEY`).
    pub key_file: Option<PathBuf>,
}

fn redacted<S: Serializer>(value: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(_) => s.serialize_str("<redacted>"),
        None => s.serialize_none(),
    }
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuth")
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_file", &self.password_file)
            .field("creds_file", &self.creds_file)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish()
    }
}

/// Why a connection could not be configured.
#[derive(Debug, thiserror::Error)]
pub enum NatsAuthError {
    #[error("reading the NATS password file {path}: {source}")]
    PasswordFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A `.creds` file that cannot be read or holds no user JWT and seed.
    #[error("nats_auth.creds_file: {path}: {source}")]
    CredsFile {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A CA, certificate or key file that is missing, unreadable or holds no PEM of its kind.
    #[error(transparent)]
    TlsFile(#[from] crate::tls::TlsFileError),
}

impl NatsAuth {
    /// Settings from the environment alone (for tools without a config file).
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> NatsAuth {
        let mut auth = NatsAuth::default();
        auth.apply_env(lookup);
        auth
    }

    /// Override fields with the `METRONOME_NATS_*` variables found through `lookup`
    /// (`std::env::var(..).ok()` in `main`); an empty value clears the field.
    pub fn apply_env(&mut self, lookup: impl Fn(&str) -> Option<String>) {
        let text = |v: String| (!v.is_empty()).then_some(v);
        let path = |v: String| (!v.is_empty()).then(|| PathBuf::from(v));
        if let Some(v) = lookup(ENV_USER) {
            self.user = text(v);
        }
        if let Some(v) = lookup(ENV_PASSWORD) {
            self.password = text(v);
        }
        if let Some(v) = lookup(ENV_PASSWORD_FILE) {
            self.password_file = path(v);
        }
        if let Some(v) = lookup(ENV_CREDS) {
            self.creds_file = path(v);
        }
        if let Some(v) = lookup(ENV_CA) {
            self.ca_file = path(v);
        }
        if let Some(v) = lookup(ENV_CERT) {
            self.cert_file = path(v);
        }
        if let Some(v) = lookup(ENV_KEY) {
            self.key_file = path(v);
        }
    }

    /// Every inconsistent setting as `(field, message)`, the field named as in the
    /// binaries' configs (`nats_auth.user`).
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut errors = Vec::new();
        if let Some(user) = &self.user {
            if !is_token(user) {
                errors.push((
                    "nats_auth.user",
                    format!("{user:?} must be letters, digits, '-' or '_' (it names the user's inbox subject)"),
                ));
            }
            if self.password.is_none() && self.password_file.is_none() && self.creds_file.is_none()
            {
                errors.push((
                    "nats_auth.password",
                    "a user needs password, password_file or creds_file".into(),
                ));
            }
        } else if self.password.is_some() || self.password_file.is_some() {
            errors.push(("nats_auth.user", "a password needs a user".into()));
        }
        if self.creds_file.is_some() && (self.password.is_some() || self.password_file.is_some()) {
            errors.push((
                "nats_auth.creds_file",
                "set a password or a creds_file, not both".into(),
            ));
        }
        if self.password.is_some() && self.password_file.is_some() {
            errors.push((
                "nats_auth.password_file",
                "set password or password_file, not both".into(),
            ));
        }
        errors.extend(crate::tls::check_settings(
            "nats_auth.cert_file",
            &self.cert_file,
            &self.key_file,
            [
                ("nats_auth.password_file", &self.password_file),
                ("nats_auth.creds_file", &self.creds_file),
                ("nats_auth.ca_file", &self.ca_file),
                ("nats_auth.cert_file", &self.cert_file),
                ("nats_auth.key_file", &self.key_file),
            ],
        ));
        errors
    }

    /// True when TLS is configured (a CA to trust or a client certificate).
    pub fn tls(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some()
    }

    /// Connect options carrying these credentials and TLS settings; the caller adds its
    /// name, timeouts and callbacks. The TLS files are read and checked here, so a missing
    /// or wrong one is an error naming its setting rather than a failed handshake later.
    pub fn connect_options(&self) -> Result<async_nats::ConnectOptions, NatsAuthError> {
        let mut options = async_nats::ConnectOptions::new();
        if let Some(path) = &self.creds_file {
            // Read here rather than by async-nats at connect: a missing or malformed file
            // is an error naming the setting before any connection is tried.
            let creds_error = |source| NatsAuthError::CredsFile {
                path: path.clone(),
                source,
            };
            let text = std::fs::read_to_string(path).map_err(creds_error)?;
            options = options.credentials(&text).map_err(creds_error)?;
        }
        if let Some(user) = &self.user {
            let password = match (&self.password, &self.password_file) {
                (Some(p), _) => Some(p.clone()),
                (None, Some(path)) => Some(read_secret(path)?),
                (None, None) => None,
            };
            if let Some(password) = password {
                options = options.user_and_password(user.clone(), password);
            }
            options = options.custom_inbox_prefix(metronome_protocol::names::inbox_prefix(user));
        }
        if let Some(ca) = &self.ca_file {
            crate::tls::read_certificates("nats_auth.ca_file", ca)?;
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            crate::tls::read_certificates("nats_auth.cert_file", cert)?;
            crate::tls::read_private_key("nats_auth.key_file", key)?;
            options = options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        Ok(options)
    }
}

/// The servers of a `nats_url` setting: one URL, or several separated by commas (every
/// node of a NATS cluster: `nats://10.0.0.1:4222,nats://10.0.0.2:4222`). A client given
/// every node can make its first connection while any one of them is down; once
/// connected it also learns the cluster's other nodes from the server, but only after
/// that first connection. Passed as is to `ConnectOptions::connect`.
pub fn server_urls(setting: &str) -> Vec<&str> {
    setting
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// Why a `nats_url` setting cannot be used, or `None`: every comma-separated entry must be
/// a NATS server address (`nats://`, `tls://`, `ws://`, `wss://` or a bare `host:port`).
pub fn check_server_urls(setting: &str) -> Option<String> {
    let urls = server_urls(setting);
    if urls.is_empty() {
        return Some("names no server".into());
    }
    urls.iter().find_map(|url| {
        url.parse::<async_nats::ServerAddr>()
            .err()
            .map(|e| format!("{url:?} is not a NATS server address: {e}"))
    })
}

fn read_secret(path: &Path) -> Result<String, NatsAuthError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
        .map_err(|source| NatsAuthError::PasswordFile {
            path: path.to_path_buf(),
            source,
        })
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `url` with any password replaced by `***`, for logs and `--check-config`
/// (`redis://worker:secret@host:6379/` → `redis://worker:***@host:6379/`).
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn environment_sets_and_clears_fields() {
        let mut auth = NatsAuth {
            ca_file: Some("/etc/ca.pem".into()),
            ..NatsAuth::default()
        };
        auth.apply_env(env(&[
            (ENV_USER, "worker-n1-gpu0"),
            (ENV_PASSWORD, "s3cret"),
            (ENV_CA, ""),
        ]));
        assert_eq!(auth.user.as_deref(), Some("worker-n1-gpu0"));
        assert_eq!(auth.password.as_deref(), Some("s3cret"));
        assert_eq!(auth.ca_file, None);
    }

    #[test]
    fn inconsistent_settings_are_named() {
        let fields = |a: &NatsAuth| a.validate().into_iter().map(|(f, _)| f).collect::<Vec<_>>();
        assert!(fields(&NatsAuth::default()).is_empty());
        let no_password = NatsAuth {
            user: Some("gateway".into()),
            ..NatsAuth::default()
        };
        assert_eq!(fields(&no_password), ["nats_auth.password"]);
        let bad_user = NatsAuth {
            user: Some("a.b".into()),
            password: Some("p".into()),
            ..NatsAuth::default()
        };
        assert_eq!(fields(&bad_user), ["nats_auth.user"]);
        let half_cert = NatsAuth {
            cert_file: Some("/nonexistent/cert.pem".into()),
            ..NatsAuth::default()
        };
        assert_eq!(
            fields(&half_cert),
            ["nats_auth.cert_file", "nats_auth.cert_file"]
        );
    }

    #[test]
    fn a_creds_file_replaces_the_password() {
        let fields = |a: &NatsAuth| a.validate().into_iter().map(|(f, _)| f).collect::<Vec<_>>();
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("admin.creds");
        std::fs::write(&creds, "not yet parsed by validate").unwrap();
        let alone = NatsAuth {
            creds_file: Some(creds.clone()),
            ..NatsAuth::default()
        };
        assert!(fields(&alone).is_empty());
        // A user beside it names the inbox prefix only: no password needed.
        let named = NatsAuth {
            user: Some("admin".into()),
            ..alone.clone()
        };
        assert!(fields(&named).is_empty());
        let both = NatsAuth {
            password: Some("p".into()),
            ..named
        };
        assert_eq!(fields(&both), ["nats_auth.creds_file"]);
        let mut from_env = NatsAuth::default();
        from_env.apply_env(env(&[(ENV_CREDS, creds.to_str().unwrap())]));
        assert_eq!(from_env.creds_file, Some(creds));
        // Parsed when the options are built: no JWT and seed in it, an error naming it.
        let err = alone.connect_options().map(|_| ()).unwrap_err();
        assert!(matches!(err, NatsAuthError::CredsFile { .. }), "{err}");
    }

    #[test]
    fn the_password_never_prints() {
        let auth = NatsAuth {
            user: Some("gateway".into()),
            password: Some("hunter2-very-secret".into()),
            ..NatsAuth::default()
        };
        let debug = format!("{auth:?}");
        let json = serde_json::to_string(&auth).unwrap();
        for shown in [debug, json] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("<redacted>"), "{shown}");
        }
    }

    #[test]
    fn password_file_is_read_without_its_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "from-file\n").unwrap();
        assert_eq!(read_secret(&path).unwrap(), "from-file");
        let missing = NatsAuth {
            user: Some("u".into()),
            password_file: Some(dir.path().join("missing")),
            ..NatsAuth::default()
        };
        assert!(matches!(
            missing.connect_options(),
            Err(NatsAuthError::PasswordFile { .. })
        ));
    }

    #[test]
    fn a_missing_ca_file_is_refused_before_connecting() {
        let dir = tempfile::tempdir().unwrap();
        let auth = NatsAuth {
            ca_file: Some(dir.path().join("ca.pem")),
            ..NatsAuth::default()
        };
        let err = auth.connect_options().map(|_| ()).unwrap_err();
        assert!(matches!(err, NatsAuthError::TlsFile(_)), "{err}");
        assert!(err.to_string().starts_with("nats_auth.ca_file: "), "{err}");
    }

    #[test]
    fn a_cluster_is_every_comma_separated_node() {
        assert_eq!(
            server_urls("nats://10.0.0.1:4222, nats://10.0.0.2:4222,,nats://10.0.0.3:4222"),
            [
                "nats://10.0.0.1:4222",
                "nats://10.0.0.2:4222",
                "nats://10.0.0.3:4222"
            ]
        );
        assert_eq!(
            server_urls("nats://127.0.0.1:4222"),
            ["nats://127.0.0.1:4222"]
        );
        assert_eq!(check_server_urls("nats://a:1,tls://b:2,c:3"), None);
        assert!(check_server_urls(" , ").is_some());
        let bad = check_server_urls("nats://a:1,http://b:2").expect("refused");
        assert!(bad.contains("http://b:2"), "{bad}");
    }

    #[test]
    fn urls_lose_their_password() {
        assert_eq!(
            redact_url("redis://agent-n1:s3cret@10.0.0.1:6379/"),
            "redis://agent-n1:***@10.0.0.1:6379/"
        );
        assert_eq!(
            redact_url("redis://10.0.0.1:6379/"),
            "redis://10.0.0.1:6379/"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }
}
