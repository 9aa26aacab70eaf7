//! Registers `ironcell_core::arenas::ArenaChunks` as CPython's arena allocator, so that
//! pymalloc's arenas fill whole 2 MiB ranges the zygote can collapse into huge pages (that
//! module says why). What the chunks do not serve goes to the interpreter's own allocator. A
//! worker that keeps huge pages has its chunks advised `MADV_HUGEPAGE` once it holds many arenas
//! ([`advise_huge_pages_past_many_arenas`], SECURITY.md #283).

use std::ffi::c_void;

use ironcell_core::arenas::ArenaChunks;

static CHUNKS: ArenaChunks = ArenaChunks::new();

/// CPython's `PyObjectArenaAllocator` (unchanged since 3.4; not in the limited API).
#[repr(C)]
struct ArenaAllocator {
    ctx: *mut c_void,
    alloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

// SAFETY: CPython's default arena allocator has no context (`ctx` is NULL) and its functions
// may be called from any thread holding the GIL; the struct is only read after `install`.
unsafe impl Send for ArenaAllocator {}
// SAFETY: as for `Send`: shared only to be read.
unsafe impl Sync for ArenaAllocator {}

/// The interpreter's own arena allocator, as it was before [`install`].
static PREVIOUS: std::sync::OnceLock<ArenaAllocator> = std::sync::OnceLock::new();

/// Installs the chunked arena allocator. Returns `false` (and changes nothing) when this
/// interpreter does not export `PyObject_GetArenaAllocator` and `PyObject_SetArenaAllocator`,
/// or it was installed already. Call it with the GIL held.
pub fn install() -> bool {
    // SAFETY: dlsym on the process's global scope for a function of the running interpreter,
    // `void f(PyObjectArenaAllocator *)`.
    let get = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"PyObject_GetArenaAllocator".as_ptr()) };
    // SAFETY: as above.
    let set = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"PyObject_SetArenaAllocator".as_ptr()) };
    if get.is_null() || set.is_null() || PREVIOUS.get().is_some() {
        return false;
    }
    type Accessor = unsafe extern "C" fn(*mut ArenaAllocator);
    // SAFETY: the symbol is CPython's function of that signature.
    let get = unsafe { std::mem::transmute::<*mut c_void, Accessor>(get) };
    // SAFETY: as above.
    let set = unsafe { std::mem::transmute::<*mut c_void, Accessor>(set) };
    let mut allocator = ArenaAllocator {
        ctx: std::ptr::null_mut(),
        alloc: arena_alloc,
        free: arena_free,
    };
    let mut previous = ArenaAllocator { ..allocator };
    // SAFETY: CPython fills `previous` with its current allocator.
    unsafe { get(&mut previous) };
    let _ = PREVIOUS.set(previous);
    // SAFETY: CPython copies ours in (the GIL is held).
    unsafe { set(&mut allocator) };
    true
}

/// How many bytes of arenas a worker holds past those it started with before its new chunks
/// are advised huge pages: more than an idle or ordinary session ever holds (an idle worker's
/// first new arena must not be a private 2 MiB page: the idle-session memory target is 1.5
/// MiB), little beside the hundreds of MiB whose fork the advice speeds up.
const HUGE_PAGES_PAST: usize = 64 << 20;

/// Chunks this process maps once it holds 64 MiB of arenas more than now are advised
/// `MADV_HUGEPAGE`, and the first of them collapses those it mapped before (since its last
/// fork: a fork's chunks are shared copy-on-write on both sides, and a collapse would copy them).
/// For a worker that keeps transparent huge pages (a memory group of its own, SECURITY.md #271,
/// #283, #286); its forks inherit it. Does nothing where [`install`] did not register the
/// chunks (pymalloc's arenas then come from the interpreter's own allocator).
pub fn advise_huge_pages_past_many_arenas() {
    CHUNKS.advise_huge_pages_past(HUGE_PAGES_PAST);
    // SAFETY: registers handlers that run in the parent and the child of every later fork(3)
    // of this process (a session's fork, its own children); each only sets flags in memory.
    unsafe {
        libc::pthread_atfork(
            None,
            Some(chunks_shared_by_a_fork),
            Some(chunks_shared_by_a_fork),
        )
    };
}

extern "C" fn chunks_shared_by_a_fork() {
    CHUNKS.all_shared_by_a_fork();
}

/// Arenas served from chunks so far, and chunks mapped now (for the zygote's log).
pub fn stats() -> (usize, usize) {
    CHUNKS.stats()
}

unsafe extern "C" fn arena_alloc(_ctx: *mut c_void, size: usize) -> *mut c_void {
    if let Some(arena) = CHUNKS.alloc(size) {
        return arena.as_ptr();
    }
    match PREVIOUS.get() {
        // SAFETY: the interpreter's own allocator, called as pymalloc would.
        Some(p) => unsafe { (p.alloc)(p.ctx, size) },
        None => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn arena_free(_ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    // SAFETY: pymalloc frees each arena it was given once, with the size it asked for, and
    // never touches it again.
    if unsafe { CHUNKS.free(ptr, size) } {
        return;
    }
    // An arena from before `install`, or one the interpreter's allocator mapped.
    if let Some(p) = PREVIOUS.get() {
        // SAFETY: as above; this arena came from the interpreter's own allocator.
        unsafe { (p.free)(p.ctx, ptr, size) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test binary has no interpreter: no allocator to register with, none to fall back on.
    #[test]
    fn without_an_interpreter_only_arenas_of_a_pymalloc_size_are_served() {
        assert!(
            !install(),
            "nothing exports PyObject_SetArenaAllocator here"
        );
        let size = 1 << 20;
        // SAFETY: called as pymalloc calls it: no context, an arena's size.
        let arena = unsafe { arena_alloc(std::ptr::null_mut(), size) };
        assert!(!arena.is_null());
        assert_eq!(
            arena as usize % size,
            0,
            "arenas fill aligned slots of a chunk"
        );
        // SAFETY: the arena's `size` bytes are ours until freed.
        unsafe { arena.cast::<u8>().write_bytes(0xab, size) };
        // SAFETY: as above, with a size pymalloc never asks for: nothing to serve it.
        let odd = unsafe { arena_alloc(std::ptr::null_mut(), 4096) };
        assert!(odd.is_null());
        assert_eq!(stats().0, 1);
        // SAFETY: freed once, with the size it was served for.
        unsafe { arena_free(std::ptr::null_mut(), arena, size) };
    }
}
