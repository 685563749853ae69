//! `ncclConfig_t`: built from [`CommOptions`] hints with `NCCL_CONFIG_INITIALIZER` semantics.
//!
//! [`RawConfig`] mirrors the `ncclConfig_v22800` layout of cudarc's 2.30 bindings field for
//! field (checked at compile time against `cudarc::nccl::sys::ncclConfig_t` when the feature is
//! on). Every tunable starts as `NCCL_CONFIG_UNDEF_INT` / `NULL` ("NCCL decides"), `size`,
//! `magic` and `version` are set as the initializer does, and only what the user asked for is
//! changed. NCCL copies `min(config.size, sizeof(its ncclConfig_t))` bytes and then resets the
//! fields newer than `config.version`, so one struct is safe on older and newer libraries alike.
//!
//! Hints (keys of [`CommOptions::hints`] starting with `nccl.`; other keys are left to other
//! backends):
//!
//! | hint | field | values |
//! |---|---|---|
//! | `nccl.cga_cluster_size` | `cgaClusterSize` | 0..=8 |
//! | `nccl.min_ctas` / `nccl.max_ctas` | `minCTAs` / `maxCTAs` | 1..=64 |
//! | `nccl.net_name` | `netName` | a network plugin name (`IB`, `Socket`, ...) |
//! | `nccl.split_share` | `splitShare` | 0 or 1: children share the parent's resources |
//! | `nccl.traffic_class` | `trafficClass` | >= 0 |
//! | `nccl.collnet_enable` | `collnetEnable` | 0 or 1 |
//! | `nccl.cta_policy` | `CTAPolicy` | >= 0 (`NCCL_CTA_POLICY_*` bits) |
//! | `nccl.nvls_ctas` | `nvlsCTAs` | >= 1 |
//!
//! `blocking` is always 0: the backend polls `ncclCommGetAsyncError` so that its timeouts can
//! abort a stuck init, split or collective (a blocking communicator cannot be interrupted).
//! `commName` is the communicator's name (NCCL >= 2.27 prints it in its logs).

use std::collections::BTreeMap;
use std::ffi::{c_char, CString};
use std::ptr;

/// `NCCL_CONFIG_UNDEF_INT`.
pub const UNDEF_INT: i32 = i32::MIN;
/// `NCCL_API_MAGIC`.
pub const API_MAGIC: u32 = 0xcafe_beef;
/// The `version` written into [`RawConfig`]: the layout is the 2.28 one (fields up to
/// `nvlinkCentricSched` are meaningful to NCCL; later ones stay undefined).
pub const CONFIG_VERSION: u32 = 22800;

/// The hint keys this backend understands.
pub const HINT_KEYS: [&str; 11] = [
    "nccl.cga_cluster_size",
    "nccl.min_ctas",
    "nccl.max_ctas",
    "nccl.net_name",
    "nccl.split_share",
    "nccl.traffic_class",
    "nccl.collnet_enable",
    "nccl.cta_policy",
    "nccl.nvls_ctas",
    "nccl.blocking",
    "nccl.shrinkable",
];

/// `ncclConfig_t` as laid out by NCCL 2.28-2.30 (cudarc's `ncclConfig_v22800`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_snake_case, missing_docs)]
pub struct RawConfig {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: i32,
    pub cgaClusterSize: i32,
    pub minCTAs: i32,
    pub maxCTAs: i32,
    pub netName: *const c_char,
    pub splitShare: i32,
    pub trafficClass: i32,
    pub commName: *const c_char,
    pub collnetEnable: i32,
    pub CTAPolicy: i32,
    pub shrinkShare: i32,
    pub nvlsCTAs: i32,
    pub nChannelsPerNetPeer: i32,
    pub nvlinkCentricSched: i32,
    pub graphUsageMode: i32,
    pub numRmaCtx: i32,
    pub maxP2pPeers: i32,
}

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER`: every tunable undefined.
    pub fn initializer() -> Self {
        RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: API_MAGIC,
            version: CONFIG_VERSION,
            blocking: UNDEF_INT,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
            graphUsageMode: UNDEF_INT,
            numRmaCtx: UNDEF_INT,
            maxP2pPeers: UNDEF_INT,
        }
    }
}

/// What a communicator asks of NCCL; owns the strings [`ConfigSpec::raw`] points into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSpec {
    /// The communicator's name (`commName`, NCCL >= 2.27).
    pub comm_name: Option<CString>,
    /// `cgaClusterSize`.
    pub cga_cluster_size: Option<i32>,
    /// `minCTAs`.
    pub min_ctas: Option<i32>,
    /// `maxCTAs`.
    pub max_ctas: Option<i32>,
    /// `netName`.
    pub net_name: Option<CString>,
    /// `splitShare`.
    pub split_share: Option<i32>,
    /// `trafficClass`.
    pub traffic_class: Option<i32>,
    /// `collnetEnable`.
    pub collnet_enable: Option<i32>,
    /// `CTAPolicy`.
    pub cta_policy: Option<i32>,
    /// `nvlsCTAs`.
    pub nvls_ctas: Option<i32>,
    /// Not an NCCL field (hint `nccl.shrinkable=1`): a communicator that fails is revoked and
    /// kept, not aborted, so that `Comm::shrink` can still rebuild it (`NCCL_SHRINK_ABORT`);
    /// it is aborted when dropped. Needs NCCL >= 2.28.7 (`ncclCommRevoke` stops its kernels).
    pub shrinkable: bool,
}

fn parse_int(key: &str, value: &str, lo: i32, hi: i32) -> Result<i32, String> {
    let v: i32 = value
        .trim()
        .parse()
        .map_err(|_| format!("hint {key}={value:?}: expected an integer in {lo}..={hi}"))?;
    if v < lo || v > hi {
        return Err(format!("hint {key}={v} is out of range {lo}..={hi}"));
    }
    Ok(v)
}

fn cstring(key: &str, value: &str) -> Result<CString, String> {
    CString::new(value).map_err(|_| format!("hint {key}={value:?} contains a NUL byte"))
}

impl ConfigSpec {
    /// The configuration of communicator `name` with `hints` (see the module docs);
    /// `with_name` is false for NCCL < 2.27, which has no `commName`.
    ///
    /// # Errors
    ///
    /// A message naming the hint when a `nccl.*` key is unknown or its value invalid.
    pub fn from_hints(
        name: &str,
        hints: &BTreeMap<String, String>,
        with_name: bool,
    ) -> Result<Self, String> {
        let mut spec = ConfigSpec {
            comm_name: if with_name {
                Some(cstring("name", name)?)
            } else {
                None
            },
            cga_cluster_size: None,
            min_ctas: None,
            max_ctas: None,
            net_name: None,
            split_share: None,
            traffic_class: None,
            collnet_enable: None,
            cta_policy: None,
            nvls_ctas: None,
            shrinkable: false,
        };
        for (key, value) in hints.iter().filter(|(k, _)| k.starts_with("nccl.")) {
            let k = key.as_str();
            match k {
                "nccl.cga_cluster_size" => spec.cga_cluster_size = Some(parse_int(k, value, 0, 8)?),
                "nccl.min_ctas" => spec.min_ctas = Some(parse_int(k, value, 1, 64)?),
                "nccl.max_ctas" => spec.max_ctas = Some(parse_int(k, value, 1, 64)?),
                "nccl.net_name" => spec.net_name = Some(cstring(k, value)?),
                "nccl.split_share" => spec.split_share = Some(parse_int(k, value, 0, 1)?),
                "nccl.traffic_class" => {
                    spec.traffic_class = Some(parse_int(k, value, 0, i32::MAX)?)
                }
                "nccl.collnet_enable" => spec.collnet_enable = Some(parse_int(k, value, 0, 1)?),
                "nccl.cta_policy" => spec.cta_policy = Some(parse_int(k, value, 0, i32::MAX)?),
                "nccl.nvls_ctas" => spec.nvls_ctas = Some(parse_int(k, value, 1, i32::MAX)?),
                "nccl.shrinkable" => spec.shrinkable = parse_int(k, value, 0, 1)? == 1,
                "nccl.blocking" => {
                    if parse_int(k, value, 0, 1)? == 1 {
                        return Err("hint nccl.blocking=1 is not supported: the nccl backend \
                                    polls nonblocking communicators so its timeouts can abort \
                                    a stuck call"
                            .to_string());
                    }
                }
                _ => {
                    return Err(format!(
                        "unknown hint {key:?}; the nccl backend understands {HINT_KEYS:?}"
                    ))
                }
            }
        }
        if let (Some(lo), Some(hi)) = (spec.min_ctas, spec.max_ctas) {
            if lo > hi {
                return Err(format!(
                    "hints nccl.min_ctas={lo} and nccl.max_ctas={hi}: the minimum exceeds the maximum"
                ));
            }
        }
        Ok(spec)
    }

    /// The raw struct: the initializer with `blocking = 0` and the requested fields set. It
    /// points into `self`, which must outlive every use of it (including a nonblocking call
    /// still in progress).
    pub fn raw(&self) -> RawConfig {
        let mut c = RawConfig::initializer();
        c.blocking = 0;
        let set = |slot: &mut i32, v: Option<i32>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut c.cgaClusterSize, self.cga_cluster_size);
        set(&mut c.minCTAs, self.min_ctas);
        set(&mut c.maxCTAs, self.max_ctas);
        set(&mut c.splitShare, self.split_share);
        set(&mut c.trafficClass, self.traffic_class);
        set(&mut c.collnetEnable, self.collnet_enable);
        set(&mut c.CTAPolicy, self.cta_policy);
        set(&mut c.nvlsCTAs, self.nvls_ctas);
        if let Some(n) = &self.net_name {
            c.netName = n.as_ptr();
        }
        if let Some(n) = &self.comm_name {
            c.commName = n.as_ptr();
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::mem::offset_of;

    fn hints(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn layout_matches_nccl_2_30() {
        // The offsets of `ncclConfig_v22800` in NCCL 2.30's nccl.h on LP64.
        assert_eq!(offset_of!(RawConfig, size), 0);
        assert_eq!(offset_of!(RawConfig, magic), 8);
        assert_eq!(offset_of!(RawConfig, version), 12);
        assert_eq!(offset_of!(RawConfig, blocking), 16);
        assert_eq!(offset_of!(RawConfig, maxCTAs), 28);
        assert_eq!(offset_of!(RawConfig, netName), 32);
        assert_eq!(offset_of!(RawConfig, splitShare), 40);
        assert_eq!(offset_of!(RawConfig, trafficClass), 44);
        assert_eq!(offset_of!(RawConfig, commName), 48);
        assert_eq!(offset_of!(RawConfig, collnetEnable), 56);
        assert_eq!(offset_of!(RawConfig, maxP2pPeers), 88);
        assert_eq!(std::mem::size_of::<RawConfig>(), 96);
    }

    #[test]
    fn initializer_leaves_everything_undefined() {
        let c = RawConfig::initializer();
        assert_eq!(c.size, 96);
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.version, 22800);
        for v in [
            c.blocking,
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.splitShare,
            c.trafficClass,
            c.collnetEnable,
            c.CTAPolicy,
            c.shrinkShare,
            c.nvlsCTAs,
            c.nChannelsPerNetPeer,
            c.nvlinkCentricSched,
            c.graphUsageMode,
            c.numRmaCtx,
            c.maxP2pPeers,
        ] {
            assert_eq!(v, i32::MIN);
        }
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn default_spec_is_nonblocking_and_named() {
        let spec = ConfigSpec::from_hints("tp", &BTreeMap::new(), true).unwrap();
        let c = spec.raw();
        assert_eq!(
            c.blocking, 0,
            "the backend always asks for a nonblocking communicator"
        );
        assert_eq!(c.minCTAs, UNDEF_INT);
        assert!(c.netName.is_null());
        // SAFETY: `commName` points into `spec`, alive here.
        let name = unsafe { CStr::from_ptr(c.commName) };
        assert_eq!(name.to_str().unwrap(), "tp");
        // NCCL < 2.27 has no commName: leave it NULL.
        let old = ConfigSpec::from_hints("tp", &BTreeMap::new(), false).unwrap();
        assert!(old.raw().commName.is_null());
    }

    #[test]
    fn hints_set_fields_and_ignore_other_backends() {
        let h = hints(&[
            ("nccl.min_ctas", "4"),
            ("nccl.max_ctas", "16"),
            ("nccl.net_name", "Socket"),
            ("nccl.split_share", "1"),
            ("nccl.cga_cluster_size", "2"),
            ("nccl.traffic_class", "3"),
            ("nccl.collnet_enable", "0"),
            ("nccl.cta_policy", "1"),
            ("nccl.nvls_ctas", "8"),
            ("nccl.blocking", "0"),
            ("ip", "10.0.0.1"),
        ]);
        let spec = ConfigSpec::from_hints("dp", &h, true).unwrap();
        let c = spec.raw();
        assert_eq!(
            (c.minCTAs, c.maxCTAs, c.splitShare, c.cgaClusterSize),
            (4, 16, 1, 2)
        );
        assert_eq!(
            (c.trafficClass, c.collnetEnable, c.CTAPolicy, c.nvlsCTAs),
            (3, 0, 1, 8)
        );
        assert_eq!(c.shrinkShare, UNDEF_INT);
        // SAFETY: `netName` points into `spec`, alive here.
        assert_eq!(
            unsafe { CStr::from_ptr(c.netName) }.to_str().unwrap(),
            "Socket"
        );
    }

    #[test]
    fn bad_hints_are_named() {
        let e = ConfigSpec::from_hints("w", &hints(&[("nccl.min_ctas", "x")]), true).unwrap_err();
        assert!(e.contains("nccl.min_ctas") && e.contains("integer"), "{e}");
        let e = ConfigSpec::from_hints("w", &hints(&[("nccl.max_ctas", "65")]), true).unwrap_err();
        assert!(e.contains("out of range"), "{e}");
        let e = ConfigSpec::from_hints("w", &hints(&[("nccl.minctas", "2")]), true).unwrap_err();
        assert!(
            e.contains("unknown hint") && e.contains("nccl.min_ctas"),
            "{e}"
        );
        let e = ConfigSpec::from_hints("w", &hints(&[("nccl.blocking", "1")]), true).unwrap_err();
        assert!(e.contains("nonblocking"), "{e}");
        let e = ConfigSpec::from_hints(
            "w",
            &hints(&[("nccl.min_ctas", "8"), ("nccl.max_ctas", "2")]),
            true,
        )
        .unwrap_err();
        assert!(e.contains("exceeds"), "{e}");
        let e = ConfigSpec::from_hints("a\0b", &BTreeMap::new(), true).unwrap_err();
        assert!(e.contains("NUL"), "{e}");
    }
}
