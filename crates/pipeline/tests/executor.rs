//! The executor against a serial computation of the same chain of stages, for every
//! schedule kind and a hand-written CSV schedule; and its refusals.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor, Var};
use switchyard_comm::local;
use switchyard_pipeline::{Executor, Microbatches, ModuleStage, Stage};
use switchyard_schedule::{generate, simulate, Action, Costs, Program, ScheduleKind};

const D: usize = 6;
const ROWS: usize = 3;

fn weight(stage: u32) -> Result<Tensor> {
    let v: Vec<f64> = (0..D * D)
        .map(|i| (((i * 7 + stage as usize * 13) % 11) as f64 - 5.0) / 10.0)
        .collect();
    Tensor::from_vec(v, (D, D), &Device::Cpu)
}

fn input(m: usize) -> Result<Tensor> {
    let v: Vec<f64> = (0..ROWS * D)
        .map(|i| ((i + 3 * m) % 5) as f64 / 4.0 - 0.5)
        .collect();
    Tensor::from_vec(v, (ROWS, D), &Device::Cpu)
}

fn target(m: usize) -> Result<Tensor> {
    input(m + 1)
}

fn stage(s: u32) -> Result<ModuleStage<impl candle_core::Module + Send + Sync>> {
    let w = Var::from_tensor(&weight(s)?)?;
    let wt = w.as_tensor().clone();
    Ok(ModuleStage::from_fn(
        move |x: &Tensor| x.matmul(&wt)?.tanh(),
        vec![w],
    ))
}

/// [`stage`] in two segments (the product, then `tanh`), for recomputation.
struct Segmented(Vec<Var>);

impl Stage for Segmented {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(self.0[0].as_tensor())?.tanh()
    }
    fn params(&self) -> &[Var] {
        &self.0
    }
    fn num_segments(&self) -> usize {
        2
    }
    fn forward_segment(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        match i {
            0 => x.matmul(self.0[0].as_tensor()),
            _ => x.tanh(),
        }
    }
}

fn loss(out: &Tensor, m: usize) -> Result<Tensor> {
    (out - target(m)?)?.sqr()?.mean_all()
}

/// The serial gradient of stage `s`'s weight for the mean loss over `m` microbatches,
/// and the mean loss.
fn serial(stages: u32, m: usize) -> Result<(Vec<Tensor>, f64)> {
    let ws: Vec<Var> = (0..stages)
        .map(|s| Var::from_tensor(&weight(s)?))
        .collect::<Result<_>>()?;
    let mut total = Tensor::zeros((), DType::F64, &Device::Cpu)?;
    for i in 0..m {
        let mut x = input(i)?;
        for w in &ws {
            x = x.matmul(w.as_tensor())?.tanh()?;
        }
        total = (total + loss(&x, i)?)?;
    }
    let total = (total / m as f64)?;
    let grads = total.backward()?;
    let g = ws
        .iter()
        .map(|w| grads.get(w.as_tensor()).unwrap().clone())
        .collect();
    Ok((g, total.to_scalar::<f64>()?))
}

/// A rank's gradients by stage, losses, peak activations, and the actions of its trace
/// with the actions its (lowered) program lists.
type RankOut = (
    BTreeMap<u32, Tensor>,
    Vec<(u32, f64)>,
    usize,
    (Vec<Action>, Vec<Action>),
);

fn run(program: &Program) -> Vec<RankOut> {
    run_with(program, false)
}

/// [`run`], with activation recomputation over two-segment stages when `recompute`.
fn run_with(program: &Program, recompute: bool) -> Vec<RankOut> {
    let m = program.num_microbatches as usize;
    local::launch(program.num_ranks(), |comm| {
        let mine = program.stages_of_rank(comm.rank() as u32);
        let modules = mine.iter().map(|&s| stage(s)).collect::<Result<Vec<_>>>()?;
        let segmented = mine
            .iter()
            .map(|&s| Ok(Segmented(vec![Var::from_tensor(&weight(s)?)?])))
            .collect::<Result<Vec<_>>>()?;
        let stages: Vec<(u32, &dyn Stage)> = match recompute {
            false => mine
                .iter()
                .copied()
                .zip(modules.iter().map(|s| s as &dyn Stage))
                .collect(),
            true => mine
                .iter()
                .copied()
                .zip(segmented.iter().map(|s| s as &dyn Stage))
                .collect(),
        };
        let exec = Executor::new(program, &*comm, stages)?.with_recompute(recompute);
        let inputs = (0..m).map(input).collect::<Result<Vec<_>>>()?;
        let out = exec.run(&Microbatches {
            inputs,
            loss: &loss,
            loss_scale: 1.0 / m as f64,
        })?;
        let grads = out
            .grads
            .into_iter()
            .map(|(s, g)| (s, g[0].clone().unwrap()))
            .collect();
        let traced = out.stats.events.iter().map(|e| e.action).collect();
        let listed = exec.program().ranks[comm.rank()].clone();
        Ok::<_, candle_core::Error>((
            grads,
            out.losses,
            out.stats.peak_activations,
            (traced, listed),
        ))
    })
    .unwrap()
}

fn check(program: &Program) {
    check_with(program, false);
}

fn check_with(program: &Program, recompute: bool) {
    let (want, want_loss) = serial(program.num_stages, program.num_microbatches as usize).unwrap();
    let outs = run_with(program, recompute);
    let mut seen = 0;
    let mut losses = Vec::new();
    for (grads, l, _, (traced, listed)) in &outs {
        // The trace holds every action the rank performed, as actions, in its order.
        assert_eq!(traced, listed);
        losses.extend(l.iter().map(|(_, l)| *l));
        for (s, g) in grads {
            let diff = (g - &want[*s as usize])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(diff < 1e-12, "stage {s}: gradient differs by {diff}");
            seen += 1;
        }
    }
    assert_eq!(
        seen, program.num_stages as usize,
        "every stage reported a gradient"
    );
    assert_eq!(losses.len(), program.num_microbatches as usize);
    let mean = losses.iter().sum::<f64>() / losses.len() as f64;
    assert!(
        (mean - want_loss).abs() < 1e-12,
        "loss {mean} vs {want_loss}"
    );
}

/// Every schedule kind, with its pipeline ranks and microbatches.
const KINDS: [(ScheduleKind, usize, usize); 5] = [
    (ScheduleKind::GPipe, 2, 3),
    (ScheduleKind::OneFOneB, 3, 5),
    (ScheduleKind::OneFOneB, 1, 2),
    (ScheduleKind::Interleaved { virtual_stages: 2 }, 2, 4),
    (ScheduleKind::ZbH1, 3, 6),
];

#[test]
fn every_schedule_matches_serial() {
    for (kind, p, m) in KINDS {
        check(&generate(kind, p, m).unwrap());
    }
}

#[test]
fn recomputation_over_segments_matches_serial_under_every_schedule() {
    for (kind, p, m) in KINDS {
        check_with(&generate(kind, p, m).unwrap(), true);
    }
}

/// A segment that ignores its input would leave the previous segments without a
/// gradient: refused, not silently treated as the loss.
#[test]
fn a_segment_that_ignores_its_input_is_refused_under_recomputation() {
    struct Ignoring(Vec<Var>);
    impl Stage for Ignoring {
        fn forward(&self, _: &Tensor) -> Result<Tensor> {
            self.0[0].as_tensor().sum_all()
        }
        fn params(&self) -> &[Var] {
            &self.0
        }
        fn num_segments(&self) -> usize {
            2
        }
        fn forward_segment(&self, i: usize, x: &Tensor) -> Result<Tensor> {
            match i {
                0 => x.sum_all(),
                _ => self.0[0].as_tensor().sum_all(),
            }
        }
    }
    let program = generate(ScheduleKind::OneFOneB, 1, 1).unwrap();
    let e = local::launch(1, |comm| {
        let st = Ignoring(vec![Var::from_tensor(&weight(0)?)?]);
        let exec =
            Executor::new(&program, &*comm, vec![(0, &st as &dyn Stage)])?.with_recompute(true);
        exec.run(&Microbatches {
            inputs: vec![input(0)?],
            loss: &|out: &Tensor, _| Ok(out.clone()),
            loss_scale: 1.0,
        })
        .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("segment 1 does not use its input"), "{e}");
}

#[test]
fn a_custom_csv_schedule_runs() {
    // Two ranks, stages 0 and 1, GPipe-like but with the backward of microbatch 1 first.
    let csv = "# rank, actions\n0,0F0,0F1,0B1,0B0\n1,1F0,1F1,1B1,1B0\n";
    let program = Program::from_csv(csv).unwrap();
    check(&program);
}

#[test]
fn an_invalid_schedule_is_refused_with_the_validator_message() {
    // Stage 1 runs backward of microbatch 0 before its forward.
    let program = Program::from_csv("0,0F0,0B0\n1,1B0,1F0\n").unwrap();
    let errs = local::launch(2, |comm| {
        let s = stage(comm.rank() as u32)?;
        match Executor::new(
            &program,
            &*comm,
            vec![(comm.rank() as u32, &s as &dyn Stage)],
        ) {
            Ok(_) => Ok(String::new()),
            Err(e) => Ok::<_, candle_core::Error>(e.to_string()),
        }
    })
    .unwrap();
    for e in errs {
        assert!(e.contains("invalid pipeline program"), "{e}");
        assert!(e.contains("1B0"), "{e}");
    }
}

#[test]
fn one_f_one_b_peak_activations_are_measured_and_match_the_simulator() {
    let (p, m) = (4, 8);
    let program = generate(ScheduleKind::OneFOneB, p, m).unwrap();
    let predicted = simulate(&program, &Costs::default())
        .unwrap()
        .peak_activations();
    let outs = run(&program);
    for (r, (_, _, peak, _)) in outs.iter().enumerate() {
        assert_eq!(*peak as u32, predicted[r], "rank {r}");
        assert_eq!(*peak, (p - r).min(m), "rank {r}");
    }
    // GPipe stashes every microbatch.
    let outs = run(&generate(ScheduleKind::GPipe, p, m).unwrap());
    assert!(outs.iter().all(|(_, _, peak, _)| *peak == m));
}

/// A stage that counts the step hooks and can fail its forward pass.
struct Hooked {
    params: Vec<Var>,
    fail: bool,
    begun: std::sync::atomic::AtomicUsize,
    ended: std::sync::atomic::AtomicUsize,
}

impl Stage for Hooked {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        use std::sync::atomic::Ordering::SeqCst;
        assert_eq!(self.begun.load(SeqCst), 1, "forward before begin_step");
        assert_eq!(self.ended.load(SeqCst), 0, "forward after end_step");
        if self.fail {
            candle_core::bail!("this stage fails");
        }
        x.matmul(self.params[0].as_tensor())?.tanh()
    }
    fn params(&self) -> &[Var] {
        &self.params
    }
    fn begin_step(&self) -> Result<()> {
        self.begun.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn end_step(&self) {
        self.ended.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn the_step_hooks_bracket_every_step_even_a_failed_one() {
    use std::sync::atomic::Ordering::SeqCst;
    let program = generate(ScheduleKind::OneFOneB, 1, 3).unwrap();
    for fail in [false, true] {
        let st = Hooked {
            params: vec![Var::from_tensor(&weight(0).unwrap()).unwrap()],
            fail,
            begun: Default::default(),
            ended: Default::default(),
        };
        local::launch(1, |comm| {
            let exec = Executor::new(&program, &*comm, vec![(0, &st as &dyn Stage)])?;
            let out = exec.run(&Microbatches {
                inputs: (0..3).map(input).collect::<Result<Vec<_>>>()?,
                loss: &loss,
                loss_scale: 1.0 / 3.0,
            });
            assert_eq!(out.is_err(), fail, "{:?}", out.err());
            Ok::<_, candle_core::Error>(())
        })
        .unwrap();
        assert_eq!(
            (st.begun.load(SeqCst), st.ended.load(SeqCst)),
            (1, 1),
            "fail {fail}"
        );
    }
}

/// `W` calls [`Stage::backward_weights`] once per microbatch, in the program's order,
/// and nothing else does.
#[test]
fn w_calls_the_stages_weight_hook() {
    struct Recording<S> {
        inner: S,
        calls: std::sync::Mutex<Vec<u32>>,
    }
    impl<S: Stage> Stage for Recording<S> {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.inner.forward(x)
        }
        fn params(&self) -> &[Var] {
            self.inner.params()
        }
        fn backward_weights(&self, microbatch: u32) -> Result<Vec<(Var, Tensor)>> {
            self.calls.lock().unwrap().push(microbatch);
            Ok(Vec::new())
        }
    }
    for kind in [ScheduleKind::ZbH1, ScheduleKind::OneFOneB] {
        let program = generate(kind, 2, 3).unwrap();
        let calls = local::launch(2, |comm| {
            let s = comm.rank() as u32;
            let st = Recording {
                inner: stage(s)?,
                calls: Default::default(),
            };
            let exec = Executor::new(&program, &*comm, vec![(s, &st as &dyn Stage)])?;
            let inputs = (0..3).map(input).collect::<Result<Vec<_>>>()?;
            let loss = |out: &Tensor, _m: usize| out.sum_all();
            exec.run(&Microbatches {
                inputs,
                loss: &loss,
                loss_scale: 1.0,
            })?;
            let want: Vec<u32> = program.ranks[s as usize]
                .iter()
                .filter(|a| a.op == switchyard_schedule::Op::W)
                .map(|a| a.microbatch)
                .collect();
            let got = st.calls.lock().unwrap().clone();
            Ok::<_, candle_core::Error>((got, want))
        })
        .unwrap();
        for (got, want) in calls {
            assert_eq!(got, want, "{kind}");
            assert_eq!(got.is_empty(), kind != ScheduleKind::ZbH1);
        }
    }
}
