//! 8-bit AdamW on plain `f32` slices: fit `w` to a target by least squares, with global-norm
//! clipping, and print the loss as it falls.
//!
//! Run: `cargo run -p lt-optim --example adamw8bit_slices`

use lt_optim::{AdamW, AdamWConfig, Grad, GradNorm, OptimizerKind, StepOutcome, ThreadPool, grad};

fn main() -> Result<(), lt_optim::OptimError> {
    const N: usize = 65_536; // over 4096 elements: this tensor gets 8-bit state
    let pool = ThreadPool::new(2)?;
    let cfg = AdamWConfig { lr: 1e-2, weight_decay: 0.0, max_grad_norm: Some(1.0), ..Default::default() };
    let mut opt = AdamW::new(cfg, OptimizerKind::adamw8bit())?;
    let group = opt.add_group("fit", &[("w", N)])?;

    let target: Vec<f32> = (0..N).map(|i| ((i % 97) as f32 / 48.0) - 1.0).collect();
    let mut w = vec![0f32; N];
    let loss = |w: &[f32]| w.iter().zip(&target).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / N as f32;
    let first = loss(&w);
    for step in 1..=300 {
        // d/dw of the mean squared error.
        let g: Vec<f32> = w.iter().zip(&target).map(|(a, b)| 2.0 * (a - b) / N as f32).collect();
        let mut norm = GradNorm::new();
        norm.add(grad::sum_squares(Grad::F32(&g), &pool));
        if let StepOutcome::Apply(ctx) = opt.begin_step(norm.norm()) {
            opt.groups_mut()[group].update(&mut [&mut w], &[Grad::F32(&g)], &ctx, &pool)?;
        }
        if step % 50 == 0 {
            println!("step {step:>3}: loss {:.6}", loss(&w));
        }
    }
    let last = loss(&w);
    println!("loss {first:.4} -> {last:.6}; state {} bytes for {N} parameters", opt.state_bytes());
    assert!(last < first * 0.01, "the loss should fall by 100x: {first} -> {last}");
    Ok(())
}
