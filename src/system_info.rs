//! The `system://info` resource: what this ironcell runs on and what it enforces.

use serde_json::{Value, json};
use sysinfo::System;

use crate::session::SessionManager;

/// Gathers the machine, interpreter and limit facts a model (or a person) needs to know.
///
/// Long on purpose: the facts in the order `system://info` shows them, each a line or two.
pub async fn collect(sessions: &SessionManager) -> Value {
    let (cpu, cores, total_mem, avail_mem) = match System::new() {
        Ok(mut sys) => {
            sys.refresh_memory();
            sys.refresh_cpu_all();
            let cpu = sys
                .cpus()
                .first()
                .map(|c| c.brand().trim().to_string())
                .unwrap_or_default();
            (
                cpu,
                sys.cpus().len(),
                sys.total_memory(),
                sys.available_memory(),
            )
        }
        Err(e) => (format!("unknown: {e}"), 0, 0, 0),
    };
    let chosen = match sessions.interpreter() {
        Ok(i) => {
            json!({"interpreter": i.executable, "given": i.given, "chosen_by": i.source.to_string(), "kind": i.kind})
        }
        Err(e) => json!({"error": e.to_string()}),
    };
    let mut python = match sessions.python_info().await {
        Ok(info) => json!({
            "version": info.python_version,
            "executable": info.executable,
            "prefix": info.prefix,
            "base_prefix": info.base_prefix,
            "site_packages": info.site_packages,
            "warm_start_ms": info.warm_ms,
        }),
        Err(e) => json!({"error": format!("{e:#}")}),
    };
    if let (Some(p), Some(c)) = (python.as_object_mut(), chosen.as_object()) {
        for (k, v) in c {
            p.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    let s = sessions.settings();
    // What serve uses: the state dir it prepared (the configured one, or the fallback).
    let state_dir = sessions.state_dir();
    let configured = s.resolved_state_dir();
    let tmp = crate::sandbox::private_tmp::host_status(s.private_tmp, state_dir);
    let mut sandbox = sandbox_summary(sessions.sandbox(), &tmp);
    sandbox["private_tmp"] = json!({"in_force": tmp.describe(), "detail": tmp});
    let fallback = state_dir != configured;
    let state = json!({
        "path": state_dir,
        "configured": configured,
        "fallback": fallback,
        "note": fallback.then_some("the configured state dir could not be used (ironcell's log and `ironcell doctor` say why): session files are in this private directory and are lost at reboot; set MCP_BRIDGE_STATE_DIR to a directory this user can write"),
        "memory_backed": crate::config::memory_backed_state_dir(state_dir),
    });
    let local_tools = match sessions.local_tools() {
        Some(t) => t.describe().await,
        None => json!({"loaded": [], "failed": []}),
    };
    json!({
        "ironcell": env!("CARGO_PKG_VERSION"),
        "os": System::long_os_version().unwrap_or_default(),
        "kernel": System::kernel_version().unwrap_or_default(),
        "arch": System::cpu_arch(),
        "cpu": {"model": cpu, "logical_cores": cores},
        "memory": {"total_bytes": total_mem, "available_bytes": avail_mem},
        "python": python,
        "limits": {
            "default_timeout_s": s.default_timeout.as_secs_f64(),
            "max_timeout_s": s.max_timeout.as_secs_f64(),
            "interrupt_grace_s": s.interrupt_grace.as_secs_f64(),
            "max_sessions": s.max_sessions,
            "session_ttl_s": s.session_ttl.as_secs_f64(),
            "max_code_bytes": s.max_code_bytes,
            "inline_output_bytes": s.inline_output_bytes,
            "max_output_bytes": s.max_output_bytes,
        },
        "sandbox": sandbox,
        "state_dir": state,
        "mcp": sessions.proxy().describe().await,
        "local_tools": local_tools,
        "packages": sessions.packages().info(),
        "worker_lockdown_ms_median": sessions.median_lockdown_ms(),
        "sessions": {
            "known": sessions.session_count(),
            "live_workers": sessions.live_worker_count(),
            "forks": sessions.forked_sessions().into_iter()
                .map(|(name, lineage)| json!({"name": name, "lineage": lineage}))
                .collect::<Vec<_>>(),
            "max_fork_depth": sessions.max_fork_depth(),
        },
        "spare_workers": spare_workers(sessions),
        "output_mode": format!("{:?}", s.output_mode).to_lowercase(),
        "not_applicable": not_applicable(s),
    })
}

/// The sandbox in force: mode, policy, layers, and which layer provides each protection.
pub fn sandbox_summary(
    sb: &crate::sandbox::Sandbox,
    tmp: &crate::sandbox::private_tmp::PrivateTmp,
) -> Value {
    json!({
        "mode": match sb.mode { crate::sandbox::SandboxMode::Enforce => "enforce", crate::sandbox::SandboxMode::BestEffort => "best-effort" },
        "policy": {"name": sb.policy.name, "source": sb.policy.source, "description": sb.policy.description},
        "landlock": {"kernel_abi": sb.kernel_landlock_abi, "abi_in_use": sb.landlock_abi, "abi_cap": sb.landlock_abi_cap},
        "seccomp": sb.seccomp_available,
        "missing_layers": sb.missing_layers(),
        "refuses_to_run": sb.preflight().err().map(|e| e.to_string()),
        "limits": {
            "cpu_seconds": sb.policy.limits.cpu_seconds,
            "memory_bytes": sb.memory_bytes,
            "address_space_bytes": sb.address_space_bytes(),
            "file_size_bytes": sb.policy.limits.file_size_mib << 20,
            "open_files": sb.policy.limits.open_files,
            "threads": sb.policy.limits.threads,
            "scratch_quota_bytes": sb.scratch_quota_bytes(),
        },
        "mechanisms": {
            "memory": "RLIMIT_DATA (private memory) + RLIMIT_AS (all mappings, shared included); memfd_create refused",
            "threads": sb.thread_cap_layer(tmp),
        },
        "protections": sb.protections(tmp),
        "child_processes": match sb.children(tmp) {
            Ok(()) => "allowed: fork (never exec), inside the session's limits, killed with it".to_string(),
            Err(why) => format!("refused: {why}"),
        },
        "epoll_watches": epoll_watches(),
        "granted": {
            "read_only": sb.policy.filesystem.allow_read,
            "read_write": sb.policy.filesystem.read_write.iter().chain(&sb.policy.filesystem.allow_write).collect::<Vec<_>>(),
        },
        "network": "none",
    })
}

/// The epoll gate's shares (src/epoll_gate.rs).
fn epoll_watches() -> Value {
    let (held, cap) = crate::epoll_gate::usage();
    json!({
        "per_session": crate::epoll_gate::PER_SESSION,
        "all_sessions_cap": cap,
        "held": held,
        "how": "each EPOLL_CTL_ADD is counted by the host (a seccomp user notification); past a share: ENOSPC",
    })
}

/// Settings of the container-based bridge that were given but do not apply here, and why.
fn not_applicable(s: &crate::config::Settings) -> Value {
    let mut out = serde_json::Map::new();
    for (name, value, why) in crate::config::not_applicable_variables(s) {
        out.insert(name, json!(format!("{value} (ignored: {why})")));
    }
    Value::Object(out)
}

/// The pool of pre-forked spares: how many wait (and of them, the plot spare: whether one is
/// kept, and its pid while it waits), the pool's size, how many new workers' sets of
/// directories wait made ahead of how many kept (`pool_dirs.rs`), and the private memory they
/// hold (USS
/// from `smaps_rollup`; `null` where the kernel does not let the host read it).
fn spare_workers(sessions: &SessionManager) -> Value {
    let spares = sessions.spare_pids();
    let private: Option<u64> = spares.iter().map(|(pid, _)| private_bytes(*pid)).sum();
    let plot_spare_pid = spares.iter().find(|(_, plots)| *plots).map(|(pid, _)| *pid);
    let (ready, kept) = sessions.dirs_made_ahead();
    json!({
        "waiting": spares.len(),
        "plot_spare_waiting": plot_spare_pid.is_some(),
        "plot_spare_pid": plot_spare_pid,
        "pool_size": sessions.settings().pool_size,
        "plot_spare": sessions.plot_spare_kept(),
        "dirs_made_ahead": {"ready": ready, "kept": kept},
        "private_bytes": private,
        "not_counted_in": "max_sessions (IRONCELL_POOL_SIZE sets how many plain spares, 0 disables the pool; IRONCELL_PLOT_SPARE one more, with a first plot's pages written)",
    })
}

/// A process's unique set size: its private clean and dirty pages.
fn private_bytes(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kib: u64 = text
        .lines()
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum();
    Some(kib * 1024)
}
