//! Fewer page-table entries for every fork to copy: the zygote's frozen heap in huge pages.
//!
//! `fork` copies the page-table entry of every anonymous page the parent has, and marks it
//! copy-on-write: for a zygote of 40–70 MiB of Python heap that is 10,000–17,000 entries, most
//! of a fork's cost, paid again for every worker (and one after another in a burst, since the
//! zygote forks serially). A 2 MiB transparent huge page is one entry. So once the heap is warm
//! and frozen, the zygote asks the kernel to collapse its anonymous memory into huge pages
//! (`MADV_COLLAPSE`, Linux 6.1), then marks those regions `MADV_NOHUGEPAGE`: the collapsed pages
//! stay huge, but no later fault in the zygote or (the flag is inherited) in a worker allocates
//! a new 2 MiB page, so a worker's private memory does not grow by it (mappings made later carry
//! no such mark: the zygote then sets `PR_SET_THP_DISABLE` for itself, see its plot warm-up). A worker that writes to a
//! shared huge page gets the usual 4 KiB copy: the kernel splits the mapping first (Linux ≥ 5.8
//! does not copy a whole huge page on a copy-on-write fault).
//!
//! Best effort: kernels without `MADV_COLLAPSE`, or with transparent huge pages set to `never`,
//! refuse, and the zygote forks as before.

use std::ffi::c_void;

/// The kernel's `MADV_COLLAPSE` (Linux 6.1); not in every libc's headers.
const MADV_COLLAPSE: libc::c_int = 25;
const HUGE: usize = 2 << 20;
const PAGE: usize = 4096;
/// Resident 4 KiB pages (of 512) a range needs to be collapsed.
const DENSE_PAGES: usize = 448;

/// What [`collapse_anonymous_memory`] did, for the zygote's log.
#[derive(Debug, Default)]
pub struct Collapsed {
    /// 2 MiB-aligned ranges tried, and how many bytes of them are now huge pages.
    pub ranges: usize,
    pub bytes: usize,
    /// Ranges left alone because too few of their pages were resident.
    pub sparse: usize,
    /// The first refusal, if any (e.g. `EINVAL` from a kernel without `MADV_COLLAPSE`).
    pub refused: Option<std::io::Error>,
}

/// Collapses the calling process's private anonymous writable memory (the heap and anonymous
/// mappings, e.g. pymalloc's arenas) into transparent huge pages, where whole aligned 2 MiB
/// ranges allow it. Call it with a single thread, right before serving forks.
pub fn collapse_anonymous_memory() -> Collapsed {
    let mut out = Collapsed::default();
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return out;
    };
    for (start, end) in anonymous_writable_ranges(&maps) {
        let lo = start.next_multiple_of(HUGE);
        let hi = end / HUGE * HUGE;
        if hi <= lo {
            continue;
        }
        let (addr, len) = (lo as *mut c_void, hi - lo);
        // Advice only, on whole pages of a mapping this process owns: none of these calls
        // changes the memory's contents or protection.
        // SAFETY: as just said.
        if unsafe { libc::madvise(addr, len, libc::MADV_HUGEPAGE) } == 0 {
            // One range at a time: one that cannot be collapsed (say, its pages are pinned)
            // does not stop the others.
            for chunk in (lo..hi).step_by(HUGE) {
                out.ranges += 1;
                // Only ranges nearly all resident already, so the zygote does not grow by the rest.
                if !dense(chunk) {
                    out.sparse += 1;
                    continue;
                }
                match collapse(chunk) {
                    Ok(()) => out.bytes += HUGE,
                    Err(e) => {
                        out.refused.get_or_insert(e);
                    }
                }
            }
        } else if out.refused.is_none() {
            out.refused = Some(std::io::Error::last_os_error());
        }
        // Whatever happened: no new huge page on a later fault, here or in a worker. On the
        // whole mapping, so that its parts split off by the advice above merge again (a fork
        // copies every mapping).
        // SAFETY: as said above.
        unsafe { libc::madvise(start as *mut c_void, end - start, libc::MADV_NOHUGEPAGE) };
    }
    out
}

/// Whether the aligned 2 MiB range at `addr` is nearly all resident: only such a range is
/// collapsed, since a collapse fills a range's untouched pages (a sparse one would grow by them).
pub(crate) fn dense(addr: usize) -> bool {
    resident_pages(addr) >= DENSE_PAGES
}

/// Collapses the aligned 2 MiB range at `addr`, in a mapping of this process advised
/// `MADV_HUGEPAGE`, into one huge page (a kernel before 6.1 refuses `MADV_COLLAPSE`).
pub(crate) fn collapse(addr: usize) -> std::io::Result<()> {
    // SAFETY: advice on whole pages of a mapping this process owns: the kernel copies their
    // contents into one huge page, contents and protection unchanged.
    if unsafe { libc::madvise(addr as *mut c_void, HUGE, MADV_COLLAPSE) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// How many of the 512 pages of the 2 MiB range at `addr` are resident (`mincore`).
fn resident_pages(addr: usize) -> usize {
    let mut vec = [0u8; HUGE / PAGE];
    // SAFETY: `addr` is page-aligned and the range lies in one of this process's mappings;
    // `vec` has one byte per page of it.
    let rc = unsafe { libc::mincore(addr as *mut c_void, HUGE, vec.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

/// The `[start, end)` address ranges of `/proc/self/maps` lines that are private, writable
/// and anonymous (no file; the `[heap]`). One per mapping: a huge page cannot straddle two.
fn anonymous_writable_ranges(maps: &str) -> Vec<(usize, usize)> {
    private_writable_mappings(maps)
        .filter(|(_, _, path)| path.is_empty() || *path == "[heap]")
        .map(|(a, b, _)| (a, b))
        .collect()
}

/// The private, writable mappings of a `/proc/<pid>/maps` text: `(start, end, path)`, the path
/// empty for anonymous memory (`[heap]`, `[stack]` as the kernel names them).
pub(crate) fn private_writable_mappings(maps: &str) -> impl Iterator<Item = (usize, usize, &str)> {
    maps.lines().filter_map(|line| {
        let mut fields = line.split_whitespace();
        let (span, perms) = (fields.next()?, fields.next()?);
        let path = fields.nth(3).unwrap_or("");
        if !perms.starts_with("rw") || !perms.ends_with('p') {
            return None;
        }
        let (a, b) = span.split_once('-')?;
        let (a, b) = (
            usize::from_str_radix(a, 16).ok()?,
            usize::from_str_radix(b, 16).ok()?,
        );
        Some((a, b, path))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_private_writable_anonymous_ranges_are_chosen() {
        let maps = "\
55d0a0000000-55d0a0200000 rw-p 00000000 00:00 0                          [heap]
55d0a0200000-55d0a0600000 rw-p 00000000 00:00 0 
7f0000000000-7f0000400000 rw-s 00000000 00:05 123                        /dev/zero (deleted)
7f0000400000-7f0000800000 r--p 00000000 08:01 42                         /usr/lib/libpython3.11.so
7f0000800000-7f0000c00000 rw-p 00100000 08:01 42                         /usr/lib/libpython3.11.so
7f0000c00000-7f0001000000 rw-p 00000000 00:00 0 
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
";
        assert_eq!(
            anonymous_writable_ranges(maps),
            vec![
                (0x55d0a0000000, 0x55d0a0200000),
                (0x55d0a0200000, 0x55d0a0600000),
                (0x7f0000c00000, 0x7f0001000000)
            ]
        );
    }

    #[test]
    fn collapsing_keeps_the_memory_as_it_was() {
        // A heap-like region with a pattern, collapsed (or refused: either way, unchanged).
        let mut block = vec![0u8; 8 << 20];
        for (i, b) in block.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let _ = collapse_anonymous_memory();
        assert!(block.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    }
}
