//! Reporting build progress. A first build takes minutes, so a person at a
//! terminal sees a live bar; in a log or CI (stderr not a terminal) each step
//! is one plain line instead of redraw noise.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Receives the steps of an image build as they start.
pub trait BuildProgress: Send + Sync {
    /// Step `index` (1-based) of `total`, named `name`, starts.
    fn step(&self, index: usize, total: usize, name: &str);
    /// The build ended (successfully or not).
    fn finish(&self);
}

/// Reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl BuildProgress for NoProgress {
    fn step(&self, _index: usize, _total: usize, _name: &str) {}
    fn finish(&self) {}
}

/// A progress bar on stderr; when stderr is not a terminal, one plain line
/// per step instead.
pub struct BarProgress {
    bar: ProgressBar,
    tty: bool,
    current: Mutex<Option<(String, Instant)>>,
}

impl Default for BarProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl BarProgress {
    /// A bar drawn on stderr if it is a terminal.
    pub fn new() -> Self {
        let tty = std::io::stderr().is_terminal();
        let bar = if tty {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} image build [{pos}/{len}] {msg} ({elapsed})",
                )
                .expect("valid template"),
            );
            bar
        } else {
            ProgressBar::hidden()
        };
        Self {
            bar,
            tty,
            current: Mutex::new(None),
        }
    }

    /// Prints the previous step's duration above the bar (a step ends
    /// successfully when the next one starts).
    fn close_current(&self, succeeded: bool) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((name, started)) = current.take() {
            if self.tty && succeeded {
                self.bar.println(format!(
                    "  {name}: {:.1} s",
                    started.elapsed().as_secs_f64()
                ));
            }
        }
    }
}

impl BuildProgress for BarProgress {
    fn step(&self, index: usize, total: usize, name: &str) {
        self.close_current(true);
        if self.tty {
            self.bar.reset_elapsed();
            self.bar.set_message(name.to_string());
            self.bar.set_length(total as u64);
            self.bar.set_position(index as u64);
            // Ticking (and so drawing) starts with the first step: a cached
            // image shows nothing.
            self.bar.enable_steady_tick(Duration::from_millis(120));
        } else {
            eprintln!("image build [{index}/{total}] {name}");
        }
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((name.to_string(), Instant::now()));
    }

    fn finish(&self) {
        self.close_current(false);
        self.bar.finish_and_clear();
    }
}
