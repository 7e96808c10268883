//! From records to training data: parse, split by group, tokenize, mask, truncate, and collect evaluation
//! questions, in parallel and deterministically.
//!
//! [`prepare`] walks the records of a [`SampleSource`] (a [`DatasetFile`] or generated samples) on
//! `threads` workers, each on a contiguous range, and concatenates their results in record order, so the
//! output does not depend on the thread count. For each record:
//!
//! 1. parse it ([`DataError::Malformed`] names the file, line and field);
//! 2. put its group on the train or eval side ([`GroupSplit`]);
//! 3. tokenize and mask it ([`ChatEncoder`]); errors become [`DataError::Record`] with file and line;
//! 4. on the eval side, keep an [`EvalExample`] when the reference response has an answer marker;
//! 5. cut it to `seq_len` tokens, counting what was cut; an example left with no loss token is dropped and
//!    counted.
//!
//! A bad record stops the run with the error of the first bad record in file order, unless
//! `skip_bad_records` is set; then bad records are counted and the first few messages kept for the report.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};

use crate::answer::{EvalExample, extract_answer};
use crate::dataset::TokenizedDataset;
use crate::encode::ChatEncoder;
use crate::error::{DataError, Result};
use crate::rng::mix64;
use crate::source::{DatasetFile, Sample, SampleBody};
use crate::split::{GroupSplit, Side};
use crate::synth::MetaMathRecord;

/// Records that [`prepare`] can read.
pub trait SampleSource: Sync {
    /// The name used in messages (a path).
    fn name(&self) -> &str;
    /// Number of records.
    fn len(&self) -> usize;
    /// Whether there are no records.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Parses record `index`.
    fn sample(&self, index: usize) -> Result<Sample>;
    /// The 1-based line (or record number) of record `index`, for messages.
    fn line(&self, index: usize) -> u64;
}

impl SampleSource for DatasetFile {
    fn name(&self) -> &str {
        self.path()
    }
    fn len(&self) -> usize {
        DatasetFile::len(self)
    }
    fn sample(&self, index: usize) -> Result<Sample> {
        DatasetFile::sample(self, index)
    }
    fn line(&self, index: usize) -> u64 {
        DatasetFile::line(self, index)
    }
}

/// Samples held in memory (e.g. the synthetic dataset); "lines" are 1-based record numbers.
#[derive(Debug, Clone)]
pub struct MemorySource {
    name: String,
    samples: Vec<Sample>,
}

impl MemorySource {
    /// Wraps samples.
    pub fn new(name: &str, samples: Vec<Sample>) -> Self {
        Self { name: name.to_string(), samples }
    }

    /// Wraps MetaMathQA-format records.
    pub fn from_records(name: &str, records: &[MetaMathRecord]) -> Self {
        Self::new(name, records.iter().map(MetaMathRecord::to_sample).collect())
    }
}

impl SampleSource for MemorySource {
    fn name(&self) -> &str {
        &self.name
    }
    fn len(&self) -> usize {
        self.samples.len()
    }
    fn sample(&self, index: usize) -> Result<Sample> {
        self.samples.get(index).cloned().ok_or(DataError::InvalidConfig {
            field: "index",
            reason: format!("record {index} of {} does not exist", self.samples.len()),
        })
    }
    fn line(&self, index: usize) -> u64 {
        index as u64 + 1
    }
}

/// Settings of [`prepare`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrepareOptions {
    /// Longest example in tokens; longer ones are cut (and counted).
    pub seq_len: usize,
    /// Fraction of question groups held out for evaluation, in `[0, 1]` (1: evaluate the whole file).
    pub eval_fraction: f64,
    /// Seed of the grouped split.
    pub split_seed: u64,
    /// Count and skip bad records instead of stopping.
    pub skip_bad_records: bool,
    /// Read only the first N records.
    pub max_records: Option<usize>,
    /// Keep at most N evaluation questions (a deterministic, seed-dependent subset).
    pub max_eval_examples: Option<usize>,
    /// Worker threads; 0 uses the available parallelism.
    pub threads: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        Self {
            seq_len: 1024,
            eval_fraction: 0.0,
            split_seed: 42,
            skip_bad_records: false,
            max_records: None,
            max_eval_examples: None,
            threads: 0,
        }
    }
}

/// Counts describing what [`prepare`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataReport {
    /// The source's name.
    pub source: String,
    /// Records read.
    pub records: usize,
    /// Records skipped as bad (only with `skip_bad_records`).
    pub bad_records: usize,
    /// Messages of the first bad records (at most 10).
    pub bad_record_messages: Vec<String>,
    /// Training examples kept.
    pub train_examples: usize,
    /// Evaluation examples kept (for eval loss).
    pub eval_examples: usize,
    /// Distinct question groups in training.
    pub train_groups: usize,
    /// Distinct question groups in evaluation.
    pub eval_groups: usize,
    /// Examples longer than `seq_len` (cut).
    pub truncated_examples: usize,
    /// Tokens cut off by truncation.
    pub truncated_tokens: usize,
    /// Examples dropped because no loss token was left (e.g. a prompt longer than `seq_len`).
    pub dropped_no_loss: usize,
    /// Training tokens (no padding exists at this stage).
    pub train_real_tokens: usize,
    /// Training labels the loss uses.
    pub train_loss_tokens: usize,
    /// Evaluation tokens.
    pub eval_real_tokens: usize,
    /// Evaluation labels the loss uses.
    pub eval_loss_tokens: usize,
    /// Exact-match questions kept.
    pub eval_questions: usize,
    /// Evaluation records with no `The answer is:` in the reference (no exact-match question).
    pub eval_without_answer: usize,
    /// Exact-match questions left out by `max_eval_examples`.
    pub eval_questions_dropped: usize,
}

impl DataReport {
    /// A short human-readable summary.
    pub fn summary(&self) -> String {
        format!(
            "{}: {} records ({} bad skipped); train {} examples / {} groups / {} tokens ({} loss); eval {} examples / \
             {} groups / {} exact-match questions; {} truncated ({} tokens cut); {} dropped with no loss token",
            self.source,
            self.records,
            self.bad_records,
            self.train_examples,
            self.train_groups,
            self.train_real_tokens,
            self.train_loss_tokens,
            self.eval_examples,
            self.eval_groups,
            self.eval_questions,
            self.truncated_examples,
            self.truncated_tokens,
            self.dropped_no_loss
        )
    }
}

/// The output of [`prepare`].
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Training examples.
    pub train: TokenizedDataset,
    /// Held-out examples (for eval loss).
    pub eval: TokenizedDataset,
    /// Held-out questions for exact match.
    pub eval_examples: Vec<EvalExample>,
    /// What happened.
    pub report: DataReport,
}

const MAX_BAD_MESSAGES: usize = 10;

/// Runs the pipeline described in the module docs.
pub fn prepare(source: &dyn SampleSource, encoder: &ChatEncoder, opts: &PrepareOptions) -> Result<Prepared> {
    if opts.seq_len == 0 {
        return Err(DataError::InvalidConfig { field: "seq_len", reason: "must be at least 1".into() });
    }
    let split = GroupSplit::new(opts.eval_fraction, opts.split_seed)?;
    let n = opts.max_records.map_or(source.len(), |m| m.min(source.len()));
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |p| p.get()),
        t => t,
    }
    .clamp(1, n.max(1));
    let chunk = n.div_ceil(threads).max(1);
    let first_error = AtomicUsize::new(usize::MAX);
    let ctx = Ctx { source, encoder, opts, split, first_error: &first_error };

    let parts: Vec<Part> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let ctx = &ctx;
                let range = (t * chunk).min(n)..((t + 1) * chunk).min(n);
                scope.spawn(move || ctx.run(range))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(p) => p,
                // A worker only panics on a bug in this crate; surface it rather than return partial data.
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    });

    let mut report = DataReport { source: source.name().to_string(), records: n, ..DataReport::default() };
    let mut first: Option<(usize, DataError)> = None;
    let mut train = TokenizedDataset::new();
    let mut eval = TokenizedDataset::new();
    let mut eval_examples: Vec<(usize, EvalExample)> = Vec::new();
    let mut train_groups = HashSet::new();
    let mut eval_groups = HashSet::new();
    for part in parts {
        if let Some((i, e)) = part.error
            && first.as_ref().is_none_or(|(j, _)| i < *j)
        {
            first = Some((i, e));
        }
        report.bad_records += part.bad_records;
        for m in part.bad_messages {
            if report.bad_record_messages.len() < MAX_BAD_MESSAGES {
                report.bad_record_messages.push(m);
            }
        }
        report.truncated_examples += part.truncated_examples;
        report.truncated_tokens += part.truncated_tokens;
        report.dropped_no_loss += part.dropped_no_loss;
        report.eval_without_answer += part.eval_without_answer;
        // Moving the first part's data instead of copying it keeps the peak near 1.5x the token storage.
        if train.is_empty() {
            train = part.train;
        } else {
            train.append(&part.train);
        }
        if eval.is_empty() {
            eval = part.eval;
        } else {
            eval.append(&part.eval);
        }
        eval_examples.extend(part.eval_examples);
        train_groups.extend(part.train_groups);
        eval_groups.extend(part.eval_groups);
    }
    if let Some((_, e)) = first {
        return Err(e);
    }
    if let Some(max) = opts.max_eval_examples
        && eval_examples.len() > max
    {
        // A seed-dependent subset spread over the whole file (MetaMathQA is sorted by type), in file order.
        let seed = mix64(opts.split_seed);
        eval_examples.sort_by_key(|(i, _)| mix64(*i as u64 ^ seed));
        report.eval_questions_dropped = eval_examples.len() - max;
        eval_examples.truncate(max);
        eval_examples.sort_by_key(|(i, _)| *i);
    }
    report.train_examples = train.len();
    report.eval_examples = eval.len();
    report.train_groups = train_groups.len();
    report.eval_groups = eval_groups.len();
    report.train_real_tokens = train.real_tokens();
    report.train_loss_tokens = train.loss_tokens();
    report.eval_real_tokens = eval.real_tokens();
    report.eval_loss_tokens = eval.loss_tokens();
    report.eval_questions = eval_examples.len();
    // An all-eval split (eval_fraction 1: `lt eval` on a test file) needs questions, not training data.
    let nothing = if opts.eval_fraction >= 1.0 { eval_examples.is_empty() } else { train.is_empty() };
    if nothing {
        return Err(DataError::EmptyDataset {
            source_name: report.source.clone(),
            records: report.records,
            bad_records: report.bad_records,
            eval_records: report.eval_examples,
        });
    }
    Ok(Prepared { train, eval, eval_examples: eval_examples.into_iter().map(|(_, e)| e).collect(), report })
}

struct Ctx<'a> {
    source: &'a dyn SampleSource,
    encoder: &'a ChatEncoder,
    opts: &'a PrepareOptions,
    split: GroupSplit,
    first_error: &'a AtomicUsize,
}

/// One worker's results.
#[derive(Default)]
struct Part {
    train: TokenizedDataset,
    eval: TokenizedDataset,
    eval_examples: Vec<(usize, EvalExample)>,
    train_groups: HashSet<u64>,
    eval_groups: HashSet<u64>,
    bad_records: usize,
    bad_messages: Vec<String>,
    truncated_examples: usize,
    truncated_tokens: usize,
    dropped_no_loss: usize,
    eval_without_answer: usize,
    error: Option<(usize, DataError)>,
}

impl Ctx<'_> {
    fn run(&self, range: std::ops::Range<usize>) -> Part {
        let mut part = Part::default();
        for i in range {
            // Records after an already failed one need not be processed: the earliest error wins.
            if !self.opts.skip_bad_records && i > self.first_error.load(Ordering::Relaxed) {
                break;
            }
            if let Err(e) = self.record(i, &mut part) {
                if self.opts.skip_bad_records && e.is_record_error() {
                    part.bad_records += 1;
                    if part.bad_messages.len() < MAX_BAD_MESSAGES {
                        part.bad_messages.push(e.to_string());
                    }
                } else {
                    self.first_error.fetch_min(i, Ordering::Relaxed);
                    part.error = Some((i, e));
                    break;
                }
            }
        }
        part
    }

    fn record(&self, i: usize, part: &mut Part) -> Result<()> {
        let sample = self.source.sample(i)?;
        let wrap = |e: DataError| DataError::Record {
            path: self.source.name().to_string(),
            line: self.source.line(i),
            source: Box::new(e),
        };
        let group = GroupSplit::group_hash(&sample.group);
        let side = self.split.side_of_hash(group);
        let (mut example, eval_example) = match &sample.body {
            SampleBody::Chat(messages) => {
                let enc = self.encoder.encode_chat(messages).map_err(wrap)?;
                let eval_example = match (side, enc.prompt_len, messages.last()) {
                    (Side::Eval, Some(prompt_len), Some(last)) => extract_answer(&last.content).map(|answer| {
                        let query = messages.iter().rev().find(|m| m.role == "user").map_or("", |m| &m.content);
                        EvalExample {
                            prompt_ids: enc.example.input_ids[..prompt_len].to_vec(),
                            answer: answer.to_string(),
                            kind: sample.kind.clone(),
                            query: query.to_string(),
                        }
                    }),
                    _ => None,
                };
                (enc.example, eval_example)
            }
            SampleBody::Tokens { input_ids, labels } => {
                (self.encoder.encode_tokens(input_ids.clone(), labels.clone()).map_err(wrap)?, None)
            }
        };
        if side == Side::Eval {
            match eval_example {
                Some(e) => part.eval_examples.push((i, e)),
                None => part.eval_without_answer += 1,
            }
        }
        let cut = example.truncate(self.opts.seq_len);
        if cut > 0 {
            part.truncated_examples += 1;
            part.truncated_tokens += cut;
        }
        if example.loss_tokens() == 0 {
            part.dropped_no_loss += 1;
            return Ok(());
        }
        match side {
            Side::Train => {
                part.train.push(&example);
                part.train_groups.insert(group);
            }
            Side::Eval => {
                part.eval.push(&example);
                part.eval_groups.insert(group);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::source::DatasetFormat;
    use crate::synth::{SynthConfig, generate};
    use crate::testutil::expect_err;
    use crate::tokenizer::{ByteTokenizer, Tokenizer};

    fn byte_encoder() -> ChatEncoder {
        ChatEncoder::new(Arc::new(ByteTokenizer), ByteTokenizer::chat_template())
    }

    fn opts(eval_fraction: f64, skip: bool, threads: usize) -> PrepareOptions {
        PrepareOptions {
            seq_len: 512,
            eval_fraction,
            split_seed: 3,
            skip_bad_records: skip,
            threads,
            ..PrepareOptions::default()
        }
    }

    #[test]
    fn synthetic_data_splits_by_group_without_leaks_and_is_thread_count_independent() {
        let records =
            generate(&SynthConfig { groups: 300, ..SynthConfig::default() }).unwrap_or_else(|e| panic!("{e}"));
        let src = MemorySource::from_records("synth", &records);
        let enc = byte_encoder();
        let one = prepare(&src, &enc, &opts(0.2, false, 1)).unwrap_or_else(|e| panic!("{e}"));
        let three = prepare(&src, &enc, &opts(0.2, false, 3)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(one.report, three.report);
        assert_eq!(one.eval_examples, three.eval_examples);
        assert_eq!(one.train.fingerprint(), three.train.fingerprint());
        let r = &one.report;
        assert_eq!(r.train_examples + r.eval_examples, records.len());
        assert_eq!(r.train_groups + r.eval_groups, 300);
        assert!((40..=80).contains(&r.eval_groups), "about 20% of 300 groups: {}", r.eval_groups);
        assert_eq!(r.eval_questions, r.eval_examples, "every synthetic response has an answer");
        // No eval question's group appears in training: compare the decoded prompts' original questions.
        let split = GroupSplit::new(0.2, 3).unwrap_or_else(|e| panic!("{e}"));
        let eval_queries: HashSet<&str> = one.eval_examples.iter().map(|e| e.query.as_str()).collect();
        for rec in &records {
            let held_out = split.side(&rec.original_question) == Side::Eval;
            assert_eq!(eval_queries.contains(rec.query.as_str()), held_out, "{}", rec.query);
        }
        // Prompts decode to the ChatML generation prompt of the query.
        let e = &one.eval_examples[0];
        let text = ByteTokenizer.decode(&e.prompt_ids, false).unwrap_or_default();
        assert_eq!(text, format!("<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", e.query));
        assert_eq!(r.train_real_tokens, one.train.real_tokens());
        assert!(r.train_loss_tokens < r.train_real_tokens);
    }

    #[test]
    fn bad_records_stop_the_run_with_file_and_line_or_are_counted() {
        let text = "{\"query\": \"q1\", \"response\": \"The answer is: 1\"}\n\
                    {\"query\": \"q2\"}\n\
                    {\"query\": \"q3\", \"response\": \"The answer is: 3\"}\n\
                    not json\n\
                    {\"query\": \"q5\", \"response\": \"The answer is: 5\"}\n";
        let file = DatasetFile::from_vec("data.jsonl", text.as_bytes().to_vec(), DatasetFormat::Auto)
            .unwrap_or_else(|e| panic!("{e}"));
        let enc = byte_encoder();
        for threads in [1, 2, 5] {
            let err = expect_err(prepare(&file, &enc, &opts(0.0, false, threads)));
            assert_eq!(err.to_string(), "data.jsonl:2: field `response`: missing", "threads {threads}");
        }
        let ok = prepare(&file, &enc, &opts(0.0, true, 2)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.report.bad_records, 2);
        assert_eq!(ok.report.train_examples, 3);
        assert_eq!(ok.report.bad_record_messages.len(), 2);
        assert!(ok.report.bad_record_messages[1].starts_with("data.jsonl:4: invalid JSON"));
    }

    #[test]
    fn encoding_errors_name_the_record() {
        // A record with no assistant turn (prompt-only training off) is a bad record at its line.
        let text = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}\n\
                    {\"messages\": [{\"role\": \"user\", \"content\": \"only a question\"}]}\n";
        let file = DatasetFile::from_vec("m.jsonl", text.as_bytes().to_vec(), DatasetFormat::Auto)
            .unwrap_or_else(|e| panic!("{e}"));
        let err = expect_err(prepare(&file, &byte_encoder(), &opts(0.0, false, 1)));
        assert!(matches!(err, DataError::Record { line: 2, .. }), "{err}");
        assert_eq!(err.to_string(), "m.jsonl:2: the conversation has no assistant message to train on");
        let with_prompt = byte_encoder().with_train_on_prompt(true);
        let ok = prepare(&file, &with_prompt, &opts(0.0, false, 1)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.report.train_examples, 2);
    }

    #[test]
    fn truncation_is_counted_and_prompt_only_leftovers_are_dropped() {
        let long_answer = format!("{} The answer is: 1", "x".repeat(100));
        let samples = vec![
            Sample::chat("short", "The answer is: 2", "GSM_AnsAug", "g1"),
            Sample::chat("q", &long_answer, "GSM_AnsAug", "g2"),
            Sample::chat(&"p".repeat(200), "The answer is: 3", "GSM_AnsAug", "g3"),
        ];
        let src = MemorySource::new("mem", samples);
        let mut o = opts(0.0, false, 1);
        o.seq_len = 64;
        let p = prepare(&src, &byte_encoder(), &o).unwrap_or_else(|e| panic!("{e}"));
        let full_len = |q: &str, a: &str| {
            let text = format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n");
            ByteTokenizer.encode(&text).map(|ids| ids.len()).unwrap_or(0)
        };
        let full2 = full_len("q", &long_answer);
        let full3 = full_len(&"p".repeat(200), "The answer is: 3");
        assert_eq!(p.report.truncated_examples, 2);
        assert_eq!(p.report.truncated_tokens, (full2 - 64) + (full3 - 64));
        assert_eq!(p.report.dropped_no_loss, 1, "the 200-byte prompt leaves no response token");
        assert_eq!(p.train.len(), 2);
        assert_eq!(p.train.max_len(), 64);
    }

    #[test]
    fn max_eval_examples_keeps_a_deterministic_subset_in_file_order() {
        let records =
            generate(&SynthConfig { groups: 200, ..SynthConfig::default() }).unwrap_or_else(|e| panic!("{e}"));
        let src = MemorySource::from_records("synth", &records);
        let mut o = opts(0.5, false, 2);
        o.max_eval_examples = Some(10);
        let a = prepare(&src, &byte_encoder(), &o).unwrap_or_else(|e| panic!("{e}"));
        let b = prepare(&src, &byte_encoder(), &o).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.eval_examples.len(), 10);
        assert_eq!(a.eval_examples, b.eval_examples);
        assert_eq!(a.report.eval_questions_dropped + 10, a.report.eval_examples);
        let pos: Vec<usize> =
            a.eval_examples.iter().filter_map(|e| records.iter().position(|r| r.query == e.query)).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]), "file order: {pos:?}");
        assert!(pos[9] - pos[0] > 100, "spread over the file: {pos:?}");
    }

    #[test]
    fn empty_or_all_eval_data_is_an_error() {
        let src = MemorySource::new("empty", vec![]);
        assert!(matches!(prepare(&src, &byte_encoder(), &opts(0.0, false, 0)), Err(DataError::EmptyDataset { .. })));
        assert!(prepare(&src, &byte_encoder(), &opts(1.0, false, 0)).is_err());
    }

    /// `eval_fraction` 1 (a whole test file for `lt eval`) keeps every question and needs no training data.
    #[test]
    fn all_eval_split_keeps_every_question() {
        let records = crate::synth::generate(&crate::SynthConfig { groups: 20, ..Default::default() })
            .unwrap_or_else(|e| panic!("{e}"));
        let src = MemorySource::from_records("synthetic", &records);
        let p = prepare(&src, &byte_encoder(), &opts(1.0, false, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert!(p.train.is_empty());
        assert_eq!(p.report.eval_groups, 20);
        assert_eq!(p.eval_examples.len(), p.report.eval_questions);
        assert!(!p.eval_examples.is_empty());
    }
}
