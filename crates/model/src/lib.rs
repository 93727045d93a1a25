//! `model` — LLaMA-family forward pass with paged attention over the `kv`
//! pool, and sampling.

pub mod sample;
