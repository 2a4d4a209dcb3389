//! Empty and degenerate shapes: a defined result or a clear error, never a panic.

use candle_core::{DType, Device, Tensor, Var};
use switchyard_ops::{
    attention_block, causal_attention_packed, causal_self_attention, PairOptions,
};

/// T = 0 (and B = 0): no query positions, so an empty output and an empty gradient, in
/// both dtypes; the same through the 4-D entry point and the fused attention block.
#[test]
fn attention_over_an_empty_sequence_is_empty() {
    let (h, hd) = (2, 3);
    for dtype in [DType::F32, DType::F64] {
        for (b, t) in [(2, 0), (0, 4), (0, 0)] {
            let qkv = Var::zeros((b, t, 3 * h * hd), dtype, &Device::Cpu).unwrap();
            let y = causal_attention_packed(qkv.as_tensor(), h).unwrap();
            assert_eq!(y.dims(), [b, t, h * hd], "B = {b}, T = {t}");
            let grads = y.sum_all().unwrap().backward().unwrap();
            assert_eq!(grads.get(&qkv).unwrap().dims(), [b, t, 3 * h * hd]);

            let q = Tensor::zeros((b, h, t, hd), dtype, &Device::Cpu).unwrap();
            let y = causal_self_attention(&q, &q, &q).unwrap();
            assert_eq!(y.dims(), [b, h, t, hd]);

            let d = h * hd;
            let x = Tensor::zeros((b, t, d), dtype, &Device::Cpu).unwrap();
            let w_qkv = Tensor::zeros((3 * d, d), dtype, &Device::Cpu).unwrap();
            let w_proj = Tensor::zeros((d, d), dtype, &Device::Cpu).unwrap();
            let opts = PairOptions::default();
            let y = attention_block(&x, &w_qkv, None, &w_proj, None, h, &opts).unwrap();
            assert_eq!(y.dims(), [b, t, d]);
        }
    }
}

/// A zero-width head has no scale (1/√0): refused, naming the shape.
#[test]
fn attention_refuses_an_empty_head() {
    let qkv = Tensor::zeros((1, 4, 0), DType::F32, &Device::Cpu).unwrap();
    let err = causal_attention_packed(&qkv, 2).unwrap_err().to_string();
    assert!(
        err.contains("head_dim") && err.contains("[1, 4, 0]"),
        "{err}"
    );
}
