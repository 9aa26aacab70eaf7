//! Where ironcell runs, as far as client configs care: WSL2 (and then where Windows is), or
//! plain Linux. Every probe reads files below a root (`/` normally; tests give a fake one through
//! `--probe-root` / `IRONCELL_PROBE_ROOT`), so WSL can be tested on any Linux.

use std::path::{Path, PathBuf};

/// The Windows side of a WSL2 installation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wsl {
    /// The distro ironcell runs in (`WSL_DISTRO_NAME`), if known.
    pub distro: Option<String>,
    /// Whether Windows programs can be started from Linux (WSL "interop").
    pub interop: bool,
    /// Where the C: drive is mounted (`<root>/mnt/c`).
    pub c_drive: PathBuf,
}

/// Detects WSL below `root`: `/proc/sys/fs/binfmt_misc/WSLInterop` (interop registered) or
/// `/proc/version` naming Microsoft's kernel.
pub fn detect(root: &Path, distro_env: Option<String>) -> Option<Wsl> {
    let interop_file = root.join("proc/sys/fs/binfmt_misc/WSLInterop");
    let interop_text = std::fs::read_to_string(&interop_file).ok();
    let version = std::fs::read_to_string(root.join("proc/version")).unwrap_or_default();
    if interop_text.is_none() && !version.to_ascii_lowercase().contains("microsoft") {
        return None;
    }
    Some(Wsl {
        distro: distro_env.filter(|d| !d.is_empty()),
        interop: interop_text.is_some_and(|t| t.trim_start().starts_with("enabled")),
        c_drive: root.join("mnt/c"),
    })
}

/// Where Claude Desktop keeps its config below a Windows user's profile.
pub const CLAUDE_DESKTOP_UNDER_PROFILE: &str = "AppData/Roaming/Claude/claude_desktop_config.json";

impl Wsl {
    /// Windows user profiles that have a Claude Desktop config (or, with `must_exist` false, a
    /// Claude folder at all), by scanning `C:\Users`.
    pub fn claude_profiles(&self, must_exist: bool) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(self.c_drive.join("Users")) else {
            return Vec::new();
        };
        let mut out: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                !matches!(name, "Public" | "Default" | "Default User" | "All Users")
            })
            .filter(|p| {
                let cfg = p.join(CLAUDE_DESKTOP_UNDER_PROFILE);
                if must_exist {
                    cfg.is_file()
                } else {
                    cfg.parent().is_some_and(Path::is_dir)
                }
            })
            .collect();
        out.sort();
        out
    }

    /// The Windows-side Claude Desktop config: for `user` if given, else the one profile that
    /// has Claude; several candidates are resolved by asking Windows for `%USERNAME%`.
    pub fn claude_desktop_config(&self, user: Option<&str>) -> Result<PathBuf, String> {
        if let Some(u) = user {
            return Ok(self
                .c_drive
                .join("Users")
                .join(u)
                .join(CLAUDE_DESKTOP_UNDER_PROFILE));
        }
        let mut found = self.claude_profiles(true);
        if found.is_empty() {
            found = self.claude_profiles(false);
        }
        match found.len() {
            1 => Ok(found.remove(0).join(CLAUDE_DESKTOP_UNDER_PROFILE)),
            0 => Err(format!(
                "no Claude Desktop found under {} (install Claude Desktop on Windows, or name the Windows user with --windows-user)",
                self.c_drive.join("Users").display()
            )),
            _ => {
                if let Some(me) = self.windows_username()
                    && let Some(p) = found
                        .iter()
                        .find(|p| p.file_name().is_some_and(|n| n == me.as_str()))
                {
                    return Ok(p.join(CLAUDE_DESKTOP_UNDER_PROFILE));
                }
                Err(format!(
                    "several Windows users have Claude Desktop ({}); name yours with --windows-user",
                    found
                        .iter()
                        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            }
        }
    }

    /// `%USERNAME%` from Windows (needs interop; `cmd.exe` under the C: drive).
    fn windows_username(&self) -> Option<String> {
        if !self.interop {
            return None;
        }
        let cmd = self.c_drive.join("Windows/System32/cmd.exe");
        let out = std::process::Command::new(cmd)
            .args(["/c", "echo", "%USERNAME%"])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (!name.is_empty() && !name.contains('%')).then_some(name)
    }

    /// A Windows path (`C:\x\y` or `C:/x/y`) as seen from this Linux (`/mnt/c/x/y`).
    pub fn linux_path_of(&self, windows: &str) -> Option<PathBuf> {
        let b = windows.as_bytes();
        if b.len() >= 2 && b[0].is_ascii_alphabetic() && b[1] == b':' {
            let drive = (b[0] as char).to_ascii_lowercase();
            let mnt = self.c_drive.parent()?.join(drive.to_string());
            let rest = windows[2..].replace('\\', "/");
            return Some(mnt.join(rest.trim_start_matches('/')));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_needs_the_interop_file_or_a_microsoft_kernel() {
        let root = std::env::temp_dir().join(format!("ironcell-wsl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("proc/sys/fs/binfmt_misc")).unwrap();
        std::fs::write(root.join("proc/version"), "Linux version 6.8.0-generic").unwrap();
        assert_eq!(detect(&root, None), None);
        std::fs::write(root.join("proc/sys/fs/binfmt_misc/WSLInterop"), "enabled\n").unwrap();
        let w = detect(&root, Some("Ubuntu".into())).unwrap();
        assert!(w.interop);
        assert_eq!(w.distro.as_deref(), Some("Ubuntu"));
        assert_eq!(
            w.linux_path_of(r"D:\Work\proj").unwrap(),
            root.join("mnt/d/Work/proj")
        );
        std::fs::create_dir_all(root.join("mnt/c/Users/ann/AppData/Roaming/Claude")).unwrap();
        std::fs::create_dir_all(root.join("mnt/c/Users/Public")).unwrap();
        assert_eq!(
            w.claude_desktop_config(None).unwrap(),
            root.join("mnt/c/Users/ann")
                .join(CLAUDE_DESKTOP_UNDER_PROFILE)
        );
    }
}
