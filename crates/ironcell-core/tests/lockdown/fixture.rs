//! What one scenario attacks, made fresh by the parent before each fork: a session scratch dir
//! owned by the child's user (as the host makes it), and outside it a world-writable host dir
//! with a world-readable-and-writable file and a unix socket anyone may connect to, plus TCP,
//! UDP and abstract-socket listeners on loopback. File modes would let the child do all of it;
//! only the sandbox stands in the way.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io::ErrorKind;
use std::net::{TcpListener, UdpSocket};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::Context;

use ironcell_core::sandbox::SandboxPlan;

use crate::attacks::{Targets, VICTIM_MODE, VICTIM_TEXT};
use crate::child::Who;

static NEXT: AtomicU32 = AtomicU32::new(0);

pub struct Fixture {
    base: PathBuf,
    pub scratch: PathBuf,
    /// The host dir outside every grant.
    pub other: PathBuf,
    victim: PathBuf,
    unix_path: PathBuf,
    abstract_name: String,
    tcp: TcpListener,
    udp: UdpSocket,
    unix: UnixListener,
    abstract_listener: UnixListener,
}

fn chmod(path: &Path, mode: u32) -> anyhow::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}

fn c_path(path: &Path) -> anyhow::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{} has a NUL", path.display()))
}

impl Fixture {
    pub fn new(who: Who) -> anyhow::Result<Fixture> {
        let id = format!(
            "ironcell-lockdown-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let tmp = std::fs::canonicalize(std::env::temp_dir()).context("the temp dir")?;
        let base = tmp.join(&id);
        std::fs::create_dir(&base).with_context(|| format!("creating {}", base.display()))?;
        chmod(&base, 0o755)?;
        let scratch = base.join("scratch");
        std::fs::create_dir(&scratch)?;
        chmod(&scratch, 0o700)?;
        std::os::unix::fs::chown(&scratch, Some(who.uid()), Some(who.gid()))
            .with_context(|| format!("chown {}", scratch.display()))?;
        let other = base.join("other");
        std::fs::create_dir(&other)?;
        chmod(&other, 0o777)?;
        let victim = other.join("victim");
        std::fs::write(&victim, VICTIM_TEXT)?;
        chmod(&victim, VICTIM_MODE)?;
        let unix_path = other.join("sock");
        let unix = UnixListener::bind(&unix_path).context("binding a unix socket")?;
        chmod(&unix_path, 0o777)?;
        unix.set_nonblocking(true)?;
        let abstract_listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(id.as_bytes())?)
                .context("binding an abstract unix socket")?;
        abstract_listener.set_nonblocking(true)?;
        let tcp = TcpListener::bind("127.0.0.1:0").context("binding a TCP listener")?;
        tcp.set_nonblocking(true)?;
        let udp = UdpSocket::bind("127.0.0.1:0").context("binding a UDP socket")?;
        udp.set_nonblocking(true)?;
        Ok(Fixture {
            base,
            scratch,
            other,
            victim,
            unix_path,
            abstract_name: id,
            tcp,
            udp,
            unix,
            abstract_listener,
        })
    }

    /// The attacks' targets, sized by `plan`'s limits.
    pub fn targets(&self, plan: &SandboxPlan) -> anyhow::Result<Targets> {
        Ok(Targets {
            victim: c_path(&self.victim)?,
            new_host_file: c_path(&self.other.join("created-by-the-child"))?,
            scratch: c_path(&self.scratch)?,
            scratch_file: c_path(&self.scratch.join("file"))?,
            scratch_link: c_path(&self.scratch.join("link-to-victim"))?,
            scratch_hard_link: c_path(&self.scratch.join("hard-link-to-victim"))?,
            scratch_script: c_path(&self.scratch.join("script.sh"))?,
            scratch_big: c_path(&self.scratch.join("big"))?,
            unix_path: c_path(&self.unix_path)?,
            abstract_name: self.abstract_name.as_bytes().to_vec(),
            tcp_port: self.tcp.local_addr()?.port(),
            udp_port: self.udp.local_addr()?.port(),
            file_size_bytes: plan.limits.file_size_bytes,
            open_files: plan.limits.open_files,
            memory_bytes: plan.limits.memory_bytes,
            address_space_bytes: plan.limits.address_space_bytes,
        })
    }

    /// After a locked-down child: the host file, the host dir and every listener are as the
    /// parent left them.
    pub fn check_untouched(&self, context: &str, problems: &mut Vec<String>) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.victim)?;
        if text != VICTIM_TEXT {
            problems.push(format!("{context}: the host file now holds {text:?}"));
        }
        let mode = std::fs::metadata(&self.victim)?.permissions().mode() & 0o7777;
        if mode != VICTIM_MODE {
            problems.push(format!("{context}: the host file's mode is now {mode:o}"));
        }
        let entries: BTreeSet<String> = std::fs::read_dir(&self.other)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        let expected: BTreeSet<String> = ["victim", "sock"].map(String::from).into();
        if entries != expected {
            problems.push(format!("{context}: the host dir now holds {entries:?}"));
        }
        let mut heard = Vec::new();
        if !would_block(self.tcp.accept().map(drop)) {
            heard.push("TCP");
        }
        if !would_block(self.udp.recv(&mut [0u8; 16]).map(drop)) {
            heard.push("UDP");
        }
        if !would_block(self.unix.accept().map(drop)) {
            heard.push("unix path");
        }
        if !would_block(self.abstract_listener.accept().map(drop)) {
            heard.push("abstract unix");
        }
        if !heard.is_empty() {
            problems.push(format!(
                "{context}: listeners were reached: {}",
                heard.join(", ")
            ));
        }
        Ok(())
    }

    /// A root worker joins a pids cgroup `w<pid>` under the plan's parent (as a real worker
    /// does); remove it once the child is gone, as the host does when the zygote reports an exit.
    pub fn remove_pids_group_of(&self, plan: &SandboxPlan, pid: nix::unistd::Pid) {
        if let Some(parent) = &plan.pids_cgroup_parent {
            ironcell_core::sandbox::cgroup::remove_group_of(parent, pid.as_raw());
        }
    }
}

fn would_block(r: std::io::Result<()>) -> bool {
    matches!(r, Err(e) if e.kind() == ErrorKind::WouldBlock)
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}
