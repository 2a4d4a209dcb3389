//! Token files in nanoGPT's format: a flat little-endian array of token ids, `u16` (what
//! nanoGPT's `prepare.py` writes with `np.uint16`) or `u32` for vocabularies over
//! 65,536, without a header. Memory-mapped, never read into memory whole.

use crate::error::{err, TrainError};
use std::path::Path;

use memmap2::Mmap;

use super::TokenSource;

/// The width of a token file's ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    /// 2 bytes (nanoGPT's `np.uint16`): vocabularies up to 65,536.
    #[default]
    U16,
    /// 4 bytes: any vocabulary.
    U32,
}

impl TokenWidth {
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }

    /// The narrowest width that holds ids `0..vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> TokenWidth {
        match vocab_size <= 1 << 16 {
            true => TokenWidth::U16,
            false => TokenWidth::U32,
        }
    }
}

impl std::str::FromStr for TokenWidth {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self, TrainError> {
        match s {
            "u16" => Ok(TokenWidth::U16),
            "u32" => Ok(TokenWidth::U32),
            _ => Err(err!(Data, "a token width is u16 or u32, not {s}")),
        }
    }
}

/// A memory-mapped token file.
pub struct TokenFile {
    map: Mmap,
    width: TokenWidth,
}

impl TokenFile {
    /// Maps `path`, refusing what is not a regular file, an empty file, and a length that
    /// is not a whole number of ids, naming the path.
    ///
    /// The file must not change while it is mapped (truncating it would end the process
    /// with `SIGBUS`): nanoGPT's `train.bin` is written once and then only read.
    pub fn open(path: &Path, width: TokenWidth) -> Result<TokenFile, TrainError> {
        let shown = path.display();
        let file =
            std::fs::File::open(path).map_err(|e| err!(Data, "cannot read --data {shown}: {e}"))?;
        let meta = file
            .metadata()
            .map_err(|e| err!(Data, "cannot read --data {shown}: {e}"))?;
        if !meta.is_file() {
            return Err(err!(
                Data,
                "--data {shown} is not a regular file: give a token file (.bin) or a text file"
            ));
        }
        if meta.len() == 0 {
            return Err(err!(Data, "the token file {shown} is empty"));
        }
        let w = width.bytes() as u64;
        if !meta.len().is_multiple_of(w) {
            let name = match width {
                TokenWidth::U16 => "u16",
                TokenWidth::U32 => "u32",
            };
            return Err(err!(
                Data,
                "the token file {shown} has {} bytes, not a whole number of {w}-byte {name} \
                 token ids: is it a token file (a flat little-endian array, as nanoGPT's \
                 prepare.py writes), and of that width (--token-width)?",
                meta.len()
            ));
        }
        // SAFETY: the map is read-only and private to this process; its contents are
        // only read as bytes (never as references to typed values), so any bytes are
        // valid. Another process truncating the file while it is mapped would fault
        // (SIGBUS) rather than read freed memory; the docs ask for a file that is not
        // changed during the run.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err!(Data, "cannot map {shown}: {e}"))?;
        Ok(TokenFile { map, width })
    }
}

impl TokenSource for TokenFile {
    fn len(&self) -> usize {
        self.map.len() / self.width.bytes()
    }

    fn read(&self, start: usize, out: &mut [u32]) {
        let w = self.width.bytes();
        let bytes = &self.map[start * w..(start + out.len()) * w];
        match self.width {
            TokenWidth::U16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u32::from(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            TokenWidth::U32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }

    /// FNV-1a 64 of the file's bytes.
    fn fingerprint(&self) -> u64 {
        let mut h = super::Fnv::default();
        h.write(&self.map);
        h.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("switchyard-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn u16_and_u32_files_read_little_endian_ids() {
        let ids: Vec<u16> = vec![0, 1, 300, 65535, 7];
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        let f = TokenFile::open(&temp("a.bin", &bytes), TokenWidth::U16).unwrap();
        assert_eq!(f.len(), 5);
        let mut out = [0u32; 3];
        f.read(2, &mut out);
        assert_eq!(out, [300, 65535, 7]);
        let f = TokenFile::open(&temp("b.bin", &bytes[..8]), TokenWidth::U32).unwrap();
        assert_eq!(f.len(), 2);
        let mut out = [0u32; 2];
        f.read(0, &mut out);
        assert_eq!(out, [1 << 16, 65535 << 16 | 300]);
    }

    #[test]
    fn bad_files_are_refused_naming_the_path() {
        let e = TokenFile::open(&temp("odd.bin", &[1, 2, 3]), TokenWidth::U16)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("odd.bin has 3 bytes, not a whole number of 2-byte u16"),
            "{e}"
        );
        let e = TokenFile::open(&temp("six.bin", &[0; 6]), TokenWidth::U32)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a whole number of 4-byte u32"), "{e}");
        let e = TokenFile::open(&temp("empty.bin", &[]), TokenWidth::U16)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("empty.bin is empty"), "{e}");
        let e = TokenFile::open(Path::new("/nonexistent/train.bin"), TokenWidth::U16)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("cannot read --data /nonexistent/train.bin"),
            "{e}"
        );
        assert_eq!(TokenWidth::for_vocab(65536), TokenWidth::U16);
        assert_eq!(TokenWidth::for_vocab(65537), TokenWidth::U32);
    }
}
