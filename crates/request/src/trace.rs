//! W3C Trace Context: a request's place in a distributed trace, as the
//! `traceparent` header carries it (`00-<32 hex trace id>-<16 hex parent
//! span id>-<2 hex flags>`). Pure: parsing and formatting; ids are made
//! (randomly) where spans are recorded, not here.
//!
//! ```
//! use request::trace::TraceContext;
//! let t = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
//! assert!(t.sampled());
//! assert_eq!(t.header(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
//! // Malformed or all-zero ids are ignored (the spec: start a new trace).
//! assert!(TraceContext::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none());
//! ```

/// A trace id, the id of the span that is the parent of what comes next,
/// and the trace flags (bit 0: sampled).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

/// Longest `traceparent` value read (future versions may append fields).
pub const TRACEPARENT_BYTES_MAX: usize = 512;

fn hex_bytes<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        let pair = &s[2 * i..2 * i + 2];
        // Lowercase hex only (the spec's grammar).
        if !pair
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        *o = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl TraceContext {
    /// A `traceparent` value, or `None` when it is not one a receiver may
    /// use: wrong lengths, uppercase or non-hex digits, version `ff`, an
    /// all-zero trace or span id, version 00 with extra fields.
    pub fn parse(value: &str) -> Option<TraceContext> {
        let v = value.trim_matches([' ', '\t']);
        if v.len() > TRACEPARENT_BYTES_MAX || v.len() < 55 || !v.is_ascii() {
            return None;
        }
        let version = hex_bytes::<1>(&v[0..2])?[0];
        if version == 0xff || &v[2..3] != "-" || &v[35..36] != "-" || &v[52..53] != "-" {
            return None;
        }
        // Version 00 is exactly 55 characters; a later version may add
        // fields after a dash, which this reader ignores.
        if (version == 0 && v.len() != 55) || (v.len() > 55 && &v[55..56] != "-") {
            return None;
        }
        let trace_id = hex_bytes::<16>(&v[3..35])?;
        let span_id = hex_bytes::<8>(&v[36..52])?;
        let flags = hex_bytes::<1>(&v[53..55])?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }

    /// The `traceparent` value (version 00).
    pub fn header(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.span_id),
            self.flags
        )
    }

    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    pub fn trace_hex(&self) -> String {
        hex(&self.trace_id)
    }

    pub fn span_hex(&self) -> String {
        hex(&self.span_id)
    }

    /// The same trace with `span_id` as the parent of what follows.
    pub fn child(&self, span_id: [u8; 8]) -> TraceContext {
        TraceContext { span_id, ..*self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn round_trips_and_rejects_what_the_spec_rejects() {
        let t = TraceContext::parse(OK).unwrap();
        assert_eq!(t.header(), OK);
        assert_eq!(t.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.span_hex(), "00f067aa0ba902b7");
        assert_eq!(TraceContext::parse(&format!(" {OK}\t")), Some(t));
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "0é-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
        ];
        for b in bad {
            assert_eq!(TraceContext::parse(b), None, "{b:?}");
        }
        // A later version with an extra field: the known fields are read.
        let v1 = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-xyz";
        assert!(!TraceContext::parse(v1).unwrap().sampled());
        assert_eq!(TraceContext::parse(&"0".repeat(600)), None);
        let child = t.child([1; 8]);
        assert_eq!((child.trace_id, child.span_id), (t.trace_id, [1; 8]));
    }
}
