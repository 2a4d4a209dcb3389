//! Token sources: a sequence of token ids readable at any offset, the bytes of a text,
//! a window of another source, and the fingerprint that identifies their content.

use std::ops::Range;
use std::sync::Arc;

/// A sequence of token ids, readable at any offset. Implement it to bring a data format
/// of your own; wrap it in a [`Corpus`](super::Corpus) with [`Corpus::new`](super::Corpus::new).
pub trait TokenSource: Send + Sync {
    /// Tokens in all.
    fn len(&self) -> usize;

    /// Copies tokens `[start, start + out.len())` into `out`; the range is within `len`.
    fn read(&self, start: usize, out: &mut [u32]);

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Identifies the content (resuming checks it). By default FNV-1a 64 over each
    /// token's four little-endian bytes.
    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        for_chunks(self, 0..self.len(), |c| {
            for &t in c {
                h.write(&t.to_le_bytes());
            }
        });
        h.0
    }
}

/// Calls `f` on the tokens of `range` in chunks of at most 1 Mi tokens.
pub(super) fn for_chunks(
    src: &(impl TokenSource + ?Sized),
    range: Range<usize>,
    mut f: impl FnMut(&[u32]),
) {
    let mut buf = vec![0u32; range.len().min(1 << 20)];
    let mut at = range.start;
    while at < range.end {
        let n = buf.len().min(range.end - at);
        src.read(at, &mut buf[..n]);
        f(&buf[..n]);
        at += n;
    }
}

/// FNV-1a 64, streaming.
pub(super) struct Fnv(pub(super) u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub(super) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The bytes of a text: token `i` is byte `i` (vocabulary 256).
pub struct Bytes(pub(super) Arc<[u8]>);

impl TokenSource for Bytes {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, start: usize, out: &mut [u32]) {
        let n = out.len();
        for (o, &b) in out.iter_mut().zip(&self.0[start..start + n]) {
            *o = u32::from(b);
        }
    }
    /// FNV-1a 64 of the bytes (what checkpoints recorded before token files existed).
    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        h.write(&self.0);
        h.0
    }
}

/// Tokens `[start, start + len)` of another source.
pub(super) struct Slice {
    pub(super) src: Arc<dyn TokenSource>,
    pub(super) start: usize,
    pub(super) len: usize,
}

impl TokenSource for Slice {
    fn len(&self) -> usize {
        self.len
    }
    fn read(&self, start: usize, out: &mut [u32]) {
        self.src.read(self.start + start, out)
    }
}
