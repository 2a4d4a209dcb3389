//! `train --resume`: the settings a resumed run takes from its checkpoint.

use std::path::Path;

use switchyard_models::GptConfig;
use switchyard_train::checkpoint;
use switchyard_train::{Resume, TrainConfig};

use super::train::TrainArgs;

/// Takes the total steps, the learning-rate schedule, the optimizer's settings (β₁, β₂,
/// ε, the weight decay and which parameters it applies to, the clipping), the seed, the
/// vocabulary and the data settings (shuffle, validation) from the checkpoint `--resume`
/// continues, except those given by a flag or in the `--config` file. Reads only the
/// manifest; the trainer checks the files. A checkpoint written before `eps`, `decay` or
/// `shuffle` existed gives their defaults, which were then the only behaviour.
pub fn restore(
    c: &mut TrainConfig<GptConfig>,
    a: &TrainArgs,
    dir: &Path,
    r: Resume,
) -> anyhow::Result<()> {
    let step = match r {
        Resume::Latest => None,
        Resume::Step(s) => Some(s),
    };
    let path = checkpoint::locate(dir, step)?;
    let saved = checkpoint::read_manifest(&path)?.config_of::<GptConfig>()?;
    let table = a
        .config
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| t.parse::<toml::Table>().ok());
    let in_file: Vec<String> = table
        .as_ref()
        .map(|t| t.keys().cloned().collect())
        .unwrap_or_default();
    let vocab_in_file = table
        .as_ref()
        .and_then(|t| t.get("model"))
        .and_then(|m| m.get("vocab_size"))
        .is_some();
    if a.vocab_size.is_none() && !vocab_in_file {
        c.model.vocab_size = saved.model.vocab_size;
    }
    let keep = |flag: bool, key: &str| !flag && !in_file.iter().any(|k| k == key);
    macro_rules! take {
        ($($flag:expr => $field:ident),* $(,)?) => {
            $(if keep($flag, stringify!($field)) { c.$field = saved.$field.clone(); })*
        };
    }
    take!(a.steps.is_some() => steps, a.lr.is_some() => lr, a.min_lr.is_some() => min_lr,
        a.warmup.is_some() => warmup, a.weight_decay.is_some() => weight_decay,
        a.grad_clip.is_some() => grad_clip, a.beta1.is_some() => beta1,
        a.beta2.is_some() => beta2, a.eps.is_some() => eps, a.decay.is_some() => decay,
        a.seed.is_some() => seed, a.no_shuffle => shuffle,
        a.val_fraction.is_some() => val_fraction, a.eval_every.is_some() => eval_every,
        a.eval_batches.is_some() => eval_batches);
    Ok(())
}
