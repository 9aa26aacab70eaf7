//! Fewer mappings for every fork to copy: each shared library's RELRO joined to its data.
//!
//! The dynamic loader maps a library as five mappings: its headers (`r--p`), its code (`r-xp`),
//! its read-only data (`r--p`), its relocated read-only data (RELRO: `r--p`, written while the
//! loader relocated it, then made read-only) and its data (`rw-p`). A zygote warm for plots
//! holds ~73 libraries, ~365 of its ~395 mappings, and `fork` duplicates each one. A mapping
//! holding private pages costs a fork the most: its anonymous reverse map is cloned (an
//! allocation and a tree insert per mapping, in trees every live worker shares) and its page
//! table copied; the RELRO and the data are two such mappings per library.
//!
//! So once the zygote is warm it makes each library's RELRO writable again, as it was while the
//! loader relocated it: the RELRO and the data after it, one file, contiguous in memory and in
//! the file, with one protection and one anonymous reverse map, are then one mapping to the
//! kernel. Nothing is written and nothing moves. Measured in one process alternating
//! (/usr/bin/python3 with matplotlib, 60 live children): 0.20-0.26 ms less CPU per fork.
//! Making the headers and read-only data executable so they join the code was measured too:
//! 0.05 ms, within noise; not done. What changes inside the worker is only that its libraries'
//! RELRO (~1 MiB, counted in `VmData`) is writable: no boundary, since a worker may `mprotect`
//! its own memory as it likes (docs/SECURITY.md #303).

use std::ffi::c_void;

/// What [`merge_library_mappings`] did, for the zygote's log.
#[derive(Debug, Default)]
pub struct Merged {
    /// Mappings of this process before and after.
    pub before: usize,
    pub after: usize,
    /// RELRO ranges made writable.
    pub ranges: usize,
    /// The first refusal, if any (each range is tried on its own; a refused one stays as it was).
    pub refused: Option<std::io::Error>,
}

/// One line of `/proc/self/smaps`' headers, with its `Anonymous:` size.
#[derive(Debug, Clone, PartialEq)]
struct Mapping {
    start: usize,
    end: usize,
    perms: String,
    offset: usize,
    device: String,
    inode: u64,
    anonymous_kib: u64,
}

impl Mapping {
    /// Whether `next` continues this mapping: the same file, right after it in memory and in
    /// the file (what the kernel needs to make two mappings one).
    fn continued_by(&self, next: &Mapping) -> bool {
        self.inode != 0
            && next.inode == self.inode
            && next.device == self.device
            && next.start == self.end
            && next.offset == self.offset + (self.end - self.start)
    }

    /// A library's RELRO: read-only, private, holding pages written since it was mapped (the
    /// loader's relocations), and followed by the file's data (`rw-p`) right after it.
    fn relro_before(&self, next: &Mapping) -> bool {
        self.perms == "r--p"
            && self.anonymous_kib > 0
            && self.anonymous_kib != u64::MAX
            && next.perms == "rw-p"
            && self.continued_by(next)
    }
}

/// Makes each library's RELRO writable again, so the kernel merges it with the library's data
/// mapping. Call it in the zygote, single-threaded, once its libraries are loaded; a range the
/// kernel refuses stays as it was.
pub fn merge_library_mappings() -> Merged {
    let mut out = Merged::default();
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return out;
    };
    let maps = parse_smaps(&smaps);
    out.before = maps.len();
    for (start, end) in relro_ranges(&maps) {
        // SAFETY: whole pages of private file mappings this process holds (its own copies since
        // the loader wrote them), readable already; adding write changes no byte and no other
        // mapping, and no other process sees a private mapping.
        let rc = unsafe {
            libc::mprotect(
                start as *mut c_void,
                end - start,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        if rc == 0 {
            out.ranges += 1;
        } else {
            out.refused
                .get_or_insert_with(std::io::Error::last_os_error);
        }
    }
    out.after = std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0);
    out
}

/// The `[start, end)` ranges of the libraries' RELRO mappings (see [`Mapping::relro_before`]).
fn relro_ranges(maps: &[Mapping]) -> Vec<(usize, usize)> {
    maps.windows(2)
        .filter(|w| w[0].relro_before(&w[1]))
        .map(|w| (w[0].start, w[0].end))
        .collect()
}

/// The mappings of a `/proc/<pid>/smaps` text, in order.
fn parse_smaps(smaps: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        if let Some(m) = parse_header(line) {
            out.push(m);
        } else if let Some(kib) = line.strip_prefix("Anonymous:")
            && let Some(last) = out.last_mut()
        {
            last.anonymous_kib = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(u64::MAX);
        }
    }
    out
}

/// A mapping's header line (`start-end perms offset dev inode [path]`); `None` for the field
/// lines that follow it.
fn parse_header(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let (span, perms, offset, device, inode) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let (a, b) = span.split_once('-')?;
    if perms.len() != 4 {
        return None;
    }
    Some(Mapping {
        start: usize::from_str_radix(a, 16).ok()?,
        end: usize::from_str_radix(b, 16).ok()?,
        perms: perms.to_string(),
        offset: usize::from_str_radix(offset, 16).ok()?,
        device: device.to_string(),
        inode: inode.parse().ok()?,
        // Unknown until its `Anonymous:` line: counted as written, so never merged.
        anonymous_kib: u64::MAX,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smaps(lines: &[(&str, u64)]) -> String {
        lines
            .iter()
            .map(|(h, kib)| format!("{h}\nRss: 4 kB\nAnonymous: {kib:>8} kB\nVmFlags: rd mr\n"))
            .collect()
    }

    #[test]
    fn a_librarys_relro_joins_its_data_and_nothing_else_moves() {
        let text = smaps(&[
            (
                "7f0000000000-7f0000005000 r--p 00000000 fe:00 42 /usr/lib/libpng.so",
                0,
            ),
            (
                "7f0000005000-7f0000029000 r-xp 00005000 fe:00 42 /usr/lib/libpng.so",
                0,
            ),
            (
                "7f0000029000-7f0000034000 r--p 00029000 fe:00 42 /usr/lib/libpng.so",
                0,
            ),
            (
                "7f0000034000-7f0000035000 r--p 00034000 fe:00 42 /usr/lib/libpng.so",
                4,
            ),
            (
                "7f0000035000-7f0000036000 rw-p 00035000 fe:00 42 /usr/lib/libpng.so",
                4,
            ),
            ("7f0000036000-7f0000038000 rw-p 00000000 00:00 0 ", 8),
        ]);
        assert_eq!(
            relro_ranges(&parse_smaps(&text)),
            vec![(0x7f0000034000, 0x7f0000035000)]
        );
    }

    #[test]
    fn read_only_data_never_written_or_of_another_file_or_not_contiguous_stays_read_only() {
        let text = smaps(&[
            // Read-only data the loader never wrote (a library without RELRO): not made writable.
            (
                "7f0000029000-7f0000034000 r--p 00029000 fe:00 42 /usr/lib/libpng.so",
                0,
            ),
            (
                "7f0000034000-7f0000035000 rw-p 00034000 fe:00 42 /usr/lib/libpng.so",
                4,
            ),
            // Another file's data right after a written read-only mapping.
            (
                "7f1000000000-7f1000001000 r--p 00000000 fe:00 43 /usr/lib/libz.so",
                4,
            ),
            (
                "7f1000001000-7f1000002000 rw-p 00001000 fe:00 44 /usr/lib/libbz2.so",
                4,
            ),
            // A gap in the file's offsets.
            (
                "7f2000000000-7f2000001000 r--p 00000000 fe:00 45 /usr/lib/libm.so",
                4,
            ),
            (
                "7f2000001000-7f2000002000 rw-p 00003000 fe:00 45 /usr/lib/libm.so",
                4,
            ),
            // Anonymous memory.
            ("7f3000000000-7f3000001000 r--p 00000000 00:00 0 ", 4),
            ("7f3000001000-7f3000002000 rw-p 00000000 00:00 0 ", 4),
        ]);
        assert_eq!(relro_ranges(&parse_smaps(&text)), vec![]);
    }

    #[test]
    fn a_mapping_whose_anonymous_size_is_unknown_is_left_alone() {
        let text = "7f0000034000-7f0000035000 r--p 00034000 fe:00 42 /usr/lib/libpng.so\n\
                    7f0000035000-7f0000036000 rw-p 00035000 fe:00 42 /usr/lib/libpng.so\n";
        assert_eq!(relro_ranges(&parse_smaps(text)), vec![]);
    }

    #[test]
    fn merging_this_processs_relro_leaves_fewer_mappings_and_the_code_running() {
        let done = merge_library_mappings();
        assert!(done.refused.is_none(), "{:?}", done.refused);
        // This test binary and libc each have a RELRO followed by their data.
        assert!(done.ranges >= 2 && done.after < done.before, "{done:?}");
        // Still calls through the merged libraries' relocated pointers (libc, this binary).
        assert_eq!(std::hint::black_box(format!("{}", 6 * 7)), "42");
    }
}
