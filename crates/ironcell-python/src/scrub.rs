//! The zygote forgets what it decoded for one worker before it forks the next (SECURITY.md
//! #156). Every spawn request names a session and its directories; the zygote decodes it
//! (serde buffers an internally tagged enum's fields in heap copies), forks, and frees it. Freed
//! heap is not cleared, and a fork copies the whole heap, so a new worker found earlier sessions'
//! names and full paths in its own memory (3 of 3 runs, read with ctypes).
//!
//! So the extension's allocator clears every block it frees while [`scrubbing`] is on: in the
//! zygote, from its start. A worker turns it off first thing after the fork (its own frees are
//! its own business, and clearing them would cost time on every frame). The request buffer the
//! zygote reuses is cleared by hand once each request is decoded ([`clear_used`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

use zeroize::Zeroize;

static SCRUBBING: AtomicBool = AtomicBool::new(false);

/// Clears what this process frees from now on (`true`) or stops doing so (`false`).
pub fn scrubbing(on: bool) {
    SCRUBBING.store(on, Ordering::Relaxed);
}

/// Clears the first `used` bytes of `buf` (all of it if `used` is past its end), in place, with
/// writes the compiler keeps. For a buffer that is all zero but for what the last packet wrote
/// at its start, this leaves it all zero while writing only the pages that packet touched.
pub fn clear_used(buf: &mut [u8], used: usize) {
    let used = used.min(buf.len());
    buf[..used].zeroize();
}

/// The extension's global allocator: the system's, clearing blocks on free while scrubbing.
pub struct ScrubOnFree;

// SAFETY: every call is forwarded to `System` with the caller's own arguments; clearing writes
// only within the block being freed (`layout.size()` bytes at `ptr`, which the caller owns), and
// the scrubbing realloc copies at most the smaller of the two sizes into the new block.
unsafe impl GlobalAlloc for ScrubOnFree {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `GlobalAlloc::alloc`, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if SCRUBBING.load(Ordering::Relaxed) {
            // SAFETY: the caller owns the `layout.size()` bytes at `ptr` until it is freed below.
            unsafe { std::slice::from_raw_parts_mut(ptr, layout.size()) }.zeroize();
        }
        // SAFETY: the caller's contract for `GlobalAlloc::dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !SCRUBBING.load(Ordering::Relaxed) {
            // SAFETY: the caller's contract for `GlobalAlloc::realloc`, passed on.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // libc's realloc would free the old block uncleared: move it by hand instead.
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: `new_layout` has a non-zero size (the caller's contract for realloc).
        let new = unsafe { System.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and distinct, each at least this long.
            unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
            // SAFETY: the old block is the caller's and is no longer used.
            unsafe { self.dealloc(ptr, layout) };
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clear_used_zeroes_what_the_packet_wrote_and_never_more_than_the_buffer() {
        let mut buf = vec![0u8; 64];
        let secret = b"session /home/alice/secret-project";
        buf[..secret.len()].copy_from_slice(secret);
        let at = buf.as_ptr();
        clear_used(&mut buf, secret.len());
        assert_eq!((buf.as_ptr(), buf.len()), (at, 64), "the same buffer");
        assert!(buf.iter().all(|&b| b == 0), "{buf:?}");
        buf.fill(7);
        clear_used(&mut buf, 1000);
        assert!(buf.iter().all(|&b| b == 0), "{buf:?}");
    }

    #[test]
    fn a_scrubbing_realloc_moves_the_contents_up_and_down() {
        let alloc = ScrubOnFree;
        let layout = Layout::from_size_align(16, 8).unwrap();
        scrubbing(true);
        // SAFETY: a non-zero-sized layout.
        let small = unsafe { alloc.alloc(layout) };
        assert!(!small.is_null());
        // SAFETY: the 16 bytes at `small` are ours.
        unsafe { small.copy_from_nonoverlapping(b"0123456789abcdef".as_ptr(), 16) };
        // SAFETY: `small` came from this allocator with `layout`; 4096 is non-zero.
        let big = unsafe { alloc.realloc(small, layout, 4096) };
        assert!(!big.is_null());
        // SAFETY: `big` holds 4096 bytes, the first 16 copied.
        let moved = unsafe { std::slice::from_raw_parts(big, 16) };
        assert_eq!(moved, b"0123456789abcdef");
        let big_layout = Layout::from_size_align(4096, 8).unwrap();
        // SAFETY: `big` came from this allocator with `big_layout`; 4 is non-zero.
        let tiny = unsafe { alloc.realloc(big, big_layout, 4) };
        scrubbing(false);
        assert!(!tiny.is_null());
        // SAFETY: `tiny` holds 4 bytes, copied from `big`.
        let kept = unsafe { std::slice::from_raw_parts(tiny, 4) };
        assert_eq!(kept, b"0123");
        // SAFETY: `tiny` came from this allocator with this layout.
        unsafe { alloc.dealloc(tiny, Layout::from_size_align(4, 8).unwrap()) };
    }
}
