//! Byte-level text data: the bundled corpus or any file, deterministic batches, and the
//! evaluation windows of `switchyard eval`.
//!
//! Tokens are bytes (vocabulary 256). A training batch for step `s` is `B` windows of
//! `T + 1` bytes, inputs the first `T` and targets the last `T`, whose start offsets
//! depend on the [`Order`]: drawn from a generator keyed by `(seed, s, sequence index)`
//! ([`Order::Shuffled`], the default), or the text's consecutive windows in order
//! ([`Order::Sequential`], `--no-shuffle`). Either way the same settings give the same
//! batches in every layout, and resuming at step `s` needs no other data state.

use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Result, Tensor};

/// The bundled corpus: Genesis to Ruth, King James Version (public domain);
/// see `crates/train/data/README.md`.
pub const BUNDLED: &[u8] = include_bytes!("../data/kjv-genesis-ruth.txt");

/// Which windows of the text a run trains on, and in what order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Window `i` of step `s` starts at an offset drawn from a generator keyed by
    /// `(seed, s, i)`: any byte of the text may start a window, windows may overlap.
    Shuffled { seed: u64 },
    /// The tiling of [`Corpus::eval_windows`], read in order and wrapping at the end:
    /// window `k = s·batch + i` (`i` the row of step `s`'s global batch of `batch`
    /// sequences) starts at byte `(k mod n)·(T + 1)`, where `n = ⌊len / (T + 1)⌋` is the
    /// number of whole windows. This is what a plain data loader without shuffling
    /// gives, so a run can be replayed step for step by another framework.
    Sequential { batch: usize },
}

/// A text as bytes.
#[derive(Clone)]
pub struct Corpus {
    pub name: String,
    bytes: Arc<Vec<u8>>,
}

impl Corpus {
    pub fn bundled() -> Corpus {
        Corpus {
            name: "bundled (KJV Genesis-Ruth)".into(),
            bytes: Arc::new(BUNDLED.to_vec()),
        }
    }

    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Corpus {
        Corpus {
            name: name.into(),
            bytes: Arc::new(bytes),
        }
    }

    /// Reads a regular file whole. A device, pipe or directory (`/dev/zero` would be
    /// read until memory runs out) and a file larger than the memory available now
    /// are refused, naming the path.
    pub fn from_file(path: &Path) -> std::result::Result<Corpus, String> {
        Corpus::from_file_within(path, crate::memory_info().available)
    }

    /// [`Corpus::from_file`] with the memory bound given (`None`: no bound).
    pub fn from_file_within(
        path: &Path,
        available: Option<u64>,
    ) -> std::result::Result<Corpus, String> {
        let shown = path.display();
        let meta =
            std::fs::metadata(path).map_err(|e| format!("cannot read --data {shown}: {e}"))?;
        if !meta.is_file() {
            return Err(format!(
                "--data {shown} is not a regular file: give a text file (a device, pipe or \
                 directory cannot be read as a corpus)"
            ));
        }
        if let Some(available) = available {
            if meta.len() > available {
                return Err(format!(
                    "--data {shown} has {} bytes, more than the {available} bytes of memory \
                     available: the corpus is read into memory whole; use a smaller file",
                    meta.len()
                ));
            }
        }
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read --data {shown}: {e}"))?;
        Ok(Corpus::from_bytes(shown.to_string(), bytes))
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Refuses a corpus too short for one window of `seq_len + 1` bytes.
    pub fn check(&self, seq_len: usize) -> std::result::Result<(), String> {
        if self.len() < seq_len + 1 {
            return Err(format!(
                "the data {} has {} bytes, fewer than one window of --seq-len + 1 = {}",
                self.name,
                self.len(),
                seq_len + 1
            ));
        }
        Ok(())
    }

    /// The start of sequence `i` of step `step` (see [`Order`]). The text holds at least
    /// one window ([`Corpus::check`]).
    fn offset(&self, order: Order, step: usize, i: usize, seq_len: usize) -> usize {
        match order {
            Order::Shuffled { seed } => {
                let span = (self.len() - seq_len) as u64;
                let h = mix(mix(mix(seed) ^ step as u64) ^ i as u64);
                (h % span) as usize
            }
            Order::Sequential { batch } => {
                let w = seq_len + 1;
                let n = (self.len() / w) as u128;
                // In u128: step · batch may exceed usize on a long run of a large batch.
                let k = step as u128 * batch as u128 + i as u128;
                (k % n) as usize * w
            }
        }
    }

    /// Sequences `rows` of the global batch of step `step`: inputs and targets `[n, T]`
    /// as u32, targets shifted by one byte.
    pub fn batch(
        &self,
        order: Order,
        step: usize,
        rows: std::ops::Range<usize>,
        seq_len: usize,
    ) -> Result<(Tensor, Tensor)> {
        let n = rows.len();
        let mut x = Vec::with_capacity(n * seq_len);
        let mut y = Vec::with_capacity(n * seq_len);
        for i in rows {
            let o = self.offset(order, step, i, seq_len);
            let w = &self.bytes[o..o + seq_len + 1];
            x.extend(w[..seq_len].iter().map(|&b| b as u32));
            y.extend(w[1..].iter().map(|&b| b as u32));
        }
        Ok((
            Tensor::from_vec(x, (n, seq_len), &Device::Cpu)?,
            Tensor::from_vec(y, (n, seq_len), &Device::Cpu)?,
        ))
    }

    /// The evaluation windows: consecutive, non-overlapping windows of `seq_len + 1`
    /// bytes from byte 0; window `k` is bytes `[k(L+1), (k+1)(L+1))`, its inputs the first
    /// `L` bytes and its targets the last `L`. At most `max_windows` (all if `None`).
    pub fn eval_windows(
        &self,
        seq_len: usize,
        max_windows: Option<usize>,
    ) -> Vec<(Vec<u32>, Vec<u32>)> {
        let w = seq_len + 1;
        let n = (self.len() / w).min(max_windows.unwrap_or(usize::MAX));
        (0..n)
            .map(|k| {
                let b = &self.bytes[k * w..(k + 1) * w];
                (
                    b[..seq_len].iter().map(|&x| x as u32).collect(),
                    b[1..].iter().map(|&x| x as u32).collect(),
                )
            })
            .collect()
    }
}

/// SplitMix64's mixer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_deterministic_and_shifted() {
        let c = Corpus::bundled();
        assert!(c.len() <= 1 << 20);
        let order = Order::Shuffled { seed: 5 };
        let (x1, y1) = c.batch(order, 3, 0..4, 16).unwrap();
        let (x2, _) = c.batch(order, 3, 0..4, 16).unwrap();
        assert_eq!(x1.to_vec2::<u32>().unwrap(), x2.to_vec2::<u32>().unwrap());
        let (x3, _) = c.batch(order, 4, 0..4, 16).unwrap();
        assert_ne!(x1.to_vec2::<u32>().unwrap(), x3.to_vec2::<u32>().unwrap());
        let (x, y) = (x1.to_vec2::<u32>().unwrap(), y1.to_vec2::<u32>().unwrap());
        assert_eq!(x[0][1..], y[0][..15]);
        // A slice of the global batch is the same rows.
        let (xs, _) = c.batch(order, 3, 2..4, 16).unwrap();
        assert_eq!(xs.to_vec2::<u32>().unwrap(), x[2..4]);
    }

    #[test]
    fn sequential_batches_read_the_eval_windows_in_order_and_wrap() {
        // 23 bytes hold 4 whole windows of 4 + 1 bytes (the last 3 bytes are never read).
        let c = Corpus::from_bytes("t", (0..23u8).collect());
        let windows = c.eval_windows(4, None);
        assert_eq!(windows.len(), 4);
        let order = Order::Sequential { batch: 3 };
        let rows = |step: usize, rows: std::ops::Range<usize>| {
            let (x, y) = c.batch(order, step, rows, 4).unwrap();
            let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
            x.into_iter().zip(y).collect::<Vec<_>>()
        };
        // Window k = step · 3 + row, modulo 4.
        for step in 0..5 {
            let got = rows(step, 0..3);
            for (i, w) in got.iter().enumerate() {
                assert_eq!(w, &windows[(step * 3 + i) % 4], "step {step} row {i}");
            }
        }
        assert_eq!(rows(1, 0..3)[0].0, vec![15, 16, 17, 18]);
        assert_eq!(rows(1, 0..3)[1], (vec![0, 1, 2, 3], vec![1, 2, 3, 4]));
        // A replica's rows of the global batch are those rows, whatever the split.
        assert_eq!(rows(2, 1..3), rows(2, 0..3)[1..]);
        // The order needs no state: a far step is computed directly, without overflow.
        let far = Order::Sequential { batch: usize::MAX };
        let (x, _) = c.batch(far, usize::MAX, 0..1, 4).unwrap();
        let k = (usize::MAX as u128 * usize::MAX as u128) % 4;
        assert_eq!(x.to_vec2::<u32>().unwrap()[0][0], k as u32 * 5);
        // A text of exactly one window repeats it.
        let one = Corpus::from_bytes("one", (0..5u8).collect());
        let (x, _) = one.batch(order, 7, 0..3, 4).unwrap();
        assert_eq!(x.to_vec2::<u32>().unwrap(), vec![vec![0, 1, 2, 3]; 3]);
    }

    #[test]
    fn only_regular_files_that_fit_in_memory_are_read() {
        let e = Corpus::from_file(Path::new("/dev/zero")).err().unwrap();
        assert!(e.contains("--data /dev/zero is not a regular file"), "{e}");
        let dir = std::env::temp_dir();
        let e = Corpus::from_file(&dir).err().unwrap();
        assert!(e.contains("is not a regular file"), "{e}");
        let path = dir.join(format!("switchyard-data-{}.txt", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        let e = Corpus::from_file_within(&path, Some(9)).err().unwrap();
        assert!(
            e.contains("has 10 bytes, more than the 9 bytes of memory available"),
            "{e}"
        );
        assert_eq!(Corpus::from_file_within(&path, Some(10)).unwrap().len(), 10);
        assert_eq!(Corpus::from_file(&path).unwrap().len(), 10);
        std::fs::remove_file(&path).unwrap();
        let e = Corpus::from_file(Path::new("/nonexistent/x.txt"))
            .err()
            .unwrap();
        assert!(e.contains("cannot read --data /nonexistent/x.txt"), "{e}");
    }

    #[test]
    fn eval_windows_tile_the_text_from_byte_zero() {
        let c = Corpus::from_bytes("t", (0..20u8).collect());
        let w = c.eval_windows(4, None);
        assert_eq!(w.len(), 4);
        assert_eq!(w[0], (vec![0, 1, 2, 3], vec![1, 2, 3, 4]));
        assert_eq!(w[1], (vec![5, 6, 7, 8], vec![6, 7, 8, 9]));
        assert_eq!(c.eval_windows(4, Some(2)).len(), 2);
        assert!(c.check(19).is_ok() && c.check(20).is_err());
    }
}
