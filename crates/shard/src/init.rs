//! How the store generates a parameter's full tensor: from `(seed, name, shape)` only, so
//! that every layout starts from the single device's weights.

use candle_core::{DType, Device, Result, Tensor};

use crate::rng::SplitMix64;

/// How a parameter's full tensor is initialised when the store generates it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Init {
    /// Independent normal samples with mean 0 and standard deviation `std`.
    Normal { std: f64 },
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

impl Init {
    /// The full (unsharded) tensor for parameter `name` under `seed`, generated in f64
    /// and converted to `dtype`. The values depend only on `(seed, name, shape)`: this is
    /// what a single device would hold.
    pub fn full_tensor(
        &self,
        seed: u64,
        name: &str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let dev = Device::Cpu;
        match *self {
            Init::Zeros => Tensor::zeros(shape, dtype, &dev),
            Init::Ones => Tensor::ones(shape, dtype, &dev),
            Init::Normal { std } => {
                let n = shape.iter().product();
                let v: Vec<f64> = SplitMix64::for_param(seed, name)
                    .normals(n)
                    .into_iter()
                    .map(|z| z * std)
                    .collect();
                Tensor::from_vec(v, shape, &dev)?.to_dtype(dtype)
            }
        }
    }
}
