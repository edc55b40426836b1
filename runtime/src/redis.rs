//! How every binary that reads or writes the EWMAs (the dispatcher, the worker-agent, the
//! gateway's console) opens its Redis client: the URL (`redis://` or, with TLS,
//! `rediss://`, credentials in its user part) and one [`RedisTls`] block of settings (the
//! `[redis_tls]` table of each binary's configuration, `METRONOME_REDIS_*` in the
//! environment), turned into a [`::redis::Client`] by [`RedisTls::client`].
//!
//! Why a CA file rather than the system's trust store: the fleet's Redis presents a
//! certificate from the provisioning's private CA (ansible/roles/metronome/tasks/tls.yml),
//! which no system trusts. Without `ca_file` a `rediss://` URL trusts the system's roots,
//! as redis-rs does by default.
//!
//! The same block takes `password_file` (`METRONOME_REDIS_PASSWORD_FILE`): the password of
//! the URL's user read from a file, such as a systemd credential, so that no configuration
//! file holds it (the URL then names the user only, `rediss://gateway@host:6379/`).
//!
//! Invariant: TLS settings are never silently ignored. Setting a CA or client certificate
//! with a plain `redis://` URL is a configuration error, not a plain-text connection.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::tls::{read_certificates, read_private_key, TlsFileError};

/// Environment variables read by [`RedisTls::apply_env`], the same for every binary.
pub const ENV_CA: &str = "METRONOME_REDIS_CA";
pub const ENV_CERT: &str = "METRONOME_REDIS_CERT";
pub const ENV_KEY: &str = "METRONOME_REDIS_KEY";
pub const ENV_PASSWORD_FILE: &str = "METRONOME_REDIS_PASSWORD_FILE";

/// TLS settings of one Redis connection. None set: the URL alone decides (`redis://`
/// plain text, `rediss://` TLS trusting the system's roots).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisTls {
    /// PEM file of the CA that signed the server's certificate (`METRONOME_REDIS_CA`).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for servers with `tls-auth-clients yes`
    /// (`METRONOME_REDIS_CERT`).
    pub cert_file: Option<PathBuf>,
    /// Its PEM private key (`METRONOME_REDIS_KEY`).
    pub key_file: Option<PathBuf>,
    /// A file holding the password of the URL's user (`METRONOME_REDIS_PASSWORD_FILE`),
    /// one line; the URL must then carry a user and no password.
    pub password_file: Option<PathBuf>,
}

/// Why a Redis client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RedisClientError {
    #[error(transparent)]
    TlsFile(#[from] TlsFileError),
    #[error("redis_url {url:?} must start with rediss:// when redis_tls is set")]
    NotTls { url: String },
    #[error("reading the Redis password file {path}: {source}")]
    PasswordFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("redis_url {url}: {source}")]
    Client {
        /// The URL without its password.
        url: String,
        source: ::redis::RedisError,
    },
}

impl RedisTls {
    /// Override fields with the `METRONOME_REDIS_*` variables found through `lookup`; an
    /// empty value clears the field.
    pub fn apply_env(&mut self, lookup: impl Fn(&str) -> Option<String>) {
        let path = |v: String| (!v.is_empty()).then(|| PathBuf::from(v));
        if let Some(v) = lookup(ENV_CA) {
            self.ca_file = path(v);
        }
        if let Some(v) = lookup(ENV_CERT) {
            self.cert_file = path(v);
        }
        if let Some(v) = lookup(ENV_KEY) {
            self.key_file = path(v);
        }
        if let Some(v) = lookup(ENV_PASSWORD_FILE) {
            self.password_file = path(v);
        }
    }

    /// True when any setting is made (a TLS file or the password file).
    pub fn is_set(&self) -> bool {
        self.tls_set() || self.password_file.is_some()
    }

    /// True when any TLS file is set.
    fn tls_set(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }

    /// Every inconsistent setting as `(field, message)`, given the URL they go with.
    pub fn validate(&self, url: &str) -> Vec<(&'static str, String)> {
        let mut errors = Vec::new();
        if self.tls_set() && !is_tls_url(url) {
            errors.push((
                "redis_url",
                format!(
                    "{:?} must start with rediss:// when redis_tls is set",
                    crate::nats::redact_url(url)
                ),
            ));
        }
        errors.extend(crate::tls::check_settings(
            "redis_tls.cert_file",
            &self.cert_file,
            &self.key_file,
            [
                ("redis_tls.ca_file", &self.ca_file),
                ("redis_tls.cert_file", &self.cert_file),
                ("redis_tls.key_file", &self.key_file),
                ("redis_tls.password_file", &self.password_file),
            ],
        ));
        if self.password_file.is_some() {
            let (user, password) = url_credentials(url);
            if !user || password {
                errors.push((
                    "redis_url",
                    format!(
                        "{:?} must name a user and no password when redis_tls.password_file is set",
                        crate::nats::redact_url(url)
                    ),
                ));
            }
        }
        errors
    }

    /// A client for `url` that trusts `ca_file` and presents the client certificate, if
    /// set. Opens no connection; the files are read and checked now.
    pub fn client(&self, url: &str) -> Result<::redis::Client, RedisClientError> {
        let client_error = |source| RedisClientError::Client {
            url: crate::nats::redact_url(url),
            source,
        };
        let mut info =
            ::redis::IntoConnectionInfo::into_connection_info(url).map_err(client_error)?;
        if let Some(path) = &self.password_file {
            let password = std::fs::read_to_string(path)
                .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
                .map_err(|source| RedisClientError::PasswordFile {
                    path: path.clone(),
                    source,
                })?;
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        if !self.tls_set() {
            return ::redis::Client::open(info).map_err(client_error);
        }
        if !is_tls_url(url) {
            return Err(RedisClientError::NotTls {
                url: crate::nats::redact_url(url),
            });
        }
        let root_cert = self
            .ca_file
            .as_deref()
            .map(|p| read_certificates("redis_tls.ca_file", p))
            .transpose()?;
        let client_tls = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some(::redis::ClientTlsConfig {
                client_cert: read_certificates("redis_tls.cert_file", cert)?,
                client_key: read_private_key("redis_tls.key_file", key)?,
            }),
            _ => None,
        };
        ::redis::Client::build_with_tls(
            info,
            ::redis::TlsCertificates {
                client_tls,
                root_cert,
            },
        )
        .map_err(client_error)
    }
}

/// Whether `url` names a user, and whether it carries a password.
fn url_credentials(url: &str) -> (bool, bool) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => match userinfo.split_once(':') {
            Some((user, password)) => (!user.is_empty(), !password.is_empty()),
            None => (!userinfo.is_empty(), false),
        },
        None => (false, false),
    }
}

fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn environment_sets_and_clears_fields() {
        let vars: HashMap<&str, &str> = [(ENV_CA, "/etc/metronome/tls/ca.pem"), (ENV_KEY, "")]
            .into_iter()
            .collect();
        let mut tls = RedisTls {
            key_file: Some("/old.key".into()),
            ..RedisTls::default()
        };
        tls.apply_env(|k| vars.get(k).map(|v| v.to_string()));
        assert_eq!(
            tls.ca_file.as_deref(),
            Some(std::path::Path::new("/etc/metronome/tls/ca.pem"))
        );
        assert_eq!(tls.key_file, None);
    }

    #[test]
    fn tls_files_need_a_rediss_url() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "x").unwrap();
        let tls = RedisTls {
            ca_file: Some(ca),
            ..RedisTls::default()
        };
        let fields = |url| {
            tls.validate(url)
                .into_iter()
                .map(|(f, _)| f)
                .collect::<Vec<_>>()
        };
        assert_eq!(fields("redis://u:secret@10.0.0.1:6379/"), ["redis_url"]);
        assert!(fields("rediss://10.0.0.1:6379/").is_empty());
        let err = tls.client("redis://u:secret@10.0.0.1:6379/").unwrap_err();
        assert!(matches!(err, RedisClientError::NotTls { .. }), "{err}");
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn a_missing_ca_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let tls = RedisTls {
            ca_file: Some(dir.path().join("ca.pem")),
            ..RedisTls::default()
        };
        assert_eq!(
            tls.validate("rediss://127.0.0.1:6379/")
                .into_iter()
                .map(|(f, _)| f)
                .collect::<Vec<_>>(),
            ["redis_tls.ca_file"]
        );
        let err = tls.client("rediss://127.0.0.1:6379/").unwrap_err();
        assert!(
            err.to_string().starts_with("redis_tls.ca_file: reading "),
            "{err}"
        );
    }

    #[test]
    fn the_password_file_completes_a_url_naming_the_user() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("password");
        std::fs::write(&path, "from-the-file\n").unwrap();
        let settings = RedisTls {
            password_file: Some(path),
            ..RedisTls::default()
        };
        assert!(settings
            .validate("redis://gateway@10.0.0.1:6379/")
            .is_empty());
        let client = settings.client("redis://gateway@10.0.0.1:6379/").unwrap();
        let redis = client.get_connection_info().redis_settings();
        assert_eq!(redis.username(), Some("gateway"));
        assert_eq!(redis.password(), Some("from-the-file"));
        // A URL without a user, or one that carries a password too, is refused.
        for url in [
            "redis://10.0.0.1:6379/",
            "redis://gateway:other@10.0.0.1:6379/",
        ] {
            let fields: Vec<_> = settings.validate(url).into_iter().map(|(f, _)| f).collect();
            assert_eq!(fields, ["redis_url"], "{url}");
        }
        // The file is no TLS setting: a plain URL stays plain.
        assert!(settings
            .validate("redis://gateway@127.0.0.1:6379/")
            .is_empty());
    }

    #[test]
    fn a_missing_password_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let settings = RedisTls {
            password_file: Some(dir.path().join("password")),
            ..RedisTls::default()
        };
        let fields: Vec<_> = settings
            .validate("redis://gateway@127.0.0.1:6379/")
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(fields, ["redis_tls.password_file"]);
        let err = settings
            .client("redis://gateway@127.0.0.1:6379/")
            .unwrap_err();
        assert!(
            matches!(err, RedisClientError::PasswordFile { .. }),
            "{err}"
        );
    }

    #[test]
    fn without_tls_settings_the_url_decides() {
        let tls = RedisTls::default();
        assert!(tls.validate("redis://127.0.0.1:6379/").is_empty());
        assert!(tls.client("redis://127.0.0.1:6379/").is_ok());
        assert!(tls.client("rediss://127.0.0.1:6379/").is_ok());
    }
}
