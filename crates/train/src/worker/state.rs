//! What a [`Worker`] saves and restores besides its parameters: its part of a
//! checkpoint, the optimizer's moments, and full gradients for tests.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use switchyard_models::Model;
use switchyard_shard::gather_full_tensor;

use super::Worker;
use crate::checkpoint::RankShard;
use crate::error::{fail, Context, Result};
use crate::zero::Optimizer;

impl<M: Model> Worker<'_, M> {
    /// This rank's part of a checkpoint: the shards it owns (none outside data-parallel
    /// replica 0, but for `--ep` its experts on the replicas of the first expert group;
    /// a replicated parameter on tensor rank 0 only; a tied table only on the
    /// stage that holds the embeddings) with their Adam moments, whole: under ZeRO they
    /// are all-gathered from the replicas, so every replica must call this (a collective
    /// over the data-parallel group), and the files are the same as without ZeRO.
    pub fn checkpoint_shards(&self) -> Result<Vec<RankShard>> {
        let gathered = match &self.opt {
            Optimizer::Sharded(o) => Some(
                o.full_moments(&*self.mesh.dp)
                    .context("ZeRO: all-gathering the moments for a checkpoint")?,
            ),
            Optimizer::Full(_) => None,
        };
        self.gathered(|| {
            let (tp_rank, tp_size) = (self.mesh.coord.tp, self.cfg.tp);
            let mut out = Vec::new();
            for (i, p) in self.params.iter().enumerate() {
                if !self.counts_once(i) {
                    continue;
                }
                let (m, v) = match (&self.opt, &gathered) {
                    (Optimizer::Full(o), _) => (&o.moments[i].m, &o.moments[i].v),
                    (Optimizer::Sharded(_), Some(g)) => (&g[i].0, &g[i].1),
                    (Optimizer::Sharded(_), None) => unreachable!("gathered above"),
                };
                let shape = p.var.shape().clone();
                out.push(RankShard {
                    name: p.name.clone(),
                    spec: p.spec,
                    full_shape: p.full_shape.clone(),
                    tp_rank,
                    tp_size,
                    value: p.var.as_tensor().copy()?,
                    m: Tensor::from_vec(m.clone(), &shape, &Device::Cpu)?,
                    v: Tensor::from_vec(v.clone(), &shape, &Device::Cpu)?,
                });
            }
            Ok(out)
        })
    }

    /// Restores the optimizer from full moments (any earlier layout) and its step count.
    /// The parameters themselves come in through `ParamSource::Full` when the worker is built.
    pub fn restore_optimizer(
        &mut self,
        m: &HashMap<String, Tensor>,
        v: &HashMap<String, Tensor>,
        t: u64,
    ) -> Result<()> {
        let (rank, n) = (self.mesh.coord.tp, self.cfg.tp);
        let mut moments = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let get = |map: &HashMap<String, Tensor>| -> Result<Vec<f64>> {
                let Some(full) = map.get(&p.name) else {
                    fail!(
                        Checkpoint,
                        "the checkpoint has no optimizer state for {}",
                        p.name
                    );
                };
                Ok(p.spec
                    .shard_of(&p.name, full, rank, n)?
                    .flatten_all()?
                    .to_dtype(DType::F64)?
                    .to_vec1()?)
            };
            moments.push((get(m)?, get(v)?));
        }
        match &mut self.opt {
            Optimizer::Full(o) => {
                for (mom, (m, v)) in o.moments.iter_mut().zip(moments) {
                    (mom.m, mom.v) = (m, v);
                }
                o.t = t;
            }
            Optimizer::Sharded(o) => o
                .restore(&moments, t)
                .context("ZeRO: cutting the checkpoint's moments into this replica's shards")?,
        }
        Ok(())
    }

    /// Every parameter's full gradient by name, gathered over the tensor-parallel group
    /// (a collective over `tp`), and under `--ep` every expert's, gathered over the
    /// expert group from the ranks that hold them (a collective over it). For parity
    /// tests and debugging.
    pub fn full_grads(&self, grads: &[Option<Tensor>]) -> Result<Vec<(String, Tensor)>> {
        let tp = &*self.mesh.tp;
        let ep = self.store.expert_group();
        let mut out = Vec::with_capacity(self.params.len());
        for (p, g) in self.params.iter().zip(grads) {
            let g = match g {
                Some(g) => g.clone(),
                None => p.var.zeros_like()?,
            };
            let full = gather_full_tensor(tp, &p.spec, &g)?;
            match (&p.expert, &ep) {
                (Some(peers), Some(ep)) => {
                    let all = ep.all_gather(&full.unsqueeze(0)?, 0)?;
                    for (j, name) in peers.iter().enumerate() {
                        out.push((name.clone(), all.get(j)?));
                    }
                }
                _ => out.push((p.name.clone(), full)),
            }
        }
        Ok(out)
    }
}
