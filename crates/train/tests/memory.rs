//! Measured memory (issue 15 §1): with `switchyard_mem::Counting` as the global allocator,
//! the report holds every rank's measured peak and its split by category, and the
//! categories hold what they should: parameters 4 bytes and AdamW's two f64 moments 16
//! bytes per parameter a rank holds, split by tensor parallelism.

use switchyard_models::{GptConfig, Model};
use switchyard_train::data::Corpus;
use switchyard_train::{train, RankMemory, TrainConfig, TrainOptions};

fn cfg(dp: usize, pp: usize, tp: usize) -> TrainConfig<GptConfig> {
    TrainConfig {
        model: GptConfig {
            n_layer: 4,
            d_model: 64,
            n_head: 4,
            block_size: 16,
            ..GptConfig::default()
        },
        seq_len: 16,
        dp,
        pp,
        tp,
        microbatches: 4,
        batch: 8,
        steps: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    }
}

fn memory(c: &TrainConfig<GptConfig>) -> Vec<RankMemory> {
    let report = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
    assert_eq!(report.memory.len(), c.world_size(), "one entry per rank");
    for (r, m) in report.memory.iter().enumerate() {
        assert_eq!(m.rank, r);
        let sum: usize = m.bytes_by_category.values().sum();
        assert!(
            sum <= m.peak_bytes && sum * 10 >= m.peak_bytes * 9,
            "rank {r}: the split ({sum}) is the peak ({})",
            m.peak_bytes
        );
    }
    report.memory
}

/// `got` is `payload` bytes of tensor data plus at most 1 KiB of bookkeeping (names,
/// shapes, candle's tensor headers) for each of `tensors` tensors.
fn about(got: usize, payload: usize, tensors: usize, what: &str) {
    assert!(
        got >= payload && got <= payload + 1024 * tensors,
        "{what}: {got} bytes for {payload} bytes of data in {tensors} tensors"
    );
}

#[test]
fn parameters_and_optimizer_state_are_what_each_rank_holds() {
    let _alone = crate::one_at_a_time();
    let c = cfg(1, 1, 1);
    let params = c.model.param_count();
    let n = Model::param_shapes(&c.model).unwrap().len();
    let serial = memory(&c);
    let cat = |m: &RankMemory, k: &str| m.bytes_by_category[k];
    about(cat(&serial[0], "parameters"), 4 * params, n, "parameters");
    about(
        cat(&serial[0], "optimizer"),
        16 * params,
        n,
        "AdamW moments",
    );
    assert!(cat(&serial[0], "activations") > 0);
    assert!(cat(&serial[0], "gradients") > 0);

    // Tensor parallelism halves the parameters of each rank (but the replicated
    // LayerNorms, biases and positions); a pipeline splits the layers.
    let tp = memory(&cfg(1, 1, 2));
    for m in &tp {
        assert!(cat(m, "parameters") < cat(&serial[0], "parameters") * 6 / 10);
    }
    let pp = memory(&cfg(1, 2, 1));
    let both: usize = pp.iter().map(|m| cat(m, "optimizer")).sum();
    about(both, 16 * params, 2 * n, "optimizer state over 2 pp ranks");
    // Data parallelism replicates everything.
    let dp = memory(&cfg(2, 1, 1));
    for m in &dp {
        about(cat(m, "parameters"), 4 * params, n, "a dp replica");
    }
}

#[test]
fn the_first_pipeline_stage_stashes_more_activations_than_the_last() {
    let _alone = crate::one_at_a_time();
    // 1F1B: stage 0 holds p microbatches in flight, the last stage one.
    let m = memory(&cfg(1, 2, 1));
    let act = |r: usize| m[r].bytes_by_category["activations"];
    assert!(act(0) > act(1), "stage 0 {} vs stage 1 {}", act(0), act(1));
}

/// The parameter elements of the largest segment of a one-stage GPT (a block, with the
/// embeddings in the first and the head in the last).
fn largest_segment(c: &TrainConfig<GptConfig>) -> usize {
    let n = c.model.n_layer;
    let mut seg = vec![0; n];
    for (name, shape) in Model::param_shapes(&c.model).unwrap() {
        let size: usize = shape.iter().product();
        let i = match name.strip_prefix("transformer.h.") {
            Some(rest) => rest.split('.').next().unwrap().parse().unwrap(),
            None if name.contains("wte") || name.contains("wpe") => 0,
            None => n - 1,
        };
        seg[i] += size;
    }
    seg.into_iter().max().unwrap()
}

/// ZeRO (issue 16 §2), measured at each rank's peak, for `Ψ` parameter elements:
/// - the optimizer category drops to `1/dp` of the moments (`16·⌈Ψ/dp⌉` bytes, two f64
///   moments), whatever the stage;
/// - stages 2 and 3 keep `4·⌈Ψ/dp⌉` bytes of gradient shards plus one segment's full
///   gradients (at most twice: a fused op's weight gradient is `[w | b]`, split into
///   the weight's and the bias's; the bucket they are flattened into for the
///   reduce-scatter is `comm`), where stages 0 and 1 keep every full gradient;
/// - stage 3 holds `4·⌈Ψ/dp⌉` bytes of parameter shards plus the one segment gathered at
///   the time (its fused weights are `other`, its gathered buffer `comm`); prefetching
///   the next segment adds at most that segment's gathered buffer and the replica's
///   shard of it to the peak.
#[test]
fn zero_shards_the_optimizer_state_over_the_replicas() {
    let _alone = crate::one_at_a_time();
    for dp in [2, 4] {
        let mut base = cfg(dp, 1, 1);
        base.batch = 4 * dp;
        // The reduce-scatters on the rank's thread: where the peak falls then does not
        // depend on when a communication thread's bucket is done (with the thread, the
        // estimator's prediction is held within 10 % by `tests/estimate.rs`).
        base.overlap_grad_reduce = false;
        let params = base.model.param_count();
        let shard = 4 * params.div_ceil(dp);
        let segment = 4 * largest_segment(&base);
        let n = Model::param_shapes(&base.model).unwrap().len();
        for zero in [0, 1, 2, 3] {
            let c = TrainConfig {
                zero,
                ..base.clone()
            };
            // ZeRO 3 without prefetching: at most a segment in flight less.
            let off = (zero == 3).then(|| {
                memory(&TrainConfig {
                    zero_prefetch: false,
                    ..c.clone()
                })
            });
            for m in memory(&c) {
                let cat = |k: &str| m.bytes_by_category[k];
                let what = format!("dp {dp} zero {zero} rank {}", m.rank);
                eprintln!(
                    "{what}: optimizer {} B, gradients {} B, parameters {} B, peak {} B",
                    cat("optimizer"),
                    cat("gradients"),
                    cat("parameters"),
                    m.peak_bytes
                );
                match zero {
                    // Prefetching moves the peak: it may come while a smaller segment
                    // computes and the largest one is in flight (`comm`). Without it
                    // the peak holds the largest (checked below).
                    3 => {
                        let got = cat("parameters");
                        assert!(
                            got >= shard && got <= shard + segment + 1024 * n,
                            "{what}: {got} B of parameters for {shard} B of shards and a \
                             largest segment of {segment} B"
                        );
                    }
                    _ => about(cat("parameters"), 4 * params, n, "parameters"),
                }
                match zero {
                    0 => about(cat("optimizer"), 16 * params, n, "AdamW moments"),
                    _ => about(
                        cat("optimizer"),
                        16 * params.div_ceil(dp),
                        // Per bucket: its two moment vectors and the layout.
                        n,
                        &format!("{what}: a replica's shard of the moments"),
                    ),
                }
                if let Some(off) = &off {
                    let (mine, worst) = (&off[m.rank], off.iter().map(|o| o.peak_bytes).max());
                    let got = mine.bytes_by_category["parameters"];
                    assert!(
                        got >= shard && got <= shard + segment + 1024 * n,
                        "{what} without prefetching: {got} B of parameters"
                    );
                    eprintln!(
                        "{what}: peak {} B with prefetching, {} B without",
                        m.peak_bytes, mine.peak_bytes
                    );
                    // Without prefetching a replica's peak comes while a segment is
                    // gathered; on the replica with the highest parameters it is the
                    // largest segment.
                    let most = off.iter().map(|o| o.bytes_by_category["parameters"]).max();
                    about(
                        most.unwrap(),
                        shard + segment,
                        n,
                        &format!("{what} without prefetching: the parameters"),
                    );
                    // In flight while a segment computes: the next one's gathered
                    // bucket and this replica's shard of it, which the thread sends.
                    // One more segment for timing: the in-process all-gather's output,
                    // which every replica reads, is charged to the replica that
                    // allocates it, whichever arrives first.
                    let ahead = 2 * segment + segment.div_ceil(dp);
                    assert!(
                        m.peak_bytes <= worst.unwrap() + ahead + 64 * 1024,
                        "{what}: a peak of {} B with prefetching, at most {worst:?} B \
                         without, for a segment of {segment} B",
                        m.peak_bytes,
                    );
                }
                let grads = cat("gradients");
                match zero {
                    0 | 1 => assert!(grads >= 4 * params, "{what}: {grads} B of gradients"),
                    _ => assert!(
                        grads >= shard && grads <= shard + 2 * segment + 64 * 1024,
                        "{what}: {grads} B of gradients for {shard} B of shards and \
                         {segment} B in the largest segment"
                    ),
                }
            }
        }
    }
}

/// A long run holds what a short one does: the executor's per-action times are kept only
/// for a trace (they were kept for every step, about 1 KiB a step here, in the gradients
/// category). The report's own per-step records (loss, time, ...) do grow, in `other`.
#[test]
fn a_long_run_holds_no_more_gradients_than_a_short_one() {
    let _alone = crate::one_at_a_time();
    let mut c = cfg(1, 2, 1);
    c.microbatches = 8;
    let gradients = |steps: usize| -> Vec<usize> {
        let c = TrainConfig { steps, ..c.clone() };
        memory(&c)
            .iter()
            .map(|m| m.bytes_by_category["gradients"])
            .collect()
    };
    let (short, long) = (gradients(5), gradients(200));
    for (s, l) in short.iter().zip(&long) {
        // A few KiB of in-flight tensors that depend on the threads' timing, not 195
        // steps of action times (about 200 KiB).
        assert!(
            l.abs_diff(*s) < 32 << 10,
            "5 steps: {short:?} B, 200 steps: {long:?} B"
        );
    }
}
