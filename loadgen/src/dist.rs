//! Token-length distributions of synthetic workloads, written as short strings so they fit
//! on a command line and in TOML:
//!
//! - `fixed:N` — always N.
//! - `uniform:A,B` — integer uniform on `[A, B]` (inclusive).
//! - `lognormal:mean=M,sigma=S[,max=X]` — log-normal with **arithmetic mean** M (not the
//!   median) and shape S: `mu = ln(M) - S^2 / 2`, so that `E[X] = exp(mu + S^2/2) = M`.
//!   Samples are rounded and clamped to `[1, max]` (max defaults to 1,000,000).
//!
//! Every sample is at least 1 token. Sampling is a pure function of the RNG state, so a
//! seeded workload is reproducible.

use std::fmt;
use std::str::FromStr;

use rand::Rng;
use serde::{Deserialize, Serialize};

const DEFAULT_LOGNORMAL_MAX: u32 = 1_000_000;

/// A distribution of token counts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum LengthDist {
    Fixed(u32),
    Uniform { lo: u32, hi: u32 },
    LogNormal { mean: f64, sigma: f64, max: u32 },
}

impl LengthDist {
    /// Draws one length (at least 1).
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> u32 {
        match *self {
            LengthDist::Fixed(n) => n.max(1),
            LengthDist::Uniform { lo, hi } => rng.random_range(lo..=hi).max(1),
            LengthDist::LogNormal { mean, sigma, max } => {
                let mu = mean.ln() - sigma * sigma / 2.0;
                let x = (mu + sigma * standard_normal(rng)).exp();
                (x.round().clamp(1.0, f64::from(max.max(1)))) as u32
            }
        }
    }

    /// The distribution's mean before clamping (what a capacity estimate should use).
    pub fn mean(&self) -> f64 {
        match *self {
            LengthDist::Fixed(n) => f64::from(n.max(1)),
            LengthDist::Uniform { lo, hi } => (f64::from(lo) + f64::from(hi)) / 2.0,
            LengthDist::LogNormal { mean, .. } => mean,
        }
    }
}

/// Box–Muller transform: one standard normal sample from two uniforms.
fn standard_normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    // 1 - u is in (0, 1], so ln never sees 0.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

impl FromStr for LengthDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (kind, args) = s.split_once(':').ok_or_else(|| {
            format!("{s:?}: expected fixed:N, uniform:A,B or lognormal:mean=M,sigma=S[,max=X]")
        })?;
        let count = |v: &str| -> Result<u32, String> {
            v.trim()
                .parse::<u32>()
                .map_err(|_| format!("{s:?}: {v:?} is not a token count"))
        };
        match kind.trim() {
            "fixed" => {
                let n = count(args)?;
                if n == 0 {
                    return Err(format!("{s:?}: N must be at least 1"));
                }
                Ok(LengthDist::Fixed(n))
            }
            "uniform" => {
                let (a, b) = args
                    .split_once(',')
                    .ok_or_else(|| format!("{s:?}: expected uniform:A,B"))?;
                let (lo, hi) = (count(a)?, count(b)?);
                if lo == 0 || lo > hi {
                    return Err(format!("{s:?}: need 1 <= A <= B"));
                }
                Ok(LengthDist::Uniform { lo, hi })
            }
            "lognormal" => {
                let (mut mean, mut sigma, mut max) = (None, None, DEFAULT_LOGNORMAL_MAX);
                for kv in args.split(',') {
                    let (k, v) = kv
                        .split_once('=')
                        .ok_or_else(|| format!("{s:?}: expected key=value, got {kv:?}"))?;
                    let num = || -> Result<f64, String> {
                        v.trim()
                            .parse::<f64>()
                            .ok()
                            .filter(|x| x.is_finite())
                            .ok_or_else(|| format!("{s:?}: {k}={v:?} is not a number"))
                    };
                    match k.trim() {
                        "mean" => mean = Some(num()?),
                        "sigma" => sigma = Some(num()?),
                        "max" => max = count(v)?,
                        other => return Err(format!("{s:?}: unknown parameter {other:?}")),
                    }
                }
                let mean = mean.ok_or_else(|| format!("{s:?}: missing mean="))?;
                let sigma = sigma.ok_or_else(|| format!("{s:?}: missing sigma="))?;
                if mean < 1.0 || sigma < 0.0 || max == 0 {
                    return Err(format!("{s:?}: need mean >= 1, sigma >= 0, max >= 1"));
                }
                Ok(LengthDist::LogNormal { mean, sigma, max })
            }
            other => Err(format!(
                "{s:?}: unknown distribution {other:?} (fixed, uniform, lognormal)"
            )),
        }
    }
}

impl fmt::Display for LengthDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LengthDist::Fixed(n) => write!(f, "fixed:{n}"),
            LengthDist::Uniform { lo, hi } => write!(f, "uniform:{lo},{hi}"),
            LengthDist::LogNormal { mean, sigma, max } if max == DEFAULT_LOGNORMAL_MAX => {
                write!(f, "lognormal:mean={mean},sigma={sigma}")
            }
            LengthDist::LogNormal { mean, sigma, max } => {
                write!(f, "lognormal:mean={mean},sigma={sigma},max={max}")
            }
        }
    }
}

impl TryFrom<String> for LengthDist {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<LengthDist> for String {
    fn from(d: LengthDist) -> String {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn parses_and_round_trips() {
        for s in [
            "fixed:128",
            "uniform:10,20",
            "lognormal:mean=1500,sigma=0.8",
            "lognormal:mean=200,sigma=1.2,max=4096",
        ] {
            let d: LengthDist = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
        }
        assert_eq!("fixed:7".parse::<LengthDist>(), Ok(LengthDist::Fixed(7)));
    }

    #[test]
    fn rejects_bad_specs() {
        for s in [
            "",
            "fixed",
            "fixed:0",
            "fixed:x",
            "uniform:5",
            "uniform:9,3",
            "lognormal:mean=10",
            "lognormal:sigma=1",
            "lognormal:mean=0.5,sigma=1",
            "normal:1",
            "lognormal:mean=10,sigma=1,foo=2",
        ] {
            assert!(s.parse::<LengthDist>().is_err(), "{s:?} should be rejected");
        }
    }

    #[test]
    fn samples_stay_in_range() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let u = LengthDist::Uniform { lo: 3, hi: 5 };
        let l: LengthDist = "lognormal:mean=50,sigma=1.5,max=300".parse().unwrap();
        for _ in 0..10_000 {
            assert!((3..=5).contains(&u.sample(&mut rng)));
            assert!((1..=300).contains(&l.sample(&mut rng)));
        }
    }

    #[test]
    fn lognormal_mean_is_the_arithmetic_mean() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let d: LengthDist = "lognormal:mean=1500,sigma=0.8".parse().unwrap();
        let n = 50_000;
        let sum: f64 = (0..n).map(|_| f64::from(d.sample(&mut rng))).sum();
        let m = sum / f64::from(n);
        // Wide tolerance: a property of the parameterisation, not of one seed.
        assert!((m - 1500.0).abs() < 75.0, "sample mean {m}");
    }

    #[test]
    fn serde_as_string() {
        let d: LengthDist = serde_json::from_str("\"uniform:1,9\"").unwrap();
        assert_eq!(d, LengthDist::Uniform { lo: 1, hi: 9 });
        assert_eq!(serde_json::to_string(&d).unwrap(), "\"uniform:1,9\"");
        assert!(serde_json::from_str::<LengthDist>("\"uniform:9,1\"").is_err());
    }
}
