//! The conformance suite every [`Communicator`] backend must pass, written once.
//!
//! Each check is a collective: every rank of the group calls it with its own
//! communicator, and each rank compares its result with a naive reference computed
//! locally from the deterministic inputs of every rank. Inputs are small integers, so
//! sums are exact in every dtype and every reduction order: results must be *equal*,
//! except `Mean`, which is checked to one rounding of the final division.
//!
//! The in-process backend runs the suite in `crates/comm/tests/conformance.rs`; the MPI
//! backend runs the same functions under `mpirun` (`switchyard-comm`'s `mpi` tests).

use candle_core::{DType, Device, Tensor};

use crate::{CommError, Communicator, Mesh, MeshShape, ReduceOp};

/// What a check returns: a failure is a [`CommError::Conformance`] naming the check.
pub type Check = Result<(), CommError>;

/// A private check's failure, named for the suite's function it belongs to.
fn conform(check: &'static str, r: Result<(), String>) -> Check {
    r.map_err(|reason| CommError::Conformance { check, reason })
}

/// Buffer lengths the collectives are checked at: empty, one element, odd, and large
/// enough to span several chunks and blocks.
pub const SIZES: [usize; 4] = [0, 1, 7, 196_611];
/// The dtypes the collectives are checked in.
pub const DTYPES: [DType; 2] = [DType::F32, DType::F64];

/// Runs every check of the suite.
pub fn run_all(comm: &dyn Communicator) -> Check {
    point_to_point(comm)?;
    all_reduce(comm)?;
    all_gather(comm)?;
    reduce_scatter(comm)?;
    broadcast(comm)?;
    all_to_all(comm)?;
    barrier(comm)?;
    split(comm)?;
    mesh(comm)?;
    misuse(comm)?;
    Ok(())
}

fn value(rank: usize, i: usize, salt: usize) -> f64 {
    ((rank * 31 + i * 7 + salt * 13) % 17) as f64 - 8.0
}

/// Rank `rank`'s deterministic input of `len` elements.
pub fn input(rank: usize, len: usize, dtype: DType, salt: usize) -> Tensor {
    let v: Vec<f64> = (0..len).map(|i| value(rank, i, salt)).collect();
    Tensor::from_vec(v, len, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("build an input tensor")
}

fn values(t: &Tensor) -> Result<Vec<f64>, String> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1::<f64>())
        .map_err(|e| e.to_string())
}

fn expect_eq(what: &str, got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.dims() != want.dims() || got.dtype() != want.dtype() {
        return Err(format!(
            "{what}: got shape {:?} {:?}, want {:?} {:?}",
            got.dims(),
            got.dtype(),
            want.dims(),
            want.dtype()
        ));
    }
    let (g, w) = (values(got)?, values(want)?);
    let eps = if got.dtype() == DType::F32 {
        f32::EPSILON as f64
    } else {
        f64::EPSILON
    };
    if let Some(i) = (0..g.len()).find(|&i| (g[i] - w[i]).abs() > eps * w[i].abs()) {
        return Err(format!("{what}: element {i} is {}, want {}", g[i], w[i]));
    }
    Ok(())
}

fn ctx<T>(what: &str, r: Result<T, CommError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// Out-of-order tags, varying shapes and dtypes, empty tensors, a message to oneself.
pub fn point_to_point(comm: &dyn Communicator) -> Check {
    conform("point_to_point", point_to_point_checks(comm))
}

fn point_to_point_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let shapes: [&[usize]; 3] = [&[3, 5], &[0], &[r + 1, 2]];
    // Send tags 2, 1, 0 and receive them 0, 1, 2.
    for (tag, shape) in shapes.iter().enumerate().rev() {
        let len: usize = shape.iter().product();
        let t = input(r, len, DTYPES[tag % 2], tag)
            .reshape(*shape)
            .map_err(|e| e.to_string())?;
        ctx("send", comm.send(&t, next, tag as u64))?;
    }
    for (tag, shape) in shapes.iter().enumerate() {
        let got = ctx("recv", comm.recv(prev, tag as u64))?;
        let shape: Vec<usize> = if tag == 2 {
            vec![prev + 1, 2]
        } else {
            shape.to_vec()
        };
        let len = shape.iter().product();
        let want = input(prev, len, DTYPES[tag % 2], tag)
            .reshape(shape)
            .map_err(|e| e.to_string())?;
        expect_eq(&format!("recv tag {tag} from {prev}"), &got, &want)?;
    }
    Ok(())
}

fn reference_reduce(n: usize, len: usize, dtype: DType, salt: usize, op: ReduceOp) -> Tensor {
    let mut acc: Vec<f64> = (0..len).map(|i| value(0, i, salt)).collect();
    for r in 1..n {
        for (i, a) in acc.iter_mut().enumerate() {
            let x = value(r, i, salt);
            *a = match op {
                ReduceOp::Max => a.max(x),
                _ => *a + x,
            };
        }
    }
    let t = Tensor::from_vec(acc, len, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("reference");
    if op == ReduceOp::Mean {
        let d = Tensor::full(n as f64, len, &Device::Cpu)
            .and_then(|d| d.to_dtype(dtype))
            .expect("divisor");
        t.div(&d).expect("mean")
    } else {
        t
    }
}

/// Sum, mean and max at every size and dtype.
pub fn all_reduce(comm: &dyn Communicator) -> Check {
    conform("all_reduce", all_reduce_checks(comm))
}

fn all_reduce_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    for (salt, &len) in SIZES.iter().enumerate() {
        for dtype in DTYPES {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let got = ctx(
                    "all_reduce",
                    comm.all_reduce(&input(r, len, dtype, salt), op),
                )?;
                let want = reference_reduce(n, len, dtype, salt, op);
                expect_eq(
                    &format!("all_reduce {op:?} len {len} {dtype:?}"),
                    &got,
                    &want,
                )?;
            }
        }
    }
    Ok(())
}

fn shaped(rank: usize, dims: &[usize], dtype: DType, salt: usize) -> Result<Tensor, String> {
    input(rank, dims.iter().product(), dtype, salt)
        .reshape(dims)
        .map_err(|e| e.to_string())
}

/// Along every dim of a 3-d tensor, and of 1-d tensors of every size.
pub fn all_gather(comm: &dyn Communicator) -> Check {
    conform("all_gather", all_gather_checks(comm))
}

fn all_gather_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let mut cases: Vec<(Vec<usize>, usize)> = (0..3).map(|d| (vec![2, 3, 4], d)).collect();
    cases.extend(SIZES.iter().map(|&s| (vec![s], 0)));
    for (salt, (dims, dim)) in cases.into_iter().enumerate() {
        for dtype in DTYPES {
            let got = ctx(
                "all_gather",
                comm.all_gather(&shaped(r, &dims, dtype, salt)?, dim),
            )?;
            let parts = (0..n)
                .map(|q| shaped(q, &dims, dtype, salt))
                .collect::<Result<Vec<_>, _>>()?;
            let want = Tensor::cat(&parts, dim).map_err(|e| e.to_string())?;
            expect_eq(
                &format!("all_gather {dims:?} dim {dim} {dtype:?}"),
                &got,
                &want,
            )?;
        }
    }
    Ok(())
}

/// Along dims 0 and 1, and of 1-d tensors of every size (times the world size).
pub fn reduce_scatter(comm: &dyn Communicator) -> Check {
    conform("reduce_scatter", reduce_scatter_checks(comm))
}

fn reduce_scatter_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let mut cases: Vec<(Vec<usize>, usize)> = vec![(vec![2 * n, 3], 0), (vec![2, 3 * n], 1)];
    cases.extend(SIZES.iter().map(|&s| (vec![s * n], 0)));
    for (salt, (dims, dim)) in cases.into_iter().enumerate() {
        for dtype in DTYPES {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let x = shaped(r, &dims, dtype, salt)?;
                let got = ctx("reduce_scatter", comm.reduce_scatter(&x, dim, op))?;
                let len: usize = dims.iter().product();
                let piece = dims[dim] / n;
                let want = reference_reduce(n, len, dtype, salt, op)
                    .reshape(dims.as_slice())
                    .and_then(|t| t.narrow(dim, r * piece, piece))
                    .map_err(|e| e.to_string())?;
                expect_eq(
                    &format!("reduce_scatter {dims:?} dim {dim} {op:?}"),
                    &got,
                    &want,
                )?;
            }
        }
    }
    Ok(())
}

/// From every root; non-root inputs are ignored.
pub fn broadcast(comm: &dyn Communicator) -> Check {
    conform("broadcast", broadcast_checks(comm))
}

fn broadcast_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    for root in 0..n {
        for dtype in DTYPES {
            let mine = if r == root {
                shaped(r, &[4, 5], dtype, root)?
            } else {
                shaped(r, &[4, 5], dtype, 99)?
            };
            let got = ctx("broadcast", comm.broadcast(&mine, root))?;
            let want = shaped(root, &[4, 5], dtype, root)?;
            expect_eq(&format!("broadcast from {root}"), &got, &want)?;
        }
    }
    Ok(())
}

/// Parts of a different shape for every (source, destination) pair; then rows of a
/// mixture of experts' exchange: some parts empty (`[0, 3]`), u32 counts beside them.
pub fn all_to_all(comm: &dyn Communicator) -> Check {
    conform("all_to_all", all_to_all_checks(comm))
}

fn all_to_all_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let parts = (0..n)
        .map(|d| shaped(r, &[r + 1, d + 1], DType::F32, d))
        .collect::<Result<Vec<_>, _>>()?;
    let got = ctx("all_to_all", comm.all_to_all(parts))?;
    if got.len() != n {
        return Err(format!(
            "all_to_all returned {} parts for {n} ranks",
            got.len()
        ));
    }
    for (s, g) in got.iter().enumerate() {
        expect_eq(
            &format!("all_to_all part from {s}"),
            g,
            &shaped(s, &[s + 1, r + 1], DType::F32, r)?,
        )?;
    }
    // Rank r sends (r + d) % 3 rows of 3 to rank d: none to some.
    let rows = |s: usize, d: usize| (s + d) % 3;
    for dtype in [DType::F32, DType::U32] {
        let parts = (0..n)
            .map(|d| shaped(r, &[rows(r, d), 3], dtype, d))
            .collect::<Result<Vec<_>, _>>()?;
        let got = ctx("all_to_all", comm.all_to_all(parts))?;
        for (s, g) in got.iter().enumerate() {
            expect_eq(
                &format!("all_to_all rows from {s} ({dtype:?}, some empty)"),
                g,
                &shaped(s, &[rows(s, r), 3], dtype, r)?,
            )?;
        }
    }
    Ok(())
}

/// A barrier, then a check that nobody ran ahead by more than one collective.
pub fn barrier(comm: &dyn Communicator) -> Check {
    conform("barrier", barrier_checks(comm))
}

fn barrier_checks(comm: &dyn Communicator) -> Result<(), String> {
    for _ in 0..3 {
        ctx("barrier", comm.barrier())?;
    }
    Ok(())
}

/// Even and odd ranks in reversed order, then the pieces split once more.
pub fn split(comm: &dyn Communicator) -> Check {
    conform("split", split_checks(comm))
}

fn split_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let sub = ctx("split", comm.split(r % 2, n - r))?;
    let mine: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).rev().collect();
    let want_members: Vec<usize> = mine.iter().map(|&q| comm.members()[q]).collect();
    if sub.members() != want_members {
        return Err(format!(
            "split: members {:?}, want {want_members:?}",
            sub.members()
        ));
    }
    let want_rank = mine.iter().position(|&q| q == r).unwrap();
    if sub.rank() != want_rank || sub.world_size() != mine.len() {
        return Err(format!(
            "split: rank {} of {}, want {want_rank} of {}",
            sub.rank(),
            sub.world_size(),
            mine.len()
        ));
    }
    let t = Tensor::new(&[r as f32], &Device::Cpu).map_err(|e| e.to_string())?;
    let got = ctx(
        "all_reduce in a sub-group",
        sub.all_reduce(&t, ReduceOp::Sum),
    )?;
    let want = mine.iter().sum::<usize>() as f32;
    expect_eq(
        "all_reduce in a sub-group",
        &got,
        &Tensor::new(&[want], &Device::Cpu).unwrap(),
    )?;
    // Point-to-point inside the sub-group does not see the parent's messages.
    let m = sub.world_size();
    let (next, prev) = ((sub.rank() + 1) % m, (sub.rank() + m - 1) % m);
    ctx("send in a sub-group", sub.send(&t, next, 0))?;
    let got = ctx("recv in a sub-group", sub.recv(prev, 0))?;
    let from = mine[prev] as f32;
    expect_eq(
        "recv in a sub-group",
        &got,
        &Tensor::new(&[from], &Device::Cpu).unwrap(),
    )?;
    let single = ctx("split of a sub-group", sub.split(sub.rank(), 0))?;
    if single.world_size() != 1 {
        return Err("split into singletons gave a bigger group".into());
    }
    ctx("barrier of one", single.barrier())?;
    Ok(())
}

/// With 8 ranks: the groups of a 2×2×2 mesh. With other sizes: a `1 × n × 1` mesh.
pub fn mesh(comm: &dyn Communicator) -> Check {
    conform("mesh", mesh_checks(comm))
}

fn mesh_checks(comm: &dyn Communicator) -> Result<(), String> {
    let n = comm.world_size();
    let shape = if n == 8 {
        MeshShape::new(2, 2, 2)
    } else {
        MeshShape::new(1, n, 1)
    };
    // The mesh is built from the group as a world of its own.
    let world = ctx("split for mesh", comm.split(0, comm.rank()))?;
    let mesh = ctx("Mesh::new", Mesh::new(world, shape))?;
    let r = comm.rank();
    let c = shape.coord(r);
    let groups = [
        (
            "tp",
            &mesh.tp,
            (0..shape.tp)
                .map(|t| shape.rank(crate::MeshCoord { tp: t, ..c }))
                .collect::<Vec<_>>(),
        ),
        (
            "pp",
            &mesh.pp,
            (0..shape.pp)
                .map(|p| shape.rank(crate::MeshCoord { pp: p, ..c }))
                .collect(),
        ),
        (
            "dp",
            &mesh.dp,
            (0..shape.dp)
                .map(|d| shape.rank(crate::MeshCoord { dp: d, ..c }))
                .collect(),
        ),
    ];
    for (name, g, want) in groups {
        let want_global: Vec<usize> = want.iter().map(|&q| comm.members()[q]).collect();
        if g.members() != want_global {
            return Err(format!(
                "mesh {name} group of rank {r}: {:?}, want {want_global:?}",
                g.members()
            ));
        }
        let t = Tensor::new(&[r as f64], &Device::Cpu).map_err(|e| e.to_string())?;
        let got = ctx(
            "all_reduce in a mesh group",
            g.all_reduce(&t, ReduceOp::Sum),
        )?;
        let s = want.iter().sum::<usize>() as f64;
        expect_eq(
            &format!("mesh {name} all_reduce"),
            &got,
            &Tensor::new(&[s], &Device::Cpu).unwrap(),
        )?;
    }
    Ok(())
}

fn expect_err<T>(what: &str, r: Result<T, CommError>, want: &str) -> Result<(), String> {
    match r {
        Ok(_) => Err(format!("{what}: succeeded but should have failed")),
        Err(e) => {
            let kind = match e {
                CommError::Invalid { .. } => "invalid",
                CommError::Mismatch { .. } => "mismatch",
                _ => "other",
            };
            if kind != want {
                return Err(format!("{what}: wrong error kind: {e}"));
            }
            Ok(())
        }
    }
}

/// Misuse gives clear errors on every rank and leaves the group usable.
pub fn misuse(comm: &dyn Communicator) -> Check {
    conform("misuse", misuse_checks(comm))
}

fn misuse_checks(comm: &dyn Communicator) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let t = input(r, 4, DType::F32, 0);
    expect_err("send out of range", comm.send(&t, n, 0), "invalid")?;
    expect_err("recv out of range", comm.recv(n + 3, 0), "invalid")?;
    expect_err(
        "gather along a missing dim",
        comm.all_gather(&t, 1),
        "invalid",
    )?;
    expect_err(
        "broadcast from a missing root",
        comm.broadcast(&t, n),
        "invalid",
    )?;
    if n > 1 {
        let x = input(r, 3 * n + 1, DType::F32, 0);
        expect_err(
            "reduce_scatter of an indivisible dim",
            comm.reduce_scatter(&x, 0, ReduceOp::Sum),
            "invalid",
        )?;
    }
    if n > 1 {
        let odd = input(r, if r == 0 { 3 } else { 4 }, DType::F32, 0);
        expect_err(
            "all_reduce of mismatched shapes",
            comm.all_reduce(&odd, ReduceOp::Sum),
            "mismatch",
        )?;
        let dt = if r == 0 { DType::F64 } else { DType::F32 };
        expect_err(
            "all_reduce of mismatched dtypes",
            comm.all_reduce(&input(r, 4, dt, 0), ReduceOp::Sum),
            "mismatch",
        )?;
        expect_err("split with duplicate keys", comm.split(0, 0), "mismatch")?;
    }
    // The group still works.
    let got = ctx(
        "all_reduce after misuse",
        comm.all_reduce(&t, ReduceOp::Sum),
    )?;
    expect_eq(
        "all_reduce after misuse",
        &got,
        &reference_reduce(n, 4, DType::F32, 0, ReduceOp::Sum),
    )
}
