//! Sampling text from a byte-level GPT: the prompt's bytes are the context, each next
//! byte is drawn from the logits at the last position (greedy at temperature 0), and
//! the context keeps the model's last `block_size` bytes.

use candle_core::{Device, Module, Tensor, D};

use crate::{GptConfig, GptStage, ModelError};

/// Continues `prompt` by `tokens` bytes, sampling at `temperature` (0: greedy) with a
/// seeded generator.
pub fn sample(
    cfg: &GptConfig,
    model: &GptStage,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    seed: u64,
) -> candle_core::Result<String> {
    let mut text = String::new();
    sample_with(cfg, model, prompt, tokens, temperature, seed, |piece| {
        text.push_str(piece);
        Ok::<(), candle_core::Error>(())
    })?;
    Ok(text)
}

/// [`sample`], handing the text to `on_text` piece by piece as it is generated (whole
/// UTF-8 characters; invalid bytes become U+FFFD as in [`String::from_utf8_lossy`]),
/// and keeping only the model's context in memory.
pub fn sample_with<E: From<candle_core::Error>>(
    cfg: &GptConfig,
    model: &GptStage,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    seed: u64,
    mut on_text: impl FnMut(&str) -> Result<(), E>,
) -> Result<(), E> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(candle_core::Error::from(ModelError::Input(format!(
            "--temperature must be a number ≥ 0 (0 samples greedily), got {temperature}"
        )))
        .into());
    }
    if cfg.vocab_size != 256 {
        return Err(candle_core::Error::from(ModelError::Input(format!(
            "sampling decodes bytes, but this model's vocabulary has {} ids (a tokenizer's): \
             sampling token models is not supported yet",
            cfg.vocab_size
        )))
        .into());
    }
    let block = cfg.block_size;
    let mut ctx: Vec<u32> = prompt.bytes().map(u32::from).collect();
    if ctx.is_empty() {
        ctx.push(u32::from(b'\n'));
    }
    let mut state = seed ^ 0x5eed;
    let mut utf8 = Utf8Pieces::default();
    for _ in 0..tokens {
        if ctx.len() > 2 * block {
            ctx.drain(..ctx.len() - block);
        }
        let window = &ctx[ctx.len().saturating_sub(block)..];
        let x = Tensor::from_vec(window.to_vec(), (1, window.len()), &Device::Cpu)?;
        let logits = Module::forward(model, &x)?;
        // f32 whatever the activations' dtype (bf16 logits at bf16 precision).
        let last = logits
            .get(window.len() - 1)?
            .to_dtype(candle_core::DType::F32)?;
        let next = if temperature <= 0.0 {
            last.argmax(D::Minus1)?.to_scalar::<u32>()?
        } else {
            let p = candle_core::Tensor::exp(
                &(&last / temperature)?
                    .broadcast_sub(&(&last / temperature)?.max_keepdim(D::Minus1)?)?,
            )?;
            let p = p.to_vec1::<f32>()?;
            let total: f32 = p.iter().sum();
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut r = ((state >> 11) as f64 / (1u64 << 53) as f64) as f32 * total;
            let mut pick = p.len() - 1;
            for (i, &pi) in p.iter().enumerate() {
                if r < pi {
                    pick = i;
                    break;
                }
                r -= pi;
            }
            pick as u32
        };
        ctx.push(next);
        let piece = utf8.push(next as u8);
        if !piece.is_empty() {
            on_text(&piece)?;
        }
    }
    let rest = utf8.finish();
    if !rest.is_empty() {
        on_text(&rest)?;
    }
    Ok(())
}

/// Decodes bytes arriving one at a time as [`String::from_utf8_lossy`] decodes them
/// all at once: a character is given out when its last byte arrives.
#[derive(Default)]
struct Utf8Pieces {
    pending: Vec<u8>,
}

impl Utf8Pieces {
    /// The text that `byte` completes (empty inside a multi-byte character).
    fn push(&mut self, byte: u8) -> String {
        self.pending.push(byte);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An invalid sequence: one replacement character, then go on.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + n);
                        }
                        // An unfinished character: wait for its next byte.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an unfinished character becomes U+FFFD).
    fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_given_out_piece_by_piece_is_the_lossy_decoding_of_all_bytes() {
        let cases: [&[u8]; 5] = [
            b"plain ascii",
            "Grüße, 世界 🙂".as_bytes(),
            b"bad \xff byte and a cut \xe4\xb8",
            b"\xf0\x9f\x99 then text \xc3",
            b"\xed\xa0\x80 surrogate, \xc3\x28 bad continuation",
        ];
        for bytes in cases {
            let mut d = Utf8Pieces::default();
            let mut text = String::new();
            for &b in bytes {
                text.push_str(&d.push(b));
            }
            text.push_str(&d.finish());
            assert_eq!(text, String::from_utf8_lossy(bytes), "{bytes:?}");
        }
        // A character comes out with its last byte, not before.
        let mut d = Utf8Pieces::default();
        assert_eq!(d.push(0xe4), "");
        assert_eq!(d.push(0xb8), "");
        assert_eq!(d.push(0x96), "世");
        assert_eq!(d.push(b'a'), "a");
    }
}
