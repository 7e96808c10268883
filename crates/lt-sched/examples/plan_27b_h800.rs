//! Plan Qwen3.6-27B on the H800 profile and print where every layer boundary's activation lives.
//!
//! Run: `cargo run -p lt-sched --example plan_27b_h800 [BATCH] [SEQ]` (default 8 x 1024).
//! Every time and memory figure printed is a prediction of the cost model.

use std::path::Path;

use lt_core::ModelConfig;
use lt_core::hardware::BuiltinProfile;
use lt_sched::Placement;
use lt_sched::planner::{PlanRequest, plan};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let batch: usize = args.next().map_or(Ok(8), |s| s.parse())?;
    let seq: usize = args.next().map_or(Ok(1024), |s| s.parse())?;
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/qwen3.6-27b.json");
    let model = ModelConfig::from_path(&config)?;
    let hw = BuiltinProfile::H800.profile();

    let out = plan(&model, &hw, &PlanRequest::new(batch, seq))?;
    let p = &out.plan;
    println!("Qwen3.6-27B on {} at batch {batch} x seq {seq} (all figures predicted)", hw.name);
    println!(
        "micro-batch {} x {} accumulation, loss chunk {} tokens, optimizer {:?}",
        p.step.shape.micro_batch_size,
        p.step.shape.grad_accum_steps,
        p.step.shape.loss_chunk_tokens,
        p.step.shape.optimizer_overlap
    );
    for (i, b) in p.step.boundaries.iter().enumerate() {
        let tier = match b {
            Placement::Gpu => "kept on the GPU",
            Placement::Host => "kept in pinned host memory",
            Placement::Nvme => "spilled to NVMe",
            Placement::Recompute => "recomputed",
        };
        println!("boundary {i:>2}: {tier}");
    }
    let pr = &p.predicted;
    println!(
        "predicted step {:.3} s, {:.1} TFLOPS (6PT), peak GPU {:.1} GB, peak host {:.1} GB",
        pr.step_seconds,
        pr.tflops,
        pr.peak_gpu_bytes as f64 / 1e9,
        pr.peak_host_bytes as f64 / 1e9
    );
    assert_eq!(p.step.boundaries.len(), model.num_layers() + 1, "one placement per layer boundary");
    Ok(())
}
