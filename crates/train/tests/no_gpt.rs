//! The trainer is generic over `switchyard_models::Model`: no code path of
//! `crates/train/src` may name the GPT or its fields. Comments, doc comments and unit-test
//! modules may (they document and test the trainer with the GPT as an example).

use std::fs;
use std::path::{Path, PathBuf};

/// What only GPT code would write.
const GPT_WORDS: &[&str] = &[
    "Gpt",
    "gpt_",
    "transformer.",
    "lm_head",
    "n_head",
    "block_size",
    "tied_embeddings",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            // A unit-test module of its own (`#[cfg(test)] mod tests;`) may name it.
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(path);
        }
    }
}

/// The lines of `text` that are code outside unit-test modules, with their numbers.
fn code_lines(text: &str) -> Vec<(usize, &str)> {
    text.lines()
        .enumerate()
        .take_while(|(_, l)| l.trim() != "#[cfg(test)]")
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, l))
        .collect()
}

fn offences(path: &Path, text: &str) -> Vec<String> {
    code_lines(text)
        .into_iter()
        .filter(|(_, l)| GPT_WORDS.iter().any(|w| l.contains(w)))
        .map(|(n, l)| format!("{}:{n}: {}", path.display(), l.trim()))
        .collect()
}

#[test]
fn no_code_path_of_the_trainer_names_the_gpt() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(
        files.len() >= 10,
        "the trainer's sources were not found under {}",
        src.display()
    );
    let found: Vec<String> = files
        .iter()
        .flat_map(|f| offences(f, &fs::read_to_string(f).unwrap()))
        .collect();
    assert!(
        found.is_empty(),
        "the trainer names the GPT; go through the Model trait instead:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_guard_sees_code_and_skips_comments_and_tests() {
    let text = "use a::GptConfig;\n// GptConfig in a comment\n/// n_head docs\nlet x = cfg.n_head;\n#[cfg(test)]\nmod tests { GptConfig }\n";
    let found = offences(Path::new("f.rs"), text);
    assert_eq!(
        found,
        vec!["f.rs:1: use a::GptConfig;", "f.rs:4: let x = cfg.n_head;"]
    );
}
