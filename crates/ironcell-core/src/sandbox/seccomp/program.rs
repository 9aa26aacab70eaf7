//! How the rules of [`super`] become the one program a worker installs: a binary search over
//! the call number for the verdicts that do not depend on arguments, and the four stacked
//! programs merged ([`merge_stacked`]) for those that do.

use std::collections::BTreeSet;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};

use super::{Processes, Rules, SeccompError, allow_list, arch, kill_list, refusals, unsupported};

/// The answer for a system call number whose verdict does not depend on its arguments, or
/// `Conditional` for one whose does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ByNumber {
    Allow,
    Refuse,
    Unsupported,
    Unknown,
    Kill,
    Conditional,
}

/// The four programs as one, laid out for the kernel's cost: seccompiler compares the system
/// call number with each listed call in turn (about 2,200 instructions for the four), and the
/// kernel converts and JIT-compiles every instruction of every filter each worker installs, and
/// runs the filter on every system call. Here a binary search over the call number (runs of
/// numbers with the same verdict) answers every call whose verdict does not depend on its
/// arguments; the few that do (ioctl, fcntl, prctl, clone, kill, tgkill, prlimit64, setrlimit,
/// socketpair, setsockopt) jump to seccompiler's programs for just those calls, merged by
/// [`merge_stacked`].
pub(super) fn searched_program(processes: Processes) -> Result<BpfProgram, SeccompError> {
    let arch = arch()?;
    let allowed = allow_list(processes)?;
    let unsupported = unsupported()?;
    let refused = refusals(processes)?;
    let killed = kill_list();
    let conditional: BTreeSet<i64> = allowed
        .iter()
        .chain(&unsupported)
        .chain(&refused)
        .filter(|(_, rules)| !rules.is_empty())
        .map(|(&nr, _)| nr)
        .collect();
    let runs = number_runs([&allowed, &unsupported, &refused, &killed], &conditional)?;
    let only = |rules: &Rules| -> Rules {
        rules
            .iter()
            .filter(|(nr, _)| conditional.contains(nr))
            .map(|(&nr, r)| (nr, r.clone()))
            .collect()
    };
    let enosys = SeccompAction::Errno(libc::ENOSYS as u32);
    let eperm = SeccompAction::Errno(libc::EPERM as u32);
    let eopnotsupp = SeccompAction::Errno(libc::EOPNOTSUPP as u32);
    let conditional_part = merge_stacked(&[
        BpfProgram::try_from(SeccompFilter::new(
            only(&allowed),
            enosys,
            SeccompAction::Allow,
            arch,
        )?)?,
        BpfProgram::try_from(SeccompFilter::new(
            only(&unsupported),
            SeccompAction::Allow,
            eopnotsupp,
            arch,
        )?)?,
        BpfProgram::try_from(SeccompFilter::new(
            only(&refused),
            SeccompAction::Allow,
            eperm,
            arch,
        )?)?,
    ])?;
    // seccompiler's own start: the architecture check, then the call number into A.
    let mut program: BpfProgram = conditional_part[..ARCH_CHECK_LEN].to_vec();
    program.push(seccompiler::sock_filter {
        code: BPF_LD_W_ABS,
        jt: 0,
        jf: 0,
        k: 0,
    });
    let mut to_conditional = Vec::new();
    emit_search(&runs, &mut program, &mut to_conditional)?;
    let start = program.len();
    for at in to_conditional {
        program[at].k =
            u32::try_from(start - at - 1).map_err(|_| SeccompError::Merge("a jump too long"))?;
    }
    program.extend(conditional_part);
    if program.len() > BPF_MAXINSNS {
        return Err(SeccompError::Merge(
            "the program is longer than the kernel allows",
        ));
    }
    Ok(program)
}

/// Runs of call numbers with the same answer: (first number, answer); the last run reaches
/// u32::MAX (x32 and unknown numbers: ENOSYS, as the allow-list answers).
fn number_runs(
    [allowed, unsupported, refused, killed]: [&Rules; 4],
    conditional: &BTreeSet<i64>,
) -> Result<Vec<(u32, ByNumber)>, SeccompError> {
    let by_number = |nr: i64| {
        if killed.contains_key(&nr) {
            ByNumber::Kill
        } else if conditional.contains(&nr) {
            ByNumber::Conditional
        } else if refused.contains_key(&nr) {
            ByNumber::Refuse
        } else if unsupported.contains_key(&nr) {
            ByNumber::Unsupported
        } else if allowed.contains_key(&nr) {
            ByNumber::Allow
        } else {
            ByNumber::Unknown
        }
    };
    let highest = allowed
        .keys()
        .chain(unsupported.keys())
        .chain(refused.keys())
        .chain(killed.keys())
        .copied()
        .max()
        .unwrap_or(0);
    if !(0..0x4000_0000).contains(&highest) {
        return Err(SeccompError::Merge("a system call number out of range"));
    }
    let mut runs: Vec<(u32, ByNumber)> = Vec::new();
    for nr in 0..=highest + 1 {
        let answer = by_number(nr);
        if runs.last().is_none_or(|&(_, a)| a != answer) {
            runs.push((nr as u32, answer));
        }
    }
    Ok(runs)
}

/// Emits a binary search over `runs` (the call number is in A): each inner node jumps to the
/// upper half when A >= its first number, and falls through to the lower half; each leaf
/// returns its verdict (or jumps to the conditional part, patched by the caller).
fn emit_search(
    runs: &[(u32, ByNumber)],
    program: &mut BpfProgram,
    to_conditional: &mut Vec<usize>,
) -> Result<(), SeccompError> {
    let ret = |k: u32| seccompiler::sock_filter {
        code: BPF_RET_K,
        jt: 0,
        jf: 0,
        k,
    };
    match runs {
        [] => Err(SeccompError::Merge("an empty search")),
        [(_, answer)] => {
            program.push(match answer {
                ByNumber::Allow => ret(libc::SECCOMP_RET_ALLOW),
                ByNumber::Refuse => ret(libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
                ByNumber::Unsupported => ret(libc::SECCOMP_RET_ERRNO | libc::EOPNOTSUPP as u32),
                ByNumber::Unknown => ret(libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
                ByNumber::Kill => ret(libc::SECCOMP_RET_KILL_PROCESS),
                ByNumber::Conditional => {
                    to_conditional.push(program.len());
                    seccompiler::sock_filter {
                        code: BPF_JMP_JA,
                        jt: 0,
                        jf: 0,
                        k: 0,
                    }
                }
            });
            Ok(())
        }
        _ => {
            let mid = runs.len() / 2;
            let node = program.len();
            program.push(seccompiler::sock_filter {
                code: BPF_JMP_JGE_K,
                jt: 0,
                jf: 0,
                k: runs[mid].0,
            });
            emit_search(&runs[..mid], program, to_conditional)?;
            program[node].jt = u8::try_from(program.len() - node - 1)
                .map_err(|_| SeccompError::Merge("a search branch too long"))?;
            emit_search(&runs[mid..], program, to_conditional)
        }
    }
}

/// The four compiled programs, in installation order (allow-list, unsupported, refusals,
/// kill-list).
pub fn stacked_worker_filters(processes: Processes) -> Result<Vec<BpfProgram>, SeccompError> {
    let arch = arch()?;
    let enosys = SeccompAction::Errno(libc::ENOSYS as u32);
    let eopnotsupp = SeccompAction::Errno(libc::EOPNOTSUPP as u32);
    let eperm = SeccompAction::Errno(libc::EPERM as u32);
    let filters = [
        SeccompFilter::new(allow_list(processes)?, enosys, SeccompAction::Allow, arch)?,
        SeccompFilter::new(unsupported()?, SeccompAction::Allow, eopnotsupp, arch)?,
        SeccompFilter::new(refusals(processes)?, SeccompAction::Allow, eperm, arch)?,
        SeccompFilter::new(
            kill_list(),
            SeccompAction::Allow,
            SeccompAction::KillProcess,
            arch,
        )?,
    ];
    let mut programs = Vec::new();
    for f in filters {
        programs.push(BpfProgram::try_from(f)?);
    }
    Ok(programs)
}

// Classic BPF opcodes (linux/filter.h, the same on every architecture).
const BPF_JMP_JA: u16 = 0x05;
const BPF_JMP_JGE_K: u16 = 0x35;
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_RET_K: u16 = 0x06;
const BPF_CLASS_MASK: u16 = 0x07;
const BPF_RET: u16 = 0x06;
/// The most instructions the kernel accepts in one filter (BPF_MAXINSNS).
const BPF_MAXINSNS: usize = 4096;

/// One program with the verdicts of `programs` installed in that order: the kernel runs every
/// installed filter and takes the most severe verdict, and between two of equal severity (two
/// errnos) the one of the filter installed last. The merged program runs the programs from the
/// last installed to the first, each "allow" (but the first-installed program's) becoming a
/// jump to the start of the next; instructions are replaced one for one, so every jump inside
/// a program keeps its target. It answers with the verdict of the last-installed program that
/// does not allow the call, which is the kernel's answer when:
/// - every program starts with the same architecture check (its kill is then decided by the
///   first program run, as by all of them), and no other kill is in any program but the last
///   installed;
/// - apart from that, each program has one verdict besides "allow", and no program is less
///   severe than one installed before it.
///
/// Both are checked; the worker's programs (ENOSYS allow-list, EOPNOTSUPP unsupported calls,
/// EPERM refusals, kill-list) satisfy them.
pub fn merge_stacked(programs: &[BpfProgram]) -> Result<BpfProgram, SeccompError> {
    let allow = libc::SECCOMP_RET_ALLOW;
    let kill = libc::SECCOMP_RET_KILL_PROCESS;
    let arch_check = programs.first().map(|p| &p[..p.len().min(ARCH_CHECK_LEN)]);
    let mut earlier_action = None::<u32>;
    for (n, program) in programs.iter().enumerate() {
        if program.len() <= ARCH_CHECK_LEN || Some(&program[..ARCH_CHECK_LEN]) != arch_check {
            return Err(SeccompError::Merge("the programs start differently"));
        }
        let installed_last = n + 1 == programs.len();
        let mut action = None::<u32>;
        for ins in &program[ARCH_CHECK_LEN..] {
            if ins.code & BPF_CLASS_MASK != BPF_RET {
                continue;
            }
            if ins.code != BPF_RET_K {
                return Err(SeccompError::Merge("a program returns a computed verdict"));
            }
            if ins.k == allow || (ins.k == kill && installed_last) {
                continue;
            }
            let a = ins.k & libc::SECCOMP_RET_ACTION_FULL;
            if a == kill || action.is_some_and(|b| b != a) {
                return Err(SeccompError::Merge(
                    "a program has a verdict the merge cannot keep",
                ));
            }
            action = Some(a);
        }
        if let Some(a) = action {
            // The kernel compares actions as signed numbers: lower is more severe.
            if earlier_action.is_some_and(|e| (a as i32) > (e as i32)) {
                return Err(SeccompError::Merge(
                    "a program is less severe than an earlier one",
                ));
            }
            earlier_action = Some(a);
        }
    }
    let mut merged = BpfProgram::new();
    let run_last = programs.len().saturating_sub(1);
    for (n, program) in programs.iter().rev().enumerate() {
        let next_start = merged.len() + program.len();
        for ins in program {
            if n != run_last && ins.code == BPF_RET_K && ins.k == allow {
                let skip = u32::try_from(next_start - merged.len() - 1)
                    .map_err(|_| SeccompError::Merge("a jump too long"))?;
                merged.push(seccompiler::sock_filter {
                    code: BPF_JMP_JA,
                    jt: 0,
                    jf: 0,
                    k: skip,
                });
            } else {
                merged.push(ins.clone());
            }
        }
    }
    if merged.len() > BPF_MAXINSNS {
        return Err(SeccompError::Merge(
            "the merged program is longer than the kernel allows",
        ));
    }
    Ok(merged)
}

/// seccompiler starts every program with: load the architecture, jump over the next if it is
/// ours, kill.
const ARCH_CHECK_LEN: usize = 3;
