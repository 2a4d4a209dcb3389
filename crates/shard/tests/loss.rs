//! The vocabulary-parallel cross-entropy equals `candle_nn::loss::cross_entropy` on the
//! full logits, in value and gradient, and communicates 2 all-reduces forward, 0 backward.

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

fn check_against_candle_nn(scale: f64, seed: u64) {
    for dtype in DTYPES {
        let full = rand_tensor(seed, &[N, V], scale, dtype);
        let full_var = var(&full);
        let want = candle_nn::loss::cross_entropy(full_var.as_tensor(), &targets()).unwrap();
        let want_grad = want
            .backward()
            .unwrap()
            .get(full_var.as_tensor())
            .unwrap()
            .clone();
        for tp in TPS {
            let out = run_tp(tp, |comm| {
                let (comm, counts) = Counting::wrap(comm);
                let local = var(&ShardSpec::split(1).shard(&full, comm.rank(), tp)?);
                let loss = vocab_parallel_cross_entropy(local.as_tensor(), &targets(), &comm)?;
                let fwd = counts.snapshot();
                counts.reset();
                let g = loss
                    .backward()?
                    .get(local.as_tensor())
                    .expect("grad")
                    .clone();
                let bwd = counts.snapshot();
                Ok((loss, g, fwd, bwd))
            });
            let case = format!("vocab-parallel CE scale={scale} tp={tp}");
            let grads: Vec<Tensor> = out.iter().map(|o| o.1.clone()).collect();
            for (rank, (loss, _, fwd, bwd)) in out.iter().enumerate() {
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
            }
            let g = ShardSpec::split(1).merge(&grads).unwrap();
            assert_close(&format!("{case} grad"), &g, &want_grad, dtype);
        }
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
        let a = vocab_parallel_cross_entropy(&local, &bad_target, &comm)
            .unwrap_err()
            .to_string();
        let b = vocab_parallel_cross_entropy(&local.unsqueeze(0)?, &targets(), &comm)
            .unwrap_err()
            .to_string();
        let c = vocab_parallel_cross_entropy(&local, &targets().narrow(0, 0, 3)?, &comm)
            .unwrap_err()
            .to_string();
        Ok((a, b, c))
    });
    let (a, b, c) = &errs[0];
    assert!(
        a.contains("target 16 of row 5") && a.contains("vocabulary of 16"),
        "{a}"
    );
    assert!(b.contains("[N, V/p]") && b.contains("[1, 6, 8]"), "{b}");
    assert!(c.contains("shape [6]"), "{c}");
}
