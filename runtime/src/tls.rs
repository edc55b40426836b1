//! The PEM files behind a TLS connection (a CA to trust, a client certificate and its key),
//! read and checked before any connection is tried.
//!
//! Why check them here: the NATS and Redis clients read these files themselves, at the
//! first connection, and a missing or wrong file then shows as a handshake or I/O error far
//! from the setting that caused it. Reading them at start-up gives one error that names the
//! setting and the file (`nats_auth.ca_file: /etc/metronome/tls/ca.pem: No such file or
//! directory`), and a CA file without a single certificate (a key, an empty file, a DER
//! file) is refused the same way instead of failing every handshake with "unknown issuer".

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The settings-level checks of a set of TLS files, as `(field, message)`: a client
/// certificate needs its key (and the other way round; reported on `cert_setting`), and every
/// file named must be a readable file.
pub fn check_settings<'a>(
    cert_setting: &'static str,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
    files: impl IntoIterator<Item = (&'static str, &'a Option<PathBuf>)>,
) -> Vec<(&'static str, String)> {
    let mut errors = Vec::new();
    if cert.is_some() != key.is_some() {
        errors.push((
            cert_setting,
            "a client certificate needs both cert_file and key_file".into(),
        ));
    }
    for (field, path) in files {
        if let Some(p) = path {
            if !p.is_file() {
                errors.push((field, format!("{} is not a readable file", p.display())));
            }
        }
    }
    errors
}

/// What is wrong with one PEM file.
#[derive(Debug, thiserror::Error)]
pub enum TlsFileError {
    #[error("{setting}: reading {path}: {source}")]
    Read {
        /// The setting that named the file (`nats_auth.ca_file`, `redis_tls.key_file`).
        setting: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{setting}: {path} holds no PEM {expected} ({reason})")]
    Content {
        setting: &'static str,
        path: PathBuf,
        /// `certificate` or `private key`.
        expected: &'static str,
        reason: String,
    },
}

/// The bytes of a PEM file holding at least one certificate (a CA bundle or a client
/// certificate chain).
pub fn read_certificates(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    let bytes = read(setting, path)?;
    let mut count = 0;
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        cert.map_err(|e| content(setting, path, "certificate", e.to_string()))?;
        count += 1;
    }
    if count == 0 {
        return Err(content(
            setting,
            path,
            "certificate",
            "no BEGIN CERTIFICATE section".into(),
        ));
    }
    Ok(bytes)
}

/// The bytes of a PEM file holding a private key (PKCS#8, PKCS#1 or SEC1).
pub fn read_private_key(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    let bytes = read(setting, path)?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| content(setting, path, "private key", e.to_string()))?;
    Ok(bytes)
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsFileError> {
    std::fs::read(path).map_err(|source| TlsFileError::Read {
        setting,
        path: path.to_path_buf(),
        source,
    })
}

fn content(
    setting: &'static str,
    path: &Path,
    expected: &'static str,
    reason: String,
) -> TlsFileError {
    TlsFileError::Content {
        setting,
        path: path.to_path_buf(),
        expected,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A syntactically valid PEM section; the content is not parsed as X.509 here.
    const CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    const KEY: &str = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n";

    #[test]
    fn a_missing_file_names_the_setting_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        let err = read_certificates("nats_auth.ca_file", &path).unwrap_err();
        assert!(matches!(err, TlsFileError::Read { .. }));
        let text = err.to_string();
        assert!(text.starts_with("nats_auth.ca_file: reading "), "{text}");
        assert!(text.contains("ca.pem"), "{text}");
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        for text in ["", "not pem at all\n", KEY] {
            std::fs::write(&path, text).unwrap();
            let err = read_certificates("redis_tls.ca_file", &path).unwrap_err();
            assert!(
                matches!(err, TlsFileError::Content { .. }),
                "{text:?}: {err}"
            );
        }
        std::fs::write(&path, format!("{CERT}{CERT}")).unwrap();
        assert!(read_certificates("redis_tls.ca_file", &path).is_ok());
    }

    #[test]
    fn a_key_file_must_hold_a_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        std::fs::write(&path, CERT).unwrap();
        assert!(matches!(
            read_private_key("nats_auth.key_file", &path),
            Err(TlsFileError::Content { .. })
        ));
        std::fs::write(&path, KEY).unwrap();
        assert!(read_private_key("nats_auth.key_file", &path).is_ok());
    }
}
