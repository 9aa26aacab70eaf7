//! Sandbox escape tests in Rust (issue 10): fork, apply the real lockdown
//! ([`apply_lockdown_to_current_process`] with the plan the host builds from the default
//! policy, enforce mode), attempt what docs/SECURITY.md's catalogue forbids, and assert each
//! attempt's own verdict, reported line by line through a pipe.
//!
//! Every scenario runs as the invoking user and, when that is root, also as `nobody` (the
//! child drops to uid/gid 65534 before locking down, as an unprivileged host's worker would
//! be). The main attack list runs once per Landlock ABI from 1 to the kernel's (older kernels
//! get the same protections from seccomp), and once without the lockdown as a control, which
//! proves each refusal comes from the sandbox and not from file modes. A canary scenario grants
//! the target directory and shows the same harness sees the attack succeed.
//!
//! This binary has no test harness (`harness = false` in Cargo.toml): `main` is its only
//! thread, so a forked child is single-threaded like a worker and may allocate freely.
//! Arguments: an optional name filter (a substring, or the whole name with `--exact`, like
//! libtest's), `--list` and `--ignored`; other flags are ignored. Skips are printed with their
//! reason: a kernel without Landlock or seccomp, and (thread cap only) a root invoker without a
//! writable pids cgroup, where docs/SECURITY.md accepts that no cap exists.
//! `IRONCELL_LOCKDOWN_VERBOSE=1` prints every attack's verdict.

mod attacks;
mod child;
mod fixture;
mod syscalls;

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;
use nix::unistd::Uid;

use ironcell_core::sandbox::policy::Policy;
use ironcell_core::sandbox::{Sandbox, SandboxMode, SandboxPlan, sys};

use attacks::{ATTACKS, Expect, KILLERS, Outcome};
use child::Who;
use fixture::Fixture;

/// One named test's end: passed, skipped (with the reason), or the list of what did not hold.
enum Verdict {
    Pass,
    Skip(String),
    Fail(Vec<String>),
}

type Test = fn(Who) -> anyhow::Result<Verdict>;

const TESTS: &[(&str, Test)] = &[
    (
        "a_locked_down_child_refuses_every_attack_at_every_landlock_abi",
        a_locked_down_child_refuses_every_attack_at_every_landlock_abi,
    ),
    (
        "without_the_lockdown_the_same_attacks_work",
        without_the_lockdown_the_same_attacks_work,
    ),
    (
        "kill_listed_syscalls_end_a_locked_down_child_with_sigsys",
        kill_listed_syscalls_end_a_locked_down_child_with_sigsys,
    ),
    (
        "a_locked_down_childs_threads_stop_at_the_thread_cap",
        a_locked_down_childs_threads_stop_at_the_thread_cap,
    ),
    (
        "canary_a_plan_granting_the_target_dir_lets_the_attack_through",
        canary_a_plan_granting_the_target_dir_lets_the_attack_through,
    ),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // libtest flags that take a separate value; that value is not a filter.
    const WITH_VALUE: &[&str] = &[
        "--test-threads",
        "--skip",
        "--format",
        "--color",
        "--logfile",
        "-Z",
    ];
    let filter = args
        .iter()
        .enumerate()
        .find(|(i, a)| {
            !a.starts_with('-') && (*i == 0 || !WITH_VALUE.contains(&args[i - 1].as_str()))
        })
        .map(|(_, a)| a.clone());
    let exact = args.iter().any(|a| a == "--exact");
    let who_list: Vec<Who> = if Uid::current().is_root() {
        vec![Who::Invoker, Who::Nobody]
    } else {
        vec![Who::Invoker]
    };
    let mut selected = Vec::new();
    for (name, test) in TESTS {
        for &who in &who_list {
            let full = format!("{name}[{}]", who.label());
            let wanted = match &filter {
                None => true,
                Some(f) if exact => full == *f,
                Some(f) => full.contains(f.as_str()),
            };
            if wanted {
                selected.push((full, *test, who));
            }
        }
    }
    if args.iter().any(|a| a == "--list") {
        for (name, _, _) in &selected {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--ignored") {
        // No test here is ignored.
        selected.clear();
    }
    println!("\nrunning {} tests", selected.len());
    let (mut passed, mut failed, mut skipped) = (0, Vec::new(), 0);
    for (name, test, who) in selected {
        match test(who) {
            Ok(Verdict::Pass) => {
                passed += 1;
                println!("test {name} ... ok");
            }
            Ok(Verdict::Skip(why)) => {
                skipped += 1;
                println!("test {name} ... skipped: {why}");
            }
            Ok(Verdict::Fail(problems)) => {
                println!("test {name} ... FAILED");
                failed.push((name, problems));
            }
            Err(e) => {
                println!("test {name} ... FAILED");
                failed.push((name, vec![format!("the test could not run: {e:#}")]));
            }
        }
    }
    for (name, problems) in &failed {
        println!("\n---- {name} ----");
        for p in problems {
            println!("  {p}");
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed; {skipped} skipped\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(101)
    }
}

/// Why this kernel cannot run the locked-down scenarios, if it cannot.
fn kernel_lacks() -> Option<String> {
    if sys::landlock_abi_of_kernel() < 1 {
        return Some("this kernel has no Landlock (Linux 5.13+ with `lsm=...,landlock`)".into());
    }
    if !sys::seccomp_available() {
        return Some("this kernel lacks CONFIG_SECCOMP_FILTER".into());
    }
    None
}

/// The plan the host would build for a worker of `who` whose session dir is `scratch`:
/// the default policy, enforce mode, the Landlock ABI capped to `abi_cap`.
fn plan_for(
    who: Who,
    scratch: &std::path::Path,
    abi_cap: Option<i32>,
) -> anyhow::Result<SandboxPlan> {
    let policy = Policy::load("default").context("loading the default policy")?;
    let mut sandbox = Sandbox::new(policy, SandboxMode::Enforce, abi_cap, None);
    if who == Who::Nobody {
        // What a host running as nobody computes: no cgroups (not root); RLIMIT_NPROC instead.
        sandbox.pids_cgroup_parent = None;
        sandbox.root_workers = false;
    }
    if let Err(e) = sandbox.preflight() {
        bail!("{e}");
    }
    Ok(sandbox.plan_for(scratch, &[]))
}

/// Compares an attack's reported outcome with what it must be.
fn judge(
    problems: &mut Vec<String>,
    context: &str,
    name: &str,
    expect: Expect,
    got: Option<Outcome>,
    who: Who,
) {
    if std::env::var_os("IRONCELL_LOCKDOWN_VERBOSE").is_some() {
        let seen = got
            .as_ref()
            .map_or_else(|| "no verdict".into(), Outcome::describe);
        println!("    [{}] {context}: {name}: {seen}", who.label());
    }
    let uid0 = who.uid() == 0;
    let same_user = who.uid() == Uid::current().as_raw();
    let ok = match (expect, &got) {
        (Expect::NotRun, None) => true,
        (Expect::NotRun, Some(_)) => false,
        (_, None) => false,
        (Expect::Done, Some(o)) => *o == Outcome::Done,
        (Expect::Refused(errnos), Some(Outcome::Refused(e))) => errnos.contains(e),
        (Expect::Refused(_), Some(_)) => false,
        (Expect::DoneAsRoot, Some(o)) => !uid0 || *o == Outcome::Done,
        (Expect::DoneAsParentsUser, Some(o)) => !same_user || *o == Outcome::Done,
        (Expect::DoneAsRootWithCapability(cap), Some(o)) => {
            !(uid0 && same_user && invoker_has_capability(cap)) || *o == Outcome::Done
        }
    };
    if !ok {
        let wanted = match expect {
            Expect::Done
            | Expect::DoneAsRoot
            | Expect::DoneAsParentsUser
            | Expect::DoneAsRootWithCapability(_) => "success".to_string(),
            Expect::Refused(errnos) => errnos
                .iter()
                .map(|e| nix::errno::Errno::from_raw(*e).to_string())
                .collect::<Vec<_>>()
                .join(" or "),
            Expect::NotRun => "not to be run".to_string(),
        };
        let seen = got.map_or_else(
            || "no verdict (the child died or exec'd first)".into(),
            |o| o.describe(),
        );
        problems.push(format!("{context}: {name}: wanted {wanted}, got {seen}"));
    }
}

/// Whether this process's effective capabilities include `cap`.
fn invoker_has_capability(cap: u32) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << cap) != 0)
}

/// Runs the attack list in one child, locked down with `plan` or (`lock == false`, the
/// control) not, and judges each verdict.
fn attack_in_child(
    who: Who,
    fx: &Fixture,
    plan: &SandboxPlan,
    lock: bool,
    context: &str,
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    let targets = fx.targets(plan)?;
    let expect = |a: &attacks::Attack| if lock { a.locked } else { a.control };
    let mut child = child::spawn(who, lock.then_some(plan), |r| {
        for a in ATTACKS {
            if !matches!(expect(a), Expect::NotRun) {
                r.line(a.name, &(a.run)(&targets).encode());
            }
        }
    })?;
    let reported_done = child.read_reports()?;
    if lock && reported_done {
        // Catalogue #25: the host sees the worker's lockdown from outside.
        check_status_from_outside(child.pid, who, context, problems)?;
    }
    let finished = child.finish()?;
    fx.remove_pids_group_of(plan, finished.pid);
    if let Some(setup) = finished.value("setup") {
        problems.push(format!("{context}: the child could not set up: {setup}"));
        return Ok(());
    }
    if lock && finished.value("locked").is_none() {
        problems.push(format!("{context}: the child never reported its lockdown"));
    }
    if !matches!(finished.status, WaitStatus::Exited(_, 0)) || !reported_done {
        problems.push(format!(
            "{context}: the child ended as {:?} before reporting every attack",
            finished.status
        ));
    }
    let reported: BTreeMap<&str, Outcome> = finished
        .lines
        .iter()
        .map(|(k, v)| (k.as_str(), Outcome::decode(v)))
        .collect();
    for a in ATTACKS {
        judge(
            problems,
            context,
            a.name,
            expect(a),
            reported.get(a.name).cloned(),
            who,
        );
    }
    Ok(())
}

/// `NoNewPrivs: 1`, `Seccomp: 2` (filter), `CapEff: 0` in the child's `/proc/<pid>/status`,
/// read by the parent while the locked-down child waits.
fn check_status_from_outside(
    pid: nix::unistd::Pid,
    who: Who,
    context: &str,
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or("")
            .to_string()
    };
    for (name, want) in [
        ("NoNewPrivs", "1"),
        ("Seccomp", "2"),
        ("CapEff", "0000000000000000"),
    ] {
        let got = field(name);
        if got != want {
            problems.push(format!(
                "{context}: 25_status_seen_from_outside: {name} is {got:?}, wanted {want}"
            ));
        }
    }
    let uid = field("Uid");
    if uid.split_whitespace().next() != Some(who.uid().to_string().as_str()) {
        problems.push(format!(
            "{context}: the child runs as uid {uid:?}, wanted {}",
            who.uid()
        ));
    }
    Ok(())
}

fn a_locked_down_child_refuses_every_attack_at_every_landlock_abi(
    who: Who,
) -> anyhow::Result<Verdict> {
    if let Some(why) = kernel_lacks() {
        return Ok(Verdict::Skip(why));
    }
    let kernel_abi =
        sys::landlock_abi_of_kernel().min(ironcell_core::sandbox::NEWEST_KNOWN_LANDLOCK_ABI);
    let mut problems = Vec::new();
    for abi in 1..=kernel_abi {
        let fx = Fixture::new(who)?;
        let plan = plan_for(who, &fx.scratch, Some(abi))?;
        let context = format!("Landlock ABI {abi}");
        let granted = plan.filesystem.as_ref().map(|f| f.abi);
        if granted != Some(abi) {
            bail!("the plan uses Landlock ABI {granted:?}, not the {abi} asked for");
        }
        attack_in_child(who, &fx, &plan, true, &context, &mut problems)?;
        fx.check_untouched(&context, &mut problems)?;
    }
    Ok(verdict(problems))
}

fn without_the_lockdown_the_same_attacks_work(who: Who) -> anyhow::Result<Verdict> {
    let fx = Fixture::new(who)?;
    // The plan only sizes the attacks (its limits); the control child applies nothing.
    let plan = plan_for(who, &fx.scratch, None)?;
    let mut problems = Vec::new();
    attack_in_child(
        who,
        &fx,
        &plan,
        false,
        "no lockdown (control)",
        &mut problems,
    )?;
    Ok(verdict(problems))
}

fn kill_listed_syscalls_end_a_locked_down_child_with_sigsys(who: Who) -> anyhow::Result<Verdict> {
    if let Some(why) = kernel_lacks() {
        return Ok(Verdict::Skip(why));
    }
    let mut problems = Vec::new();
    for k in KILLERS {
        let fx = Fixture::new(who)?;
        let plan = plan_for(who, &fx.scratch, None)?;
        // Control: without the lockdown the call returns (with an error: harmless arguments).
        let control = child::spawn(who, None, |r| {
            (k.run)();
            r.line("returned", "");
        })?
        .run_to_end()?;
        if control.value("returned").is_none()
            || !matches!(control.status, WaitStatus::Exited(_, 0))
        {
            problems.push(format!(
                "{}: without the lockdown the call did not return normally ({:?})",
                k.name, control.status
            ));
        }
        let locked = child::spawn(who, Some(&plan), |r| {
            (k.run)();
            r.line("returned", "");
        })?
        .run_to_end()?;
        if let Some(setup) = locked.value("setup") {
            problems.push(format!("{}: the child could not set up: {setup}", k.name));
        } else if locked.value("locked").is_none() {
            problems.push(format!("{}: the child never reported its lockdown", k.name));
        } else if locked.value("returned").is_some()
            || !matches!(locked.status, WaitStatus::Signaled(_, Signal::SIGSYS, _))
        {
            problems.push(format!(
                "{}: wanted death by SIGSYS, got {:?}{}",
                k.name,
                locked.status,
                if locked.value("returned").is_some() {
                    " after the call returned"
                } else {
                    ""
                }
            ));
        }
        fx.remove_pids_group_of(&plan, locked.pid);
    }
    Ok(verdict(problems))
}

/// Catalogue #29 and #49: thousands of small-stack threads stop at the thread cap (a pids
/// cgroup's `pids.max` for a root worker, RLIMIT_NPROC for any other), and without the lockdown
/// the same child goes past it.
fn a_locked_down_childs_threads_stop_at_the_thread_cap(who: Who) -> anyhow::Result<Verdict> {
    if let Some(why) = kernel_lacks() {
        return Ok(Verdict::Skip(why));
    }
    let fx = Fixture::new(who)?;
    let plan = plan_for(who, &fx.scratch, None)?;
    let by_cgroup = plan.pids_cgroup_parent.is_some();
    if !by_cgroup && who.uid() == 0 {
        return Ok(Verdict::Skip(
            "a root worker without a writable pids cgroup has no thread cap (an accepted \
             residual risk in docs/SECURITY.md; `doctor` says `thread cap NONE`)"
                .into(),
        ));
    }
    const TRIES: u64 = 100_000;
    let locked = child::spawn(who, Some(&plan), |r| {
        r.line("nproc", &syscalls::nproc_limit().to_string());
        let (started, refused) = syscalls::start_threads(TRIES);
        r.line("started", &started.to_string());
        r.line("refused", &refused.unwrap_or(0).to_string());
    })?
    .run_to_end()?;
    fx.remove_pids_group_of(&plan, locked.pid);
    let mut problems = Vec::new();
    if let Some(setup) = locked.value("setup") {
        problems.push(format!("the child could not set up: {setup}"));
        return Ok(verdict(problems));
    }
    let number = |key: &str| locked.value(key).and_then(|v| v.parse::<u64>().ok());
    let (Some(nproc), Some(started), Some(refused)) =
        (number("nproc"), number("started"), number("refused"))
    else {
        problems.push(format!(
            "the child did not report its threads (ended as {:?})",
            locked.status
        ));
        return Ok(verdict(problems));
    };
    // pids.max counts the main thread; RLIMIT_NPROC counts every task of the uid.
    let (cap, layer) = if by_cgroup {
        (plan.limits.threads, "pids.max")
    } else {
        (nproc, "RLIMIT_NPROC")
    };
    if std::env::var_os("IRONCELL_LOCKDOWN_VERBOSE").is_some() {
        println!(
            "    [{}] threads: {started} started, then errno {refused}; {layer} cap {cap}",
            who.label()
        );
    }
    if !by_cgroup && nproc == libc::RLIM_INFINITY {
        problems.push("a non-root locked-down child has no RLIMIT_NPROC".into());
    }
    if refused != libc::EAGAIN as u64 || started >= cap {
        problems.push(format!(
            "wanted EAGAIN below the {layer} cap of {cap}; {started} threads started, \
             then errno {refused}"
        ));
    }
    // Control: the same child without the lockdown starts more threads than the cap allows.
    let want = started + 64;
    let control = child::spawn(who, None, |r| {
        let (started, refused) = syscalls::start_threads(want);
        r.line("started", &started.to_string());
        r.line("refused", &refused.unwrap_or(0).to_string());
    })?
    .run_to_end()?;
    if control.value("started") != Some(want.to_string().as_str()) {
        problems.push(format!(
            "without the lockdown wanted {want} threads, got {:?} (errno {:?})",
            control.value("started"),
            control.value("refused")
        ));
    }
    Ok(verdict(problems))
}

fn canary_a_plan_granting_the_target_dir_lets_the_attack_through(
    who: Who,
) -> anyhow::Result<Verdict> {
    if let Some(why) = kernel_lacks() {
        return Ok(Verdict::Skip(why));
    }
    let fx = Fixture::new(who)?;
    let mut plan = plan_for(who, &fx.scratch, None)?;
    // A deliberately broken plan: the host directory the attacks aim at is granted.
    if let Some(fs) = plan.filesystem.as_mut() {
        fs.read_write.push(fx.other.clone());
    }
    let targets = fx.targets(&plan)?;
    let finished = child::spawn(who, Some(&plan), |r| {
        for a in ATTACKS.iter().filter(|a| CANARY.contains(&a.name)) {
            r.line(a.name, &(a.run)(&targets).encode());
        }
    })?
    .run_to_end()?;
    fx.remove_pids_group_of(&plan, finished.pid);
    let mut problems = Vec::new();
    if let Some(setup) = finished.value("setup") {
        problems.push(format!("the child could not set up: {setup}"));
    }
    for (name, want) in [
        (
            "07_read_a_world_readable_host_file_outside_the_grants",
            Outcome::Done,
        ),
        (
            "08_create_a_file_in_a_world_writable_host_dir",
            Outcome::Done,
        ),
        // seccomp does not depend on the filesystem grants.
        (
            "12_tcp_connect_to_a_loopback_listener",
            Outcome::Refused(libc::EPERM),
        ),
    ] {
        let got = finished.value(name).map(Outcome::decode);
        if got.as_ref() != Some(&want) {
            problems.push(format!(
                "{name}: with the target dir granted wanted {}, got {}",
                want.describe(),
                got.map_or("no verdict".into(), |o| o.describe())
            ));
        }
    }
    Ok(verdict(problems))
}

const CANARY: &[&str] = &[
    "07_read_a_world_readable_host_file_outside_the_grants",
    "08_create_a_file_in_a_world_writable_host_dir",
    "12_tcp_connect_to_a_loopback_listener",
];

fn verdict(problems: Vec<String>) -> Verdict {
    if problems.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(problems)
    }
}
