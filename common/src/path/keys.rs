//! Round trips that recent one-sided GETs of each key took. A key that is
//! rewritten all the time keeps missing its cached address (two round trips
//! instead of one) or retrying verification; pricing it by its own history
//! sends it over RPC while other keys stay one-sided.

/// Entries in the table (a power of two; direct-mapped by key hash).
pub const DEFAULT_KEY_ENTRIES: usize = 4096;
/// Weight of a new GET in a key's mean.
const KEY_SMOOTHING: f64 = 0.5;

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    key: u64,
    rounds: f64,
    at: u64,
    used: bool,
}

/// A bounded, direct-mapped table from key hash to mean round trips. A
/// collision replaces the older key: the table forgets, it never grows.
#[derive(Debug, Clone)]
pub struct KeyRounds {
    entries: Vec<Entry>,
    memory_ns: u64,
}

impl KeyRounds {
    /// A table of `entries` (rounded up to a power of two) whose records
    /// expire `memory_ns` after their last update.
    pub fn new(entries: usize, memory_ns: u64) -> Self {
        KeyRounds { entries: vec![Entry::default(); entries.max(1).next_power_of_two()], memory_ns }
    }

    fn slot(&self, key: u64) -> usize {
        (key as usize) & (self.entries.len() - 1)
    }

    /// The key's mean round trips per GET, if it was read lately.
    pub fn get(&self, key: u64, now: u64) -> Option<f64> {
        let e = &self.entries[self.slot(key)];
        (e.used && e.key == key && now.saturating_sub(e.at) < self.memory_ns).then_some(e.rounds)
    }

    /// Records a GET of `key` that took `rounds` round trips.
    pub fn record(&mut self, key: u64, rounds: f64, now: u64) {
        let memory = self.memory_ns;
        let i = self.slot(key);
        let e = &mut self.entries[i];
        if e.used && e.key == key && now.saturating_sub(e.at) < memory {
            e.rounds += KEY_SMOOTHING * (rounds - e.rounds);
        } else {
            e.rounds = rounds;
        }
        e.key = key;
        e.at = now;
        e.used = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_expires_and_replaces_on_collision() {
        let mut k = KeyRounds::new(4, 1_000);
        k.record(1, 2.0, 0);
        k.record(1, 4.0, 10);
        assert_eq!(k.get(1, 20), Some(3.0));
        assert_eq!(k.get(1, 1_010), None);
        k.record(5, 1.0, 20); // 5 & 3 == 1: same slot
        assert_eq!(k.get(1, 30), None);
        assert_eq!(k.get(5, 30), Some(1.0));
    }
}
