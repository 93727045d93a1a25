//! What crosses to another node: a page exported (never carrying an
//! earlier owner's bytes) and imported exactly once (K10), its canary
//! (K7) and checksum (K6).

use super::*;

impl Pool {
    // -------------------------------------------------------------- transfer

    /// Copies a page's KV data out for transfer (`out.len()` must be
    /// `shape.data_bytes()`), zeroing every slot not written in the current
    /// epoch so no byte of an earlier owner ever leaves the node. Allowed
    /// while the page is leased even if its free is pending (the transfer
    /// that holds the lease is still reading it). Returns the number of
    /// slots written in every layer.
    pub fn export_page(&self, h: PageRef, owner: Owner, out: &mut [u8]) -> Result<usize, KvError> {
        let meta = self.check_handle(h, owner)?;
        if meta.free_pending && meta.leases == 0 {
            bump(&self.counters.refused_release_pending);
            return Err(KvError::ReleasePending { index: h.index });
        }
        let shape = self.shape;
        if out.len() != shape.data_bytes() {
            return Err(KvError::PageBytes {
                expected: shape.data_bytes(),
                got: out.len(),
            });
        }
        let page = self.page(h.index);
        let row_bytes = shape.row_bytes();
        let mut slots = shape.page_size;
        for layer in 0..shape.layers {
            let wm = self.watermarks[h.index as usize * shape.layers + layer] as usize;
            slots = slots.min(wm);
            for half in 0..2 {
                let off = layer * shape.layer_bytes() + half * shape.half_bytes();
                let written = wm * row_bytes;
                out[off..off + written].copy_from_slice(&page[off..off + written]);
                out[off + written..off + shape.half_bytes()].fill(0);
            }
        }
        Ok(slots)
    }

    /// Writes a transferred page: `bytes` (`shape.data_bytes()` long) with
    /// `slots` written slots in every layer. Refused unless the page was not
    /// written in this epoch: a page is filled by one transfer exactly once
    /// (K10).
    pub fn import_page(
        &mut self,
        h: PageRef,
        owner: Owner,
        bytes: &[u8],
        slots: usize,
    ) -> Result<(), KvError> {
        self.check_write(h, owner)?;
        let shape = self.shape;
        if bytes.len() != shape.data_bytes() {
            return Err(KvError::PageBytes {
                expected: shape.data_bytes(),
                got: bytes.len(),
            });
        }
        if slots == 0 || slots > shape.page_size {
            return Err(KvError::WriteGap {
                index: h.index,
                layer: 0,
                slot: slots,
                watermark: 0,
            });
        }
        let layers = shape.layers;
        let wms = &self.watermarks[h.index as usize * layers..(h.index as usize + 1) * layers];
        if wms.iter().any(|&w| w != 0) {
            bump(&self.counters.refused_already_written);
            return Err(KvError::AlreadyWritten { index: h.index });
        }
        let data = shape.data_bytes();
        self.page_mut(h.index)[..data].copy_from_slice(bytes);
        self.watermarks[h.index as usize * layers..(h.index as usize + 1) * layers]
            .fill(slots as u16);
        Ok(())
    }

    // ------------------------------------------------------ canary, checksum

    /// Checks the page's canary (K7): the trailer must hold the value derived
    /// from (owner, epoch, index) in all eight words.
    pub fn check_canary(&self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        let meta = self.check_handle(h, owner)?;
        if fault!(self, skip_canary_check) {
            return Ok(());
        }
        // A cached page carries its scope's cache owner.
        let expected_owner = if meta.shared { meta.owner } else { owner };
        let expected = canary_value(expected_owner, h.epoch, h.index);
        let data = self.shape.data_bytes();
        let trailer = &self.page(h.index)[data..data + TRAILER_BYTES];
        let intact = trailer
            .chunks_exact(8)
            .all(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")) == expected);
        if !intact {
            bump(&self.counters.canary_mismatch);
            return Err(KvError::CanaryMismatch { index: h.index });
        }
        Ok(())
    }

    /// Checks a received page's bytes against the checksum its sender
    /// computed, bound to (request, epoch, position) (K6). Counts a mismatch.
    pub fn verify_checksum(
        &self,
        request: crate::RequestId,
        epoch: u64,
        position: u32,
        bytes: &[u8],
        expected: u64,
    ) -> Result<(), KvError> {
        if fault!(self, skip_checksum_check) {
            return Ok(());
        }
        if page_checksum(request, epoch, position, bytes) != expected {
            bump(&self.counters.checksum_mismatch);
            return Err(KvError::ChecksumMismatch { position });
        }
        Ok(())
    }
}
