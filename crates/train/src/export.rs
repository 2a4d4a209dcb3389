//! The file `switchyard export` writes: where it may go, how it is written, and the
//! checksum over its tensors that every reader verifies.
//!
//! ## Writing
//!
//! An export goes to a temporary file of a unique name in the directory of `--out`
//! (`.NAME.tmp-PID-N`, created only if no such file exists), is synced, and is then
//! renamed onto `--out`. No other file is ever touched: a failed export removes its
//! temporary file and leaves everything as it was. An existing `--out` is refused unless
//! the caller forces it; a directory as `--out` is always refused.
//!
//! ## The checksum
//!
//! The metadata key `checksum` holds `fnv1a64:` and 16 hex digits: FNV-1a 64 over, for
//! each tensor in byte order of its name, the bytes of `NAME`, `0x00`, the dtype as
//! safetensors writes it (`F32`), `0x00`, the dimensions in decimal joined by commas,
//! `0x00`, then the tensor's data bytes. It covers every tensor's name, dtype, shape and
//! values, so a flipped byte anywhere in the data is found before the model is used.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{err, fail, Context, Result};
use safetensors::View;

/// The metadata key of the checksum.
pub const CHECKSUM_KEY: &str = "checksum";
const CHECKSUM_PREFIX: &str = "fnv1a64:";

/// FNV-1a 64, fed in pieces.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The checksum of a set of named tensors, as the metadata holds it (see the module docs).
pub fn checksum<V: View>(tensors: &[(&str, V)]) -> String {
    let mut order: Vec<&(&str, V)> = tensors.iter().collect();
    order.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut h = Fnv::new();
    for (name, t) in order {
        let shape: Vec<String> = t.shape().iter().map(|d| d.to_string()).collect();
        h.update(format!("{name}\0{}\0{}\0", t.dtype(), shape.join(",")).as_bytes());
        h.update(&t.data());
    }
    format!("{CHECKSUM_PREFIX}{:016x}", h.0)
}

/// What a loaded file's checksum says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// Merged from a checkpoint, whose files the manifest's hashes checked.
    Checkpoint,
    /// A file whose `checksum` metadata matches its tensors.
    Checksum,
    /// A file without a checksum (not written by `switchyard export`, or by an older
    /// version): its tensors could not be verified.
    Unverified,
}

/// Checks the `checksum` metadata of the safetensors file `bytes` read from `path`.
pub fn verify(path: &Path, bytes: &[u8]) -> Result<Integrity> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
        err!(
            Weights,
            "{} is not a readable safetensors file: {e}",
            path.display()
        )
    })?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| {
        err!(
            Weights,
            "{} is not a readable safetensors file: {e}",
            path.display()
        )
    })?;
    let Some(want) = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get(CHECKSUM_KEY).cloned())
    else {
        return Ok(Integrity::Unverified);
    };
    let tensors = st.tensors();
    let views: Vec<(&str, &safetensors::tensor::TensorView)> =
        tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let got = checksum(&views);
    if got != want {
        fail!(
            Weights,
            "{} is damaged: its tensors' checksum is {got}, but the file records {want}; \
             export it again from its checkpoint",
            path.display()
        );
    }
    Ok(Integrity::Checksum)
}

/// What an export writes at `--out`: one file, or a directory of files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    File,
    Dir,
}

/// Checks, before any work, that an export may be written to `out`: a directory for a
/// file or a file for a directory is refused, an existing `out` unless `force`; its
/// parent directory must exist, and `out` must not be inside `source` (the checkpoint
/// or file being exported).
pub fn check_destination(out: &Path, force: bool, source: Option<&Path>, dest: Dest) -> Result<()> {
    match dest {
        Dest::File if out.is_dir() => fail!(
            Weights,
            "--out {} is a directory: give the path of a file, such as {}",
            out.display(),
            out.join("model.safetensors").display()
        ),
        Dest::Dir if out.is_file() => fail!(
            Weights,
            "--out {} is a file: this format is a directory",
            out.display()
        ),
        _ => {}
    }
    if out.exists() && !force {
        fail!(
            Weights,
            "--out {} already exists: pass --force to replace it",
            out.display()
        );
    }
    let name = file_name(out, dest)?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = parent.canonicalize().with_context(|| {
        format!(
            "the directory of --out {} cannot be used ({})",
            out.display(),
            parent.display()
        )
    })?;
    if let Some(source) = source {
        let source = source
            .canonicalize()
            .with_context(|| format!("cannot read {}", source.display()))?;
        let target = parent.join(name);
        if target.starts_with(&source) {
            fail!(
                Weights,
                "--out {} is inside {}, the checkpoint being exported: write the export elsewhere",
                out.display(),
                source.display()
            );
        }
    }
    Ok(())
}

fn file_name(out: &Path, dest: Dest) -> Result<String> {
    let what = match dest {
        Dest::File => "file",
        Dest::Dir => "directory",
    };
    Ok(out
        .file_name()
        .ok_or_else(|| err!(Weights, "{} does not name a {what}", out.display()))?
        .to_string_lossy()
        .into_owned())
}

/// Creates `.NAME.WHAT-PID-N` next to `out` with `create` (which must fail with
/// `AlreadyExists` on an existing path: `create_new` for a file, `create_dir` for a
/// directory), for the first `N` that is free: never a path something else named.
fn create_sibling<T>(
    out: &Path,
    dest: Dest,
    what: &str,
    create: impl Fn(&Path) -> std::io::Result<T>,
) -> Result<(PathBuf, T)> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let name = file_name(out, dest)?;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let p = out.with_file_name(format!(".{name}.{what}-{}-{n}", std::process::id()));
        match create(&p) {
            Ok(t) => return Ok((p, t)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", p.display())),
        }
    }
}

/// Writes a directory of `files` (name, bytes) at `out`: into a fresh directory beside it
/// (`.NAME.tmp-PID-N`), each file synced, then renamed onto `out`. An existing `out` is
/// refused unless `force`; with `force` it is moved aside first, put back if the new one
/// cannot take its place, and removed only once the new one is in place. A file at `out`
/// is always refused.
pub fn write_dir(out: &Path, files: &[(&str, &[u8])], force: bool) -> Result<()> {
    check_destination(out, force, None, Dest::Dir)?;
    let (staging, ()) = create_sibling(out, Dest::Dir, "tmp", |p| fs::create_dir(p))?;
    let written = (|| -> Result<()> {
        for (file, bytes) in files {
            let p = staging.join(file);
            let mut f =
                fs::File::create(&p).with_context(|| format!("cannot create {}", p.display()))?;
            f.write_all(bytes)
                .and_then(|_| f.sync_all())
                .with_context(|| format!("cannot write {}", p.display()))?;
        }
        let rename = || {
            fs::rename(&staging, out).with_context(|| {
                format!("cannot rename {} to {}", staging.display(), out.display())
            })
        };
        if !out.exists() {
            return rename();
        }
        // An empty directory of a fresh name, which the rename replaces.
        let (old, ()) = create_sibling(out, Dest::Dir, "old", |p| fs::create_dir(p))?;
        fs::rename(out, &old).with_context(|| format!("cannot move {} aside", out.display()))?;
        if let Err(e) = rename() {
            // Put the old directory back: nothing is lost.
            let _ = fs::rename(&old, out);
            return Err(e);
        }
        let _ = fs::remove_dir_all(&old);
        Ok(())
    })();
    if written.is_err() {
        let _ = fs::remove_dir_all(&staging);
    }
    written
}

/// Writes `bytes` to `out` through a unique temporary file in the same directory,
/// synced, then renamed (see the module docs). Refuses an existing `out` unless `force`.
pub fn write_file(out: &Path, bytes: &[u8], force: bool) -> Result<()> {
    check_destination(out, force, None, Dest::File)?;
    let (tmp, mut f) = create_temp(out)?;
    let written = (|| -> Result<()> {
        f.write_all(bytes)
            .and_then(|_| f.sync_all())
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        drop(f);
        // Checked again just before the rename, so that an --out created meanwhile is
        // not replaced without --force.
        check_destination(out, force, None, Dest::File)?;
        fs::rename(&tmp, out)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    if let Some(dir) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        // Best effort: persists the rename on file systems that need it.
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Creates `.NAME.tmp-PID-N` next to `out`, for the first `N` whose file does not exist:
/// never a file that something else named (such as `NAME.tmp`).
pub(crate) fn create_temp(out: &Path) -> Result<(PathBuf, fs::File)> {
    create_sibling(out, Dest::File, "tmp", |p| {
        fs::OpenOptions::new().write(true).create_new(true).open(p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("switchyard-export-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn an_export_never_touches_a_file_named_like_its_old_temporary() {
        let dir = scratch("notes");
        fs::write(dir.join("notes.tmp"), b"my notes").unwrap();
        write_file(&dir.join("notes.safetensors"), b"weights", false).unwrap();
        assert_eq!(fs::read(dir.join("notes.tmp")).unwrap(), b"my notes");
        assert_eq!(fs::read(dir.join("notes.safetensors")).unwrap(), b"weights");
        assert_eq!(listing(&dir), ["notes.safetensors", "notes.tmp"]);
    }

    #[test]
    fn an_existing_out_is_replaced_only_when_forced() {
        let dir = scratch("force");
        let out = dir.join("m.safetensors");
        fs::write(&out, b"old").unwrap();
        let e = write_file(&out, b"new", false).unwrap_err().to_string();
        assert!(e.contains("already exists: pass --force"), "{e}");
        assert_eq!(fs::read(&out).unwrap(), b"old");
        write_file(&out, b"new", true).unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"new");
        assert_eq!(listing(&dir), ["m.safetensors"]);
    }

    #[test]
    fn a_directory_as_out_is_refused_and_leaves_nothing_behind() {
        let dir = scratch("dir");
        let out = dir.join("model");
        fs::create_dir(&out).unwrap();
        for force in [false, true] {
            let e = write_file(&out, b"w", force).unwrap_err().to_string();
            assert!(e.contains("is a directory"), "{e}");
        }
        assert_eq!(listing(&dir), ["model"]);
        assert!(listing(&out).is_empty());
    }

    #[test]
    fn an_out_inside_the_source_is_refused() {
        let dir = scratch("inside");
        let ckpt = dir.join("ckpt");
        fs::create_dir_all(ckpt.join("step-00000001")).unwrap();
        for out in [
            ckpt.join("m.safetensors"),
            ckpt.join("step-00000001").join("m.safetensors"),
            ckpt.join("step-00000001").join("..").join("m.safetensors"),
        ] {
            let e = check_destination(&out, true, Some(&ckpt), Dest::File)
                .unwrap_err()
                .to_string();
            assert!(e.contains("the checkpoint being exported"), "{e}");
        }
        check_destination(&dir.join("m.safetensors"), false, Some(&ckpt), Dest::File).unwrap();
        let e = check_destination(
            &dir.join("no").join("m.safetensors"),
            false,
            None,
            Dest::File,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("the directory of --out"), "{e}");
    }

    #[test]
    fn the_checksum_covers_names_shapes_and_every_byte() {
        use candle_core::{Device, Tensor};
        let a = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap();
        let b = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let base = checksum(&[("a", &a), ("b", &b)]);
        assert!(
            base.starts_with("fnv1a64:") && base.len() == 8 + 16,
            "{base}"
        );
        // The order the tensors come in does not matter; their names do.
        assert_eq!(checksum(&[("b", &b), ("a", &a)]), base);
        assert_ne!(checksum(&[("a", &b), ("b", &a)]), base);
        assert_ne!(
            checksum(&[("a", &a.reshape((3, 4)).unwrap()), ("b", &b)]),
            base
        );
        let mut flipped = a.to_vec1::<f32>().unwrap();
        flipped[5] = f32::from_bits(flipped[5].to_bits() ^ 1);
        let a2 = Tensor::new(flipped, &Device::Cpu).unwrap();
        assert_ne!(checksum(&[("a", &a2), ("b", &b)]), base);
    }
}
