//! Exact-match evaluation: answer extraction, answer equivalence and accuracy per record type.
//!
//! A MetaMathQA response ends with `The answer is: X`. [`extract_answer`] takes the text after the last
//! such marker (up to the end of that line). How two answers are compared depends on the record's type:
//!
//! - **GSM types** (`type` starts with `GSM`): numerically. `$`, thousands commas, `%`, surrounding LaTeX
//!   `$`, a trailing period and any text after the number are ignored; integers, decimals, fractions
//!   (`3/4`, `\frac{3}{4}`) and negatives (`-`, `−`) are parsed exactly as rationals, so `0.75 == 3/4` and
//!   `18.00 == 18`. An answer with no number falls back to the MATH comparison.
//! - **MATH types** (`type` starts with `MATH`): normalised strings ([`normalize_math`]): surrounding `$`,
//!   `\(..\)`, `\[..\]` removed, `\boxed{..}` unwrapped, `\left`/`\right` dropped, `\dfrac`/`\tfrac` ->
//!   `\frac`, `\frac12` -> `\frac{1}{2}`, spacing commands, `^\circ` and `\%` dropped, all whitespace
//!   removed, a trailing period and a trailing `.0`/`.00` removed. Two normalised answers that are both
//!   plain numbers are compared numerically.
//! - **Other types**: numerically when both answers are numbers, else as MATH.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The marker that precedes the final answer.
pub const ANSWER_MARKER: &str = "The answer is:";

/// One held-out question for exact-match evaluation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvalExample {
    /// Ids of the prompt rendered with `add_generation_prompt=true`: generate from here.
    pub prompt_ids: Vec<u32>,
    /// The reference answer (text after `The answer is:` in the reference response).
    pub answer: String,
    /// The record type (e.g. `GSM_Rephrased`, `MATH_AnsAug`); decides how answers are compared.
    pub kind: String,
    /// The question text (the last user message), for reports.
    pub query: String,
}

/// Whether a generated text's answer matches the example's reference answer.
pub fn score(prediction_text: &str, example: &EvalExample) -> bool {
    match extract_answer(prediction_text) {
        Some(pred) => answers_match(pred, &example.answer, &example.kind),
        None => false,
    }
}

/// The text after the last [`ANSWER_MARKER`], up to the end of its line, trimmed; `None` when there is no
/// marker or nothing follows it.
pub fn extract_answer(text: &str) -> Option<&str> {
    let pos = text.rfind(ANSWER_MARKER)?;
    let rest = &text[pos + ANSWER_MARKER.len()..];
    let line = rest.trim_start().split('\n').next().unwrap_or("").trim();
    (!line.is_empty()).then_some(line)
}

/// Whether `prediction` and `reference` (both already extracted) are the same answer for a record type.
pub fn answers_match(prediction: &str, reference: &str, kind: &str) -> bool {
    if kind.starts_with("GSM") {
        if let (Some(a), Some(b)) = (parse_number(prediction), parse_number(reference)) {
            return a == b;
        }
        return math_equal(prediction, reference);
    }
    if kind.starts_with("MATH") {
        return math_equal(prediction, reference);
    }
    match (parse_plain_number(prediction), parse_plain_number(reference)) {
        (Some(a), Some(b)) => a == b,
        _ => math_equal(prediction, reference),
    }
}

fn math_equal(a: &str, b: &str) -> bool {
    let (na, nb) = (normalize_math(a), normalize_math(b));
    if na == nb {
        return true;
    }
    match (parse_plain_number(&na), parse_plain_number(&nb)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

/// An exact rational number `num / den` with `den > 0`, reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rational {
    /// Numerator (carries the sign).
    pub num: i128,
    /// Denominator, positive.
    pub den: i128,
}

impl Rational {
    /// `num / den` reduced; `None` when `den` is zero.
    pub fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1) as i128;
        let sign = if den < 0 { -1 } else { 1 };
        Some(Self { num: sign * num / g, den: sign * den / g })
    }

    fn div(self, other: Self) -> Option<Self> {
        Self::new(self.num.checked_mul(other.den)?, self.den.checked_mul(other.num)?)
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The first number in a GSM-style answer: `$1,234.50 dollars.` -> 2469/2. See the module docs.
pub fn parse_number(text: &str) -> Option<Rational> {
    let s = text.trim().replace("\\$", "").replace(['$', ','], "").replace("\\!", "");
    let s = s.replace('−', "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac");
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let next_digit = bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
        if c.is_ascii_digit() || (c == b'.' && next_digit) {
            return parse_number_at(&s, i, false);
        }
        // Byte-wise checks: `i` may sit inside a multi-byte character, where slicing `s` would panic.
        if c == b'-' && (next_digit || bytes.get(i + 1) == Some(&b'.') || bytes[i + 1..].starts_with(b"\\frac")) {
            return parse_number_at(&s, i + 1, true);
        }
        if bytes[i..].starts_with(b"\\frac") {
            return parse_number_at(&s, i, false);
        }
        i += 1;
    }
    None
}

/// Parses a number (or `\frac{a}{b}`, or `a/b`) starting at byte `i`.
fn parse_number_at(s: &str, i: usize, negative: bool) -> Option<Rational> {
    let rest = &s[i..];
    let value = if let Some(frac) = rest.strip_prefix("\\frac") {
        let (num, after) = braced(frac)?;
        let (den, _) = braced(after)?;
        parse_plain_number(num)?.div(parse_plain_number(den)?)?
    } else {
        let (a, len) = decimal_prefix(rest)?;
        let after = &rest[len..];
        match after.strip_prefix('/').and_then(decimal_prefix) {
            Some((b, _)) => a.div(b)?,
            None => a,
        }
    };
    Some(if negative { Rational { num: -value.num, den: value.den } } else { value })
}

/// `{content}` at the start of `s` (balanced), or a single character as LaTeX allows (`\frac12`).
fn braced(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    if let Some(body) = s.strip_prefix('{') {
        let end = matching_brace(body)?;
        Some((&body[..end], &body[end + 1..]))
    } else {
        let c = s.chars().next()?;
        Some((&s[..c.len_utf8()], &s[c.len_utf8()..]))
    }
}

/// Index of the `}` closing an already opened brace in `s`.
fn matching_brace(s: &str) -> Option<usize> {
    let mut depth = 1usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// An unsigned decimal (`12`, `12.5`, `.5`, `12.`) at the start of `s`: (value, bytes used).
fn decimal_prefix(s: &str) -> Option<(Rational, usize)> {
    let b = s.as_bytes();
    let int_len = b.iter().take_while(|c| c.is_ascii_digit()).count();
    let mut len = int_len;
    let mut frac_len = 0;
    if b.get(len) == Some(&b'.') {
        frac_len = b[len + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if frac_len > 0 || int_len > 0 {
            len += 1 + frac_len;
        }
    }
    if int_len == 0 && frac_len == 0 {
        return None;
    }
    let digits: String = s[..len].chars().filter(char::is_ascii_digit).collect();
    let num: i128 = digits.parse().ok()?;
    let den = 10i128.checked_pow(frac_len as u32)?;
    Some((Rational::new(num, den)?, len))
}

/// A string that is exactly one number (`-12`, `3.50`, `3/4`, `-\frac{1}{2}`), else `None`.
pub fn parse_plain_number(text: &str) -> Option<Rational> {
    let s = text.trim().replace(',', "").replace('−', "-").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac");
    let s = s.trim_end_matches('.');
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let value = if let Some(frac) = body.strip_prefix("\\frac") {
        let (num, after) = braced(frac)?;
        let (den, after) = braced(after)?;
        if !after.trim().is_empty() {
            return None;
        }
        parse_plain_number(num)?.div(parse_plain_number(den)?)?
    } else {
        let (a, len) = decimal_prefix(body)?;
        let after = &body[len..];
        if after.is_empty() {
            a
        } else {
            let den = after.strip_prefix('/')?;
            let (b, blen) = decimal_prefix(den)?;
            if blen != den.len() {
                return None;
            }
            a.div(b)?
        }
    };
    Some(if neg { Rational { num: -value.num, den: value.den } } else { value })
}

/// Normalises a MATH-style answer for string comparison (see the module docs).
pub fn normalize_math(text: &str) -> String {
    let mut s = text.trim().to_string();
    // Surrounding math delimiters, possibly nested with a trailing period: "$x$." or "\(x\)".
    loop {
        let t = s.trim().trim_end_matches('.').trim();
        let stripped = t
            .strip_prefix("$$")
            .and_then(|x| x.strip_suffix("$$"))
            .or_else(|| t.strip_prefix('$').and_then(|x| x.strip_suffix('$')))
            .or_else(|| t.strip_prefix("\\(").and_then(|x| x.strip_suffix("\\)")))
            .or_else(|| t.strip_prefix("\\[").and_then(|x| x.strip_suffix("\\]")));
        match stripped {
            Some(x) => s = x.to_string(),
            None => break,
        }
    }
    s = unwrap_boxed(&s);
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac");
    s = remove_command(&s, "\\left");
    s = remove_command(&s, "\\right");
    for spacing in ["\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad"] {
        s = s.replace(spacing, "");
    }
    for unit in ["^{\\circ}", "^\\circ", "\\%", "%"] {
        s = s.replace(unit, "");
    }
    s.retain(|c| !c.is_whitespace());
    s = fix_fracs(&s);
    while s.ends_with('.') {
        s.pop();
    }
    if let Some(stripped) = strip_zero_decimals(&s) {
        s = stripped;
    }
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    s
}

/// The content of the last `\boxed{...}` (or `\fbox{...}`), or `s` unchanged.
fn unwrap_boxed(s: &str) -> String {
    for cmd in ["\\boxed", "\\fbox"] {
        if let Some(pos) = s.rfind(cmd) {
            let after = s[pos + cmd.len()..].trim_start();
            if let Some(body) = after.strip_prefix('{')
                && let Some(end) = matching_brace(body)
            {
                return body[..end].to_string();
            }
            // `\boxed 5`: the rest of the string.
            return after.trim().to_string();
        }
    }
    s.to_string()
}

/// Removes a LaTeX command word (`\left`) but not longer words that start with it (`\leftarrow`).
fn remove_command(s: &str, cmd: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find(cmd) {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + cmd.len()..];
        if after.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) {
            out.push_str(cmd);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}` (what Hendrycks' MATH normaliser does).
fn fix_fracs(s: &str) -> String {
    let mut parts = s.split("\\frac");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        out.push_str("\\frac");
        let mut chars = part.chars();
        match (chars.next(), chars.clone().next()) {
            (Some('{'), _) | (None, _) => out.push_str(part),
            (Some(a), Some('{')) => {
                out.push('{');
                out.push(a);
                out.push('}');
                out.push_str(chars.as_str());
            }
            (Some(a), Some(b)) => {
                out.push('{');
                out.push(a);
                out.push_str("}{");
                out.push(b);
                out.push('}');
                let mut rest = chars;
                rest.next();
                out.push_str(rest.as_str());
            }
            (Some(a), None) => {
                out.push('{');
                out.push(a);
                out.push('}');
            }
        }
    }
    out
}

/// `12.0` / `12.000` -> `12`; `None` when `s` is not a number with only zero decimals.
fn strip_zero_decimals(s: &str) -> Option<String> {
    let (int, frac) = s.split_once('.')?;
    let digits = int.strip_prefix('-').unwrap_or(int);
    if !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !frac.is_empty()
        && frac.bytes().all(|b| b == b'0')
    {
        Some(int.to_string())
    } else {
        None
    }
}

/// Correct / total counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// Correct answers.
    pub correct: u64,
    /// Questions asked.
    pub total: u64,
}

impl Tally {
    /// `correct / total`, 0 when empty.
    pub fn rate(&self) -> f64 {
        if self.total == 0 { 0.0 } else { self.correct as f64 / self.total as f64 }
    }
}

/// Exact-match accuracy overall and per record type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accuracy {
    /// All questions.
    pub overall: Tally,
    /// Per `type` (e.g. `GSM_AnsAug`).
    pub by_type: BTreeMap<String, Tally>,
}

impl Accuracy {
    /// An empty aggregate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one answer.
    pub fn record(&mut self, kind: &str, correct: bool) {
        for t in [&mut self.overall, self.by_type.entry(kind.to_string()).or_default()] {
            t.total += 1;
            t.correct += u64::from(correct);
        }
    }

    /// Scores `prediction_text` against `example`, records it, and returns whether it was correct.
    pub fn score_and_record(&mut self, prediction_text: &str, example: &EvalExample) -> bool {
        let ok = score(prediction_text, example);
        self.record(&example.kind, ok);
        ok
    }

    /// Adds another aggregate (e.g. from another worker).
    pub fn merge(&mut self, other: &Accuracy) {
        self.overall.correct += other.overall.correct;
        self.overall.total += other.overall.total;
        for (k, t) in &other.by_type {
            let mine = self.by_type.entry(k.clone()).or_default();
            mine.correct += t.correct;
            mine.total += t.total;
        }
    }

    /// Overall exact match in `[0, 1]`.
    pub fn rate(&self) -> f64 {
        self.overall.rate()
    }

    /// One line: `overall 95.42% (n/N); GSM_AnsAug 96.00% (..); ...`.
    pub fn summary(&self) -> String {
        let mut s = format!("overall {:.2}% ({}/{})", 100.0 * self.rate(), self.overall.correct, self.overall.total);
        for (k, t) in &self.by_type {
            s.push_str(&format!("; {k} {:.2}% ({}/{})", 100.0 * t.rate(), t.correct, t.total));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extraction_takes_the_last_marker_and_its_line() {
        assert_eq!(extract_answer("a\nThe answer is: 5\n"), Some("5"));
        assert_eq!(extract_answer("The answer is: 4. No wait.\nThe answer is:  18 apples.  "), Some("18 apples."));
        assert_eq!(extract_answer("The answer is: 7\nExplanation follows"), Some("7"));
        assert_eq!(extract_answer("The answer is 7"), None);
        assert_eq!(extract_answer("The answer is:   \n"), None);
        assert_eq!(extract_answer(""), None);
    }

    /// (prediction, reference, type, expected match).
    const CASES: &[(&str, &str, &str, bool)] = &[
        // GSM: numbers.
        ("18", "18", "GSM_AnsAug", true),
        ("1,234", "1234", "GSM_AnsAug", true),
        ("$1,234.00", "1234", "GSM_Rephrased", true),
        ("\\$18", "18", "GSM_AnsAug", true),
        ("18.", "18", "GSM_AnsAug", true),
        ("18 apples.", "18", "GSM_AnsAug", true),
        ("18 apples and 3 pears", "18", "GSM_AnsAug", true),
        ("0.75", "3/4", "GSM_SV", true),
        ("\\frac{3}{4}", "0.75", "GSM_SV", true),
        ("\\dfrac{6}{8}", "3/4", "GSM_SV", true),
        ("-5", "-5", "GSM_FOBAR", true),
        ("−5", "-5", "GSM_FOBAR", true),
        ("5", "-5", "GSM_FOBAR", false),
        ("-\\frac{1}{2}", "-0.5", "GSM_FOBAR", true),
        ("12.50", "12.5", "GSM_AnsAug", true),
        (".5", "0.5", "GSM_AnsAug", true),
        ("50%", "50", "GSM_AnsAug", true),
        ("$5$", "5", "GSM_AnsAug", true),
        ("17", "18", "GSM_AnsAug", false),
        ("180", "18", "GSM_AnsAug", false),
        ("1.8", "18", "GSM_AnsAug", false),
        ("no idea", "18", "GSM_AnsAug", false),
        ("123456789012345678901234567890", "123456789012345678901234567890", "GSM_AnsAug", true),
        // MATH: normalised strings.
        ("\\frac{1}{2}", "\\frac{1}{2}", "MATH_AnsAug", true),
        ("\\dfrac{1}{2}", "\\frac{1}{2}", "MATH_AnsAug", true),
        ("\\tfrac12", "\\frac{1}{2}", "MATH_AnsAug", true),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "MATH_AnsAug", true),
        ("$\\boxed{x^2+1}$", "x^2 + 1", "MATH_Rephrased", true),
        ("\\left( 1, 2 \\right)", "(1,2)", "MATH_AnsAug", true),
        ("\\leftarrow", "arrow", "MATH_AnsAug", false),
        ("5.0", "5", "MATH_AnsAug", true),
        ("5.", "5", "MATH_AnsAug", true),
        ("$5$.", "5", "MATH_AnsAug", true),
        ("90^\\circ", "90", "MATH_AnsAug", true),
        ("\\sqrt{2}", "\\sqrt{3}", "MATH_AnsAug", false),
        ("\\frac{2}{4}", "\\frac{1}{2}", "MATH_AnsAug", true),
        ("x=2", "2", "MATH_AnsAug", false),
        ("10.00", "10", "MATH_FOBAR", true),
        // Other types: numbers when both are numbers, else strings.
        ("42", "42.0", "alpaca", true),
        ("Paris", " Paris ", "sharegpt", true),
    ];

    #[test]
    fn tricky_answers_compare_as_expected() {
        for &(pred, reference, kind, want) in CASES {
            assert_eq!(answers_match(pred, reference, kind), want, "{pred:?} vs {reference:?} ({kind})");
        }
    }

    #[test]
    fn parsing_and_normalisation_details() {
        assert_eq!(parse_number("-1,000.5 dollars"), Rational::new(-2001, 2));
        assert_eq!(parse_number("x"), None);
        assert_eq!(parse_number("3/0"), None);
        assert_eq!(parse_plain_number("3/4 cup"), None);
        assert_eq!(parse_plain_number("-.25"), Rational::new(-1, 4));
        assert_eq!(normalize_math("$\\boxed{ \\dfrac{a}{b} }$"), "\\frac{a}{b}");
        assert_eq!(normalize_math("\\left[ 0, \\infty \\right)"), "[0,\\infty)");
        assert_eq!(normalize_math("\\frac1{2}"), "\\frac{1}{2}");
        assert_eq!(normalize_math("-3.000"), "-3");
        assert_eq!(normalize_math("3.05"), "3.05");
    }

    /// Regression: byte-wise scanning once sliced a `&str` inside a multi-byte character.
    #[test]
    fn answer_functions_never_panic_on_arbitrary_text() {
        let alphabet: Vec<char> = "0123456789.-−,$/\\{}frac boxed left right€é中😀%^\n".chars().collect();
        let mut rng = crate::rng::SplitMix64::new(11);
        for _ in 0..5000 {
            let len = rng.below(24) as usize;
            let s: String = (0..len).map(|_| *rng.pick(&alphabet).unwrap_or(&'x')).collect();
            for kind in ["GSM_AnsAug", "MATH_AnsAug", "other"] {
                let _ = answers_match(&s, "€5", kind);
                let _ = answers_match("3", &s, kind);
            }
            let _ = extract_answer(&format!("The answer is: {s}"));
            let _ = normalize_math(&s);
            let _ = parse_number(&s);
        }
        assert_eq!(parse_number("€5 or 中-3"), Rational::new(5, 1));
        assert_eq!(parse_number("中-\\frac{1}{4}"), Rational::new(-1, 4));
    }

    #[test]
    fn score_uses_extraction_and_type() {
        let ex =
            EvalExample { prompt_ids: vec![1], answer: "1234".into(), kind: "GSM_AnsAug".into(), query: "q".into() };
        assert!(score("so 1,000 + 234 = 1,234.\nThe answer is: 1,234", &ex));
        assert!(!score("The answer is: 1,235", &ex));
        assert!(!score("1234", &ex), "no marker, no answer");
        let mut acc = Accuracy::new();
        assert!(acc.score_and_record("The answer is: $1234", &ex));
        acc.record("MATH_AnsAug", false);
        acc.record("MATH_AnsAug", true);
        assert_eq!(acc.overall, Tally { correct: 2, total: 3 });
        assert_eq!(acc.by_type["MATH_AnsAug"], Tally { correct: 1, total: 2 });
        let mut sum = acc.clone();
        sum.merge(&acc);
        assert_eq!(sum.by_type["GSM_AnsAug"], Tally { correct: 2, total: 2 });
        assert!((sum.rate() - 4.0 / 6.0).abs() < 1e-12);
        assert!(acc.summary().starts_with("overall 66.67% (2/3); GSM_AnsAug 100.00% (1/1)"));
        let json = serde_json::to_string(&acc).unwrap_or_default();
        let back: Accuracy = serde_json::from_str(&json).unwrap_or_default();
        assert_eq!(back, acc);
    }
}
