//! Text for `train_gpt --data`: a UTF-8 file as byte-level tokens, or as the ids of a
//! Hugging Face `tokenizer.json` (the `tokenizers` crate). Shared with `tests/train_gpt_data.rs`.
#![allow(dead_code)]

use std::path::Path;

use candle_dtensor::train::data::Corpus;

/// How text becomes tokens.
pub enum Tokenizer {
    /// Each UTF-8 byte is a token (vocabulary 256).
    Bytes,
    /// A `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// The tokenizer at `path`, or byte-level tokens without one.
    ///
    /// # Errors
    ///
    /// An unreadable or invalid `tokenizer.json`, naming the file.
    pub fn load(path: Option<&Path>) -> Result<Self, String> {
        match path {
            None => Ok(Tokenizer::Bytes),
            Some(p) => tokenizers::Tokenizer::from_file(p)
                .map(|t| Tokenizer::Hf(Box::new(t)))
                .map_err(|e| format!("tokenizer {}: {e}", p.display())),
        }
    }

    /// The vocabulary size (with added tokens).
    pub fn vocab(&self) -> usize {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// The ids of `text`.
    ///
    /// # Errors
    ///
    /// The tokenizer's error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| format!("tokenizing: {e}")),
        }
    }

    /// The text of `ids` (invalid UTF-8 from a byte sequence cut mid-character is replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Hf(t) => t
                .decode(ids, false)
                .unwrap_or_else(|e| format!("<cannot decode {ids:?}: {e}>")),
        }
    }

    /// What it is, for the output.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes => "byte-level tokens (vocabulary 256)".into(),
            Tokenizer::Hf(_) => format!("tokenizer.json (vocabulary {})", self.vocab()),
        }
    }
}

/// The tokens of the UTF-8 text file at `path`.
///
/// # Errors
///
/// An unreadable file, text that is not UTF-8, or no tokens.
pub fn corpus(path: &Path, tokenizer: &Tokenizer) -> Result<Corpus, String> {
    let text = std::fs::read(path).map_err(|e| format!("--data {}: {e}", path.display()))?;
    let text = String::from_utf8(text).map_err(|e| {
        format!(
            "--data {}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let ids = tokenizer.encode(&text)?;
    Corpus::from_tokens(ids, tokenizer.vocab())
        .map_err(|e| format!("--data {}: {e}", path.display()))
}
