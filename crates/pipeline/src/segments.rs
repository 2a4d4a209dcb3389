//! Running a stage segment by segment ([`Stage::num_segments`], one per transformer
//! block), for activation recomputation and for [`SegmentHooks`].
//!
//! Three ways to run a forward and its backward:
//! - **whole** (the default): one autograd graph per stage and microbatch;
//! - **recomputed** ([`crate::Executor::with_recompute`]): the forward keeps each
//!   segment's input only; the backward runs the segments again, last first, each with
//!   autograd just before its own backward;
//! - **segmented** (hooks without recomputation): the forward keeps one graph per
//!   segment, joined by a variable at each segment's input, and the backward walks them
//!   last first. The same kernels run on the same values as the whole graph, so the
//!   gradients are the same; what it adds is a place between segments.
//!
//! With [`SegmentHooks`] the executor calls `acquire` before a segment runs (forward,
//! recomputed forward or backward) and `release` after, and hands each segment's
//! parameter gradients to `grads` as soon as they are final for the microbatch: ZeRO
//! stage 3 gathers a segment's parameters in `acquire` and frees them in `release`, and
//! stages 2 and 3 reduce-scatter the gradients in `grads`. The executor knows nothing of
//! either; it only says when.

use candle_core::{Result, Tensor, Var};

use crate::Stage;

/// What the executor calls around every segment of a stage when it runs with hooks
/// ([`crate::Executor::with_hooks`]). Calls come in program order, the same on every
/// rank that runs the same program, so a hook may use a collective over ranks that run
/// identical programs (the data-parallel replicas of a pipeline rank).
pub trait SegmentHooks: Sync {
    /// Before segment `segment` of stage `stage` runs: its forward, its recomputed
    /// forward, or its backward.
    fn acquire(&self, stage: u32, segment: usize) -> Result<()>;
    /// After it ran.
    fn release(&self, stage: u32, segment: usize) -> Result<()>;
    /// The parameter gradients of one microbatch's backward of `segment` (indexed like
    /// [`Stage::params`], `None` for a parameter it did not reach), when they are final
    /// for that microbatch (at `B`, or at `W` of a split backward). What the hook takes
    /// (sets to `None`) the executor does not accumulate.
    fn grads(&self, stage: u32, segment: usize, grads: &mut [Option<Tensor>]) -> Result<()>;
}

/// Per segment, the parameter gradients of one backward (in the order of
/// [`Stage::params`]).
pub(crate) type SegmentGrads = Vec<(usize, Vec<Option<Tensor>>)>;

/// One segment's autograd graph in the segmented mode.
pub(crate) struct SegmentGraph {
    /// The segment's input as a variable, to read its gradient (`None` for token ids).
    input: Option<Var>,
    /// Its output, or the loss on the last stage's last segment.
    pub(crate) output: Tensor,
}

/// Hooks for one stage.
#[derive(Clone, Copy)]
pub(crate) struct Hooked<'h> {
    pub(crate) hooks: Option<&'h dyn SegmentHooks>,
    pub(crate) stage: u32,
}

impl Hooked<'_> {
    /// Runs `f` between `acquire` and `release` of `segment` (release also when `f`
    /// fails, its error first).
    fn around<R>(&self, segment: usize, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let Some(h) = self.hooks else { return f() };
        h.acquire(self.stage, segment)?;
        let out = f();
        let released = h.release(self.stage, segment);
        let out = out?;
        released?;
        Ok(out)
    }

    /// Hands one segment's gradients of a microbatch to the hook (if any); what it
    /// leaves is added into `rest`, the microbatch's sum over its segments so far.
    pub(crate) fn hand(
        &self,
        segment: usize,
        mut grads: Vec<Option<Tensor>>,
        rest: &mut [Option<Tensor>],
    ) -> Result<()> {
        if let Some(h) = self.hooks {
            h.grads(self.stage, segment, &mut grads)?;
        }
        add_into(rest, grads)
    }

    /// Hands each segment's gradients to the hook, then to the accumulator: what the
    /// hook leaves of every segment is summed first (last segment first, as one
    /// backward pass would), then added into `acc`, with hooks or without, so that a
    /// parameter several segments use gets the same sums either way.
    pub(crate) fn take_grads(
        &self,
        segments: SegmentGrads,
        acc: &mut [Option<Tensor>],
    ) -> Result<()> {
        let mut rest = vec![None; acc.len()];
        for (i, pg) in segments {
            self.hand(i, pg, &mut rest)?;
        }
        add_into(acc, rest)
    }
}

/// A float tensor as a variable of its own (to read its gradient); `None` otherwise.
fn as_input(x: &Tensor) -> Result<Option<Var>> {
    match x.dtype().is_float() {
        true => Ok(Some(Var::from_tensor(x)?)),
        false => Ok(None),
    }
}

/// The segmented forward: one graph per segment. Returns the stage's output and the
/// graphs (the last one's output is that output, with its graph).
pub(crate) fn forward_graphs(
    stage: &dyn Stage,
    x: &Tensor,
    hooked: Hooked,
) -> Result<(Tensor, Vec<SegmentGraph>)> {
    let n = stage.num_segments();
    let mut graphs = Vec::with_capacity(n);
    let mut h = x.clone();
    for i in 0..n {
        let input = as_input(&h)?;
        let x = input.as_ref().map_or(h, |v| v.as_tensor().clone());
        let output = hooked.around(i, || stage.forward_segment(i, &x))?;
        h = output.detach();
        graphs.push(SegmentGraph { input, output });
    }
    Ok((graphs.last().expect("a segment").output.clone(), graphs))
}

/// The recomputed forward: each segment's input, without graphs. Returns the stage's
/// output (without a graph) and the inputs.
pub(crate) fn forward_inputs(
    stage: &dyn Stage,
    x: Tensor,
    hooked: Hooked,
) -> Result<(Tensor, Vec<Tensor>)> {
    let mut inputs = Vec::with_capacity(stage.num_segments());
    let mut h = x;
    for i in 0..stage.num_segments() {
        let next = hooked.around(i, || Ok(stage.forward_segment(i, &h)?.detach()))?;
        inputs.push(std::mem::replace(&mut h, next));
    }
    Ok((h, inputs))
}

/// Where a backward hands each segment's parameter gradients, as soon as the segment's
/// backward is done: `(segment, gradients in the order of Stage::params)`.
pub(crate) type Sink<'s> = dyn FnMut(usize, Vec<Option<Tensor>>) -> Result<()> + 's;

/// The segmented backward: the graphs last first. `g` is the gradient of the stage's
/// output, `None` when the last graph ends in a loss. Hands each segment's parameter
/// gradients to `sink`; returns the gradient of the stage's input (when it is a float
/// tensor).
pub(crate) fn backward_graphs(
    stage: &dyn Stage,
    graphs: Vec<SegmentGraph>,
    mut g: Option<Tensor>,
    loss_scale: f64,
    hooked: Hooked,
    sink: &mut Sink,
) -> Result<Option<Tensor>> {
    for (i, graph) in graphs.into_iter().enumerate().rev() {
        let SegmentGraph { input, output } = graph;
        let grads = hooked.around(i, || backward(&output, g.as_ref(), loss_scale))?;
        drop(output);
        g = hand_over(stage, i, grads, input, sink)?;
    }
    Ok(g)
}

/// After segment `i`'s backward: hands its parameter gradients to `sink` (once the
/// rest of the backward's gradients are dropped) and returns the gradient of its input,
/// which every segment but the first must have.
fn hand_over(
    stage: &dyn Stage,
    i: usize,
    grads: candle_core::backprop::GradStore,
    input: Option<Var>,
    sink: &mut Sink,
) -> Result<Option<Tensor>> {
    let pg = param_grads(stage, &grads);
    let g = input.and_then(|v| grads.get(v.as_tensor()).cloned());
    drop(grads);
    sink(i, pg)?;
    if i > 0 && g.is_none() {
        candle_core::bail!("segment {i} does not use its input");
    }
    Ok(g)
}

/// Back-propagates a stashed `output`: `Σ output ⊙ g` for a stage's output and its
/// upstream gradient `g`, or `output · loss_scale` for a loss.
pub(crate) fn backward(
    output: &Tensor,
    g: Option<&Tensor>,
    loss_scale: f64,
) -> Result<candle_core::backprop::GradStore> {
    let root = match g {
        Some(g) => output.mul(g)?.sum_all()?,
        None => output.affine(loss_scale, 0.0)?,
    };
    root.backward()
}

/// The gradient of each of the stage's parameters in `grads`.
pub(crate) fn param_grads(
    stage: &dyn Stage,
    grads: &candle_core::backprop::GradStore,
) -> Vec<Option<Tensor>> {
    stage
        .params()
        .iter()
        .map(|p| grads.get(p.as_tensor()).cloned())
        .collect()
}

/// The last stage's loss of its output.
pub(crate) type LossFn<'a> = dyn Fn(&Tensor) -> Result<Tensor> + 'a;

/// The backward of a recomputed stage: its segments run again from their stashed
/// `inputs`, last first, each with autograd just before its backward, so that only one
/// segment's graph is alive at a time. `g` is the gradient of the stage's output, or
/// `None` on the last stage, whose `loss` scores the last segment's output. Hands each
/// segment's parameter gradients to `sink`; returns the gradient of the stage's input
/// (when it is a float tensor).
pub(crate) fn recompute(
    stage: &dyn Stage,
    inputs: Vec<Tensor>,
    mut g: Option<Tensor>,
    loss: Option<&LossFn>,
    loss_scale: f64,
    hooked: Hooked,
    sink: &mut Sink,
) -> Result<Option<Tensor>> {
    let n = inputs.len();
    for (i, x) in inputs.into_iter().enumerate().rev() {
        let input = as_input(&x)?;
        let x = input.as_ref().map_or(x, |v| v.as_tensor().clone());
        let grads = hooked.around(i, || {
            // The recomputed activations are activations, in the backward's memory.
            let activations = switchyard_mem::scope(switchyard_mem::Category::Activations);
            stage.recomputing(true);
            let y = stage.forward_segment(i, &x);
            stage.recomputing(false);
            let mut y = y?;
            if i + 1 == n {
                if let Some(loss) = loss {
                    y = loss(&y)?;
                }
            }
            drop(activations);
            backward(&y, g.as_ref(), loss_scale)
        })?;
        g = hand_over(stage, i, grads, input, sink)?;
    }
    Ok(g)
}

/// Adds `new` into `acc`, parameter by parameter.
pub(crate) fn add_into(acc: &mut [Option<Tensor>], new: Vec<Option<Tensor>>) -> Result<()> {
    for (a, n) in acc.iter_mut().zip(new) {
        if let Some(n) = n {
            *a = Some(match a.take() {
                Some(prev) => (prev + n)?,
                None => n,
            });
        }
    }
    Ok(())
}

/// Adds the gradients a split backward's `W` computed ([`Stage::backward_weights`]) to
/// those its `I` kept, each into the segment that holds its parameter (the only entry
/// when the stage ran as one graph).
pub(crate) fn add_weight_grads(
    stage: &dyn Stage,
    kept: &mut SegmentGrads,
    computed: Vec<(Var, Tensor)>,
) -> Result<()> {
    let params = stage.params();
    let index = |v: &Var| params.iter().position(|p| p.id() == v.id());
    // The segment that holds each parameter (the first that lists it).
    let mut segment_of = vec![0; params.len()];
    for i in (0..stage.num_segments()).rev() {
        for j in stage.segment_params(i).iter().filter_map(index) {
            segment_of[j] = i;
        }
    }
    for (var, g) in computed {
        let Some(j) = index(&var) else {
            candle_core::bail!(
                "backward_weights gave a gradient for a parameter the stage does not have ({:?})",
                var.dims()
            )
        };
        let e = match kept.iter().position(|(i, _)| *i == segment_of[j]) {
            _ if kept.len() == 1 => 0,
            Some(e) => e,
            None => {
                kept.push((segment_of[j], vec![None; params.len()]));
                kept.len() - 1
            }
        };
        let slot = &mut kept[e].1[j];
        *slot = Some(match slot.take() {
            Some(prev) => (prev + g)?,
            None => g,
        });
    }
    Ok(())
}
