//! The reservation ledger: which job is booked on which worker, and with how much KV.
//!
//! A reservation is made right after a decision and before the next job is read, so every
//! later decision counts it as active work and used KV even though the worker has not yet
//! reported the job (kube-scheduler's Reserve/Unreserve contract). It ends in one of three
//! ways: a completion event releases it, a heartbeat reconciliation expires it when the
//! worker never listed it within the TTL, or the worker dies.
//!
//! Invariants:
//! - A job is reserved on at most one worker; [`Ledger::reserve`] refuses a second booking.
//! - Per-worker totals (count, KV tokens) always equal the sum over that worker's
//!   reservations.
//! - [`Ledger::release`] is idempotent.
//! - Outputs never depend on map iteration order: per-worker reservations keep their
//!   booking order and the job map is ordered, so replays are exact. The per-worker map,
//!   read once per worker in every decision, is a hash map with FNV-1a: a lookup is one
//!   cheap hash of a short id and one comparison instead of a dozen string comparisons in
//!   a B-tree; the hash is fixed, so runs are identical, and nothing is ever read from the
//!   map in iteration order. (Worker ids come from operators' agents, not from clients, so
//!   a non-keyed hash is no flooding risk.)

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// FNV-1a, 64-bit: deterministic and fast on short keys such as worker ids.
#[derive(Debug, Clone, Copy)]
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

type FixedState = BuildHasherDefault<Fnv1a>;

/// What admission control needs to know about a booked job to protect its SLO while it
/// runs: its prompt (prefill still to come while unreported, less its cached prefix), its expected output and the
/// decode-rate floor it was promised.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct JobProfile {
    pub prompt_tokens: u32,
    /// Of its prompt, the tokens its worker was believed to hold in its prefix cache: not
    /// prefilled, still context.
    #[serde(default)]
    pub cached_tokens: u32,
    /// Output tokens it is protected as writing: a length it is unlikely to fall short of
    /// ([`crate::OutputLength::predict_low`]; its expected output where nothing better is
    /// known), never more than its `max_tokens`.
    pub protected_output: f64,
    /// Its decode-rate floor, tokens/s.
    pub min_tok_s: f64,
    /// The most it can write (0: unknown, `protected_output` is the bound).
    #[serde(default)]
    pub max_tokens: u32,
    /// When it was predicted to start decoding (Unix ms: its placement plus its predicted
    /// TTFT; 0: unknown). A job still running long after that has written more than a
    /// job just started, whatever its expected length said ([`crate::forecast`]).
    #[serde(default)]
    pub decoding_from_ms: u64,
}

/// One booked job.
#[derive(Debug, Clone, PartialEq)]
pub struct Reservation {
    pub job_id: String,
    pub worker_id: String,
    /// KV tokens booked for the job.
    pub kv_tokens: u64,
    /// When the reservation was made (Unix ms).
    pub reserved_ms: u64,
    /// Last time a heartbeat of the worker listed the job; 0 until the first one does.
    pub confirmed_ms: u64,
    /// The job's size and SLO; `None` for a job adopted from a heartbeat (its size is not
    /// in a heartbeat).
    pub profile: Option<JobProfile>,
    /// Prefill stall charged to this job by admissions made on its worker after it (ms):
    /// the time its decode is predicted to stand still while their prompts are prefilled.
    pub stall_ms: f64,
    /// Its floor is not protected: no forecast counts it as a miss. Set only on a what-if
    /// copy of the ledger ([`Ledger::waive_floor`]), never on the ledger of record.
    pub floor_waived: bool,
}

impl Reservation {
    /// Last sign of life: the later of booking and confirmation.
    pub fn last_seen_ms(&self) -> u64 {
        self.reserved_ms.max(self.confirmed_ms)
    }

    /// True once a heartbeat has listed the job (the worker holds it).
    pub fn is_confirmed(&self) -> bool {
        self.confirmed_ms > 0
    }
}

/// Ceiling of [`StallOutlook::stall_fraction`]: past it the prediction is not worth more.
pub const STALL_FRACTION_MAX: f64 = 0.8;
/// τ of the decaying sums of a worker's recent admissions.
pub const ADMISSION_WINDOW_MS: f64 = 10_000.0;

/// Why a ledger operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    #[error("job {job_id} is already reserved on worker {worker_id}")]
    AlreadyReserved { job_id: String, worker_id: String },
}

/// What a heartbeat reconciliation changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reconciliation {
    /// Jobs the worker reported that the ledger did not know (e.g. after a leader change),
    /// now reserved on it.
    pub adopted: Vec<String>,
    /// Reservations on the worker that it never listed within the TTL, now released.
    pub expired: Vec<String>,
    /// Jobs the worker reported that the ledger holds on another worker; left unchanged,
    /// for the caller to log or resolve (e.g. a rescued job whose first worker still runs it).
    pub conflicting: Vec<String>,
}

impl Reconciliation {
    pub fn is_empty(&self) -> bool {
        self.adopted.is_empty() && self.expired.is_empty() && self.conflicting.is_empty()
    }
}

/// One worker's reservations in booking order, with their running KV total.
#[derive(Debug, Clone, Default)]
struct WorkerBook {
    /// Kept small (bounded by the worker's cap) and held here rather than behind the job
    /// map: every decision walks each candidate's reservations several times (its load, its
    /// stall fraction, the forecast of every running job), and a walk over contiguous
    /// records costs no lookup per job, where a B-tree lookup by job id costs a dozen
    /// string comparisons each.
    jobs: Vec<Reservation>,
    kv_tokens: u64,
}

impl WorkerBook {
    fn position(&self, job_id: &str) -> Option<usize> {
        self.jobs.iter().position(|r| r.job_id == job_id)
    }
}

/// The reservation ledger, keyed by job id.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    /// Job id → the worker it is booked on; the reservation itself is in that worker's book.
    jobs: BTreeMap<String, String>,
    workers: HashMap<String, WorkerBook, FixedState>,
    /// Per worker, its recent admissions, the stall they charged and the jobs booked there
    /// (kept while the worker has no booking: an idle worker's next job meets the
    /// admissions to come).
    recent: HashMap<String, Recent, FixedState>,
}

/// A worker's recent admissions that charged a stall, the stall they charged and the jobs
/// booked there, each weighted by `exp(−age / τ)` (τ = [`ADMISSION_WINDOW_MS`]): divided
/// by τ, their recent rates.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Recent {
    admissions: f64,
    stall_ms: f64,
    placements: f64,
    at_ms: u64,
}

impl Recent {
    /// Every sum decayed to `now_ms` (a time before the last update decays nothing).
    fn at(&self, now_ms: u64) -> Recent {
        let age = now_ms.saturating_sub(self.at_ms) as f64;
        let decay = (-age / ADMISSION_WINDOW_MS).exp();
        Recent {
            admissions: self.admissions * decay,
            stall_ms: self.stall_ms * decay,
            placements: self.placements * decay,
            at_ms: now_ms.max(self.at_ms),
        }
    }
}

/// What a job starting to decode on a worker can expect of the admissions after it, if
/// they go on as they recently have: how often they come and how long each stalls it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StallOutlook {
    /// Admissions per ms.
    pub admissions_per_ms: f64,
    /// The mean stall one admission charged, ms.
    pub mean_stall_ms: f64,
}

impl StallOutlook {
    /// Share of time a job decoding there stands still: `rate × mean stall`, at most
    /// [`STALL_FRACTION_MAX`].
    pub fn stall_fraction(&self) -> f64 {
        (self.admissions_per_ms * self.mean_stall_ms).clamp(0.0, STALL_FRACTION_MAX)
    }

    /// The stall a job decoding for `decode_ms` most likely meets: the median number of
    /// admissions during its decode (a Poisson count over the decode stretched by the
    /// stalls themselves) times the mean stall of one.
    ///
    /// Why the median and not the mean: a short decode on a worker that admits now and
    /// then meets no admission at all far more often than not, and the mean (a fraction of
    /// one stall) would predict every such job slower than any of them runs; a long decode
    /// meets many, and the two agree. The median is also what minimises the absolute error
    /// the predictions are judged on.
    pub fn likely_stall_ms(&self, decode_ms: f64) -> f64 {
        let phi = self.stall_fraction();
        let mu = self.admissions_per_ms * decode_ms.max(0.0) / (1.0 - phi);
        poisson_median(mu) * self.mean_stall_ms.max(0.0)
    }
}

/// The median of a Poisson distribution of mean `mu` (0 for a mean that is not positive).
fn poisson_median(mu: f64) -> f64 {
    if !(mu.is_finite() && mu > 0.0) {
        return 0.0;
    }
    if mu > 50.0 {
        // The median lies in [μ − ln 2, μ + 1/3] (Choi, 1994), and this is it at every mean
        // the unit test checks past 50; the loop below would underflow `e^−μ` past ~700.
        return (mu + 1.0 / 3.0 - 0.02 / mu).floor();
    }
    let (mut n, mut term) = (0u32, (-mu).exp());
    let mut cdf = term;
    while cdf < 0.5 {
        n += 1;
        term *= mu / f64::from(n);
        cdf += term;
    }
    f64::from(n)
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    /// Book `job_id` on `worker_id`. Refused when the job is already booked anywhere.
    pub fn reserve(
        &mut self,
        worker_id: &str,
        job_id: &str,
        kv_tokens: u64,
        now_ms: u64,
    ) -> Result<(), LedgerError> {
        self.insert(worker_id, job_id, kv_tokens, now_ms, 0, None)
    }

    /// Book `job_id` on `worker_id` with its profile, so later admissions on the worker can
    /// predict what they do to it.
    pub fn reserve_profiled(
        &mut self,
        worker_id: &str,
        job_id: &str,
        kv_tokens: u64,
        profile: JobProfile,
        now_ms: u64,
    ) -> Result<(), LedgerError> {
        self.insert(worker_id, job_id, kv_tokens, now_ms, 0, Some(profile))
    }

    /// The worker's recent sums, decayed to `now_ms`, to add to.
    fn recent_mut(&mut self, worker_id: &str, now_ms: u64) -> &mut Recent {
        // Looked up before inserting, so a worker already known costs no id copy.
        if !self.recent.contains_key(worker_id) {
            self.recent.insert(worker_id.to_owned(), Recent::default());
        }
        let recent = self.recent.get_mut(worker_id).expect("inserted above");
        *recent = recent.at(now_ms);
        recent
    }

    /// The jobs booked on the worker over the last [`ADMISSION_WINDOW_MS`] or so, each
    /// weighted by `exp(−age / τ)`: its recent share of the placements, which prefix
    /// affinity bounds ([`crate::affinity`]). A job adopted from a heartbeat (an earlier
    /// leader placed it) counts as placed when it is adopted: a new leader starts from the
    /// share each worker runs, not from none, where every holder's second job within a
    /// second would be past its bound. Kept while the worker has no booking.
    pub fn recent_placements(&self, worker_id: &str, now_ms: u64) -> f64 {
        self.recent
            .get(worker_id)
            .map_or(0.0, |r| r.at(now_ms).placements)
    }

    /// Charge `stall_ms` of prefill stall to every job booked on `worker_id` except
    /// `except_job` (the job whose prefill causes it). Non-finite or negative charges are
    /// ignored.
    pub fn charge_stall(&mut self, worker_id: &str, except_job: &str, stall_ms: f64, now_ms: u64) {
        if !(stall_ms.is_finite() && stall_ms > 0.0) {
            return;
        }
        let recent = self.recent_mut(worker_id, now_ms);
        recent.admissions += 1.0;
        recent.stall_ms += stall_ms;
        let Some(book) = self.workers.get_mut(worker_id) else {
            return;
        };
        for r in book.jobs.iter_mut().filter(|r| r.job_id != except_job) {
            r.stall_ms += stall_ms;
        }
    }

    /// What a job starting on the worker now can expect of the admissions after it, from
    /// the worker's admissions of the last [`ADMISSION_WINDOW_MS`] or so.
    pub fn stall_outlook(&self, worker_id: &str, now_ms: u64) -> StallOutlook {
        let Some(r) = self.recent.get(worker_id).map(|r| r.at(now_ms)) else {
            return StallOutlook::default();
        };
        if r.admissions <= 0.0 {
            return StallOutlook::default();
        }
        StallOutlook {
            admissions_per_ms: r.admissions / ADMISSION_WINDOW_MS,
            mean_stall_ms: r.stall_ms / r.admissions,
        }
    }

    /// The reservations on the worker, in booking order.
    pub fn reservations_on<'a>(
        &'a self,
        worker_id: &str,
    ) -> impl Iterator<Item = &'a Reservation> + 'a {
        self.workers
            .get(worker_id)
            .into_iter()
            .flat_map(|b| b.jobs.iter())
    }

    fn insert(
        &mut self,
        worker_id: &str,
        job_id: &str,
        kv_tokens: u64,
        reserved_ms: u64,
        confirmed_ms: u64,
        profile: Option<JobProfile>,
    ) -> Result<(), LedgerError> {
        if let Some(existing) = self.jobs.get(job_id) {
            return Err(LedgerError::AlreadyReserved {
                job_id: job_id.to_owned(),
                worker_id: existing.clone(),
            });
        }
        self.jobs.insert(job_id.to_owned(), worker_id.to_owned());
        let book = match self.workers.get_mut(worker_id) {
            Some(b) => b,
            None => self.workers.entry(worker_id.to_owned()).or_default(),
        };
        book.jobs.push(Reservation {
            job_id: job_id.to_owned(),
            worker_id: worker_id.to_owned(),
            kv_tokens,
            reserved_ms,
            confirmed_ms,
            profile,
            stall_ms: 0.0,
            floor_waived: false,
        });
        book.kv_tokens = book.kv_tokens.saturating_add(kv_tokens);
        // Every booking is a placement: this ledger's own, or an adopted one.
        self.recent_mut(worker_id, reserved_ms).placements += 1.0;
        Ok(())
    }

    /// Release a job's reservation. Idempotent: `None` when it was not (or no longer) booked.
    pub fn release(&mut self, job_id: &str) -> Option<Reservation> {
        let worker_id = self.jobs.remove(job_id)?;
        let book = self.workers.get_mut(&worker_id)?;
        let r = book.jobs.remove(book.position(job_id)?);
        book.kv_tokens = book.kv_tokens.saturating_sub(r.kv_tokens);
        if book.jobs.is_empty() {
            self.workers.remove(&worker_id);
        }
        Some(r)
    }

    /// Reservations booked on the worker.
    pub fn reserved_count(&self, worker_id: &str) -> u32 {
        self.workers
            .get(worker_id)
            .map_or(0, |b| u32::try_from(b.jobs.len()).unwrap_or(u32::MAX))
    }

    /// KV tokens booked on the worker.
    pub fn reserved_kv_tokens(&self, worker_id: &str) -> u64 {
        self.workers.get(worker_id).map_or(0, |b| b.kv_tokens)
    }

    /// Worker the job is booked on.
    pub fn worker_of(&self, job_id: &str) -> Option<&str> {
        self.jobs.get(job_id).map(String::as_str)
    }

    /// The job's reservation.
    pub fn get(&self, job_id: &str) -> Option<&Reservation> {
        let book = self.workers.get(self.jobs.get(job_id)?)?;
        book.jobs.get(book.position(job_id)?)
    }

    /// `(job_id, kv_tokens)` of each reservation on the worker, in booking order.
    pub fn jobs_on<'a>(&'a self, worker_id: &str) -> impl Iterator<Item = (&'a str, u64)> + 'a {
        self.reservations_on(worker_id)
            .map(|r| (r.job_id.as_str(), r.kv_tokens))
    }

    /// Reservations on the worker that `in_flight` does not list: booked work the worker
    /// has not reported yet. Returns `(count, kv_tokens)`.
    pub fn unreported(&self, worker_id: &str, in_flight: &[String]) -> (u32, u64) {
        let Some(book) = self.workers.get(worker_id) else {
            return (0, 0);
        };
        if in_flight.is_empty() {
            return (
                u32::try_from(book.jobs.len()).unwrap_or(u32::MAX),
                book.kv_tokens,
            );
        }
        let mut count = 0u32;
        let mut kv = 0u64;
        // Agents list jobs in the order they received them, which is booking order, so the
        // search resumes after the previous match: linear in the usual case, quadratic
        // only when the orders disagree.
        let mut from = 0;
        for r in &book.jobs {
            let job = &r.job_id;
            let found = in_flight[from..]
                .iter()
                .position(|f| f == job)
                .map(|k| from + k)
                .or_else(|| in_flight[..from].iter().position(|f| f == job));
            match found {
                Some(k) => from = (k + 1) % in_flight.len(),
                None => {
                    count = count.saturating_add(1);
                    kv = kv.saturating_add(r.kv_tokens);
                }
            }
        }
        (count, kv)
    }

    /// Heartbeat reconciliation for one worker.
    ///
    /// - Jobs in `in_flight` unknown to the ledger are adopted on this worker with
    ///   `adopt_kv_tokens` (the caller's estimate; the job's size is not in a heartbeat).
    /// - Listed jobs already booked on this worker are confirmed (`confirmed_ms = now`).
    /// - Listed jobs booked on another worker are reported as conflicting and left alone.
    /// - Unlisted reservations on this worker whose last sign of life (booking or
    ///   confirmation) is more than `ttl_ms` old are released.
    pub fn reconcile(
        &mut self,
        worker_id: &str,
        in_flight: &[String],
        adopt_kv_tokens: u64,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Reconciliation {
        let mut out = Reconciliation::default();
        for job_id in in_flight {
            match self.jobs.get(job_id.as_str()) {
                Some(w) if w == worker_id => {
                    if let Some(book) = self.workers.get_mut(worker_id) {
                        if let Some(i) = book.position(job_id) {
                            let r = &mut book.jobs[i];
                            r.confirmed_ms = r.confirmed_ms.max(now_ms);
                        }
                    }
                }
                Some(_) => out.conflicting.push(job_id.clone()),
                None => {
                    if self
                        .insert(worker_id, job_id, adopt_kv_tokens, now_ms, now_ms, None)
                        .is_ok()
                    {
                        out.adopted.push(job_id.clone());
                    }
                }
            }
        }
        let stale: Vec<String> = self
            .reservations_on(worker_id)
            .filter(|r| !in_flight.contains(&r.job_id))
            .filter(|r| now_ms.saturating_sub(r.last_seen_ms()) > ttl_ms)
            .map(|r| r.job_id.clone())
            .collect();
        for job in stale {
            self.release(&job);
            out.expired.push(job);
        }
        out
    }

    /// Release every reservation of a dead worker, in booking order.
    pub fn release_worker(&mut self, worker_id: &str) -> Vec<Reservation> {
        let Some(book) = self.workers.remove(worker_id) else {
            return Vec::new();
        };
        for r in &book.jobs {
            self.jobs.remove(&r.job_id);
        }
        book.jobs
    }

    /// Number of reservations.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Stop protecting `job_id`'s decode rate: forecasts on this ledger no longer count it
    /// below its floor. For a what-if copy: the dispatcher judges a lighter tenant's job on
    /// a copy with the floors of a tenant above its fair share waived.
    pub fn waive_floor(&mut self, job_id: &str) {
        let Some(book) = self
            .jobs
            .get(job_id)
            .and_then(|worker_id| self.workers.get_mut(worker_id))
        else {
            return;
        };
        if let Some(r) = book.jobs.iter_mut().find(|r| r.job_id == job_id) {
            r.floor_waived = true;
        }
    }

    /// Every reservation, ordered by job id.
    pub fn iter(&self) -> impl Iterator<Item = &Reservation> {
        self.jobs.keys().filter_map(|job| self.get(job))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn reserve_counts_and_refuses_a_double_booking() {
        let mut l = Ledger::new();
        l.reserve("w1", "a", 100, 10).unwrap();
        l.reserve("w1", "b", 50, 11).unwrap();
        assert_eq!(l.reserved_count("w1"), 2);
        assert_eq!(l.reserved_kv_tokens("w1"), 150);
        assert_eq!(l.worker_of("a"), Some("w1"));
        let err = l.reserve("w2", "a", 1, 12).unwrap_err();
        assert_eq!(
            err,
            LedgerError::AlreadyReserved {
                job_id: "a".into(),
                worker_id: "w1".into()
            }
        );
        assert_eq!(l.reserved_count("w2"), 0);
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn stalls_are_charged_to_the_other_jobs_of_the_worker_only() {
        let profile = JobProfile {
            prompt_tokens: 100,
            protected_output: 50.0,
            min_tok_s: 30.0,
            ..Default::default()
        };
        let mut l = Ledger::new();
        l.reserve_profiled("w1", "a", 100, profile, 10).unwrap();
        l.reserve("w1", "b", 100, 10).unwrap();
        l.reserve("w2", "c", 100, 10).unwrap();
        l.charge_stall("w1", "b", 40.0, 0);
        l.charge_stall("w1", "b", f64::NAN, 0);
        l.charge_stall("w1", "b", -5.0, 0);
        assert_eq!(l.get("a").unwrap().stall_ms, 40.0);
        assert_eq!(l.get("b").unwrap().stall_ms, 0.0);
        assert_eq!(l.get("c").unwrap().stall_ms, 0.0);
        assert_eq!(l.get("a").unwrap().profile, Some(profile));
        let on: Vec<&str> = l.reservations_on("w1").map(|r| r.job_id.as_str()).collect();
        assert_eq!(on, ["a", "b"]);
    }

    #[test]
    fn release_is_idempotent_and_keeps_totals() {
        let mut l = Ledger::new();
        l.reserve("w1", "a", 100, 10).unwrap();
        l.reserve("w1", "b", 50, 11).unwrap();
        let r = l.release("a").unwrap();
        assert_eq!(
            (r.worker_id.as_str(), r.kv_tokens, r.reserved_ms),
            ("w1", 100, 10)
        );
        assert_eq!(l.release("a"), None);
        assert_eq!(l.reserved_count("w1"), 1);
        assert_eq!(l.reserved_kv_tokens("w1"), 50);
        l.release("b");
        assert!(l.is_empty());
        assert_eq!(l.reserved_kv_tokens("w1"), 0);
    }

    #[test]
    fn unreported_excludes_jobs_the_worker_lists() {
        let mut l = Ledger::new();
        l.reserve("w1", "a", 100, 10).unwrap();
        l.reserve("w1", "b", 50, 11).unwrap();
        assert_eq!(l.unreported("w1", &[]), (2, 150));
        assert_eq!(l.unreported("w1", &ids(&["a", "zzz"])), (1, 50));
        assert_eq!(l.unreported("w2", &ids(&["a"])), (0, 0));
        l.reserve("w1", "c", 7, 12).unwrap();
        assert_eq!(l.unreported("w1", &ids(&["c", "b", "a"])), (0, 0));
        assert_eq!(l.unreported("w1", &ids(&["b", "x", "c"])), (1, 100));
        assert_eq!(l.unreported("w1", &ids(&["c"])), (2, 150));
    }

    #[test]
    fn reconcile_adopts_confirms_and_expires() {
        let mut l = Ledger::new();
        l.reserve("w1", "listed", 10, 1_000).unwrap();
        l.reserve("w1", "young", 10, 1_500).unwrap();
        l.reserve("w1", "old", 10, 1_000).unwrap();
        l.reserve("w2", "elsewhere", 10, 1_000).unwrap();
        let r = l.reconcile(
            "w1",
            &ids(&["listed", "new", "elsewhere"]),
            77,
            1_000,
            2_200,
        );
        assert_eq!(r.adopted, ids(&["new"]));
        assert_eq!(r.expired, ids(&["old"]));
        assert_eq!(r.conflicting, ids(&["elsewhere"]));
        assert_eq!(l.get("listed").unwrap().confirmed_ms, 2_200);
        assert_eq!(l.get("new").unwrap().kv_tokens, 77);
        assert_eq!(l.get("new").unwrap().confirmed_ms, 2_200);
        assert!(
            l.get("young").is_some(),
            "booked 700 ms ago, inside the TTL"
        );
        assert_eq!(l.worker_of("elsewhere"), Some("w2"));
        assert_eq!(l.reserved_count("w1"), 3);
        assert_eq!(l.reserved_kv_tokens("w1"), 10 + 10 + 77);

        // A confirmed job that stops being listed lives TTL past its last confirmation.
        let r = l.reconcile("w1", &[], 0, 1_000, 3_100);
        assert_eq!(r.expired, ids(&["young"]));
        let r = l.reconcile("w1", &[], 0, 1_000, 3_201);
        assert_eq!(r.expired, ids(&["listed", "new"]));
        assert_eq!(l.reserved_count("w1"), 0);
    }

    #[test]
    fn release_worker_returns_its_reservations_in_booking_order() {
        let mut l = Ledger::new();
        l.reserve("w1", "b", 1, 1).unwrap();
        l.reserve("w1", "a", 2, 2).unwrap();
        l.reserve("w2", "c", 3, 3).unwrap();
        let gone: Vec<String> = l
            .release_worker("w1")
            .into_iter()
            .map(|r| r.job_id)
            .collect();
        assert_eq!(gone, ids(&["b", "a"]));
        assert_eq!(l.len(), 1);
        assert!(l.release_worker("w1").is_empty());
        assert_eq!(l.release("a"), None);
    }

    #[test]
    fn recent_placements_count_this_ledgers_bookings_decaying_over_the_window() {
        let mut l = Ledger::new();
        assert_eq!(l.recent_placements("w", 0), 0.0);
        l.reserve("w", "a", 10, 1_000).unwrap();
        l.reserve_profiled("w", "b", 10, JobProfile::default(), 1_000)
            .unwrap();
        assert!((l.recent_placements("w", 1_000) - 2.0).abs() < 1e-12);
        // One window on, each weighs 1/e; a third booked then counts in full.
        let t = 1_000 + ADMISSION_WINDOW_MS as u64;
        assert!((l.recent_placements("w", t) - 2.0 / std::f64::consts::E).abs() < 1e-12);
        l.reserve("w", "c", 10, t).unwrap();
        assert!((l.recent_placements("w", t) - (1.0 + 2.0 / std::f64::consts::E)).abs() < 1e-12);
        // A refused booking (the job is already booked) is no placement.
        assert!(l.reserve("w", "c", 10, t).is_err());
        assert!((l.recent_placements("w", t) - (1.0 + 2.0 / std::f64::consts::E)).abs() < 1e-12);
        // Releasing keeps the history; a job adopted from a heartbeat (an earlier leader
        // placed it) counts as placed when adopted, once.
        l.release("a");
        assert!((l.recent_placements("w", t) - (1.0 + 2.0 / std::f64::consts::E)).abs() < 1e-12);
        l.reconcile("w2", &["adopted".to_string()], 10, 1_000, t);
        l.reconcile("w2", &["adopted".to_string()], 10, 1_000, t);
        assert!(l.get("adopted").is_some());
        assert_eq!(l.recent_placements("w2", t), 1.0);
    }

    #[test]
    fn the_stall_outlook_is_the_recent_admissions_rate_and_mean_stall() {
        let mut l = Ledger::new();
        assert_eq!(
            l.stall_outlook("w", 0),
            StallOutlook::default(),
            "no admission yet"
        );
        // Two admissions at 1 s, stalling for 300 and 100 ms; read at once, then one window on.
        l.reserve("w", "a", 10, 1_000).unwrap();
        l.charge_stall("w", "a", 300.0, 1_000);
        l.reserve("w", "b", 10, 1_000).unwrap();
        l.charge_stall("w", "b", 100.0, 1_000);
        let now = l.stall_outlook("w", 1_000);
        assert!((now.admissions_per_ms - 2.0 / ADMISSION_WINDOW_MS).abs() < 1e-15);
        assert!((now.mean_stall_ms - 200.0).abs() < 1e-9);
        let later = l.stall_outlook("w", 1_000 + ADMISSION_WINDOW_MS as u64);
        assert!(
            (later.admissions_per_ms - now.admissions_per_ms / std::f64::consts::E).abs() < 1e-15
        );
        assert!(
            (later.mean_stall_ms - 200.0).abs() < 1e-9,
            "decay keeps the mean"
        );
        // The outlook outlives the bookings: an idle worker keeps its admissions' pace.
        l.release("a");
        l.release("b");
        assert_eq!(l.stall_outlook("w", 1_000), now);
        assert_eq!(l.stall_outlook("other", 1_000), StallOutlook::default());
        // A charge that is no stall is no admission to learn from.
        l.charge_stall("w", "c", f64::NAN, 1_000);
        l.charge_stall("w", "c", 0.0, 1_000);
        assert_eq!(l.stall_outlook("w", 1_000), now);
    }

    #[test]
    fn a_short_decode_most_likely_meets_no_admission_and_a_long_one_meets_its_share() {
        // One admission a second, each stalling 100 ms: a stall share of 10 %.
        let o = StallOutlook {
            admissions_per_ms: 1e-3,
            mean_stall_ms: 100.0,
        };
        assert!((o.stall_fraction() - 0.1).abs() < 1e-12);
        // 500 ms of decode (555 ms stretched): P(no admission) = e^-0.555 > 1/2.
        assert_eq!(o.likely_stall_ms(500.0), 0.0);
        // 900 ms (1 s stretched): P(0) = e^-1 < 1/2 ≤ P(0) + P(1): one admission.
        assert_eq!(o.likely_stall_ms(900.0), 100.0);
        // 90 s (100 s stretched): the median count of a mean of 100 is 100, the mean share.
        assert_eq!(o.likely_stall_ms(90_000.0), 10_000.0);
        // A share past the ceiling is held to it.
        let heavy = StallOutlook {
            admissions_per_ms: 1e-2,
            mean_stall_ms: 1_000.0,
        };
        assert_eq!(heavy.stall_fraction(), STALL_FRACTION_MAX);
        assert_eq!(StallOutlook::default().likely_stall_ms(1e9), 0.0);
    }

    #[test]
    fn the_poisson_median_matches_its_definition_on_both_sides_of_the_shortcut() {
        let beyond_the_shortcut = (0..500).map(|i| 50.05 + 0.73 * f64::from(i));
        for mu in [0.1, 0.69, 0.7, 1.0, 2.5, 10.0, 49.9]
            .into_iter()
            .chain(beyond_the_shortcut)
        {
            let m = poisson_median(mu);
            // P(N ≤ m) ≥ 1/2 > P(N ≤ m − 1), summed directly (in logs, for large means).
            let cdf = |k: f64| -> f64 {
                let mut sum = 0.0;
                let mut log_term = -mu;
                for n in 0..=(k as u32) {
                    if n > 0 {
                        log_term += mu.ln() - f64::from(n).ln();
                    }
                    sum += log_term.exp();
                }
                sum
            };
            assert!(cdf(m) >= 0.5, "mu {mu}: median {m}");
            assert!(m == 0.0 || cdf(m - 1.0) < 0.5, "mu {mu}: median {m}");
        }
        assert_eq!(poisson_median(0.0), 0.0);
        assert_eq!(poisson_median(f64::NAN), 0.0);
    }
}
