//! The [`Tokenizer`] abstraction: Hugging Face `tokenizer.json` ([`HfTokenizer`]) or a tiny byte-level
//! tokenizer for tiny demo models ([`ByteTokenizer`]).
//!
//! Both encode text without adding special tokens (what `apply_chat_template(tokenize=True)` does: the
//! template already wrote them), while special-token *text* in the input, such as `<|im_start|>`, becomes
//! the special token's id.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::template::{ChatTemplate, SpecialTokenStrings, TokenizerConfig};

/// Text to token ids and back.
pub trait Tokenizer: Send + Sync + fmt::Debug {
    /// Token ids of `text`; no special tokens are added, but special-token text maps to its id.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// Text of `ids`; special tokens are dropped when `skip_special_tokens`.
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String>;
    /// Number of ids the tokenizer can produce (added tokens included). The model's embedding may be larger.
    fn vocab_size(&self) -> usize;
    /// The id of a token string (regular or special).
    fn token_to_id(&self, token: &str) -> Option<u32>;
    /// The end-of-sequence id, if the tokenizer defines one.
    fn eos_id(&self) -> Option<u32>;
    /// The padding id, if the tokenizer defines one.
    fn pad_id(&self) -> Option<u32>;
}

/// Which tokenizer to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TokenizerKind {
    /// The model folder's `tokenizer.json` and `tokenizer_config.json`.
    Hf,
    /// [`ByteTokenizer`] with the ChatML template: 259 ids, for tiny models.
    Byte,
}

/// Loads a tokenizer and its chat template. `model_dir` is required for [`TokenizerKind::Hf`].
pub fn load(kind: TokenizerKind, model_dir: Option<&Path>) -> Result<(Arc<dyn Tokenizer>, ChatTemplate)> {
    match kind {
        TokenizerKind::Byte => Ok((Arc::new(ByteTokenizer), ByteTokenizer::chat_template())),
        TokenizerKind::Hf => {
            let dir = model_dir.ok_or_else(|| DataError::InvalidConfig {
                field: "tokenizer",
                reason: "the Hugging Face tokenizer needs a model folder".into(),
            })?;
            let cfg = TokenizerConfig::from_dir(dir)?;
            let tok = HfTokenizer::from_file(&dir.join("tokenizer.json"), &cfg)?;
            let template = ChatTemplate::from_config(&cfg, &dir.display().to_string())?;
            Ok((Arc::new(tok), template))
        }
    }
}

/// A Hugging Face `tokenizer.json` tokenizer (the `tokenizers` crate).
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    eos: Option<u32>,
    pad: Option<u32>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json`; special tokens come from `cfg` (parsed `tokenizer_config.json`).
    pub fn from_file(path: &Path, cfg: &TokenizerConfig) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| DataError::TokenizerLoad { path: path.display().to_string(), reason: e.to_string() })?;
        Ok(Self::from_tokenizer(inner, &cfg.special))
    }

    /// Loads `tokenizer.json` and `tokenizer_config.json` from a model folder.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"), &TokenizerConfig::from_dir(dir)?)
    }

    /// Wraps an already built `tokenizers::Tokenizer`.
    pub fn from_tokenizer(inner: tokenizers::Tokenizer, special: &SpecialTokenStrings) -> Self {
        let id = |s: &Option<String>| s.as_deref().and_then(|t| inner.token_to_id(t));
        let eos = id(&special.eos_token);
        let pad = id(&special.pad_token);
        Self { inner, eos, pad }
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| DataError::Tokenize { reason: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| DataError::Tokenize { reason: e.to_string() })
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    fn pad_id(&self) -> Option<u32> {
        self.pad
    }
}

/// A byte-level tokenizer: ids 0..=255 are the UTF-8 bytes of the text, then three ChatML special tokens.
///
/// Its vocabulary of [`ByteTokenizer::VOCAB_SIZE`] ids lets a model of a few million parameters spend its
/// parameters on layers instead of embeddings; any text round-trips. Use it with
/// [`ByteTokenizer::chat_template`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// `<|endoftext|>`, also the padding token.
    pub const ENDOFTEXT: u32 = 256;
    /// `<|im_start|>`.
    pub const IM_START: u32 = 257;
    /// `<|im_end|>`, the end-of-turn and end-of-sequence token.
    pub const IM_END: u32 = 258;
    /// Number of ids.
    pub const VOCAB_SIZE: usize = 259;
    const SPECIALS: [(&'static str, u32); 3] =
        [("<|endoftext|>", Self::ENDOFTEXT), ("<|im_start|>", Self::IM_START), ("<|im_end|>", Self::IM_END)];

    /// The ChatML template with this tokenizer's special tokens.
    pub fn chat_template() -> ChatTemplate {
        ChatTemplate::chatml(SpecialTokenStrings {
            bos_token: None,
            eos_token: Some("<|im_end|>".into()),
            pad_token: Some("<|endoftext|>".into()),
            unk_token: None,
        })
    }
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(bytes.len());
        let mut i = 0;
        'outer: while i < bytes.len() {
            if bytes[i] == b'<' {
                for (s, id) in Self::SPECIALS {
                    if bytes[i..].starts_with(s.as_bytes()) {
                        ids.push(id);
                        i += s.len();
                        continue 'outer;
                    }
                }
            }
            ids.push(u32::from(bytes[i]));
            i += 1;
        }
        Ok(ids)
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) => match Self::SPECIALS.iter().find(|(_, sid)| *sid == id) {
                    Some((s, _)) if !skip_special_tokens => bytes.extend_from_slice(s.as_bytes()),
                    Some(_) => {}
                    None => return Err(DataError::TokenOutOfRange { id: u64::from(id), vocab_size: Self::VOCAB_SIZE }),
                },
            }
        }
        // Like HF's byte-level decoder, invalid UTF-8 (a cut multi-byte character) becomes U+FFFD.
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some((_, id)) = Self::SPECIALS.iter().find(|(s, _)| *s == token) {
            return Some(*id);
        }
        match token.as_bytes() {
            [b] => Some(u32::from(*b)),
            _ => None,
        }
    }

    fn eos_id(&self) -> Option<u32> {
        Some(Self::IM_END)
    }

    fn pad_id(&self) -> Option<u32> {
        Some(Self::ENDOFTEXT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{ChatFixture, expect_err, qwen3_dir};

    #[test]
    fn hf_tokenizer_matches_transformers_ids_on_the_fixture() {
        let tok = HfTokenizer::from_dir(&qwen3_dir()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tok.eos_id(), tok.token_to_id("<|im_end|>"));
        assert_eq!(tok.pad_id(), tok.token_to_id("<|endoftext|>"));
        assert_eq!(tok.eos_id(), Some(151645));
        for case in ChatFixture::load().cases {
            let ids = tok.encode(&case.text).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(ids, case.ids, "case {}", case.name);
            let back = tok.decode(&ids, false).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(back, case.text, "round trip of case {}", case.name);
        }
    }

    #[test]
    fn load_hf_gives_tokenizer_and_template() {
        let (tok, template) = load(TokenizerKind::Hf, Some(&qwen3_dir())).unwrap_or_else(|e| panic!("{e}"));
        assert!(tok.vocab_size() > 151_000);
        assert!(template.origin().contains("qwen3") || template.origin().contains("tokenizer"));
        let err = expect_err(load(TokenizerKind::Hf, None));
        assert!(matches!(err, DataError::InvalidConfig { field: "tokenizer", .. }));
        let err = expect_err(HfTokenizer::from_dir(Path::new("/nonexistent/model")));
        assert!(matches!(err, DataError::TokenizerLoad { .. }), "{err}");
    }

    #[test]
    fn byte_tokenizer_round_trips_and_maps_specials() {
        let t = ByteTokenizer;
        let text = "<|im_start|>user\nÜber 3 < 4<|im_end|>\n<|endoftext|><|im_x|>";
        let ids = t.encode(text).unwrap_or_default();
        assert_eq!(ids[0], ByteTokenizer::IM_START);
        assert_eq!(ids.iter().filter(|&&i| i == ByteTokenizer::IM_END).count(), 1);
        assert_eq!(ids.iter().filter(|&&i| i == ByteTokenizer::ENDOFTEXT).count(), 1);
        assert!(ids.iter().all(|&i| (i as usize) < ByteTokenizer::VOCAB_SIZE));
        assert_eq!(t.decode(&ids, false).unwrap_or_default(), text);
        assert_eq!(t.decode(&ids, true).unwrap_or_default(), "user\nÜber 3 < 4\n<|im_x|>");
        assert!(matches!(t.decode(&[999], false), Err(DataError::TokenOutOfRange { id: 999, .. })));
        assert_eq!(t.token_to_id("<|im_end|>"), Some(ByteTokenizer::IM_END));
        assert_eq!(t.token_to_id("a"), Some(97));
        assert_eq!(t.token_to_id("ab"), None);
    }
}
