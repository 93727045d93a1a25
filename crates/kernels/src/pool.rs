//! A small fork-join thread pool with persistent workers and microsecond
//! dispatch.
//!
//! Protocol (one job at a time, serialised by `dispatch_lock`). `state`
//! packs `generation << 32 | CLOSED | inside`, where `inside` counts the
//! workers currently taking part in the job:
//! 1. the caller stores the job descriptor in `job`, resets the item counter
//!    `next` and publishes a new generation with `inside = 0` (SeqCst store);
//! 2. a worker that sees a new generation *joins* it with a CAS incrementing
//!    `inside`, which fails if the generation changed or the job is CLOSED;
//!    only after joining does it read `job`;
//! 3. everybody (the caller included) claims chunks of items from `next`
//!    until none are left; a joined worker then decrements `inside`;
//! 4. the caller, once out of items, sets CLOSED (no more joins) and waits
//!    until `inside == 0`. Only then is the closure — which lives on the
//!    caller's stack — released, so no worker can touch it afterwards.
//!
//! A worker that is descheduled (e.g. on an oversubscribed machine) therefore
//! never delays a job: the caller and the other workers take its items, and
//! the late worker finds the job closed and skips it.
//!
//! A panic in a task is caught on the thread that ran it, the other items
//! still run, and the first panic is re-raised on the calling thread once
//! every joined thread is done; the pool stays usable.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Environment variable overriding the default number of threads.
pub const THREADS_ENV: &str = "ISOSERVE_THREADS";

/// How long an idle worker polls for a new job before parking on the condvar.
const SPIN_TIME: Duration = Duration::from_micros(200);
/// Polls with `spin_loop` before switching to `yield_now` while spinning.
const SPIN_TIGHT: u32 = 1 << 12;
/// `parallel_for` cuts its items into about this many chunks per thread.
const CHUNKS_PER_THREAD: usize = 4;

const CLOSED: u64 = 1 << 31;
const INSIDE_MASK: u64 = CLOSED - 1;

thread_local! {
    /// Set while the thread is a pool worker or runs a pool task: nested
    /// dispatches then run inline instead of deadlocking.
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

type Task = dyn Fn(Range<usize>) + Sync;

#[derive(Clone, Copy)]
struct JobDesc {
    task: *const Task,
    n_items: usize,
    chunk: usize,
}

#[repr(align(128))]
struct Padded<T>(T);

struct Shared {
    state: Padded<AtomicU64>,
    next: Padded<AtomicUsize>,
    /// Written only by the dispatching caller while no worker is joined and
    /// before publishing a generation; read by workers only after joining.
    job: UnsafeCell<Option<JobDesc>>,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

// SAFETY: `job` is the only non-Sync field; its accesses are ordered by the
// join protocol described in the module docs (written before the SeqCst
// publication of a generation and after `inside` returned to 0 with the job
// CLOSED; read only by joined workers, after their Acquire CAS). The task it
// points to is `Sync`, so calling it from several threads is fine.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under the protocol.
unsafe impl Send for Shared {}

/// Fixed-size pool of persistent worker threads; the calling thread takes part
/// in every job, so `ThreadPool::new(2)` starts one extra thread.
///
/// Items are handed out dynamically in chunks, so a slow or descheduled
/// worker never stalls a job. Dispatching costs about a microsecond when the
/// workers are spinning (they poll for ~200 µs after each job, then park).
/// No allocation happens per job.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    dispatch_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool running jobs on `n_threads` threads in total (the caller plus
    /// `n_threads - 1` workers); 0 is treated as 1.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            state: Padded(AtomicU64::new(0)),
            next: Padded(AtomicUsize::new(0)),
            job: UnsafeCell::new(None),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        });
        let workers = (1..n_threads)
            .map(|idx| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("isoserve-worker-{idx}"))
                    .spawn(move || worker_loop(&shared))
                    .expect("failed to spawn a thread-pool worker")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            n_threads,
            dispatch_lock: Mutex::new(()),
        }
    }

    /// A pool sized from [`THREADS_ENV`] if set to a positive integer, else
    /// from [`std::thread::available_parallelism`].
    pub fn from_env() -> ThreadPool {
        ThreadPool::new(default_threads())
    }

    /// Total number of threads taking part in a job (including the caller).
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Calls `f(i)` exactly once for every task index `i` in
    /// `0..n_threads()`, in parallel, and returns when all calls returned.
    /// Typical use: `split_range(items, n_threads, i)` as a static partition.
    /// Index `i` is a task number, not a thread identity: if a worker is slow
    /// to start, another thread (often the caller) runs its index. Called from
    /// inside a task, the calls run inline.
    ///
    /// If a call panics, the panic is re-raised here after all calls ended.
    pub fn broadcast<F: Fn(usize) + Sync>(&self, f: F) {
        self.run(self.n_threads, 1, &|r: Range<usize>| {
            for i in r {
                f(i);
            }
        });
    }

    /// Calls `f` on disjoint contiguous ranges covering `0..n_items`, in
    /// parallel, and returns when all calls returned. The range boundaries
    /// depend only on `n_items` and `n_threads()` (about 4 chunks per
    /// thread); which thread runs which range is unspecified.
    ///
    /// If a call panics, the panic is re-raised here after all calls ended.
    pub fn parallel_for<F: Fn(Range<usize>) + Sync>(&self, n_items: usize, f: F) {
        if n_items == 0 {
            return;
        }
        if self.n_threads == 1 || n_items == 1 {
            f(0..n_items);
            return;
        }
        let chunk = n_items.div_ceil(self.n_threads * CHUNKS_PER_THREAD);
        self.run(n_items, chunk, &f);
    }

    /// Calls `f(k, chunk)` for every `chunk_len`-long chunk `k` of `data`
    /// (the last may be shorter), in parallel; each chunk goes to exactly
    /// one call. For element-wise work on a buffer the caller owns.
    pub fn for_each_chunk_mut<T: Send, F: Fn(usize, &mut [T]) + Sync>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: F,
    ) {
        assert!(chunk_len > 0, "for_each_chunk_mut: chunk_len 0");
        let len = data.len();
        let base = SendPtr(data.as_mut_ptr());
        self.parallel_for(len.div_ceil(chunk_len), |ks| {
            for k in ks {
                let start = k * chunk_len;
                let end = (start + chunk_len).min(len);
                // SAFETY: `parallel_for` hands out every k exactly once, so
                // the chunks are disjoint; `data` stays mutably borrowed for
                // this whole call.
                let chunk =
                    unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
                f(k, chunk);
            }
        });
    }

    /// As [`ThreadPool::parallel_for`] with an explicit chunk size: `f` gets
    /// the ranges `k*chunk .. min((k+1)*chunk, n_items)` (`chunk` ≥ 1).
    pub fn parallel_for_chunked<F: Fn(Range<usize>) + Sync>(
        &self,
        n_items: usize,
        chunk: usize,
        f: F,
    ) {
        let chunk = chunk.max(1);
        if n_items == 0 {
            return;
        }
        if self.n_threads == 1 || n_items <= chunk {
            let mut start = 0;
            while start < n_items {
                let end = (start + chunk).min(n_items);
                f(start..end);
                start = end;
            }
            return;
        }
        self.run(n_items, chunk, &f);
    }

    fn run(&self, n_items: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync + '_)) {
        if self.workers.is_empty() || IN_POOL.with(Cell::get) {
            // Single thread, or nested call from a task: run inline.
            let mut start = 0;
            while start < n_items {
                let end = (start + chunk).min(n_items);
                f(start..end);
                start = end;
            }
            return;
        }
        let guard = self
            .dispatch_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let sh = &*self.shared;
        // SAFETY: erasing the lifetime is sound because this function does
        // not return before every joined worker is done with the pointer
        // (job CLOSED and `inside == 0` below), and no worker can join later.
        let task: *const Task = unsafe {
            std::mem::transmute::<*const (dyn Fn(Range<usize>) + Sync + '_), *const Task>(f)
        };
        let job = JobDesc {
            task,
            n_items,
            chunk,
        };
        // SAFETY: no worker is joined (the previous job ended with
        // `inside == 0` and CLOSED) and the new generation is not published.
        unsafe { *sh.job.get() = Some(job) };
        sh.next.0.store(0, Ordering::Relaxed);
        let generation = (sh.state.0.load(Ordering::Relaxed) >> 32) + 1;
        sh.state.0.store(generation << 32, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
            sh.wake.notify_all();
        }

        IN_POOL.with(|c| c.set(true));
        work(sh, &job);
        IN_POOL.with(|c| c.set(false));

        sh.state.0.fetch_or(CLOSED, Ordering::AcqRel);
        let mut spins = 0u32;
        while sh.state.0.load(Ordering::Acquire) & INSIDE_MASK != 0 {
            if spins < SPIN_TIGHT {
                spins += 1;
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        // SAFETY: the job is closed and no worker is inside it.
        unsafe { *sh.job.get() = None };
        let panicked = sh
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(guard);
        if let Some(p) = panicked {
            panic::resume_unwind(p);
        }
    }
}

/// Claims and runs chunks of `job` until none are left.
fn work(sh: &Shared, job: &JobDesc) {
    loop {
        let start = sh.next.0.fetch_add(job.chunk, Ordering::Relaxed);
        if start >= job.n_items {
            return;
        }
        let end = (start + job.chunk).min(job.n_items);
        // SAFETY: the task outlives the job (see `ThreadPool::run`) and is
        // `Sync`.
        let r = panic::catch_unwind(AssertUnwindSafe(|| unsafe { (*job.task)(start..end) }));
        if let Err(p) = r {
            let mut slot = sh.panic.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.is_none() {
                *slot = Some(p);
            }
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::SeqCst);
        let generation = (sh.state.0.load(Ordering::SeqCst) >> 32) + 1;
        sh.state
            .0
            .store(generation << 32 | CLOSED, Ordering::SeqCst);
        {
            let _g = sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
            sh.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

/// The `tid`-th of `parts` contiguous ranges splitting `0..n`.
pub fn split_range(n: usize, parts: usize, tid: usize) -> Range<usize> {
    (n * tid / parts)..(n * (tid + 1) / parts)
}

/// Threads from [`THREADS_ENV`] or `available_parallelism`.
pub fn default_threads() -> usize {
    parse_threads(std::env::var(THREADS_ENV).ok().as_deref()).unwrap_or_else(|| {
        thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}

fn parse_threads(v: Option<&str>) -> Option<usize> {
    v.and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

fn worker_loop(sh: &Shared) {
    IN_POOL.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let mut cur = wait_for_job(sh, seen);
        if sh.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let generation = cur >> 32;
        seen = generation;
        // Join unless the job moved on or was closed meanwhile.
        let joined = loop {
            if cur >> 32 != generation || cur & CLOSED != 0 {
                break false;
            }
            match sh.state.0.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break true,
                Err(v) => cur = v,
            }
        };
        if !joined {
            continue;
        }
        // SAFETY: joined, so the dispatcher keeps `job` unchanged (and the
        // task alive) until we leave; the Acquire CAS synchronises with the
        // SeqCst store that published it.
        if let Some(job) = unsafe { *sh.job.get() } {
            work(sh, &job);
        }
        sh.state.0.fetch_sub(1, Ordering::Release);
    }
}

/// Waits until the generation differs from `seen`; returns the state.
fn wait_for_job(sh: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        let s = sh.state.0.load(Ordering::Acquire);
        if s >> 32 != seen {
            return s;
        }
        polls += 1;
        if polls < SPIN_TIGHT {
            std::hint::spin_loop();
            continue;
        }
        if start.elapsed() < SPIN_TIME {
            thread::yield_now();
            continue;
        }
        break;
    }
    // Park. The SeqCst increment of `sleepers` followed by the SeqCst load of
    // `state` pairs with the dispatcher's SeqCst store of `state` followed by
    // its SeqCst load of `sleepers`: at least one side sees the other, and the
    // dispatcher notifies under `lock`, which we hold until `wait` releases
    // it, so a wake-up cannot be lost.
    let mut guard = sh.lock.lock().unwrap_or_else(PoisonError::into_inner);
    sh.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        let s = sh.state.0.load(Ordering::SeqCst);
        if s >> 32 != seen {
            sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            return s;
        }
        guard = sh.wake.wait(guard).unwrap_or_else(PoisonError::into_inner);
    }
}

/// A buffer's base pointer shared by the calls of one
/// [`ThreadPool::for_each_chunk_mut`] (each writes a disjoint chunk).
struct SendPtr<T>(*mut T);

// SAFETY: only used to hand disjoint chunks of a `&mut [T]` (T: Send) to
// the pool's threads for the duration of one call.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// Accessor, so closures capture the whole (Sync) wrapper.
    fn get(&self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_thread_counts() {
        assert_eq!(parse_threads(Some("3")), Some(3));
        assert_eq!(parse_threads(Some(" 2 ")), Some(2));
        assert_eq!(parse_threads(Some("0")), None);
        assert_eq!(parse_threads(Some("x")), None);
        assert_eq!(parse_threads(None), None);
        assert!(default_threads() >= 1);
    }

    #[test]
    fn split_covers_everything() {
        for n in 0..50 {
            for parts in 1..9 {
                let mut next = 0;
                for t in 0..parts {
                    let r = split_range(n, parts, t);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
