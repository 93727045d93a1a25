//! The pool map the operator console reads, kept by the thread that owns
//! the pool.
//!
//! The pool has one owner (the engine or PD node thread), so a reader never
//! touches it: it marks the map *wanted* and takes the latest one. While the
//! map is wanted (for [`WANTED_FOR`] after the last read) the owner refills
//! it after every step — O(pages) over the metadata, ~20 µs at the default
//! pool (`cargo bench -p kv --bench pool -- console`) — and swaps it in
//! under a lock held only for the swap. Nobody watching, it costs nothing.
//! The time each refill took is kept: the console shows what it cost.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use request::console::PoolMap;

/// How long a read keeps the owner refreshing the map.
pub const WANTED_FOR: Duration = Duration::from_secs(3);

/// How long a read waits for a map taken after it asked (then it takes
/// the latest there is).
pub const FRESH_WAIT: Duration = Duration::from_millis(300);

/// A map younger than this is served without waiting.
const FRESH_ENOUGH: Duration = Duration::from_millis(50);

/// The latest map and what taking it cost.
#[derive(Clone, Debug)]
pub struct MapSnapshot {
    pub map: Arc<PoolMap>,
    /// When it was taken.
    pub taken: Instant,
    /// Refills so far (0: none yet).
    pub version: u64,
    /// Time the owner spent on the last refill and the longest one
    /// (microseconds).
    pub fill_us_last: f64,
    pub fill_us_max: f64,
}

/// Shared between the pool's owner and the console's readers.
#[derive(Debug)]
pub struct ConsoleCell {
    start: Instant,
    /// Milliseconds after `start` until which the map is wanted.
    wanted_until_ms: AtomicU64,
    latest: Mutex<MapSnapshot>,
    /// A wake-up is on its way to the owner (at most one at a time, so
    /// readers never fill the owner's command queue).
    wake_pending: std::sync::atomic::AtomicBool,
}

impl Default for ConsoleCell {
    fn default() -> Self {
        ConsoleCell::new()
    }
}

impl ConsoleCell {
    pub fn new() -> ConsoleCell {
        let start = Instant::now();
        ConsoleCell {
            start,
            wanted_until_ms: AtomicU64::new(0),
            latest: Mutex::new(MapSnapshot {
                map: Arc::new(PoolMap::default()),
                taken: start,
                version: 0,
                fill_us_last: 0.0,
                fill_us_max: 0.0,
            }),
            wake_pending: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Claims the one wake-up a reader may have in flight; `false`: one is
    /// on its way already.
    pub fn claim_wake(&self) -> bool {
        !self.wake_pending.swap(true, Ordering::AcqRel)
    }

    /// The owner took the wake-up (or the reader could not send it).
    pub fn wake_done(&self) {
        self.wake_pending.store(false, Ordering::Release);
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Whether a reader asked recently (the owner checks it every step).
    pub fn wanted(&self) -> bool {
        self.now_ms() < self.wanted_until_ms.load(Ordering::Relaxed)
    }

    /// The latest snapshot, without asking for a new one.
    pub fn latest(&self) -> MapSnapshot {
        self.latest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Marks the map wanted and returns one taken after this call if the
    /// owner produces it within [`FRESH_WAIT`] (`wake` nudges an idle
    /// owner), else the latest. Blocks at most [`FRESH_WAIT`].
    pub fn read(&self, wake: impl FnOnce()) -> MapSnapshot {
        let asked = Instant::now();
        let until = self.now_ms() + WANTED_FOR.as_millis() as u64;
        self.wanted_until_ms.fetch_max(until, Ordering::Relaxed);
        let first = self.latest();
        if first.version > 0 && first.taken.elapsed() < FRESH_ENOUGH {
            return first;
        }
        wake();
        // Bounded: FRESH_WAIT / 2 ms polls at most.
        while asked.elapsed() < FRESH_WAIT {
            std::thread::sleep(Duration::from_millis(2));
            let s = self.latest();
            if s.version > first.version {
                return s;
            }
        }
        self.latest()
    }

    /// The owner's side: refills `spare` from the pool and swaps it in.
    /// `spare` gets the previous map's buffers back when no reader holds
    /// them (no allocation in the steady state).
    pub fn refresh(&self, pool: &kv::Pool, spare: &mut PoolMap) {
        let t0 = Instant::now();
        pool.map_into(spare);
        let fresh = Arc::new(std::mem::take(spare));
        let old = {
            let mut l = self.latest.lock().unwrap_or_else(|e| e.into_inner());
            let fill_us = t0.elapsed().as_secs_f64() * 1e6;
            l.version += 1;
            l.taken = Instant::now();
            l.fill_us_last = fill_us;
            l.fill_us_max = l.fill_us_max.max(fill_us);
            std::mem::replace(&mut l.map, fresh)
        };
        if let Ok(buffers) = Arc::try_unwrap(old) {
            *spare = buffers;
        }
    }
}

/// The console's view of a node from its latest map, its pool's counters
/// and its transfers in flight.
pub fn node_view(
    name: &str,
    role: &str,
    snap: &MapSnapshot,
    pool: &request::PoolStats,
    transfers: Vec<request::console::TransferView>,
) -> request::console::NodeView {
    request::console::NodeView {
        name: name.into(),
        role: role.into(),
        grid: snap.map.grid(request::console::GRID_CELLS_MAX),
        counts: snap.map.counts(),
        safety: request::console::pool_safety(pool),
        transfers,
        snapshot_us_last: snap.fill_us_last,
        snapshot_us_max: snap.fill_us_max,
        map_age_ms: snap.taken.elapsed().as_secs_f64() * 1e3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv::{DType, KvShape, Owner, Pool, PoolOptions, RequestId, TenantId};
    use request::console::PageState;

    fn pool() -> Pool {
        let shape = KvShape::new(1, 1, 32, 4, DType::F32).unwrap();
        Pool::new(shape, 6, PoolOptions::default()).unwrap()
    }

    #[test]
    fn a_read_gets_a_map_taken_after_it_asked() {
        let cell = Arc::new(ConsoleCell::new());
        let mut p = pool();
        let mut spare = PoolMap::default();
        assert!(!cell.wanted());
        let mut held = Vec::new();
        p.alloc(Owner::new(RequestId(1), TenantId(3)), 2, &mut held)
            .unwrap();
        // The owner refreshes only once a reader has asked.
        let reader = {
            let cell = cell.clone();
            std::thread::spawn(move || cell.read(|| {}))
        };
        let t0 = Instant::now();
        while !cell.wanted() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(cell.wanted());
        cell.refresh(&p, &mut spare);
        let s = reader.join().unwrap();
        assert_eq!(s.version, 1);
        assert_eq!(s.map.len(), 6);
        assert_eq!(s.map.counts().private, 2);
        assert_eq!(s.map.who[held[0].index as usize], 3);
        assert!(s.fill_us_max >= s.fill_us_last && s.fill_us_last > 0.0);
        // A young map is served at once; the buffers come back as spare.
        drop(s);
        cell.refresh(&p, &mut spare);
        assert_eq!(spare.len(), 6, "the previous map's buffers are reused");
        let s = cell.read(|| panic!("no wake for a fresh map"));
        assert_eq!(s.version, 2);
        assert_eq!(s.map.state[0], PageState::Private);
    }

    #[test]
    fn a_read_without_an_owner_returns_after_the_wait() {
        let cell = ConsoleCell::new();
        let t0 = Instant::now();
        let mut woke = false;
        let s = cell.read(|| woke = true);
        assert!(woke);
        assert_eq!(s.version, 0);
        assert!(t0.elapsed() >= FRESH_WAIT && t0.elapsed() < FRESH_WAIT * 4);
    }

    #[test]
    fn readers_have_one_wake_up_in_flight_at_most() {
        let cell = ConsoleCell::new();
        assert!(cell.claim_wake());
        assert!(!cell.claim_wake(), "a second reader sends none");
        cell.wake_done();
        assert!(cell.claim_wake());
    }
}
