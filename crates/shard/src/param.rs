//! Parameters, their degree-independent initialisation, and the per-rank registry.
//!
//! A parameter is declared by its **full** shape and a [`ShardSpec`]; the store creates
//! only this rank's shard. With [`ParamSource::Init`] the full tensor is generated from
//! `(seed, name)` and then sliced, so for one seed the shards at any tensor-parallel
//! degree are exactly slices of the single-device weights. With [`ParamSource::Full`]
//! the full tensors come from the caller (a checkpoint) and are sliced the same way.
//!
//! A parameter with a [`ShardSpec::Padded`] layout (the vocabulary) has the full shape of
//! its logical size, `[V, d]`, everywhere outside the rank: its initial values are those
//! of the unpadded `[V, d]` tensor, the padding rows a rank holds are zeros, and
//! [`ParamStore::gather_full`] returns `[V, d]`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Result, Tensor, Var};
use switchyard_comm::Communicator;
use switchyard_ops::{OpsBackend, Precision};

use crate::error::{invalid, ShardError};
pub use crate::init::Init;
use crate::spec::{gather_full_tensor, ShardSpec};

/// Where a [`ParamStore`] takes the values of the parameters it creates.
#[derive(Debug, Clone)]
pub enum ParamSource {
    /// Generate each full tensor from `(seed, name)` with the parameter's [`Init`].
    Init { seed: u64 },
    /// Full, unsharded tensors by parameter name (for example a checkpoint); the store
    /// slices out this rank's shard and converts it to the store's dtype.
    Full(HashMap<String, Tensor>),
}

/// One parameter held by this rank.
#[derive(Debug, Clone)]
pub struct Param {
    /// The full name, e.g. `transformer.h.0.attn.c_attn.weight`.
    pub name: String,
    /// This rank's shard; its shape is `spec.local_shape(full_shape, tp)`.
    pub var: Var,
    /// How the full tensor is divided over the tensor-parallel group.
    pub spec: ShardSpec,
    /// The shape of the full (unsharded) tensor.
    pub full_shape: Vec<usize>,
    /// Expert parallelism ([`Builder::expert`]): a parameter of one expert, held only by
    /// the rank of the expert group that computes it. Entry `j` is the name of the
    /// matching parameter on rank `j` of the group (this rank's own name at its rank):
    /// what a gather over the group needs to name what it receives. `None` for every
    /// parameter that all replicas hold.
    pub expert: Option<Vec<String>>,
}

struct StoreInner {
    dtype: DType,
    device: Device,
    tp_rank: usize,
    tp_size: usize,
    source: ParamSource,
    params: Mutex<Vec<Param>>,
    used: Mutex<HashSet<String>>,
    /// [`ParamStore::set_selective_recompute`].
    selective_recompute: std::sync::atomic::AtomicBool,
    /// [`ParamStore::set_sequence_parallel`].
    sequence_parallel: std::sync::atomic::AtomicBool,
    /// What this rank's sequence-parallel layers free once the group has moved on
    /// ([`crate::SequenceSplit`]): one list for all the layers of the rank.
    sequence_pending: crate::sequence::Pending,
    /// [`ParamStore::set_expert_group`].
    expert_group: Mutex<Option<Arc<dyn Communicator>>>,
}

/// The registry of the parameters created on this rank, in creation order.
///
/// Cheap to clone (an `Arc`), `Send + Sync`. Create parameters through
/// [`ParamStore::builder`]; hand [`ParamStore::params`] (or [`ParamStore::vars`]) to
/// the optimizer and the checkpoint writer.
#[derive(Clone)]
pub struct ParamStore(Arc<StoreInner>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ParamStore {
    /// A store for rank `tp_rank` of a tensor-parallel group of `tp_size` ranks
    /// (`tp_size = 1`: no tensor parallelism), creating parameters in `dtype` on the CPU.
    pub fn new(dtype: DType, tp_rank: usize, tp_size: usize, source: ParamSource) -> Result<Self> {
        ParamStore::new_on(&Device::Cpu, dtype, tp_rank, tp_size, source)
    }

    /// [`ParamStore::new`] creating the parameters on `device` (their values are computed
    /// on the host, so they are the same on every device).
    pub fn new_on(
        device: &Device,
        dtype: DType,
        tp_rank: usize,
        tp_size: usize,
        source: ParamSource,
    ) -> Result<Self> {
        if tp_size == 0 || tp_rank >= tp_size {
            return Err(invalid(format!(
                "ParamStore: tensor-parallel rank {tp_rank} out of range for a group of {tp_size}"
            )));
        }
        if !dtype.is_float() {
            return Err(invalid(format!(
                "ParamStore: parameters must be floating point, got {dtype:?}"
            )));
        }
        Ok(ParamStore(Arc::new(StoreInner {
            dtype,
            device: device.clone(),
            tp_rank,
            tp_size,
            source,
            params: Mutex::new(Vec::new()),
            used: Mutex::new(HashSet::new()),
            selective_recompute: Default::default(),
            sequence_parallel: Default::default(),
            sequence_pending: Default::default(),
            expert_group: Mutex::new(None),
        })))
    }

    /// [`ParamStore::new`] with the rank and size of the tensor-parallel group `tp`.
    pub fn for_group(tp: &dyn Communicator, dtype: DType, source: ParamSource) -> Result<Self> {
        ParamStore::for_group_on(tp, &Device::Cpu, dtype, source)
    }

    /// [`ParamStore::for_group`] creating the parameters on `device`.
    pub fn for_group_on(
        tp: &dyn Communicator,
        device: &Device,
        dtype: DType,
        source: ParamSource,
    ) -> Result<Self> {
        ParamStore::new_on(device, dtype, tp.rank(), tp.world_size(), source)
    }

    /// The device the parameters are created on.
    pub fn device(&self) -> &Device {
        &self.0.device
    }

    /// A builder with an empty path prefix.
    pub fn builder(&self) -> Builder {
        Builder {
            store: self.clone(),
            prefix: String::new(),
            shared: false,
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            selective_recompute: self
                .0
                .selective_recompute
                .load(std::sync::atomic::Ordering::Relaxed),
            sequence_parallel: self.sequence_parallel(),
            expert_peers: None,
        }
    }

    /// Selective activation recomputation for the layers built from now on through this
    /// store's builders ([`Builder::selective_recompute`]): the trainer's choice, set
    /// before it asks the model to build its stages, so that model code stays free of it.
    pub fn set_selective_recompute(&self, on: bool) {
        self.0
            .selective_recompute
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sequence parallelism for the layers built through the builders made from now on
    /// ([`Builder::sequence_parallel`]; a builder copies the flag when it is made): the
    /// trainer's choice, set before it asks the model to build its stages. Over a group
    /// of one rank it changes nothing.
    pub fn set_sequence_parallel(&self, on: bool) {
        self.0
            .sequence_parallel
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`ParamStore::set_sequence_parallel`] is on and the group has several ranks.
    pub fn sequence_parallel(&self) -> bool {
        self.0.tp_size > 1
            && self
                .0
                .sequence_parallel
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Expert parallelism: the group over which the mixtures of experts built from now
    /// on spread their experts (rank `j` of `n` computes experts `j·E/n ..
    /// (j+1)·E/n` for the tokens of the whole group, which an all-to-all brings to it;
    /// [`crate::ParallelMoe`]). The trainer's choice, set before it asks the model to
    /// build its stages; a group of one rank (or none) computes every expert here.
    pub fn set_expert_group(&self, group: Option<Arc<dyn Communicator>>) {
        *lock(&self.0.expert_group) = group;
    }

    /// The group set by [`ParamStore::set_expert_group`], if it has several ranks.
    pub fn expert_group(&self) -> Option<Arc<dyn Communicator>> {
        lock(&self.0.expert_group)
            .clone()
            .filter(|g| g.world_size() > 1)
    }

    /// The list of tensors this rank's sequence-parallel layers free later.
    pub(crate) fn sequence_pending(&self) -> crate::sequence::Pending {
        self.0.sequence_pending.clone()
    }

    /// Every parameter created so far, in creation order.
    pub fn params(&self) -> Vec<Param> {
        lock(&self.0.params).clone()
    }

    /// The variables of [`ParamStore::params`], in creation order.
    pub fn vars(&self) -> Vec<Var> {
        lock(&self.0.params).iter().map(|p| p.var.clone()).collect()
    }

    /// The parameter called `name`, if it was created.
    pub fn get(&self, name: &str) -> Option<Param> {
        lock(&self.0.params)
            .iter()
            .find(|p| p.name == name)
            .cloned()
    }

    /// The number of parameters created so far.
    pub fn len(&self) -> usize {
        lock(&self.0.params).len()
    }

    /// Whether no parameter was created yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype of every parameter.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// This rank's index in the tensor-parallel group.
    pub fn tp_rank(&self) -> usize {
        self.0.tp_rank
    }

    /// The size of the tensor-parallel group.
    pub fn tp_size(&self) -> usize {
        self.0.tp_size
    }

    /// With [`ParamSource::Full`]: the supplied names no parameter has used (sorted), to
    /// report unexpected checkpoint entries. Empty for [`ParamSource::Init`].
    pub fn unused_sources(&self) -> Vec<String> {
        let ParamSource::Full(map) = &self.0.source else {
            return Vec::new();
        };
        let used = lock(&self.0.used);
        let mut v: Vec<String> = map.keys().filter(|k| !used.contains(*k)).cloned().collect();
        v.sort();
        v
    }

    /// The full (unsharded) value of every parameter, in creation order, gathered over
    /// the tensor-parallel group `tp` (one all-gather per split parameter, none for
    /// replicated ones; every rank of `tp` must call it). Use it to write a checkpoint
    /// that loads at any degree through [`ParamSource::Full`].
    pub fn gather_full(&self, tp: &dyn Communicator) -> Result<Vec<(String, Tensor)>> {
        if tp.world_size() != self.tp_size() || tp.rank() != self.tp_rank() {
            return Err(invalid(format!(
                "ParamStore::gather_full: the store is rank {} of {} but the group {} has this as rank {} of {}",
                self.tp_rank(),
                self.tp_size(),
                switchyard_comm::describe(tp),
                tp.rank(),
                tp.world_size()
            )));
        }
        self.params()
            .into_iter()
            .map(|p| {
                let full = gather_full_tensor(tp, &p.spec, &p.var.as_detached_tensor())?;
                Ok((p.name, full))
            })
            .collect()
    }

    fn create(
        &self,
        name: String,
        full_shape: &[usize],
        spec: ShardSpec,
        init: Init,
        shared: bool,
        expert: Option<Vec<String>>,
    ) -> Result<Var> {
        let inner = &self.0;
        if let Some(p) = lock(&inner.params).iter().find(|p| p.name == name) {
            if !shared {
                return Err(ShardError::Param {
                    name,
                    reason: "created twice (use the existing Var, e.g. for tied weights)".into(),
                }
                .into());
            }
            if p.full_shape != full_shape || p.spec != spec {
                return Err(ShardError::Param {
                    name,
                    reason: format!(
                        "created twice: shared as full shape {full_shape:?} laid out {spec:?}, \
                         but it exists with full shape {:?} laid out {:?}",
                        p.full_shape, p.spec
                    ),
                }
                .into());
            }
            return Ok(p.var.clone());
        }
        let (rank, n) = (inner.tp_rank, inner.tp_size);
        let local_shape = spec.local_shape_of(&name, full_shape, n)?;
        let local = match &inner.source {
            ParamSource::Init { .. } if matches!(init, Init::Zeros) => {
                Tensor::zeros(local_shape, inner.dtype, &Device::Cpu)?
            }
            // Padding rows are zeros whatever the init: go through the full tensor.
            ParamSource::Init { .. }
                if matches!(init, Init::Ones) && !matches!(spec, ShardSpec::Padded { .. }) =>
            {
                Tensor::ones(local_shape, inner.dtype, &Device::Cpu)?
            }
            ParamSource::Init { seed } => {
                let full = init.full_tensor(*seed, &name, full_shape, DType::F64)?;
                spec.shard_of(&name, &full, rank, n)?
                    .to_dtype(inner.dtype)?
            }
            ParamSource::Full(map) => {
                let Some(full) = map.get(&name) else {
                    return Err(ShardError::Param {
                        name,
                        reason: format!("not found among the {} supplied full tensors", map.len()),
                    }
                    .into());
                };
                if full.dims() != full_shape {
                    return Err(ShardError::Param {
                        name,
                        reason: format!(
                            "the supplied full tensor has shape {:?} but the model expects {full_shape:?}",
                            full.dims()
                        ),
                    }
                    .into());
                }
                lock(&inner.used).insert(name.clone());
                spec.shard_of(&name, full, rank, n)?.to_dtype(inner.dtype)?
            }
        };
        // `detach` + `Var::from_tensor` always copies into fresh storage, so the Var never
        // aliases the caller's (or another rank's) tensor.
        let var = Var::from_tensor(&local.to_device(&inner.device)?.detach())?;
        lock(&inner.params).push(Param {
            name,
            var: var.clone(),
            spec,
            full_shape: full_shape.to_vec(),
            expert,
        });
        Ok(var)
    }
}

/// Creates parameters under a dotted path prefix, like candle's `VarBuilder`.
///
/// ```
/// use candle_core::DType;
/// use switchyard_shard::{Init, ParamSource, ParamStore, ShardSpec};
///
/// # fn main() -> candle_core::Result<()> {
/// // rank 1 of a tensor-parallel group of 2
/// let store = ParamStore::new(DType::F32, 1, 2, ParamSource::Init { seed: 0 })?;
/// let vb = store.builder().pp("transformer.h.0").pp("mlp.c_fc");
/// let w = vb.param("weight", &[64, 16], ShardSpec::split(0), Init::Normal { std: 0.02 })?;
/// assert_eq!(w.dims(), &[32, 16]); // this rank's half of the rows
/// assert_eq!(store.params()[0].name, "transformer.h.0.mlp.c_fc.weight");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Builder {
    store: ParamStore,
    prefix: String,
    /// [`Builder::shared`]: an existing parameter of the same name, full shape and spec
    /// is returned instead of refused.
    shared: bool,
    /// [`Builder::with_ops`]: the ops backend of the layers built through this builder.
    ops: OpsBackend,
    /// [`Builder::with_precision`].
    precision: Precision,
    /// [`Builder::selective_recompute`].
    selective_recompute: bool,
    /// [`Builder::sequence_parallel`].
    sequence_parallel: bool,
    /// [`Builder::expert`]: the prefixes of the matching builders on the ranks of the
    /// expert group.
    expert_peers: Option<Vec<String>>,
}

impl Builder {
    /// A builder whose paths are prefixed by `s` (joined with a dot).
    pub fn pp(&self, s: impl AsRef<str>) -> Builder {
        let s = s.as_ref();
        Builder {
            prefix: self.path(s),
            expert_peers: self
                .expert_peers
                .as_ref()
                .map(|peers| peers.iter().map(|p| format!("{p}.{s}")).collect()),
            ..self.clone()
        }
    }

    /// A builder (and the builders [`Builder::pp`] derives from it) for the parameters
    /// of one expert under expert parallelism: only this rank of the expert group holds
    /// them, and `peers[j]` is the prefix of the matching expert on rank `j` (this
    /// builder's own prefix at this rank's index). Each parameter records the names of
    /// its peers ([`Param::expert`]), so that a trainer can tell expert parameters from
    /// the ones every replica holds, and name what a gather over the group brings,
    /// without knowing the model's names.
    pub fn expert(&self, peers: Vec<String>) -> Builder {
        Builder {
            expert_peers: Some(peers),
            ..self.clone()
        }
    }

    /// A builder (and the builders [`Builder::pp`] derives from it) whose
    /// [`Builder::param`] returns the existing `Var` when the store already holds a
    /// parameter of that name with the same full shape and spec, instead of refusing the
    /// duplicate; `init` is then ignored. This is how one rank shares a parameter between
    /// two of its stages (a tied embedding and LM head). Another full shape or spec is
    /// still an error naming the parameter.
    ///
    /// ```
    /// use candle_core::DType;
    /// use switchyard_shard::{Init, ParamSource, ParamStore, ShardSpec};
    ///
    /// # fn main() -> candle_core::Result<()> {
    /// let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 0 })?;
    /// let vb = store.builder().pp("wte");
    /// let a = vb.param("weight", &[8, 4], ShardSpec::Replicated, Init::Ones)?;
    /// let b = vb.shared().param("weight", &[8, 4], ShardSpec::Replicated, Init::Ones)?;
    /// assert_eq!(a.id(), b.id());
    /// assert_eq!(store.len(), 1);
    /// assert!(vb.param("weight", &[8, 4], ShardSpec::Replicated, Init::Ones).is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub fn shared(&self) -> Builder {
        Builder {
            shared: true,
            ..self.clone()
        }
    }

    /// A builder (and the builders [`Builder::pp`] derives from it) whose layers compute
    /// with `ops`: the fused CPU kernels (the default) or their composed twins, which run
    /// on every candle device ([`OpsBackend`]). A model passes its configuration's
    /// choice here; nothing is global.
    pub fn with_ops(&self, ops: OpsBackend) -> Builder {
        Builder {
            ops,
            ..self.clone()
        }
    }

    /// The ops backend of the layers built through this builder ([`Builder::with_ops`]).
    pub fn ops(&self) -> OpsBackend {
        self.ops
    }

    /// A builder (and the builders [`Builder::pp`] derives from it) whose layers multiply
    /// at `precision` ([`Precision`]: f32, or bf16 products with f32 sums and bf16 saved
    /// activations). A model passes its configuration's choice here; nothing is global.
    pub fn with_precision(&self, precision: Precision) -> Builder {
        Builder {
            precision,
            ..self.clone()
        }
    }

    /// The precision of the layers built through this builder
    /// ([`Builder::with_precision`]).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Whether the layers built through this builder recompute the cheap parts of their
    /// activations in the backward instead of keeping them (the MLP's GELU output; see
    /// `switchyard_ops::PairOptions::recompute_gelu`). Set on the store
    /// ([`ParamStore::set_selective_recompute`]).
    pub fn selective_recompute(&self) -> bool {
        self.selective_recompute
    }

    /// Whether the layers built through this builder split the sequence over the
    /// tensor-parallel group outside their parallel regions (Megatron's sequence
    /// parallelism, [`crate::SequenceSplit`]). Set on the store
    /// ([`ParamStore::set_sequence_parallel`]); never on a group of one rank.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// The current prefix (`""` at the root).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The full name of `name` under the current prefix.
    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Creates the parameter `<prefix>.<name>` of full shape `full_shape`, laid out by
    /// `spec`, and returns this rank's shard as a `Var`. A duplicate name, a shape that
    /// does not split, a name missing from a [`ParamSource::Full`] map or a full tensor of
    /// the wrong shape is an error naming the parameter (see [`Builder::shared`] for
    /// sharing one parameter between layers on purpose).
    pub fn param(
        &self,
        name: &str,
        full_shape: &[usize],
        spec: ShardSpec,
        init: Init,
    ) -> Result<Var> {
        let expert = self
            .expert_peers
            .as_ref()
            .map(|peers| peers.iter().map(|p| format!("{p}.{name}")).collect());
        self.store
            .create(self.path(name), full_shape, spec, init, self.shared, expert)
    }

    /// The store this builder adds to.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// This rank's index in the tensor-parallel group.
    pub fn tp_rank(&self) -> usize {
        self.store.tp_rank()
    }

    /// The size of the tensor-parallel group.
    pub fn tp_size(&self) -> usize {
        self.store.tp_size()
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        self.store.dtype()
    }
}
