//! A small persistent worker pool.
//!
//! The optimizer is called once per layer per step; spawning threads each time would cost tens of
//! microseconds per call and lose the workers' warm caches. The pool keeps `threads - 1` workers
//! parked on a condition variable; [`ThreadPool::broadcast`] runs one closure on every thread (the
//! caller included) and returns when all are done, so the closure may borrow from the caller's stack
//! exactly like `std::thread::scope`. Work inside the closure is shared by pulling tasks from a
//! common queue, which balances load when other processes steal a core.

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::thread::JoinHandle;

use crate::error::{OptimError, Result};

type Job = dyn Fn() + Sync;

/// A lifetime-erased pointer to the closure of the broadcast in flight.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);

// SAFETY: the pointee is `Sync`, so calling it from another thread is allowed; `broadcast` keeps it
// alive until every worker is done with it (see there).
unsafe impl Send for JobPtr {}

#[derive(Default)]
struct State {
    generation: u64,
    job: Option<JobPtr>,
    running: usize,
    worker_panicked: bool,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Jobs run outside the lock and panics are caught, so a poisoned lock holds consistent data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A fixed set of worker threads that run a closure on all threads at once.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One broadcast at a time; a concurrent caller runs its closure alone on its own thread.
    busy: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.threads()).finish()
    }
}

impl ThreadPool {
    /// A pool in which `threads` threads (the caller plus `threads - 1` workers) share the work.
    /// `threads == 0` is treated as 1.
    pub fn new(threads: usize) -> Result<Self> {
        let mut pool = Self::calling_thread();
        for i in 1..threads.max(1) {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("lt-optim-{i}"))
                .spawn(move || worker(&shared))
                .map_err(OptimError::Spawn)?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// As [`ThreadPool::new`], or the calling thread alone when no worker thread can be started.
    pub fn new_or_calling_thread(threads: usize) -> Self {
        Self::new(threads).unwrap_or_else(|_| Self::calling_thread())
    }

    /// A pool of the calling thread only (starts no thread).
    fn calling_thread() -> Self {
        let shared =
            Arc::new(Shared { state: Mutex::new(State::default()), work: Condvar::new(), done: Condvar::new() });
        ThreadPool { shared, workers: Vec::new(), busy: Mutex::new(()) }
    }

    /// Number of threads that run a broadcast (the caller included).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f` once on each of the pool's threads, the calling thread included, and returns when
    /// all calls have returned. If another thread is broadcasting on this pool at the same time,
    /// `f` runs only on the calling thread (the work still gets done, just not in parallel).
    ///
    /// # Panics
    /// Re-raises a panic of `f` (on any thread) after all threads have finished.
    pub fn broadcast<F: Fn() + Sync>(&self, f: F) {
        if self.workers.is_empty() {
            return f();
        }
        let _busy = match self.busy.try_lock() {
            Ok(g) => g,
            // Poisoned only by a panic that `broadcast` already re-raised; the pool itself is fine.
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return f(),
        };
        let job: *const (dyn Fn() + Sync + '_) = &f;
        // SAFETY: only the lifetime bound is erased (same fat-pointer layout). Workers dereference
        // the pointer only between `generation` changing and their `running -= 1`, and this function
        // does not return (or unwind) before `running` is back to 0, so `f` outlives every use.
        let ptr = JobPtr(unsafe { std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const Job>(job) });
        {
            let mut st = self.shared.lock();
            st.job = Some(ptr);
            st.running = self.workers.len();
            st.generation = st.generation.wrapping_add(1);
        }
        self.shared.work.notify_all();
        let mine = catch_unwind(AssertUnwindSafe(&f));
        let worker_panicked = {
            let mut st = self.shared.lock();
            while st.running > 0 {
                st = self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.job = None;
            std::mem::take(&mut st.worker_panicked)
        };
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if worker_panicked {
            panic!("an lt-optim worker thread panicked");
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        let job = {
            let mut st = shared.lock();
            while st.generation == seen && !st.shutdown {
                st = shared.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.shutdown {
                return;
            }
            seen = st.generation;
            st.job
        };
        let ok = match job {
            // SAFETY: `broadcast` keeps the closure alive until this worker decrements `running`.
            Some(JobPtr(p)) => catch_unwind(AssertUnwindSafe(|| unsafe { (*p)() })).is_ok(),
            None => true,
        };
        let mut st = shared.lock();
        st.worker_panicked |= !ok;
        st.running -= 1;
        if st.running == 0 {
            shared.done.notify_all();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            // A worker only ends by returning from its loop; a join error cannot carry anything useful.
            let _ = w.join();
        }
    }
}

/// Runs `work` over `tasks` on all threads of `pool`, each thread pulling the next task from a shared
/// iterator. Tasks must be independent (they usually hold disjoint `&mut` chunks).
pub(crate) fn run_tasks<T: Send, I: Iterator<Item = T> + Send>(pool: &ThreadPool, tasks: I, work: impl Fn(T) + Sync) {
    let queue = Mutex::new(tasks);
    pool.broadcast(|| {
        loop {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            match next {
                Some(t) => work(t),
                None => break,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn broadcast_runs_on_every_thread_and_borrows_the_stack() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for _ in 0..50 {
                let calls = AtomicUsize::new(0);
                pool.broadcast(|| {
                    calls.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(calls.load(Ordering::Relaxed), threads);
            }
        }
    }

    #[test]
    fn run_tasks_visits_each_task_once() {
        let pool = ThreadPool::new(3).unwrap();
        let mut data = vec![0u32; 10_000];
        run_tasks(&pool, data.chunks_mut(7).enumerate(), |(i, c)| c.iter_mut().for_each(|x| *x += i as u32 + 1));
        for (i, c) in data.chunks(7).enumerate() {
            assert!(c.iter().all(|&x| x == i as u32 + 1));
        }
    }

    #[test]
    fn worker_panic_is_reraised_and_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        let who = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.broadcast(|| {
                if who.fetch_add(1, Ordering::SeqCst) == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let calls = AtomicUsize::new(0);
        pool.broadcast(|| {
            calls.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn concurrent_broadcasts_still_complete() {
        let pool = ThreadPool::new(2).unwrap();
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        pool.broadcast(|| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        // Each broadcast ran on 1 or 2 threads.
        let t = total.load(Ordering::Relaxed);
        assert!((400..=800).contains(&t), "{t}");
    }
}
