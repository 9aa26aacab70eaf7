//! A forked child that (optionally) drops to `nobody`, applies a real lockdown, runs a body and
//! reports one line per verdict through a pipe; the parent reads the lines, may inspect the
//! child from outside while it waits, and then collects its exit status.
//!
//! The test binary has no harness (`harness = false`), so `main` is its only thread and a
//! forked child is exactly what the zygote hands a worker: one thread, free to allocate,
//! taking no lock another thread could hold.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Gid, Pid, Uid, fork, pipe};

use ironcell_core::sandbox::{SandboxPlan, apply_lockdown_to_current_process};

/// The unprivileged user a root invoker also tests as (`nobody`/`nogroup` on Debian).
pub const NOBODY: u32 = 65534;

/// Whose identity the child has when it locks itself down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// The user running the tests (root in CI, or an ordinary user on a laptop).
    Invoker,
    /// `nobody`, dropped to from root in the child before the lockdown (root invokers only).
    Nobody,
}

impl Who {
    pub fn label(self) -> String {
        match self {
            Who::Nobody => "nobody".into(),
            Who::Invoker if Uid::current().is_root() => "root".into(),
            Who::Invoker => format!("uid {}", Uid::current()),
        }
    }

    /// The uid the child runs as.
    pub fn uid(self) -> u32 {
        match self {
            Who::Nobody => NOBODY,
            Who::Invoker => Uid::current().as_raw(),
        }
    }

    /// The gid the child runs as.
    pub fn gid(self) -> u32 {
        match self {
            Who::Nobody => NOBODY,
            Who::Invoker => Gid::current().as_raw(),
        }
    }
}

/// Writes the child's report lines to the pipe. Lines are `key\tvalue`.
pub struct Reporter {
    pipe: ManuallyDrop<File>,
}

impl Reporter {
    pub fn line(&mut self, key: &str, value: &str) {
        // A failed write means the parent is gone; there is no one left to tell.
        let _ = self.pipe.write_all(format!("{key}\t{value}\n").as_bytes());
    }
}

/// The parent's handle on a running child.
pub struct Child {
    pub pid: Pid,
    reports: BufReader<File>,
    /// Closing this lets the child exit after it reported `done`.
    go: Option<OwnedFd>,
    /// The child's lines, in order.
    pub lines: Vec<(String, String)>,
}

/// What a child's whole life produced.
pub struct Finished {
    pub pid: Pid,
    pub lines: Vec<(String, String)>,
    pub status: WaitStatus,
}

impl Finished {
    pub fn value(&self, key: &str) -> Option<&str> {
        self.lines
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// How long a child may take to report; far above what any scenario needs (milliseconds).
const REPORT_DEADLINE: Duration = Duration::from_secs(60);

/// Forks a child that becomes `who`, applies `plan` if given (the real
/// [`apply_lockdown_to_current_process`], enforce mode), runs `body`, reports `done` and waits
/// for the parent before it exits. Setup failures are reported as `setup` lines.
pub fn spawn(
    who: Who,
    plan: Option<&SandboxPlan>,
    body: impl FnOnce(&mut Reporter),
) -> anyhow::Result<Child> {
    let threads = std::fs::read_dir("/proc/self/task")
        .context("listing /proc/self/task")?
        .count();
    if threads != 1 {
        bail!(
            "the test process has {threads} threads; the lockdown must be applied in a child \
             forked from a single-threaded process, as the zygote is"
        );
    }
    let (report_r, report_w) = pipe().context("pipe")?;
    let (go_r, go_w) = pipe().context("pipe")?;
    // SAFETY: this process has one thread (no test harness), so the child may do anything.
    match unsafe { fork() }.context("fork")? {
        ForkResult::Child => {
            drop(report_r);
            drop(go_w);
            let mut reporter = Reporter {
                // SAFETY: the child owns this fd for the rest of its life.
                pipe: ManuallyDrop::new(unsafe { File::from_raw_fd(report_w.as_raw_fd()) }),
            };
            let code = run_child(
                who,
                plan,
                &mut reporter,
                body,
                &[report_w.as_raw_fd(), go_r.as_raw_fd()],
            );
            reporter.line("done", "");
            // Wait until the parent has looked at us from outside (it closes its end).
            let mut byte = [0u8; 1];
            // SAFETY: go_r is this process's own open fd.
            let mut go = ManuallyDrop::new(unsafe { File::from_raw_fd(go_r.as_raw_fd()) });
            let _ = go.read(&mut byte);
            // SAFETY: ends the child without running the parent's destructors or atexit hooks.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(report_w);
            drop(go_r);
            Ok(Child {
                pid: child,
                reports: BufReader::new(File::from(report_r)),
                go: Some(go_w),
                lines: Vec::new(),
            })
        }
    }
}

/// The child's side; returns its exit code.
fn run_child(
    who: Who,
    plan: Option<&SandboxPlan>,
    reporter: &mut Reporter,
    body: impl FnOnce(&mut Reporter),
    keep: &[i32],
) -> i32 {
    // As the worker does first: no inherited fd but its own (here: the two pipes and stdio).
    close_fds_except(keep);
    if who == Who::Nobody
        && let Err(e) = become_nobody()
    {
        reporter.line("setup", &format!("dropping to nobody: {e}"));
        return 3;
    }
    if let Some(plan) = plan {
        match apply_lockdown_to_current_process(plan) {
            Ok(missing) if missing.is_empty() => reporter.line("locked", ""),
            Ok(missing) => {
                reporter.line(
                    "setup",
                    &format!("layers skipped in enforce mode: {missing:?}"),
                );
                return 4;
            }
            Err(e) => {
                reporter.line("setup", &format!("lockdown failed: {e}"));
                return 4;
            }
        }
    }
    body(reporter);
    0
}

fn close_fds_except(keep: &[i32]) {
    let max = nix::unistd::sysconf(nix::unistd::SysconfVar::OPEN_MAX)
        .ok()
        .flatten()
        .unwrap_or(1024)
        .min(65536) as i32;
    for fd in 3..max {
        if !keep.contains(&fd) {
            // SAFETY: closing an fd number this process may or may not have open; EBADF is fine.
            unsafe { libc::close(fd) };
        }
    }
}

fn become_nobody() -> nix::Result<()> {
    nix::unistd::setgroups(&[])?;
    nix::unistd::setgid(Gid::from_raw(NOBODY))?;
    nix::unistd::setuid(Uid::from_raw(NOBODY))?;
    if Uid::current().as_raw() != NOBODY || Uid::effective().as_raw() != NOBODY {
        return Err(nix::errno::Errno::EPERM);
    }
    Ok(())
}

impl Child {
    /// Reads the child's lines until it reports `done` or closes the pipe (it exited, or an
    /// attack replaced its program).
    pub fn read_reports(&mut self) -> anyhow::Result<bool> {
        let deadline = Instant::now() + REPORT_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.reports.buffer().is_empty() {
                let mut fds = [PollFd::new(
                    self.reports.get_ref().as_fd(),
                    PollFlags::POLLIN,
                )];
                let ms = PollTimeout::try_from(left.as_millis().min(60_000) as i32)
                    .unwrap_or(PollTimeout::MAX);
                if poll(&mut fds, ms).context("poll")? == 0 {
                    let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
                    bail!("the child sent nothing for {REPORT_DEADLINE:?}; killed it");
                }
            }
            let mut line = String::new();
            if self
                .reports
                .read_line(&mut line)
                .context("reading the child's report")?
                == 0
            {
                return Ok(false);
            }
            let line = line.trim_end_matches('\n');
            let (k, v) = line.split_once('\t').unwrap_or((line, ""));
            if k == "done" {
                return Ok(true);
            }
            self.lines.push((k.to_string(), v.to_string()));
        }
    }

    /// Lets the child exit and collects its status.
    pub fn finish(mut self) -> anyhow::Result<Finished> {
        self.go = None;
        let status = waitpid(self.pid, None).context("waitpid")?;
        Ok(Finished {
            pid: self.pid,
            lines: self.lines,
            status,
        })
    }

    /// Reads everything and waits: for children that need no inspection from outside.
    pub fn run_to_end(mut self) -> anyhow::Result<Finished> {
        self.read_reports()?;
        self.finish()
    }
}
