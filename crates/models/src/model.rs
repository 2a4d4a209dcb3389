//! What a trainer needs from a model, as two small traits.
//!
//! A [`Model`] is implemented by a model's *config* (candle style: the config builds the
//! modules). It says how many layers a pipeline split divides, how to build one stage of
//! one rank on a tensor-parallel group, what each layer costs, which parameters several
//! stages share, and how its parameters are named and shaped. The stage it builds is a
//! [`ModelStage`]: a `switchyard_pipeline::Stage` that also scores the last stage's
//! output. Nothing here knows about data parallelism, optimizers or checkpoints; the
//! trainer derives all of that from the parameters' names, full shapes and specs.

use std::collections::HashMap;
use std::fmt::Debug;

use candle_core::{DType, Tensor};
use serde::{de::DeserializeOwned, Serialize};
use switchyard_pipeline::Stage as _;
use switchyard_shard::{single_device, ParamSource, ParamStore, TpGroup};

use crate::{plan_stages, LayerCosts, ModelError, SplitSpec, StagePlan};

/// A model the trainer can build on any `dp × pp × tp` layout.
///
/// Contract: [`Model::stage`] creates its parameters in the given store under names
/// that do not depend on the layout (so checkpoints reshard), with full shapes and
/// `ShardSpec`s that describe how the tensor-parallel group divides them, and draws
/// their initial values from the store's source (so every layout starts from the same
/// weights).
pub trait Model:
    Clone + PartialEq + Debug + Default + Serialize + DeserializeOwned + Send + Sync + 'static
{
    /// The kind of model, recorded in checkpoints and exports; loading one of another
    /// kind is refused naming both.
    const NAME: &'static str;
    /// What one pipeline stage of one rank runs.
    type Stage: ModelStage;

    /// The layers a pipeline split divides among stages (parts that only the first or
    /// the last stage runs, such as embeddings and a head, are not layers).
    fn layers(&self) -> usize;

    /// Builds stage `plan` of this rank: its parameters go into `store`, its collectives
    /// into `tp`. Called once per stage the rank runs, in stage order, on one store
    /// (the virtual stages of a rank share it: use `Builder::shared` for a tied
    /// parameter another stage of the rank may already have created).
    fn stage(
        &self,
        plan: &StagePlan,
        store: &ParamStore,
        tp: TpGroup,
    ) -> candle_core::Result<Self::Stage>;

    /// Refuses a config that cannot build a model (zero or overflowing dimensions),
    /// whatever the layout.
    fn validate(&self) -> Result<(), ModelError> {
        Ok(())
    }

    /// Refuses a layout this config cannot run: a tensor-parallel degree that does not
    /// divide what must be divided, a sequence longer than the model can take.
    fn check_layout(&self, _tp: usize, _seq_len: usize) -> Result<(), ModelError> {
        Ok(())
    }

    /// Whether the stages split the sequence over the tensor-parallel group when the
    /// store asks for it (`ParamStore::set_sequence_parallel`): their embeddings' output
    /// is split along dim 1 and their LM head gathers it
    /// ([`switchyard_shard::SequenceSplit`]). Default: no (the trainer then refuses
    /// `--sequence-parallel`).
    fn sequence_parallel(&self) -> bool {
        false
    }

    /// Experts per mixture-of-experts layer (0: none), which expert parallelism spreads
    /// over replicas (`ParamStore::set_expert_group`). Default: none (the trainer then
    /// refuses `--ep` above 1).
    fn experts(&self) -> usize {
        0
    }

    /// Per layer of [`Model::costs`]' `blocks`, the elements per token it sends to its
    /// experts under expert parallelism, and gets back (`k · d` for a mixture routing
    /// each token to `k` experts of a `d`-wide stream; 0 for a layer without): what the
    /// time model prices the all-to-alls by. Default: none.
    fn expert_exchange(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Of the elements of [`Model::param_shapes`], the experts' (which expert
    /// parallelism spreads: a replica holds `1/ep` of them). Default: none.
    fn expert_params(&self) -> usize {
        0
    }

    /// The names of what the stages count each step besides the loss
    /// ([`ModelStage::take_metrics`]); the trainer sums each over the job's ranks (one
    /// per tensor-parallel group) and reports the sums. Default: none.
    fn step_metrics(&self) -> Vec<String> {
        Vec::new()
    }

    /// A few words on a step's [`Model::step_metrics`] sums for the step line, if any.
    fn summarize_metrics(&self, sums: &std::collections::BTreeMap<String, f64>) -> Option<String> {
        let _ = sums;
        None
    }

    /// Elements per token of the activation a stage passes to the next, and of each
    /// tensor-parallel all-reduce (the hidden width), for the time model
    /// (`switchyard_train::estimate::time`). Default: unknown (messages then count their
    /// latency only).
    fn width(&self) -> Option<usize> {
        None
    }

    /// Training cost per token of each part, for balanced splits (and planners).
    /// Default: every layer alike, embeddings and head free.
    fn costs(&self, _seq_len: usize) -> LayerCosts {
        LayerCosts::uniform(self.layers(), 0.0, 1.0, 0.0)
    }

    /// Parameters used by several of `num_stages` stages (a token embedding tied to the
    /// LM head). Default: none.
    fn tied(&self, _num_stages: usize) -> Vec<Tied> {
        Vec::new()
    }

    /// When the first stage reads token ids: the size of the vocabulary, which the
    /// data must stay below. `None`: the model takes any token ids.
    fn vocab_size(&self) -> Option<usize> {
        None
    }

    /// What stage `plan` of one rank of a tensor-parallel group of `tp` holds and saves,
    /// in elements, for the memory estimator (`switchyard_train::estimate::memory`);
    /// `sequence_parallel` when the stage splits its sequence over the group
    /// ([`Model::sequence_parallel`]).
    ///
    /// Default: the parameters of the stage built at degree 1 on a throw-away store
    /// (which allocates it), each divided by its `ShardSpec`; activations unknown (the
    /// estimator then refuses the model). A large model should override this with
    /// arithmetic, and any model that wants predictions should describe its activations.
    fn footprint(
        &self,
        plan: &StagePlan,
        tp: usize,
        _seq_len: usize,
        _sequence_parallel: bool,
    ) -> Result<Footprint, ModelError> {
        self.validate()?;
        let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 0 })
            .map_err(|e| ModelError::Config(e.to_string()))?;
        let stage = self
            .stage(plan, &store, single_device())
            .map_err(|e| ModelError::Config(e.to_string()))?;
        let mut f = Footprint::default();
        let mut local = HashMap::new();
        for p in store.params() {
            let shape = p
                .spec
                .local_shape(&p.full_shape, tp)
                .map_err(|e| ModelError::Layout(e.to_string()))?;
            let n: usize = shape.iter().product();
            f.add_param(n);
            local.insert(p.var.id(), n);
        }
        let segments: Vec<Vec<candle_core::Var>> = (0..stage.num_segments())
            .map(|i| stage.segment_params(i))
            .collect();
        let mut uses: HashMap<candle_core::TensorId, usize> = HashMap::new();
        for v in segments.iter().flatten() {
            *uses.entry(v.id()).or_default() += 1;
        }
        let size = |v: &candle_core::Var| local.get(&v.id()).copied().unwrap_or(0);
        f.shared = uses
            .iter()
            .filter(|(_, &n)| n > 1)
            .map(|(id, _)| local.get(id).copied().unwrap_or(0))
            .sum();
        f.largest_segment = segments
            .iter()
            .map(|seg| seg.iter().filter(|v| uses[&v.id()] == 1).map(size).sum())
            .max()
            .unwrap_or(0);
        Ok(f)
    }

    /// Every parameter's name and full shape, in creation order. Default: builds the
    /// whole model as one stage at tensor-parallel degree 1 on a throw-away store, which
    /// allocates it; a large model should override this with arithmetic.
    fn param_shapes(&self) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
        self.validate()?;
        let plans = plan_stages(&self.costs(1), 1, &SplitSpec::Even)?;
        let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 0 })
            .map_err(|e| ModelError::Config(e.to_string()))?;
        self.stage(&plans[0], &store, single_device())
            .map_err(|e| ModelError::Config(e.to_string()))?;
        Ok(store
            .params()
            .into_iter()
            .map(|p| (p.name, p.full_shape))
            .collect())
    }

    /// All parameters, counting a tied one once (saturating; `usize::MAX` when
    /// [`Model::param_shapes`] fails).
    fn param_count(&self) -> usize {
        match self.param_shapes() {
            Ok(shapes) => shapes.iter().fold(0usize, |n, (_, s)| {
                n.saturating_add(s.iter().fold(1usize, |a, &d| a.saturating_mul(d)))
            }),
            Err(_) => usize::MAX,
        }
    }

    /// Reads a state dict (a file without switchyard's metadata, such as a PyTorch
    /// export) as this kind of model: its config, with `self` as the hint for what the
    /// shapes cannot say, and its parameters under this model's names. Default: the
    /// config is `self`, the names are the model's own.
    fn import(
        &self,
        tensors: HashMap<String, Tensor>,
    ) -> Result<(Self, HashMap<String, Tensor>), ModelError> {
        Ok((self.clone(), tensors))
    }

    /// Adds the aliases an exported state dict carries besides the parameters (GPT:
    /// a tied `lm_head.weight`). Default: none.
    fn export(&self, _tensors: &mut Vec<(String, Tensor)>) -> Result<(), ModelError> {
        Ok(())
    }

    /// Hugging Face `transformers` interop: this model's `config.json` and its
    /// parameters as `transformers` names and lays them out, sorted by name. Default:
    /// refused (the model has no `transformers` counterpart).
    fn hf_export(
        &self,
        _params: &HashMap<String, Tensor>,
    ) -> Result<(serde_json::Value, Vec<(String, Tensor)>), ModelError> {
        Err(no_hf::<Self>())
    }

    /// The inverse of [`Model::hf_export`]: a `transformers` directory's `config.json` and
    /// tensors as this model (`self` is only a hint). Default: refused.
    fn hf_import(
        &self,
        _config: &serde_json::Value,
        _tensors: HashMap<String, Tensor>,
    ) -> Result<(Self, HashMap<String, Tensor>), ModelError> {
        Err(no_hf::<Self>())
    }
}

fn no_hf<M: Model>() -> ModelError {
    ModelError::Weights(format!(
        "a {} model has no Hugging Face transformers format",
        M::NAME
    ))
}

/// What one pipeline stage of one tensor-parallel rank holds and saves, in elements of
/// the compute dtype (see [`Model::footprint`]): arithmetic, so that a planner can size
/// models far too large to build.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Footprint {
    /// Parameter elements.
    pub params: usize,
    /// Parameter tensors (each carries bookkeeping besides its data).
    pub tensors: usize,
    /// The largest parameter tensor, in elements (the optimizer updates one at a time).
    pub largest: usize,
    /// Tied parameters the stage holds and their elements (two stages of one rank
    /// share one copy).
    pub tied: Vec<(String, usize)>,
    /// Elements kept for a whole step besides the parameters (weights the fused ops
    /// pack at the step's start).
    pub step_cache: usize,
    /// Parameter elements of the stage's largest segment (`Stage::segment_params`),
    /// without those several segments share: what ZeRO 2 and 3 reduce-scatter, and
    /// stage 3 gathers, at once.
    pub largest_segment: usize,
    /// Parameter elements several of the stage's segments use (a token table tied to
    /// the head on one stage): ZeRO 2 and 3 keep them whole for the step.
    pub shared: usize,
    /// Of `params` and `tensors`, the experts' (a mixture of experts; all of them, as
    /// one rank holds them without expert parallelism): under `--ep N` a rank holds
    /// `1/N` of them, and ZeRO keeps them whole (their gradients are summed over the
    /// replicas that hold the same experts, not over every replica).
    pub experts: usize,
    pub expert_tensors: usize,
    /// Of `step_cache`, what the experts pack (`1/N` of it under `--ep N`).
    pub expert_cache: usize,
    /// `largest_segment` with every block's experts left out: under `--ep` they are
    /// resident, out of the segments' buckets.
    pub largest_segment_without_experts: usize,
    /// What a microbatch's forward keeps for its backward; `None`: not described.
    pub activations: Option<Activations>,
}

impl Footprint {
    /// Counts one parameter tensor of `elems` elements.
    pub fn add_param(&mut self, elems: usize) {
        self.params += elems;
        self.tensors += 1;
        self.largest = self.largest.max(elems);
    }
}

/// What one microbatch of a stage keeps between its forward and its backward, and what
/// its backward works on besides that, in elements.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Activations {
    /// Saved elements per token of the microbatch.
    pub per_token: f64,
    /// Saved elements per microbatch whatever its size (weights an op keeps).
    pub per_microbatch: usize,
    /// Saved tensors per microbatch (each carries bookkeeping).
    pub tensors: usize,
    /// Elements per token the backward holds at once besides the saved activations
    /// and the parameters' gradients (the gradients flowing back through a layer).
    pub backward_per_token: f64,
    /// Elements per token of the stage's input (what the previous stage sends), and so of
    /// the gradient it sends back; 0 on the first stage.
    pub input_per_token: f64,
    /// Of `per_token`, the elements selective recomputation does not keep (computed
    /// again in the backward).
    pub selective_per_token: f64,
    /// The segments of full recomputation (`Stage::num_segments`), each keeping its input
    /// of `segment_input_per_token` elements per token (token ids count as one).
    pub segments: usize,
    pub segment_input_per_token: f64,
    /// The most one segment saves per token: what a recomputed backward holds at once.
    pub segment_per_token: f64,
    /// The multiply-adds per token of the stage's largest matrix product (`n · k`), and
    /// whether the fused ops compute it (`switchyard_ops::product_path` then says how):
    /// what decides the matrix multiply's per-thread packing buffers.
    pub largest_product: usize,
    pub fused_products: bool,
    /// Whether the fused ops' products are bf16 ([`crate::Precision::Bf16`]): on a CPU
    /// with a native bf16 kernel they pack into buffers of their own, and none of them
    /// uses the f32 matrix multiply's per-thread packing buffer.
    pub bf16_products: bool,
    /// Elements of scratch each compute thread holds while the backward runs, whatever
    /// the microbatch's size (the fused attention's `T × T` score blocks of one head).
    pub backward_scratch_per_thread: usize,
    /// Elements per token a split backward's `I` copies for its `W` (the fused ops'
    /// deferred weight products: their output gradients, inputs and middle
    /// activations), in f32 elements; 0 when `I` runs the whole backward.
    pub deferred_per_token: f64,
}

/// A pipeline stage of a [`Model`] that, when it is the last stage, scores its output.
pub trait ModelStage: switchyard_pipeline::Stage {
    /// The mean loss of the last stage's `out` against `target` over the microbatch,
    /// identical on every tensor-parallel rank.
    fn loss(&self, out: &Tensor, target: &Tensor) -> candle_core::Result<Tensor>;
    /// What this stage counted since the last call, by a name of
    /// [`Model::step_metrics`] (a sum over its forwards). Default: nothing.
    fn take_metrics(&self) -> Vec<(String, f64)> {
        Vec::new()
    }
    /// The training step the forwards from now on belong to, or `None` after it: a
    /// stage with dropout draws its masks from it (with `Stage::microbatch`), and drops
    /// nothing without one. The trainer sets it around each step's pipeline pass.
    /// Default: ignored.
    fn set_dropout_step(&self, step: Option<crate::DropoutStep>) {
        let _ = step;
    }
}

/// One parameter that several stages use (a token embedding tied to the LM head).
///
/// Every listed stage creates a parameter of this name with the same full shape, spec
/// and initial values. The first listed stage owns it (it counts toward the gradient
/// norm and goes into checkpoints); the trainer sums the copies' gradients over the
/// ranks that hold them, so the copies stay equal. Stages on one rank share one
/// variable and need no sum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tied {
    pub name: String,
    /// The stages that use it, the owner first.
    pub stages: Vec<usize>,
}
