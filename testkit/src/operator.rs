//! An operator-mode `nats-server` setup for tests of `.creds` files: a throwaway operator,
//! one account with JetStream, and users of that account, each written as the `.creds`
//! file `nsc` would write (the user's JWT and its nkey seed).
//!
//! The JWTs follow NATS's v2 format (nats-io/jwt): a header `{"typ":"JWT","alg":
//! "ed25519-nkey"}`, the claims (`iss` the signer's public nkey, `sub` the subject's, the
//! kind-specific part under `nats` with `version: 2`), each base64url without padding,
//! and the ed25519 signature of `header.claims` by the issuer's nkey. The operator signs
//! itself and the accounts, the account signs its users. The server is given the operator
//! JWT and the accounts' JWTs through `resolver: MEMORY` with `resolver_preload`
//! (nats-server 2.9), with a system account, which its JetStream needs; nothing else is
//! needed to run it.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use nkeys::KeyPair;
use serde_json::{json, Value};

use crate::error::TestkitError;

/// A throwaway operator and one account with JetStream.
pub struct TestOperator {
    account: KeyPair,
    operator_jwt: String,
    account_jwt: String,
    /// The system account (nats-server's JetStream needs one in operator mode).
    system: KeyPair,
    system_jwt: String,
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A v2 JWT of `claims` (`iss`, `iat` and `jti` added) signed by `issuer`.
fn encode(issuer: &KeyPair, mut claims: Value) -> String {
    let iat = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    claims["iss"] = json!(issuer.public_key());
    claims["iat"] = json!(iat);
    // A unique id; the server does not recompute it (nsc's is a hash of the claims).
    claims["jti"] = json!(KeyPair::new_user().public_key());
    let header = b64(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body = b64(claims.to_string().as_bytes());
    let signed = format!("{header}.{body}");
    let signature = issuer.sign(signed.as_bytes()).expect("ed25519 signs");
    format!("{signed}.{}", b64(&signature))
}

impl TestOperator {
    pub fn generate() -> TestOperator {
        let operator = KeyPair::new_operator();
        let account = KeyPair::new_account();
        let operator_jwt = encode(
            &operator,
            json!({
                "sub": operator.public_key(),
                "name": "metronome-test",
                "nats": {"type": "operator", "version": 2},
            }),
        );
        // -1: unlimited; JetStream is on for an account whose storage limits are not 0.
        let account_jwt = encode(
            &operator,
            json!({
                "sub": account.public_key(),
                "name": "metronome",
                "nats": {
                    "type": "account",
                    "version": 2,
                    "limits": {
                        "subs": -1, "data": -1, "payload": -1, "imports": -1,
                        "exports": -1, "wildcards": true, "conn": -1, "leaf": -1,
                        "mem_storage": -1, "disk_storage": -1, "streams": -1,
                        "consumer": -1,
                    },
                },
            }),
        );
        let system = KeyPair::new_account();
        let system_jwt = encode(
            &operator,
            json!({
                "sub": system.public_key(),
                "name": "SYS",
                "nats": {"type": "account", "version": 2, "limits": {
                    "subs": -1, "data": -1, "payload": -1, "imports": -1,
                    "exports": -1, "wildcards": true, "conn": -1, "leaf": -1,
                }},
            }),
        );
        TestOperator {
            account,
            operator_jwt,
            account_jwt,
            system,
            system_jwt,
        }
    }

    /// The server configuration (for [`crate::NatsServer::start_with_config`]): the
    /// operator, and the account preloaded into a memory resolver.
    pub fn server_config(&self) -> String {
        format!(
            "operator: {}\nsystem_account: {}\nresolver: MEMORY\nresolver_preload: {{\n  {}: {}\n  {}: {}\n}}\n",
            self.operator_jwt,
            self.system.public_key(),
            self.account.public_key(),
            self.account_jwt,
            self.system.public_key(),
            self.system_jwt
        )
    }

    /// The `.creds` text of a new user `name` of the account, allowed everything.
    pub fn user_creds(&self, name: &str) -> String {
        let user = KeyPair::new_user();
        let jwt = encode(
            &self.account,
            json!({
                "sub": user.public_key(),
                "name": name,
                "nats": {
                    "type": "user",
                    "version": 2,
                    "pub": {}, "sub": {},
                    "subs": -1, "data": -1, "payload": -1,
                },
            }),
        );
        let seed = user.seed().expect("a generated key has a seed");
        format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\
             NKEYs are sensitive and should be treated as secrets.\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
             *************************************************************\n"
        )
    }

    /// [`TestOperator::user_creds`] written to `dir/<name>.creds` (mode 0600, as `nsc`
    /// writes it); returns the path.
    pub fn write_user_creds(&self, dir: &Path, name: &str) -> Result<PathBuf, TestkitError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(format!("{name}.creds"));
        let io = |source| TestkitError::Io {
            what: path.display().to_string(),
            source,
        };
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut f| f.write_all(self.user_creds(name).as_bytes()))
            .map_err(io)?;
        Ok(path)
    }
}
