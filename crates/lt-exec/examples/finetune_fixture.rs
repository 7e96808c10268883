//! Fine-tune a fixture model for a few steps on the streamed executor, at the trainer level: a
//! plan, an executor with a device budget, and `Trainer::step` on micro-batches.
//! (`lt-run`'s `finetune` example does the same through the whole-run library API.)
//!
//! Run: `cargo run -p lt-exec --example finetune_fixture`

use std::path::Path;
use std::sync::Arc;

use lt_core::ByteSize;
use lt_exec::executor::Executor;
use lt_exec::plan::{Placement, Step};
use lt_exec::state::SharedModel;
use lt_exec::train::{LrSchedule, TrainOptions, Trainer};
use lt_model::CpuAutodiff;
use lt_model::host::HostModel;
use lt_model::model::Batch;
use lt_optim::{AdamWConfig, OptimizerKind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/fixtures/models/qwen3-tied-mqa");
    let host = HostModel::load(&dir)?;
    let layers = host.config.num_layers();
    // Boundary 0 and every 4th kept on the device, the rest recomputed in backward.
    let plan = Step::every(layers, 4, Placement::Gpu);
    let executor = Executor::<CpuAutodiff>::new(plan, ByteSize::mib(64), Default::default(), None);
    let opts = TrainOptions {
        adamw: AdamWConfig { lr: 3e-3, ..Default::default() },
        optimizer: OptimizerKind::adamw8bit(),
        warmup_steps: 0,
        schedule: LrSchedule::Constant,
        total_steps: 10,
        overlap_optimizer: true,
        threads: 2,
    };
    let mut trainer = Trainer::new(Arc::new(SharedModel::new(host, 0)), executor, opts, None, 0)?;
    // One step = two micro-batches of one row (gradient accumulation).
    let rows = [vec![69u32, 65, 57, 91, 46, 6, 63, 24, 72, 68], vec![48, 3, 23, 89, 77, 60, 3, 64, 72, 46]];
    let micro: Vec<Batch> = rows.iter().map(|r| Batch::from_ids(vec![r.clone()])).collect();
    let mut losses = Vec::new();
    for _ in 0..10 {
        let m = trainer.step(&micro)?;
        println!(
            "step {:>2}: loss {:.4}, exposed h2d {:.4} s, predicted peak device {}",
            m.step,
            m.loss,
            m.timing.exposed.h2d,
            ByteSize(m.peak_device_bytes)
        );
        losses.push(m.loss);
    }
    trainer.flush()?;
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < first, "the loss should fall: {first} -> {last}");
    Ok(())
}
