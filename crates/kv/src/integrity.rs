//! Canaries (K7) and checksums (K6): pure functions of their inputs.
//!
//! Both use xxh3-64. It was chosen by measurement against CRC32C
//! (`cargo bench -p kv --bench pool -- checksum`, figures in BENCHMARKS.md):
//! it is faster on this machine and 64 bits wide, so a random corruption goes
//! unnoticed with probability 2^-64 rather than 2^-32.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::{Owner, RequestId};

/// Domain separators so that a canary can never equal a checksum seed.
const CANARY_DOMAIN: u64 = 0x6b76_2d63_616e_6172; // "kv-canar"
const CHECKSUM_DOMAIN: u64 = 0x6b76_2d63_6865_636b; // "kv-check"

/// The canary of a page: a function of (owner with its scope, epoch,
/// index), so a page that changed hands, or a handle of another epoch,
/// never shows the expected value, and a stray write into the trailer is
/// caught.
pub fn canary_value(owner: Owner, epoch: u64, index: u32) -> u64 {
    let mut buf = [0u8; 48];
    buf[0..8].copy_from_slice(&CANARY_DOMAIN.to_le_bytes());
    buf[8..16].copy_from_slice(&owner.request.0.to_le_bytes());
    buf[16..24].copy_from_slice(&owner.tenant.0.to_le_bytes());
    buf[24..32].copy_from_slice(&epoch.to_le_bytes());
    buf[32..36].copy_from_slice(&index.to_le_bytes());
    buf[40..48].copy_from_slice(&owner.scope.0.to_le_bytes());
    let v = xxh3_64(&buf);
    // Never the poison pattern nor zero, whatever the inputs.
    if v == 0 || v == u64::MAX {
        0x5a5a_5a5a_5a5a_5a5a
    } else {
        v
    }
}

/// The checksum of a page's bytes bound to (request, epoch, position in the
/// sequence): the same bytes sent for another request, to another epoch of
/// the destination page or at another position give another digest (K6).
pub fn page_checksum(request: RequestId, epoch: u64, position: u32, bytes: &[u8]) -> u64 {
    let mut buf = [0u8; 28];
    buf[0..8].copy_from_slice(&request.0.to_le_bytes());
    buf[8..16].copy_from_slice(&epoch.to_le_bytes());
    buf[16..20].copy_from_slice(&position.to_le_bytes());
    buf[20..28].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    let seed = xxh3_64_with_seed(&buf, CHECKSUM_DOMAIN);
    xxh3_64_with_seed(bytes, seed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RequestId, TenantId};

    #[test]
    fn canary_depends_on_every_input() {
        let o = Owner::new(RequestId(1), TenantId(2));
        let base = canary_value(o, 3, 4);
        assert_ne!(
            base,
            canary_value(Owner::new(RequestId(9), TenantId(2)), 3, 4)
        );
        assert_ne!(
            base,
            canary_value(Owner::new(RequestId(1), TenantId(9)), 3, 4)
        );
        let other_scope = Owner::request(RequestId(1), TenantId(2), Some(crate::Scope::derived(7)));
        assert_ne!(base, canary_value(other_scope, 3, 4));
        assert_ne!(base, canary_value(o, 5, 4));
        assert_ne!(base, canary_value(o, 3, 5));
        assert_eq!(base, canary_value(o, 3, 4));
    }

    #[test]
    fn checksum_binds_request_epoch_position_and_bytes() {
        let bytes = vec![7u8; 4096];
        let base = page_checksum(RequestId(1), 3, 0, &bytes);
        assert_eq!(base, page_checksum(RequestId(1), 3, 0, &bytes));
        assert_ne!(base, page_checksum(RequestId(2), 3, 0, &bytes));
        assert_ne!(base, page_checksum(RequestId(1), 5, 0, &bytes));
        assert_ne!(base, page_checksum(RequestId(1), 3, 1, &bytes));
        let mut flipped = bytes.clone();
        flipped[4000] ^= 1;
        assert_ne!(base, page_checksum(RequestId(1), 3, 0, &flipped));
        assert_ne!(base, page_checksum(RequestId(1), 3, 0, &bytes[..4095]));
    }
}
