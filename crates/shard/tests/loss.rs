//! The vocabulary-parallel cross-entropy equals `candle_nn::loss::cross_entropy` on the
//! full logits, in value and gradient, and communicates 2 all-reduces forward, 0 backward;
//! also over a vocabulary the group size does not divide (padded, the padding logits
//! left out whatever their values, and given a zero gradient).

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use switchyard_comm::Counting;
use switchyard_shard::{vocab_parallel_cross_entropy, ShardSpec};

const N: usize = 6;
const V: usize = 16;

fn targets() -> Tensor {
    // Targets owned by every rank at tp = 4 (ranges of 4 ids), including both ends.
    Tensor::new(&[0u32, 15, 4, 5, 11, 8], &Device::Cpu).unwrap()
}

/// [`targets`] for a vocabulary of `v` ids (the last id where 15 was).
fn targets_for(v: usize) -> Tensor {
    Tensor::new(&[0u32, v as u32 - 1, 4, 5, 11, 8], &Device::Cpu).unwrap()
}

fn check_against_candle_nn(scale: f64, seed: u64) {
    // 16 splits evenly at every degree; 13 is padded (to 14, 15, 16 at tp = 2, 3, 4).
    for v in [V, 13] {
        for dtype in DTYPES {
            check_vocab(v, dtype, scale, seed);
        }
    }
}

fn check_vocab(v: usize, dtype: DType, scale: f64, seed: u64) {
    let targets = targets_for(v);
    let full = rand_tensor(seed, &[N, v], scale, dtype);
    let full_var = var(&full);
    let want = candle_nn::loss::cross_entropy(full_var.as_tensor(), &targets).unwrap();
    let want_grad = want
        .backward()
        .unwrap()
        .get(full_var.as_tensor())
        .unwrap()
        .clone();
    let spec = ShardSpec::padded(1, v);
    for tp in [1, 2, 3, 4] {
        let out = run_tp(tp, |comm| {
            let (comm, counts) = Counting::wrap(comm);
            let local = spec.shard(&full, comm.rank(), tp)?;
            // Garbage in the padding columns: it must not count.
            let (c, real) = spec.padded_rows(comm.rank(), tp).unwrap();
            let local = match c > real {
                true => {
                    let garbage = (Tensor::ones((N, c - real), dtype, &Device::Cpu)? * 1e3)?;
                    var(&Tensor::cat(&[local.narrow(1, 0, real)?, garbage], 1)?)
                }
                false => var(&local),
            };
            let loss = vocab_parallel_cross_entropy(local.as_tensor(), &targets, v, &comm)?;
            let fwd = counts.snapshot();
            counts.reset();
            let g = loss
                .backward()?
                .get(local.as_tensor())
                .expect("grad")
                .clone();
            let bwd = counts.snapshot();
            let pad_grad = match c > real {
                true => g
                    .narrow(1, real, c - real)?
                    .abs()?
                    .sum_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?,
                false => 0.0,
            };
            Ok((loss, g, fwd, bwd, pad_grad))
        });
        let case = format!("vocab-parallel CE V={v} {dtype:?} scale={scale} tp={tp}");
        let grads: Vec<Tensor> = out.iter().map(|o| o.1.clone()).collect();
        for (rank, (loss, _, fwd, bwd, pad_grad)) in out.iter().enumerate() {
            assert_close(&format!("{case} loss rank {rank}"), loss, &want, dtype);
            let fwd_ar = fwd.get("all_reduce").copied().unwrap_or(0);
            assert_eq!(
                fwd_ar,
                if tp == 1 { 0 } else { 2 },
                "{case}: forward {fwd:?}"
            );
            assert_eq!(
                fwd.len(),
                usize::from(tp > 1),
                "{case}: only all-reduces: {fwd:?}"
            );
            assert!(bwd.is_empty(), "{case}: backward communicated {bwd:?}");
            assert_eq!(*pad_grad, 0.0, "{case}: padding gradient on rank {rank}");
        }
        let g = spec.merge(&grads).unwrap();
        assert_close(&format!("{case} grad"), &g, &want_grad, dtype);
    }
}

#[test]
fn matches_candle_nn_cross_entropy() {
    check_against_candle_nn(3.0, 1);
}

#[test]
fn is_stable_for_huge_logits() {
    check_against_candle_nn(1e4, 2);
}

#[test]
fn rejects_bad_input() {
    let errs = run_tp(2, |comm| {
        let local = Tensor::zeros((N, V / 2), DType::F32, &Device::Cpu)?;
        let bad_target = Tensor::new(&[0u32, 1, 2, 3, 4, 16], &Device::Cpu)?;
        let a = vocab_parallel_cross_entropy(&local, &bad_target, V, &comm)
            .unwrap_err()
            .to_string();
        let b = vocab_parallel_cross_entropy(&local.unsqueeze(0)?, &targets(), V, &comm)
            .unwrap_err()
            .to_string();
        let c = vocab_parallel_cross_entropy(&local, &targets().narrow(0, 0, 3)?, V, &comm)
            .unwrap_err()
            .to_string();
        // A slice that is not ⌈V/p⌉ wide.
        let d = vocab_parallel_cross_entropy(&local, &targets_for(13), 13, &comm)
            .unwrap_err()
            .to_string();
        Ok((a, b, c, d))
    });
    let (a, b, c, d) = &errs[0];
    assert!(
        d.contains("a slice of 8 logits per row, but a vocabulary of 13 over 2 ranks has 7 per rank (padded to 14)"),
        "{d}"
    );
    assert!(
        a.contains("target 16 of row 5") && a.contains("vocabulary of 16"),
        "{a}"
    );
    assert!(b.contains("[N, ⌈V/p⌉]") && b.contains("[1, 6, 8]"), "{b}");
    assert!(c.contains("shape [6]"), "{c}");
}
