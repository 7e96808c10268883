//! Prepares a dataset file and prints what the pipeline made of it: record counts, bad records, split,
//! token counts, truncation, packing efficiency and the first evaluation question.
//!
//! ```text
//! cargo run --release -p lt-data --example inspect -- <data.json|jsonl|synthetic> <model-dir|byte> [seq_len] [eval_fraction]
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use lt_data::{
    BatchMode, Batcher, BatcherConfig, ChatEncoder, DatasetFile, DatasetFormat, MemorySource, PrepareOptions,
    SampleSource, TokenizerKind, prepare, synth, tokenizer,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(data), Some(tok)) = (args.first(), args.get(1)) else {
        eprintln!("usage: inspect <data.json|jsonl|synthetic> <model-dir|byte> [seq_len] [eval_fraction]");
        std::process::exit(2);
    };
    let seq_len: usize = args.get(2).map_or(Ok(1024), |s| s.parse())?;
    let eval_fraction: f64 = args.get(3).map_or(Ok(0.3), |s| s.parse())?;

    let (tokenizer, template) = if tok == "byte" {
        tokenizer::load(TokenizerKind::Byte, None)?
    } else {
        tokenizer::load(TokenizerKind::Hf, Some(Path::new(tok)))?
    };
    let encoder = ChatEncoder::new(tokenizer.clone(), template);
    let opts = PrepareOptions { seq_len, eval_fraction, skip_bad_records: true, ..PrepareOptions::default() };

    let t0 = Instant::now();
    let source: Box<dyn SampleSource> = if data == "synthetic" {
        Box::new(MemorySource::from_records("synthetic", &synth::generate(&synth::SynthConfig::default())?))
    } else {
        Box::new(DatasetFile::open(Path::new(data), DatasetFormat::Auto)?)
    };
    println!("indexed {} records in {:.2}s", source.len(), t0.elapsed().as_secs_f64());
    let t1 = Instant::now();
    let prepared = prepare(source.as_ref(), &encoder, &opts)?;
    println!("prepared in {:.2}s", t1.elapsed().as_secs_f64());
    println!("{}", prepared.report.summary());
    for m in &prepared.report.bad_record_messages {
        println!("  bad: {m}");
    }

    let cfg = BatcherConfig {
        batch_size: 8,
        seq_len,
        mode: BatchMode::Pack,
        seed: 42,
        shuffle: true,
        pad_id: tokenizer.pad_id().unwrap_or(0),
    };
    let batcher = Batcher::new(Arc::new(prepared.train), cfg)?;
    let batches = batcher.batches_in_epoch(0);
    let slots = batches * cfg.batch_size * seq_len;
    println!(
        "packing: {batches} batches of {}x{seq_len} per epoch, {:.1}% of slots hold real tokens",
        cfg.batch_size,
        100.0 * batcher.dataset().real_tokens() as f64 / slots.max(1) as f64
    );
    if let Some(e) = prepared.eval_examples.first() {
        println!(
            "first eval question ({}): {:?} -> {:?} ({} prompt tokens)",
            e.kind,
            e.query,
            e.answer,
            e.prompt_ids.len()
        );
    }
    Ok(())
}
