//! NCCL versions and the features they gate.
//!
//! The library a process loads can be older or newer than the bindings it was built against,
//! so every optional path asks two questions at run time: is the version high enough
//! (`ncclGetVersion`), and does the library export the function (functions newer than the
//! oldest supported library are looked up by name, never linked, so a binary still starts on
//! an older libnccl). [`Gates`] holds the answers for one process.

use std::fmt;

use super::api::{NcclApi, Optional};

/// An NCCL version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

/// The oldest NCCL the backend runs on: `ncclCommSplit` (2.18), `ncclMemAlloc` (2.19), and
/// nonblocking communicators (2.14) are used unconditionally.
pub const MIN_VERSION: NcclVersion = NcclVersion::new(2, 19, 0);

impl NcclVersion {
    /// `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        NcclVersion {
            major,
            minor,
            patch,
        }
    }

    /// Decodes `NCCL_VERSION_CODE` as `ncclGetVersion` reports it: `X*1000 + Y*100 + Z` up to
    /// 2.8, `X*10000 + Y*100 + Z` from 2.9 on (the macro in `nccl.h`).
    pub fn from_code(code: i32) -> Option<Self> {
        if code <= 0 {
            return None;
        }
        let c = code as u32;
        Some(if c < 10_000 {
            NcclVersion::new(c / 1000, (c % 1000) / 100, c % 100)
        } else {
            NcclVersion::new(c / 10_000, (c % 10_000) / 100, c % 100)
        })
    }

    /// The `NCCL_VERSION(X, Y, Z)` code of this version.
    pub fn code(self) -> i32 {
        let (x, y, z) = (self.major, self.minor, self.patch);
        if x <= 2 && y <= 8 {
            (x * 1000 + y * 100 + z) as i32
        } else {
            (x * 10_000 + y * 100 + z) as i32
        }
    }

    /// Whether this version is at least `major.minor.patch`.
    pub fn at_least(self, major: u32, minor: u32, patch: u32) -> bool {
        self >= NcclVersion::new(major, minor, patch)
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// What the loaded NCCL can do, decided once per process from its version and its exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gates {
    /// The library's version.
    pub version: NcclVersion,
    /// `ncclAlltoAll` (2.28.3); otherwise `all_to_all_single` is grouped send/recv.
    pub all_to_all: bool,
    /// `ncclGather` / `ncclScatter` (2.28.3); otherwise grouped send/recv.
    pub gather_scatter: bool,
    /// `ncclCommRevoke` (2.28.7): abort revokes in-flight work first.
    pub revoke: bool,
    /// `ncclCommShrink` (2.27.3): `Comm::shrink`.
    pub shrink: bool,
    /// Windows: `ncclCommWindowRegister` (2.27) and `ncclPutSignal` / `ncclSignal` /
    /// `ncclWaitSignal` (2.29).
    pub windows: bool,
    /// `ncclConfig_t::commName` (2.27): communicators carry their name into NCCL's logs.
    pub comm_name: bool,
}

impl Gates {
    /// The gates of `version`, with `has` telling which optional functions are exported.
    pub fn new(version: NcclVersion, has: impl Fn(Optional) -> bool) -> Self {
        Gates {
            version,
            all_to_all: version.at_least(2, 28, 3) && has(Optional::AllToAll),
            gather_scatter: version.at_least(2, 28, 3)
                && has(Optional::Gather)
                && has(Optional::Scatter),
            revoke: version.at_least(2, 28, 7) && has(Optional::Revoke),
            shrink: version.at_least(2, 27, 3) && has(Optional::Shrink),
            windows: version.at_least(2, 29, 0)
                && has(Optional::Window)
                && has(Optional::PutSignal)
                && has(Optional::Signal)
                && has(Optional::WaitSignal),
            comm_name: version.at_least(2, 27, 0),
        }
    }

    /// Asks `api` for its version and exports.
    ///
    /// # Errors
    ///
    /// A message naming the version when it is below [`MIN_VERSION`] or cannot be read.
    pub fn probe(api: &dyn NcclApi) -> Result<Self, String> {
        let code = api
            .version()
            .map_err(|c| format!("ncclGetVersion failed: {c}"))?;
        let version = NcclVersion::from_code(code)
            .ok_or_else(|| format!("ncclGetVersion reported an invalid version code {code}"))?;
        if version < MIN_VERSION {
            return Err(format!(
                "NCCL {version} is too old: the nccl backend needs NCCL >= {MIN_VERSION}"
            ));
        }
        Ok(Gates::new(version, |f| api.has(f)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_decode_in_both_encodings() {
        assert_eq!(
            NcclVersion::from_code(2708),
            Some(NcclVersion::new(2, 7, 8))
        );
        assert_eq!(
            NcclVersion::from_code(21903),
            Some(NcclVersion::new(2, 19, 3))
        );
        assert_eq!(
            NcclVersion::from_code(22807),
            Some(NcclVersion::new(2, 28, 7))
        );
        assert_eq!(
            NcclVersion::from_code(23203),
            Some(NcclVersion::new(2, 32, 3))
        );
        assert_eq!(NcclVersion::from_code(0), None);
        assert_eq!(NcclVersion::from_code(-3), None);
        for v in [
            NcclVersion::new(2, 8, 4),
            NcclVersion::new(2, 9, 0),
            NcclVersion::new(2, 28, 3),
        ] {
            assert_eq!(NcclVersion::from_code(v.code()), Some(v), "{v}");
        }
        assert_eq!(NcclVersion::new(2, 28, 0).code(), 22800);
        assert_eq!(NcclVersion::new(2, 30, 7).to_string(), "2.30.7");
    }

    #[test]
    fn gates_follow_versions_and_exports() {
        let all = |_| true;
        let g = Gates::new(NcclVersion::new(2, 27, 7), all);
        assert!(!g.all_to_all && !g.gather_scatter && !g.revoke && !g.windows && g.comm_name);
        let g = Gates::new(NcclVersion::new(2, 28, 3), all);
        assert!(g.all_to_all && g.gather_scatter && !g.revoke && !g.windows);
        let g = Gates::new(NcclVersion::new(2, 28, 6), all);
        assert!(!g.revoke, "revoke needs 2.28.7");
        let g = Gates::new(NcclVersion::new(2, 28, 7), all);
        assert!(g.revoke && !g.windows);
        let g = Gates::new(NcclVersion::new(2, 29, 0), all);
        assert!(g.windows);
        let g = Gates::new(NcclVersion::new(2, 26, 2), all);
        assert!(!g.comm_name && !g.shrink);
        let g = Gates::new(NcclVersion::new(2, 27, 2), all);
        assert!(!g.shrink, "shrink needs 2.27.3");
        let g = Gates::new(NcclVersion::new(2, 27, 3), all);
        assert!(g.shrink && !g.revoke);
        let g = Gates::new(NcclVersion::new(2, 30, 7), |f| f != Optional::Shrink);
        assert!(!g.shrink);
        // A new enough version without the export (a stripped or mismatched library).
        let g = Gates::new(NcclVersion::new(2, 30, 7), |f| f != Optional::AllToAll);
        assert!(!g.all_to_all && g.gather_scatter && g.windows);
        let g = Gates::new(NcclVersion::new(2, 30, 7), |f| f != Optional::WaitSignal);
        assert!(!g.windows);
        let g = Gates::new(NcclVersion::new(2, 30, 7), |f| f != Optional::Scatter);
        assert!(!g.gather_scatter);
    }

    #[test]
    fn probe_rejects_old_and_bad_versions() {
        use crate::mock::MockApi;
        let api = MockApi::new();
        api.set_version(21805);
        let e = Gates::probe(&api).unwrap_err();
        assert!(e.contains("2.18.5") && e.contains("2.19.0"), "{e}");
        api.set_version(0);
        assert!(Gates::probe(&api).unwrap_err().contains("invalid version"));
        api.set_version(22903);
        let g = Gates::probe(&api).expect("2.29.3 is supported");
        assert_eq!(g.version, NcclVersion::new(2, 29, 3));
        assert!(g.windows && g.revoke && g.all_to_all);
    }
}
