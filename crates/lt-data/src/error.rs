//! The one error type of `lt-data`.

use std::fmt;

/// Everything that can go wrong while reading, tokenizing, splitting or batching data.
///
/// Errors about one record of a dataset file carry the file and the 1-based line where the record starts
/// ([`DataError::Malformed`], [`DataError::Record`]); a run stops on them unless `skip_bad_records` is set,
/// and then they are counted instead.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened, mapped or read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file's JSON structure is broken in a way that makes its records impossible to locate (an
    /// unterminated string, unbalanced brackets). Not skippable: no record boundary can be trusted after it.
    #[error("{path}:{line}: broken JSON structure: {reason}")]
    Structure {
        /// The file.
        path: String,
        /// 1-based line of the problem.
        line: u64,
        /// What was found.
        reason: String,
    },
    /// The first record matches none of the known dataset formats.
    #[error(
        "{path}:{line}: cannot detect the dataset format from keys {keys:?} (expected MetaMathQA query/response, \
         Alpaca instruction/output, ShareGPT conversations, messages, or input_ids); pass the format explicitly"
    )]
    UnknownFormat {
        /// The file.
        path: String,
        /// 1-based line of the first record.
        line: u64,
        /// The keys of the first record.
        keys: Vec<String>,
    },
    /// One record is not valid JSON or lacks / mistypes a field.
    #[error("{path}:{line}: {}{reason}", FieldPrefix(field.as_deref()))]
    Malformed {
        /// The file.
        path: String,
        /// 1-based line where the record (or, for JSON syntax errors, the error) is.
        line: u64,
        /// The offending field, as a path like `conversations[2].from`, when one is to blame.
        field: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A record parsed but could not be turned into training data (template error, prefix mismatch, ...).
    #[error("{path}:{line}: {source}")]
    Record {
        /// The file.
        path: String,
        /// 1-based line where the record starts.
        line: u64,
        /// The underlying error.
        source: Box<DataError>,
    },
    /// The tokenizer files could not be loaded.
    #[error("{path}: cannot load tokenizer: {reason}")]
    TokenizerLoad {
        /// The file or folder.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// Encoding or decoding failed inside the tokenizer.
    #[error("tokenizer failed: {reason}")]
    Tokenize {
        /// The tokenizer's message.
        reason: String,
    },
    /// A token id is outside the tokenizer's vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        /// The id.
        id: u64,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The chat template does not compile.
    #[error("chat template from {origin}: cannot compile: {reason}")]
    TemplateCompile {
        /// Where the template came from (file path or "built-in ChatML").
        origin: String,
        /// minijinja's message.
        reason: String,
    },
    /// Rendering the chat template failed (including `raise_exception` inside the template).
    #[error("chat template: cannot render: {reason}")]
    TemplateRender {
        /// minijinja's message.
        reason: String,
    },
    /// The prompt rendered with `add_generation_prompt=true` is not a prefix of the rendered conversation,
    /// so the prompt/response boundary is undefined.
    #[error(
        "rendered prompt (turn {turn}) is not a prefix of the rendered conversation: they differ at byte \
         {diverge_at}: prompt {prompt_context:?} vs conversation {full_context:?}"
    )]
    PromptNotPrefix {
        /// Index of the assistant message whose prompt was rendered.
        turn: usize,
        /// Byte offset of the first difference.
        diverge_at: usize,
        /// A few bytes of the prompt around the difference.
        prompt_context: String,
        /// A few bytes of the conversation around the difference.
        full_context: String,
    },
    /// The prompt's tokens are not a prefix of the conversation's tokens (a token straddles the boundary).
    #[error(
        "tokens of the prompt (turn {turn}, {prompt_tokens} tokens) are not a prefix of the conversation's \
         tokens: they differ at token {diverge_at}"
    )]
    TokenBoundary {
        /// Index of the assistant message.
        turn: usize,
        /// Number of tokens in the prompt.
        prompt_tokens: usize,
        /// Token index of the first difference.
        diverge_at: usize,
    },
    /// An assistant turn that is not the last message has no end-of-turn marker after it.
    #[error("assistant turn {turn} has no end-of-turn marker {marker:?} after it")]
    MissingEndOfTurn {
        /// Index of the assistant message.
        turn: usize,
        /// The marker looked for.
        marker: String,
    },
    /// A conversation has no assistant message, so there is nothing to learn (and prompt-only training is off).
    #[error("the conversation has no assistant message to train on")]
    NoAssistantTurn,
    /// An option is out of its valid range.
    #[error("invalid setting `{field}`: {reason}")]
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// No usable training example is left.
    #[error(
        "no training examples left from {source_name} ({records} records, {bad_records} bad, {eval_records} in eval)"
    )]
    EmptyDataset {
        /// The file or generator.
        source_name: String,
        /// Records seen.
        records: usize,
        /// Records skipped as bad.
        bad_records: usize,
        /// Records assigned to evaluation.
        eval_records: usize,
    },
    /// A saved batcher state does not belong to this dataset or configuration.
    #[error("cannot resume batcher: saved {what} {saved} but the current one is {current}")]
    ResumeMismatch {
        /// What differs.
        what: &'static str,
        /// The saved value.
        saved: u64,
        /// The current value.
        current: u64,
    },
}

impl DataError {
    /// Whether this error concerns a single record, so that `skip_bad_records` may skip it.
    pub fn is_record_error(&self) -> bool {
        matches!(self, DataError::Malformed { .. } | DataError::Record { .. })
    }
}

/// Formats `field: ` when a field is named.
struct FieldPrefix<'a>(Option<&'a str>);

impl fmt::Display for FieldPrefix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(field) => write!(f, "field `{field}`: "),
            None => Ok(()),
        }
    }
}

/// Result alias used across the crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_message_names_file_line_and_field() {
        let e = DataError::Malformed {
            path: "d.jsonl".into(),
            line: 7,
            field: Some("conversations[1].from".into()),
            reason: "unknown role \"bot\"".into(),
        };
        assert_eq!(e.to_string(), "d.jsonl:7: field `conversations[1].from`: unknown role \"bot\"");
        assert!(e.is_record_error());
        let e = DataError::Malformed { path: "d.json".into(), line: 3, field: None, reason: "bad".into() };
        assert_eq!(e.to_string(), "d.json:3: bad");
        assert!(!DataError::NoAssistantTurn.is_record_error());
    }
}
