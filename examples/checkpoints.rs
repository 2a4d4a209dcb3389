//! Chapter 7, "Checkpoints" (`docs/tutorial/07-checkpoints.md`).
//!
//! 1. Trains a tiny GPT for 8 steps on pp 2 × tp 2, saving a checkpoint every 4 steps,
//!    and lists what a checkpoint holds.
//! 2. Resumes from step 4 on the same layout (the losses are bit-identical) and on a
//!    different one, dp 2 × pp 1 × tp 1 (the shards are merged and re-cut; the losses
//!    agree to float rounding).
//! 3. Exports the newest checkpoint to one `.safetensors` file with nanoGPT names (what
//!    PyTorch loads), evaluates both, and starts a new run from the file (`--init`).
//!
//! ```text
//! cargo run --release --example checkpoints
//! ```

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context};
use switchyard::models::GptConfig;
use switchyard::train::checkpoint::{complete_steps, Checkpoint};
use switchyard::train::data::Corpus;
use switchyard::train::weights::{evaluate, Weights};
use switchyard::train::{train, Resume, TrainConfig, TrainOptions, TrainReport};

fn main() -> anyhow::Result<()> {
    let out = out_dir("checkpoints")?;
    let ckpt = out.join("ckpt");
    let corpus = Corpus::bundled();
    let cfg = TrainConfig {
        model: GptConfig {
            n_layer: 2,
            d_model: 32,
            block_size: 32,
            ..GptConfig::default()
        },
        seq_len: 32,
        batch: 8, // over all replicas: the same global batch on every layout
        microbatches: 2,
        steps: 8,
        warmup: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let save = |resume| TrainOptions {
        checkpoint_dir: Some(ckpt.clone()),
        save_every: 4,
        keep: 0, // keep every checkpoint
        resume,
        ..TrainOptions::default()
    };

    println!("== 1. Train 8 steps on pp 2 × tp 2, saving every 4\n");
    let full = train(&cfg, &corpus, &save(None))?;
    print!("{}", full.render(&cfg));
    let steps: Vec<usize> = complete_steps(&ckpt)?.into_iter().map(|(s, _)| s).collect();
    ensure!(
        steps == [4, 8],
        "checkpoints after steps 4 and 8, got {steps:?}"
    );
    let at4 = Checkpoint::find(&ckpt, Some(4))?;
    println!("\n{}:", at4.path.display());
    list(&at4.path)?;
    let m = &at4.manifest;
    println!(
        "manifest: format {}, step {}, layout dp {} × pp {} × tp {}, optimizer step {}, {} shard files",
        m.format, m.step, m.config.dp, m.config.pp, m.config.tp, m.optimizer_t, m.files.len()
    );
    let e = &m.files[0].tensors[0];
    println!(
        "  e.g. {} in {}: {:?}, full {:?}, this shard {:?} (tensor rank {} of {})",
        e.name, m.files[0].file, e.spec, e.full_shape, e.shape, e.tp_rank, e.tp_size
    );

    println!("\n== 2. Resume from step 4\n");
    let same = train(&cfg, &corpus, &save(Some(Resume::Step(4))))?;
    let other_cfg = TrainConfig {
        dp: 2,
        pp: 1,
        tp: 1,
        ..cfg.clone()
    };
    let other = train(&other_cfg, &corpus, &save(Some(Resume::Step(4))))?;
    println!("step   original (pp 2 × tp 2)   resumed, same layout   resumed on dp 2");
    for (k, o) in full.steps[4..].iter().enumerate() {
        let (s, r) = (&same.steps[k], &other.steps[k]);
        println!(
            "{:>4}   {:>22.6}   {:>20.6}   {:>15.6}",
            o.step, o.loss, s.loss, r.loss
        );
        ensure!(
            s.step == o.step && s.loss == o.loss,
            "same layout: bit-identical"
        );
        ensure!(
            (r.loss - o.loss).abs() <= 1e-5 * o.loss,
            "another layout: the same run"
        );
    }

    println!("\n== 3. Export, evaluate, start again from the file\n");
    let weights = Weights::load(&ckpt, &cfg.model)?; // the newest checkpoint, merged
    let file = out.join("model.safetensors");
    weights.export(&file)?;
    println!(
        "{}: {} tensors, {:.3}M parameters, nanoGPT names such as {}",
        file.display(),
        weights.tensors.len(),
        weights.config.param_count() as f64 / 1e6,
        {
            let mut names: Vec<&String> = weights.tensors.keys().collect();
            names.sort();
            names[0].clone()
        }
    );
    let from_file = Weights::load(&file, &GptConfig::default())?; // the model's config comes from the file's metadata
    ensure!(
        from_file.config == cfg.model,
        "the export records the model"
    );
    let a = evaluate(&weights, &corpus, 32, Some(64))?;
    let b = evaluate(&from_file, &corpus, 32, Some(64))?;
    println!(
        "eval (64 windows of 32+1 bytes): checkpoint {:.4} nats/byte, exported file {:.4} nats/byte",
        a.nats_per_byte, b.nats_per_byte
    );
    ensure!(a.nats_per_byte == b.nats_per_byte, "the same weights");

    let fresh = TrainConfig {
        steps: 2,
        ..cfg.clone()
    };
    let opts = TrainOptions {
        init: Some(file),
        ..TrainOptions::default()
    };
    let started: TrainReport = train(&fresh, &corpus, &opts)?;
    println!(
        "a new run from the file: loss {:.4} at its step 0 (the original run ended at {:.4}; a run from the seed starts at {:.4})",
        started.steps[0].loss,
        full.final_loss(),
        full.steps[0].loss
    );
    ensure!(
        started.steps[0].loss < full.steps[0].loss - 0.5,
        "--init starts from the trained weights"
    );
    Ok(())
}

/// Lists a directory's files with their sizes.
fn list(dir: &Path) -> anyhow::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        println!(
            "  {:<24} {:>7} bytes",
            e.file_name().to_string_lossy(),
            e.metadata()?.len()
        );
    }
    Ok(())
}

fn out_dir(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join("switchyard-examples").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}
