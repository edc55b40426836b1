//! What a worker identity was provisioned for, and how far its own heartbeat is believed.
//!
//! A heartbeat is the worker's own claim: its model, its `max_concurrency` and its fitted
//! performance figures. NATS lets a worker write only its own key of the `workers` bucket,
//! so the key is proof of *who* speaks, not of what it says: a stolen worker identity
//! could claim another model and an unbounded capacity and draw that model's jobs (other
//! tenants' prompts). The provisioning (`./dev up`, compose, Ansible) knows each worker's
//! id, model and capacity when it renders the worker's credentials, and writes them into a
//! record only the dispatcher reads ([`Provisioning`]). A heartbeat is then checked
//! against it ([`Provisioning::check`]): a model other than the provisioned one, or a
//! concurrency cap above the provisioned ceiling, makes the worker not eligible (filter
//! [`crate::filter::Provisioned`], code `not_provisioned`) until a heartbeat within its
//! provisioning comes. Such a worker stays alive (its jobs are not declared lost): only new
//! work is kept from it.
//!
//! Performance figures cannot be provisioned (they are learnt), so they are bounded
//! instead ([`clamp_perf`], [`clamp_ewma`]): every coefficient of a fitted model, and the
//! latency EWMAs, count as at least `perf_claim_floor` (default 1/20) of the configured
//! prior's. Only the fast side is bounded: a worker that claims to be slow only turns work
//! away from itself. With the default prior (an ~8B model on one GPU, 20 ms a decode step)
//! the floor is 1 ms a step, 1,000 tokens/s for one stream, beyond any such GPU.

use std::collections::BTreeMap;

use metronome_protocol::{PerfCoefficients, WorkerStatus};
use serde::{Deserialize, Serialize};

use crate::perf::PerfPrior;
use crate::EwmaSnapshot;

/// The version of the provisioning record this code reads.
pub const PROVISIONING_VERSION: u32 = 1;

/// One worker id's provisioning.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProvisionedWorker {
    /// The only model the worker may serve.
    pub model: String,
    /// The highest `max_concurrency` the worker may claim; `None`: no ceiling beyond the
    /// dispatcher's own.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
}

/// Every provisioned worker, by worker id (the file `scripts/render-auth.py` writes,
/// `workers.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provisioning {
    pub v: u32,
    pub workers: BTreeMap<String, ProvisionedWorker>,
}

impl Provisioning {
    /// The record, when it is one this code reads and every entry is usable.
    pub fn checked(self) -> Result<Provisioning, String> {
        let p = self;
        if p.v != PROVISIONING_VERSION {
            return Err(format!(
                "version {} (this dispatcher reads version {PROVISIONING_VERSION})",
                p.v
            ));
        }
        for (id, w) in &p.workers {
            if w.model.is_empty() {
                return Err(format!("workers.{id}.model is empty"));
            }
            if w.max_concurrency == Some(0) {
                return Err(format!("workers.{id}.max_concurrency must be at least 1"));
            }
        }
        Ok(p)
    }

    /// `Err(reason)` when `status` claims more than its worker id was provisioned for: an
    /// id with no record, another model, or a concurrency cap (`default_max_concurrency`
    /// when it reports 0, as the scheduler reads it) above the ceiling.
    pub fn check(&self, status: &WorkerStatus, default_max_concurrency: u32) -> Result<(), String> {
        let Some(p) = self.workers.get(&status.worker_id) else {
            return Err(
                "no provisioning record for this worker id: its heartbeats are not trusted"
                    .to_string(),
            );
        };
        if status.model != p.model {
            return Err(format!(
                "provisioned for model '{}', its heartbeat claims '{}'",
                p.model, status.model
            ));
        }
        let cap = if status.max_concurrency == 0 {
            default_max_concurrency
        } else {
            status.max_concurrency
        };
        match p.max_concurrency {
            Some(ceiling) if cap > ceiling => Err(format!(
                "its heartbeat claims max_concurrency {cap}, above its provisioned ceiling {ceiling}"
            )),
            _ => Ok(()),
        }
    }
}

/// `perf` with every coefficient at least `floor` times the prior's (a NaN counts as the
/// floor). `step_error_ms` and `samples` are kept: the error only makes admission more
/// careful, and the sample count only ends the warm-up allowance, which the concurrency
/// ceiling still bounds.
pub fn clamp_perf(perf: PerfCoefficients, prior: &PerfPrior, floor: f64) -> PerfCoefficients {
    let at_least = |claimed: f64, prior: f64| claimed.max(prior * floor);
    PerfCoefficients {
        step_base_ms: at_least(perf.step_base_ms, prior.step_base_ms),
        step_per_stream_ms: at_least(perf.step_per_stream_ms, prior.step_per_stream_ms),
        step_per_ktok_ms: at_least(perf.step_per_ktok_ms, prior.step_per_ktok_ms),
        stall_per_prefill_token_ms: at_least(
            perf.stall_per_prefill_token_ms,
            prior.stall_per_prefill_token_ms,
        ),
        ttft_base_ms: at_least(perf.ttft_base_ms, prior.ttft_base_ms),
        prefill_per_token_ms: at_least(perf.prefill_per_token_ms, prior.prefill_per_token_ms),
        ttft_per_stream_ms: at_least(perf.ttft_per_stream_ms, prior.ttft_per_stream_ms),
        ..perf
    }
}

/// `ewma` bounded like [`clamp_perf`]: time per output token at least `floor` times the
/// prior's decode step (and the rate at most its inverse), time to first token and
/// end-to-end time at least `floor` times the prior's TTFT. A field left at 0 (not
/// measured) stays 0: the scheduler already treats it as unavailable.
pub fn clamp_ewma(ewma: EwmaSnapshot, prior: &PerfPrior, floor: f64) -> EwmaSnapshot {
    let min_tpot = prior.step_base_ms * floor;
    let min_ttft = prior.ttft_base_ms * floor;
    let at_least = |v: f64, min: f64| if v == 0.0 { 0.0 } else { v.max(min) };
    let max_tok_s = if min_tpot > 0.0 {
        1000.0 / min_tpot
    } else {
        f64::INFINITY
    };
    EwmaSnapshot {
        ttft_ms: at_least(ewma.ttft_ms, min_ttft),
        tpot_ms: at_least(ewma.tpot_ms, min_tpot),
        tok_s: if ewma.tok_s > max_tok_s {
            max_tok_s
        } else {
            ewma.tok_s
        },
        e2e_ms: at_least(ewma.e2e_ms, min_ttft),
        ..ewma
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;

    impl Provisioning {
        fn from_json(text: &str) -> Result<Provisioning, String> {
            serde_json::from_str::<Provisioning>(text)
                .map_err(|e| e.to_string())?
                .checked()
        }
    }

    fn provisioning() -> Provisioning {
        Provisioning::from_json(
            r#"{"v": 1, "workers": {
                "w1": {"model": "m", "max_concurrency": 8},
                "w2": {"model": "m"}
            }}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_heartbeat_within_its_provisioning_passes() {
        let p = provisioning();
        let mut w = worker("w1");
        w.status.max_concurrency = 8;
        assert_eq!(p.check(&w.status, 256), Ok(()));
        // No ceiling provisioned: any cap, the model still bound.
        let mut w = worker("w2");
        w.status.max_concurrency = 100_000;
        assert_eq!(p.check(&w.status, 256), Ok(()));
    }

    #[test]
    fn another_model_an_inflated_cap_or_no_record_is_refused() {
        let p = provisioning();
        let mut w = worker("w1");
        w.status.model = "llama".into();
        assert_eq!(
            p.check(&w.status, 256),
            Err("provisioned for model 'm', its heartbeat claims 'llama'".into())
        );
        let mut w = worker("w1");
        w.status.max_concurrency = 100_000;
        assert_eq!(
            p.check(&w.status, 256),
            Err(
                "its heartbeat claims max_concurrency 100000, above its provisioned ceiling 8"
                    .into()
            )
        );
        // Reporting no cap means the dispatcher's default, which is above the ceiling here.
        w.status.max_concurrency = 0;
        assert!(p.check(&w.status, 256).is_err());
        assert_eq!(p.check(&w.status, 4), Ok(()));
        let stranger = worker("w9");
        assert!(p
            .check(&stranger.status, 256)
            .unwrap_err()
            .starts_with("no provisioning record"));
    }

    #[test]
    fn a_record_of_another_version_or_a_zero_ceiling_is_refused() {
        assert!(Provisioning::from_json(r#"{"v": 2, "workers": {}}"#).is_err());
        assert!(Provisioning::from_json(
            r#"{"v": 1, "workers": {"w": {"model": "m", "max_concurrency": 0}}}"#
        )
        .is_err());
        assert!(Provisioning::from_json(r#"{"v": 1, "workers": {"w": {"model": ""}}}"#).is_err());
        assert!(Provisioning::from_json(
            r#"{"v": 1, "workers": {"w": {"model": "m", "speed": 3}}}"#
        )
        .is_err());
    }

    #[test]
    fn claimed_speed_is_bounded_by_the_prior_and_slowness_is_kept() {
        let prior = PerfPrior::default();
        let fast = PerfCoefficients {
            step_base_ms: 0.001,
            step_per_stream_ms: 0.0,
            step_per_ktok_ms: f64::NAN,
            stall_per_prefill_token_ms: 0.0,
            ttft_base_ms: 0.0,
            prefill_per_token_ms: 0.0,
            ttft_per_stream_ms: 0.0,
            step_error_ms: 0.0,
            samples: 1_000,
        };
        let c = clamp_perf(fast, &prior, 0.05);
        assert_eq!(c.step_base_ms, 1.0);
        assert_eq!(c.ttft_base_ms, 2.5);
        assert_eq!(c.step_per_stream_ms, prior.step_per_stream_ms * 0.05);
        assert_eq!(c.step_per_ktok_ms, prior.step_per_ktok_ms * 0.05);
        assert_eq!(c.samples, 1_000);
        let slow = PerfCoefficients {
            step_base_ms: 80.0,
            ..prior.coefficients()
        };
        assert_eq!(clamp_perf(slow, &prior, 0.05), slow);

        let e = clamp_ewma(
            EwmaSnapshot {
                ttft_ms: 0.01,
                tpot_ms: 0.01,
                tok_s: 1e9,
                e2e_ms: 0.0,
                samples: 5,
                updated_ms: 7,
            },
            &prior,
            0.05,
        );
        assert_eq!((e.ttft_ms, e.tpot_ms, e.tok_s), (2.5, 1.0, 1000.0));
        assert_eq!((e.e2e_ms, e.samples, e.updated_ms), (0.0, 5, 7));
        let honest = ewma(120.0, 40.0);
        assert_eq!(clamp_ewma(honest, &prior, 0.05), honest);
    }
}
