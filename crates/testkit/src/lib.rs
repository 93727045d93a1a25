//! `testkit` — what tests share, kept out of the production crates; only
//! dev-dependencies (and the `verify` harness) use it.
//!
//! * [`world`] — the whole PD stack as one value: the production gateway
//!   machine, and prefill and decode as the production node glue
//!   (`transfer::node`) over stand-in engines whose tokens hash every KV row
//!   they read through the pool; every invariant checked after each event.
//! * [`sim`] — the seeded deterministic simulation over the world (faults,
//!   partitions, an adversarial network).
//! * [`synthetic`] — a tiny random LLaMA GGUF shaped like SmolLM2.
//! * [`model_path`] — the real model for release-mode tests: one lookup,
//!   honouring `$ISOSERVE_MODEL` and `$ISOSERVE_HOME` like the binary.
//!
//! ```
//! use testkit::world::{ClientSpec, World, WorldParams};
//! let mut w = World::new(WorldParams::default(), vec![ClientSpec::new(kv::TenantId(1), vec![5, 6, 7], 2)]);
//! // Take the first possible event until nothing is left to do.
//! for _ in 0..200 {
//!     if !w.step_first() {
//!         break;
//!     }
//!     w.check_step().expect("invariants hold after every event");
//! }
//! assert!(w.quiescent());
//! let outcomes = w.check_end().expect("content and pools check out");
//! assert_eq!(outcomes[0].end, Some(Ok(2)));
//! ```

#![forbid(unsafe_code)]

use std::path::PathBuf;

pub mod sim;
pub mod synthetic;
pub mod world;

/// The default model's file name (as `isoserve fetch-model` stores it).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where `isoserve fetch-model` puts models: `$ISOSERVE_HOME`, else
/// `~/.cache/isoserve` (the binary's rule, `isoserve::fetch`).
pub fn model_home() -> PathBuf {
    match std::env::var_os("ISOSERVE_HOME").filter(|h| !h.is_empty()) {
        Some(h) => PathBuf::from(h),
        None => {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/isoserve")
        }
    }
}

/// The real model: `$ISOSERVE_MODEL`, else the default model in
/// [`model_home`]. Panics when it is missing, so a test fails rather than
/// skips (`scripts/test` fetches it first).
pub fn model_path() -> PathBuf {
    let p = match std::env::var_os("ISOSERVE_MODEL").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => model_home().join(DEFAULT_MODEL_FILE),
    };
    assert!(
        p.is_file(),
        "the real model is missing at {}: run `isoserve fetch-model` (or set ISOSERVE_MODEL); \
         this test fails rather than skips",
        p.display()
    );
    p
}
