//! # switchyard-pipeline: run one rank's schedule with candle autograd
//!
//! A pipeline-parallel step is a *program* from `switchyard-schedule`: for each rank, the
//! ordered list of actions it performs (`1F3`: forward of stage 1 on microbatch 3; `2RF3`:
//! stage 2 receives that activation; `1B3`, `1I3`, `1W3`: backward, or its input- and
//! weight-gradient halves). This crate holds the [`Stage`] trait and the [`Executor`]
//! that performs one rank's actions, in the order given. The executor never chooses what
//! comes next: any valid program runs, including interleaved programs (several stages
//! per rank), zero-bubble programs (split backward) and custom schedules loaded from CSV.
//!
//! ## How an action runs
//!
//! * `F`: the input is the microbatch itself (first stage), a received activation, or
//!   the output of the previous stage on the same rank. It is wrapped in a `Var` so its
//!   gradient can be read later, the stage runs forward with candle autograd, and the
//!   output is stashed with the graph. On the last stage the loss function turns the
//!   output into a scalar loss.
//! * `B` (or `I`): the upstream gradient `g` is injected by back-propagating the scalar
//!   `Σ out ⊙ g` (candle seeds backward with ones); the last stage back-propagates
//!   `loss · loss_scale`. The input gradient is sent on (or handed to the previous stage
//!   on this rank), parameter gradients are accumulated over microbatches, and the stash
//!   entry is dropped, so its activations are freed at once. A split backward keeps the
//!   parameter gradients of `I` until its `W`: before a microbatch's `F` and its
//!   backward the executor tells the stage whether that backward is split
//!   ([`Stage::split_backward`]); a stage that splits (the GPT's fused ops) computes
//!   only input gradients (and the weight gradients it does not defer) in `I`, and
//!   `W` calls [`Stage::backward_weights`], whose gradients are added to those `I`
//!   kept. A stage that does not split runs its whole backward in `I` and nothing in
//!   `W` (a synthetic stage spends `W`'s time there). The activation count runs until
//!   `W`, as the simulator counts it.
//! * With activation recomputation ([`Executor::with_recompute`]), `F` keeps only the
//!   input of each of the stage's segments ([`Stage::forward_segment`]) and drops the
//!   graph; `B` runs the segments again, last first, each with autograd just before its
//!   own backward, so one segment's activations are alive at a time.
//! * `SF`/`RF`/`SB`/`RB`: point-to-point messages over the pipeline communicator, tagged
//!   with [`switchyard_schedule::tag`].
//!
//! The executor measures, rather than computes, what the simulator predicts: the peak
//! number of microbatches whose activations it holds (per rank and per stage), and the
//! time of every action (a trace that opens in Perfetto).
//!
//! ## Synthetic stages: schedules checked at scale
//!
//! A [`SyntheticStage`] costs its actions instead of computing, and a [`SyntheticComm`]
//! around the real communicator costs its messages; [`run_synthetic`] runs a whole
//! program with them, one thread per rank, through the real [`Executor`] (the design is
//! in the [`synthetic`] module). On a virtual clock ([`SyntheticMode::Virtual`]) the
//! measured timeline is deterministic and equals the simulator's action by action, which
//! checks the executor's ordering and the lowering at 32 ranks on two cores; with
//! [`SyntheticMode::Sleep`] actions sleep, for real timings (`switchyard schedule
//! --execute`).
//!
//! ```
//! use switchyard_pipeline::{run_synthetic, timeline_difference, SyntheticMode};
//! use switchyard_schedule::{generate, Costs, ScheduleKind};
//!
//! let program = generate(ScheduleKind::ZbH1, 8, 16).unwrap();
//! let costs: Costs = "F=1,I=1,W=1,comm=0.25".parse().unwrap();
//! let run = run_synthetic(&program, &[costs], SyntheticMode::Virtual).unwrap();
//! assert_eq!(run.measured.makespan, run.simulated.makespan);
//! assert_eq!(timeline_difference(&run.simulated, &run.measured).unwrap(), 0.0);
//! ```
//!
//! ## Errors
//!
//! The executor refuses, with a [`PipelineError`], a program that does not lower or
//! validate, stages that are not those the program puts on the rank, and actions it
//! cannot run in the order given (a backward before its forward, a `W` before its `I`,
//! a missing input or gradient, work left unfinished). These are returned as
//! [`candle_core::Error`] (wrapped, as switchyard-shard does with its errors), so they
//! travel through `?` next to the stages' own candle errors; the message names the rank
//! and the action (`rank 1: 1B3 runs before the forward 1F3`).
//!
//! ## Example: two stages on two threads
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use switchyard_comm::local;
//! use switchyard_pipeline::{Executor, Microbatches, ModuleStage};
//! use switchyard_schedule::{generate, lower, ScheduleKind};
//!
//! let program = lower(&generate(ScheduleKind::OneFOneB, 2, 4).unwrap()).unwrap();
//! let results = local::launch(2, |comm| {
//!     let w = Var::new(&[[0.5f32]], &Device::Cpu)?;
//!     let wt = w.as_tensor().clone();
//!     let stage = ModuleStage::from_fn(move |x: &Tensor| x.matmul(&wt), vec![w]);
//!     let exec = Executor::new(&program, &*comm, vec![(comm.rank() as u32, &stage)])?;
//!     let inputs = (0..4).map(|i| Tensor::new(&[[i as f32]], &Device::Cpu)).collect::<Result<Vec<_>, _>>()?;
//!     let loss = |out: &Tensor, _mb: usize| out.sum_all();
//!     let out = exec.run(&Microbatches { inputs, loss: &loss, loss_scale: 0.25 })?;
//!     Ok::<_, candle_core::Error>(out.losses.len())
//! })
//! .unwrap();
//! assert_eq!(results, vec![0, 4]); // the last stage saw every microbatch's loss
//! ```
//!
//! ## Tutorials
//!
//! * [Chapter 2, "Pipeline parallelism"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/02-pipeline-parallelism.md):
//!   every schedule run on threads against a serial chain (example `pipeline`), and how
//!   `I` and `W` are executed.
//! * [Chapter 5, "Bring your own model"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/05-bring-your-own-model.md): a
//!   [`Stage`] of your own, pipelined and tensor-parallel (example `own_model`).
//! * [Chapter 6, "A custom schedule as CSV"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/06-custom-schedule.md).

mod error;
mod executor;
pub mod segments;
mod stage;
pub mod synthetic;

pub use error::PipelineError;
pub use executor::{
    step_bubbles, CheckedProgram, Executor, Microbatches, StepOutput, StepStats, TraceEvent,
};
pub use segments::SegmentHooks;
pub use stage::{ModuleStage, Stage};
pub use synthetic::{
    run_synthetic, timeline_difference, SyntheticClock, SyntheticComm, SyntheticMode, SyntheticRun,
    SyntheticStage,
};
