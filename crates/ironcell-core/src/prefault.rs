//! A new session's first plot without its copy-on-write faults in the middle of it.
//!
//! The zygote draws one figure before it forks (matplotlib warm in every worker), but a worker's
//! first plot still writes reference counts, caches and buffers on ~3,000 pages it shares with
//! the zygote, and takes a copy-on-write fault on each, scattered through the plot: ~8 ms on the
//! development machine, against ~160 faults for a plot in a warm session. Taking the same copies
//! in one `madvise(MADV_POPULATE_WRITE)` per run of pages costs about a third of that per page
//! (measured in a plain python3.11 forked from a warm parent: 3,600 pages in 12.8 ms ahead,
//! against ~33 ms of extra plot time when faulted one by one).
//!
//! So once it has warmed matplotlib, the zygote forks a probe that draws the same figure and
//! reports, from its own `/proc/self/pagemap`, which pages of its private writable mappings it
//! now holds alone ([`exclusive_pages`]): right after a fork every page is shared, so those are
//! the ones the plot wrote. A worker whose cell is about to plot for the first time writes those
//! pages ahead ([`populate_for_writing`]). Nothing changes in memory but which process owns the
//! copy; a session that never plots never copies them, so an idle session's private memory is
//! what it was.

use std::ffi::c_void;
use std::ops::Range;
use std::os::unix::fs::FileExt;

pub const PAGE: usize = 4096;

/// At most this many pages (64 MiB) are remembered: a probe that wrote more was not drawing
/// one figure, and nothing is written ahead.
pub const MAX_PAGES: usize = 16 * 1024;

/// Mappings larger than this are not read from `pagemap` (reservations of address space, not
/// heaps a plot writes into); 8 bytes of `pagemap` per 4 KiB page.
const MAX_MAPPING: usize = 1 << 30;

/// The kernel's `MADV_POPULATE_WRITE` (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

const PM_PRESENT: u64 = 1 << 63;
const PM_FILE_OR_SHARED: u64 = 1 << 61;
const PM_EXCLUSIVE: u64 = 1 << 56;

/// Words that make a cell a likely first plot. The runner writes a first plot's pages ahead
/// before the first cell that has one of them (once per worker; a cell that plots without them
/// takes its faults as it goes), and the host hands a new session whose first cell has one the
/// pool's spare that did so already.
pub const PLOT_WORDS: [&str; 8] = [
    "plt",
    "matplotlib",
    "pyplot",
    "pylab",
    "seaborn",
    ".plot",
    ".hist",
    "savefig",
];

/// Whether `code` has one of the [`PLOT_WORDS`].
pub fn looks_like_a_plot(code: &str) -> bool {
    PLOT_WORDS.iter().any(|word| code.contains(word))
}

/// Runs of whole pages, `[start, end)`, in address order, none touching the next.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageRuns(Vec<Range<usize>>);

impl PageRuns {
    pub fn runs(&self) -> &[Range<usize>] {
        &self.0
    }

    pub fn pages(&self) -> usize {
        self.0.iter().map(|r| (r.end - r.start) / PAGE).sum()
    }

    /// Adds the page at `addr`, above every page added so far.
    fn push_page(&mut self, addr: usize) {
        match self.0.last_mut() {
            Some(last) if last.end == addr => last.end += PAGE,
            _ => self.0.push(addr..addr + PAGE),
        }
    }

    /// The runs as little-endian `u64` pairs (start, end), for the probe's pipe.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0
            .iter()
            .flat_map(|r| [r.start as u64, r.end as u64])
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    /// Reads [`Self::to_bytes`]'s form back; `None` unless every run is whole pages, in order,
    /// apart from the next, and all of them at most [`MAX_PAGES`].
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if !bytes.len().is_multiple_of(16) {
            return None;
        }
        let mut runs: Vec<Range<usize>> = Vec::with_capacity(bytes.len() / 16);
        let mut pages = 0usize;
        for pair in bytes.chunks_exact(16) {
            let word = |i: usize| -> Option<usize> {
                usize::try_from(u64::from_le_bytes(pair[i..i + 8].try_into().ok()?)).ok()
            };
            let (start, end) = (word(0)?, word(8)?);
            let aligned = start % PAGE == 0 && end % PAGE == 0;
            let apart = runs.last().is_none_or(|last| last.end < start);
            if !aligned || end <= start || !apart {
                return None;
            }
            pages += (end - start) / PAGE;
            if pages > MAX_PAGES {
                return None;
            }
            runs.push(start..end);
        }
        Some(PageRuns(runs))
    }
}

/// The private writable mappings of this process, from `/proc/self/maps`: what a copy-on-write
/// fault can copy. Read it before the work whose writes [`exclusive_pages`] is to find.
pub fn private_writable_ranges() -> std::io::Result<Vec<Range<usize>>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(crate::hugepages::private_writable_mappings(&maps)
        .map(|(start, end, _)| start..end)
        .collect())
}

/// The pages of `ranges` that this process now has to itself: present, anonymous (a copy, or
/// a fresh page; not a file's page or shared memory) and mapped by no other process, from
/// `/proc/self/pagemap`. In a child forked a moment ago every page is still shared with its
/// parent, so these are the pages it wrote since (and the fresh ones it touched). Mappings over
/// 1 GiB are skipped; more than [`MAX_PAGES`] is an error.
pub fn exclusive_pages(ranges: &[Range<usize>]) -> std::io::Result<PageRuns> {
    let pagemap = std::fs::File::open("/proc/self/pagemap")?;
    let mut found = PageRuns::default();
    let mut pages = 0;
    let mut entries = vec![0u8; 8 * 4096];
    let mut sorted = ranges.to_vec();
    sorted.sort_by_key(|r| r.start);
    for range in sorted {
        if range.end - range.start > MAX_MAPPING {
            continue;
        }
        let mut addr = range.start / PAGE * PAGE;
        while addr < range.end {
            let count = ((range.end - addr).div_ceil(PAGE)).min(entries.len() / 8);
            let buf = &mut entries[..count * 8];
            pagemap.read_exact_at(buf, (addr / PAGE * 8) as u64)?;
            for (i, entry) in buf.chunks_exact(8).enumerate() {
                let mut word = [0u8; 8];
                word.copy_from_slice(entry);
                let entry = u64::from_le_bytes(word);
                let alone = entry & PM_PRESENT != 0
                    && entry & PM_EXCLUSIVE != 0
                    && entry & PM_FILE_OR_SHARED == 0;
                if alone {
                    pages += 1;
                    if pages > MAX_PAGES {
                        return Err(std::io::Error::other(format!(
                            "more than {MAX_PAGES} pages written"
                        )));
                    }
                    found.push_page(addr + i * PAGE);
                }
            }
            addr += count * PAGE;
        }
    }
    Ok(found)
}

/// Whether this kernel has `MADV_POPULATE_WRITE` (Linux 5.14): asked on one page of a mapping
/// of its own, made for the question.
pub fn populate_supported() -> bool {
    // SAFETY: a fresh private anonymous page where the kernel chooses.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: advice on that page, which nothing else uses.
    let supported = unsafe { libc::madvise(page, PAGE, MADV_POPULATE_WRITE) } == 0;
    // SAFETY: that page, unused from here on.
    unsafe { libc::munmap(page, PAGE) };
    supported
}

/// What [`populate_for_writing`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Populated {
    /// Pages of runs the kernel populated whole.
    pub pages: usize,
    /// Runs it refused (no longer mapped, or no longer writable, in this process).
    pub refused: usize,
}

/// Takes the write faults of `runs` now, one `madvise(MADV_POPULATE_WRITE)` per run (the
/// caller asked [`populate_supported`] first): each page becomes this process's own, as a write
/// would make it, with its contents unchanged. A run that is no longer mapped or writable here
/// is skipped. The runs are the zygote's layout: if the process has since put a shared file
/// mapping where one of them was, that file's pages are dirtied with what they hold.
pub fn populate_for_writing(runs: &PageRuns) -> Populated {
    let mut done = Populated::default();
    for run in runs.runs() {
        // SAFETY: advice on whole pages; MADV_POPULATE_WRITE faults them in as a write would,
        // without changing their contents, and fails (ENOMEM, EFAULT, EINVAL) on addresses
        // that are not mapped writable (or not as ordinary memory) rather than touching them.
        let rc = unsafe {
            libc::madvise(
                run.start as *mut c_void,
                run.end - run.start,
                MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            done.pages += (run.end - run.start) / PAGE;
        } else {
            done.refused += 1;
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Mapping {
        addr: usize,
        len: usize,
    }

    impl Mapping {
        fn new(pages: usize, flags: libc::c_int) -> Mapping {
            let len = pages * PAGE;
            // SAFETY: a fresh anonymous mapping, unmapped in Drop.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED);
            Mapping {
                addr: addr as usize,
                len,
            }
        }

        fn page(&self, i: usize) -> usize {
            self.addr + i * PAGE
        }

        fn write(&self, i: usize, value: u8) {
            // SAFETY: page i lies inside the mapping, which is readable and writable.
            unsafe { std::ptr::write_volatile(self.page(i) as *mut u8, value) }
        }

        fn read(&self, i: usize) -> u8 {
            // SAFETY: as above.
            unsafe { std::ptr::read_volatile(self.page(i) as *const u8) }
        }

        fn resident(&self) -> Vec<usize> {
            let mut vec = vec![0u8; self.len / PAGE];
            // SAFETY: the mapping is page-aligned and `vec` has a byte per page.
            let rc = unsafe { libc::mincore(self.addr as *mut c_void, self.len, vec.as_mut_ptr()) };
            assert_eq!(rc, 0);
            (0..vec.len()).filter(|i| vec[*i] & 1 != 0).collect()
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`.
            unsafe { libc::munmap(self.addr as *mut c_void, self.len) };
        }
    }

    #[test]
    fn the_pages_written_are_found_in_runs_and_shared_memory_is_not() {
        let private = Mapping::new(16, libc::MAP_PRIVATE);
        let shared = Mapping::new(4, libc::MAP_SHARED);
        for i in [3, 4, 9] {
            private.write(i, 1);
        }
        shared.write(0, 1);
        let ranges = [
            shared.addr..shared.addr + shared.len,
            private.addr..private.addr + private.len,
        ];
        let found = exclusive_pages(&ranges).unwrap();
        assert_eq!(
            found.runs(),
            &[
                private.page(3)..private.page(5),
                private.page(9)..private.page(10)
            ]
        );
        assert_eq!(found.pages(), 3);
    }

    #[test]
    fn writing_ahead_makes_the_pages_resident_and_keeps_what_they_hold() {
        let m = Mapping::new(16, libc::MAP_PRIVATE);
        m.write(2, 7);
        let runs = PageRuns(vec![m.page(2)..m.page(4), m.page(10)..m.page(11)]);
        if !populate_supported() {
            eprintln!("MADV_POPULATE_WRITE is not supported by this kernel");
            return;
        }
        let done = populate_for_writing(&runs);
        assert_eq!(
            done,
            Populated {
                pages: 3,
                refused: 0,
            }
        );
        assert_eq!(m.resident(), vec![2, 3, 10]);
        assert_eq!((m.read(2), m.read(3), m.read(10)), (7, 0, 0));
        // A run this process may not write is refused, the others still written ahead.
        let read_only = Mapping::new(2, libc::MAP_PRIVATE);
        // SAFETY: the mapping made just above.
        let rc = unsafe {
            libc::mprotect(
                read_only.addr as *mut c_void,
                read_only.len,
                libc::PROT_READ,
            )
        };
        assert_eq!(rc, 0);
        let done = populate_for_writing(&PageRuns(vec![
            m.page(12)..m.page(13),
            read_only.addr..read_only.addr + read_only.len,
        ]));
        assert_eq!((done.pages, done.refused), (1, 1));
        assert!(m.resident().contains(&12));
        assert!(read_only.resident().is_empty());
    }

    #[test]
    fn runs_cross_the_pipe_and_malformed_ones_are_refused() {
        let runs = PageRuns(vec![0x1000..0x3000, 0x5000..0x6000]);
        assert_eq!(PageRuns::from_bytes(&runs.to_bytes()), Some(runs.clone()));
        assert_eq!(PageRuns::from_bytes(&[]), Some(PageRuns::default()));
        let bad = |pairs: &[(u64, u64)]| {
            let bytes: Vec<u8> = pairs
                .iter()
                .flat_map(|&(a, b)| [a, b])
                .flat_map(u64::to_le_bytes)
                .collect();
            PageRuns::from_bytes(&bytes)
        };
        assert_eq!(bad(&[(0x1001, 0x2000)]), None, "not page-aligned");
        assert_eq!(bad(&[(0x2000, 0x2000)]), None, "empty");
        assert_eq!(
            bad(&[(0x3000, 0x4000), (0x1000, 0x2000)]),
            None,
            "out of order"
        );
        assert_eq!(
            bad(&[(0x1000, 0x3000), (0x2000, 0x4000)]),
            None,
            "overlapping"
        );
        assert_eq!(bad(&[(0x1000, 0x2000), (0x2000, 0x3000)]), None, "touching");
        let too_many = (MAX_PAGES as u64 + 1) * PAGE as u64;
        assert_eq!(bad(&[(0x1000, 0x1000 + too_many)]), None, "too many pages");
        assert_eq!(
            PageRuns::from_bytes(&runs.to_bytes()[..15]),
            None,
            "cut short"
        );
    }
}
