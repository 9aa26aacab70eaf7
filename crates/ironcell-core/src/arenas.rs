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
//! collapses its full ones explicitly. A freed arena is unmapped, as CPython's own allocator
//! does, so the address-space and data limits count what they counted before (at most the
//! unused rest of the newest chunk more); its slot is mapped again first when the next arena is
//! needed, unless something else was mapped there meanwhile, and a chunk with no arena left is
//! gone. What it does not serve (a size that does not divide 2 MiB, a chunk or slot that cannot
//! be mapped near the limits) the caller maps as CPython would. `ironcell-python` registers it
//! with `PyObject_SetArenaAllocator`.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Mutex;

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
        }))
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
                    match map_at(slot, size) {
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
                return NonNull::new(slot as *mut c_void);
            }
        }
        c.chunks.try_reserve(1).ok()?;
        // Right below the lowest chunk, so the chunks merge into one mapping.
        let base = map_chunk(c.chunks.iter().map(|k| k.base).min())?;
        c.chunks.push(Chunk {
            base,
            used: 1,
            mapped: u64::MAX >> (64 - slots),
        });
        c.served += 1;
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
}

/// A 2 MiB-aligned 2 MiB mapping: right below `below` when that address is free (so the
/// chunks merge into one mapping), otherwise 4 MiB trimmed to the aligned 2 MiB inside.
fn map_chunk(below: Option<usize>) -> Option<usize> {
    if let Some(below) = below.and_then(|b| b.checked_sub(CHUNK))
        && matches!(map_at(below, CHUNK), Placed::Mapped)
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
    no_huge_pages(base, CHUNK);
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

/// Maps `len` bytes at exactly `addr`, never over another mapping, marked `MADV_NOHUGEPAGE`.
fn map_at(addr: usize, len: usize) -> Placed {
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
    no_huge_pages(addr, len);
    Placed::Mapped
}

fn no_huge_pages(addr: usize, len: usize) {
    // SAFETY: advice on a range this allocator just mapped.
    unsafe { libc::madvise(addr as *mut c_void, len, libc::MADV_NOHUGEPAGE) };
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
            let upper = map_chunk(Some(top)).unwrap();
            let lower = map_chunk(Some(upper)).unwrap();
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
