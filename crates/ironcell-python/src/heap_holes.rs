//! The zygote's heap before it forks workers: its malloc and pymalloc holes filled, and a
//! reserve held for a worker's first plot, so that what a worker allocates lands in pages of
//! its own instead of copying the zygote's one fault at a time.

use std::os::fd::{AsRawFd, FromRawFd};

use anyhow::{Context, anyhow};
use pyo3::prelude::*;

/// Fills the free chunks ("holes") of the zygote's malloc heap with allocations it never frees,
/// so that a worker's own allocations come from fresh memory at the heap's end instead.
///
/// Why: after a fork every page is shared copy-on-write, and a worker's first write to a page
/// copies it. An allocation served from a hole writes into a page the zygote also uses (the
/// chunk header and the data), so each small allocation a worker makes (a lock after fork, a
/// dict's table, a `Vec`) can cost it a whole private 4 KiB page; the plot warm-up leaves
/// hundreds of such holes scattered over its heap. Filled here, once the zygote's own
/// warm-up is done, a worker's allocations are packed into new pages instead (measured: an idle
/// session's private `[heap]` pages ~1 MiB -> ~0.4 MiB with plots warmed). The filled chunks are
/// memory the zygote already held; only sizes served from the heap are used (never `mmap`ed
/// ones), and the loop is bounded.
///
/// glibc only: `mallinfo2` gives the size of the top chunk (`keepcost`, main arena), which
/// shrinks exactly when an allocation no longer finds a hole of its size. The zygote is
/// single-threaded, so the main arena is the only one.
pub(crate) fn fill_malloc_holes() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// Sizes tried, largest first (below the default 128 KiB `mmap` threshold): big holes
        /// are used up by big blocks, the small size classes (and glibc's per-size caches) last.
        const LARGE: [usize; 5] = [64 << 10, 16 << 10, 4 << 10, 2 << 10, 1 << 10];
        /// At most this many blocks in all (a few thousand holes are usual after a warm-up).
        const MAX_BLOCKS: usize = 200_000;
        fn holes(info: &libc::mallinfo2) -> usize {
            info.fordblks.saturating_sub(info.keepcost)
        }
        let started = std::time::Instant::now();
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let before = unsafe { libc::mallinfo2() };
        if holes(&before) == 0 {
            return;
        }
        let mut blocks = 0usize;
        let sizes = LARGE.iter().copied().chain((16..=1008).rev().step_by(16));
        'sizes: for size in sizes {
            loop {
                if blocks >= MAX_BLOCKS {
                    break 'sizes;
                }
                // SAFETY: as above.
                let info = unsafe { libc::mallinfo2() };
                // SAFETY: a plain allocation, never freed if it fills a hole.
                // `black_box`: an allocation nothing uses may otherwise be optimized away.
                let p = std::hint::black_box(unsafe { libc::malloc(size) });
                if p.is_null() {
                    break 'sizes;
                }
                blocks += 1;
                // SAFETY: as above.
                let after = unsafe { libc::mallinfo2() };
                if after.hblks > info.hblks || after.keepcost < info.keepcost {
                    // Served by mmap (a raised threshold) or taken from the top chunk: no hole
                    // of this size is left. Give it back (so nothing grows fork after fork).
                    // SAFETY: `p` came from malloc above and is not used elsewhere.
                    unsafe { libc::free(p) };
                    blocks -= 1;
                    continue 'sizes;
                }
                if holes(&after) == 0 {
                    break 'sizes;
                }
            }
        }
        // SAFETY: as above.
        let after = unsafe { libc::mallinfo2() };
        tracing::debug!(
            blocks,
            holes_before = holes(&before),
            holes_after = holes(&after),
            us = started.elapsed().as_micros() as u64,
            "filled the zygote's malloc holes"
        );
    }
}

/// How much heap [`reserve_malloc_heap`] holds for a first plot: a new session's first plot
/// grew the heap by ~2.8 MiB (Debian's 3.11, matplotlib 3.6), which a warm session reuses.
pub(crate) const PLOT_HEAP_RESERVE: usize = 4 << 20;

/// The blocks [`reserve_malloc_heap`] holds (addresses), freed by [`release_heap_reserve`].
static HEAP_RESERVE: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// Holds `bytes` of the zygote's malloc heap, mapped but untouched (one chunk header per block
/// written), for the allocations of a worker's first plot: contiguous blocks allocated here and
/// freed only in a child that is about to plot ([`release_heap_reserve`]: the probe, and a
/// worker right after it wrote a first plot's pages ahead), where they coalesce into one free
/// chunk, kept off the heap's top (so glibc does not give it back) by one more block that is
/// never freed.
///
/// Why: the hole filling above sends a worker's allocations to the heap's top, and a first plot
/// (its image buffers, its temporary arrays) grew the heap there by ~700 pages, each one a fault
/// of its own in the middle of the plot, where a warm session reuses the memory its first plot
/// freed. Inside the heap as the zygote leaves it, those pages are the probe's too: it writes
/// them, finds them its own, and lists them with the copy-on-write pages, so a worker's first
/// plot takes them ahead in bulk (`ironcell_core::prefault`). Held (not freed) in the zygote,
/// no allocation of the zygote's own lands in them, and a worker that never plots never frees
/// them, writes them, or holds them as private memory.
///
/// glibc only, and only from the heap (`brk`): a block served by `mmap` is given back and the
/// reserve is smaller or not made. Called after the huge-page collapse, with huge pages off for
/// the zygote (`PR_SET_THP_DISABLE`): a fault on a chunk header would otherwise fill in a whole
/// 2 MiB where transparent huge pages are `always`.
pub(crate) fn reserve_malloc_heap(bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// Below glibc's smallest `mmap` threshold (128 KiB) and above its per-size caches.
        const BLOCK: usize = 120 << 10;
        let mut blocks: Vec<usize> = Vec::with_capacity(bytes / BLOCK + 2);
        let mut contiguous = true;
        while blocks.len() <= bytes / BLOCK {
            // SAFETY: mallinfo2 only reads the allocator's statistics.
            let before = unsafe { libc::mallinfo2() };
            // SAFETY: a plain allocation, held for the process's life (or freed by a child).
            let p = unsafe { libc::malloc(BLOCK) };
            if p.is_null() {
                break;
            }
            // SAFETY: as above.
            let after = unsafe { libc::mallinfo2() };
            if after.hblks > before.hblks {
                // SAFETY: `p` came from malloc above and is not used elsewhere.
                unsafe { libc::free(p) };
                break;
            }
            if let Some(&last) = blocks.last() {
                // Each block right above the last (one chunk header between them, 64-bit).
                contiguous &= (p as usize).wrapping_sub(last) == BLOCK + 16;
            }
            blocks.push(p as usize);
        }
        // The last block is the fence: never freed, it keeps the chunk below off the top.
        blocks.pop();
        let reserved = blocks.len() * BLOCK;
        if HEAP_RESERVE.set(blocks).is_err() {
            tracing::warn!("the heap reserve for a first plot was made twice");
        }
        tracing::debug!(
            reserved,
            contiguous,
            "held part of the zygote's malloc heap for a first plot"
        );
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = bytes;
}

/// In a child of the zygote about to plot for the first time (the probe, or a worker that just
/// wrote a first plot's pages ahead): frees the blocks [`reserve_malloc_heap`] held, so the
/// plot's allocations come from them. Once per process.
pub(crate) fn release_heap_reserve() {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    for &p in HEAP_RESERVE.get().map(Vec::as_slice).unwrap_or_default() {
        // SAFETY: each came from malloc in the zygote, which never used or freed it; this
        // process inherited the heap with it and frees it once (`DONE`).
        unsafe { libc::free(p as *mut libc::c_void) };
    }
}

/// Fills the free blocks of pymalloc's partly used pools with allocations the zygote never
/// frees, so that a worker's new Python objects are packed into fresh pools instead of being
/// scattered over the zygote's pages.
///
/// Why: CPython serves a small object (512 bytes or less) from a partly used pool of its size
/// class when there is one, and the zygote's warm-up and `gc.collect()` leave thousands of free
/// blocks spread over its frozen heap (Debian's 3.11: ~3,500 at boot, ~7,700 more after the plot
/// warm-up). After a fork each of them sits in a page the worker shares with the zygote, so a
/// worker that allocates an object there copies a whole 4 KiB page for it: every dict, string and frame object a fresh worker makes (its setup, its
/// first cells) can cost a private page. With those blocks taken here, a worker's allocations
/// start new pools, 4 KiB of which hold dozens of objects. The taken blocks are memory the zygote
/// already holds (a free block is only unlinked, never written), so the zygote does not grow.
///
/// The counts come from `sys._debugmallocstats()` ("avail blocks" per size class are the free
/// blocks of pools in use), read from a memfd that stands in for fd 2 meanwhile. An interpreter
/// without pymalloc (`PYTHONMALLOC=malloc`, debug builds) prints no such table: nothing is done.
pub(crate) fn fill_pymalloc_holes(py: Python<'_>) {
    /// At most this many blocks in all.
    const MAX_BLOCKS: usize = 1_000_000;
    let started = std::time::Instant::now();
    let mut blocks = 0usize;
    let mut found = [0usize; 2];
    // A second look takes the blocks freed while the first round ran (its own temporaries).
    for seen in &mut found {
        let avail = match pymalloc_free_blocks(py) {
            Ok(avail) => avail,
            Err(e) => {
                tracing::debug!(error = %e, "pymalloc's statistics are not available");
                return;
            }
        };
        *seen = avail.iter().map(|&(_, n)| n).sum();
        for (size, n) in avail {
            for _ in 0..n.min(MAX_BLOCKS - blocks) {
                // SAFETY: the GIL is held (`py`); the block is never freed and never used.
                // `black_box`: an allocation nothing uses may otherwise be optimized away.
                let p = std::hint::black_box(unsafe { pyo3::ffi::PyObject_Malloc(size) });
                if p.is_null() {
                    return;
                }
                blocks += 1;
            }
        }
    }
    tracing::debug!(
        blocks,
        free_blocks = found[0],
        second_look = found[1],
        us = started.elapsed().as_micros() as u64,
        "filled the zygote's pymalloc holes"
    );
}

/// pymalloc's free blocks in partly used pools, as (block size, count) per size class, from
/// the table `sys._debugmallocstats()` writes to the C `stderr` (fd 2, swapped for a memfd).
fn pymalloc_free_blocks(py: Python<'_>) -> anyhow::Result<Vec<(usize, usize)>> {
    use std::io::{Read, Seek};
    // SAFETY: memfd_create with a static name; the result is checked and owned at once.
    let raw = unsafe { libc::memfd_create(c"ironcell-mallocstats".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create");
    }
    // SAFETY: `raw` is a fresh descriptor this function owns.
    let mut stats = unsafe { std::fs::File::from_raw_fd(raw) };
    // SAFETY: the zygote is single-threaded, so nothing else writes to fd 2 while it points at
    // the memfd; the saved copy is put back (and closed) before this returns.
    let saved = unsafe { libc::fcntl(libc::STDERR_FILENO, libc::F_DUPFD_CLOEXEC, 10) };
    if saved < 0 {
        return Err(std::io::Error::last_os_error()).context("saving fd 2");
    }
    // SAFETY: as above.
    unsafe { libc::dup2(stats.as_raw_fd(), libc::STDERR_FILENO) };
    let printed = py
        .import("sys")
        .and_then(|sys| sys.call_method0("_debugmallocstats"))
        .map(drop);
    // SAFETY: as above.
    unsafe { libc::dup2(saved, libc::STDERR_FILENO) };
    // SAFETY: the copy of stderr made above, ours, unused from here on.
    unsafe { libc::close(saved) };
    printed.map_err(|e| anyhow!("sys._debugmallocstats(): {e}"))?;
    let mut text = String::new();
    stats.rewind()?;
    stats.read_to_string(&mut text)?;
    Ok(parse_pymalloc_free_blocks(&text))
}

/// The size-class rows of `sys._debugmallocstats()`: `class size num-pools in-use avail`.
fn parse_pymalloc_free_blocks(text: &str) -> Vec<(usize, usize)> {
    text.lines()
        .filter_map(|line| {
            let cols: Vec<usize> = line
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            match cols[..] {
                [_class, size, _pools, _in_use, avail] if (1..=512).contains(&size) => {
                    Some((size, avail))
                }
                _ => None,
            }
        })
        .collect()
}
