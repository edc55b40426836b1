//! The leader lease: the value of [`crate::names::LEADER_KEY`] in the `leader` bucket, and
//! how a worker-agent checks an epoch it has not seen before against it.
//!
//! Why: an agent refuses assignments below the highest epoch it has accepted, so one
//! assignment with an impossible epoch (`u64::MAX`, from a buggy or compromised writer of
//! `work.<worker_id>`) used to make it refuse every later assignment of the real leader,
//! which kept picking the idle-looking worker until the jobs ran out of attempts. An
//! epoch above the agent's highest is now believed only when the lease vouches for it.
//!
//! Invariant: a term's epoch is the lease's creation revision, or higher when lifted above
//! the epochs workers report (a rebuilt bucket); the leader records it in the lease value
//! ([`LeaseValue::epoch`]) as soon as it knows it. Every genuine epoch, the current term's
//! and every earlier one's, is at most the recorded epoch; without a record (an older
//! dispatcher, or the moments before the first renewal) at most the lease's current
//! revision, since revisions only grow.

use serde::{Deserialize, Serialize};

/// Value of the lease key, for operators and for agents checking epochs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseValue {
    pub dispatcher_id: String,
    pub acquired_ms: u64,
    pub renewed_ms: u64,
    /// The epoch the leading term's assignments carry, once the leader has computed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
}

/// Whether the lease, stored at `revision` with `value`, vouches for an assignment epoch
/// `epoch` (see the module docs). A value that does not parse vouches by its revision only.
pub fn lease_vouches_for(epoch: u64, revision: u64, value: &[u8]) -> bool {
    match serde_json::from_slice::<LeaseValue>(value)
        .ok()
        .and_then(|v| v.epoch)
    {
        Some(recorded) => epoch <= recorded,
        None => epoch <= revision,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(epoch: Option<u64>) -> Vec<u8> {
        serde_json::to_vec(&LeaseValue {
            dispatcher_id: "d".into(),
            acquired_ms: 1,
            renewed_ms: 2,
            epoch,
        })
        .unwrap()
    }

    #[test]
    fn a_recorded_epoch_bounds_every_genuine_one() {
        assert!(lease_vouches_for(40, 57, &value(Some(40))));
        assert!(
            lease_vouches_for(12, 57, &value(Some(40))),
            "an earlier term's"
        );
        assert!(
            !lease_vouches_for(41, 57, &value(Some(40))),
            "below the revision but above the term's"
        );
        assert!(!lease_vouches_for(u64::MAX, 57, &value(Some(40))));
        // Lifted above the revision (a rebuilt bucket): recorded, so believed.
        assert!(lease_vouches_for(600, 3, &value(Some(600))));
    }

    #[test]
    fn without_a_record_the_revision_bounds_it() {
        assert!(lease_vouches_for(40, 57, &value(None)));
        assert!(!lease_vouches_for(58, 57, &value(None)));
        assert!(!lease_vouches_for(u64::MAX, 57, b"not json"));
        assert!(lease_vouches_for(5, 5, b"not json"));
        // An older dispatcher's value (no epoch field) reads as no record.
        let old = br#"{"dispatcher_id":"d","acquired_ms":1,"renewed_ms":2}"#;
        assert!(!lease_vouches_for(6, 5, old));
    }
}
