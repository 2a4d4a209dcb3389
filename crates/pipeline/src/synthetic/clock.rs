//! Per-rank time of the synthetic stages: a virtual clock or real sleeps.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a [`SyntheticClock`] spends an action's cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SyntheticMode {
    /// A logical clock in cost units: deterministic, equal to the simulator's timeline.
    Virtual,
    /// Real sleeps of `cost × unit`, timed by the executor's trace.
    Sleep {
        /// The wall time of one cost unit.
        unit: Duration,
    },
}

/// One rank's clock, shared by its [`SyntheticStage`](super::SyntheticStage)s and its
/// [`SyntheticComm`](super::SyntheticComm).
#[derive(Debug)]
pub struct SyntheticClock {
    mode: SyntheticMode,
    state: Mutex<ClockState>,
}

#[derive(Debug, Default)]
pub(super) struct ClockState {
    /// The logical time (virtual mode).
    now: f64,
    /// `(start, end)` of every charge, in order: one per action (virtual mode).
    log: Vec<(f64, f64)>,
    /// Time spent on message costs, in cost units (both modes).
    comm: f64,
    /// When the last action is due to end (sleep mode).
    deadline: Option<Instant>,
}

impl ClockState {
    /// An action from `start` to `start + cost`; returns its end.
    fn charge(&mut self, start: f64, cost: f64) -> f64 {
        let end = start + cost;
        self.now = end;
        self.log.push((start, end));
        end
    }
}

impl SyntheticClock {
    /// A clock at time 0.
    pub fn new(mode: SyntheticMode) -> Arc<SyntheticClock> {
        Arc::new(SyntheticClock {
            mode,
            state: Mutex::new(ClockState::default()),
        })
    }

    /// The mode.
    pub fn mode(&self) -> SyntheticMode {
        self.mode
    }

    /// The logical time (always 0 in sleep mode).
    pub fn now(&self) -> f64 {
        self.lock().now
    }

    /// The `(start, end)` of every action charged so far, in order (virtual mode; empty
    /// in sleep mode).
    pub fn log(&self) -> Vec<(f64, f64)> {
        self.lock().log.clone()
    }

    /// The time spent on message costs so far, in cost units (in sleep mode: measured).
    pub fn comm_time(&self) -> f64 {
        self.lock().comm
    }

    fn lock(&self) -> MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spends `cost` on a compute action; returns the time after it.
    pub(super) fn compute(&self, cost: f64) -> f64 {
        match self.mode {
            SyntheticMode::Virtual => {
                let mut st = self.lock();
                let start = st.now;
                st.charge(start, cost)
            }
            SyntheticMode::Sleep { unit } => {
                self.sleep(unit, cost, None);
                0.0
            }
        }
    }

    /// Spends `cost` on a send; returns the stamp the message carries (its end).
    pub(super) fn send(&self, cost: f64) -> f64 {
        match self.mode {
            SyntheticMode::Virtual => {
                let mut st = self.lock();
                let start = st.now;
                st.comm += cost;
                st.charge(start, cost)
            }
            SyntheticMode::Sleep { unit } => {
                let spent = self.sleep(unit, cost, None);
                self.lock().comm += spent;
                0.0
            }
        }
    }

    /// Spends `cost` on a receive of a message stamped `sent`.
    pub(super) fn recv(&self, cost: f64, sent: f64) {
        match self.mode {
            SyntheticMode::Virtual => {
                let mut st = self.lock();
                let start = st.now.max(sent);
                st.comm += cost;
                st.charge(start, cost);
            }
            SyntheticMode::Sleep { unit } => {
                let spent = self.sleep(unit, cost, Some(Instant::now()));
                self.lock().comm += spent;
            }
        }
    }

    /// Sleeps until the action's deadline: `cost × unit` after the previous action's
    /// deadline, or after `arrived` (a message's arrival) when that is later. Sleeping
    /// to a deadline rather than for a duration keeps the timer's overshoot (tens of
    /// microseconds per sleep) from adding up over a rank's thousands of actions, as a
    /// device running at a fixed speed would. Returns the time spent, in cost units,
    /// from the later of the call and `arrived` on.
    fn sleep(&self, unit: Duration, cost: f64, arrived: Option<Instant>) -> f64 {
        let now = Instant::now();
        let from = arrived.map_or(now, |a| a.max(now));
        let start = {
            let st = self.lock();
            match (st.deadline, arrived) {
                (Some(d), Some(a)) => d.max(a),
                (Some(d), None) => d,
                (None, _) => from,
            }
        };
        let end = start + unit.mul_f64(cost);
        let now = Instant::now();
        if end > now {
            std::thread::sleep(end - now);
        }
        self.lock().deadline = Some(end);
        from.elapsed().as_secs_f64() / unit.as_secs_f64()
    }
}
