//! The mask workers (structured outputs): two threads that compute each
//! constrained sequence's next grammar mask beside the forward pass. A
//! sequence's matcher goes to them after its token is sampled and comes
//! back with the mask for the next one, so the mask is usually ready when
//! the logits are. The cheapest masks go first (by each sequence's last
//! mask time): a grammar whose masks are slow waits behind the others, not
//! they behind it; two threads, so one slow mask never holds every other.

use std::collections::BinaryHeap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv::RequestId;

/// Threads computing masks.
pub(crate) const MASK_THREADS: usize = 2;

/// A mask to compute.
struct Job {
    /// The sequence's last mask time: the queue serves the cheapest first.
    cost_ns: u64,
    /// Arrival order among equal costs.
    order: u64,
    req: RequestId,
    matcher: grammar::Matcher,
}

impl PartialEq for Job {
    fn eq(&self, other: &Self) -> bool {
        (self.cost_ns, self.order) == (other.cost_ns, other.order)
    }
}
impl Eq for Job {}
impl PartialOrd for Job {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
/// The max-heap's greatest is the cheapest, then the earliest.
impl Ord for Job {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .cost_ns
            .cmp(&self.cost_ns)
            .then(other.order.cmp(&self.order))
    }
}

/// A computed mask and the matcher it came from.
pub(crate) struct Done {
    pub req: RequestId,
    pub matcher: grammar::Matcher,
    pub mask: Result<grammar::Mask, grammar::GrammarError>,
    pub took: Duration,
}

struct Queue {
    jobs: Mutex<(BinaryHeap<Job>, bool)>,
    ready: Condvar,
}

/// The workers, their queue and their answers.
pub(crate) struct Masks {
    queue: Arc<Queue>,
    done: Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
    order: u64,
    /// Jobs sent whose answer has not been taken.
    pub in_flight: usize,
}

impl Masks {
    pub fn start() -> std::io::Result<Masks> {
        let queue = Arc::new(Queue {
            jobs: Mutex::new((BinaryHeap::new(), false)),
            ready: Condvar::new(),
        });
        let (tx, done) = mpsc::channel();
        let mut threads = Vec::with_capacity(MASK_THREADS);
        for i in 0..MASK_THREADS {
            let (q, tx): (Arc<Queue>, Sender<Done>) = (queue.clone(), tx.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("isoserve-masks-{i}"))
                    .spawn(move || work(&q, &tx))?,
            );
        }
        Ok(Masks {
            queue,
            done,
            threads,
            order: 0,
            in_flight: 0,
        })
    }

    /// Computes `matcher`'s next mask (`cost_ns`: its last mask's time).
    pub fn send(&mut self, req: RequestId, matcher: grammar::Matcher, cost_ns: u64) {
        self.order += 1;
        let mut jobs = self.queue.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.0.push(Job {
            cost_ns,
            order: self.order,
            req,
            matcher,
        });
        drop(jobs);
        self.in_flight += 1;
        self.queue.ready.notify_one();
    }

    /// An answer, waiting until `deadline` at most (`None`: do not wait).
    pub fn recv(&mut self, deadline: Option<Instant>) -> Option<Done> {
        if self.in_flight == 0 {
            return None;
        }
        let got = match deadline {
            None => self.done.try_recv().ok(),
            // A timeout (or no worker left) is no answer.
            Some(d) => self
                .done
                .recv_timeout(d.saturating_duration_since(Instant::now()))
                .ok(),
        };
        if got.is_some() {
            self.in_flight -= 1;
        }
        got
    }
}

impl Drop for Masks {
    fn drop(&mut self) {
        self.queue.jobs.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.queue.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn work(q: &Queue, tx: &Sender<Done>) {
    loop {
        let job = {
            let mut jobs = q.jobs.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if jobs.1 {
                    return;
                }
                if let Some(j) = jobs.0.pop() {
                    break j;
                }
                jobs = q.ready.wait(jobs).unwrap_or_else(|e| e.into_inner());
            }
        };
        let mut matcher = job.matcher;
        let started = Instant::now();
        let mask = matcher.mask();
        let done = Done {
            req: job.req,
            matcher,
            mask,
            took: started.elapsed(),
        };
        if tx.send(done).is_err() {
            return;
        }
    }
}
