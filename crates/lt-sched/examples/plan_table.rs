//! Prints the planner's predicted figures for the published models on the built-in profiles, as a
//! Markdown table: the figures of `lt plan` without building the CLI (and Burn).
//!
//! Run: `cargo run --release -p lt-sched --example plan_table [BATCH] [SEQ]` (default 72 x 1024).
//!
//! Every figure is a prediction of the cost model; solve times are wall-clock of this process.

use std::path::Path;
use std::time::Instant;

use lt_core::ModelConfig;
use lt_core::hardware::BuiltinProfile;
use lt_sched::Plan;
use lt_sched::planner::{PlanRequest, Policy, baseline, max_batch, plan};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let batch: usize = args.get(1).map_or(Ok(72), |s| s.parse())?;
    let seq: usize = args.get(2).map_or(Ok(1024), |s| s.parse())?;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models");
    println!("batch {batch} x seq {seq}; every figure predicted by the cost model\n");
    println!(
        "| model | profile | TFLOPS 6PT (executed) | megatrain TFLOPS | speedup | keep-all speedup | \
         step shape | peak GPU GB | max batch vs megatrain | solve ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for name in ["qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen3.6-27b"] {
        let m = ModelConfig::from_path(&dir.join(format!("{name}.json")))?;
        for hw in [BuiltinProfile::H800, BuiltinProfile::Rtx3090, BuiltinProfile::H200] {
            let hw = hw.profile();
            let req = PlanRequest::new(batch, seq);
            let t = Instant::now();
            let out = plan(&m, &hw, &req);
            let solve_ms = t.elapsed().as_secs_f64() * 1e3;
            let o = match out {
                Ok(o) => o,
                Err(e) => {
                    println!("| {name} | {} | {e} |", hw.name);
                    continue;
                }
            };
            let p = &o.plan.predicted;
            let base = |b| -> Result<Option<Plan>, lt_sched::SchedError> {
                Ok(baseline(&m, &hw, &req, b)?.map(|(plan, _)| plan))
            };
            let mt = base(Policy::Megatrain)?;
            let ka = base(Policy::KeepAll)?;
            let speedup = |b: &Option<Plan>| {
                b.as_ref().map_or("-".to_string(), |b| format!("{:.3}x", b.predicted.step_seconds / p.step_seconds))
            };
            let mt_shape = mt.as_ref().map_or("-".to_string(), |b| {
                format!("{}x{}", b.step.shape.micro_batch_size, b.step.shape.grad_accum_steps)
            });
            let show = |b: Option<usize>| b.map_or("none".to_string(), |b| b.to_string());
            println!(
                "| {name} | {} | {:.1} ({:.1}) | {} | {} | {} | {}x{} (megatrain {mt_shape}), chunk {}, {:?} | {:.1} | {} vs {} | {solve_ms:.0} |",
                hw.name,
                p.tflops,
                p.hardware_tflops,
                mt.as_ref().map_or("-".to_string(), |b| format!("{:.1}", b.predicted.tflops)),
                speedup(&mt),
                speedup(&ka),
                o.plan.step.shape.micro_batch_size,
                o.plan.step.shape.grad_accum_steps,
                o.plan.step.shape.loss_chunk_tokens,
                o.plan.step.shape.optimizer_overlap,
                p.peak_gpu_bytes as f64 / 1e9,
                show(max_batch(&m, &hw, &req, Policy::Auto)?),
                show(max_batch(&m, &hw, &req, Policy::Megatrain)?),
            );
        }
    }
    Ok(())
}
