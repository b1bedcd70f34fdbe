//! Giving memory back once a flood of subscribers has gone.
//!
//! glibc keeps what was freed in its arenas for reuse; after thousands of
//! connections and their queues are gone that is hundreds of MiB the
//! process still shows as resident. `malloc_trim(0)` hands the free pages of
//! every arena back to the system. It walks the heap, so it runs only after
//! a large drop, on a blocking thread, at most once per drop.

/// Decides when a drop is large enough to trim for.
#[derive(Debug, Default)]
pub struct Trimmer {
    /// The most held (and the most subscribers) since the last trim.
    high_bytes: usize,
    high_subscribers: usize,
}

/// Drops smaller than this are not worth a walk of the heap.
const MIN_DROP_BYTES: usize = 64 << 20;
const MIN_DROP_SUBSCRIBERS: usize = 500;

impl Trimmer {
    /// Called periodically with what subscribers hold now and how many are
    /// connected; true when either fell to a quarter of a large high mark.
    pub fn observe(&mut self, held_bytes: usize, subscribers: usize) -> bool {
        self.high_bytes = self.high_bytes.max(held_bytes);
        self.high_subscribers = self.high_subscribers.max(subscribers);
        let bytes_fell = self.high_bytes >= MIN_DROP_BYTES && held_bytes <= self.high_bytes / 4;
        let subscribers_left =
            self.high_subscribers >= MIN_DROP_SUBSCRIBERS && subscribers <= self.high_subscribers / 4;
        if bytes_fell || subscribers_left {
            self.high_bytes = held_bytes;
            self.high_subscribers = subscribers;
            return true;
        }
        false
    }
}

/// Returns free heap pages to the system (glibc only; elsewhere nothing to do).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only reads and changes the allocator's own state,
    // under the allocator's locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_once_after_a_large_drop_and_not_for_small_ones() {
        let mut t = Trimmer::default();
        assert!(!t.observe(10 << 20, 10), "small peaks are not worth it");
        assert!(!t.observe(0, 0));
        assert!(!t.observe(400 << 20, 2000));
        assert!(!t.observe(200 << 20, 1500), "half is not enough");
        assert!(t.observe(50 << 20, 1500), "a quarter of the high mark is");
        assert!(!t.observe(10 << 20, 1200), "once per drop");
        assert!(t.observe(10 << 20, 200), "the fleet leaving counts as well");
    }
}
