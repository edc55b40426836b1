//! The `metronome-loadgen` binary: flag handling, config checking, and a short run against
//! an in-process simulated GPU writing every output.

use metronome_gpu_sim::{SimGpu, SimGpuConfig};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

fn loadgen() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_metronome-loadgen"));
    c.env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("METRONOME_LOADGEN_MODEL")
        .env("RUST_LOG", "warn");
    c
}

#[tokio::test]
async fn check_config_reports_every_field_error() {
    let out = loadgen()
        .args(["--check-config", "--rate", "0", "--max-in-flight", "0"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for field in ["model:", "max_in_flight:", "workload.rate_rps:", "limit:"] {
        assert!(err.contains(field), "{field} missing in {err}");
    }

    let out = loadgen()
        .args([
            "--check-config",
            "--model",
            "m",
            "--rate",
            "3",
            "--duration",
            "10",
        ])
        .env("OPENAI_BASE_URL", "http://gw.example:9000/v1")
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let toml = String::from_utf8_lossy(&out.stdout);
    assert!(
        toml.contains("base_url = \"http://gw.example:9000/v1\""),
        "{toml}"
    );
    assert!(toml.contains("rate_rps = 3.0"), "{toml}");

    let out = loadgen()
        .args([
            "--check-config",
            "--model",
            "m",
            "--rate",
            "3",
            "--limit",
            "1",
            "--time-scale",
            "2",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "time scale needs a trace (clap or spec error)"
    );
}

#[tokio::test]
async fn trace_stats_prints_the_mean_rate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    std::fs::write(
        &path,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,1\n2,10,3\n4,10,5\n",
    )
    .unwrap();
    let out = loadgen()
        .args(["--trace-stats", "--trace"])
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mean_rate_rps"], serde_json::json!(0.5));
    assert_eq!(v["output_tokens"]["mean"], serde_json::json!(3.0));

    std::fs::write(&path, "0,10,1\n2,ten,3\n").unwrap();
    let out = loadgen()
        .args(["--trace-stats", "--trace"])
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
}

#[tokio::test]
async fn short_runs_write_outputs_and_print_the_summary() {
    let shutdown = CancellationToken::new();
    let gpu = SimGpu::spawn(
        SimGpuConfig {
            base_step_ms: 1.0,
            ..SimGpuConfig::new("sim-model")
        },
        shutdown.clone(),
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let base = format!("{}/v1", gpu.base_url());

    let poisson_out = dir.path().join("poisson");
    let out = loadgen()
        .args([
            "--base-url",
            &base,
            "--model",
            "sim-model",
            "--rate",
            "50",
            "--limit",
            "6",
        ])
        .args([
            "--prompt-tokens",
            "fixed:32",
            "--output-tokens",
            "fixed:5",
            "--quiet",
            "--out",
        ])
        .arg(&poisson_out)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("requests 6  ok 6  errors 0"), "{table}");
    assert!(table.contains("goodput"), "{table}");
    for f in [
        "requests.csv",
        "summary.json",
        "latency_cdf.svg",
        "tokens_per_s_cdf.svg",
        "latency_over_time.svg",
    ] {
        assert!(
            std::fs::metadata(poisson_out.join(f)).unwrap().len() > 0,
            "{f}"
        );
    }

    let trace = dir.path().join("t.csv");
    std::fs::write(
        &trace,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n0,40,3\n1,50,4\n2,60,5\n",
    )
    .unwrap();
    let trace_out = dir.path().join("trace");
    let out = loadgen()
        .args([
            "--base-url",
            &base,
            "--model",
            "sim-model",
            "--endpoint",
            "completions",
            "--time-scale",
            "0.01",
            "--quiet",
            "--trace",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&trace_out)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace_out.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["count"], serde_json::json!(3));
    assert_eq!(summary["ok"], serde_json::json!(3));
    shutdown.cancel();
    gpu.join().await;
}
