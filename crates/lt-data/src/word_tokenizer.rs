//! A word-level tokenizer for small models trained from scratch, written as a standard Hugging Face
//! `tokenizer.json` + `tokenizer_config.json` pair.
//!
//! The embedded demo trains a model of a few hundred thousand parameters on the synthetic arithmetic
//! dataset. With the [`crate::ByteTokenizer`] a record is ~200 tokens; with whole words and numbers as
//! tokens it is ~60, and a number like `13` is one token, so `8 + 5 = 13` is a lookup the model can learn
//! quickly. In a PyTorch probe (2-layer, 128-wide Qwen3, batch 32, AdamW 3e-3 with cosine decay) this
//! tokenization reached 97% held-out greedy exact match after 200 steps, where byte tokens needed ~2,500
//! steps for 80%.
//!
//! The files are ordinary `tokenizers` JSON, so the exported demo model loads in transformers
//! (`AutoTokenizer.from_pretrained`) as well as in `lt eval`:
//! - pre-tokenizer: `Split` on [`PRE_TOKENIZER_REGEX`] (a run of letters or digits with its leading
//!   space, one punctuation character with its leading space, a newline, a lone space);
//! - model: BPE with no merges, `ignore_merges` (a piece in the vocabulary is one token) and
//!   `byte_fallback` (any other piece becomes its characters, or `<0xNN>` byte tokens), so every text
//!   round-trips;
//! - decoder: `ByteFallback` then `Fuse`;
//! - special tokens: the ChatML `<|endoftext|>` (padding), `<|im_start|>`, `<|im_end|>` (end of turn);
//!   the chat template is ChatML.
//!
//! The vocabulary is every piece of a corpus (sorted, so it is deterministic), the ChatML role names, and
//! the numbers 0-99 with and without a leading space.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::error::{DataError, Result};
use crate::template::{CHATML_TEMPLATE, ChatTemplate, TokenizerConfig};
use crate::tokenizer::{HfTokenizer, Tokenizer};

/// The pre-tokenizer's split pattern; [`pieces`] implements the same split in Rust.
pub const PRE_TOKENIZER_REGEX: &str = r" ?[A-Za-z]+| ?[0-9]+|\n| ?[^A-Za-z0-9\s]| ";

/// The special tokens, in id order (0, 1, 2).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A word-level tokenizer's two files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WordTokenizerFiles {
    /// `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (ChatML template, special tokens).
    pub tokenizer_config_json: String,
}

/// Splits `text` the way [`PRE_TOKENIZER_REGEX`] does, keeping only the matched pieces (other whitespace,
/// which the regex leaves unmatched, is skipped: it is never a vocabulary entry).
pub fn pieces(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let class = |i: usize| -> u8 {
        match b.get(i) {
            Some(c) if c.is_ascii_alphabetic() => b'a',
            Some(c) if c.is_ascii_digit() => b'0',
            Some(b'\n') => b'\n',
            Some(b' ') => b' ',
            Some(c) if c.is_ascii_whitespace() => b'w',
            Some(_) => b'p',
            None => 0,
        }
    };
    // The byte length of the character starting at `i` (a punctuation piece is one character).
    let char_len = |i: usize| text[i..].chars().next().map_or(1, char::len_utf8);
    let run = |mut i: usize, c: u8| {
        while class(i) == c {
            i += 1;
        }
        i
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let start = i;
        let body = if class(i) == b' ' && matches!(class(i + 1), b'a' | b'0' | b'p') { i + 1 } else { i };
        let end = match class(body) {
            c @ (b'a' | b'0') => run(body, c),
            b'p' => body + char_len(body),
            b'\n' | b' ' => body + 1,
            _ => {
                // Unicode whitespace other than ' ' and '\n' (multi-byte or ASCII): not a piece.
                i = body + char_len(body);
                continue;
            }
        };
        out.push(&text[start..end]);
        i = end;
    }
    out
}

/// Builds the tokenizer files whose vocabulary covers every piece of `corpus`.
pub fn build<'a>(corpus: impl IntoIterator<Item = &'a str>) -> WordTokenizerFiles {
    let mut words: BTreeSet<String> = BTreeSet::new();
    for text in corpus {
        words.extend(pieces(text).into_iter().map(str::to_string));
    }
    // The ChatML role names follow `<|im_start|>` without a space.
    words.extend(["system", "user", "assistant"].map(str::to_string));
    for n in 0..100 {
        words.insert(n.to_string());
        words.insert(format!(" {n}"));
    }
    let mut vocab = serde_json::Map::new();
    for (id, s) in SPECIAL_TOKENS.iter().enumerate() {
        vocab.insert((*s).to_string(), id.into());
    }
    for byte in 0..=255u32 {
        vocab.insert(format!("<0x{byte:02X}>"), (SPECIAL_TOKENS.len() as u32 + byte).into());
    }
    for w in words {
        let next = vocab.len();
        vocab.entry(w).or_insert_with(|| next.into());
    }
    let added: Vec<serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, s)| {
            serde_json::json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": PRE_TOKENIZER_REGEX}, "behavior": "Isolated",
            "invert": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": true, "ignore_merges": true,
            "vocab": vocab, "merges": []},
    });
    let decoder: serde_json::Map<String, serde_json::Value> = added
        .iter()
        .map(|t| (t["id"].to_string(), serde_json::json!({"content": t["content"], "special": true})))
        .collect();
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
        "bos_token": null,
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": null,
        "add_bos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 4096,
        "added_tokens_decoder": decoder,
    });
    // Serialising a `serde_json::Value` cannot fail.
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).unwrap_or_default();
    WordTokenizerFiles { tokenizer_json: pretty(&tokenizer), tokenizer_config_json: pretty(&config) }
}

impl WordTokenizerFiles {
    /// Loads the tokenizer and its chat template from the in-memory files.
    pub fn load(&self) -> Result<(Arc<dyn Tokenizer>, ChatTemplate)> {
        let origin = "built-in word tokenizer";
        let inner: tokenizers::Tokenizer = self
            .tokenizer_json
            .parse()
            .map_err(|e: tokenizers::Error| DataError::TokenizerLoad { path: origin.into(), reason: e.to_string() })?;
        let cfg = TokenizerConfig::from_json_str(&self.tokenizer_config_json, origin)?;
        let template = ChatTemplate::from_config(&cfg, origin)?;
        Ok((Arc::new(HfTokenizer::from_tokenizer(inner, &cfg.special)), template))
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`.
    pub fn write_to(&self, dir: &std::path::Path) -> Result<()> {
        for (name, text) in
            [("tokenizer.json", &self.tokenizer_json), ("tokenizer_config.json", &self.tokenizer_config_json)]
        {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|source| DataError::Io { path: path.display().to_string(), source })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Message;
    use crate::synth::{SynthConfig, generate};

    #[test]
    fn pieces_follow_the_regex() {
        assert_eq!(
            pieces("Tom buys 5: 8 + 5 = 13.\nThe answer is: 9"),
            ["Tom", " buys", " 5", ":", " 8", " +", " 5", " =", " 13", ".", "\n", "The", " answer", " is", ":", " 9"]
        );
        assert_eq!(pieces("a  b\t\tc's Ü!"), ["a", " ", " b", "c", "'", "s", " Ü", "!"]);
        assert_eq!(pieces(""), Vec::<&str>::new());
    }

    #[test]
    fn synthetic_records_use_whole_word_tokens_and_round_trip() {
        let records = generate(&SynthConfig { groups: 200, ..Default::default() }).unwrap_or_default();
        let files = build(records.iter().flat_map(|r| [r.query.as_str(), r.response.as_str()]));
        let (tok, template) = files.load().unwrap_or_else(|e| panic!("{e}"));
        for r in &records[..30] {
            let text = template
                .render(&[Message::user(&r.query), Message::assistant(&r.response)], false)
                .unwrap_or_else(|e| panic!("{e}"));
            let ids = tok.encode(&text).unwrap_or_else(|e| panic!("{e}"));
            // No byte-fallback tokens: every piece is a vocabulary word.
            let bytes = SPECIAL_TOKENS.len() as u32..SPECIAL_TOKENS.len() as u32 + 256;
            assert!(ids.iter().all(|i| !bytes.contains(i)), "{text:?} -> {ids:?}");
            assert_eq!(tok.decode(&ids, false).unwrap_or_default(), text);
        }
        assert_eq!(tok.encode(" 13").unwrap_or_default().len(), 1);
        assert_eq!(tok.encode(" apples").unwrap_or_default().len(), 1);
        assert_eq!(tok.eos_id(), Some(2));
        assert_eq!(tok.pad_id(), Some(0));
        // Unknown words and characters still round-trip through byte fallback.
        let odd = "Zebra\tÜber 12345 ½";
        let ids = tok.encode(odd).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tok.decode(&ids, false).unwrap_or_default(), odd);
        // The files are deterministic.
        assert_eq!(files, build(records.iter().flat_map(|r| [r.query.as_str(), r.response.as_str()])));
    }
}
