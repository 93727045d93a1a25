//! Thread-pool tests. Every test body runs under a watchdog, so a deadlock
//! fails the test instead of hanging the suite.

use kernels::ThreadPool;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

fn with_timeout<F: FnOnce() + Send + 'static>(secs: u64, f: F) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let r = catch_unwind(AssertUnwindSafe(f));
        let _ = tx.send(());
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap(),
        Err(_) => panic!("test did not finish within {secs} s (deadlock?)"),
    }
}

#[test]
fn parallel_for_covers_each_item_once() {
    with_timeout(60, || {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads);
            for n in [0usize, 1, 2, 3, 7, 64, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                let calls = AtomicUsize::new(0);
                pool.parallel_for(n, |r| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    for i in r {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                // About 4 chunks per thread at most.
                assert!(calls.load(Ordering::Relaxed) <= (4 * threads).min(n.max(1)));
            }
        }
    });
}

#[test]
fn parallel_for_chunked_uses_the_given_chunks() {
    with_timeout(60, || {
        let pool = ThreadPool::new(3);
        for (n, chunk) in [(10usize, 3usize), (7, 7), (7, 100), (100, 1), (5, 0)] {
            let seen = std::sync::Mutex::new(vec![]);
            pool.parallel_for_chunked(n, chunk, |r| seen.lock().unwrap().push(r));
            let mut v = seen.into_inner().unwrap();
            v.sort_by_key(|r| r.start);
            let c = chunk.max(1);
            let want: Vec<_> = (0..n.div_ceil(c))
                .map(|k| k * c..((k + 1) * c).min(n))
                .collect();
            assert_eq!(v, want);
        }
    });
}

#[test]
fn many_dispatches() {
    with_timeout(120, || {
        let pool = ThreadPool::new(3);
        let total = AtomicUsize::new(0);
        let iters = 20_000;
        for k in 0..iters {
            pool.parallel_for(3 + k % 5, |r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
        }
        let want: usize = (0..iters).map(|k| 3 + k % 5).sum();
        assert_eq!(total.load(Ordering::Relaxed), want);
    });
}

#[test]
fn dispatch_after_workers_parked() {
    with_timeout(60, || {
        let pool = ThreadPool::new(2);
        for _ in 0..5 {
            // Long enough for the workers to stop spinning and park.
            std::thread::sleep(Duration::from_millis(5));
            let seen = AtomicUsize::new(0);
            pool.broadcast(|t| {
                seen.fetch_or(1 << t, Ordering::Relaxed);
            });
            assert_eq!(seen.load(Ordering::Relaxed), 0b11);
        }
    });
}

#[test]
fn broadcast_gives_each_index_once() {
    with_timeout(60, || {
        let pool = ThreadPool::new(4);
        let seen: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        pool.broadcast(|t| {
            seen[t].fetch_add(1, Ordering::Relaxed);
        });
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
    });
}

#[test]
fn nested_calls_run_inline() {
    with_timeout(60, || {
        let pool = ThreadPool::new(3);
        let total = AtomicUsize::new(0);
        pool.parallel_for(6, |outer| {
            for _ in outer {
                pool.parallel_for(10, |inner| {
                    total.fetch_add(inner.len(), Ordering::Relaxed);
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 60);
    });
}

/// A panicking task does not hang the pool: the panic is re-raised on the
/// caller after all tasks end, and the pool keeps working.
#[test]
fn panics_propagate_and_pool_survives() {
    with_timeout(60, || {
        let pool = ThreadPool::new(3);
        for bad in 0..3 {
            let done = AtomicUsize::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                pool.broadcast(|t| {
                    if t == bad {
                        panic!("task {t} fails");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                });
            }));
            let msg = r.expect_err("the panic must reach the caller");
            let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert_eq!(msg, format!("task {bad} fails"));
            assert_eq!(done.load(Ordering::Relaxed), 2, "other tasks still ran");
            let total = AtomicUsize::new(0);
            pool.parallel_for(100, |r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
            assert_eq!(total.load(Ordering::Relaxed), 100);
        }
        // Every task panics.
        assert!(catch_unwind(AssertUnwindSafe(|| pool.broadcast(|_| panic!("all")))).is_err());
        pool.broadcast(|_| {});
    });
}

#[test]
fn concurrent_callers_are_serialised() {
    with_timeout(120, || {
        let pool = Arc::new(ThreadPool::new(2));
        let total = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (Arc::clone(&pool), Arc::clone(&total));
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        pool.parallel_for(7, |r| {
                            total.fetch_add(r.len(), Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        assert_eq!(total.load(Ordering::Relaxed), 4 * 2000 * 7);
    });
}

#[test]
fn create_and_drop_many_pools() {
    with_timeout(60, || {
        for k in 0..50 {
            let pool = ThreadPool::new(1 + k % 4);
            if k % 2 == 0 {
                pool.broadcast(|_| {});
            }
            if k % 10 == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(pool);
        }
        let pool = ThreadPool::new(0);
        assert_eq!(pool.n_threads(), 1);
        assert!(ThreadPool::from_env().n_threads() >= 1);
    });
}

#[test]
fn borrows_caller_data_mutably_through_disjoint_chunks() {
    with_timeout(60, || {
        let pool = ThreadPool::new(3);
        let data: Vec<AtomicUsize> = (0..1000).map(AtomicUsize::new).collect();
        pool.parallel_for(data.len(), |r| {
            for i in r {
                data[i].fetch_add(i, Ordering::Relaxed);
            }
        });
        assert!(data
            .iter()
            .enumerate()
            .all(|(i, v)| v.load(Ordering::Relaxed) == 2 * i));
    });
}

#[test]
fn for_each_chunk_mut_visits_every_chunk_once() {
    with_timeout(60, || {
        let pool = ThreadPool::new(3);
        for (len, chunk) in [(1000usize, 7usize), (1, 5), (0, 3), (64, 64), (65, 64)] {
            let mut data: Vec<usize> = vec![0; len];
            pool.for_each_chunk_mut(&mut data, chunk, |k, c| {
                assert!(c.len() <= chunk && !c.is_empty());
                for (j, v) in c.iter_mut().enumerate() {
                    *v += k * chunk + j + 1;
                }
            });
            assert!(
                data.iter().enumerate().all(|(i, &v)| v == i + 1),
                "{len}/{chunk}"
            );
        }
    });
}
