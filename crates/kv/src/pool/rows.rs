//! Rows: where a page lives in memory, writing a token's K/V row and
//! reading a layer back, both through the owner, epoch and watermark
//! checks (K1–K3).

use super::*;

impl Pool {
    // ---------------------------------------------------------- reads/writes

    pub(super) fn page_offset(&self, index: u32) -> usize {
        index as usize * self.shape.page_bytes()
    }

    pub(crate) fn page_mut(&mut self, index: u32) -> &mut [u8] {
        // The slice below is unchecked: the index must be a page's.
        assert!(index < self.pages, "page {index} of {}", self.pages);
        let off = self.page_offset(index);
        let len = self.shape.page_bytes();
        // SAFETY: index < pages (asserted above), so
        // [off, off+len) is inside the allocation; `&mut self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.memory.ptr.as_ptr().add(off), len) }
    }

    pub(crate) fn page(&self, index: u32) -> &[u8] {
        // The slice below is unchecked: the index must be a page's.
        assert!(index < self.pages, "page {index} of {}", self.pages);
        let off = self.page_offset(index);
        let len = self.shape.page_bytes();
        // SAFETY: as in `page_mut`; shared borrow of the pool, shared slice.
        unsafe { std::slice::from_raw_parts(self.memory.ptr.as_ptr().add(off), len) }
    }

    pub(super) fn write_canary(&mut self, index: u32, value: u64) {
        let data = self.shape.data_bytes();
        let trailer = &mut self.page_mut(index)[data..data + TRAILER_BYTES];
        for chunk in trailer.chunks_exact_mut(8) {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }

    /// Writes K and V of one token at `slot` of `layer`. Slots are written in
    /// order: `slot` may rewrite a written slot or append at the watermark,
    /// never leave a gap (a gap would make the watermark lie).
    pub fn write_token(
        &mut self,
        h: PageRef,
        owner: Owner,
        layer: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        self.check_write(h, owner)?;
        self.check_layer(layer)?;
        let width = self.shape.token_width();
        if k.len() != width || v.len() != width {
            return Err(KvError::RowWidth {
                expected: width,
                got: k.len().min(v.len()),
            });
        }
        let wm_index = h.index as usize * self.shape.layers + layer;
        let wm = self.watermarks[wm_index] as usize;
        // With the watermark check off (fault tests, the fault-incident
        // build) a write may leave a gap: the slots below stay whatever the
        // page held before.
        if slot >= self.shape.page_size || (slot > wm && !fault!(self, skip_watermark_check)) {
            bump(&self.counters.refused_write_gap);
            return Err(KvError::WriteGap {
                index: h.index,
                layer,
                slot,
                watermark: wm,
            });
        }
        let shape = self.shape;
        let layer_off = layer * shape.layer_bytes();
        let rb = shape.row_bytes();
        let k_off = layer_off + slot * rb;
        let v_off = layer_off + shape.half_bytes() + slot * rb;
        let page = self.page_mut(h.index);
        store_row(shape.dtype, &mut page[k_off..k_off + rb], k);
        store_row(shape.dtype, &mut page[v_off..v_off + rb], v);
        if slot >= wm {
            self.watermarks[wm_index] = (slot + 1) as u16;
        }
        Ok(())
    }

    /// The first `n` written K/V slots of `layer` in page `h`. Refused if any
    /// of them was not written by `owner` in the page's current epoch (K3).
    // Always inlined: it runs once per (page, layer) of every attention
    // step, and returned through memory its view costs a store-forwarding
    // stall (measured: 4.8 → 13 ns a call when it stopped being inlined).
    #[inline(always)]
    pub fn read_layer(
        &self,
        h: PageRef,
        owner: Owner,
        layer: usize,
        n: usize,
    ) -> Result<LayerView<'_>, KvError> {
        self.check_read(h, owner)?;
        self.check_layer(layer)?;
        let wm = self.watermarks[h.index as usize * self.shape.layers + layer] as usize;
        if n > wm && !fault!(self, skip_watermark_check) {
            bump(&self.counters.refused_unwritten_read);
            return Err(KvError::UnwrittenRead {
                index: h.index,
                layer,
                slots: n,
                watermark: wm,
            });
        }
        let n = n.min(self.shape.page_size);
        let shape = self.shape;
        let count = n * shape.token_width();
        let off = h.index as usize * shape.page_bytes() + layer * shape.layer_bytes();
        // SAFETY: index < pages (check_live) and layer < layers (check_layer),
        // so [off, off + layer_bytes) lies inside the allocation. Every
        // (page, layer) half starts 64-byte aligned (KvShape::validate) and
        // holds page_size × width ≥ count elements (page_size × row_bytes ≥
        // n × row_bytes bytes); f32, f16 and bytes have no invalid bit
        // patterns; `&self` forbids concurrent writes.
        unsafe {
            let k = self.memory.ptr.as_ptr().add(off);
            let v = k.add(shape.half_bytes());
            Ok(match shape.dtype {
                DType::F32 => LayerView::F32 {
                    k: std::slice::from_raw_parts(k.cast::<f32>(), count),
                    v: std::slice::from_raw_parts(v.cast::<f32>(), count),
                },
                DType::F16 => LayerView::F16 {
                    k: std::slice::from_raw_parts(k.cast::<f16>(), count),
                    v: std::slice::from_raw_parts(v.cast::<f16>(), count),
                },
                DType::Q8_0 => LayerView::Q8_0 {
                    k: std::slice::from_raw_parts(k, n * shape.row_bytes()),
                    v: std::slice::from_raw_parts(v, n * shape.row_bytes()),
                },
            })
        }
    }

    /// Rolls page `h` back to its first `slots` written slots in every
    /// layer: the positions a speculative step wrote and its verification
    /// rejected (issue 37). The watermarks move back (K3), so those rows
    /// read as unwritten until the owner writes them again; rewinding to
    /// `slots` at or above a layer's watermark leaves that layer as it is.
    /// Only the owner of a private page may rewind it (a cached page's
    /// slots never change), and not while a transfer holds a lease on it
    /// (the transfer may already have counted its written slots).
    pub fn rewind(&mut self, h: PageRef, owner: Owner, slots: usize) -> Result<(), KvError> {
        self.check_write(h, owner)?;
        if self.meta[h.index as usize].leases > 0 {
            return Err(KvError::Leased { index: h.index });
        }
        if fault!(self, skip_rewind) {
            return Ok(());
        }
        let layers = self.shape.layers;
        let at = h.index as usize * layers;
        for wm in &mut self.watermarks[at..at + layers] {
            *wm = (*wm).min(slots.min(u16::MAX as usize) as u16);
        }
        Ok(())
    }

    /// Written slots of (page, layer) in the current epoch.
    pub fn watermark(&self, h: PageRef, owner: Owner, layer: usize) -> Result<usize, KvError> {
        self.check_handle(h, owner)?;
        self.check_layer(layer)?;
        Ok(self.watermarks[h.index as usize * self.shape.layers + layer] as usize)
    }

    /// Slots written in every layer (the page's usable length).
    pub fn written_slots(&self, h: PageRef, owner: Owner) -> Result<usize, KvError> {
        self.check_handle(h, owner)?;
        let layers = self.shape.layers;
        let wms = &self.watermarks[h.index as usize * layers..(h.index as usize + 1) * layers];
        Ok(wms.iter().copied().min().unwrap_or(0) as usize)
    }
}
