//! What a simulated GPU shows under load: starts one in-process GPU with the calibrated
//! defaults, sends `concurrency` simultaneous streamed completions of `prompt` prompt tokens
//! and `output` output tokens, and prints TTFT and TPOT (wall clock, as a client sees them)
//! with the preemptions the load caused.
//!
//! ```sh
//! cargo run -p metronome-gpu-sim --example overload -- 64 500 300 [speed]
//! ```

use std::time::{Duration, Instant};

use futures::StreamExt;
use metronome_gpu_sim::{SimGpu, SimGpuConfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;

struct Sample {
    ttft: Duration,
    tpot: Duration,
    tokens: usize,
}

async fn one(
    http: reqwest::Client,
    url: String,
    prompt: u32,
    output: u32,
) -> anyhow::Result<Sample> {
    let body = json!({
        "model": "llama-3.1-8b", "prompt": "x", "stream": true,
        "max_tokens": output, "metronome_prompt_tokens": prompt,
    });
    let started = Instant::now();
    let mut stream = http
        .post(url)
        .json(&body)
        .send()
        .await?
        .error_for_status()?
        .bytes_stream();
    let mut first = None;
    let mut tokens = 0;
    let mut buffer = String::new();
    while let Some(bytes) = stream.next().await {
        buffer.push_str(&String::from_utf8_lossy(&bytes?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            if event.contains("\"finish_reason\":null") {
                tokens += 1;
                first.get_or_insert_with(Instant::now);
            }
        }
    }
    let first = first.ok_or_else(|| anyhow::anyhow!("no token"))?;
    let decode = first.elapsed();
    Ok(Sample {
        ttft: first - started,
        tpot: decode / (tokens.max(2) as u32 - 1),
        tokens,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: f64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (concurrency, prompt, output, speed) = (
        arg(0, 16.0) as usize,
        arg(1, 500.0) as u32,
        arg(2, 300.0) as u32,
        arg(3, 1.0),
    );

    let shutdown = CancellationToken::new();
    let gpu = SimGpu::spawn(
        SimGpuConfig {
            speed,
            ..SimGpuConfig::new("llama-3.1-8b")
        },
        shutdown.clone(),
    )
    .await?;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", gpu.base_url());
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| tokio::spawn(one(http.clone(), url.clone(), prompt, output)))
        .collect();
    let mut samples = Vec::new();
    for t in tasks {
        samples.push(t.await??);
    }
    let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
    let mut tpot: Vec<Duration> = samples.iter().map(|s| s.tpot).collect();
    ttft.sort();
    tpot.sort();
    let stats = gpu.stats();
    println!(
        "concurrency={concurrency} prompt={prompt} output={output} speed={speed}: all got {output} tokens: {}\n\
         TTFT p50 {:.0} ms, max {:.0} ms; TPOT p50 {:.1} ms, max {:.1} ms; preemptions {}, recomputed tokens {}, simulated busy {:.2} s",
        samples.iter().all(|s| s.tokens == output as usize),
        percentile(&ttft, 0.5).as_secs_f64() * 1e3,
        ttft.last().unwrap().as_secs_f64() * 1e3,
        percentile(&tpot, 0.5).as_secs_f64() * 1e3,
        tpot.last().unwrap().as_secs_f64() * 1e3,
        stats.preemptions_total,
        stats.recomputed_tokens_total,
        stats.busy_seconds_total,
    );
    shutdown.cancel();
    Ok(())
}
