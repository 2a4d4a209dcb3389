//! Forward and backward of every autograd-aware collective at tp = 1, 2, 4, with
//! rank-dependent upstream gradients so that a wrong backward cannot pass by symmetry.

mod common;

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use common::*;
use switchyard_comm::{Communicator, Counting};
use switchyard_shard::collectives::*;

const DT: DType = DType::F64;

/// A tensor that differs per `(seed, rank)`.
fn per_rank(seed: u64, rank: usize, shape: &[usize]) -> Tensor {
    rand_tensor(seed * 100 + rank as u64, shape, 1.0, DT)
}

type Op = fn(&Tensor, &Arc<dyn Communicator>) -> Result<Tensor>;

/// Runs `op` on `x(rank)` with upstream gradient `r(rank)`; returns per rank
/// `(y, dx)` and asserts that tp = 1 communicates nothing.
fn run(
    tp: usize,
    x: impl Fn(usize) -> Tensor + Sync,
    r: impl Fn(usize) -> Tensor + Sync,
    op: Op,
) -> Vec<(Tensor, Tensor)> {
    run_tp(tp, |comm| {
        let (comm, counts) = Counting::wrap(comm);
        let rank = comm.rank();
        let xv = var(&x(rank));
        let y = op(xv.as_tensor(), &comm)?;
        let g = (&y * r(rank))?.sum_all()?.backward()?;
        let dx = g.get(xv.as_tensor()).expect("input gradient").clone();
        // The plain (non-tracking) path gives the same forward.
        let y_plain = op(&x(rank), &comm)?;
        assert_close("untracked forward", &y_plain, &y, DT);
        if tp == 1 {
            assert!(
                counts.snapshot().is_empty(),
                "tp=1 communicated: {:?}",
                counts.snapshot()
            );
        }
        Ok((y, dx))
    })
}

fn sum_over(tp: usize, f: impl Fn(usize) -> Tensor) -> Tensor {
    (1..tp).fold(f(0), |acc, r| (acc + f(r)).unwrap())
}

fn cat_over(tp: usize, dim: usize, f: impl Fn(usize) -> Tensor) -> Tensor {
    Tensor::cat(&(0..tp).map(f).collect::<Vec<_>>(), dim).unwrap()
}

#[test]
fn copy_to_region_is_identity_forward_all_reduce_backward() {
    for tp in TPS {
        let x = |_| per_rank(1, 0, &[2, 4]);
        let r = |rank| per_rank(2, rank, &[2, 4]);
        let out = run(tp, x, r, copy_to_region);
        for (rank, (y, dx)) in out.iter().enumerate() {
            assert_close(&format!("f fwd tp={tp} rank={rank}"), y, &x(rank), DT);
            assert_close(
                &format!("f bwd tp={tp} rank={rank}"),
                dx,
                &sum_over(tp, r),
                DT,
            );
        }
    }
}

#[test]
fn reduce_from_region_is_all_reduce_forward_identity_backward() {
    for tp in TPS {
        let x = |rank| per_rank(3, rank, &[2, 4]);
        let r = |rank| per_rank(4, rank, &[2, 4]);
        let out = run(tp, x, r, reduce_from_region);
        for (rank, (y, dx)) in out.iter().enumerate() {
            assert_close(
                &format!("g fwd tp={tp} rank={rank}"),
                y,
                &sum_over(tp, x),
                DT,
            );
            assert_close(&format!("g bwd tp={tp} rank={rank}"), dx, &r(rank), DT);
        }
    }
}

#[test]
fn gather_from_region_is_all_gather_forward_split_backward() {
    for tp in TPS {
        let x = |rank| per_rank(5, rank, &[2, 3]);
        // Downstream of a gather the computation is replicated: the same r everywhere.
        let r_full = per_rank(6, 0, &[2, 3 * tp]);
        let out = run(
            tp,
            x,
            |_| r_full.clone(),
            |x, c| gather_from_region(x, 1, c),
        );
        for (rank, (y, dx)) in out.iter().enumerate() {
            assert_close(
                &format!("gather fwd tp={tp} rank={rank}"),
                y,
                &cat_over(tp, 1, x),
                DT,
            );
            let want = r_full.narrow(1, 3 * rank, 3).unwrap();
            assert_close(&format!("gather bwd tp={tp} rank={rank}"), dx, &want, DT);
        }
    }
}

#[test]
fn scatter_to_region_is_split_forward_all_gather_backward() {
    for tp in TPS {
        let x_full = per_rank(7, 0, &[2, 3 * tp]);
        let r = |rank| per_rank(8, rank, &[2, 3]);
        let out = run(tp, |_| x_full.clone(), r, |x, c| scatter_to_region(x, 1, c));
        for (rank, (y, dx)) in out.iter().enumerate() {
            let want = x_full.narrow(1, 3 * rank, 3).unwrap();
            assert_close(&format!("scatter fwd tp={tp} rank={rank}"), y, &want, DT);
            assert_close(
                &format!("scatter bwd tp={tp} rank={rank}"),
                dx,
                &cat_over(tp, 1, r),
                DT,
            );
        }
    }
}

#[test]
fn gather_seq_is_all_gather_forward_reduce_scatter_backward() {
    for tp in TPS {
        let x = |rank| per_rank(9, rank, &[2, 3]);
        let r = |rank| per_rank(10, rank, &[2 * tp, 3]);
        let out = run(tp, x, r, |x, c| gather_seq(x, 0, c));
        for (rank, (y, dx)) in out.iter().enumerate() {
            assert_close(
                &format!("gather_seq fwd tp={tp} rank={rank}"),
                y,
                &cat_over(tp, 0, x),
                DT,
            );
            let want = sum_over(tp, r).narrow(0, 2 * rank, 2).unwrap();
            assert_close(
                &format!("gather_seq bwd tp={tp} rank={rank}"),
                dx,
                &want,
                DT,
            );
        }
    }
}

#[test]
fn reduce_scatter_seq_is_reduce_scatter_forward_all_gather_backward() {
    for tp in TPS {
        let x = |rank| per_rank(11, rank, &[2 * tp, 3]);
        let r = |rank| per_rank(12, rank, &[2, 3]);
        let out = run(tp, x, r, |x, c| reduce_scatter_seq(x, 0, c));
        for (rank, (y, dx)) in out.iter().enumerate() {
            let want = sum_over(tp, x).narrow(0, 2 * rank, 2).unwrap();
            assert_close(
                &format!("reduce_scatter_seq fwd tp={tp} rank={rank}"),
                y,
                &want,
                DT,
            );
            assert_close(
                &format!("reduce_scatter_seq bwd tp={tp} rank={rank}"),
                dx,
                &cat_over(tp, 0, r),
                DT,
            );
        }
    }
}

#[test]
fn each_op_communicates_once_in_the_documented_direction() {
    // (op, forward collective, backward collective)
    let cases: [(Op, &str, Option<&str>, Option<&str>); 6] = [
        (|x, c| copy_to_region(x, c), "f", None, Some("all_reduce")),
        (
            |x, c| reduce_from_region(x, c),
            "g",
            Some("all_reduce"),
            None,
        ),
        (
            |x, c| gather_from_region(x, 1, c),
            "gather",
            Some("all_gather"),
            None,
        ),
        (
            |x, c| scatter_to_region(x, 1, c),
            "scatter",
            None,
            Some("all_gather"),
        ),
        (
            |x, c| gather_seq(x, 1, c),
            "gather_seq",
            Some("all_gather"),
            Some("reduce_scatter"),
        ),
        (
            |x, c| reduce_scatter_seq(x, 1, c),
            "reduce_scatter_seq",
            Some("reduce_scatter"),
            Some("all_gather"),
        ),
    ];
    for (op, name, fwd, bwd) in cases {
        run_tp(2, |comm| {
            let (comm, counts) = Counting::wrap(comm);
            let x = var(&per_rank(13, 0, &[2, 4]));
            let y = op(x.as_tensor(), &comm)?;
            fn expect(c: Option<&'static str>) -> Vec<(&'static str, usize)> {
                c.map(|c| vec![(c, 1)]).unwrap_or_default()
            }
            let snap = |counts: &switchyard_comm::Counts| {
                counts.snapshot().into_iter().collect::<Vec<_>>()
            };
            assert_eq!(snap(&counts), expect(fwd), "{name} forward");
            counts.reset();
            y.sum_all()?.backward()?;
            assert_eq!(snap(&counts), expect(bwd), "{name} backward");
            Ok(())
        });
    }
}

#[test]
fn bad_dims_are_errors() {
    let msgs = run_tp(4, |comm| {
        let x = per_rank(14, 0, &[2, 6]);
        let a = scatter_to_region(&x, 1, &comm).unwrap_err().to_string();
        let b = reduce_scatter_seq(&x, 0, &comm).unwrap_err().to_string();
        let c = gather_from_region(&x, 2, &comm).unwrap_err().to_string();
        Ok((a, b, c))
    });
    let (a, b, c) = &msgs[0];
    assert!(
        a.contains("scatter_to_region") && a.contains("size 6") && a.contains("4 ranks"),
        "{a}"
    );
    assert!(
        b.contains("reduce_scatter_seq") && b.contains("size 2"),
        "{b}"
    );
    assert!(c.contains("dim 2 out of range"), "{c}");
}
