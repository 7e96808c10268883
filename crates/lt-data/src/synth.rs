//! A built-in, deterministic, MetaMathQA-format arithmetic dataset for the embedded demo.
//!
//! Each group is one small word problem: a person starts with some objects and gains or loses some in
//! two or three steps. Its rewrites share the numbers and the answer but phrase the question differently:
//! rewrite 0 uses the canonical wording (type `GSM_AnsAug`, like MetaMathQA's answer augmentations of
//! the original question), the others use other wordings (type `GSM_Rephrased`). `original_question` is
//! the canonical wording, so the grouped split keeps all rewrites on one side.
//!
//! It is built to be learnable in minutes by a model of a few hundred thousand parameters on a CPU: by
//! default values stay in `0..=20` (starts 2-9, changes 1-5); names, objects and verbs come from small
//! fixed lists, and the verbs of one problem are distinct; and the response always has the same shape,
//! one line per step, so every number in it is either copied ("verb amount" from the question, the
//! previous result from the line above) or a one-step sum or difference:
//!
//! ```text
//! buys 5: 8 + 5 = 13.
//! gives away 4: 13 - 4 = 9.
//! The answer is: 9
//! ```
//!
//! Measured learnability (PyTorch probe, a 2-layer 128-wide Qwen3 of 0.36M parameters, batch 32 examples,
//! AdamW lr 3e-3 with 20 warmup steps and cosine decay, greedy exact match on 100 held-out questions):
//! with the word-level tokenizer of [`crate::word_tokenizer`], 97% after 200 steps (~390K tokens) and 100%
//! after 400; a 120-step schedule reached 68%. With byte tokens and a longer response (the name repeated
//! and a first line restating the start) a 4-layer model needed ~2,500 steps of 32 rows for 80%. With
//! values up to 50 and repeated verbs, a byte-level run was at 0.2% after 700 steps. Larger ranges are
//! available through [`SynthConfig`].
//!
//! The generator uses [`SplitMix64`], so a seed gives the same records on every machine.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::rng::SplitMix64;
use crate::source::Sample;

/// A record in MetaMathQA's format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaMathRecord {
    /// The question.
    pub query: String,
    /// The worked solution, ending in `The answer is: N`.
    pub response: String,
    /// `GSM_AnsAug` or `GSM_Rephrased`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The canonical wording of the question (the group key).
    pub original_question: String,
}

impl MetaMathRecord {
    /// The record as a chat sample (user query, assistant response).
    pub fn to_sample(&self) -> Sample {
        Sample::chat(&self.query, &self.response, &self.kind, &self.original_question)
    }
}

/// A row length that holds every default-settings example rendered with ChatML and tokenized with
/// [`crate::ByteTokenizer`] (the longest is 232 tokens), so nothing is truncated.
pub const BYTE_SEQ_LEN: usize = 240;

/// The longest default-settings example rendered with ChatML and tokenized with the word-level tokenizer
/// that [`crate::word_tokenizer::build`] makes from the records: a row of at least this many tokens
/// truncates nothing.
pub const WORD_SEQ_LEN: usize = 80;

/// Generator settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynthConfig {
    /// Number of distinct problems (groups).
    pub groups: usize,
    /// Records per problem (the first canonical, the rest rephrased).
    pub rewrites_per_group: usize,
    /// Seed.
    pub seed: u64,
    /// Fewest steps per problem (at least 1).
    pub min_steps: usize,
    /// Most steps per problem.
    pub max_steps: usize,
    /// Largest starting amount (the smallest is 2).
    pub max_start: u32,
    /// Largest amount gained or lost in one step (the smallest is 1).
    pub max_delta: u32,
    /// Largest value any intermediate result may take.
    pub max_value: u32,
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self {
            groups: 3000,
            rewrites_per_group: 3,
            seed: 0,
            min_steps: 2,
            max_steps: 3,
            max_start: 9,
            max_delta: 5,
            max_value: 20,
        }
    }
}

const PEOPLE: [(&str, &str); 8] = [
    ("Tom", "he"),
    ("Anna", "she"),
    ("Ben", "he"),
    ("Mia", "she"),
    ("Sam", "he"),
    ("Lily", "she"),
    ("Max", "he"),
    ("Emma", "she"),
];
const OBJECTS: [&str; 8] = ["apples", "pens", "books", "cards", "coins", "stickers", "marbles", "cookies"];
const GAIN: [&str; 3] = ["buys", "finds", "gets"];
const LOSE: [&str; 3] = ["gives away", "loses", "sells"];

/// One step: gain or lose `amount`.
#[derive(Debug, Clone, Copy)]
struct Step {
    gain: bool,
    verb: &'static str,
    amount: u32,
}

/// One problem: everything its rewrites share.
#[derive(Debug, Clone)]
struct Problem {
    name: &'static str,
    pronoun: &'static str,
    object: &'static str,
    start: u32,
    steps: Vec<Step>,
}

impl Problem {
    fn random(rng: &mut SplitMix64, cfg: &SynthConfig) -> Self {
        let &(name, pronoun) = rng.pick(&PEOPLE).unwrap_or(&PEOPLE[0]);
        let object = *rng.pick(&OBJECTS).unwrap_or(&OBJECTS[0]);
        let start = rng.range_inclusive(2, u64::from(cfg.max_start.max(2))) as u32;
        let n_steps = rng.range_inclusive(cfg.min_steps.max(1) as u64, cfg.max_steps.max(cfg.min_steps.max(1)) as u64);
        let mut value = start;
        let mut steps = Vec::new();
        for _ in 0..n_steps {
            let max_delta = cfg.max_delta.max(1);
            let can_gain = value < cfg.max_value;
            let can_lose = value >= 1;
            let gain = match (can_gain, can_lose) {
                (true, true) => rng.below(2) == 0,
                (gain, _) => gain,
            };
            let limit = if gain { max_delta.min(cfg.max_value - value) } else { max_delta.min(value) };
            let amount = rng.range_inclusive(1, u64::from(limit.max(1))) as u32;
            // Verbs are distinct within a problem (while the lists last): the response copies "verb amount"
            // from the question step by step, and a repeated verb would make that copy ambiguous. In a
            // probe this ambiguity capped a tiny model's accuracy on copied numbers near 86%.
            let list: &[&'static str] = if gain { &GAIN } else { &LOSE };
            let unused: Vec<&'static str> =
                list.iter().copied().filter(|v| !steps.iter().any(|s: &Step| s.verb == *v)).collect();
            let pool: &[&'static str] = if unused.is_empty() { list } else { &unused };
            let verb = *rng.pick(pool).unwrap_or(&list[0]);
            value = if gain { value + amount } else { value - amount };
            steps.push(Step { gain, verb, amount });
        }
        Self { name, pronoun, object, start, steps }
    }

    fn answer(&self) -> u32 {
        self.steps.iter().fold(self.start, |v, s| if s.gain { v + s.amount } else { v - s.amount })
    }

    /// "buys 7 more, loses 2 and gives away 5"
    fn actions(&self) -> String {
        let parts: Vec<String> = self
            .steps
            .iter()
            .map(|s| if s.gain { format!("{} {} more", s.verb, s.amount) } else { format!("{} {}", s.verb, s.amount) })
            .collect();
        match parts.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    fn question(&self, wording: usize) -> String {
        let (n, o, s) = (self.name, self.object, self.start);
        let p = capitalize(self.pronoun);
        let a = self.actions();
        match wording {
            0 => format!("{n} has {s} {o}. {p} {a}. How many {o} does {n} have?"),
            1 => format!("{n} starts with {s} {o}. Then {} {a}. How many {o} does {n} have now?", self.pronoun),
            2 => format!("There are {s} {o} in {n}'s bag. {n} {a}. How many {o} are in {n}'s bag now?"),
            _ => format!("{n} owns {s} {o}. {p} {a}. What is the number of {o} {n} has now?"),
        }
    }

    fn response(&self) -> String {
        let mut out = String::new();
        let mut v = self.start;
        for s in &self.steps {
            let (op, next) = if s.gain { ('+', v + s.amount) } else { ('-', v - s.amount) };
            out.push_str(&format!("{} {}: {v} {op} {} = {next}.\n", s.verb, s.amount, s.amount));
            v = next;
        }
        out.push_str(&format!("The answer is: {v}"));
        out
    }
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// Number of question wordings (wording 0 is canonical).
const WORDINGS: usize = 4;

/// Generates the dataset: `groups * rewrites_per_group` records, rewrites of a group adjacent.
pub fn generate(cfg: &SynthConfig) -> Result<Vec<MetaMathRecord>> {
    if cfg.rewrites_per_group == 0 || cfg.groups == 0 {
        return Err(DataError::InvalidConfig {
            field: "synth",
            reason: "groups and rewrites_per_group must be >= 1".into(),
        });
    }
    if cfg.max_value < cfg.max_start.max(2) {
        return Err(DataError::InvalidConfig { field: "synth.max_value", reason: "must be >= max_start".into() });
    }
    let mut rng = SplitMix64::new(cfg.seed);
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(cfg.groups * cfg.rewrites_per_group);
    let mut attempts = 0usize;
    while seen.len() < cfg.groups {
        attempts += 1;
        if attempts > cfg.groups.saturating_mul(20) + 1000 {
            return Err(DataError::InvalidConfig {
                field: "synth.groups",
                reason: format!("only {} distinct problems exist for these settings", seen.len()),
            });
        }
        let problem = Problem::random(&mut rng, cfg);
        let original = problem.question(0);
        if !seen.insert(original.clone()) {
            continue;
        }
        let response = problem.response();
        // Rephrased rewrites use the other wordings, in a per-group random rotation.
        let offset = rng.below((WORDINGS - 1) as u64) as usize;
        for r in 0..cfg.rewrites_per_group {
            let (wording, kind) =
                if r == 0 { (0, "GSM_AnsAug") } else { (1 + (offset + r - 1) % (WORDINGS - 1), "GSM_Rephrased") };
            out.push(MetaMathRecord {
                query: problem.question(wording),
                response: response.clone(),
                kind: kind.to_string(),
                original_question: original.clone(),
            });
        }
        debug_assert_eq!(response.rsplit(' ').next(), Some(problem.answer().to_string().as_str()));
    }
    Ok(out)
}

/// The records as a MetaMathQA-style JSON array (what [`crate::DatasetFile`] reads).
pub fn to_json_array(records: &[MetaMathRecord]) -> String {
    // Serialising plain strings cannot fail; an empty array is the only conceivable fallback.
    serde_json::to_string_pretty(records).unwrap_or_else(|_| "[]".to_string())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::answer::{answers_match, extract_answer};

    #[test]
    fn records_are_deterministic_grouped_and_correct() {
        let cfg = SynthConfig { groups: 500, ..SynthConfig::default() };
        let a = generate(&cfg).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a, generate(&cfg).unwrap_or_else(|e| panic!("{e}")));
        assert_ne!(a, generate(&SynthConfig { seed: 1, ..cfg }).unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(a.len(), 1500);
        let mut groups: HashMap<&str, Vec<&MetaMathRecord>> = HashMap::new();
        for r in &a {
            groups.entry(r.original_question.as_str()).or_default().push(r);
        }
        assert_eq!(groups.len(), 500);
        for (orig, recs) in &groups {
            assert_eq!(recs.len(), 3);
            assert_eq!(recs.iter().filter(|r| r.kind == "GSM_AnsAug").count(), 1);
            assert!(recs.iter().all(|r| r.kind == "GSM_AnsAug" || r.kind == "GSM_Rephrased"));
            let canonical = recs.iter().find(|r| r.kind == "GSM_AnsAug").map(|r| r.query.as_str());
            assert_eq!(canonical, Some(*orig));
            let queries: HashSet<&str> = recs.iter().map(|r| r.query.as_str()).collect();
            assert_eq!(queries.len(), 3, "rewrites are worded differently");
            let answers: HashSet<&str> = recs.iter().filter_map(|r| extract_answer(&r.response)).collect();
            assert_eq!(answers.len(), 1, "rewrites share the answer");
        }
        for r in &a {
            check_arithmetic(r);
            // Verbs within one problem are distinct (at most 3 steps, 3 verbs per kind).
            let lines: Vec<&str> = r.response.lines().collect();
            // "gives away 4: 13 - 4 = 9." -> "gives away"
            let verbs: Vec<String> = lines[..lines.len() - 1]
                .iter()
                .filter_map(|l| l.split(": ").next())
                .map(|head| {
                    let words: Vec<&str> = head.split(' ').collect();
                    words[..words.len() - 1].join(" ")
                })
                .collect();
            let distinct: HashSet<&String> = verbs.iter().collect();
            assert_eq!(distinct.len(), verbs.len(), "{}", r.response);
        }
    }

    /// Re-derives every step of a response from its question's numbers.
    fn check_arithmetic(r: &MetaMathRecord) {
        let lines: Vec<&str> = r.response.lines().collect();
        assert!((3..=4).contains(&lines.len()), "{}", r.response);
        let mut value: Option<i64> = None;
        for line in &lines[..lines.len() - 1] {
            let eq = line.split(": ").nth(1).unwrap_or_else(|| panic!("{line}")).trim_end_matches('.');
            let toks: Vec<&str> = eq.split(' ').collect();
            let (a, op, b, res): (i64, &str, i64, i64) =
                (toks[0].parse().unwrap_or(-1), toks[1], toks[2].parse().unwrap_or(-1), toks[4].parse().unwrap_or(-1));
            if let Some(v) = value {
                assert_eq!(a, v, "steps chain");
            }
            assert_eq!(if op == "+" { a + b } else { a - b }, res, "{line}");
            assert!((0..=20).contains(&res));
            assert!((1..=5).contains(&b));
            assert!(r.query.contains(&format!(" {b}")), "the operand {b} is in the question: {}", r.query);
            value = Some(res);
        }
        let answer = extract_answer(&r.response).unwrap_or_default();
        assert!(answers_match(answer, &value.unwrap_or(-1).to_string(), &r.kind));
    }

    fn longest_encoded(enc: &crate::ChatEncoder, recs: &[MetaMathRecord]) -> usize {
        recs.iter()
            .map(|r| match &r.to_sample().body {
                crate::SampleBody::Chat(m) => enc.encode_chat(m).map(|e| e.example.len()).unwrap_or(usize::MAX),
                crate::SampleBody::Tokens { .. } => usize::MAX,
            })
            .max()
            .unwrap_or(usize::MAX)
    }

    #[test]
    fn default_examples_fit_the_suggested_seq_lens() {
        use std::sync::Arc;
        let recs = generate(&SynthConfig::default()).unwrap_or_else(|e| panic!("{e}"));
        let bytes = crate::ChatEncoder::new(Arc::new(crate::ByteTokenizer), crate::ByteTokenizer::chat_template());
        let longest = longest_encoded(&bytes, &recs);
        assert!(longest <= BYTE_SEQ_LEN, "{longest}");
        assert!(longest > BYTE_SEQ_LEN - 16, "the constant is not far too large: {longest}");
        let files = crate::word_tokenizer::build(recs.iter().flat_map(|r| [r.query.as_str(), r.response.as_str()]));
        let (tok, template) = files.load().unwrap_or_else(|e| panic!("{e}"));
        let longest = longest_encoded(&crate::ChatEncoder::new(tok, template), &recs);
        assert!(longest <= WORD_SEQ_LEN, "{longest}");
        assert!(longest > WORD_SEQ_LEN - 8, "the constant is not far too large: {longest}");
    }

    #[test]
    fn json_array_round_trips_through_the_metamathqa_reader() {
        let recs = generate(&SynthConfig { groups: 20, ..SynthConfig::default() }).unwrap_or_else(|e| panic!("{e}"));
        let json = to_json_array(&recs);
        let file = crate::source::DatasetFile::from_vec("synth.json", json.into_bytes(), crate::DatasetFormat::Auto)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(file.format(), crate::DatasetFormat::MetaMathQa);
        assert_eq!(file.len(), recs.len());
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(file.sample(i).unwrap_or_else(|e| panic!("{e}")), r.to_sample());
        }
    }

    #[test]
    fn invalid_settings_are_refused() {
        assert!(generate(&SynthConfig { groups: 0, ..SynthConfig::default() }).is_err());
        assert!(generate(&SynthConfig { rewrites_per_group: 0, ..SynthConfig::default() }).is_err());
        // Too few distinct problems for the requested count.
        let tiny = SynthConfig {
            groups: 100_000,
            max_start: 2,
            max_delta: 1,
            min_steps: 1,
            max_steps: 1,
            max_value: 3,
            ..SynthConfig::default()
        };
        assert!(generate(&tiny).is_err());
    }
}
