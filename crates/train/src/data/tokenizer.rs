//! Text through a Hugging Face tokenizer (`tokenizer.json`, e.g. GPT-2's BPE), tokenized
//! once and cached as a token file.
//!
//! The cache is `.switchyard-cache/<text name>-<key>.bin` in the text's directory, `key`
//! being a hash of the text's bytes and the tokenizer file's bytes: a changed text or
//! tokenizer gets a new file, an unchanged one is memory-mapped without tokenizing again.
//! The file is written whole to a temporary name and renamed, so an interrupted run never
//! leaves a partial cache. Its ids are `u16` when the tokenizer's vocabulary fits, else
//! `u32` (the file name ends in `.u32.bin`). Where the directory cannot be written, the
//! tokens stay in memory for the run (with a note).

use crate::error::{err, Context, TrainError};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Corpus, Fnv, TokenFile, TokenSource, TokenWidth};

/// Token ids in memory.
struct Ids(Vec<u32>);

impl TokenSource for Ids {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn read(&self, start: usize, out: &mut [u32]) {
        out.copy_from_slice(&self.0[start..start + out.len()]);
    }
}

/// Loads a tokenizer, naming the file when it is missing or not a tokenizer.
pub fn load(path: &Path) -> Result<tokenizers::Tokenizer, TrainError> {
    let shown = path.display();
    if !path.is_file() {
        return Err(err!(
            Data,
            "--tokenizer {shown}: no such file (give a Hugging Face tokenizer.json)"
        ));
    }
    tokenizers::Tokenizer::from_file(path).map_err(|e| {
        err!(
            Data,
            "--tokenizer {shown} is not a Hugging Face tokenizer.json: {e}"
        )
    })
}

/// The cache file of `text` (from `data`) tokenized by the tokenizer file `tok_bytes`.
pub fn cache_path(data: &Path, text: &[u8], tok_bytes: &[u8], width: TokenWidth) -> PathBuf {
    let mut h = Fnv::default();
    h.write(&(text.len() as u64).to_le_bytes());
    h.write(text);
    h.write(tok_bytes);
    let stem = data
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    let ext = match width {
        TokenWidth::U16 => "bin",
        TokenWidth::U32 => "u32.bin",
    };
    data.parent()
        .unwrap_or(Path::new("."))
        .join(".switchyard-cache")
        .join(format!("{stem}-{:016x}.{ext}", h.0))
}

/// `text` (read from `data`) tokenized by `tokenizer`, from the cache when it is there;
/// the last `val_fraction` of the tokens is the validation split.
pub fn tokenize_cached(
    data: &Path,
    text: &[u8],
    tokenizer: &Path,
    val_fraction: f64,
) -> Result<Corpus, TrainError> {
    let tok = load(tokenizer)?;
    let tok_bytes = std::fs::read(tokenizer)
        .map_err(|e| err!(Data, "cannot read --tokenizer {}: {e}", tokenizer.display()))?;
    let vocab = tok.get_vocab_size(true);
    let width = TokenWidth::for_vocab(vocab);
    let cache = cache_path(data, text, &tok_bytes, width);
    let name = format!(
        "{} (tokenized with {})",
        data.display(),
        tokenizer.display()
    );
    let source: Arc<dyn TokenSource> = match cache.is_file() {
        true => Arc::new(TokenFile::open(&cache, width)?),
        false => {
            let ids = encode(&tok, data, text)?;
            match write_cache(&cache, &ids, width) {
                Ok(()) => Arc::new(TokenFile::open(&cache, width)?),
                Err(e) => {
                    eprintln!(
                        "note: cannot cache the tokens in {} ({e}); they stay in memory for this run",
                        cache.display()
                    );
                    Arc::new(Ids(ids))
                }
            }
        }
    };
    if source.is_empty() {
        return Err(err!(
            Data,
            "--data {} has no tokens under --tokenizer {}",
            data.display(),
            tokenizer.display()
        ));
    }
    Ok(Corpus::split_by_fraction(
        name,
        source,
        val_fraction,
        Some(vocab),
    ))
}

fn encode(tok: &tokenizers::Tokenizer, data: &Path, text: &[u8]) -> Result<Vec<u32>, TrainError> {
    let text = std::str::from_utf8(text).map_err(|e| {
        err!(
            Data,
            "--data {} is not UTF-8 text (at byte {}): a tokenizer reads text",
            data.display(),
            e.valid_up_to()
        )
    })?;
    let enc = tok
        .encode(text, false)
        .map_err(|e| err!(Data, "cannot tokenize --data {}: {e}", data.display()))?;
    Ok(enc.get_ids().to_vec())
}

fn write_cache(path: &Path, ids: &[u32], width: TokenWidth) -> crate::error::Result<()> {
    let dir = path.parent().expect("a cache file has a directory");
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let bytes: Vec<u8> = match width {
        TokenWidth::U16 => ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect(),
        TokenWidth::U32 => ids.iter().flat_map(|&t| t.to_le_bytes()).collect(),
    };
    crate::checkpoint::write_atomic(path, &bytes)
}
