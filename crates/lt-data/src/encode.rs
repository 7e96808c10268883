//! Conversations to token ids and labels: which tokens the loss sees.
//!
//! # Labels
//! Labels are aligned with `input_ids`, as in Hugging Face: the model shifts them by one (logits at
//! position `t` are scored against `labels[t + 1]`), and [`IGNORE_INDEX`] (-100) marks tokens the loss
//! skips. `labels[0]` is always -100: no position predicts the first token of a sequence, and in a packed
//! row this is what stops the last token of one sequence from being trained to predict the first token of
//! the next (transformers' `DataCollatorWithFlattening` does the same).
//!
//! # The prompt/response boundary
//! For each assistant message `i`, the prompt is `messages[..i]` rendered with
//! `add_generation_prompt=true`. It must be a byte prefix of the rendering of the whole conversation
//! ([`DataError::PromptNotPrefix`] otherwise) and its tokens a prefix of the conversation's tokens
//! ([`DataError::TokenBoundary`] otherwise: a token straddles the boundary, so no split is exact). Tokens
//! from the end of the prompt to the end of the turn are trained on, everything else is masked.
//!
//! # End-of-turn tokens (what HF SFT trains on)
//! - The **last** assistant turn is trained up to the end of the rendering. This is exactly TRL
//!   `SFTTrainer`'s completion-only loss on a prompt/completion pair (completion = full rendering minus the
//!   prompt rendering): it includes the end-of-turn token `<|im_end|>` (so the model learns to stop) and
//!   the newline the template writes after it. For Qwen3 it also includes the empty
//!   `<think>\n\n</think>\n\n` block the template inserts, which the model must produce at inference too.
//! - **Earlier** assistant turns (multi-turn data) are trained up to and including the first end-of-turn
//!   marker after their prompt (`<|im_end|>` when the tokenizer has it, else the template's `eos_token`);
//!   the newline after it belongs to the next prompt.
//! - With `train_on_prompt`, every token but the first is trained on.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};
use crate::template::{ChatTemplate, Message};
use crate::tokenizer::Tokenizer;

/// The label value the loss ignores (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// One training sequence: token ids and aligned labels (see the module docs for the alignment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizedExample {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// Same length as `input_ids`; [`IGNORE_INDEX`] where no loss is taken.
    pub labels: Vec<i64>,
}

impl TokenizedExample {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Number of labels the loss uses.
    pub fn loss_tokens(&self) -> usize {
        self.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
    }

    /// Keeps the first `max_len` tokens; returns how many were cut.
    pub fn truncate(&mut self, max_len: usize) -> usize {
        let cut = self.input_ids.len().saturating_sub(max_len);
        self.input_ids.truncate(max_len);
        self.labels.truncate(max_len);
        cut
    }
}

/// A tokenized conversation plus where its final prompt ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedChat {
    /// Ids and labels.
    pub example: TokenizedExample,
    /// When the last message is the assistant's: the number of tokens of the prompt that precedes it.
    /// `example.input_ids[..prompt_len]` are exactly the ids of the prompt rendered with
    /// `add_generation_prompt=true`, i.e. what generation at evaluation starts from.
    pub prompt_len: Option<usize>,
}

/// Renders conversations with a chat template, tokenizes them and builds the loss mask.
#[derive(Debug, Clone)]
pub struct ChatEncoder {
    tokenizer: Arc<dyn Tokenizer>,
    template: Arc<ChatTemplate>,
    end_of_turn: Option<(String, Option<u32>)>,
    train_on_prompt: bool,
}

impl ChatEncoder {
    /// An encoder with loss on responses only. The end-of-turn marker is `<|im_end|>` when the tokenizer
    /// knows it (ChatML, including Qwen base models whose `eos_token` is `<|endoftext|>`), else the
    /// template's `eos_token`.
    pub fn new(tokenizer: Arc<dyn Tokenizer>, template: ChatTemplate) -> Self {
        let end_of_turn = match tokenizer.token_to_id("<|im_end|>") {
            Some(id) => Some(("<|im_end|>".to_string(), Some(id))),
            None => template.special().eos_token.clone().map(|t| {
                let id = tokenizer.token_to_id(&t);
                (t, id)
            }),
        };
        Self { tokenizer, template: Arc::new(template), end_of_turn, train_on_prompt: false }
    }

    /// Trains on prompt tokens too (every token but the first).
    pub fn with_train_on_prompt(mut self, yes: bool) -> Self {
        self.train_on_prompt = yes;
        self
    }

    /// Whether prompt tokens are trained on.
    pub fn train_on_prompt(&self) -> bool {
        self.train_on_prompt
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<dyn Tokenizer> {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The end-of-turn marker text, if known.
    pub fn end_of_turn(&self) -> Option<&str> {
        self.end_of_turn.as_ref().map(|(s, _)| s.as_str())
    }

    /// The token id generation should stop at: the end-of-turn token, else the tokenizer's EOS.
    pub fn stop_token_id(&self) -> Option<u32> {
        self.end_of_turn.as_ref().and_then(|(_, id)| *id).or_else(|| self.tokenizer.eos_id())
    }

    /// Ids of `messages` rendered with `add_generation_prompt=true`: the input for generation.
    pub fn encode_prompt(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.tokenizer.encode(&self.template.render(messages, true)?)
    }

    /// Tokenizes a conversation and masks it (see the module docs).
    pub fn encode_chat(&self, messages: &[Message]) -> Result<EncodedChat> {
        let full = self.template.render(messages, false)?;
        let ids = self.tokenizer.encode(&full)?;
        let mut labels = vec![IGNORE_INDEX; ids.len()];
        let assistant_turns: Vec<usize> =
            messages.iter().enumerate().filter(|(_, m)| m.role == "assistant").map(|(i, _)| i).collect();
        let last_is_assistant = messages.last().is_some_and(|m| m.role == "assistant");

        let mut prompt_len = None;
        if self.train_on_prompt {
            for (l, &id) in labels.iter_mut().zip(&ids) {
                *l = i64::from(id);
            }
            if last_is_assistant {
                let turn = messages.len() - 1;
                prompt_len = Some(self.prompt_boundary(messages, turn, &full, &ids)?.1);
            }
        } else {
            if assistant_turns.is_empty() {
                return Err(DataError::NoAssistantTurn);
            }
            for &turn in &assistant_turns {
                let (prompt_bytes, start) = self.prompt_boundary(messages, turn, &full, &ids)?;
                let end = if turn + 1 == messages.len() {
                    prompt_len = Some(start);
                    ids.len()
                } else {
                    self.turn_end(turn, prompt_bytes, &full, &ids)?
                };
                for k in start..end.min(ids.len()) {
                    labels[k] = i64::from(ids[k]);
                }
            }
        }
        if let Some(first) = labels.first_mut() {
            *first = IGNORE_INDEX;
        }
        Ok(EncodedChat { example: TokenizedExample { input_ids: ids, labels }, prompt_len })
    }

    /// Checks a pre-tokenized example against the vocabulary; labels default to the ids (train on all).
    pub fn encode_tokens(&self, input_ids: Vec<u32>, labels: Option<Vec<i64>>) -> Result<TokenizedExample> {
        let vocab = self.tokenizer.vocab_size();
        if let Some(&bad) = input_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(DataError::TokenOutOfRange { id: u64::from(bad), vocab_size: vocab });
        }
        let mut labels = match labels {
            Some(l) => {
                if let Some(&bad) = l.iter().find(|&&x| x != IGNORE_INDEX && (x < 0 || x as u64 >= vocab as u64)) {
                    return Err(DataError::TokenOutOfRange { id: bad as u64, vocab_size: vocab });
                }
                l
            }
            None => input_ids.iter().map(|&id| i64::from(id)).collect(),
        };
        if let Some(first) = labels.first_mut() {
            *first = IGNORE_INDEX;
        }
        Ok(TokenizedExample { input_ids, labels })
    }

    /// Renders the prompt of assistant message `turn`, checks it is a byte and token prefix of the
    /// conversation, and returns (its byte length, its token count).
    fn prompt_boundary(&self, messages: &[Message], turn: usize, full: &str, ids: &[u32]) -> Result<(usize, usize)> {
        let prompt = self.template.render(&messages[..turn], true)?;
        if !full.starts_with(&prompt) {
            let at = prompt.bytes().zip(full.bytes()).take_while(|(a, b)| a == b).count();
            return Err(DataError::PromptNotPrefix {
                turn,
                diverge_at: at,
                prompt_context: context_at(&prompt, at),
                full_context: context_at(full, at),
            });
        }
        let prompt_ids = self.tokenizer.encode(&prompt)?;
        check_token_prefix(turn, &prompt_ids, ids)?;
        Ok((prompt.len(), prompt_ids.len()))
    }

    /// Token index just past the end-of-turn marker that closes assistant message `turn`.
    fn turn_end(&self, turn: usize, prompt_bytes: usize, full: &str, ids: &[u32]) -> Result<usize> {
        let marker = self.end_of_turn.as_ref().map(|(s, _)| s.as_str()).unwrap_or("");
        let found = if marker.is_empty() { None } else { full.get(prompt_bytes..).and_then(|rest| rest.find(marker)) };
        let Some(pos) = found else {
            return Err(DataError::MissingEndOfTurn { turn, marker: marker.to_string() });
        };
        let end_bytes = prompt_bytes + pos + marker.len();
        let prefix_ids = self.tokenizer.encode(&full[..end_bytes])?;
        check_token_prefix(turn, &prefix_ids, ids)?;
        Ok(prefix_ids.len())
    }
}

fn check_token_prefix(turn: usize, prefix: &[u32], ids: &[u32]) -> Result<()> {
    if ids.starts_with(prefix) {
        return Ok(());
    }
    let at = prefix.iter().zip(ids).take_while(|(a, b)| a == b).count();
    Err(DataError::TokenBoundary { turn, prompt_tokens: prefix.len(), diverge_at: at })
}

/// Up to 24 bytes of `s` around byte `at`, cut at character boundaries.
fn context_at(s: &str, at: usize) -> String {
    let mut lo = at.saturating_sub(12);
    while lo > 0 && !s.is_char_boundary(lo) {
        lo -= 1;
    }
    let mut hi = (at + 12).min(s.len());
    while hi < s.len() && !s.is_char_boundary(hi) {
        hi += 1;
    }
    s.get(lo..hi).unwrap_or("").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::SpecialTokenStrings;
    use crate::testutil::{ChatFixture, expect_err, qwen3_dir};
    use crate::tokenizer::{ByteTokenizer, HfTokenizer};

    fn qwen3_encoder() -> ChatEncoder {
        let dir = qwen3_dir();
        let tok = HfTokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
        let template = ChatTemplate::from_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
        ChatEncoder::new(Arc::new(tok), template)
    }

    fn trained(ex: &TokenizedExample) -> Vec<u32> {
        ex.input_ids.iter().zip(&ex.labels).filter(|(_, l)| **l != IGNORE_INDEX).map(|(i, _)| *i).collect()
    }

    /// The masks match TRL's completion-only split, computed by transformers in the fixture: every token
    /// after the prompt (`prompt_ids`, from `add_generation_prompt=True`) is trained, every prompt token is
    /// not, and the labels equal the ids where trained.
    #[test]
    fn qwen3_masks_match_the_transformers_prompt_completion_split() {
        let enc = qwen3_encoder();
        let mut checked = 0;
        for case in ChatFixture::load().cases {
            let (Some(prompt_ids), false) = (&case.prompt_ids, case.add_generation_prompt) else { continue };
            if !case.extra.is_empty() || case.messages.iter().filter(|m| m.role == "assistant").count() != 1 {
                continue;
            }
            let out = enc.encode_chat(&case.messages).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert_eq!(out.example.input_ids, case.ids, "{}", case.name);
            assert_eq!(out.prompt_len, Some(prompt_ids.len()), "{}", case.name);
            for (k, (&id, &l)) in out.example.input_ids.iter().zip(&out.example.labels).enumerate() {
                if k < prompt_ids.len() {
                    assert_eq!(l, IGNORE_INDEX, "{}: prompt token {k} is trained", case.name);
                } else {
                    assert_eq!(l, i64::from(id), "{}: response token {k} is masked", case.name);
                }
            }
            // The trained part ends with <|im_end|> then "\n", as in TRL.
            let tail = trained(&out.example);
            assert_eq!(tail[tail.len() - 2..], [151645, 198], "{}", case.name);
            checked += 1;
        }
        assert!(checked >= 5, "only {checked} single-turn cases");
    }

    #[test]
    fn multi_turn_trains_every_assistant_turn_through_its_end_marker() {
        let enc = qwen3_encoder();
        let fixture = ChatFixture::load();
        let case = fixture.cases.iter().find(|c| c.name == "multi_turn").unwrap_or_else(|| panic!("no multi_turn"));
        let out = enc.encode_chat(&case.messages).unwrap_or_else(|e| panic!("{e}"));
        let tok = enc.tokenizer();
        let text = tok.decode(&trained(&out.example), false).unwrap_or_default();
        assert_eq!(
            text,
            "Hello. How can I help?<|im_end|><think>\n\n</think>\n\n6 * 7 = 42.\nThe answer is: 42<|im_end|>\n"
        );
        // Prompt-side tokens, including the user turns and headers, are masked.
        let masked: Vec<u32> = out
            .example
            .input_ids
            .iter()
            .zip(&out.example.labels)
            .filter(|(_, l)| **l == IGNORE_INDEX)
            .map(|(i, _)| *i)
            .collect();
        let masked_text = tok.decode(&masked, false).unwrap_or_default();
        assert!(masked_text.contains("What is 6 * 7?"));
        assert!(!masked_text.contains("Hello."));
    }

    #[test]
    fn train_on_prompt_trains_everything_but_the_first_token() {
        let enc = qwen3_encoder().with_train_on_prompt(true);
        let msgs = [Message::user("2+2?"), Message::assistant("The answer is: 4")];
        let out = enc.encode_chat(&msgs).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.example.labels[0], IGNORE_INDEX);
        assert_eq!(out.example.loss_tokens(), out.example.len() - 1);
        let prompt = enc.encode_prompt(&msgs[..1]).unwrap_or_default();
        assert_eq!(out.prompt_len, Some(prompt.len()));
        // A prompt-only conversation is trainable only in this mode.
        assert!(enc.encode_chat(&msgs[..1]).is_ok());
        assert!(matches!(qwen3_encoder().encode_chat(&msgs[..1]), Err(DataError::NoAssistantTurn)));
    }

    #[test]
    fn byte_tokenizer_chatml_masks_prompt_and_keeps_im_end() {
        let enc = ChatEncoder::new(Arc::new(ByteTokenizer), ByteTokenizer::chat_template());
        assert_eq!(enc.stop_token_id(), Some(ByteTokenizer::IM_END));
        let msgs = [Message::user("1+1?"), Message::assistant("2")];
        let out = enc.encode_chat(&msgs).unwrap_or_else(|e| panic!("{e}"));
        let want_prompt = "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n";
        let prompt_ids = ByteTokenizer.encode(want_prompt).unwrap_or_default();
        assert_eq!(out.prompt_len, Some(prompt_ids.len()));
        assert_eq!(trained(&out.example), vec![u32::from(b'2'), ByteTokenizer::IM_END, u32::from(b'\n')]);
    }

    #[test]
    fn prompt_that_is_not_a_prefix_is_an_error() {
        // A template that renders the generation prompt differently from a finished assistant turn.
        let src = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}";
        let t = ChatTemplate::new(src, "t", SpecialTokenStrings::default()).unwrap_or_else(|e| panic!("{e}"));
        let enc = ChatEncoder::new(Arc::new(ByteTokenizer), t);
        let err = expect_err(enc.encode_chat(&[Message::user("q"), Message::assistant("a")]));
        match err {
            DataError::PromptNotPrefix { turn, diverge_at, .. } => {
                assert_eq!(turn, 1);
                assert_eq!(diverge_at, "[user]q".len());
            }
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn straddling_token_is_a_boundary_error() {
        // With ChatML and the Qwen3 BPE, a response starting with "\n" merges with the prompt's final "\n".
        let dir = qwen3_dir();
        let tok = HfTokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{e}"));
        let enc = ChatEncoder::new(Arc::new(tok), ChatTemplate::chatml(SpecialTokenStrings::default()));
        let err = expect_err(enc.encode_chat(&[Message::user("q"), Message::assistant("\nx")]));
        assert!(matches!(err, DataError::TokenBoundary { turn: 1, .. }), "{err}");
        assert!(enc.encode_chat(&[Message::user("q"), Message::assistant("x")]).is_ok());
    }

    #[test]
    fn pretokenized_examples_are_checked_against_the_vocabulary() {
        let enc = ChatEncoder::new(Arc::new(ByteTokenizer), ByteTokenizer::chat_template());
        let ex = enc.encode_tokens(vec![1, 2, 3], None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ex.labels, vec![IGNORE_INDEX, 2, 3]);
        let ex = enc.encode_tokens(vec![1, 2, 3], Some(vec![1, -100, 3])).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ex.labels, vec![IGNORE_INDEX, IGNORE_INDEX, 3]);
        assert!(matches!(enc.encode_tokens(vec![1, 9999], None), Err(DataError::TokenOutOfRange { id: 9999, .. })));
        assert!(matches!(enc.encode_tokens(vec![1], Some(vec![-5])), Err(DataError::TokenOutOfRange { .. })));
    }

    #[test]
    fn truncate_counts_the_cut() {
        let mut ex = TokenizedExample { input_ids: vec![1, 2, 3, 4], labels: vec![-100, 2, 3, 4] };
        assert_eq!(ex.truncate(3), 1);
        assert_eq!(ex.len(), 3);
        assert_eq!(ex.loss_tokens(), 2);
        assert_eq!(ex.truncate(10), 0);
    }
}
