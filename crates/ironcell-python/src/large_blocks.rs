//! Python's large memory blocks in transparent huge pages, in a worker that keeps huge pages (a
//! memory group of its own: SECURITY.md #271, #276).
//!
//! A fork copies one page-table entry per 4 KiB page its parent holds: 512 MiB in a `bytearray`
//! is 131,072 entries (~11-21 ms here), in 2 MiB pages 256 (~1 ms). numpy advises
//! `MADV_HUGEPAGE` on its arrays of 4 MiB and more itself; glibc's malloc, which serves every
//! other large block (`bytes`, `bytearray`, list and dict tables, `array`, I/O buffers), never
//! does. Its `glibc.malloc.hugetlb=1` tunable would, but only for a whole process from its exec:
//! set for the zygote, it advised every heap growth too, and an idle worker whose first
//! allocations grew the heap past the zygote's held a private 2 MiB page (1.6 -> 3.6 MiB per
//! idle session in 3 of 23 servers), while `khugepaged` filled the zygote's sparse heap reserve
//! in every worker (1.6 -> 5.5 MiB each within two minutes).
//!
//! So such a worker wraps CPython's raw allocator, which every block past pymalloc's 512 bytes
//! comes from, and advises `MADV_HUGEPAGE` on a block of 4 MiB or more, as numpy does on its
//! arrays: the pages it spans, so that a block glibc maps by itself (one past its `mmap`
//! threshold, 128 KiB rising to 32 MiB) is advised as one whole mapping. Smaller blocks, the rest
//! of the heap, the zygote and every other worker are left as they were; a fork of the worker
//! inherits the wrapper with its memory. Interpreters run with `PYTHONMALLOC=malloc` send no block through
//! the raw allocator: nothing is advised there.
//!
//! Such a block is also asked for a little larger, so that glibc's mapping of it is a whole
//! number of 2 MiB ([`whole_huge_pages`], SECURITY.md #289). A block that grows by `realloc` (a
//! list's table of pointers) is moved by `mremap`, and the kernel splits every huge page it moves
//! to an address of another offset within 2 MiB: such a table ended with 6 of its 92 MiB in huge
//! pages. The kernel places a new anonymous mapping of a whole number of 2 MiB on a 2 MiB
//! boundary, and moves one to an address of the same offset, whose huge pages it moves whole.
//! Only blocks of 16 MiB and more are rounded: the address space added (under 2 MiB, untouched)
//! counts against the session's data limit (RLIMIT_DATA), and for a block of 4 MiB it would be
//! half as much again (a cell holding many such blocks would meet its `MemoryError` at two
//! thirds of its limit); from 16 MiB it is under an eighth, and the tables whose page-table
//! entries a fork feels are larger still.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

/// Blocks from this size up are advised (numpy's threshold for its arrays).
const LARGE: usize = 4 << 20;
const PAGE: usize = 4096;
const HUGE: usize = 2 << 20;
/// Blocks from this size up are rounded to whole 2 MiB mappings ([`whole_huge_pages`]).
const ROUND_FROM: usize = 16 << 20;
/// What glibc's malloc adds to a request before it maps a chunk by itself, on 64-bit: the size
/// word (8 bytes), rounding to 16 and the next chunk's size word (8). A request of `k * 2 MiB -
/// 24` bytes is a mapping of exactly `k * 2 MiB`.
const GLIBC_MMAP_OVERHEAD: usize = 24;
/// CPython's `PYMEM_DOMAIN_RAW`.
const DOMAIN_RAW: c_int = 0;

/// CPython's `PyMemAllocatorEx` (unchanged since 3.5; not in the limited API).
#[repr(C)]
#[derive(Clone, Copy)]
struct Allocator {
    ctx: *mut c_void,
    malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void),
}

// SAFETY: the raw domain's allocator is thread-safe by CPython's contract (it is called without
// the GIL), and the struct is only read after `advise_huge_pages_on_large_blocks` stored it.
unsafe impl Send for Allocator {}
// SAFETY: as for `Send`: shared only to be read.
unsafe impl Sync for Allocator {}

/// The interpreter's raw allocator as it was before the wrapper went in: what does the work.
static UNDERLYING: OnceLock<Allocator> = OnceLock::new();

/// Wraps the interpreter's raw allocator so that blocks of 4 MiB or more are advised
/// `MADV_HUGEPAGE`. Returns `false` (and changes nothing) when the interpreter does not export
/// `PyMem_GetAllocator` and `PyMem_SetAllocator`, or the wrapper is in already. Call it with the
/// GIL held and no other thread running: CPython allows a wrapper of its allocator to be set
/// after its start, not a replacement.
pub fn advise_huge_pages_on_large_blocks() -> bool {
    // SAFETY: dlsym on the process's global scope for a function of the running interpreter,
    // `void f(PyMemAllocatorDomain, PyMemAllocatorEx *)`.
    let get = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"PyMem_GetAllocator".as_ptr()) };
    // SAFETY: as above.
    let set = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"PyMem_SetAllocator".as_ptr()) };
    if get.is_null() || set.is_null() || UNDERLYING.get().is_some() {
        return false;
    }
    type Accessor = unsafe extern "C" fn(c_int, *mut Allocator);
    // SAFETY: the symbol is CPython's function of that signature.
    let get = unsafe { std::mem::transmute::<*mut c_void, Accessor>(get) };
    // SAFETY: as above.
    let set = unsafe { std::mem::transmute::<*mut c_void, Accessor>(set) };
    let mut wrapper = Allocator {
        ctx: std::ptr::null_mut(),
        malloc: wrapped_malloc,
        calloc: wrapped_calloc,
        realloc: wrapped_realloc,
        free: wrapped_free,
    };
    let mut underlying = wrapper;
    // SAFETY: CPython fills `underlying` with its current raw allocator.
    unsafe { get(DOMAIN_RAW, &mut underlying) };
    if UNDERLYING.set(underlying).is_err() {
        return false;
    }
    // SAFETY: CPython copies ours in; every block allocated before is still freed by the
    // allocator that made it (the wrapper hands `free` through).
    unsafe { set(DOMAIN_RAW, &mut wrapper) };
    true
}

/// `block` (of `size` bytes, or null) advised `MADV_HUGEPAGE` when it is large: the pages it
/// spans, its own (or, at its ends, its neighbours' in the heap: advice only, no contents or
/// protections change). Returns `block`.
fn advised(block: *mut c_void, size: usize) -> *mut c_void {
    if !block.is_null() && size >= LARGE {
        let start = block as usize / PAGE * PAGE;
        let end = (block as usize).saturating_add(size).next_multiple_of(PAGE);
        // SAFETY: advice on whole pages of a block this process just allocated (see above).
        unsafe { libc::madvise(start as *mut c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    block
}

/// The size to ask the underlying allocator for: a `size` of [`ROUND_FROM`] or more rounded up so
/// that glibc maps it as a whole number of 2 MiB (under 2 MiB more, never touched until the
/// caller writes there); any other size unchanged. The caller may only use the `size` it asked for.
fn whole_huge_pages(size: usize) -> usize {
    if size < ROUND_FROM {
        return size;
    }
    size.checked_add(GLIBC_MMAP_OVERHEAD)
        .and_then(|s| s.checked_next_multiple_of(HUGE))
        .map_or(size, |s| s - GLIBC_MMAP_OVERHEAD)
}

unsafe extern "C" fn wrapped_malloc(_ctx: *mut c_void, size: usize) -> *mut c_void {
    let size = whole_huge_pages(size);
    match UNDERLYING.get() {
        // SAFETY: the interpreter's own allocator, called as CPython would.
        Some(a) => advised(unsafe { (a.malloc)(a.ctx, size) }, size),
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn wrapped_calloc(_ctx: *mut c_void, count: usize, each: usize) -> *mut c_void {
    let Some(a) = UNDERLYING.get() else {
        return std::ptr::null_mut();
    };
    match count.checked_mul(each) {
        Some(size) if size >= LARGE => {
            let size = whole_huge_pages(size);
            // SAFETY: as above (one element of the rounded size: as many zeroed bytes, or more).
            advised(unsafe { (a.calloc)(a.ctx, 1, size) }, size)
        }
        // SAFETY: as above; an overflowing product is the underlying allocator's to refuse.
        _ => unsafe { (a.calloc)(a.ctx, count, each) },
    }
}

unsafe extern "C" fn wrapped_realloc(
    _ctx: *mut c_void,
    block: *mut c_void,
    size: usize,
) -> *mut c_void {
    let size = whole_huge_pages(size);
    match UNDERLYING.get() {
        // SAFETY: as above; `block` came from the same underlying allocator.
        Some(a) => advised(unsafe { (a.realloc)(a.ctx, block, size) }, size),
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn wrapped_free(_ctx: *mut c_void, block: *mut c_void) {
    if let Some(a) = UNDERLYING.get() {
        // SAFETY: as above.
        unsafe { (a.free)(a.ctx, block) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test binary has no interpreter: nothing to wrap.
    #[test]
    fn without_an_interpreter_nothing_is_wrapped() {
        assert!(!advise_huge_pages_on_large_blocks());
        assert!(UNDERLYING.get().is_none());
    }

    #[test]
    fn a_large_block_is_advised_and_keeps_its_contents() {
        let mut block = vec![7u8; LARGE + 12_345];
        let p = advised(block.as_mut_ptr().cast(), block.len());
        assert_eq!(p, block.as_mut_ptr().cast());
        assert!(block.iter().all(|&b| b == 7));
        assert!(advised(std::ptr::null_mut(), LARGE).is_null());
    }

    #[test]
    fn requests_from_16_mib_become_whole_huge_pages_of_glibcs_mappings_and_smaller_ones_stay() {
        assert_eq!(whole_huge_pages(LARGE + 1), LARGE + 1);
        assert_eq!(whole_huge_pages(ROUND_FROM - 1), ROUND_FROM - 1);
        assert_eq!(
            whole_huge_pages(ROUND_FROM),
            ROUND_FROM + HUGE - GLIBC_MMAP_OVERHEAD
        );
        assert_eq!(whole_huge_pages(9 * HUGE - 24), 9 * HUGE - 24);
        assert_eq!(whole_huge_pages(9 * HUGE - 23), 10 * HUGE - 24);
        assert_eq!(whole_huge_pages(usize::MAX - 10), usize::MAX - 10);
        // glibc maps a chunk of the request + 8, rounded to 16, + 8, rounded to a page.
        let mapping = |r: usize| ((r + 8).next_multiple_of(16) + 8).next_multiple_of(PAGE);
        for size in [ROUND_FROM, ROUND_FROM + 1, 96_000_000, 100 << 20] {
            let asked = whole_huge_pages(size);
            assert!(asked >= size && asked - size < HUGE);
            assert_eq!(mapping(asked) % HUGE, 0, "{size}");
        }
    }
}
