//! Host waits on GPU work with a limit. The CUDA paths wait on the host only off the normal path
//! (more retired ops than `MAX_RETIRED`, a communicator dropped with ops in flight, an event
//! that could not be recorded); a GPU that never finishes (a hung kernel, a stream waiting on an
//! event no rank records) must not hang those threads forever. Past the limit the caller gives
//! up and keeps whatever the GPU may still read referenced for good (a leak, never a free of
//! memory in use).

use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Polls `done` until it answers true or `limit` passed (backing off from 20 us to 5 ms between
/// polls); whether it answered true.
pub(crate) fn poll_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    // A limit past what an Instant can hold (Duration::MAX as a timeout) is no limit.
    let deadline = Instant::now().checked_add(limit);
    let mut pause = Duration::from_micros(20);
    loop {
        if done() {
            return true;
        }
        let now = Instant::now();
        let left = match deadline {
            Some(d) if now >= d => return false,
            Some(d) => d - now,
            None => pause,
        };
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// Runs `f` (a blocking call that has no limit of its own, such as a context synchronisation)
/// on a helper thread and waits up to `limit` for it; whether it finished. Past the limit the
/// helper is left to finish (or block) on its own; a helper that cannot be started counts as
/// not finished.
pub(crate) fn run_within(limit: Duration, f: impl FnOnce() + Send + 'static) -> bool {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("cdt-local-drain".into())
        .spawn(move || {
            f();
            // The waiter may have given up and dropped the receiver.
            let _ = tx.send(());
        });
    match spawned {
        Ok(_) => rx.recv_timeout(limit).is_ok(),
        Err(e) => {
            tracing::error!(error = %e, "no thread for a bounded wait; treated as not finished");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn a_poll_that_never_completes_gives_up_at_the_limit() {
        let t0 = Instant::now();
        assert!(!poll_until(Duration::from_millis(50), || false));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(50), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn an_unbounded_limit_does_not_overflow() {
        let polls = Cell::new(0);
        assert!(poll_until(Duration::MAX, || {
            polls.set(polls.get() + 1);
            polls.get() == 2
        }));
        assert!(run_within(Duration::MAX, || {}));
    }

    #[test]
    fn a_poll_that_completes_returns_at_once() {
        let polls = Cell::new(0);
        let done = poll_until(Duration::from_secs(60), || {
            polls.set(polls.get() + 1);
            polls.get() == 3
        });
        assert!(done);
        assert_eq!(polls.get(), 3);
        // A limit of zero still polls once.
        assert!(poll_until(Duration::ZERO, || true));
    }

    #[test]
    fn a_call_that_blocks_is_abandoned_at_the_limit() {
        let (release, blocked) = mpsc::channel::<()>();
        let t0 = Instant::now();
        let finished = run_within(Duration::from_millis(50), move || {
            let _ = blocked.recv_timeout(Duration::from_secs(60));
        });
        let took = t0.elapsed();
        assert!(!finished);
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Let the helper go.
        drop(release);
    }

    #[test]
    fn a_call_that_finishes_is_waited_for() {
        let (tx, rx) = mpsc::channel();
        assert!(run_within(Duration::from_secs(60), move || {
            std::thread::sleep(Duration::from_millis(10));
            tx.send(7).unwrap();
        }));
        assert_eq!(rx.try_recv(), Ok(7));
    }
}
