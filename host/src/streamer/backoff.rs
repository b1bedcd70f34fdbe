//! Retry delays for the replication loop: 25 ms doubling up to 10 s (Zero's
//! RunningState).

use std::time::Duration;

pub const INITIAL: Duration = Duration::from_millis(25);
pub const MAX: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: INITIAL }
    }
}

impl Backoff {
    /// The delay before the next attempt; each call doubles the one after.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(MAX);
        d
    }

    /// Called once a stream makes progress.
    pub fn reset(&mut self) {
        self.next = INITIAL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let mut b = Backoff::default();
        let ms: Vec<u128> = (0..11).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(ms, [25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 10000, 10000]);
        b.reset();
        assert_eq!(b.next_delay(), INITIAL);
    }
}
