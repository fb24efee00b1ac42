//! A failed collective, classified once, from facts: the one place that
//! decides between a timeout, a peer gone, a cancelled epoch and a backend
//! error, for any transport that can say who never reached a collective
//! (the Python bindings' engines, over torch's or Paddle's gloo).
//!
//! The facts are what the engine can know without reading anybody's
//! wording: whether a broken membership epoch cut the wait short, how long
//! this rank waited against the deadline it gave the collective, and which
//! ranks never reached it (their position in the store is below the failed
//! collective's). gloo reports a vanished peer and a deadline alike, as an
//! I/O error with a message that differs across versions and frameworks;
//! the clock and the store do not.
//!
//! * cut short by the epoch's break: [`CommError::Cancelled`];
//! * waited the whole deadline: [`CommError::Timeout`], naming the ranks behind;
//! * failed early with exactly one rank behind: that rank is gone
//!   ([`CommError::PeerGone`]): its connection broke before it reached the
//!   collective;
//! * anything else (failed early with nobody or several behind, a bad
//!   argument): [`CommError::Backend`] with the message and the ranks behind.

use std::time::Duration;

use crate::error::{CollectiveTag, CommError};

/// What a transport knows about a collective that failed.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// The collective.
    pub tag: CollectiveTag,
    /// What the library said (kept for the message, never parsed).
    pub message: String,
    /// Ranks that never reached the collective (empty when the store cannot say).
    pub behind: Vec<usize>,
    /// How long this rank waited.
    pub waited: Duration,
    /// The deadline this rank gave the collective.
    pub timeout: Duration,
    /// A broken membership epoch cut the wait short.
    pub cancelled: bool,
}

/// How close to its deadline a failed wait counts as having waited it out:
/// the library measures the deadline from its own start, in whole
/// milliseconds, so a wait that ran out can read a little short here. A peer
/// that is gone fails a wait long before (a closed socket is seen at once).
fn deadline_slack(timeout: Duration) -> Duration {
    (timeout / 50).max(Duration::from_millis(10))
}

impl Failure {
    /// This failure as the runtime's error, for rank `rank` (see the module docs).
    pub fn classify(self, rank: usize) -> CommError {
        let Failure { tag, message, behind, waited, timeout, cancelled } = self;
        if cancelled {
            return CommError::Cancelled { rank, tag };
        }
        if waited + deadline_slack(timeout) >= timeout {
            return CommError::Timeout { rank, tag, missing: behind, waited };
        }
        if let [peer] = behind[..] {
            return CommError::PeerGone { rank, peer, tag };
        }
        let why = if behind.is_empty() { message } else { format!("{message}; ranks {behind:?} had not reached it") };
        CommError::Backend { rank, tag, why }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CollectiveKind;

    fn failure(behind: Vec<usize>, waited_ms: u64, cancelled: bool) -> Failure {
        Failure {
            tag: CollectiveTag { step: 3, kind: CollectiveKind::Control { len: 4 } },
            message: "Connection closed by peer".into(),
            behind,
            waited: Duration::from_millis(waited_ms),
            timeout: Duration::from_millis(2000),
            cancelled,
        }
    }

    #[test]
    fn a_wait_as_long_as_the_deadline_is_a_timeout_naming_the_ranks_behind() {
        let e = failure(vec![0, 2], 2000, false).classify(1);
        assert!(matches!(e, CommError::Timeout { rank: 1, ref missing, .. } if missing == &[0, 2]), "{e}");
        let e = failure(vec![], 2500, false).classify(1);
        assert!(matches!(e, CommError::Timeout { ref missing, .. } if missing.is_empty()), "{e}");
        // The library's own clock ran out a hair before ours: still the deadline, not a lost peer.
        let e = failure(vec![1], 1990, false).classify(0);
        assert!(matches!(e, CommError::Timeout { ref missing, .. } if missing == &[1]), "{e}");
        let e = failure(vec![1], 1900, false).classify(0);
        assert!(matches!(e, CommError::PeerGone { peer: 1, .. }), "an early failure with one rank behind: {e}");
    }

    #[test]
    fn an_early_failure_with_one_rank_behind_names_it_gone() {
        let e = failure(vec![2], 40, false).classify(0);
        assert!(matches!(e, CommError::PeerGone { rank: 0, peer: 2, .. }), "{e}");
    }

    #[test]
    fn an_early_failure_that_cannot_name_one_rank_is_a_backend_error_with_what_is_known() {
        let e = failure(vec![1, 2], 40, false).classify(0);
        assert!(
            matches!(e, CommError::Backend { ref why, .. } if why.contains("ranks [1, 2] had not reached it")),
            "{e}"
        );
        let e = failure(vec![], 40, false).classify(0);
        assert!(matches!(e, CommError::Backend { ref why, .. } if why == "Connection closed by peer"), "{e}");
    }

    #[test]
    fn a_broken_epoch_is_a_cancellation_whatever_else_is_known() {
        let e = failure(vec![2], 2000, true).classify(0);
        assert!(matches!(e, CommError::Cancelled { rank: 0, .. }), "{e}");
    }
}
