//! The forward step as a trait: what a batch scheduler needs of a model.
//!
//! The engine's batch core is generic over [`Forward`], so its schedules
//! (admission, chunked prefill, the step budget, cancellation) are tested
//! with a stand-in model in milliseconds, and production plugs in
//! [`Runner`]: the real [`Model`] with its preallocated [`Scratch`].

use kv::{DType, KvError, KvShape, Pool};

use crate::{Model, ModelError, Row, Scratch, SeqCtx, BATCH_ROWS_MAX};

/// A forward step over pages. Every KV row it writes or reads goes through
/// the pool (K1–K3 are the pool's, whatever the implementation).
pub trait Forward: Send + 'static {
    /// Tokens in the vocabulary: the length of each row's logits.
    fn vocab(&self) -> usize;
    /// The model's context window.
    fn context_length(&self) -> usize;
    /// The KV page shape this model needs.
    fn kv_shape(&self, page_size: usize, dtype: DType) -> Result<KvShape, KvError>;
    /// Rows one [`Forward::forward`] call takes at most.
    fn rows_max(&self) -> usize;
    /// Runs one step over `rows`: writes each row's K/V into its
    /// sequence's pages, then leaves the logits of every row with
    /// `logits: true` in [`Forward::logits`] (row order, `vocab` each).
    fn forward(
        &mut self,
        pool: &mut Pool,
        seqs: &[SeqCtx<'_>],
        rows: &[Row],
    ) -> Result<(), ModelError>;
    /// The logits of the last step.
    fn logits(&mut self) -> &mut [f32];
}

/// The real model with its scratch buffers: the production [`Forward`].
pub struct Runner {
    model: Model,
    scratch: Scratch,
}

impl Runner {
    /// Buffers for steps of up to `rows_max` rows (clamped to
    /// [`BATCH_ROWS_MAX`]).
    pub fn new(model: Model, rows_max: usize) -> Runner {
        let scratch = Scratch::new(&model, rows_max);
        Runner { model, scratch }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl Forward for Runner {
    fn vocab(&self) -> usize {
        self.model.config.vocab
    }
    fn context_length(&self) -> usize {
        self.model.config.context_length
    }
    fn kv_shape(&self, page_size: usize, dtype: DType) -> Result<KvShape, KvError> {
        self.model.kv_shape(page_size, dtype)
    }
    fn rows_max(&self) -> usize {
        BATCH_ROWS_MAX
    }
    fn forward(
        &mut self,
        pool: &mut Pool,
        seqs: &[SeqCtx<'_>],
        rows: &[Row],
    ) -> Result<(), ModelError> {
        self.model.forward(pool, seqs, rows, &mut self.scratch)
    }
    fn logits(&mut self) -> &mut [f32] {
        &mut self.scratch.logits
    }
}
