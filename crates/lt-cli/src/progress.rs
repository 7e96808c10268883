//! Progress bars that stay silent when stderr is not a terminal (CI logs, pipes).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether progress should be printed as lines: stderr is not a terminal (a log, a pipe, a run under
/// `timeout`), so [`bar`]s are hidden and a stopped run would otherwise say nothing of how far it got.
pub fn as_lines() -> bool {
    !std::io::IsTerminal::is_terminal(&std::io::stderr())
}

/// A bar of `len` steps labelled `what`; hidden unless stderr is a terminal.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if as_lines() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({eta})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}
