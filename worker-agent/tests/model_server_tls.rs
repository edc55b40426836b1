//! An `https://` model server: the agent's client verifies its certificate against the
//! system's CAs and `model_server_ca_file`'s. The server is a real TLS server (`openssl
//! s_server -www`, which answers any GET with 200) with a certificate from a CA made for
//! the test.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use metronome_worker_agent::model_client::{HttpModelClient, ModelClient, ModelError};
use metronome_worker_agent::Config;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl is needed for this test (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`ca.pem`) and a certificate for 127.0.0.1 signed by it (`server.pem`, `server.key`).
fn certificates(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
    ]);
    openssl(dir, &ca);
    let mut server = vec!["req", "-x509", "-CA", "ca.pem", "-CAkey", "ca.key"];
    server.extend(ec);
    server.extend([
        "-keyout",
        "server.key",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-subj",
        "/CN=127.0.0.1",
        "-addext",
        "subjectAltName=IP:127.0.0.1",
        "-addext",
        "basicConstraints=critical,CA:FALSE",
        "-addext",
        "extendedKeyUsage=serverAuth",
    ]);
    openssl(dir, &server);
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `openssl s_server` on a free port of 127.0.0.1, once it accepts connections.
async fn tls_server(dir: &Path) -> (Server, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("openssl")
        .args([
            "s_server",
            "-quiet",
            "-www",
            "-cert",
            "server.pem",
            "-key",
            "server.key",
        ])
        .args(["-accept", &format!("127.0.0.1:{port}")])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_server starts");
    let server = Server(child);
    metronome_testkit::wait_for(
        "openssl s_server to listen",
        Duration::from_secs(10),
        || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    (server, port)
}

#[tokio::test]
async fn an_https_model_server_is_trusted_through_the_configured_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path());
    let (_server, port) = tls_server(dir.path()).await;
    let url = format!("https://127.0.0.1:{port}");
    let ca = dir.path().join("ca.pem");

    let trusted = HttpModelClient::new(&url, "/health", "/metrics", ca.to_str()).unwrap();
    trusted
        .health()
        .await
        .expect("the server's certificate verifies against the CA");

    let untrusted = HttpModelClient::new(&url, "/health", "/metrics", None).unwrap();
    let err = untrusted
        .health()
        .await
        .expect_err("a certificate from an unknown CA is refused");
    assert!(matches!(err, ModelError::Connect(_)), "{err:?}");
}

#[test]
fn a_ca_file_that_is_missing_or_holds_no_certificate_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    for path in [dir.path().join("missing.pem"), empty] {
        let config = Config {
            worker_id: "w".into(),
            model: "m".into(),
            model_server_url: "https://127.0.0.1:8443".into(),
            model_server_ca_file: Some(path.to_str().unwrap().into()),
            ..Config::default()
        };
        let errors = config.validate().expect_err("refused");
        assert!(
            errors.iter().any(|e| e.field == "model_server_ca_file"),
            "{path:?}: {errors:?}"
        );
    }
}
