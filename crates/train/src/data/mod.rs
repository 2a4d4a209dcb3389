//! Training data: token sources, the [`Dataset`] trait with its deterministic sampler, and
//! the built-in datasets.
//!
//! * [`TokenSource`]: a sequence of token ids that can be read at any offset. Built in:
//!   the bytes of a text ([`Bytes`], vocabulary 256), and a memory-mapped token file in
//!   nanoGPT's format ([`TokenFile`]: a flat little-endian array of `u16`, or `u32`, ids).
//! * [`Dataset`]: a training split and an optional validation split (never trained on),
//!   with the vocabulary they need. Its provided methods are the sampler: the batch of
//!   step `s` is the same in every `dp × pp × tp` layout, and resuming at step `s` needs
//!   no data state besides `s`.
//! * [`Corpus`]: the built-in [`Dataset`]; [`open`] builds it from the command line's
//!   `--data`, `--tokenizer` and `--val-fraction` (text → bytes, `*.bin` → token file,
//!   text with a tokenizer → a cached token file, see [`tokenizer`]).
//!
//! ## Sampling
//!
//! A step's global batch is `batch` windows of `seq_len + 1` tokens; row `i` of step `s`
//! starts at
//!
//! * shuffled (the default): `h(seed, s, i) mod (len − seq_len)`, `h` a SplitMix64 hash;
//! * sequential (`shuffle = false`, `--no-shuffle`): window `k = s · batch + i` starts at
//!   `(k mod n) · (seq_len + 1)`, `n = ⌊len / (seq_len + 1)⌋` whole windows — consecutive
//!   windows from offset 0, in order, wrapping at the end.
//!
//! Inputs are a window's first `seq_len` tokens, targets its last `seq_len`. Each
//! data-parallel replica takes its rows `[r · batch/dp, (r + 1) · batch/dp)` and cuts them
//! into microbatches in order, so every layout sees the same tokens.
//!
//! Validation batch `b` is the sequential batch of step `b` over the validation split.

use crate::error::{err, TrainError};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Result, Tensor};

mod sampler;
mod source;
pub mod tokenizer;
mod tokens;

pub use sampler::Sampler;
use source::{for_chunks, Fnv, Slice};
pub use source::{Bytes, TokenSource};
pub use tokens::{TokenFile, TokenWidth};

/// The bundled corpus: Genesis to Ruth, King James Version (public domain);
/// see `crates/train/data/README.md`.
pub const BUNDLED: &[u8] = include_bytes!("../../data/kjv-genesis-ruth.txt");

/// One split of a [`Dataset`]: a source, what to call it in messages, and its largest
/// token id with the offset where it first occurs.
#[derive(Clone)]
pub struct Split {
    pub name: String,
    pub source: Arc<dyn TokenSource>,
    /// `(id, offset)` of the largest token id (first occurrence); `None` when empty.
    pub largest: Option<(u32, usize)>,
}

impl Split {
    /// Scans `source` once for its largest token id.
    pub fn new(name: impl Into<String>, source: Arc<dyn TokenSource>) -> Split {
        let mut largest: Option<(u32, usize)> = None;
        let mut at = 0;
        for_chunks(&*source, 0..source.len(), |c| {
            for (i, &t) in c.iter().enumerate() {
                if largest.is_none_or(|(m, _)| t > m) {
                    largest = Some((t, at + i));
                }
            }
            at += c.len();
        });
        Split {
            name: name.into(),
            source,
            largest,
        }
    }

    pub fn len(&self) -> usize {
        self.source.len()
    }

    pub fn is_empty(&self) -> bool {
        self.source.is_empty()
    }
}

/// What a run trains and validates on. The trainer reads it only through these methods;
/// the provided ones are the sampler (see the module docs), the same for every dataset.
pub trait Dataset: Send + Sync {
    /// Shown in messages and recorded in checkpoints.
    fn name(&self) -> &str;
    /// The training split.
    fn train(&self) -> &Split;
    /// The validation split, never trained on.
    fn validation(&self) -> Option<&Split>;
    /// The vocabulary the data comes with (a tokenizer's, bytes' 256), or else the
    /// smallest that covers every token id; a model's may be larger.
    fn vocab_size(&self) -> usize;
    /// Identifies the content: a resumed run must read the same data.
    fn fingerprint(&self) -> String;

    /// Rows `rows` of step `step`'s global batch of the training split: inputs and
    /// targets `[n, seq_len]` (u32).
    fn batch(&self, s: &Sampler, step: usize, rows: Range<usize>) -> Result<(Tensor, Tensor)> {
        s.tensors(&*self.train().source, step, rows)
    }

    /// Rows `rows` of validation batch `b` (sequential windows of the validation split).
    fn validation_batch(
        &self,
        s: &Sampler,
        b: usize,
        rows: Range<usize>,
    ) -> Option<Result<(Tensor, Tensor)>> {
        let s = Sampler {
            shuffle: false,
            ..*s
        };
        self.validation()
            .map(|v| s.tensors(&*v.source, b, rows.clone()))
    }

    /// Refuses data a model of `vocab_size` cannot read or that has no window of
    /// `seq_len + 1` tokens, naming the split and the offset of the offending token.
    fn check(&self, vocab_size: usize, seq_len: usize) -> std::result::Result<(), TrainError> {
        let splits = std::iter::once((self.train(), ""))
            .chain(self.validation().map(|v| (v, " (the validation split)")));
        for (split, what) in splits {
            if split.len() < seq_len + 1 {
                return Err(err!(
                    Data,
                    "the data {}{what} has {} tokens, fewer than one window of --seq-len + 1 = {}",
                    split.name,
                    split.len(),
                    seq_len + 1
                ));
            }
            if let Some((id, at)) = split.largest.filter(|(id, _)| *id as usize >= vocab_size) {
                return Err(err!(
                    Data,
                    "the data {}{what} has token id {id} at token offset {at}, but the \
                     vocabulary has {vocab_size} ids (0 to {}): pass --vocab-size {} or more, \
                     or check the file's token width",
                    split.name,
                    vocab_size - 1,
                    id as usize + 1
                ));
            }
        }
        Ok(())
    }

    /// The windows `switchyard eval` scores: consecutive, non-overlapping windows of
    /// `seq_len + 1` tokens from offset 0 of the validation split (of the training split
    /// when there is none); window `k` is tokens `[k(L+1), (k+1)(L+1))`, its inputs the
    /// first `L` and its targets the last `L`. At most `max_windows` (all if `None`).
    fn eval_windows(
        &self,
        seq_len: usize,
        max_windows: Option<usize>,
    ) -> Vec<(Vec<u32>, Vec<u32>)> {
        let split = self.validation().unwrap_or(self.train());
        let w = seq_len + 1;
        let n = (split.len() / w).min(max_windows.unwrap_or(usize::MAX));
        let mut buf = vec![0u32; w];
        (0..n)
            .map(|k| {
                split.source.read(k * w, &mut buf);
                (buf[..seq_len].to_vec(), buf[1..].to_vec())
            })
            .collect()
    }
}

/// The built-in [`Dataset`]: a training split and an optional validation split.
#[derive(Clone)]
pub struct Corpus {
    pub name: String,
    train: Split,
    validation: Option<Split>,
    vocab_size: usize,
    fingerprint: String,
}

impl Corpus {
    /// A dataset of `train` and an optional `validation` source. `vocab_size`: the
    /// vocabulary the data comes with; `None` takes the largest token id + 1.
    pub fn new(
        name: impl Into<String>,
        train: Split,
        validation: Option<Split>,
        vocab_size: Option<usize>,
    ) -> Corpus {
        let name = name.into();
        let largest = std::iter::once(&train)
            .chain(validation.as_ref())
            .filter_map(|s| s.largest)
            .map(|(id, _)| id as usize + 1)
            .max()
            .unwrap_or(1);
        let mut fp = format!("{:016x}", train.source.fingerprint());
        if let Some(v) = &validation {
            fp += &format!("+{:016x}", v.source.fingerprint());
        }
        Corpus {
            name,
            train,
            validation,
            vocab_size: vocab_size.unwrap_or(largest),
            fingerprint: fp,
        }
    }

    /// The bundled text, all of it for training.
    pub fn bundled() -> Corpus {
        Corpus::from_bytes("bundled (KJV Genesis-Ruth)", BUNDLED.to_vec())
    }

    /// A text as bytes, all of it for training.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Corpus {
        Corpus::text(name, bytes, 0.0)
    }

    /// A text as bytes (vocabulary 256); the last `val_fraction` of it is the validation
    /// split (none when 0).
    pub fn text(name: impl Into<String>, bytes: Vec<u8>, val_fraction: f64) -> Corpus {
        let name = name.into();
        let src: Arc<dyn TokenSource> = Arc::new(Bytes(bytes.into()));
        Corpus::split_by_fraction(name, src, val_fraction, Some(256))
    }

    /// `src` with its last `val_fraction` as the validation split.
    pub fn split_by_fraction(
        name: String,
        src: Arc<dyn TokenSource>,
        val_fraction: f64,
        vocab_size: Option<usize>,
    ) -> Corpus {
        let len = src.len();
        let n_val = ((len as f64) * val_fraction).round() as usize;
        if n_val == 0 {
            return Corpus::new(name.clone(), Split::new(name, src), None, vocab_size);
        }
        let cut = len - n_val.min(len);
        let pct = format!("{}%", val_fraction * 100.0);
        let train = Slice {
            src: src.clone(),
            start: 0,
            len: cut,
        };
        let val = Slice {
            src: src.clone(),
            start: cut,
            len: len - cut,
        };
        let mut c = Corpus::new(
            name.clone(),
            Split::new(format!("{name} (first {cut} tokens)"), Arc::new(train)),
            Some(Split::new(
                format!("{name} (last {pct}, tokens {cut}..{len})"),
                Arc::new(val),
            )),
            vocab_size,
        );
        // The whole source identifies the data; the split point is in the config.
        c.fingerprint = format!("{:016x}", src.fingerprint());
        c
    }

    /// Reads a regular text file whole. A device, pipe or directory (`/dev/zero` would be
    /// read until memory runs out) and a file larger than the memory available now
    /// are refused, naming the path.
    pub fn from_file(path: &Path) -> std::result::Result<Corpus, TrainError> {
        Corpus::from_file_within(path, crate::memory_info().available)
    }

    /// [`Corpus::from_file`] with the memory bound given (`None`: no bound).
    pub fn from_file_within(
        path: &Path,
        available: Option<u64>,
    ) -> std::result::Result<Corpus, TrainError> {
        let bytes = read_text(path, available)?;
        Ok(Corpus::from_bytes(path.display().to_string(), bytes))
    }

    /// Tokens in the training split.
    pub fn len(&self) -> usize {
        self.train.len()
    }

    pub fn is_empty(&self) -> bool {
        self.train.is_empty()
    }

    /// Refuses a corpus too short for one window of `seq_len + 1` tokens (in either
    /// split). [`Dataset::check`] also checks the vocabulary.
    pub fn check_len(&self, seq_len: usize) -> std::result::Result<(), TrainError> {
        self.check(usize::MAX, seq_len)
    }
}

impl Dataset for Corpus {
    fn name(&self) -> &str {
        &self.name
    }
    fn train(&self) -> &Split {
        &self.train
    }
    fn validation(&self) -> Option<&Split> {
        self.validation.as_ref()
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }
}

/// Reads a regular file whole, refusing what is not one or does not fit in `available`.
fn read_text(path: &Path, available: Option<u64>) -> std::result::Result<Vec<u8>, TrainError> {
    let shown = path.display();
    let meta =
        std::fs::metadata(path).map_err(|e| err!(Data, "cannot read --data {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(err!(
            Data,
            "--data {shown} is not a regular file: give a text file (a device, pipe or \
             directory cannot be read as a corpus)"
        ));
    }
    if let Some(available) = available {
        if meta.len() > available {
            return Err(err!(
                Data,
                "--data {shown} has {} bytes, more than the {available} bytes of memory \
                 available: the corpus is read into memory whole; use a smaller file",
                meta.len()
            ));
        }
    }
    std::fs::read(path).map_err(|e| err!(Data, "cannot read --data {shown}: {e}"))
}

/// Where the data comes from: the command line's data flags.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DataSpec {
    /// A text file, or a token file ending in `.bin`; `None`: the bundled text.
    pub data: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`: the text is tokenized with it (once; cached).
    pub tokenizer: Option<PathBuf>,
    /// The width of a token file's ids.
    pub width: TokenWidth,
    /// The held-out fraction at the end of the data (0: none; a `val.bin` beside a
    /// `train.bin` is the validation split instead).
    pub val_fraction: f64,
}

/// Opens the dataset `spec` describes (see the module docs). Every problem is an error
/// naming the file, before any work.
pub fn open(spec: &DataSpec) -> std::result::Result<Corpus, TrainError> {
    let f = spec.val_fraction;
    if !(f.is_finite() && (0.0..1.0).contains(&f)) {
        return Err(err!(
            Data,
            "--val-fraction must be at least 0 and below 1 (0: no validation split), got {f}"
        ));
    }
    let is_bin = |p: &Path| p.extension().is_some_and(|e| e == "bin");
    match (&spec.data, &spec.tokenizer) {
        (None, None) => {
            let c = Corpus::bundled();
            Ok(match f > 0.0 {
                true => Corpus::text(c.name, BUNDLED.to_vec(), f),
                false => c,
            })
        }
        (None, Some(t)) => Err(err!(
            Data,
            "--tokenizer {} needs --data: the text to tokenize",
            t.display()
        )),
        (Some(p), Some(t)) if is_bin(p) => Err(err!(
            Data,
            "--data {} is a token file (.bin) and needs no --tokenizer {}: give the text \
             with --tokenizer, or the token file alone",
            p.display(),
            t.display()
        )),
        (Some(p), Some(t)) => {
            let bytes = read_text(p, crate::memory_info().available)?;
            tokenizer::tokenize_cached(p, &bytes, t, f)
        }
        (Some(p), None) if is_bin(p) => open_token_file(p, spec.width, f),
        (Some(p), None) => {
            let bytes = read_text(p, crate::memory_info().available)?;
            Ok(Corpus::text(p.display().to_string(), bytes, f))
        }
    }
}

/// A token file, with a `val.bin` beside a `train.bin` as its validation split.
fn open_token_file(
    path: &Path,
    width: TokenWidth,
    val_fraction: f64,
) -> std::result::Result<Corpus, TrainError> {
    let train: Arc<dyn TokenSource> = Arc::new(TokenFile::open(path, width)?);
    let val_path = path.with_file_name("val.bin");
    let sibling = path.file_name().is_some_and(|n| n == "train.bin") && val_path.is_file();
    let name = path.display().to_string();
    if !sibling {
        return Ok(Corpus::split_by_fraction(name, train, val_fraction, None));
    }
    if val_fraction > 0.0 {
        return Err(err!(
            Data,
            "--val-fraction {val_fraction} with {} beside --data {}: the validation split is \
             val.bin; leave out --val-fraction",
            val_path.display(),
            path.display()
        ));
    }
    let val: Arc<dyn TokenSource> = Arc::new(TokenFile::open(&val_path, width)?);
    Ok(Corpus::new(
        name.clone(),
        Split::new(name, train),
        Some(Split::new(val_path.display().to_string(), val)),
        None,
    ))
}

#[cfg(test)]
mod tests {
    use super::sampler::mix;
    use super::*;

    fn sampler(seed: u64, seq_len: usize) -> Sampler {
        Sampler {
            seed,
            seq_len,
            batch: 4,
            shuffle: true,
        }
    }

    #[test]
    fn batches_are_deterministic_and_shifted() {
        let c = Corpus::bundled();
        assert!(c.len() <= 1 << 20);
        let s = sampler(5, 16);
        let (x1, y1) = c.batch(&s, 3, 0..4).unwrap();
        let (x2, _) = c.batch(&s, 3, 0..4).unwrap();
        assert_eq!(x1.to_vec2::<u32>().unwrap(), x2.to_vec2::<u32>().unwrap());
        let (x3, _) = c.batch(&s, 4, 0..4).unwrap();
        assert_ne!(x1.to_vec2::<u32>().unwrap(), x3.to_vec2::<u32>().unwrap());
        let (x, y) = (x1.to_vec2::<u32>().unwrap(), y1.to_vec2::<u32>().unwrap());
        assert_eq!(x[0][1..], y[0][..15]);
        // A slice of the global batch is the same rows.
        let (xs, _) = c.batch(&s, 3, 2..4).unwrap();
        assert_eq!(xs.to_vec2::<u32>().unwrap(), x[2..4]);
    }

    #[test]
    fn shuffled_offsets_are_those_of_the_byte_corpus_before_datasets() {
        // The formula of the byte-only corpus, kept bit for bit: runs on the bundled
        // text train on exactly the batches they did.
        let c = Corpus::bundled();
        let s = sampler(1337, 64);
        for (step, i) in [(0, 0), (3, 7), (999, 15)] {
            let span = (BUNDLED.len() - 64) as u64;
            let o = (mix(mix(mix(1337) ^ step as u64) ^ i as u64) % span) as usize;
            let (x, _) = s.rows(&*c.train().source, step, i..i + 1);
            let want: Vec<u32> = BUNDLED[o..o + 64].iter().map(|&b| u32::from(b)).collect();
            assert_eq!(x, want);
        }
        assert_eq!(
            c.fingerprint(),
            crate::checkpoint::fnv64(BUNDLED),
            "the fingerprint of a text is the FNV-1a of its bytes, as before"
        );
    }

    #[test]
    fn sequential_windows_tile_the_data_in_order_and_wrap() {
        let c = Corpus::from_bytes("t", (0..20u8).collect());
        let s = Sampler {
            seed: 9,
            seq_len: 4,
            batch: 3,
            shuffle: false,
        };
        // 4 whole windows of 5: steps 0 and 1 take windows 0 1 2, 3 0 1.
        let (x, y) = s.rows(&*c.train().source, 0, 0..3);
        assert_eq!(x, [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]);
        assert_eq!(y[..4], [1, 2, 3, 4]);
        let (x, _) = s.rows(&*c.train().source, 1, 0..3);
        assert_eq!(x, [15, 16, 17, 18, 0, 1, 2, 3, 5, 6, 7, 8]);
        // Replica 1 of 3 takes row 1 of the same windows.
        let (x, _) = s.rows(&*c.train().source, 1, 1..2);
        assert_eq!(x, [0, 1, 2, 3]);
    }

    #[test]
    fn only_regular_files_that_fit_in_memory_are_read() {
        let e = Corpus::from_file(Path::new("/dev/zero"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--data /dev/zero is not a regular file"), "{e}");
        let dir = std::env::temp_dir();
        let e = Corpus::from_file(&dir).err().unwrap().to_string();
        assert!(e.contains("is not a regular file"), "{e}");
        let path = dir.join(format!("switchyard-data-{}.txt", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        let e = Corpus::from_file_within(&path, Some(9))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("has 10 bytes, more than the 9 bytes of memory available"),
            "{e}"
        );
        assert_eq!(Corpus::from_file_within(&path, Some(10)).unwrap().len(), 10);
        assert_eq!(Corpus::from_file(&path).unwrap().len(), 10);
        std::fs::remove_file(&path).unwrap();
        let e = Corpus::from_file(Path::new("/nonexistent/x.txt"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot read --data /nonexistent/x.txt"), "{e}");
    }

    #[test]
    fn eval_windows_tile_the_validation_split_from_its_start() {
        let c = Corpus::from_bytes("t", (0..20u8).collect());
        let w = c.eval_windows(4, None);
        assert_eq!(w.len(), 4);
        assert_eq!(w[0], (vec![0, 1, 2, 3], vec![1, 2, 3, 4]));
        assert_eq!(w[1], (vec![5, 6, 7, 8], vec![6, 7, 8, 9]));
        assert_eq!(c.eval_windows(4, Some(2)).len(), 2);
        assert!(c.check_len(19).is_ok() && c.check_len(20).is_err());
        // With the last half held out, eval reads it and training never does.
        let c = Corpus::text("t", (0..20u8).collect(), 0.5);
        assert_eq!(c.train().len(), 10);
        assert_eq!(c.eval_windows(4, None)[0].0, [10, 11, 12, 13]);
        let s = Sampler {
            seed: 1,
            seq_len: 4,
            batch: 1,
            shuffle: true,
        };
        for step in 0..50 {
            let (x, y) = s.rows(&*c.train().source, step, 0..1);
            assert!(x.iter().chain(&y).all(|&t| t < 10), "{x:?}");
        }
    }

    #[test]
    fn token_ids_beyond_the_vocabulary_name_their_offset() {
        let c = Corpus::from_bytes("t", b"abcdez".to_vec());
        assert_eq!(c.vocab_size(), 256);
        let e = c.check(100, 2).unwrap_err().to_string();
        assert!(
            e.contains("the data t has token id 122 at token offset 5"),
            "{e}"
        );
        assert!(e.contains("pass --vocab-size 123 or more"), "{e}");
        c.check(123, 2).unwrap();
        let e = c.check(256, 6).unwrap_err().to_string();
        assert!(e.contains("has 6 tokens, fewer than one window"), "{e}");
    }
}
