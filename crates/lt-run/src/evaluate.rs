//! Exact-match evaluation shared by `lt eval` and `lt train --eval-every`.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use burn::tensor::backend::Backend;
use lt_data::{Accuracy, ChatEncoder, EvalExample, Tokenizer, TokenizerKind};
use lt_model::generate::generate_greedy_with;
use lt_model::stream::ForwardWeights;
use serde::Serialize;

/// The tokenizer and chat template of a model folder (`tokenizer.json`, `tokenizer_config.json`).
/// A tokenizer with more tokens than the model's `vocab_size` (`vocab`) is refused here, naming both
/// files, rather than at the first batch that holds one of the extra ids.
pub fn encoder_for(model_dir: &Path, vocab: usize) -> Result<ChatEncoder> {
    if !model_dir.join("tokenizer.json").exists() {
        anyhow::bail!("{}: no tokenizer.json: cannot tokenize text for this model", model_dir.display());
    }
    let (tok, template) = lt_data::tokenizer::load(TokenizerKind::Hf, Some(model_dir))
        .with_context(|| format!("{}: loading the tokenizer", model_dir.display()))?;
    if tok.vocab_size() > vocab {
        anyhow::bail!(
            "{}: the tokenizer has {} tokens, but config.json's vocab_size is {vocab}: this tokenizer is not the model's",
            model_dir.join("tokenizer.json").display(),
            tok.vocab_size()
        );
    }
    Ok(ChatEncoder::new(tok, template))
}

/// One scored prediction (a line of predictions.jsonl).
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    /// The question.
    pub query: String,
    /// Record type.
    pub kind: String,
    /// Reference answer.
    pub answer: String,
    /// Generated text.
    pub generated: String,
    /// Extracted answer, if any.
    pub extracted: Option<String>,
    /// Exact match.
    pub correct: bool,
}

/// Greedy-generate for every example (in batches) and score it. `model` is a whole `DeviceModel`
/// (`&mut &model`) or a model streamed from host memory (`lt_model::stream::Streamed`), which
/// uploads every layer once per decoding step for the whole batch.
pub fn evaluate<B: Backend, W: ForwardWeights<B> + ?Sized>(
    model: &mut W,
    tokenizer: &Arc<dyn Tokenizer>,
    stop: Option<u32>,
    examples: &[EvalExample],
    max_new_tokens: usize,
    batch_size: usize,
    mut progress: impl FnMut(usize),
) -> Result<(Accuracy, Vec<Prediction>)> {
    let mut acc = Accuracy::new();
    let mut preds = Vec::with_capacity(examples.len());
    let stops: Vec<u32> = stop.into_iter().collect();
    for chunk in examples.chunks(batch_size.max(1)) {
        let prompts: Vec<Vec<u32>> = chunk.iter().map(|e| e.prompt_ids.clone()).collect();
        let outs = generate_greedy_with(model, &prompts, max_new_tokens, &stops);
        for (ex, out) in chunk.iter().zip(outs) {
            let text = tokenizer.decode(&out, true).context("decoding a generation")?;
            let correct = acc.score_and_record(&text, ex);
            preds.push(Prediction {
                query: ex.query.clone(),
                kind: ex.kind.clone(),
                answer: ex.answer.clone(),
                extracted: lt_data::extract_answer(&text).map(str::to_string),
                generated: text,
                correct,
            });
        }
        progress(chunk.len());
    }
    Ok((acc, preds))
}
