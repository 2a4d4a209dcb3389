//! The validation loss of a [`Worker`]: the parallel model scores the validation
//! split, forward only, through the pipeline.

use candle_core::{Device, Tensor};
use switchyard_comm::ReduceOp;
use switchyard_models::{Model, ModelStage};
use switchyard_pipeline::Stage;

use super::Worker;
use crate::data::Sampler;
use crate::error::Result;

impl<M: Model> Worker<'_, M> {
    /// The mean cross-entropy over `batches` validation batches (sequential windows of
    /// the validation split, see [`crate::data`]), computed by the parallel model: each
    /// replica scores its rows of every batch, microbatch by microbatch, forward only,
    /// through the pipeline. `None` when the data has no validation split. Collective
    /// over the world; every rank gets the same value.
    pub fn validation_loss(&self, batches: usize) -> Result<Option<f64>> {
        if self.data.validation().is_none() {
            return Ok(None);
        }
        self.gathered(|| self.score_validation(batches))
    }

    /// [`Worker::validation_loss`] with the parameters whole.
    fn score_validation(&self, batches: usize) -> Result<Option<f64>> {
        if self.data.validation().is_none() {
            return Ok(None);
        }
        let c = &self.cfg;
        let sampler = Sampler::validation(c);
        let (m, mbs) = (c.microbatches, c.microbatch_size());
        let per_replica = c.batch / c.dp;
        let first = self.mesh.coord.dp * per_replica;
        let pipe = self.program();
        let me = self.mesh.coord.pp as u32;
        let last = pipe.num_stages - 1;
        for (_, g) in &self.stages {
            g.begin_step()?;
        }
        let scored = (|| -> Result<(f64, f64)> {
            let (mut sum, mut count) = (0.0, 0.0);
            for b in 0..batches {
                let Some(batch) =
                    self.data
                        .validation_batch(&sampler, b, first..first + per_replica)
                else {
                    return Ok((0.0, 0.0));
                };
                let (x, y) = batch?;
                let (x, y) = (self.on_device(&x)?, self.on_device(&y)?);
                for mb in 0..m {
                    let mut h = None;
                    for (s, g) in &self.stages {
                        let s = *s;
                        // The activation for stage `to`; distinct from the training
                        // step's tags (stage << 33 | …).
                        let tag = |to: u32| {
                            (1u64 << 62) | u64::from(to) << 44 | (b as u64) << 22 | mb as u64
                        };
                        let input = match s {
                            0 => x.narrow(0, mb * mbs, mbs)?,
                            _ if pipe.rank_of_stage(s - 1) == me => h.take().expect("ran"),
                            _ => self.on_device(
                                &self
                                    .mesh
                                    .pp
                                    .recv(pipe.rank_of_stage(s - 1) as usize, tag(s))?,
                            )?,
                        };
                        let out = g.forward(&input)?;
                        if s == last {
                            let loss = g.loss(&out, &y.narrow(0, mb * mbs, mbs)?)?;
                            if self.mesh.coord.tp == 0 {
                                let n = (mbs * c.seq_len) as f64;
                                sum += loss.to_scalar::<f32>()? as f64 * n;
                                count += n;
                            }
                        } else if pipe.rank_of_stage(s + 1) == me {
                            h = Some(out);
                        } else {
                            self.mesh.pp.send(
                                &out,
                                pipe.rank_of_stage(s + 1) as usize,
                                tag(s + 1),
                            )?;
                        }
                    }
                }
            }
            Ok((sum, count))
        })();
        for (_, g) in &self.stages {
            g.end_step();
            // What the model counted here is not the next training step's.
            drop(switchyard_models::ModelStage::take_metrics(g));
        }
        let (sum, count) = scored?;
        let all = self
            .mesh
            .world
            .all_reduce(&Tensor::new(&[sum, count], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?;
        Ok(Some(all[0] / all[1]))
    }
}
