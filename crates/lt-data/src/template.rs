//! Chat templates: Hugging Face's Jinja `chat_template`, rendered with minijinja.
//!
//! The goal is byte-identical output to transformers' `apply_chat_template(..., tokenize=False)`. That
//! function renders in a Jinja2 sandbox with `trim_blocks=True, lstrip_blocks=True`, the `loopcontrols`
//! extension, a `raise_exception` function, a `strftime_now` function, a `tojson` filter that is Python's
//! `json.dumps(ensure_ascii=False)`, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
//! variables. This module sets minijinja up the same way, adds Python string/dict methods
//! (`.startswith`, `.strip`, `.split`, ... from `minijinja-contrib`'s `pycompat`), and turns the
//! `{% generation %}` blocks (transformers' assistant-mask extension) into plain blocks.
//!
//! Where the template comes from, in order: `chat_template.jinja` in the model folder (what transformers 5
//! writes), the `chat_template` field of `tokenizer_config.json` (a string, or a list of named templates of
//! which `default` is used), and else the built-in ChatML template [`CHATML_TEMPLATE`].

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};

/// One chat message, as transformers' `{"role": ..., "content": ...}` dict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (or `tool`).
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// transformers' default ChatML template, used when a model folder has none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' \
}}{% endif %}";

/// Special tokens that templates see as variables, read from `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecialTokenStrings {
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
}

/// The parts of `tokenizer_config.json` this crate uses.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// The chat template source, if any.
    pub chat_template: Option<String>,
    /// Special token strings.
    pub special: SpecialTokenStrings,
}

impl TokenizerConfig {
    /// Parses `tokenizer_config.json` text. Special tokens may be strings or `{"content": ...}` objects.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| DataError::Malformed {
            path: origin.to_string(),
            line: e.line() as u64,
            field: None,
            reason: e.to_string(),
        })?;
        let token = |key: &str| -> Option<String> {
            match v.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
                _ => None,
            }
        };
        let chat_template = match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                let named = |want: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(want))
                        .and_then(|t| t.get("template").and_then(|s| s.as_str()).map(str::to_string))
                };
                let only = if list.len() == 1 {
                    list.first().and_then(|t| t.get("template")).and_then(|s| s.as_str()).map(str::to_string)
                } else {
                    None
                };
                Some(named("default").or(only).ok_or_else(|| DataError::Malformed {
                    path: origin.to_string(),
                    line: 1,
                    field: Some("chat_template".into()),
                    reason: "a list of templates without one named \"default\"".into(),
                })?)
            }
            Some(_) => {
                return Err(DataError::Malformed {
                    path: origin.to_string(),
                    line: 1,
                    field: Some("chat_template".into()),
                    reason: "expected a string or a list of {name, template}".into(),
                });
            }
        };
        Ok(Self {
            chat_template,
            special: SpecialTokenStrings {
                bos_token: token("bos_token"),
                eos_token: token("eos_token"),
                pad_token: token("pad_token"),
                unk_token: token("unk_token"),
            },
        })
    }

    /// Reads `tokenizer_config.json` (and `chat_template.jinja`, which wins) from a model folder. A folder
    /// without either gives an empty config (ChatML fallback, no special tokens).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("tokenizer_config.json");
        let mut cfg = if cfg_path.exists() {
            let text = read_text(&cfg_path)?;
            Self::from_json_str(&text, &cfg_path.display().to_string())?
        } else {
            Self::default()
        };
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            cfg.chat_template = Some(read_text(&jinja)?);
        }
        Ok(cfg)
    }
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| DataError::Io { path: path.display().to_string(), source })
}

/// A compiled chat template plus the variables transformers passes to it.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    special: SpecialTokenStrings,
    extra: BTreeMap<String, serde_json::Value>,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`. `origin` names it in error messages.
    pub fn new(source: &str, origin: &str, special: SpecialTokenStrings) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| compile_error(origin, &e))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(source)).map_err(|e| compile_error(origin, &e))?;
        Ok(Self { env, origin: origin.to_string(), special, extra: BTreeMap::new() })
    }

    /// The built-in ChatML template.
    ///
    /// # Panics
    /// Only if [`CHATML_TEMPLATE`] stopped compiling, a bug in this crate that the tests catch.
    pub fn chatml(special: SpecialTokenStrings) -> Self {
        match Self::new(CHATML_TEMPLATE, "built-in ChatML", special) {
            Ok(t) => t,
            // The constant is a fixed, tested template; failing to compile it is a bug in this crate.
            Err(e) => unreachable!("built-in ChatML template does not compile: {e}"),
        }
    }

    /// The template a model folder defines (see the module docs), or ChatML.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_config(&TokenizerConfig::from_dir(dir)?, &dir.display().to_string())
    }

    /// The template of a parsed tokenizer config, or ChatML when it has none.
    pub fn from_config(cfg: &TokenizerConfig, origin: &str) -> Result<Self> {
        match &cfg.chat_template {
            Some(src) => Self::new(src, origin, cfg.special.clone()),
            None => Ok(Self::chatml(cfg.special.clone())),
        }
    }

    /// Adds a variable passed to every rendering, like an extra keyword argument of `apply_chat_template`
    /// (e.g. `enable_thinking=false` for Qwen3).
    pub fn with_variable(mut self, name: &str, value: serde_json::Value) -> Self {
        self.extra.insert(name.to_string(), value);
        self
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Special token strings the template sees.
    pub fn special(&self) -> &SpecialTokenStrings {
        &self.special
    }

    /// Renders `messages`, like `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (name, v) in [
            ("bos_token", &self.special.bos_token),
            ("eos_token", &self.special.eos_token),
            ("pad_token", &self.special.pad_token),
            ("unk_token", &self.special.unk_token),
        ] {
            if let Some(v) = v {
                ctx.insert(name.to_string(), Value::from(v.as_str()));
            }
        }
        for (k, v) in &self.extra {
            ctx.insert(k.clone(), Value::from(Serde(v)));
        }
        ctx.insert("messages".into(), Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| render_error(&e))?;
        tmpl.render(Value::from_pairs(ctx)).map_err(|e| render_error(&e))
    }
}

fn compile_error(origin: &str, e: &JinjaError) -> DataError {
    DataError::TemplateCompile { origin: origin.to_string(), reason: full_error(e) }
}

fn render_error(e: &JinjaError) -> DataError {
    DataError::TemplateRender { reason: full_error(e) }
}

/// minijinja's message with its causes (the top-level message alone is often just "invalid operation").
fn full_error(e: &JinjaError) -> String {
    let mut s = e.to_string();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// transformers' `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, separators=..., sort_keys=...)`.
///
/// minijinja's own `tojson` HTML-escapes `<`, `>`, `&` and `'` and uses compact separators, which would
/// change the rendered bytes of tool-calling templates. Maps keep their iteration order (template dict
/// literals keep insertion order, like Python dicts).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(seps) => {
            let item = seps.get_item(&Value::from(0))?;
            let key = seps.get_item(&Value::from(1))?;
            (item.as_str().unwrap_or(", ").to_string(), key.as_str().unwrap_or(": ").to_string())
        }
        // Python's default: ", " without indent, "," with indent (trailing spaces are dropped).
        None => (if indent.is_some() { ",".to_string() } else { ", ".to_string() }, ": ".to_string()),
    };
    let layout = JsonLayout { indent, item_sep, key_sep, sort_keys: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    py_dumps(&value, &layout, 0, &mut out)?;
    Ok(Value::from(out))
}

struct JsonLayout {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonLayout {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    }
}

/// Python `json.dumps` layout with `ensure_ascii=False`, walking a minijinja value.
fn py_dumps(v: &Value, layout: &JsonLayout, level: usize, out: &mut String) -> std::result::Result<(), JinjaError> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match (v.as_i64(), f64::try_from(v.clone())) {
            (Some(i), _) if !v.to_string().contains(['.', 'e', 'E']) => out.push_str(&i.to_string()),
            (_, Ok(f)) if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 => out.push_str(&format!("{f:.1}")),
            (_, Ok(f)) if f.is_nan() => out.push_str("NaN"),
            (_, Ok(f)) if f.is_infinite() => out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" }),
            (_, Ok(f)) => out.push_str(&f.to_string()),
            (_, Err(_)) => out.push_str(&v.to_string()),
        },
        ValueKind::String | ValueKind::Bytes => py_string(v.as_str().unwrap_or(&v.to_string()), out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if layout.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item_sep);
                }
                layout.newline(out, level + 1);
                py_string(k.as_str().unwrap_or(&k.to_string()), out);
                out.push_str(&layout.key_sep);
                py_dumps(&v.get_item(k)?, layout, level + 1, out)?;
            }
            layout.newline(out, level);
            out.push('}');
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&layout.item_sep);
                }
                layout.newline(out, level + 1);
                py_dumps(item, layout, level + 1, out)?;
            }
            layout.newline(out, level);
            out.push(']');
        }
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`: only `"`, `\` and control characters are
/// escaped.
fn py_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// transformers' `strftime_now(format)`: the current UTC time through a subset of `strftime` (`%Y %y %m
/// %d %e %H %M %S %j %b %B %a %A %p %I %%`); other directives are copied literally.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(secs as i64, &format)
}

fn strftime(unix_secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs_of_day / 3600, (secs_of_day / 60) % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let month_name = MONTHS.get((m - 1) as usize).copied().unwrap_or("");
    let day_name = DAYS.get(weekday).copied().unwrap_or("");
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 })),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(day_name.get(..3).unwrap_or("")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (transformers' `AssistantTracker` extension, which
/// only records assistant spans) by `{% if true %}` / `{% endif %}`, keeping whitespace-control markers, so
/// templates written for `return_assistant_tokens_mask` render unchanged.
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        match parse_generation_tag(tag) {
            Some((len, open_marker, is_end, close_marker)) => {
                out.push_str("{%");
                out.push_str(open_marker);
                out.push_str(if is_end { " endif " } else { " if true " });
                out.push_str(close_marker);
                out.push_str("%}");
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Parses `{%[-+]? generation|endgeneration [-+]?%}` at the start of `s`: (length, open marker, is end,
/// close marker).
fn parse_generation_tag(s: &str) -> Option<(usize, &str, bool, &str)> {
    let body = s.strip_prefix("{%")?;
    let (open, body) = match body.chars().next() {
        Some(c @ ('-' | '+')) => (&s[2..2 + c.len_utf8()], &body[1..]),
        _ => ("", body),
    };
    let trimmed = body.trim_start();
    let (is_end, after) = if let Some(a) = trimmed.strip_prefix("endgeneration") {
        (true, a)
    } else if let Some(a) = trimmed.strip_prefix("generation") {
        (false, a)
    } else {
        return None;
    };
    let after_ws = after.trim_start();
    if after_ws.len() == after.len() && !after.starts_with(['-', '+', '%']) {
        // `generationfoo`: another identifier.
        return None;
    }
    let (close, after_ws) = match after_ws.chars().next() {
        Some('-') => ("-", &after_ws[1..]),
        Some('+') => ("+", &after_ws[1..]),
        _ => ("", after_ws),
    };
    let tail = after_ws.strip_prefix("%}")?;
    Some((s.len() - tail.len(), open, is_end, close))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{ChatFixture, expect_err, qwen3_dir};

    fn qwen3_template() -> ChatTemplate {
        let dir = qwen3_dir();
        match ChatTemplate::from_dir(&dir) {
            Ok(t) => t,
            Err(e) => panic!("loading the Qwen3 template from {}: {e}", dir.display()),
        }
    }

    #[test]
    fn qwen3_template_matches_transformers_byte_for_byte() {
        let fixture = ChatFixture::load();
        assert!(fixture.cases.len() >= 10);
        let base = qwen3_template();
        for case in &fixture.cases {
            let mut t = ChatTemplate::from_dir(&qwen3_dir()).unwrap_or_else(|e| panic!("{e}"));
            for (k, v) in &case.extra {
                t = t.with_variable(k, v.clone());
            }
            let got = t.render(&case.messages, case.add_generation_prompt).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got, case.text, "case {}", case.name);
            if let Some(prompt_text) = &case.prompt_text {
                let n = case.messages.len() - 1;
                let got = t.render(&case.messages[..n], true).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(&got, prompt_text, "prompt of case {}", case.name);
            }
        }
        assert_eq!(base.special().eos_token.as_deref(), Some("<|im_end|>"));
    }

    #[test]
    fn chatml_fallback_renders_the_standard_layout() {
        let t = ChatTemplate::chatml(SpecialTokenStrings::default());
        let msgs = [Message::system("s"), Message::user("q"), Message::assistant("a")];
        assert_eq!(
            t.render(&msgs, false).unwrap_or_default(),
            "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
        );
        assert_eq!(
            t.render(&msgs[1..2], true).unwrap_or_default(),
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_a_render_error() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, "test", SpecialTokenStrings::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.render(&[Message::user("x")], false).unwrap_or_default(), "ok");
        let err = expect_err(t.render(&[Message::assistant("x")], false));
        assert!(matches!(err, DataError::TemplateRender { .. }));
        assert!(err.to_string().contains("first must be user"), "{err}");
    }

    #[test]
    fn broken_template_is_a_compile_error() {
        let err =
            expect_err(ChatTemplate::new("{% for m in messages %}", "broken.jinja", SpecialTokenStrings::default()));
        assert!(matches!(err, DataError::TemplateCompile { .. }), "{err}");
        assert!(err.to_string().contains("broken.jinja"));
    }

    #[test]
    fn generation_tags_are_neutralised() {
        let src = "{%- for m in messages %}{% if m.role == 'assistant' %}{%- generation -%}[{{ m.content }}]\
                   {%- endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(src, "gen", SpecialTokenStrings::default()).unwrap_or_else(|e| panic!("{e}"));
        let out = t.render(&[Message::user("q"), Message::assistant("a")], false).unwrap_or_default();
        assert_eq!(out, "q[a]");
        assert_eq!(strip_generation_tags("{% generationx %}"), "{% generationx %}");
    }

    #[test]
    fn tojson_follows_python_json_dumps() {
        // Expected strings are Python's json.dumps(x, ensure_ascii=False) and json.dumps(x, ensure_ascii=False,
        // indent=2) of {"name": "f<x>", "args": [1, 2.0, "é\n", None, True], "e": {}}.
        let src = "{% set x = {'name': 'f<x>', 'args': [1, 2.0, 'é\\n', none, true], 'e': {}} %}\
                   {{ x | tojson }}|{{ x | tojson(indent=2) }}";
        let t = ChatTemplate::new(src, "j", SpecialTokenStrings::default()).unwrap_or_else(|e| panic!("{e}"));
        let out = t.render(&[], false).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out,
            "{\"name\": \"f<x>\", \"args\": [1, 2.0, \"é\\n\", null, true], \"e\": {}}|{\n  \"name\": \"f<x>\",\n  \
             \"args\": [\n    1,\n    2.0,\n    \"é\\n\",\n    null,\n    true\n  ],\n  \"e\": {}\n}"
        );
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC was a Thursday.
        assert_eq!(strftime(1_709_211_909, "%d %b %Y %H:%M:%S %A %j %%"), "29 Feb 2024 13:05:09 Thursday 060 %");
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(days_from_civil(2024, 2, 29), 19782);
    }

    #[test]
    fn tokenizer_config_accepts_object_tokens_and_template_lists() {
        let cfg = TokenizerConfig::from_json_str(
            r#"{"eos_token": {"content": "</s>", "lstrip": false}, "bos_token": "<s>",
                "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
            "cfg",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.special.eos_token.as_deref(), Some("</s>"));
        assert_eq!(cfg.special.bos_token.as_deref(), Some("<s>"));
        assert_eq!(cfg.chat_template.as_deref(), Some("D"));
        let bad = expect_err(TokenizerConfig::from_json_str(r#"{"chat_template": 3}"#, "cfg"));
        assert!(bad.to_string().contains("chat_template"), "{bad}");
    }
}
