//! Saving a training checkpoint (fp32 masters + 8-bit AdamW state, fsynced), against the disk.
//!
//! Run: `cargo bench -p benches --bench checkpoint`
//! (`LT_CKPT_BENCH_CONFIG`, default a 12-layer, 1024-wide Qwen2-style model of 186M parameters, a
//! 1.1 GB checkpoint; `LT_CKPT_BENCH_REPEATS` rounds, default 3; `LT_CKPT_BENCH_DIR`, default the
//! system temp dir).
//!
//! Each round runs, one after the other on the same disk and the same bytes:
//! - **before**: what `lt train` did up to bd1becf: a `SharedModel::snapshot` (a copy of every
//!   master), then the masters converted to bytes value by value into a 1 MiB buffer, written
//!   through the page cache;
//! - **no copy, buffered**: `persist::save_shared_checkpoint`, the masters written from their own
//!   memory under each layer's lock, through the page cache (`LT_CHECKPOINT_DIRECT=0`);
//! - **now**: the same with `O_DIRECT` writes from a writer thread (the default);
//! - **dd, buffered**: the same number of bytes written in 4 MiB `write`s from one buffer into one
//!   new file, then `fsync` (`dd bs=4M conv=fsync`): the disk's limit for a durable write;
//! - **dd, O_DIRECT**: 4 MiB O_DIRECT writes (`dd bs=4M oflag=direct`), then `fsync`.
//!
//! It prints each path's median seconds and GB/s, its speed against **before**, and its fraction of
//! the O_DIRECT dd's speed (the disk's limit for one stream; the buffered dd where O_DIRECT is
//! refused). A save's seconds set the pace of `--save-every auto` (against a step's).
#![allow(missing_docs)]
#![allow(clippy::expect_used)] // a benchmark stops with the reason when its set-up fails

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use benches::env_usize;
use lt_core::ModelConfig;
use lt_exec::persist;
use lt_exec::state::SharedModel;
use lt_model::host::HostModel;
use lt_optim::{AdamW, AdamWConfig, OptimizerKind};
use lt_storage::checkpoint::{CheckpointStore, Retention};
use lt_storage::spill::SpillBuf;

#[cfg(target_arch = "x86_64")]
const O_DIRECT: i32 = 0o40000;
#[cfg(target_arch = "aarch64")]
const O_DIRECT: i32 = 0o200000;

const DEFAULT_CONFIG: &str = r#"{
  "model_type": "qwen2", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
  "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
  "tie_word_embeddings": true
}"#;

const BLOCK: usize = 4 << 20;

fn optimizer_for(model: &SharedModel) -> AdamW {
    let mut o = AdamW::new(AdamWConfig::default(), OptimizerKind::adamw8bit()).expect("optimizer");
    {
        let h = model.head.read().expect("head");
        let names = ["embed_tokens.weight", "norm.weight", "lm_head.weight"];
        let t: Vec<(&str, usize)> = h.tensors().zip(names).map(|(t, n)| (n, t.data.len())).collect();
        o.add_group("head", &t).expect("group");
    }
    for (i, l) in model.layers.iter().enumerate() {
        let l = l.read().expect("layer");
        let t: Vec<(&str, usize)> =
            l.specs.iter().zip(&l.tensors).map(|(s, t)| (s.name.as_str(), t.data.len())).collect();
        o.add_group(&format!("layers.{i}"), &t).expect("group");
    }
    o
}

/// Up to bd1becf: a snapshot, then byte-wise conversion into a 1 MiB buffer, through the page cache.
fn save_before(store: &CheckpointStore, model: &SharedModel, optim: &AdamW) {
    let snap = model.snapshot();
    let mut w = store.begin(1).expect("begin");
    {
        let mut blob = w.blob("master_weights").expect("blob");
        let mut buf = Vec::with_capacity(1 << 20);
        for (_, _, data) in persist::named_params(&snap) {
            for chunk in data.chunks(1 << 18) {
                buf.clear();
                buf.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
                blob.append(&buf).expect("append");
            }
        }
        blob.finish().expect("finish");
    }
    {
        let mut blob = w.blob("optimizer").expect("blob");
        optim.save(&mut blob).expect("optimizer");
        blob.flush().expect("flush");
        blob.finish().expect("finish");
    }
    w.commit(serde_json::json!({})).expect("commit");
}

fn dd_buffered(path: &Path, bytes: usize, block: &[u8]) {
    let mut f = File::create(path).expect("create");
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len());
        f.write_all(&block[..n]).expect("write");
        left -= n;
    }
    f.sync_all().expect("fsync");
}

/// O_DIRECT 4 MiB writes; `bytes` rounded up to whole blocks. None where the file system refuses
/// O_DIRECT (tmpfs).
fn dd_direct(path: &Path, bytes: usize, block: &SpillBuf) -> Option<()> {
    use std::os::unix::fs::FileExt;
    let f =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).custom_flags(O_DIRECT).open(path).ok()?;
    let mut off = 0u64;
    while (off as usize) < bytes {
        f.write_all_at(block, off).ok()?;
        off += block.len() as u64;
    }
    f.sync_all().ok()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let repeats = env_usize("LT_CKPT_BENCH_REPEATS", 3).max(1);
    let dir: PathBuf = std::env::var_os("LT_CKPT_BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let text = match std::env::var_os("LT_CKPT_BENCH_CONFIG") {
        Some(p) => std::fs::read_to_string(&p).expect("LT_CKPT_BENCH_CONFIG"),
        None => DEFAULT_CONFIG.to_string(),
    };
    let cfg = ModelConfig::from_json_str(&text).expect("config");
    let model = Arc::new(SharedModel::new(HostModel::random_init(cfg, 7), 0));
    let optim = optimizer_for(&model);
    let bytes = persist::checkpoint_bytes(&optim) as usize;
    eprintln!(
        "checkpoint: {} parameters, {:.3} GB (fp32 masters + 8-bit state), {repeats} rounds, in {}",
        optim.numel(),
        bytes as f64 / 1e9,
        dir.display()
    );
    let work = tempfile::tempdir_in(&dir).expect("temp dir");
    let block: Vec<u8> = (0..BLOCK).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3]).collect();
    let mut aligned = SpillBuf::zeroed(BLOCK).expect("aligned buffer");
    aligned.copy_from_slice(&block);

    let names = [
        "before (snapshot + byte-wise, buffered)",
        "no copy, buffered",
        "now (no copy, O_DIRECT)",
        "dd, buffered + fsync",
        "dd, O_DIRECT",
    ];
    let mut secs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for round in 0..repeats {
        let store = |k: usize, direct: bool| {
            CheckpointStore::new(work.path().join(format!("r{round}-{k}")), Retention::KeepAll).with_direct_io(direct)
        };
        let t = Instant::now();
        save_before(&store(0, false), &model, &optim);
        secs[0].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        persist::save_shared_checkpoint(&store(1, false), 1, &model, &optim, serde_json::json!({})).expect("save");
        secs[1].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        persist::save_shared_checkpoint(&store(2, true), 1, &model, &optim, serde_json::json!({})).expect("save");
        secs[2].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        dd_buffered(&work.path().join(format!("dd-{round}")), bytes, &block);
        secs[3].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        if dd_direct(&work.path().join(format!("direct-{round}")), bytes, &aligned).is_some() {
            secs[4].push(t.elapsed().as_secs_f64());
        }
        // Free the disk for the next round.
        for e in std::fs::read_dir(work.path()).expect("read dir").flatten() {
            let p = e.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
        eprintln!(
            "round {}: {}",
            round + 1,
            names
                .iter()
                .zip(&secs)
                .filter_map(|(n, s)| Some(format!("{n} {:.3} s", s.last()?)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let before = median(secs[0].clone());
    let limit = if secs[4].is_empty() { median(secs[3].clone()) } else { median(secs[4].clone()) };
    println!("| path | median s | GB/s | x before | of the disk (dd O_DIRECT) |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (n, s) in names.iter().zip(secs) {
        if s.is_empty() {
            println!("| {n} | (refused here) | | | |");
            continue;
        }
        let m = median(s);
        println!("| {n} | {m:.3} | {:.2} | {:.2} | {:.2} |", bytes as f64 / m / 1e9, before / m, limit / m);
    }
}
