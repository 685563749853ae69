//! GPU timing marks and the phase split of a step.

use candle_core::Device;

use super::ProfileError;

/// A point in time a duration can be measured from.
pub trait Stamp {
    /// Milliseconds from `earlier` to `self`, or `None` while either has not happened yet
    /// (for a GPU event: its work is still queued). Never waits.
    ///
    /// # Errors
    ///
    /// The device could not tell.
    fn ms_since(&self, earlier: &Self) -> Result<Option<f64>, ProfileError>;
}

/// The stamps of one training step: its start, each micro-batch's forward (start, end), the
/// end of the backward (gradients reduced and clipped) and the end of the optimizer step.
///
/// [`Phases::ms`] splits the step as the host-time split does: forward = the forwards' sum,
/// backward = start to backward end minus the forwards, optimizer = optimizer start (or, when
/// none was recorded, backward end) to optimizer end.
#[derive(Debug)]
pub struct Phases<S> {
    start: S,
    forwards: Vec<(S, Option<S>)>,
    backward_end: Option<S>,
    optimizer_start: Option<S>,
    optimizer_end: Option<S>,
}

impl<S: Stamp> Phases<S> {
    /// A step starting at `start`.
    pub fn new(start: S) -> Self {
        Phases {
            start,
            forwards: Vec::new(),
            backward_end: None,
            optimizer_start: None,
            optimizer_end: None,
        }
    }

    /// A micro-batch's forward starts.
    pub fn forward_start(&mut self, s: S) {
        self.forwards.push((s, None));
    }

    /// The last started forward ends (ignored when none is open).
    pub fn forward_end(&mut self, s: S) {
        if let Some(last) = self.forwards.last_mut() {
            if last.1.is_none() {
                last.1 = Some(s);
            }
        }
    }

    /// The backward ends (gradients reduced and clipped).
    pub fn backward_end(&mut self, s: S) {
        self.backward_end = Some(s);
    }

    /// The optimizer step starts. Optional: without it the optimizer phase starts at the
    /// backward's end. With it, what the device spends between the two (idle while the host
    /// reads the loss back and queues the optimizer) is in no phase.
    pub fn optimizer_start(&mut self, s: S) {
        self.optimizer_start = Some(s);
    }

    /// The optimizer step ends.
    pub fn optimizer_end(&mut self, s: S) {
        self.optimizer_end = Some(s);
    }

    /// The step's last stamp: the optimizer's end, once recorded.
    pub fn end(&self) -> Option<&S> {
        self.optimizer_end.as_ref()
    }

    /// `[forward, backward, optimizer]` milliseconds, or `None` while a stamp is missing or
    /// has not happened yet. Never waits.
    ///
    /// # Errors
    ///
    /// A stamp could not be read.
    pub fn ms(&self) -> Result<Option<[f64; 3]>, ProfileError> {
        let (Some(bwd), Some(opt)) = (&self.backward_end, &self.optimizer_end) else {
            return Ok(None);
        };
        let mut fwd = 0.0;
        for (a, b) in &self.forwards {
            let Some(b) = b else { return Ok(None) };
            match b.ms_since(a)? {
                Some(ms) => fwd += ms,
                None => return Ok(None),
            }
        }
        let opt_start = self.optimizer_start.as_ref().unwrap_or(bwd);
        let (Some(to_bwd), Some(o)) = (bwd.ms_since(&self.start)?, opt.ms_since(opt_start)?) else {
            return Ok(None);
        };
        Ok(Some([fwd, to_bwd - fwd, o]))
    }
}

/// A CUDA timing event recorded on a device's stream (as the recording thread sees it:
/// candle's per-thread default stream), or nothing on other devices.
#[derive(Debug)]
pub struct Mark {
    #[cfg(feature = "cuda")]
    event: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl Mark {
    /// Records a mark after the work queued so far on `device`'s stream: `None` on a device
    /// without timing events (the CPU, or any device without the `cuda` feature).
    ///
    /// # Errors
    ///
    /// The driver refused to create or record the event.
    pub fn record(device: &Device) -> Result<Option<Mark>, ProfileError> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            // Timing on (no DISABLE_TIMING), no blocking sync: only queried and measured.
            let event = d
                .cuda_stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| ProfileError::Cuda {
                    what: "recording a timing event",
                    message: e.to_string(),
                })?;
            return Ok(Some(Mark { event }));
        }
        let _ = device;
        Ok(None)
    }

    /// Blocks until the work before this mark completed.
    ///
    /// # Errors
    ///
    /// The driver reported an error.
    pub fn wait(&self) -> Result<(), ProfileError> {
        #[cfg(feature = "cuda")]
        return self.event.synchronize().map_err(|e| ProfileError::Cuda {
            what: "waiting for a timing event",
            message: e.to_string(),
        });
        #[cfg(not(feature = "cuda"))]
        match self.never {}
    }
}

impl Stamp for Mark {
    fn ms_since(&self, earlier: &Mark) -> Result<Option<f64>, ProfileError> {
        #[cfg(feature = "cuda")]
        {
            let err =
                |e: candle_core::cuda_backend::cudarc::driver::DriverError| ProfileError::Cuda {
                    what: "reading a timing event",
                    message: e.to_string(),
                };
            // Both complete: elapsed_ms's synchronizations return at once.
            if !(earlier.event.try_is_complete().map_err(err)?
                && self.event.try_is_complete().map_err(err)?)
            {
                return Ok(None);
            }
            let ms = earlier.event.elapsed_ms(&self.event).map_err(err)?;
            Ok(Some(f64::from(ms)))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = earlier;
            match self.never {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A stamp at a fixed time that has happened once `now` reaches it.
    struct At<'a>(f64, &'a Cell<f64>);

    impl Stamp for At<'_> {
        fn ms_since(&self, earlier: &Self) -> Result<Option<f64>, ProfileError> {
            let now = self.1.get();
            Ok((self.0 <= now && earlier.0 <= now).then_some(self.0 - earlier.0))
        }
    }

    #[test]
    fn phases_split_as_the_host_split_does() {
        let now = Cell::new(100.0);
        let at = |t| At(t, &now);
        // Two micro-batches: forwards 1..3 and 6..10, backward ends at 15, optimizer at 18.
        let mut p = Phases::new(at(0.0));
        p.forward_start(at(1.0));
        p.forward_end(at(3.0));
        p.forward_start(at(6.0));
        p.forward_end(at(10.0));
        p.backward_end(at(15.0));
        assert_eq!(p.ms().unwrap(), None, "no optimizer end yet");
        p.optimizer_end(at(18.0));
        assert_eq!(p.ms().unwrap(), Some([6.0, 9.0, 3.0]));
        // Not yet happened: no value, and no waiting.
        now.set(17.0);
        assert_eq!(p.ms().unwrap(), None);
        now.set(9.0);
        assert_eq!(p.ms().unwrap(), None, "a forward still running");
    }

    /// With an optimizer start, the gap before it (the device idle during the loss read) is
    /// in no phase.
    #[test]
    fn the_optimizer_phase_starts_at_its_own_mark_when_there_is_one() {
        let now = Cell::new(100.0);
        let at = |t| At(t, &now);
        let mut p = Phases::new(at(0.0));
        p.forward_start(at(0.0));
        p.forward_end(at(4.0));
        p.backward_end(at(10.0));
        p.optimizer_start(at(13.0));
        p.optimizer_end(at(15.0));
        assert_eq!(p.ms().unwrap(), Some([4.0, 6.0, 2.0]));
        now.set(14.0);
        assert_eq!(p.ms().unwrap(), None, "the optimizer still running");
    }

    #[test]
    fn an_unclosed_forward_gives_nothing() {
        let now = Cell::new(100.0);
        let at = |t| At(t, &now);
        let mut p = Phases::new(at(0.0));
        p.forward_start(at(1.0));
        p.backward_end(at(5.0));
        p.optimizer_end(at(6.0));
        assert_eq!(p.ms().unwrap(), None);
        p.forward_end(at(2.0));
        p.forward_end(at(4.0)); // no open forward: ignored
        assert_eq!(p.ms().unwrap(), Some([1.0, 4.0, 1.0]));
    }

    #[test]
    fn the_cpu_has_no_marks() {
        assert!(Mark::record(&Device::Cpu).unwrap().is_none());
    }
}
