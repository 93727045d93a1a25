//! Page geometry and capacity arithmetic (pure functions, used by K8 checks).

use crate::KvError;

/// Element type of stored keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    F32,
    /// GGML's `q8_0`: blocks of [`Q8_BLOCK`] values, each an `f16` scale
    /// then 32 `i8` (34 bytes), value = scale × q. A block never straddles
    /// two heads (`head_dim % 32 == 0`, checked by [`KvShape::validate`]).
    Q8_0,
}

/// Values in one `q8_0` block.
pub const Q8_BLOCK: usize = 32;
/// Bytes of one `q8_0` block: the `f16` scale and 32 `i8`.
pub const Q8_BLOCK_BYTES: usize = 2 + Q8_BLOCK;

impl DType {
    /// Bytes that `n` values take (`n` a multiple of [`Q8_BLOCK`] for `q8_0`).
    #[inline]
    pub const fn row_bytes(self, n: usize) -> usize {
        match self {
            DType::F16 => 2 * n,
            DType::F32 => 4 * n,
            DType::Q8_0 => n / Q8_BLOCK * Q8_BLOCK_BYTES,
        }
    }

    #[inline]
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::Q8_0 => "q8_0",
        }
    }
}

/// Bytes at the end of every page that hold its canary (K7). A multiple of
/// 64 so that page data stays cache-line aligned.
pub const TRAILER_BYTES: usize = 64;

/// Alignment of every page and of every (page, layer) block.
pub const PAGE_ALIGN_BYTES: usize = 64;

/// Upper bounds that keep the arithmetic below far from overflow and reject
/// absurd configurations with a clear error instead of a huge allocation.
pub const PAGE_SIZE_MAX_TOKENS: usize = 4096;
pub const LAYERS_MAX: usize = 1024;
pub const TOKEN_WIDTH_MAX: usize = 1 << 16;

/// Geometry of one page: `page_size` token slots for every layer, K then V,
/// `kv_heads × head_dim` elements each.
///
/// Memory layout of a page (all offsets multiples of 64 bytes):
///
/// ```text
/// [layer 0: K slot 0..page_size | V slot 0..page_size] [layer 1: ...] ... [trailer: canary ×8]
/// ```
///
/// so attention over one layer streams one contiguous block per page, and a
/// whole page is one contiguous byte range for transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Token slots per page.
    pub page_size: usize,
    pub dtype: DType,
}

impl KvShape {
    /// Validated constructor.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        page_size: usize,
        dtype: DType,
    ) -> Result<KvShape, KvError> {
        let shape = KvShape {
            layers,
            kv_heads,
            head_dim,
            page_size,
            dtype,
        };
        shape.validate()?;
        Ok(shape)
    }

    pub fn validate(&self) -> Result<(), KvError> {
        let bad = |why: &str| {
            Err(KvError::InvalidShape {
                why: why.to_string(),
            })
        };
        if self.layers == 0 || self.layers > LAYERS_MAX {
            return bad(&format!("layers must be in 1..={LAYERS_MAX}"));
        }
        if self.page_size == 0 || self.page_size > PAGE_SIZE_MAX_TOKENS {
            return bad(&format!("page_size must be in 1..={PAGE_SIZE_MAX_TOKENS}"));
        }
        if self.kv_heads == 0 || self.head_dim == 0 || self.token_width() > TOKEN_WIDTH_MAX {
            return bad(&format!(
                "kv_heads × head_dim must be in 1..={TOKEN_WIDTH_MAX}"
            ));
        }
        if self.dtype == DType::Q8_0 && !self.head_dim.is_multiple_of(Q8_BLOCK) {
            return bad("q8_0 needs head_dim to be a multiple of 32");
        }
        Ok(())
    }

    /// Elements per token for K (or for V) in one layer.
    #[inline]
    pub const fn token_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one token's K (or V) row in one layer.
    #[inline]
    pub const fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.token_width())
    }

    /// Bytes of the K half (= the V half) of one (page, layer) block:
    /// `page_size` rows, padded to [`PAGE_ALIGN_BYTES`] so that every half
    /// starts 64-byte aligned.
    #[inline]
    pub const fn half_bytes(&self) -> usize {
        (self.page_size * self.row_bytes()).next_multiple_of(PAGE_ALIGN_BYTES)
    }

    /// Bytes of one (page, layer) block: K slots then V slots.
    #[inline]
    pub const fn layer_bytes(&self) -> usize {
        2 * self.half_bytes()
    }

    /// Bytes of KV data in one page (all layers), without the trailer.
    #[inline]
    pub const fn data_bytes(&self) -> usize {
        self.layers * self.layer_bytes()
    }

    /// Bytes one page occupies in the pool, trailer included.
    #[inline]
    pub const fn page_bytes(&self) -> usize {
        self.data_bytes() + TRAILER_BYTES
    }

    /// KV bytes one token needs across all layers (K and V).
    #[inline]
    pub const fn bytes_per_token(&self) -> usize {
        self.layers * 2 * self.row_bytes()
    }

    /// Pages needed to hold `tokens` tokens of one sequence.
    #[inline]
    pub const fn pages_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.page_size as u64)
    }
}

/// Pages a memory budget buys (whole pages only, trailers counted).
pub fn pages_for_budget(shape: &KvShape, budget_bytes: u64) -> u64 {
    budget_bytes / shape.page_bytes() as u64
}

/// Tokens a pool of `pages` pages holds: the number K8 compares with the
/// model's context window.
pub fn capacity_tokens(shape: &KvShape, pages: u64) -> u64 {
    pages.saturating_mul(shape.page_size as u64)
}

/// Tokens a memory budget holds for a model shape.
pub fn tokens_for_budget(shape: &KvShape, budget_bytes: u64) -> u64 {
    capacity_tokens(shape, pages_for_budget(shape, budget_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm(dtype: DType) -> KvShape {
        KvShape::new(30, 3, 64, 16, dtype).unwrap()
    }

    #[test]
    fn smollm2_page_geometry() {
        let s = smollm(DType::F32);
        assert_eq!(s.token_width(), 192);
        assert_eq!(s.half_bytes(), 16 * 192 * 4);
        assert_eq!(s.data_bytes(), 30 * 2 * 16 * 192 * 4);
        assert_eq!(s.page_bytes(), 737_280 + 64);
        assert_eq!(s.bytes_per_token(), 30 * 2 * 192 * 4);
        let h = smollm(DType::F16);
        assert_eq!(h.data_bytes() * 2, s.data_bytes());
        // q8_0: 6 blocks of 34 bytes a row; 16 rows = 3,264 bytes, 64-aligned.
        let q = smollm(DType::Q8_0);
        assert_eq!(q.row_bytes(), 204);
        assert_eq!(q.half_bytes(), 3264);
        assert_eq!(q.bytes_per_token(), 30 * 2 * 204);
    }

    #[test]
    fn halves_are_padded_to_64_bytes() {
        // 1 slot × 3 × 5 × 2 bytes = 30 bytes, padded to 64.
        let s = KvShape::new(2, 3, 5, 1, DType::F16).unwrap();
        assert_eq!(s.half_bytes(), 64);
        assert_eq!(s.bytes_per_token(), 2 * 2 * 30);
        let q = KvShape::new(1, 1, 32, 3, DType::Q8_0).unwrap();
        assert_eq!((q.row_bytes(), q.half_bytes()), (34, 128));
    }

    #[test]
    fn capacity_arithmetic() {
        let s = smollm(DType::F16);
        // One page exactly, minus one byte, buys nothing.
        assert_eq!(pages_for_budget(&s, s.page_bytes() as u64 - 1), 0);
        assert_eq!(pages_for_budget(&s, s.page_bytes() as u64), 1);
        assert_eq!(tokens_for_budget(&s, 10 * s.page_bytes() as u64), 160);
        assert_eq!(s.pages_for_tokens(0), 0);
        assert_eq!(s.pages_for_tokens(1), 1);
        assert_eq!(s.pages_for_tokens(16), 1);
        assert_eq!(s.pages_for_tokens(17), 2);
        assert_eq!(capacity_tokens(&s, u64::MAX), u64::MAX);
    }

    #[test]
    fn invalid_shapes_are_refused() {
        assert!(KvShape::new(0, 3, 64, 16, DType::F32).is_err());
        assert!(KvShape::new(30, 0, 64, 16, DType::F32).is_err());
        assert!(KvShape::new(30, 3, 64, 0, DType::F32).is_err());
        assert!(KvShape::new(30, 3, 64, 100_000, DType::F32).is_err());
        // q8_0 blocks must not straddle heads.
        assert!(KvShape::new(30, 3, 48, 16, DType::Q8_0).is_err());
        assert!(KvShape::new(30, 2, 16, 16, DType::Q8_0).is_err());
    }
}
