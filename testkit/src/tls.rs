//! A throwaway private CA for tests of TLS: a CA certificate, a server certificate for
//! `127.0.0.1` and `localhost`, and a client certificate, all made with the `openssl` CLI
//! in a temporary folder, the same kind of chain provisioning makes for the fleet
//! (ansible/roles/metronome/tasks/tls.yml).
//!
//! Why the `openssl` CLI: it is what provisioning uses, so a test passing here says the
//! extensions provisioning writes (CA basic constraints, IP subject names, key usages)
//! satisfy both the servers (Go's TLS in nats-server, OpenSSL in redis-server) and the
//! clients (rustls, which refuses a server certificate without a matching subject name).

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

use crate::error::TestkitError;
use crate::process::find_binary;

/// A private CA and the certificates it signed, removed on drop. Keep it alive as long as
/// the servers using it (a restart reads the files again).
pub struct TestCa {
    dir: TempDir,
}

impl TestCa {
    /// Generate a CA (`ca.pem`), a server certificate (`server.pem`, `server.key`) and a
    /// client certificate (`client.pem`, `client.key`) signed by it; fails with an
    /// install hint when `openssl` is missing.
    pub fn generate() -> Result<TestCa, TestkitError> {
        let openssl = find_binary("openssl", "openssl")?;
        let dir = tempfile::Builder::new()
            .prefix("metronome-ca-")
            .tempdir()
            .map_err(|source| TestkitError::Io {
                what: "temporary folder".into(),
                source,
            })?;
        let d = dir.path();
        let run = |args: &[&str]| -> Result<(), TestkitError> {
            let out = Command::new(&openssl)
                .current_dir(d)
                .args(args)
                .output()
                .map_err(|source| TestkitError::Io {
                    what: "openssl".into(),
                    source,
                })?;
            if out.status.success() {
                Ok(())
            } else {
                Err(TestkitError::Io {
                    what: format!("openssl {}", args.join(" ")),
                    source: std::io::Error::other(
                        String::from_utf8_lossy(&out.stderr).into_owned(),
                    ),
                })
            }
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        run(&[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=metronome-test-ca",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        ]
        .concat())?;
        for (name, usage, san) in [
            (
                "server",
                "serverAuth",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ),
            (
                "client",
                "clientAuth",
                "subjectAltName=DNS:metronome-test-client",
            ),
        ] {
            let (key, pem) = (format!("{name}.key"), format!("{name}.pem"));
            let eku = format!("extendedKeyUsage={usage}");
            run(&[
                &["req", "-x509", "-CA", "ca.pem", "-CAkey", "ca.key"][..],
                &ec,
                &[
                    "-keyout",
                    &key,
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN={name}"),
                    "-addext",
                    "basicConstraints=critical,CA:FALSE",
                    "-addext",
                    "keyUsage=critical,digitalSignature",
                    "-addext",
                    &eku,
                    "-addext",
                    san,
                ],
            ]
            .concat())?;
        }
        Ok(TestCa { dir })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The CA certificate clients trust.
    pub fn ca_file(&self) -> PathBuf {
        self.file("ca.pem")
    }

    /// The server certificate (subject names `127.0.0.1` and `localhost`).
    pub fn server_cert(&self) -> PathBuf {
        self.file("server.pem")
    }

    pub fn server_key(&self) -> PathBuf {
        self.file("server.key")
    }

    /// A client certificate, for servers that verify clients.
    pub fn client_cert(&self) -> PathBuf {
        self.file("client.pem")
    }

    pub fn client_key(&self) -> PathBuf {
        self.file("client.key")
    }

    /// The folder holding every file.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// nats-server's `tls {}` block serving the server certificate. With `verify_clients`
    /// the server also requires a client certificate signed by the CA.
    pub fn nats_config(&self, verify_clients: bool) -> String {
        format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: {verify_clients}\n  timeout: 5\n}}\n",
            self.server_cert(),
            self.server_key(),
            self.ca_file()
        )
    }
}
