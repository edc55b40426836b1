//! Idle check: GPU-seconds a simulated GPU sat idle while a job for its model waited, in
//! the dispatcher's queue or in another GPU's server queue — capacity that admission
//! control or placement left unused.
//!
//! Sampled every ~100 ms during a run: per GPU, `vllm:num_requests_running` and
//! `vllm:num_requests_waiting` from its own metrics; per model, the leader dispatcher's
//! `metronome_dispatcher_queue_depth`. A sample's state holds until the next sample
//! (left-endpoint rule), so the idle time is
//! `Σ_k (t_{k+1} - t_k) · #{gpu idle at k while a job for model(gpu) waits at k}` and the
//! total is `#gpus · (t_last - t_first)`. The queue gauge is refreshed on the dispatcher's
//! tick (100 ms by default), so a short idle spell right after a completion can be
//! counted; that bias is the same for every policy. Pure; the samples come from
//! [`System::sample`](metronome_loadgen::system::System::sample).

use metronome_loadgen::system::ClusterSample;
use serde::{Deserialize, Serialize};

/// Idle GPU-seconds of one run.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct IdleStats {
    pub samples: usize,
    /// GPU-seconds idle while a job for the GPU's model was queued.
    pub idle_gpu_s: f64,
    /// GPU-seconds observed (`#gpus × sampled span`).
    pub total_gpu_s: f64,
    /// `idle_gpu_s / total_gpu_s` (0 when nothing was observed).
    pub share: f64,
    /// Deepest dispatcher queue seen (all models), to show the queue was observed at all.
    #[serde(default)]
    pub max_queued: f64,
}

/// Idle accounting over samples in time order (see module docs).
pub fn idle_stats(samples: &[ClusterSample]) -> IdleStats {
    let mut idle = 0.0;
    let mut total = 0.0;
    for w in samples.windows(2) {
        let dt = (w[1].t_s - w[0].t_s).max(0.0);
        let s = &w[0];
        total += dt * s.gpus.len() as f64;
        let idle_gpus = s
            .gpus
            .iter()
            .filter(|(model, running, waiting)| {
                *running <= 0.0 && *waiting <= 0.0 && job_waits_for(s, model)
            })
            .count();
        idle += dt * idle_gpus as f64;
    }
    let max_queued = samples
        .iter()
        .map(|s| s.queued.values().sum::<f64>())
        .fold(0.0, f64::max);
    IdleStats {
        max_queued,
        samples: samples.len(),
        idle_gpu_s: idle,
        total_gpu_s: total,
        share: if total > 0.0 { idle / total } else { 0.0 },
    }
}

/// Whether a job for `model` waits at sample `s`: in the dispatcher's queue, or in the
/// waiting queue of a GPU serving that model (a job placed on a busy GPU while another sat
/// idle waits there, not in the dispatcher, and a router with no queue of its own keeps
/// all its waiting jobs there).
fn job_waits_for(s: &ClusterSample, model: &str) -> bool {
    s.queued.get(model).is_some_and(|q| *q > 0.0)
        || s.gpus
            .iter()
            .any(|(m, _, waiting)| m == model && *waiting > 0.0)
}

/// The samples as CSV, one row per sample and GPU (`gpu` is its index in the cluster):
/// `t_s,gpu,model,running,waiting,queued`, `queued` being the dispatcher's queue for the
/// GPU's model. Written beside each run's requests so a slow request can be read against
/// what its GPU was doing (a GPU that starts nothing while jobs wait for it shows as a
/// flat `running` with `queued` > 0).
pub fn samples_csv(samples: &[ClusterSample]) -> String {
    let mut out = String::from("t_s,gpu,model,running,waiting,queued\n");
    for s in samples {
        for (i, (model, running, waiting)) in s.gpus.iter().enumerate() {
            let queued = s.queued.get(model).copied().unwrap_or(0.0);
            out.push_str(&format!(
                "{:.3},{i},{},{running},{waiting},{queued}\n",
                s.t_s,
                csv_field(model)
            ));
        }
    }
    out
}

/// A CSV field: quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_become_one_row_per_gpu_with_its_models_queue() {
        let mut a = sample(0.1, &[(3.0, 0.0), (0.0, 1.0)], 2.0);
        a.gpus[1].0 = "org/m,8b".into();
        let csv = samples_csv(&[a]);
        assert_eq!(
            csv,
            "t_s,gpu,model,running,waiting,queued\n0.100,0,m,3,0,2\n0.100,1,\"org/m,8b\",0,1,0\n"
        );
    }

    fn sample(t: f64, gpus: &[(f64, f64)], queued: f64) -> ClusterSample {
        ClusterSample {
            t_s: t,
            gpus: gpus.iter().map(|&(r, w)| ("m".to_string(), r, w)).collect(),
            queued: [("m".to_string(), queued)].into_iter().collect(),
        }
    }

    #[test]
    fn counts_idle_gpus_only_while_jobs_wait() {
        let s = [
            // 0–0.1 s: GPU 1 idle, 2 jobs queued: 0.1 GPU-s idle.
            sample(0.0, &[(1.0, 0.0), (0.0, 0.0)], 2.0),
            // 0.1–0.3 s: GPU 1 idle but nothing queued: not idle time.
            sample(0.1, &[(1.0, 0.0), (0.0, 0.0)], 0.0),
            // 0.3–0.4 s: both idle, queue 1: 0.2 GPU-s.
            sample(0.3, &[(0.0, 0.0), (0.0, 0.0)], 1.0),
            // 0.4–0.5 s: a waiting request means the GPU has work: not idle.
            sample(0.4, &[(0.0, 1.0), (2.0, 0.0)], 1.0),
            sample(0.5, &[(0.0, 0.0), (0.0, 0.0)], 5.0),
        ];
        let st = idle_stats(&s);
        assert_eq!(st.samples, 5);
        assert!((st.idle_gpu_s - 0.3).abs() < 1e-9, "{st:?}");
        assert!((st.total_gpu_s - 1.0).abs() < 1e-9, "{st:?}");
        assert!((st.share - 0.3).abs() < 1e-9);
        assert_eq!(st.max_queued, 5.0);
    }

    #[test]
    fn a_job_waiting_at_another_gpus_server_counts() {
        // GPU 0 runs 1 and has 3 waiting; GPU 1 is idle; nothing in the dispatcher.
        let s = [
            sample(0.0, &[(1.0, 3.0), (0.0, 0.0)], 0.0),
            sample(0.5, &[(1.0, 0.0), (0.0, 0.0)], 0.0),
            sample(1.0, &[(1.0, 0.0), (0.0, 0.0)], 0.0),
        ];
        let st = idle_stats(&s);
        assert!((st.idle_gpu_s - 0.5).abs() < 1e-9, "{st:?}");
        // A job waiting at a GPU of another model does not count.
        let mut other = s[0].clone();
        other.gpus[0].0 = "other".into();
        assert_eq!(idle_stats(&[other, s[1].clone()]).idle_gpu_s, 0.0);
    }

    #[test]
    fn a_queue_for_another_model_does_not_count() {
        let mut s = sample(0.0, &[(0.0, 0.0)], 0.0);
        s.queued = [("other".to_string(), 3.0)].into_iter().collect();
        let st = idle_stats(&[s, sample(1.0, &[(0.0, 0.0)], 0.0)]);
        assert_eq!(st.idle_gpu_s, 0.0);
        assert_eq!(st.total_gpu_s, 1.0);
    }

    #[test]
    fn fewer_than_two_samples_observe_nothing() {
        assert_eq!(idle_stats(&[]).share, 0.0);
        assert_eq!(
            idle_stats(&[sample(0.0, &[(0.0, 0.0)], 9.0)]).total_gpu_s,
            0.0
        );
    }
}
