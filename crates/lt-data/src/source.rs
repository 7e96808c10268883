//! Dataset files: formats, format detection, and lazy record access over a memory map.
//!
//! [`DatasetFile::open`] maps the file and makes one pass over it to record where each record starts and
//! ends (a JSON array's elements, or a JSONL file's non-blank lines) and on which line. That index costs
//! 24 bytes per record; the records themselves are parsed only when [`DatasetFile::sample`] is called, so a
//! 400 MB MetaMathQA file needs its mapping (paged in and out by the OS) plus a few MB, not 10x its size.
//!
//! # Formats
//! | [`DatasetFormat`] | record | becomes |
//! |---|---|---|
//! | `metamathqa` | `{"query", "response", "type"?, "original_question"?}` | user query, assistant response; kind = `type`, group = `original_question` |
//! | `alpaca` | `{"instruction", "input"?, "output"}` | user `instruction` (+ `"\n\n" + input` when non-empty), assistant `output` |
//! | `sharegpt` | `{"conversations": [{"from": "system"\|"human"\|"gpt", "value"}], "system"?}` | messages |
//! | `messages` | `{"messages": [{"role", "content"}]}` | messages |
//! | `tokens` | `{"input_ids": [...], "labels": [...]?}` | used as is (labels aligned with ids, -100 ignored) |
//!
//! `auto` picks the format from the keys of the first record. The group key (for the grouped train/eval
//! split) is `original_question` for MetaMathQA, the prompt (every message before the last assistant one)
//! for chat formats, and a hash of the ids for pre-tokenized data.

use std::fs::File;
use std::path::Path;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{DataError, Result};
use crate::rng::fnv1a64;
use crate::template::Message;

/// The layout of a dataset file's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetFormat {
    /// Detect from the first record.
    Auto,
    /// MetaMathQA: `query`, `response`, `type`, `original_question`.
    #[value(name = "metamathqa")]
    #[serde(rename = "metamathqa")]
    MetaMathQa,
    /// Alpaca: `instruction`, `input`, `output`.
    Alpaca,
    /// ShareGPT: `conversations` of `{from, value}`.
    #[value(name = "sharegpt")]
    #[serde(rename = "sharegpt")]
    ShareGpt,
    /// OpenAI-style `messages` of `{role, content}`.
    Messages,
    /// Pre-tokenized `input_ids` with optional `labels`.
    #[value(alias = "pretokenized")]
    Tokens,
}

impl DatasetFormat {
    /// The lowercase name, also used as the `kind` of records whose format has no `type` field.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::MetaMathQa => "metamathqa",
            Self::Alpaca => "alpaca",
            Self::ShareGpt => "sharegpt",
            Self::Messages => "messages",
            Self::Tokens => "tokens",
        }
    }

    /// The format whose required keys a record has, if any.
    pub fn detect(record: &Map<String, Value>) -> Option<Self> {
        let has = |k: &str| record.contains_key(k);
        if has("query") && has("response") {
            Some(Self::MetaMathQa)
        } else if has("instruction") && has("output") {
            Some(Self::Alpaca)
        } else if has("conversations") {
            Some(Self::ShareGpt)
        } else if has("messages") {
            Some(Self::Messages)
        } else if has("input_ids") {
            Some(Self::Tokens)
        } else {
            None
        }
    }
}

/// What a record holds once parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SampleBody {
    /// A conversation to render with the chat template.
    Chat(Vec<Message>),
    /// Pre-tokenized ids and optional aligned labels.
    Tokens {
        /// Token ids.
        input_ids: Vec<u32>,
        /// Labels aligned with the ids (-100 ignored); `None` trains on every token.
        labels: Option<Vec<i64>>,
    },
}

/// One parsed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The content.
    pub body: SampleBody,
    /// The record's type (MetaMathQA `type`, e.g. `GSM_AnsAug`), else the format's name.
    pub kind: String,
    /// The key that keeps all rewrites of one question on the same side of the train/eval split.
    pub group: String,
}

impl Sample {
    /// A single-turn chat sample.
    pub fn chat(query: &str, response: &str, kind: &str, group: &str) -> Self {
        Self {
            body: SampleBody::Chat(vec![Message::user(query), Message::assistant(response)]),
            kind: kind.to_string(),
            group: group.to_string(),
        }
    }
}

/// Byte range and starting line of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: usize,
    end: usize,
    line: u64,
}

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A JSON-array or JSONL dataset file, indexed but parsed lazily.
pub struct DatasetFile {
    path: String,
    bytes: Bytes,
    spans: Vec<Span>,
    format: DatasetFormat,
}

impl std::fmt::Debug for DatasetFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetFile")
            .field("path", &self.path)
            .field("bytes", &self.bytes.as_slice().len())
            .field("records", &self.spans.len())
            .field("format", &self.format)
            .finish()
    }
}

impl DatasetFile {
    /// Maps and indexes `path`. With [`DatasetFormat::Auto`] the first record decides the format.
    pub fn open(path: &Path, format: DatasetFormat) -> Result<Self> {
        let name = path.display().to_string();
        let io = |source| DataError::Io { path: name.clone(), source };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let bytes = if len == 0 {
            Bytes::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this process. If another process truncates or
            // rewrites the file while it is mapped, reads may see the new bytes or fault (SIGBUS); like
            // ripgrep, we accept that for dataset files, which are not modified during a run. Where mapping
            // is refused (some filesystems), the file is read into memory instead.
            match unsafe { memmap2::Mmap::map(&file) } {
                Ok(m) => Bytes::Mapped(m),
                Err(_) => Bytes::Owned(std::fs::read(path).map_err(io)?),
            }
        };
        Self::from_bytes(name, bytes, format)
    }

    /// Indexes an in-memory file (tests, generated data). `name` is used in error messages.
    pub fn from_vec(name: &str, data: Vec<u8>, format: DatasetFormat) -> Result<Self> {
        Self::from_bytes(name.to_string(), Bytes::Owned(data), format)
    }

    fn from_bytes(path: String, bytes: Bytes, format: DatasetFormat) -> Result<Self> {
        let spans = index_records(bytes.as_slice(), &path)?;
        let mut file = Self { path, bytes, spans, format };
        if format == DatasetFormat::Auto
            && let Some(first) = file.spans.first().copied()
        {
            let obj = file.object(first)?;
            file.format = DatasetFormat::detect(&obj).ok_or_else(|| DataError::UnknownFormat {
                path: file.path.clone(),
                line: first.line,
                keys: obj.keys().cloned().collect(),
            })?;
        }
        Ok(file)
    }

    /// The path, as used in messages.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The format (resolved; `Auto` only for a file with no records).
    pub fn format(&self) -> DatasetFormat {
        self.format
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether the file has no records.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// The 1-based line where record `index` starts (0 when out of range).
    pub fn line(&self, index: usize) -> u64 {
        self.spans.get(index).map_or(0, |s| s.line)
    }

    /// The raw bytes of record `index`.
    pub fn raw(&self, index: usize) -> Option<&[u8]> {
        let s = self.spans.get(index)?;
        self.bytes.as_slice().get(s.start..s.end)
    }

    /// Parses record `index`. Errors are [`DataError::Malformed`] with this file, the line and the field.
    pub fn sample(&self, index: usize) -> Result<Sample> {
        let span = self.spans.get(index).copied().ok_or(DataError::InvalidConfig {
            field: "index",
            reason: format!("record {index} of {} does not exist", self.spans.len()),
        })?;
        let obj = self.object(span)?;
        parse_record(&obj, self.format).map_err(|(field, reason)| DataError::Malformed {
            path: self.path.clone(),
            line: span.line,
            field: Some(field),
            reason,
        })
    }

    fn object(&self, span: Span) -> Result<Map<String, Value>> {
        let raw = self.bytes.as_slice().get(span.start..span.end).unwrap_or(&[]);
        let value: Value = serde_json::from_slice(raw).map_err(|e| DataError::Malformed {
            path: self.path.clone(),
            line: span.line + (e.line() as u64).saturating_sub(1),
            field: None,
            reason: format!("invalid JSON: {e}"),
        })?;
        match value {
            Value::Object(o) => Ok(o),
            other => Err(DataError::Malformed {
                path: self.path.clone(),
                line: span.line,
                field: None,
                reason: format!("a record must be a JSON object, found {}", json_kind(&other)),
            }),
        }
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A field error: (field path, reason).
type FieldError = (String, String);

fn req_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<&'a str, FieldError> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err((key.to_string(), format!("expected a string, found {}", json_kind(other)))),
        None => Err((key.to_string(), "missing".to_string())),
    }
}

fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, FieldError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err((key.to_string(), format!("expected a string, found {}", json_kind(other)))),
    }
}

fn parse_record(obj: &Map<String, Value>, format: DatasetFormat) -> Result<Sample, FieldError> {
    match format {
        DatasetFormat::MetaMathQa => {
            let query = req_str(obj, "query")?;
            let response = req_str(obj, "response")?;
            let kind = opt_str(obj, "type")?.unwrap_or("metamathqa");
            let group = opt_str(obj, "original_question")?.unwrap_or(query);
            Ok(Sample::chat(query, response, kind, group.trim()))
        }
        DatasetFormat::Alpaca => {
            let instruction = req_str(obj, "instruction")?;
            let input = opt_str(obj, "input")?.unwrap_or("");
            let output = req_str(obj, "output")?;
            let prompt = if input.is_empty() { instruction.to_string() } else { format!("{instruction}\n\n{input}") };
            Ok(Sample::chat(&prompt, output, "alpaca", &prompt))
        }
        DatasetFormat::ShareGpt => {
            let turns = match obj.get("conversations") {
                Some(Value::Array(a)) => a,
                Some(other) => {
                    return Err(("conversations".into(), format!("expected an array, found {}", json_kind(other))));
                }
                None => return Err(("conversations".into(), "missing".into())),
            };
            let mut messages = Vec::with_capacity(turns.len() + 1);
            if let Some(system) = opt_str(obj, "system")?
                && !system.is_empty()
            {
                messages.push(Message::system(system));
            }
            for (i, t) in turns.iter().enumerate() {
                let Value::Object(t) = t else {
                    return Err((format!("conversations[{i}]"), format!("expected an object, found {}", json_kind(t))));
                };
                let from = req_str(t, "from").map_err(|(f, r)| (format!("conversations[{i}].{f}"), r))?;
                let role = match from {
                    "human" | "user" => "user",
                    "gpt" | "assistant" | "chatgpt" => "assistant",
                    "system" => "system",
                    "tool" | "function" | "observation" => "tool",
                    other => {
                        return Err((
                            format!("conversations[{i}].from"),
                            format!("unknown speaker {other:?} (expected human, gpt, system or tool)"),
                        ));
                    }
                };
                let value = req_str(t, "value").map_err(|(f, r)| (format!("conversations[{i}].{f}"), r))?;
                messages.push(Message::new(role, value));
            }
            chat_sample(messages, "sharegpt", "conversations")
        }
        DatasetFormat::Messages => {
            let turns = match obj.get("messages") {
                Some(Value::Array(a)) => a,
                Some(other) => {
                    return Err(("messages".into(), format!("expected an array, found {}", json_kind(other))));
                }
                None => return Err(("messages".into(), "missing".into())),
            };
            let mut messages = Vec::with_capacity(turns.len());
            for (i, t) in turns.iter().enumerate() {
                let Value::Object(t) = t else {
                    return Err((format!("messages[{i}]"), format!("expected an object, found {}", json_kind(t))));
                };
                let role = req_str(t, "role").map_err(|(f, r)| (format!("messages[{i}].{f}"), r))?;
                if !matches!(role, "system" | "user" | "assistant" | "tool") {
                    return Err((
                        format!("messages[{i}].role"),
                        format!("unknown role {role:?} (expected system, user, assistant or tool)"),
                    ));
                }
                // transformers allows `content: null` (e.g. tool-call turns); it renders as empty text here.
                let content = opt_str(t, "content").map_err(|(f, r)| (format!("messages[{i}].{f}"), r))?;
                messages.push(Message::new(role, content.unwrap_or("")));
            }
            chat_sample(messages, "messages", "messages")
        }
        DatasetFormat::Tokens => {
            let input_ids = int_array(obj, "input_ids")?
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    u32::try_from(v).map_err(|_| (format!("input_ids[{i}]"), format!("{v} is not a token id")))
                })
                .collect::<Result<Vec<u32>, FieldError>>()?;
            if input_ids.is_empty() {
                return Err(("input_ids".into(), "empty".into()));
            }
            let labels = if obj.get("labels").is_none_or(Value::is_null) {
                None
            } else {
                let labels = int_array(obj, "labels")?;
                if labels.len() != input_ids.len() {
                    return Err((
                        "labels".into(),
                        format!("{} labels for {} input_ids (they must be aligned)", labels.len(), input_ids.len()),
                    ));
                }
                Some(labels)
            };
            let mut key = Vec::with_capacity(input_ids.len() * 4);
            for id in &input_ids {
                key.extend_from_slice(&id.to_le_bytes());
            }
            Ok(Sample {
                body: SampleBody::Tokens { input_ids, labels },
                kind: "tokens".into(),
                group: format!("tokens:{:016x}", fnv1a64(&key)),
            })
        }
        DatasetFormat::Auto => Err(("(format)".into(), "the format was not resolved".into())),
    }
}

fn int_array(obj: &Map<String, Value>, key: &str) -> Result<Vec<i64>, FieldError> {
    let arr = match obj.get(key) {
        Some(Value::Array(a)) => a,
        Some(other) => return Err((key.to_string(), format!("expected an array, found {}", json_kind(other)))),
        None => return Err((key.to_string(), "missing".to_string())),
    };
    arr.iter()
        .enumerate()
        .map(|(i, v)| v.as_i64().ok_or_else(|| (format!("{key}[{i}]"), format!("expected an integer, found {v}"))))
        .collect()
}

/// Checks a conversation and derives its group key (the prompt: every message before the last assistant
/// message).
fn chat_sample(messages: Vec<Message>, kind: &str, field: &str) -> Result<Sample, FieldError> {
    if messages.is_empty() {
        return Err((field.to_string(), "empty conversation".to_string()));
    }
    let last_assistant = messages.iter().rposition(|m| m.role == "assistant").unwrap_or(messages.len());
    let mut group = String::new();
    for m in &messages[..last_assistant] {
        group.push_str(&m.role);
        group.push('\u{1f}');
        group.push_str(&m.content);
        group.push('\u{1e}');
    }
    Ok(Sample { body: SampleBody::Chat(messages), kind: kind.to_string(), group })
}

/// Finds the records of a JSON array or JSONL file (see the module docs).
fn index_records(data: &[u8], path: &str) -> Result<Vec<Span>> {
    let bom = if data.starts_with(&[0xEF, 0xBB, 0xBF]) { 3 } else { 0 };
    let first = data[bom..].iter().position(|b| !b.is_ascii_whitespace()).map(|p| p + bom);
    match first {
        None => Ok(Vec::new()),
        Some(p) if data[p] == b'[' => index_json_array(data, p, path),
        Some(_) => Ok(index_jsonl(data, bom)),
    }
}

fn index_jsonl(data: &[u8], start: usize) -> Vec<Span> {
    let mut spans = Vec::new();
    let mut line = 1u64;
    let mut pos = start;
    while pos < data.len() {
        let end = data[pos..].iter().position(|&b| b == b'\n').map_or(data.len(), |e| pos + e);
        if data[pos..end].iter().any(|b| !b.is_ascii_whitespace()) {
            spans.push(Span { start: pos, end, line });
        }
        line += 1;
        pos = end + 1;
    }
    spans
}

/// Scans a top-level JSON array, tracking strings and nesting depth, and records each element's bytes.
fn index_json_array(data: &[u8], open: usize, path: &str) -> Result<Vec<Span>> {
    let structure =
        |line: u64, reason: &str| DataError::Structure { path: path.to_string(), line, reason: reason.to_string() };
    let mut spans = Vec::new();
    let mut line = 1 + data[..open].iter().filter(|&&b| b == b'\n').count() as u64;
    let mut depth = 1usize;
    let mut in_string = false;
    let mut escape = false;
    let mut string_line = 0u64;
    // The element being read: (start, line, is a scalar).
    let mut element: Option<(usize, u64, bool)> = None;
    // Whether an element has been seen since the last comma (for `[1,,2]` and `[1,]`).
    let mut seen_since_comma = false;
    let mut commas = 0usize;
    let mut close = None;
    let mut i = open + 1;
    while i < data.len() {
        let b = data[i];
        if in_string {
            if escape {
                escape = false;
            } else if b == b'\\' {
                escape = true;
            } else if b == b'"' {
                in_string = false;
            } else if b == b'\n' {
                line += 1;
            }
            i += 1;
            continue;
        }
        match b {
            b'\n' => line += 1,
            b' ' | b'\t' | b'\r' => {}
            b'"' => {
                in_string = true;
                string_line = line;
                if depth == 1 && element.is_none() {
                    element = Some((i, line, true));
                    seen_since_comma = true;
                }
            }
            b'{' | b'[' => {
                if depth == 1 && element.is_none() {
                    element = Some((i, line, false));
                    seen_since_comma = true;
                }
                depth += 1;
            }
            b'}' | b']' => {
                if depth == 1 {
                    if b == b'}' {
                        return Err(structure(line, "unexpected `}` at the top level"));
                    }
                    if let Some((s, l, _)) = element.take() {
                        spans.push(Span { start: s, end: trim_end(data, s, i), line: l });
                    } else if commas > 0 && !seen_since_comma {
                        return Err(structure(line, "trailing comma before `]`"));
                    }
                    close = Some(i);
                    break;
                }
                depth -= 1;
                if depth == 1
                    && let Some((s, l, false)) = element
                {
                    spans.push(Span { start: s, end: i + 1, line: l });
                    element = None;
                }
            }
            b',' if depth == 1 => {
                if let Some((s, l, _)) = element.take() {
                    spans.push(Span { start: s, end: trim_end(data, s, i), line: l });
                } else if !seen_since_comma {
                    return Err(structure(line, "empty array element (two commas, or a comma after `[`)"));
                }
                seen_since_comma = false;
                commas += 1;
            }
            _ => {
                if depth == 1 && element.is_none() {
                    element = Some((i, line, true));
                    seen_since_comma = true;
                }
            }
        }
        i += 1;
    }
    if in_string {
        return Err(structure(string_line, "unterminated string"));
    }
    let Some(close) = close else {
        return Err(structure(line, "the top-level array is not closed (truncated file?)"));
    };
    if let Some(extra) = data[close + 1..].iter().position(|b| !b.is_ascii_whitespace()) {
        let extra_line = line + data[close + 1..close + 1 + extra].iter().filter(|&&b| b == b'\n').count() as u64;
        return Err(structure(extra_line, "data after the closing `]`"));
    }
    Ok(spans)
}

/// `end` moved back over whitespace, not before `start`.
fn trim_end(data: &[u8], start: usize, mut end: usize) -> usize {
    while end > start && data[end - 1].is_ascii_whitespace() {
        end -= 1;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::expect_err;

    fn file(text: &str, format: DatasetFormat) -> Result<DatasetFile> {
        DatasetFile::from_vec("mem.json", text.as_bytes().to_vec(), format)
    }

    #[test]
    fn json_array_records_are_indexed_with_lines() {
        let text = "\u{feff}[\n {\"query\": \"a, [b]\", \"response\": \"r\\\"}\", \"type\": \"GSM_AnsAug\"},\n\n  \
                    {\"query\": \"q2\",\n \"response\": \"r2\", \"original_question\": \" oq \"}\n]\n";
        let f = file(text, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.format(), DatasetFormat::MetaMathQa);
        assert_eq!(f.len(), 2);
        assert_eq!((f.line(0), f.line(1)), (2, 4));
        let s0 = f.sample(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s0.kind, "GSM_AnsAug");
        assert_eq!(s0.body, SampleBody::Chat(vec![Message::user("a, [b]"), Message::assistant("r\"}")]));
        assert_eq!(s0.group, "a, [b]");
        let s1 = f.sample(1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((s1.kind.as_str(), s1.group.as_str()), ("metamathqa", "oq"));
    }

    #[test]
    fn jsonl_skips_blank_lines_and_keeps_line_numbers() {
        let text = "{\"instruction\": \"i\", \"input\": \"x\", \"output\": \"o\"}\n\n  \r\n{\"instruction\": \"j\", \"output\": \"p\"}\r\n";
        let f = file(text, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.format(), DatasetFormat::Alpaca);
        assert_eq!((f.len(), f.line(0), f.line(1)), (2, 1, 4));
        let s = f.sample(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.body, SampleBody::Chat(vec![Message::user("i\n\nx"), Message::assistant("o")]));
        let s = f.sample(1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.body, SampleBody::Chat(vec![Message::user("j"), Message::assistant("p")]));
    }

    #[test]
    fn sharegpt_and_messages_map_roles() {
        let text =
            r#"{"system": "S", "conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}"#;
        let f = file(text, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.format(), DatasetFormat::ShareGpt);
        let s = f.sample(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.body, SampleBody::Chat(vec![Message::system("S"), Message::user("h"), Message::assistant("g")]));
        let text = r#"{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": null}]}"#;
        let f = file(text, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.format(), DatasetFormat::Messages);
        let s = f.sample(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.body, SampleBody::Chat(vec![Message::user("u"), Message::assistant("")]));
        assert_eq!(s.group, "user\u{1f}u\u{1e}");
    }

    #[test]
    fn pretokenized_records_parse_with_optional_labels() {
        let text = "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5], \"labels\": [-100, 5]}\n{\"input_ids\": [1, 2], \"labels\": [1]}\n{\"input_ids\": [-1]}\n";
        let f = file(text, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.format(), DatasetFormat::Tokens);
        let s = f.sample(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.body, SampleBody::Tokens { input_ids: vec![1, 2, 3], labels: None });
        let s = f.sample(1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.body, SampleBody::Tokens { input_ids: vec![4, 5], labels: Some(vec![-100, 5]) });
        let e = expect_err(f.sample(2)).to_string();
        assert_eq!(e, "mem.json:3: field `labels`: 1 labels for 2 input_ids (they must be aligned)");
        let e = expect_err(f.sample(3)).to_string();
        assert_eq!(e, "mem.json:4: field `input_ids[0]`: -1 is not a token id");
    }

    #[test]
    fn malformed_records_name_file_line_and_field() {
        let text = "{\"query\": \"q\", \"response\": \"r\"}\n{\"query\": 3, \"response\": \"r\"}\n{\"query\": \"q\"}\n{\"query\": \"q\", \"response\": \"r\" oops}\n[1]\n";
        let f = file(text, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.len(), 5);
        let errs: Vec<String> = (1..5).map(|i| expect_err(f.sample(i)).to_string()).collect();
        assert_eq!(errs[0], "mem.json:2: field `query`: expected a string, found a number");
        assert_eq!(errs[1], "mem.json:3: field `response`: missing");
        // JSONL records are single lines, so the JSON error is on the record's line.
        assert!(errs[2].starts_with("mem.json:4: invalid JSON"), "{}", errs[2]);
        assert_eq!(errs[3], "mem.json:5: a record must be a JSON object, found an array");
        let text = "{\"conversations\": [{\"from\": \"bot\", \"value\": \"x\"}]}";
        let f = file(text, DatasetFormat::ShareGpt).unwrap_or_else(|e| panic!("{e}"));
        let e = expect_err(f.sample(0));
        match e {
            DataError::Malformed { line, field, .. } => {
                assert_eq!(line, 1);
                assert_eq!(field.as_deref(), Some("conversations[0].from"));
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn json_syntax_error_inside_a_multiline_record_points_at_the_bad_line() {
        let text =
            "[\n{\"query\": \"q\", \"response\": \"r\"},\n{\"query\": \"q\",\n \"response\": \"r\",\n \"type\": ]}\n]";
        // `]` inside the object closes nothing at depth > 1 but makes the element invalid JSON.
        let f = file(text, DatasetFormat::MetaMathQa);
        match f {
            Ok(f) => {
                let e = expect_err(f.sample(1));
                assert!(e.to_string().starts_with("mem.json:5: invalid JSON"), "{e}");
            }
            // Unbalanced brackets may also break the array structure, which is reported as such.
            Err(e) => assert!(matches!(e, DataError::Structure { .. }), "{e}"),
        }
    }

    #[test]
    fn broken_array_structure_is_reported() {
        let cases = [
            ("[{\"a\": 1},", "not closed"),
            ("[{\"a\": \"x}]", "unterminated string"),
            ("[{\"a\": 1}] x", "data after"),
            ("[{\"a\": 1},,{\"a\": 2}]", "empty array element"),
            ("[{\"a\": 1},]", "trailing comma"),
        ];
        for (text, want) in cases {
            let e = expect_err(DatasetFile::from_vec("b.json", text.as_bytes().to_vec(), DatasetFormat::Tokens));
            assert!(matches!(e, DataError::Structure { .. }) && e.to_string().contains(want), "{text}: {e}");
        }
        let f = file("[ ]", DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert!(f.is_empty());
        assert!(file("", DatasetFormat::Auto).map(|f| f.is_empty()).unwrap_or(false));
    }

    /// Random JSON-like bytes never make the indexer or the record parser panic.
    #[test]
    fn indexing_and_parsing_never_panic_on_garbage() {
        let alphabet = b"[]{}\",:\\ a1\n-";
        let mut rng = crate::rng::SplitMix64::new(5);
        let mut parsed = 0;
        for _ in 0..3000 {
            let len = rng.below(40) as usize;
            let mut text: Vec<u8> = (0..len).map(|_| *rng.pick(alphabet).unwrap_or(&b' ')).collect();
            if rng.below(2) == 0 {
                text.insert(0, b'[');
            }
            for format in [DatasetFormat::MetaMathQa, DatasetFormat::ShareGpt, DatasetFormat::Tokens] {
                if let Ok(f) = DatasetFile::from_vec("g.json", text.clone(), format) {
                    for i in 0..f.len() {
                        parsed += usize::from(f.sample(i).is_ok());
                        assert!(f.line(i) >= 1);
                    }
                }
            }
        }
        // Garbage almost never forms a valid record; the point is that nothing panicked.
        assert!(parsed < 100, "{parsed}");
    }

    #[test]
    fn unknown_format_lists_the_keys() {
        let e = expect_err(file("{\"foo\": 1, \"bar\": 2}\n", DatasetFormat::Auto));
        match &e {
            DataError::UnknownFormat { line: 1, keys, .. } => {
                let mut keys = keys.clone();
                keys.sort();
                assert_eq!(keys, ["bar", "foo"]);
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn open_maps_a_real_file() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"query\": \"q\", \"response\": \"r\"}\n").unwrap_or_else(|e| panic!("{e}"));
        let f = DatasetFile::open(&path, DatasetFormat::Auto).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((f.len(), f.format()), (1, DatasetFormat::MetaMathQa));
        assert_eq!(f.raw(0), Some(&b"{\"query\": \"q\", \"response\": \"r\"}"[..]));
        let e = expect_err(DatasetFile::open(&dir.path().join("missing.json"), DatasetFormat::Auto));
        assert!(matches!(e, DataError::Io { .. }));
    }
}
