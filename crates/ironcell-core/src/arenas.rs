//! pymalloc's arenas, packed into 2 MiB-aligned chunks so the zygote can put them in huge pages.
//!
//! CPython's small-object allocator takes its memory from the system in arenas (1 MiB from 3.10,
//! 256 KiB before), one `mmap` each, wherever the kernel places it. Most of them never fill a
//! whole aligned 2 MiB range of one mapping, so `MADV_COLLAPSE` ([`crate::hugepages`]) cannot
//! make them huge pages, and every fork of the zygote copies one page-table entry per 4 KiB of
//! them: on Debian's 3.11 with matplotlib warm, ~4,000 of the ~4,200 small-page entries outside
//! huge pages that a fork copied were arena pages.
//!
//! [`ArenaChunks`] carves arenas out of 2 MiB chunks, each aligned to 2 MiB and placed right
//! below the previous one when that address is free, so neighbouring chunks merge into one
//! mapping. Chunks are marked `MADV_NOHUGEPAGE`: no fault ever allocates a 2 MiB page for them,
//! in the zygote or in a worker (which inherits the allocator with the fork); the zygote
//! collapses its full ones explicitly. The exception is a worker that keeps huge pages and
//! already holds many arenas ([`ArenaChunks::advise_huge_pages_past`], SECURITY.md #283): its
//! new chunks are marked `MADV_HUGEPAGE` instead, so a session holding hundreds of MiB of small
//! objects forks with one page-table entry per 2 MiB of them, not 512, while an idle or
//! ordinary session never puts an arena in a private 2 MiB page (an arena freed there splits
//! its chunk's huge page, whose unmapped half its memory group charges until reclaim splits it
//! off). When it maps its first such chunk, it also collapses the nearly full chunks it mapped
//! itself before, since its last fork (SECURITY.md #286: its first 64 MiB of arenas, in 4 KiB
//! pages until then), once.
//! A freed arena is unmapped, as CPython's own allocator
//! does, so the address-space and data limits count what they counted before (at most the
//! unused rest of the newest chunk more); its slot is mapped again first when the next arena is
//! needed, unless something else was mapped there meanwhile, and a chunk with no arena left is
//! gone. What it does not serve (a size that does not divide 2 MiB, a chunk or slot that cannot
//! be mapped near the limits) the caller maps as CPython would. `ironcell-python` registers it
//! with `PyObject_SetArenaAllocator`.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::hugepages;

/// The chunk size and alignment: one transparent huge page on x86-64 and arm64 (4 KiB pages).
pub const CHUNK: usize = 2 << 20;

/// The allocator's state. pymalloc calls it with the GIL held; the mutex guards it all the same
/// (3.12's interpreters with their own GIL share the arena allocator). The zygote forks with one
/// thread, so the mutex is never held across a fork.
pub struct ArenaChunks(Mutex<Chunks>);

struct Chunks {
    /// pymalloc's arena size (256 KiB before 3.10, 1 MiB from it), set by the first request of
    /// either; nothing else is served (3.11's frame stacks ask this allocator for 16 KiB and
    /// up, and go to the interpreter's own).
    arena: usize,
    /// The chunks that hold an arena. A `Vec` reserved before it grows, so that no allocation
    /// here can abort a worker at its memory limit; searched linearly (a few hundred chunks for
    /// a worker using 1 GiB of small objects, and arenas come and go rarely).
    chunks: Vec<Chunk>,
    /// Arenas served so far, for the zygote's log.
    served: usize,
    /// Arenas handed out and not taken back, in all chunks.
    in_use: usize,
    /// A chunk mapped while `in_use * arena` is this many bytes or more is advised
    /// `MADV_HUGEPAGE`; `usize::MAX` (the default, and the zygote's) never.
    huge_from: usize,
    /// Whether the first chunk so advised was mapped (and the earlier ones collapsed).
    past_huge_from: bool,
}

impl Chunks {
    /// Marks every chunk mapped now as one this process must never collapse.
    fn all_inherited(&mut self) {
        for chunk in self.chunks.iter_mut() {
            chunk.inherited = true;
        }
    }
}

struct Chunk {
    base: usize,
    /// Which slots are handed out (bit i: the arena at `base + i * arena`). Only those are
    /// taken back: anything else inside the chunk (a fallback arena the kernel placed in a
    /// freed slot's hole) is not ours.
    used: u64,
    /// Which slots are mapped by this allocator: in use, or not used since the chunk was
    /// mapped. Only those are ever unmapped: a freed slot's addresses may belong to another
    /// mapping by the time the chunk goes.
    mapped: u64,
    /// Advised `MADV_HUGEPAGE` (when it was mapped, or collapsed later); its freed slots are
    /// mapped again the same way.
    huge: bool,
    /// Mapped before [`ArenaChunks::advise_huge_pages_past`] (in a worker: the zygote's,
    /// shared with it and every other worker) or before a fork of this process or of its
    /// parent ([`ArenaChunks::all_shared_by_a_fork`]): never collapsed, which would copy it.
    inherited: bool,
}

/// The two arena sizes pymalloc has used.
const ARENA_SIZES: [usize; 2] = [256 << 10, 1 << 20];

impl Default for ArenaChunks {
    fn default() -> Self {
        Self::new()
    }
}

impl ArenaChunks {
    pub const fn new() -> Self {
        ArenaChunks(Mutex::new(Chunks {
            arena: 0,
            chunks: Vec::new(),
            served: 0,
            in_use: 0,
            huge_from: usize::MAX,
            past_huge_from: false,
        }))
    }

    /// From now on, a chunk mapped once this process holds `extra` bytes of arenas more than
    /// it does now is advised `MADV_HUGEPAGE` (faults fill it with one 2 MiB page where the
    /// process keeps transparent huge pages) instead of `MADV_NOHUGEPAGE`; chunks mapped
    /// already, and any mapped while it holds less, keep theirs, except that the first chunk so
    /// advised collapses the nearly full chunks mapped since this call into huge pages
    /// ([`collapse_chunks_of_own_arenas`]). A fork inherits the setting with the allocator.
    pub fn advise_huge_pages_past(&self, extra: usize) {
        let mut c = self.state();
        c.huge_from = c.in_use.saturating_mul(c.arena).saturating_add(extra);
        c.past_huge_from = false;
        c.all_inherited();
    }

    /// Marks every chunk mapped now as shared with another process, so that no collapse copies
    /// it: for `pthread_atfork` handlers, in the parent and in the child of a fork (whose
    /// chunks stay shared copy-on-write). Takes the lock only if it is free: the forking
    /// thread holds the GIL, under which every arena is allocated.
    pub fn all_shared_by_a_fork(&self) {
        let mut c = match self.0.try_lock() {
            Ok(c) => c,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        c.all_inherited();
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Chunks> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An arena of `size` bytes from a chunk, aligned to `size`; `None` when this allocator does
    /// not serve it, or cannot map one now (then the caller maps one itself).
    pub fn alloc(&self, size: usize) -> Option<NonNull<c_void>> {
        let mut c = self.state();
        if c.arena == 0 && ARENA_SIZES.contains(&size) {
            c.arena = size;
        }
        if size == 0 || size != c.arena {
            return None;
        }
        let slots = CHUNK / size;
        // A free slot of an existing chunk, lowest chunk first in the order they were made.
        for chunk in c.chunks.iter_mut() {
            for i in 0..slots {
                let bit = 1u64 << i;
                if chunk.used & bit != 0 {
                    continue;
                }
                let slot = chunk.base + i * size;
                if chunk.mapped & bit == 0 {
                    match map_at(slot, size, chunk.huge) {
                        Placed::Mapped => chunk.mapped |= bit,
                        // Another mapping sits there now: maybe free again later.
                        Placed::Taken => continue,
                        // Out of address space or data limit: the caller's allocator fails
                        // the same way, and this slot stays for later.
                        Placed::NoRoom => return None,
                    }
                }
                chunk.used |= bit;
                c.served += 1;
                c.in_use += 1;
                return NonNull::new(slot as *mut c_void);
            }
        }
        c.chunks.try_reserve(1).ok()?;
        let huge = c.in_use.saturating_mul(size) >= c.huge_from;
        if huge && !c.past_huge_from {
            c.past_huge_from = true;
            collapse_chunks_of_own_arenas(&mut c.chunks, slots);
        }
        // Right below the lowest chunk, so the chunks merge into one mapping (where their
        // advice is the same).
        let base = map_chunk(c.chunks.iter().map(|k| k.base).min(), huge)?;
        c.chunks.push(Chunk {
            base,
            used: 1,
            mapped: u64::MAX >> (64 - slots),
            huge,
            inherited: false,
        });
        c.served += 1;
        c.in_use += 1;
        NonNull::new(base as *mut c_void)
    }

    /// Takes back an arena this allocator handed out, and unmaps it (with the rest of its
    /// chunk once the chunk holds no arena). Returns `false`, doing nothing, for anything else.
    ///
    /// # Safety
    /// If `ptr` is an arena this allocator handed out and has not taken back, nothing may use
    /// it afterwards.
    pub unsafe fn free(&self, ptr: *mut c_void, size: usize) -> bool {
        let mut c = self.state();
        let arena = c.arena;
        let (addr, base) = (ptr as usize, ptr as usize & !(CHUNK - 1));
        if arena == 0 || size != arena || !(addr - base).is_multiple_of(arena) {
            return false;
        }
        let bit = 1u64 << ((addr - base) / arena);
        let Some(at) = c
            .chunks
            .iter()
            .position(|k| k.base == base && k.used & bit != 0)
        else {
            return false;
        };
        c.in_use -= 1;
        let chunk = &mut c.chunks[at];
        chunk.used &= !bit;
        chunk.mapped &= !bit;
        // SAFETY: a slot this allocator mapped and handed out; unused from here on (the
        // caller's promise).
        unsafe { libc::munmap(ptr, size) };
        if chunk.used != 0 {
            return true;
        }
        let mapped = chunk.mapped;
        for i in (0..CHUNK / arena).filter(|i| mapped & (1 << i) != 0) {
            // SAFETY: a slot of this chunk still mapped by this allocator, never handed out.
            unsafe { libc::munmap((base + i * arena) as *mut c_void, arena) };
        }
        c.chunks.swap_remove(at);
        true
    }

    /// Arenas served so far, and chunks mapped now.
    pub fn stats(&self) -> (usize, usize) {
        let c = self.state();
        (c.served, c.chunks.len())
    }

    /// Chunks mapped now that were advised `MADV_HUGEPAGE`.
    #[cfg(test)]
    fn huge_chunks(&self) -> usize {
        self.state().chunks.iter().filter(|k| k.huge).count()
    }
}

/// Collapses into huge pages the chunks this process mapped itself since its last fork (not
/// `inherited`: a chunk shared with a fork's other side would be copied whole) that are
/// whole (every slot mapped: a collapse needs the 2 MiB in one mapping) and nearly all resident
/// (a collapse fills the untouched pages: at most 64 of 512 here), and marks them
/// `MADV_HUGEPAGE`, as chunks mapped from now on are. Once, when a worker that keeps huge pages
/// maps its first chunk past its threshold (SECURITY.md #286): its arenas mapped before, 64 MiB
/// at most, would otherwise stay in 4 KiB pages, one page-table entry each for every fork to
/// copy. Best effort: a kernel before 6.1 refuses `MADV_COLLAPSE` and nothing but the advice
/// changes; where huge pages are off (`PR_SET_THP_DISABLE`) it is never called.
fn collapse_chunks_of_own_arenas(chunks: &mut [Chunk], slots: usize) {
    let whole = u64::MAX >> (64 - slots);
    for chunk in chunks.iter_mut() {
        if chunk.huge || chunk.inherited || chunk.mapped != whole || !hugepages::dense(chunk.base) {
            continue;
        }
        advise(chunk.base, CHUNK, true);
        chunk.huge = true;
        // Best effort, as said above.
        let _ = hugepages::collapse(chunk.base);
    }
}

/// A 2 MiB-aligned 2 MiB mapping, advised `MADV_HUGEPAGE` if `huge` (else `MADV_NOHUGEPAGE`):
/// right below `below` when that address is free (so the chunks merge into one mapping),
/// otherwise 4 MiB trimmed to the aligned 2 MiB inside.
fn map_chunk(below: Option<usize>, huge: bool) -> Option<usize> {
    if let Some(below) = below.and_then(|b| b.checked_sub(CHUNK))
        && matches!(map_at(below, CHUNK, huge), Placed::Mapped)
    {
        return Some(below);
    }
    // SAFETY: a fresh anonymous mapping, placed where the kernel chooses.
    let p = unsafe { map(std::ptr::null_mut(), 2 * CHUNK, 0) };
    if p == libc::MAP_FAILED {
        return None;
    }
    let start = p as usize;
    let base = start.next_multiple_of(CHUNK);
    if base > start {
        // SAFETY: the part of that fresh mapping below the aligned chunk; nothing uses it.
        unsafe { libc::munmap(p, base - start) };
    }
    let tail = start + 2 * CHUNK - (base + CHUNK);
    if tail > 0 {
        // SAFETY: the part of that fresh mapping above the aligned chunk; nothing uses it.
        unsafe { libc::munmap((base + CHUNK) as *mut c_void, tail) };
    }
    advise(base, CHUNK, huge);
    Some(base)
}

/// What [`map_at`] did.
enum Placed {
    Mapped,
    /// Another mapping holds (part of) the range.
    Taken,
    /// The kernel refused for another reason (address-space or data limit).
    NoRoom,
}

/// Maps `len` bytes at exactly `addr`, never over another mapping, advised as [`advise`] does.
fn map_at(addr: usize, len: usize, huge: bool) -> Placed {
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; it fails instead.
    let p = unsafe { map(addr as *mut c_void, len, libc::MAP_FIXED_NOREPLACE) };
    if p == libc::MAP_FAILED {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EEXIST) => Placed::Taken,
            _ => Placed::NoRoom,
        };
    }
    if p as usize != addr {
        // A kernel before 4.17 takes the address as a hint only.
        // SAFETY: the mapping just made, unused.
        unsafe { libc::munmap(p, len) };
        return Placed::Taken;
    }
    advise(addr, len, huge);
    Placed::Mapped
}

/// `MADV_HUGEPAGE` on a range if `huge`, else `MADV_NOHUGEPAGE`. Advice only: where it fails
/// (a kernel without transparent huge pages), the range is as usable as before.
fn advise(addr: usize, len: usize, huge: bool) {
    let advice = if huge {
        libc::MADV_HUGEPAGE
    } else {
        libc::MADV_NOHUGEPAGE
    };
    // SAFETY: advice on a range this allocator just mapped.
    unsafe { libc::madvise(addr as *mut c_void, len, advice) };
}

/// # Safety
/// As `mmap(2)` with these flags: `flags` adds placement flags only.
unsafe fn map(addr: *mut c_void, len: usize, flags: libc::c_int) -> *mut c_void {
    // SAFETY: the caller's; an anonymous private read-write mapping.
    unsafe {
        libc::mmap(
            addr,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn mapped(addr: usize, len: usize) -> bool {
        // msync fails with ENOMEM on a range that is not (wholly) mapped.
        // SAFETY: msync only inspects the range.
        unsafe { libc::msync(addr as *mut c_void, len, libc::MS_ASYNC) == 0 }
    }

    #[test]
    fn arenas_fill_aligned_chunks_that_are_unmapped_when_empty() {
        let chunks = ArenaChunks::new();
        let a = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        let b = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        assert_eq!(a % CHUNK, 0, "the first arena starts a 2 MiB-aligned chunk");
        assert_eq!(b, a + MIB, "the second fills the same chunk");
        // A third needs a new chunk, right below the first when that address is free.
        let c = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        assert_eq!(c % CHUNK, 0);
        assert_eq!(chunks.stats(), (3, 2));
        // The memory is usable.
        for &arena in &[a, b, c] {
            // SAFETY: arenas of MIB bytes this test owns.
            let bytes = unsafe { std::slice::from_raw_parts_mut(arena as *mut u8, MIB) };
            bytes[0] = 7;
            bytes[MIB - 1] = 9;
            assert_eq!((bytes[0], bytes[MIB - 1]), (7, 9));
        }
        // Freeing one arena of a chunk unmaps that arena only; its slot comes back next, zeroed.
        // SAFETY: `b` came from `chunks` and is not used again before it is handed out anew.
        assert!(unsafe { chunks.free(b as *mut c_void, MIB) });
        assert!(mapped(a, MIB) && !mapped(b, MIB));
        let again = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        assert_eq!(again, b);
        let last = (again + MIB - 1) as *const u8;
        // SAFETY: the last byte of the MIB-byte arena `again`, mapped and ours.
        assert_eq!(unsafe { *last }, 0);
        // Freeing both arenas of a chunk unmaps it.
        // SAFETY: an arena from `chunks`, not used afterwards.
        assert!(unsafe { chunks.free(a as *mut c_void, MIB) });
        // SAFETY: as above.
        assert!(unsafe { chunks.free(again as *mut c_void, MIB) });
        assert!(!mapped(a, CHUNK));
        assert_eq!(chunks.stats(), (4, 1));
        // SAFETY: as above.
        assert!(unsafe { chunks.free(c as *mut c_void, MIB) });
        assert!(!mapped(c, CHUNK));
        assert_eq!(chunks.stats().1, 0);
    }

    /// The `VmFlags` of the mapping that holds `addr`, from `/proc/self/smaps`.
    fn vm_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = head.split_once('-')
                && !head.ends_with(':')
            {
                let lo = usize::from_str_radix(lo, 16).unwrap_or(usize::MAX);
                let hi = usize::from_str_radix(hi, 16).unwrap_or(0);
                inside = lo <= addr && addr < hi;
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("{addr:x} is not mapped");
    }

    #[test]
    fn chunks_mapped_past_the_threshold_are_advised_huge_pages_and_others_not() {
        let chunks = ArenaChunks::new();
        let first = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        // Huge pages from 3 MiB of arenas more than the one held now: the chunk mapped while 2
        // arenas are held is not advised, the one mapped while 4 are is.
        chunks.advise_huge_pages_past(3 * MIB);
        let arenas: Vec<usize> = (0..5)
            .map(|_| chunks.alloc(MIB).unwrap().as_ptr() as usize)
            .collect();
        assert_eq!(chunks.stats(), (6, 3));
        assert_eq!(chunks.huge_chunks(), 1);
        for &small in &[first, arenas[0], arenas[1], arenas[2]] {
            let flags = vm_flags(small);
            assert!(flags.iter().any(|f| f == "nh"), "{small:x}: {flags:?}");
        }
        let (huge, last) = (arenas[3], arenas[4]);
        assert_eq!((huge % CHUNK, last), (0, huge + MIB));
        let flags = vm_flags(huge);
        assert!(flags.iter().any(|f| f == "hg"), "{huge:x}: {flags:?}");
        // A freed slot of the advised chunk is mapped again with the chunk's advice, and falling
        // below the threshold does not change the chunks mapped already.
        for &arena in arenas[..3].iter().chain([&first]) {
            // SAFETY: an arena from `chunks`, not used afterwards.
            assert!(unsafe { chunks.free(arena as *mut c_void, MIB) });
        }
        // SAFETY: as above.
        assert!(unsafe { chunks.free(last as *mut c_void, MIB) });
        let again = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        assert_eq!(again, last);
        assert!(vm_flags(again).iter().any(|f| f == "hg"));
        // Two arenas held: a new chunk is not advised.
        let low = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        assert_eq!(chunks.huge_chunks(), 1);
        assert!(vm_flags(low).iter().any(|f| f == "nh"));
        for arena in [huge, again, low] {
            // SAFETY: as above.
            assert!(unsafe { chunks.free(arena as *mut c_void, MIB) });
        }
        assert_eq!(chunks.stats().1, 0);
    }

    #[test]
    fn the_first_chunk_past_the_threshold_collapses_the_full_chunks_mapped_since_the_advice_and_the_last_fork()
     {
        let chunks = ArenaChunks::new();
        let write = |arena: usize, byte: u8| {
            // SAFETY: an arena of MIB bytes from `chunks`, ours until freed.
            unsafe { (arena as *mut u8).write_bytes(byte, MIB) };
        };
        let alloc = || chunks.alloc(MIB).unwrap().as_ptr() as usize;
        // One full chunk before the advice (a worker's: the zygote's).
        let inherited = [alloc(), alloc()];
        // Huge pages from 6 MiB of arenas more than the 2 held now: the next three chunks not.
        chunks.advise_huge_pages_past(6 * MIB);
        // One mapped before a fork (shared with the fork's other side), two after it.
        let shared = [alloc(), alloc()];
        chunks.all_shared_by_a_fork();
        let (own_full, own_sparse) = ([alloc(), alloc()], [alloc(), alloc()]);
        let full = [inherited, shared, own_full].concat();
        for (i, &arena) in full.iter().enumerate() {
            write(arena, i as u8 + 1);
        }
        write(own_sparse[0], 9);
        assert_eq!(chunks.huge_chunks(), 0);
        // Mapped while 8 arenas are held: advised, and the own full chunk with it, only.
        let past = alloc();
        assert_eq!(chunks.huge_chunks(), 2);
        for (arena, advice) in [
            (past, "hg"),
            (own_full[0], "hg"),
            (own_full[1], "hg"),
            (inherited[0], "nh"),
            (shared[1], "nh"),
            (own_sparse[1], "nh"),
        ] {
            let flags = vm_flags(arena);
            assert!(flags.iter().any(|f| f == advice), "{arena:x}: {flags:?}");
        }
        for (i, &arena) in full.iter().enumerate() {
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(arena as *const u8, MIB) };
            assert!(bytes.iter().all(|&b| b == i as u8 + 1), "{arena:x} changed");
        }
        for arena in full.iter().chain(&own_sparse).chain([&past]) {
            // SAFETY: an arena from `chunks`, not used afterwards.
            assert!(unsafe { chunks.free(*arena as *mut c_void, MIB) });
        }
        assert_eq!(chunks.stats().1, 0);
    }

    #[test]
    fn a_new_chunk_goes_right_below_the_lowest_and_merges_with_it() {
        // Free address space for two chunks, given back just before: another test's thread may
        // map there in between, so a few tries.
        let placed = (0..5).find_map(|_| {
            // SAFETY: a fresh mapping where the kernel chooses.
            let p = unsafe { map(std::ptr::null_mut(), 3 * CHUNK, 0) };
            assert_ne!(p, libc::MAP_FAILED);
            // SAFETY: that mapping, unused.
            unsafe { libc::munmap(p, 3 * CHUNK) };
            let top = (p as usize + 3 * CHUNK) / CHUNK * CHUNK;
            let upper = map_chunk(Some(top), false).unwrap();
            let lower = map_chunk(Some(upper), false).unwrap();
            if (upper, lower) == (top - CHUNK, top - 2 * CHUNK) {
                return Some((lower, top));
            }
            // SAFETY: a chunk this try mapped, unused.
            unsafe { libc::munmap(upper as *mut c_void, CHUNK) };
            // SAFETY: as above.
            unsafe { libc::munmap(lower as *mut c_void, CHUNK) };
            None
        });
        let (lower, top) = placed.expect("each new chunk went right below the last one");
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let one = maps.lines().any(|line| {
            let span = line.split_whitespace().next().unwrap_or("");
            let (lo, hi) = span.split_once('-').unwrap_or(("0", "0"));
            let lo = usize::from_str_radix(lo, 16).unwrap_or(usize::MAX);
            let hi = usize::from_str_radix(hi, 16).unwrap_or(0);
            lo <= lower && top <= hi
        });
        assert!(one, "{lower:x}-{top:x} is not one mapping in:\n{maps}");
        // SAFETY: the two chunks this test mapped.
        unsafe { libc::munmap(lower as *mut c_void, 2 * CHUNK) };
    }

    #[test]
    fn a_freed_slot_someone_else_mapped_is_skipped_and_left_alone() {
        let chunks = ArenaChunks::new();
        let a = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        let b = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        // SAFETY: `b` came from `chunks`, not used afterwards.
        assert!(unsafe { chunks.free(b as *mut c_void, MIB) });
        // SAFETY: a mapping of our own where it was (never over another: FIXED_NOREPLACE).
        let foreign = unsafe { map(b as *mut c_void, MIB, libc::MAP_FIXED_NOREPLACE) };
        assert_eq!(foreign as usize, b);
        // SAFETY: the first byte of the foreign mapping, ours.
        unsafe { *(foreign as *mut u8) = 42 };
        // SAFETY: the foreign mapping is ours, MIB bytes; handing it to `free` must not take it
        // (what a fallback arena the kernel placed in a freed slot's hole looks like).
        assert!(!unsafe { chunks.free(foreign, MIB) });
        assert!(mapped(a, MIB) && mapped(b, MIB));
        let c = chunks.alloc(MIB).unwrap().as_ptr() as usize;
        assert_ne!(c, b, "a slot another mapping took is not handed out");
        // SAFETY: an arena from `chunks`, not used afterwards.
        assert!(unsafe { chunks.free(a as *mut c_void, MIB) });
        // SAFETY: as above.
        assert!(unsafe { chunks.free(c as *mut c_void, MIB) });
        assert!(!mapped(a, MIB));
        assert!(
            mapped(b, MIB),
            "the chunk went without unmapping the foreign mapping"
        );
        // SAFETY: still the foreign mapping, ours.
        assert_eq!(unsafe { *(foreign as *const u8) }, 42);
        // SAFETY: unmapped by its owner, unused afterwards.
        unsafe { libc::munmap(foreign, MIB) };
    }

    #[test]
    fn sizes_that_do_not_divide_a_chunk_and_foreign_memory_are_left_to_the_caller() {
        let chunks = ArenaChunks::new();
        assert!(chunks.alloc(3 * MIB).is_none());
        assert!(chunks.alloc(0).is_none());
        assert!(
            chunks.alloc(32 << 10).is_none(),
            "a frame stack's 32 KiB is not an arena"
        );
        let chunks = ArenaChunks::new();
        let a = chunks.alloc(256 << 10).unwrap().as_ptr() as usize;
        assert_eq!(a % CHUNK, 0);
        assert!(
            chunks.alloc(MIB).is_none(),
            "one arena size per allocator (pymalloc uses one)"
        );
        let mut local = [0u8; 64];
        // SAFETY: not memory the allocator served: it must refuse, touching nothing.
        assert!(!unsafe { chunks.free(local.as_mut_ptr().cast(), local.len()) });
        // SAFETY: not a size it serves: it must refuse, touching nothing.
        assert!(!unsafe { chunks.free(a as *mut c_void, MIB) });
        // SAFETY: `a` came from `chunks`.
        assert!(unsafe { chunks.free(a as *mut c_void, 256 << 10) });
    }
}
