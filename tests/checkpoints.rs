//! Checkpoints during a run: `--save-every 3` saves at steps 3 and 6 and at the end, each save
//! announced (`Saving`, with the bytes it will write) before it is reported durable (`Saved`),
//! and `--keep-checkpoints 2` leaves the last two on disk.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use lt_run::{Event, Run};
use lt_storage::checkpoint::{CheckpointStore, Retention};

#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Saving(u64, u64),
    Saved(u64, u64),
}

#[test]
fn fixed_interval_saves_are_announced_then_reported_and_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    Run::builder(common::fixture_run("qwen3-tied-mqa", &out, 7).save_every(3).keep_checkpoints(2))
        .without_default_outputs()
        .observer(move |e: &Event<'_>| {
            match e {
                Event::Saving { step, bytes } => log.lock().unwrap().push(Seen::Saving(*step, *bytes)),
                Event::Saved { step, bytes, .. } => log.lock().unwrap().push(Seen::Saved(*step, *bytes)),
                _ => {}
            }
            Ok(())
        })
        .build()
        .unwrap()
        .execute()
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    let steps: Vec<u64> = seen
        .iter()
        .filter_map(|s| match s {
            Seen::Saved(step, _) => Some(*step),
            Seen::Saving(..) => None,
        })
        .collect();
    assert_eq!(steps, [3, 6, 7], "{seen:?}");
    for pair in seen.chunks(2) {
        let [Seen::Saving(a, estimate), Seen::Saved(b, written)] = pair else { panic!("{seen:?}") };
        assert_eq!(a, b, "{seen:?}");
        // The estimate leaves out the manifest and the optimizer's per-tensor headers: a few KiB.
        assert!(written >= estimate && written - estimate < 64 << 10, "{estimate} estimated, {written} written");
    }
    let store = CheckpointStore::new(out.join("checkpoints"), Retention::KeepAll);
    let kept: Vec<u64> = store.list().unwrap().into_iter().map(|(step, _)| step).collect();
    assert_eq!(kept, [6, 7]);
}
