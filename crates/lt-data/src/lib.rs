//! The data pipeline of LazyTrain-rs: dataset files, chat templates, tokenization with loss masks, the
//! grouped train/eval split, sequence packing, shuffled resumable batching, and exact-match scoring.
//!
//! `lt-data` sits beside the compute crates in the layering: it depends on neither Burn nor `lt-model`.
//! It hands the trainer plain vectors ([`TrainBatch`]) and the evaluator plain prompts and answers
//! ([`EvalExample`], [`score`], [`Accuracy`]).
//!
//! The flow:
//! 1. [`tokenizer::load`] gives a [`Tokenizer`] (the model folder's `tokenizer.json`, or the tiny
//!    [`ByteTokenizer`]; [`word_tokenizer::build`] writes a word-level `tokenizer.json` for models
//!    trained from scratch, as the demo does) and its [`ChatTemplate`] (`tokenizer_config.json`'s
//!    `chat_template`, rendered like transformers' `apply_chat_template`; ChatML when absent); a
//!    [`ChatEncoder`] combines them.
//! 2. [`DatasetFile::open`] memory-maps and indexes a JSON-array or JSONL dataset in MetaMathQA, Alpaca,
//!    ShareGPT, messages or pre-tokenized format (detected or forced with [`DatasetFormat`]); or
//!    [`synth::generate`] makes the built-in arithmetic dataset.
//! 3. [`prepare()`] parses, splits by `original_question` ([`GroupSplit`]), tokenizes, masks and truncates,
//!    giving a [`TokenizedDataset`] per side, [`EvalExample`]s and a [`DataReport`].
//! 4. A [`Batcher`] packs or pads shuffled epochs into [`TrainBatch`]es; its [`BatcherState`] resumes
//!    exactly.
//!
//! ```
//! use std::sync::Arc;
//! use lt_data::{
//!     Accuracy, BYTE_SEQ_LEN, BatchMode, Batcher, BatcherConfig, ChatEncoder, MemorySource, PrepareOptions,
//!     TokenizerKind, prepare, synth, tokenizer,
//! };
//!
//! let records = synth::generate(&synth::SynthConfig { groups: 50, ..Default::default() })?;
//! let (tok, template) = tokenizer::load(TokenizerKind::Byte, None)?;
//! let encoder = ChatEncoder::new(tok.clone(), template);
//! let opts = PrepareOptions { seq_len: BYTE_SEQ_LEN, eval_fraction: 0.2, ..Default::default() };
//! let data = prepare(&MemorySource::from_records("synthetic", &records), &encoder, &opts)?;
//!
//! let cfg = BatcherConfig {
//!     batch_size: 4, seq_len: BYTE_SEQ_LEN, mode: BatchMode::Pack, seed: 42, shuffle: true,
//!     pad_id: tok.pad_id().unwrap_or(0),
//! };
//! let mut batcher = Batcher::new(Arc::new(data.train), cfg)?;
//! let batch = batcher.next_batch();
//! assert!(batch.input_ids.iter().all(|row| row.len() == BYTE_SEQ_LEN));
//! assert_eq!(data.report.truncated_examples, 0);
//! assert!(batch.loss_tokens < batch.real_tokens);
//!
//! // Evaluation: generate from `prompt_ids`, decode, score.
//! let mut acc = Accuracy::new();
//! for ex in &data.eval_examples {
//!     let generated = format!("... The answer is: {}", ex.answer); // a perfect model
//!     acc.score_and_record(&generated, ex);
//! }
//! assert_eq!(acc.rate(), 1.0);
//! # Ok::<(), lt_data::DataError>(())
//! ```

pub mod answer;
pub mod batch;
pub mod dataset;
pub mod encode;
pub mod error;
pub mod prepare;
pub use lt_core::rng;
pub mod source;
pub mod split;
pub mod synth;
pub mod template;
pub mod tokenizer;
pub mod word_tokenizer;

#[cfg(test)]
mod testutil;

pub use answer::{Accuracy, EvalExample, Tally, answers_match, extract_answer, score};
pub use batch::{BatchMode, Batcher, BatcherConfig, BatcherState, TrainBatch};
pub use dataset::TokenizedDataset;
pub use encode::{ChatEncoder, EncodedChat, IGNORE_INDEX, TokenizedExample};
pub use error::DataError;
pub use prepare::{DataReport, MemorySource, PrepareOptions, Prepared, SampleSource, prepare};
pub use source::{DatasetFile, DatasetFormat, Sample, SampleBody};
pub use split::{GroupSplit, Side};
pub use synth::{BYTE_SEQ_LEN, MetaMathRecord, SynthConfig, WORD_SEQ_LEN};
pub use template::{ChatTemplate, Message};
pub use tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer, TokenizerKind};
