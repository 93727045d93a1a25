//! The pool map the operator console reads, kept by the thread that owns
//! the pool.
//!
//! The pool has one owner (the engine or PD node thread), so a reader never
//! touches it: it marks the map *wanted* and takes the latest one. While the
//! map is wanted (for [`WANTED_FOR`] after the last read) the owner refills
//! it after every step — O(pages) over the metadata, ~20 µs at the default
//! pool (`cargo bench -p kv --bench pool -- console`) — and swaps it in
//! under a lock held only for the swap. Nobody watching, it costs nothing.
//! A pool of more than [`MAP_SLICE_PAGES`] pages is taken a slice per step
//! (so no step waits more than one slice, ~60 µs, whatever the pool's size);
//! an idle owner takes the slices back to back, taking commands between
//! them. The longest time a step waited for the
//! map is kept: the console shows what it cost.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use request::console::PoolMap;

/// How long a read keeps the owner refreshing the map.
pub const WANTED_FOR: Duration = Duration::from_secs(3);

/// How long a read waits for a map taken after it asked (then it takes
/// the latest there is).
pub const FRESH_WAIT: Duration = Duration::from_millis(300);

/// Pages the owner maps per step at most (a larger pool's map spans
/// several steps: each page's state is of the step that mapped it).
pub const MAP_SLICE_PAGES: usize = 8192;

/// The owner's map in progress.
#[derive(Debug, Default)]
pub struct MapWork {
    map: PoolMap,
    /// Pages mapped so far (0: none; a new map starts).
    cursor: usize,
    /// The longest step spent on this map so far (µs).
    step_us_max: f64,
    /// When this map's first slice was taken.
    started: Option<Instant>,
}

impl MapWork {
    /// A map is half taken (its next slice is due).
    pub fn in_progress(&self) -> bool {
        self.cursor > 0
    }
}

/// A map in progress older than this starts over (the console stopped
/// reading in between: its slices would be of very different moments).
const MAP_STALE: Duration = Duration::from_secs(1);

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
    /// The longest time one step of the owner spent on the last map, and
    /// the longest since start (microseconds): what the console held a
    /// step up by.
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

    /// The owner's side, after a step: maps the next slice of the pool
    /// and, once the map is complete, swaps it in (an idle owner takes the
    /// slices back to back: `Core::console_pending`). The previous map's
    /// buffers come back when no reader holds them (no allocation in the
    /// steady state).
    pub fn refresh(&self, pool: &kv::Pool, work: &mut MapWork) {
        let t0 = Instant::now();
        let pages = pool.pages_total() as usize;
        if work.started.is_some_and(|t| t.elapsed() > MAP_STALE) {
            work.cursor = 0;
        }
        if work.cursor == 0 {
            work.started = Some(t0);
            work.map.clear();
            work.map.reserve(pages);
            work.step_us_max = 0.0;
        }
        let end = (work.cursor + MAP_SLICE_PAGES).min(pages);
        pool.map_range_into(&mut work.map, work.cursor..end);
        work.cursor = end;
        if end < pages {
            work.step_us_max = work.step_us_max.max(t0.elapsed().as_secs_f64() * 1e6);
            return;
        }
        work.cursor = 0;
        debug_assert_eq!(work.map.len(), pages);
        let fresh = Arc::new(std::mem::take(&mut work.map));
        let old = {
            let mut l = self.latest.lock().unwrap_or_else(|e| e.into_inner());
            let step_us = work.step_us_max.max(t0.elapsed().as_secs_f64() * 1e6);
            l.version += 1;
            l.taken = Instant::now();
            l.fill_us_last = step_us;
            l.fill_us_max = l.fill_us_max.max(step_us);
            std::mem::replace(&mut l.map, fresh)
        };
        if let Ok(buffers) = Arc::try_unwrap(old) {
            work.map = buffers;
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
        held: snap.map.held_by_tenant(),
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
        let mut work = MapWork::default();
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
        cell.refresh(&p, &mut work);
        let s = reader.join().unwrap();
        assert_eq!(s.version, 1);
        assert_eq!(s.map.len(), 6);
        assert_eq!(s.map.counts().private, 2);
        assert_eq!(s.map.who[held[0].index as usize], 3);
        assert!(s.fill_us_max >= s.fill_us_last && s.fill_us_last > 0.0);
        // A young map is served at once; the buffers come back as spare.
        drop(s);
        cell.refresh(&p, &mut work);
        assert_eq!(work.map.len(), 6, "the previous map's buffers are reused");
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

    #[test]
    fn a_large_pool_is_mapped_a_slice_per_step() {
        let shape = KvShape::new(1, 1, 32, 4, DType::F32).unwrap();
        let pages = 2 * MAP_SLICE_PAGES as u64 + 5;
        let mut p = Pool::new(shape, pages, PoolOptions::default()).unwrap();
        let mut held = Vec::new();
        p.alloc(Owner::new(RequestId(1), TenantId(3)), 4, &mut held)
            .unwrap();
        let cell = ConsoleCell::new();
        let mut work = MapWork::default();
        // Busy: three steps, the map swapped in at the third only.
        cell.refresh(&p, &mut work);
        cell.refresh(&p, &mut work);
        assert_eq!(cell.latest().version, 0);
        assert_eq!(work.map.len(), 2 * MAP_SLICE_PAGES);
        cell.refresh(&p, &mut work);
        let s = cell.latest();
        assert_eq!((s.version, s.map.len()), (1, pages as usize));
        assert_eq!(s.map.counts().private, 4);
        let mut whole = PoolMap::default();
        p.map_into(&mut whole);
        assert_eq!(*s.map, whole);
        // The next map starts over and is whole again after three slices.
        for _ in 0..3 {
            cell.refresh(&p, &mut work);
        }
        assert_eq!(cell.latest().version, 2);
        assert_eq!(*cell.latest().map, whole);
    }
}
