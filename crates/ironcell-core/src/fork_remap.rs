//! A fork's private mappings of its parent's files, moved onto its own copies (SECURITY.md #305).
//!
//! A fork inherits its parent's memory, and a private file mapping (`MAP_PRIVATE`: `mmap`'s
//! `ACCESS_COPY`, numpy's `memmap(mode='c')`, a library's segments) stays on the parent's
//! file: every page the fork has not written is the file's page in the page cache, so it shows
//! what the parent writes to that file after the fork. Shared file mappings are refused before
//! the fork goes on (#301); these are moved instead. The worker cannot read its own `/proc`
//! (hidden, #155), so the host reads the fork's `/proc/<pid>/maps` and, for each private
//! mapping of a file on the parent directory's filesystem or of a deleted file, the fork's
//! `/proc/<pid>/pagemap` over that range only (8 bytes a page): the runs of pages the fork has
//! not written privately. It sends them with the go-ahead; the fork, before any Python runs in
//! it, maps each run whose file is one it copied onto its copy, at the same address
//! (`MAP_FIXED`), protection and file offset. Pages written privately (a library's relocated
//! data, an `ACCESS_COPY` map the session wrote) are the fork's own already and stay.
//!
//! Nothing here is a boundary against the parent: the parent's code could have changed the
//! fork's before it ran. What the host checks from outside is #301's refusal of shared ones.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// One run of a fork's memory to map again on its own copy of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remap {
    pub start: u64,
    pub len: u64,
    /// The run's offset in the file.
    pub offset: u64,
    pub major: u64,
    pub minor: u64,
    pub inode: u64,
    /// `PROT_*` bits, from the mapping's `rwx`.
    pub prot: u64,
}

/// The most runs sent to one fork: past it the fork is refused (with the reason).
pub const MAX_REMAPS: usize = 4096;
const RECORD: usize = 7 * 8;

/// The payload that follows the go-ahead byte: a count, then the runs (little-endian).
pub fn encode(remaps: &[Remap]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + remaps.len() * RECORD);
    out.extend_from_slice(&(remaps.len() as u32).to_le_bytes());
    for r in remaps {
        for v in [r.start, r.len, r.offset, r.major, r.minor, r.inode, r.prot] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// How many bytes of runs follow a count read from the payload's first four bytes; `None`
/// past [`MAX_REMAPS`].
pub fn records_len(count: [u8; 4]) -> Option<usize> {
    let n = u32::from_le_bytes(count) as usize;
    (n <= MAX_REMAPS).then_some(n * RECORD)
}

/// The runs in the bytes after the count.
pub fn decode(records: &[u8]) -> Vec<Remap> {
    records
        .chunks_exact(RECORD)
        .map(|c| {
            let v = |i: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&c[i * 8..i * 8 + 8]);
                u64::from_le_bytes(b)
            };
            Remap {
                start: v(0),
                len: v(1),
                offset: v(2),
                major: v(3),
                minor: v(4),
                inode: v(5),
                prot: v(6),
            }
        })
        .collect()
}

/// One file mapping of a `/proc/<pid>/maps` line.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileMapping {
    start: u64,
    end: u64,
    private: bool,
    prot: u64,
    offset: u64,
    device: (u64, u64),
    inode: u64,
    deleted: bool,
}

/// A line of `/proc/<pid>/maps` that maps a file (inode not 0). The path that ends it is the
/// process's to name: only its ` (deleted)` ending is read.
fn parse_line(line: &[u8]) -> Option<FileMapping> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let mut next = || std::str::from_utf8(fields.next()?).ok();
    let (range, perms, offset, device, inode) =
        (next()?, next()?.as_bytes(), next()?, next()?, next()?);
    let (start, end) = range.split_once('-')?;
    let (major, minor) = device.split_once(':')?;
    let hex = |s: &str| u64::from_str_radix(s, 16).ok();
    let inode: u64 = inode.parse().ok()?;
    if inode == 0 || perms.len() < 4 {
        return None;
    }
    let bit = |i: usize, c: u8, p: i32| if perms[i] == c { p as u64 } else { 0 };
    Some(FileMapping {
        start: hex(start)?,
        end: hex(end)?,
        private: perms[3] == b'p',
        prot: bit(0, b'r', libc::PROT_READ)
            | bit(1, b'w', libc::PROT_WRITE)
            | bit(2, b'x', libc::PROT_EXEC),
        offset: hex(offset)?,
        device: (hex(major)?, hex(minor)?),
        inode,
        deleted: line.ends_with(b" (deleted)"),
    })
}

/// The runs of pages not written privately, as (first page, pages), from a range's pagemap
/// entries: a page is the process's own once it is present and not a file page, or swapped
/// (a file page is never swapped; it is dropped and read again).
fn unwritten_runs(entries: &[u64]) -> Vec<(usize, usize)> {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE: u64 = 1 << 61;
    let written = |e: u64| e & SWAPPED != 0 || (e & PRESENT != 0 && e & FILE == 0);
    let mut runs = Vec::new();
    let mut from = None;
    for (i, &e) in entries.iter().chain([&PRESENT]).enumerate() {
        match (written(e) || i == entries.len(), from) {
            (false, None) => from = Some(i),
            (true, Some(f)) => {
                runs.push((f, i - f));
                from = None;
            }
            _ => {}
        }
    }
    runs
}

/// What the host sends fork `fork` (the process the kernel says it is; `None`: no runs) as its
/// go-ahead: one byte, then the runs of its memory that map the files of `parent_dir`'s
/// filesystem (or deleted ones) privately ([`runs_to_remap`]). An error refuses the fork.
pub fn go_ahead(fork: Option<i32>, zygote: i32, parent_dir: &Path) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::MetadataExt;
    // Where the directory cannot be read, no mapping's device is it: deleted files' only.
    let device = std::fs::symlink_metadata(parent_dir).map_or((u64::MAX, u64::MAX), |m| {
        (
            u64::from(libc::major(m.dev())),
            u64::from(libc::minor(m.dev())),
        )
    });
    let runs = match fork {
        Some(pid) => runs_to_remap(pid, zygote, device)?,
        None => Vec::new(),
    };
    let mut go = b"g".to_vec();
    go.extend(encode(&runs));
    Ok(go)
}

/// The runs fork `pid` should map again on its copies: its private mappings of files on
/// `device` (the parent directory's filesystem) or deleted, that `zygote` does not map (its
/// libraries, which no session writes), less the pages the fork wrote. An error: its memory
/// could not be read, or it holds more than [`MAX_REMAPS`] runs.
pub fn runs_to_remap(pid: i32, zygote: i32, device: (u64, u64)) -> Result<Vec<Remap>, String> {
    let read = |p: i32| std::fs::read(format!("/proc/{p}/maps"));
    let maps = read(pid).map_err(|e| format!("the fork's memory map cannot be read: {e}"))?;
    let zygotes: HashSet<((u64, u64), u64)> = read(zygote)
        .unwrap_or_default()
        .split(|&b| b == b'\n')
        .filter_map(parse_line)
        .map(|m| (m.device, m.inode))
        .collect();
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))
        .map_err(|e| format!("the fork's pages cannot be read: {e}"))?;
    // SAFETY: sysconf(3) with a constant name.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let mut remaps = Vec::new();
    for m in maps.split(|&b| b == b'\n').filter_map(parse_line) {
        let ours = m.device == device || m.deleted;
        if !m.private || !ours || zygotes.contains(&(m.device, m.inode)) || m.end <= m.start {
            continue;
        }
        let pages = ((m.end - m.start) / page) as usize;
        let mut bytes = vec![0u8; pages * 8];
        pagemap
            .read_exact_at(&mut bytes, m.start / page * 8)
            .map_err(|e| format!("the fork's pages cannot be read: {e}"))?;
        let entries: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        for (first, n) in unwritten_runs(&entries) {
            remaps.push(Remap {
                start: m.start + first as u64 * page,
                len: n as u64 * page,
                offset: m.offset + first as u64 * page,
                major: m.device.0,
                minor: m.device.1,
                inode: m.inode,
                prot: m.prot,
            });
        }
        if remaps.len() > MAX_REMAPS {
            return Err(format!(
                "it maps its files privately in more than {MAX_REMAPS} runs, which the fork \
                 cannot move onto its copies: close them (del the maps) and fork again"
            ));
        }
    }
    Ok(remaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_file_mapping_is_read_with_its_protection_offset_and_device() {
        let line = b"7f00aa000000-7f00aa003000 rw-p 00002000 fd:01 1234567                    /s/a b/data.bin";
        let m = parse_line(line).unwrap();
        assert_eq!(
            (m.start, m.end, m.offset),
            (0x7f00aa000000, 0x7f00aa003000, 0x2000)
        );
        assert_eq!(
            (m.device, m.inode, m.private, m.deleted),
            ((0xfd, 1), 1234567, true, false)
        );
        assert_eq!(m.prot, (libc::PROT_READ | libc::PROT_WRITE) as u64);
        let gone = parse_line(b"1000-2000 r--p 00000000 00:1f 9 /s/tmpabc (deleted)").unwrap();
        assert!(gone.deleted && gone.prot == libc::PROT_READ as u64);
        let shared = parse_line(b"1000-2000 rw-s 00000000 08:02 77 /dev/shm/x").unwrap();
        assert!(!shared.private);
        assert_eq!(parse_line(b"1000-2000 rw-p 00000000 00:00 0 [heap]"), None);
        assert_eq!(parse_line(b"1000-2000 rw-p 00000000 00:00 0"), None);
        assert_eq!(parse_line(b"garbage"), None);
        // A path that is not UTF-8 still reads the fields before it.
        let odd = parse_line(b"1000-2000 ---p 00000000 08:02 78 /s/\xff\xfe").unwrap();
        assert_eq!((odd.prot, odd.inode), (0, 78));
    }

    #[test]
    fn pages_written_privately_or_swapped_split_the_runs_and_stay() {
        const P: u64 = 1 << 63;
        const S: u64 = 1 << 62;
        const F: u64 = 1 << 61;
        // file page, absent, anonymous (written), file, file, swapped, absent
        let entries = [P | F, 0, P, P | F, P | F, S, 0];
        assert_eq!(unwritten_runs(&entries), vec![(0, 2), (3, 2), (6, 1)]);
        assert_eq!(unwritten_runs(&[P, P]), Vec::<(usize, usize)>::new());
        assert_eq!(unwritten_runs(&[0, 0, 0]), vec![(0, 3)]);
        assert_eq!(unwritten_runs(&[]), Vec::<(usize, usize)>::new());
    }

    #[test]
    fn runs_travel_to_the_fork_as_they_were_and_too_many_are_refused() {
        let r = Remap {
            start: 0x7f00_0000_0000,
            len: 8192,
            offset: 4096,
            major: 0xfd,
            minor: 1,
            inode: u64::MAX,
            prot: 3,
        };
        let bytes = encode(&[r, r]);
        let len = records_len(bytes[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, bytes.len() - 4);
        assert_eq!(decode(&bytes[4..]), vec![r, r]);
        assert_eq!(records_len((MAX_REMAPS as u32 + 1).to_le_bytes()), None);
    }
}
