//! Kernel counts from CUPTI's activity API: every kernel the process runs on any GPU leaves
//! one record (start and end timestamps), whichever library launched it (candle's kernels,
//! cuBLAS, NCCL, the fused kernels), so a step's launches are counted, not estimated.
//!
//! CUPTI is loaded at run time (`$CDT_CUPTI_LIB`, else `libcupti.so`, `libcupti.so.13`,
//! `libcupti.so.12` on the loader's path), never linked: a binary without it on the machine
//! still starts, and [`KernelCounter::start`] says why counting is off. CUPTI's activity
//! buffers are process-global, so one counter is on at a time, and it counts every thread's
//! kernels (with several rank threads in a process: all of them).
//!
//! Only the kernel records are enabled (`CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL`, which does
//! not serialize kernels); the cost is one record written per kernel by CUPTI.
//!
//! Each kernel's name is read too, where the library's API version is one whose kernel records
//! are known to keep it at [`NAME_AT`] (`cuptiGetVersion` from CUDA 10.0 through 13.x:
//! `CUpti_ActivityKernel4` to `CUpti_ActivityKernel10`, offsets taken with `offsetof` on the
//! CUDA 13.0 headers), so a count says where the time went ([`KernelCount::by_name`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use super::ProfileError;

/// `CUpti_ActivityKind`s of kernel records (`KERNEL` serialized, `CONCURRENT_KERNEL`).
const KIND_KERNEL: u32 = 3;
const KIND_CONCURRENT_KERNEL: u32 = 10;
/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`: flush buffers that are not full yet.
const FLUSH_FORCED: u32 = 1;
/// `CUPTI_SUCCESS`; `CUPTI_ERROR_MAX_LIMIT_REACHED` ends a buffer's records.
const SUCCESS: i32 = 0;
const END_OF_BUFFER: i32 = 12;
/// The offsets of `start` and `end` (u64 nanoseconds) in every kernel record layout since
/// `CUpti_ActivityKernel3` (kind u32, cache config u8, shared memory config u8, registers
/// u16, two partitioned-cache enums u32, then start and end), and the bytes read.
const START_AT: usize = 16;
const END_AT: usize = 24;
const KERNEL_RECORD_MIN: usize = 32;
/// The offset of `name` (a `const char*`, null or a NUL-terminated string CUPTI owns) in
/// `CUpti_ActivityKernel4` through `CUpti_ActivityKernel10` (all 104; their sizes 144-216 bytes),
/// and the bytes a record needs for it to be read.
const NAME_AT: usize = 104;
const NAMED_RECORD_MIN: usize = NAME_AT + 8;
/// The CUPTI API versions (`cuptiGetVersion`) whose kernel records are those: 12 (CUDA 10.0)
/// to 28 (CUDA 12.9 update 1), then CUDA 13.x's `13yyzz`.
const NAMED_VERSIONS: [std::ops::RangeInclusive<u32>; 2] = [12..=28, 130_000..=139_999];
/// Names longer than this are cut (cuBLAS's and templates' can run to hundreds of bytes).
const NAME_MAX: usize = 120;
/// Each activity buffer: 8 MiB, 8-byte aligned (a `u64` allocation).
const BUF_WORDS: usize = 1 << 20;
const BUF_BYTES: usize = BUF_WORDS * 8;

type CuptiResult = i32;
type RequestFn = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type CompleteFn = unsafe extern "C" fn(*mut std::ffi::c_void, u32, *mut u8, usize, usize);

/// The CUPTI functions used, resolved once; the library stays loaded for the process.
struct Api {
    _lib: libloading::Library,
    register: unsafe extern "C" fn(Option<RequestFn>, Option<CompleteFn>) -> CuptiResult,
    enable: unsafe extern "C" fn(u32) -> CuptiResult,
    disable: unsafe extern "C" fn(u32) -> CuptiResult,
    flush_all: unsafe extern "C" fn(u32) -> CuptiResult,
    next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> CuptiResult,
    dropped: unsafe extern "C" fn(*mut std::ffi::c_void, u32, *mut usize) -> CuptiResult,
    /// Whether kernel records carry a name at [`NAME_AT`]: the library's `cuptiGetVersion`
    /// is one of [`NAMED_VERSIONS`] (false without the function).
    names: bool,
}

static API: OnceLock<Result<Api, ProfileError>> = OnceLock::new();
static REGISTERED: OnceLock<Result<(), ProfileError>> = OnceLock::new();
static ON: AtomicBool = AtomicBool::new(false);
static KERNELS: AtomicU64 = AtomicU64::new(0);
static BUSY_NS: AtomicU64 = AtomicU64::new(0);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static MALFORMED: AtomicU64 = AtomicU64::new(0);
/// Kernels and their summed time by name, since the last take.
static BY_NAME: std::sync::Mutex<Vec<KernelTime>> = std::sync::Mutex::new(Vec::new());

fn candidates() -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(p) = std::env::var("CDT_CUPTI_LIB") {
        if !p.is_empty() {
            names.push(p);
        }
    }
    names.extend(["libcupti.so", "libcupti.so.13", "libcupti.so.12"].map(String::from));
    names
}

/// Function `name` of `lib`, or what the loader said, naming it.
///
/// # Safety
///
/// `T` is the type of the function `name` in `lib`.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    let c = format!("{name}\0");
    // SAFETY: the caller's promise.
    match unsafe { lib.get::<T>(c.as_bytes()) } {
        Ok(f) => Ok(*f),
        Err(e) => Err(match std::error::Error::source(&e) {
            Some(why) => format!("no {name} ({e}: {why})"),
            None => format!("no {name} ({e})"),
        }),
    }
}

/// The functions of a loaded library, or the first one it lacks.
///
/// # Safety
///
/// `lib` is a CUPTI library: each symbol read is the CUPTI function of that name, whose C
/// signature (cupti_activity.h, unchanged since CUDA 5.5) is the function type it is read as.
unsafe fn resolve(lib: libloading::Library) -> Result<Api, String> {
    // SAFETY: the caller's promise; the pointers are copied out while `lib`, moved into `Api`
    // with them, is alive. `cuptiGetVersion(uint32_t*)` writes one u32 through a valid pointer.
    unsafe {
        let version: Option<unsafe extern "C" fn(*mut u32) -> CuptiResult> =
            sym(&lib, "cuptiGetVersion").ok();
        let names = version.is_some_and(|get| {
            let mut v = 0u32;
            get(&mut v) == SUCCESS && NAMED_VERSIONS.iter().any(|r| r.contains(&v))
        });
        Ok(Api {
            names,
            register: sym(&lib, "cuptiActivityRegisterCallbacks")?,
            enable: sym(&lib, "cuptiActivityEnable")?,
            disable: sym(&lib, "cuptiActivityDisable")?,
            flush_all: sym(&lib, "cuptiActivityFlushAll")?,
            next_record: sym(&lib, "cuptiActivityGetNextRecord")?,
            dropped: sym(&lib, "cuptiActivityGetNumDroppedRecords")?,
            _lib: lib,
        })
    }
}

/// The first candidate that loads and has every function; otherwise what each one lacked.
fn load() -> Result<Api, ProfileError> {
    let names = candidates();
    let mut failures = Vec::new();
    for name in &names {
        // SAFETY: loading CUPTI runs its initialisers, which only set up the library; the
        // handle is kept in `API` for the rest of the process, so no resolved function
        // outlives it.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        // SAFETY: a library loaded under a CUPTI name is taken for CUPTI; one that lacks a
        // function is passed over (the next candidate is tried).
        match unsafe { resolve(lib) } {
            Ok(api) => return Ok(api),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    Err(ProfileError::NoCupti {
        tried: names.join(", "),
        message: failures.join("; "),
    })
}

fn api() -> Result<&'static Api, ProfileError> {
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn check(call: &'static str, code: CuptiResult) -> Result<(), ProfileError> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(ProfileError::Cupti { call, code })
    }
}

/// CUPTI asks for a buffer to write records into.
///
/// # Safety
///
/// Called by CUPTI with valid out-pointers.
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max: *mut usize) {
    let words: Box<[u64]> = vec![0u64; BUF_WORDS].into_boxed_slice();
    let ptr = Box::into_raw(words).cast::<u8>();
    ours().push(ptr as usize);
    // SAFETY: CUPTI passes valid, writable out-pointers. The buffer is leaked here and
    // reclaimed, with the same length, in `buffer_completed`, which frees only buffers listed
    // in `OURS` (each once: it takes them off the list).
    unsafe {
        *buffer = ptr;
        *size = BUF_BYTES;
        *max = 0; // as many records as fit
    }
}

/// The buffers `buffer_requested` handed out and CUPTI has not handed back: the only ones
/// `buffer_completed` reads and frees (callbacks are process-wide, so a buffer another CUPTI
/// client requested before ours replaced its callbacks could come back to ours).
static OURS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

fn ours() -> std::sync::MutexGuard<'static, Vec<usize>> {
    OURS.lock().unwrap_or_else(|e| e.into_inner())
}

/// CUPTI hands back a buffer with `valid` bytes of records: count the kernels, free it.
///
/// # Safety
///
/// Called by CUPTI with a buffer and the number of bytes of records in it. Only a buffer
/// `buffer_requested` handed out (listed in `OURS`) is read and freed; any other is counted
/// as malformed and left alone.
unsafe extern "C" fn buffer_completed(
    ctx: *mut std::ffi::c_void,
    stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    if buffer.is_null() {
        return;
    }
    {
        let mut ours = ours();
        match ours.iter().position(|&p| p == buffer as usize) {
            Some(i) => {
                ours.swap_remove(i);
            }
            None => {
                MALFORMED.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
    if let Ok(api) = api() {
        let valid = valid.min(BUF_BYTES);
        let mut record: *mut u8 = std::ptr::null_mut();
        // Each record must lie past the previous one: a library that hands the same record
        // (or an earlier one) again would otherwise keep this loop going.
        let mut past: Option<usize> = None;
        loop {
            // SAFETY: `buffer` holds `valid` bytes of records CUPTI wrote; `record` is the
            // previous record (null for the first), as the iteration requires.
            let code = unsafe { (api.next_record)(buffer, valid, &mut record) };
            if code != SUCCESS || record.is_null() {
                if code != END_OF_BUFFER && code != SUCCESS {
                    MALFORMED.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
            let offset = (record as usize).wrapping_sub(buffer as usize);
            if offset >= valid || valid - offset < 4 || past.is_some_and(|p| offset <= p) {
                MALFORMED.fetch_add(1, Ordering::Relaxed);
                break;
            }
            past = Some(offset);
            // SAFETY: `record` lies inside the buffer with at least 4 bytes left (checked);
            // unaligned reads copy the bytes out.
            let kind = unsafe { record.cast::<u32>().read_unaligned() };
            if kind != KIND_KERNEL && kind != KIND_CONCURRENT_KERNEL {
                continue;
            }
            if valid - offset < KERNEL_RECORD_MIN {
                MALFORMED.fetch_add(1, Ordering::Relaxed);
                break;
            }
            // SAFETY: a kernel record with at least `KERNEL_RECORD_MIN` bytes inside the
            // buffer (checked): `start` and `end` are its u64s at `START_AT` and `END_AT`.
            let (start, end) = unsafe {
                (
                    record.add(START_AT).cast::<u64>().read_unaligned(),
                    record.add(END_AT).cast::<u64>().read_unaligned(),
                )
            };
            KERNELS.fetch_add(1, Ordering::Relaxed);
            let ns = end.saturating_sub(start);
            BUSY_NS.fetch_add(ns, Ordering::Relaxed);
            let name = if !api.names {
                None
            } else if valid - offset < NAMED_RECORD_MIN {
                Some(String::from("(record too short for a name)"))
            } else {
                // SAFETY: a kernel record of a library whose API version writes
                // `CUpti_ActivityKernel4`..`10` records (checked at load), with at least
                // `NAMED_RECORD_MIN` bytes inside the buffer (checked): its `name` is the
                // pointer at `NAME_AT`, null or a NUL-terminated string CUPTI keeps alive at
                // least while it hands the buffer back.
                unsafe {
                    let p = record
                        .add(NAME_AT)
                        .cast::<*const std::ffi::c_char>()
                        .read_unaligned();
                    Some(if p.is_null() {
                        String::from("(unnamed)")
                    } else {
                        let mut n = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
                        if n.len() > NAME_MAX {
                            let mut cut = NAME_MAX;
                            while !n.is_char_boundary(cut) {
                                cut -= 1;
                            }
                            n.truncate(cut);
                            n.push_str("...");
                        }
                        n
                    })
                }
            };
            if let Some(name) = name {
                let mut by = BY_NAME.lock().unwrap_or_else(|e| e.into_inner());
                match by.iter_mut().find(|k| k.name == name) {
                    Some(k) => {
                        k.count += 1;
                        k.busy_ns += ns;
                    }
                    None => by.push(KernelTime {
                        name,
                        count: 1,
                        busy_ns: ns,
                    }),
                }
            }
        }
        let mut dropped = 0usize;
        // SAFETY: `ctx` and `stream` are the ones CUPTI passed for this buffer; `dropped` is a
        // valid out-pointer.
        if unsafe { (api.dropped)(ctx, stream, &mut dropped) } == SUCCESS {
            DROPPED.fetch_add(dropped as u64, Ordering::Relaxed);
        }
    }
    // SAFETY: `buffer` was in `OURS` (taken off it above, so this runs once per buffer): it
    // came from `buffer_requested` as a leaked `Box<[u64]>` of `BUF_WORDS` words.
    drop(unsafe {
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            buffer.cast::<u64>(),
            BUF_WORDS,
        ))
    });
}

/// The kernels of one name: how many ran and their summed GPU time.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KernelTime {
    /// The kernel's name as CUPTI gives it (mangled where the compiler mangled it), cut to
    /// 120 bytes.
    pub name: String,
    /// Kernels of this name that ran.
    pub count: u64,
    /// Their summed GPU time, nanoseconds.
    pub busy_ns: u64,
}

/// Kernels counted since the counter started (or since the last [`KernelCounter::take`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KernelCount {
    /// Kernels that ran (one record each).
    pub kernels: u64,
    /// Their summed GPU time, nanoseconds (overlapping kernels on several streams count
    /// each: this is kernel time, not wall time).
    pub busy_ns: u64,
    /// Records CUPTI dropped (a buffer overflowed): when non-zero the counts are low.
    pub dropped: u64,
    /// Records that could not be read (an unexpected CUPTI result or layout): when non-zero
    /// the counts are low.
    pub malformed: u64,
    /// The same kernels by name, most GPU time first (ties by name); empty where the
    /// library's records are not known to carry names (see the module docs).
    pub by_name: Vec<KernelTime>,
}

/// Counts every kernel the process runs while it lives (see the module docs).
#[derive(Debug)]
pub struct KernelCounter {
    _private: (),
}

impl KernelCounter {
    /// Loads CUPTI (once per process) and starts counting.
    ///
    /// # Errors
    ///
    /// [`ProfileError::NoCupti`] without the library, [`ProfileError::Busy`] while another
    /// counter is on, [`ProfileError::Cupti`] when CUPTI refuses (for example another CUPTI
    /// client, such as a profiler, holds the activity API).
    pub fn start() -> Result<KernelCounter, ProfileError> {
        let api = api()?;
        if ON.swap(true, Ordering::AcqRel) {
            return Err(ProfileError::Busy);
        }
        let started = (|| {
            REGISTERED
                .get_or_init(|| {
                    // SAFETY: both callbacks have the C signatures CUPTI calls them with and
                    // live for the whole process.
                    check("cuptiActivityRegisterCallbacks", unsafe {
                        (api.register)(Some(buffer_requested), Some(buffer_completed))
                    })
                })
                .clone()?;
            // SAFETY: a plain call with a valid activity kind.
            check("cuptiActivityEnable", unsafe {
                (api.enable)(KIND_CONCURRENT_KERNEL)
            })
        })();
        if let Err(e) = started {
            ON.store(false, Ordering::Release);
            return Err(e);
        }
        let counter = KernelCounter { _private: () };
        counter.take()?;
        Ok(counter)
    }

    /// Flushes CUPTI's buffers and returns the kernels counted since the start or the last
    /// call, then counts afresh. Kernels still running are not in it yet: synchronize the
    /// device first for an exact count of the work queued so far.
    ///
    /// # Errors
    ///
    /// CUPTI failed to flush.
    pub fn take(&self) -> Result<KernelCount, ProfileError> {
        let api = api()?;
        // SAFETY: a plain call; the completion callback runs inside it or on CUPTI's thread.
        check("cuptiActivityFlushAll", unsafe {
            (api.flush_all)(FLUSH_FORCED)
        })?;
        Ok(KernelCount {
            kernels: KERNELS.swap(0, Ordering::AcqRel),
            busy_ns: BUSY_NS.swap(0, Ordering::AcqRel),
            dropped: DROPPED.swap(0, Ordering::AcqRel),
            malformed: MALFORMED.swap(0, Ordering::AcqRel),
            by_name: {
                let mut by =
                    std::mem::take(&mut *BY_NAME.lock().unwrap_or_else(|e| e.into_inner()));
                by.sort_by(|a, b| b.busy_ns.cmp(&a.busy_ns).then_with(|| a.name.cmp(&b.name)));
                by
            },
        })
    }
}

impl Drop for KernelCounter {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: plain calls with a valid kind and flag; failures only mean records are
            // lost, and counting is over.
            unsafe {
                let _ = (api.disable)(KIND_CONCURRENT_KERNEL);
                let _ = (api.flush_all)(FLUSH_FORCED);
            }
        }
        ON.store(false, Ordering::Release);
    }
}
