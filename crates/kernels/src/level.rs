//! Runtime selection of the SIMD kernel level.

use std::sync::OnceLock;

/// Name of the environment variable that forces a kernel level
/// (`scalar`, `avx2` or `avx512`).
pub const KERNEL_ENV: &str = "ISOSERVE_KERNEL";

/// A family of kernel implementations.
///
/// All levels compute exactly the same floating-point operations in the same
/// order (see the crate documentation), so their results are bitwise
/// identical; they differ only in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelLevel {
    /// Portable Rust, the reference implementation.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (`maddubs` integer dot products).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL + VNNI (`vpdpbusd` integer dot products).
    Avx512,
}

impl KernelLevel {
    /// Every level, slowest first.
    pub const ALL: [KernelLevel; 3] = [KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512];

    /// The name used by [`KERNEL_ENV`].
    pub const fn name(self) -> &'static str {
        match self {
            KernelLevel::Scalar => "scalar",
            KernelLevel::Avx2 => "avx2",
            KernelLevel::Avx512 => "avx512",
        }
    }

    /// Parses a level name (case-insensitive, surrounding blanks ignored).
    pub fn parse(s: &str) -> Option<KernelLevel> {
        let s = s.trim();
        KernelLevel::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s))
    }

    /// Whether this CPU can run the level.
    pub fn is_supported(self) -> bool {
        match self {
            KernelLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            KernelLevel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            KernelLevel::Avx512 => {
                KernelLevel::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The levels this CPU supports, slowest first.
    pub fn supported() -> impl Iterator<Item = KernelLevel> {
        KernelLevel::ALL.into_iter().filter(|l| l.is_supported())
    }

    /// The fastest level this CPU supports.
    pub fn best() -> KernelLevel {
        KernelLevel::supported()
            .last()
            .unwrap_or(KernelLevel::Scalar)
    }

    /// The level used by [`crate::matmul`]: chosen once per process, from
    /// [`KERNEL_ENV`] if set (an unknown or unsupported value falls back to
    /// [`KernelLevel::best`] with a warning on stderr), else the best level.
    pub fn active() -> KernelLevel {
        static ACTIVE: OnceLock<KernelLevel> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let requested = std::env::var(KERNEL_ENV).ok();
            resolve(requested.as_deref()).unwrap_or_else(|msg| {
                eprintln!(
                    "isoserve kernels: {msg}; using {}",
                    KernelLevel::best().name()
                );
                KernelLevel::best()
            })
        })
    }
}

/// Why a requested kernel level cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LevelError {
    /// Not a level's name.
    Unknown(String),
    /// A level this CPU lacks the instructions for.
    Unsupported(String),
}

impl std::fmt::Display for LevelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LevelError::Unknown(s) => {
                write!(f, "{KERNEL_ENV}={s:?} is not one of scalar, avx2, avx512")
            }
            LevelError::Unsupported(s) => {
                write!(f, "{KERNEL_ENV}={s:?} is not supported by this CPU")
            }
        }
    }
}

impl std::error::Error for LevelError {}

/// Resolves an optional requested level name into a supported level.
fn resolve(requested: Option<&str>) -> Result<KernelLevel, LevelError> {
    match requested {
        None => Ok(KernelLevel::best()),
        Some(s) if s.trim().is_empty() => Ok(KernelLevel::best()),
        Some(s) => match KernelLevel::parse(s) {
            None => Err(LevelError::Unknown(s.to_string())),
            Some(l) if !l.is_supported() => Err(LevelError::Unsupported(s.to_string())),
            Some(l) => Ok(l),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names() {
        assert_eq!(KernelLevel::parse("scalar"), Some(KernelLevel::Scalar));
        assert_eq!(KernelLevel::parse(" AVX2 "), Some(KernelLevel::Avx2));
        assert_eq!(KernelLevel::parse("avx512"), Some(KernelLevel::Avx512));
        assert_eq!(KernelLevel::parse("sse"), None);
    }

    #[test]
    fn resolve_env_values() {
        assert_eq!(resolve(None), Ok(KernelLevel::best()));
        assert_eq!(resolve(Some("")), Ok(KernelLevel::best()));
        assert_eq!(resolve(Some("scalar")), Ok(KernelLevel::Scalar));
        assert!(resolve(Some("neon")).is_err());
        for l in KernelLevel::ALL {
            assert_eq!(resolve(Some(l.name())).is_ok(), l.is_supported());
        }
        assert!(KernelLevel::active().is_supported());
    }
}
