//! Embeds ironcell's Python extension (crates/ironcell-python, a stable-ABI cdylib) in the
//! binary. Cargo builds it first because it is a build-dependency of this crate; this script
//! finds the shared object cargo produced and copies it to OUT_DIR, where `include_bytes!`
//! (src/zygote.rs) picks it up. The host itself links no libpython.
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=python");
    println!("cargo:rerun-if-changed=sandbox-policy");
    println!("cargo:rerun-if-changed=crates/ironcell-python/src");
    println!("cargo:rerun-if-changed=crates/ironcell-core/src");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let found = find_extension(&out).unwrap_or_else(|| {
        panic!(
            "ironcell: cannot find libironcell_python.so, which cargo builds as a build-dependency \
             of this crate (looked in the deps/ directories above {}); run `cargo clean -p \
             ironcell-python` and build again",
            out.display()
        )
    });
    println!("cargo:rerun-if-changed={}", found.display());
    let dest = out.join("libironcell_python.so");
    if let Err(e) = std::fs::copy(&found, &dest) {
        panic!(
            "ironcell: copying {} to {}: {e}",
            found.display(),
            dest.display()
        );
    }
}

/// OUT_DIR is `<target>/<profile>/build/ironcell-<hash>/out`; build-dependencies land in
/// `<profile>/deps` (without `--target`) or `<target-dir>/<profile>/deps` (with it: they are
/// built for the host). The newest one wins, which is the one this build just made.
fn find_extension(out: &Path) -> Option<PathBuf> {
    let profile_dir = out.ancestors().nth(3)?;
    let mut candidates = vec![profile_dir.join("deps")];
    if let (Some(target_dir), Some(profile)) =
        (profile_dir.ancestors().nth(2), profile_dir.file_name())
    {
        candidates.push(target_dir.join(profile).join("deps"));
    }
    candidates
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libironcell_python") && n.ends_with(".so"))
        })
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
}
