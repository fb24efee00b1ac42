//! The protocol's notion of now: the system's clock in a job, a clock the
//! test drives in the unit tests of the monitor and the tally, so that what
//! they decide about silence and deadlines never depends on how fast a
//! loaded machine runs the test.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where the monitor and the agreement read the time.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to ([`ManualClock::advance`]); clones
/// share it.
#[derive(Debug, Clone)]
pub struct ManualClock {
    /// The instant it started at, and how far it has been moved since.
    at: Arc<Mutex<(Instant, Duration)>>,
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock { at: Arc::new(Mutex::new((Instant::now(), Duration::ZERO))) }
    }
}

impl ManualClock {
    /// Move the clock on by `by`.
    pub fn advance(&self, by: Duration) {
        self.at.lock().unwrap_or_else(|p| p.into_inner()).1 += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        let (start, moved) = *self.at.lock().unwrap_or_else(|p| p.into_inner());
        start + moved
    }
}

/// A shared clock (what the monitor and the agreement hold).
pub type SharedClock = Arc<dyn Clock>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced_and_clones_share_it() {
        let clock = ManualClock::default();
        let t0 = clock.now();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(clock.now(), t0, "real time does not move it");
        let other = clock.clone();
        other.advance(Duration::from_secs(3));
        assert_eq!(clock.now() - t0, Duration::from_secs(3));
        assert!(SystemClock.now() >= t0);
    }
}
