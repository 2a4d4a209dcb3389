//! The pipeline bubble the training report shows ([`step_bubbles`]): against the
//! simulator's and the analytic value on timings that follow the simulation exactly, and
//! what the executor measures with stages that sleep a known time (bounds only: real
//! timings depend on the machine's load, so no test compares them with a tolerance).

use std::thread::sleep;
use std::time::Duration;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};
use switchyard_comm::local;
use switchyard_pipeline::{step_bubbles, Executor, Microbatches, Stage};
use switchyard_schedule::{generate, simulate, Costs, Program, ScheduleKind};

const F: Duration = Duration::from_millis(20);
const B: Duration = Duration::from_millis(20);

/// The identity, whose backward sleeps `B`.
struct SlowBackward;

impl CustomOp1 for SlowBackward {
    fn name(&self) -> &'static str {
        "slow-backward"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        assert!(layout.is_contiguous() && layout.start_offset() == 0);
        Ok((storage.clone(), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        sleep(B);
        Ok(Some(grad_res.clone()))
    }
}

/// `x ↦ x · w` whose forward sleeps `F` and whose backward sleeps `B`.
struct SleepyStage {
    w: Vec<Var>,
}

impl Stage for SleepyStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        sleep(F);
        // After the product with `w`, so that the backward passes through the op on
        // every stage (the first stage's input is not tracked).
        x.broadcast_mul(self.w[0].as_tensor())?
            .apply_op1(SlowBackward)
    }

    fn params(&self) -> &[Var] {
        &self.w
    }
}

/// Each rank's `(compute, wall)` for one step of `program`.
fn timings(program: &Program) -> Vec<(Duration, Duration)> {
    let m = program.num_microbatches as usize;
    local::launch(program.num_ranks(), |comm| {
        let mine = program.stages_of_rank(comm.rank() as u32);
        let stages: Vec<SleepyStage> = mine
            .iter()
            .map(|_| {
                Ok(SleepyStage {
                    w: vec![Var::ones(1, DType::F32, &Device::Cpu)?],
                })
            })
            .collect::<Result<_>>()?;
        let stages: Vec<(u32, &dyn Stage)> = mine
            .iter()
            .copied()
            .zip(stages.iter().map(|s| s as &dyn Stage))
            .collect();
        let exec = Executor::new(program, &*comm, stages)?;
        let inputs = (0..m)
            .map(|_| Tensor::ones(4, DType::F32, &Device::Cpu))
            .collect::<Result<Vec<_>>>()?;
        let out = exec.run(&Microbatches {
            inputs,
            loss: &|y: &Tensor, _| y.sum_all(),
            loss_scale: 1.0,
        })?;
        Ok::<_, candle_core::Error>((out.stats.compute, out.stats.wall))
    })
    .unwrap()
}

/// Each rank's `(compute, wall)` as the executor would measure it if every action took
/// exactly its simulated time: compute is the rank's busy time, wall its own window
/// (from the step's start to the end of its last action).
fn simulated_stats(timeline: &switchyard_schedule::Timeline) -> Vec<(Duration, Duration)> {
    timeline
        .ranks
        .iter()
        .map(|r| {
            let end = r.actions.iter().map(|a| a.end).fold(0.0, f64::max);
            (
                Duration::from_secs_f64(r.busy),
                Duration::from_secs_f64(end),
            )
        })
        .collect()
}

/// The report's bubble ([`step_bubbles`]) of timings that follow the simulator is the
/// simulator's bubble on every rank, and the analytic `(p − 1)/(m + p − 1)` for GPipe
/// and 1F1B with `F = B`. (The old measure, each rank's own window, gave 1/9 for the
/// last rank of GPipe p = 2, m = 4 instead of 1/5.)
#[test]
fn the_measured_bubble_is_the_simulators_on_every_rank() {
    let costs = Costs {
        f: 1.0,
        b: 1.0,
        ..Costs::default()
    };
    for (kind, p, m) in [
        (ScheduleKind::GPipe, 2usize, 4usize),
        (ScheduleKind::OneFOneB, 3, 3),
        (ScheduleKind::OneFOneB, 4, 8),
    ] {
        let program = generate(kind, p, m).unwrap();
        let predicted = simulate(&program, &costs).unwrap();
        let analytic = (p - 1) as f64 / (m + p - 1) as f64;
        let bubbles = step_bubbles(&simulated_stats(&predicted));
        assert_eq!(bubbles.len(), p);
        for (r, bubble) in bubbles.iter().enumerate() {
            let sim = predicted.ranks[r].bubble_fraction;
            assert!((sim - analytic).abs() < 1e-12, "{kind:?} rank {r}: {sim}");
            assert!(
                (bubble - sim).abs() < 1e-9,
                "{kind:?} p={p} m={m} rank {r}: measured {bubble}, simulated {sim}"
            );
        }
    }
    // A rank's own window leaves out the wait for the slowest rank.
    let program = generate(ScheduleKind::GPipe, 2, 4).unwrap();
    let stats = simulated_stats(&simulate(&program, &costs).unwrap());
    let own_window = 1.0 - stats[1].0.as_secs_f64() / stats[1].1.as_secs_f64();
    assert!((own_window - 1.0 / 9.0).abs() < 1e-9, "{own_window}");
}

/// What the executor measures with stages that sleep: sleeps never end early, so each
/// rank's compute time is at least its `m` forwards and `m` backwards, and no rank
/// computes longer than its step lasts. Bounds only, no timing tolerance: the figures
/// themselves depend on the machine's load.
#[test]
fn the_executor_measures_compute_within_the_step() {
    let (p, m) = (3usize, 3usize);
    let program = generate(ScheduleKind::OneFOneB, p, m).unwrap();
    let stats = timings(&program);
    assert_eq!(stats.len(), p);
    for (r, (compute, wall)) in stats.iter().enumerate() {
        assert!(*compute >= (F + B) * m as u32, "rank {r}: {compute:?}");
        assert!(compute <= wall, "rank {r}: {compute:?} > {wall:?}");
    }
    for b in step_bubbles(&stats) {
        assert!((0.0..1.0).contains(&b), "{b}");
    }
}
