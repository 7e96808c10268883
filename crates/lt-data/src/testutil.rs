//! Test helpers: locating the Qwen3 tokenizer and loading the chat-template fixture.

use std::path::PathBuf;

use serde::Deserialize;

use crate::error::DataError;
use crate::template::Message;

/// The repository root (two levels above this crate's manifest).
pub(crate) fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("..")
}

/// The Qwen3 tokenizer folder: `<repo>/../shared/data/qwen3-tokenizer` where the workspace keeps it, else
/// the copy committed under `tools/fixtures/tokenizer/` (a fresh CI clone may have no `shared/`).
pub(crate) fn qwen3_dir() -> PathBuf {
    let shared = repo_root().join("..").join("shared").join("data").join("qwen3-tokenizer");
    if shared.join("tokenizer.json").is_file() {
        return shared;
    }
    repo_root().join("tools").join("fixtures").join("tokenizer")
}

/// One case of `tools/fixtures/chat/qwen3_chat_template.json` (see `tools/fixtures/gen_chat_template.py`).
#[derive(Debug, Deserialize)]
pub(crate) struct ChatCase {
    pub name: String,
    pub messages: Vec<Message>,
    pub add_generation_prompt: bool,
    #[serde(default)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    pub text: String,
    pub ids: Vec<u32>,
    pub prompt_text: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
}

/// The fixture file.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatFixture {
    pub cases: Vec<ChatCase>,
}

impl ChatFixture {
    /// Loads the committed fixture; panics (test-only) when it is missing or malformed.
    pub(crate) fn load() -> Self {
        let path = repo_root().join("tools").join("fixtures").join("chat").join("qwen3_chat_template.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
    }
}

/// The error of a result that must have failed; panics (test-only) with a clear message when it did not.
pub(crate) fn expect_err<T>(r: Result<T, DataError>) -> DataError {
    match r {
        Ok(_) => panic!("expected an error, got Ok"),
        Err(e) => e,
    }
}

/// The committed tokenizer copy must load on its own: it is what a fresh clone without `shared/` uses.
#[test]
fn committed_tokenizer_copy_loads_and_matches_the_fixture() {
    use crate::tokenizer::{HfTokenizer, Tokenizer};
    let dir = repo_root().join("tools").join("fixtures").join("tokenizer");
    let tok = HfTokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let template = crate::template::ChatTemplate::from_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
    let case = &ChatFixture::load().cases[0];
    let text = template.render(&case.messages, case.add_generation_prompt).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(text, case.text);
    assert_eq!(tok.encode(&text).unwrap_or_default(), case.ids);
}
