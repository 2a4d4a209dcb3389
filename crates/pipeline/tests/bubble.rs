//! The measured pipeline bubble against its analytic value: stages whose forward and
//! backward sleep a known time make the executor's timings (and so the bubble the
//! training report shows, computed by [`step_bubbles`]) predictable. Sleeps, not
//! computation, so that a loaded CPU hardly moves the figures.

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

#[test]
fn a_sleeping_gpipe_measures_the_analytic_bubble() {
    let (p, m) = (2usize, 4usize);
    let program = generate(ScheduleKind::GPipe, p, m).unwrap();
    // GPipe with F = B: every rank idles (p − 1)/(m + p − 1) of the step.
    let analytic = (p - 1) as f64 / (m + p - 1) as f64;
    let predicted = simulate(
        &program,
        &Costs {
            f: 1.0,
            b: 1.0,
            ..Costs::default()
        },
    )
    .unwrap();
    let bubbles = step_bubbles(&timings(&program));
    assert_eq!(bubbles.len(), p);
    for (r, bubble) in bubbles.iter().enumerate() {
        assert!(
            (predicted.ranks[r].bubble_fraction - analytic).abs() < 1e-12,
            "the simulator's bubble of rank {r}"
        );
        // The sleeps overshoot by well under a millisecond each; a 200 ms step leaves
        // a 0.03 margin for scheduling noise.
        assert!(
            (bubble - analytic).abs() < 0.03,
            "rank {r}: measured bubble {bubble:.3}, analytic {analytic:.3}"
        );
    }
}

#[test]
fn a_sleeping_1f1b_measures_the_analytic_bubble_per_rank() {
    // 1F1B, p = 3, m = 3, F = B: the same (p − 1)/(m + p − 1) = 2/5 on every rank.
    let program = generate(ScheduleKind::OneFOneB, 3, 3).unwrap();
    let bubbles = step_bubbles(&timings(&program));
    for (r, bubble) in bubbles.iter().enumerate() {
        assert!(
            (bubble - 0.4).abs() < 0.03,
            "rank {r}: measured bubble {bubble:.3}, analytic 0.400"
        );
    }
}
