//! Bad input is a clear error at construction, naming the layer or parameter.

mod common;

use candle_core::DType;
use common::*;
use switchyard_shard::{
    ColumnConfig, ColumnParallelLinear, LayerInit, ParallelMlp, ParallelSelfAttention, ParamSource,
    ParamStore, RowConfig, RowParallelLinear, VocabParallelEmbedding,
};

/// Runs `f` at `tp` and returns rank 0's error message.
fn error_at(
    tp: usize,
    f: impl Fn(std::sync::Arc<dyn switchyard_comm::Communicator>) -> candle_core::Result<()> + Sync,
) -> String {
    let msgs = run_tp(tp, |comm| {
        Ok(f(comm).expect_err("expected an error").to_string())
    });
    msgs[0].clone()
}

#[test]
fn heads_not_divisible_by_tp() {
    let err = error_at(4, |comm| {
        let store = store(&comm, DType::F32);
        ParallelSelfAttention::new(
            &store.builder().pp("transformer.h.3"),
            comm,
            24,
            6,
            LayerInit::default(),
        )
        .map(|_| ())
    });
    assert!(err.contains("transformer.h.3.attn"), "{err}");
    assert!(
        err.contains("number of heads (6) is not divisible by 4"),
        "{err}"
    );
    assert!(err.contains("whole heads"), "{err}");
}

#[test]
fn d_model_not_divisible_by_heads() {
    let err = error_at(1, |comm| {
        let store = store(&comm, DType::F32);
        ParallelSelfAttention::new(
            &store.builder().pp("transformer.h.0"),
            comm,
            30,
            4,
            LayerInit::default(),
        )
        .map(|_| ())
    });
    assert!(
        err.contains(
            "transformer.h.0.attn: d_model (30) is not divisible by 4 (the number of heads)"
        ),
        "{err}"
    );
}

#[test]
fn empty_vocabulary() {
    let err = error_at(2, |comm| {
        let store = store(&comm, DType::F32);
        let vb = store.builder().pp("transformer.wte");
        VocabParallelEmbedding::new(&vb, comm, 0, 8, switchyard_shard::Init::Zeros).map(|_| ())
    });
    assert!(
        err.contains("transformer.wte: a vocabulary of 0 tokens"),
        "{err}"
    );
}

#[test]
fn hidden_size_not_divisible_by_tp() {
    let err = error_at(4, |comm| {
        let store = store(&comm, DType::F32);
        ParallelMlp::new(
            &store.builder().pp("transformer.h.1"),
            comm,
            8,
            30,
            LayerInit::default(),
        )
        .map(|_| ())
    });
    assert!(
        err.contains("transformer.h.1.mlp: the hidden size (30) is not divisible by 4"),
        "{err}"
    );
}

#[test]
fn communicator_of_the_wrong_size() {
    // The store was made for a group of 2, the layer is given the world of 4.
    let err = error_at(4, |comm| {
        let store = ParamStore::new(
            DType::F32,
            comm.rank() % 2,
            2,
            ParamSource::Init { seed: 0 },
        )?;
        ParallelMlp::new(
            &store.builder().pp("transformer.h.0"),
            comm,
            8,
            32,
            LayerInit::default(),
        )
        .map(|_| ())
    });
    assert!(err.contains("transformer.h.0.mlp"), "{err}");
    assert!(err.contains("group of 2 ranks"), "{err}");
    assert!(
        err.contains("world[0,1,2,3]") && err.contains("of 4"),
        "{err}"
    );

    for layer in ["column", "row"] {
        let err = error_at(2, |comm| {
            let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 0 })?;
            let vb = store.builder().pp("lm_head");
            match layer {
                "column" => {
                    ColumnParallelLinear::new(&vb, comm, 8, 8, ColumnConfig::default()).map(|_| ())
                }
                _ => RowParallelLinear::new(&vb, comm, 8, 8, RowConfig::default()).map(|_| ()),
            }
        });
        assert!(
            err.starts_with("lm_head: built for rank 0 of a tensor-parallel group of 1 ranks"),
            "{err}"
        );
    }
}

#[test]
fn indivisible_fused_shard() {
    let err = error_at(5, |comm| {
        let store = store(&comm, DType::F32);
        let vb = store.builder().pp("transformer.h.0.attn.c_attn");
        let cfg = ColumnConfig {
            blocks: 3,
            ..Default::default()
        };
        ColumnParallelLinear::new(&vb, comm, 32, 96, cfg).map(|_| ())
    });
    assert!(
        err.starts_with("dim 0 of transformer.h.0.attn.c_attn.weight (size 96) does not split into 3 blocks × 5 ranks"),
        "{err}"
    );
}

#[test]
fn bad_token_ids() {
    let msgs = run_tp(2, |comm| {
        let store = store(&comm, DType::F32);
        let emb = VocabParallelEmbedding::new(
            &store.builder().pp("transformer.wte"),
            comm,
            8,
            4,
            switchyard_shard::Init::Zeros,
        )?;
        let dev = candle_core::Device::Cpu;
        let a = emb
            .forward(&candle_core::Tensor::new(&[1u32, 8], &dev)?)
            .unwrap_err()
            .to_string();
        let b = emb
            .forward(&candle_core::Tensor::new(&[1i64, 2], &dev)?)
            .unwrap_err()
            .to_string();
        Ok((a, b))
    });
    let (a, b) = &msgs[0];
    assert!(
        a.contains("transformer.wte: token id 8 out of range for a vocabulary of 8"),
        "{a}"
    );
    assert!(b.contains("must be u32"), "{b}");
}
