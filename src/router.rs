//! The router: the host's one road for a worker's bridge requests.
//!
//! A session's cell loop parses each `request` frame once, at the edge, into an
//! [`ironcell_core::bridge::Request`], and hands it here with who asked ([`Caller`]: known to
//! the host, never taken from the frame). The router gives it to the code for its kind — the
//! proxy, the memory store, the local tools, the change tracker, the package store — and
//! returns a typed answer.
//! Sessions reach it through the [`Requests`] trait; nothing the router owns knows sessions
//! (`session.fork` goes back to the session manager through the [`Forks`] it was given).
//!
//! Threat note: the worker is the attacker. A request holds the worker's budget for its
//! parameters ([`Caller::room`]) until they are freed, waits for blocking work in its own task
//! (never in the blocking pool), and ends with its worker — except a local tool's run, which is
//! cancelled through [`Caller::gone`] and ends by itself (its session is never left mid-cell).

use std::sync::{Arc, OnceLock, Weak};

use futures::future::BoxFuture;
use ironcell_core::bridge::{BridgeError, MemoryRequest, Request, ToolsRequest};
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::files::ChangeTracker;
use crate::local_tools::LocalTools;
use crate::memory::MemoryStore;
use crate::packages::{Packages, View};
use crate::proxy::{CallSink, Proxy};

/// Memory requests the host serves on blocking threads at once (the store has one lock anyway).
const BLOCKING_REQUESTS_AT_ONCE: usize = 2;
/// `files.changed` requests waiting on a blocking thread for the change tracker at once: its own
/// count, so sessions whose listings keep the tracker busy never hold up others' memory requests.
const TRACKER_WAITS_AT_ONCE: usize = 1;
/// At most this many changed names go back to a worker asking which files its run changed
/// (`files.changed`); past it the worker searches its directory itself.
const CHANGED_FILES_HINT_LIMIT: usize = 2_000;

/// Who sent a request, as the host knows it, and what it may hold while it is answered.
pub struct Caller {
    /// The session whose worker asks.
    pub session: String,
    /// Where the summaries of its proxied calls go (its run's record).
    pub sink: CallSink,
    /// Fires when the host lets go of the worker.
    pub gone: CancellationToken,
    /// The worker's turn for local-tools requests (one at a time).
    pub tools_turn: Arc<Semaphore>,
    /// The worker's turn for requests doing blocking work (one at a time, held until written).
    pub blocking_turn: Arc<Semaphore>,
    /// The worker's budget for the request's parameters: held until they are freed.
    pub room: Box<dyn Send>,
    /// The worker's read-only view of the session's installed packages (`%pip install`).
    pub packages_view: Option<Arc<View>>,
    /// The session's directory (`files.set_times` acts beneath it).
    pub scratch: std::path::PathBuf,
    /// The Landlock layers its worker holds where it may fork (it was given a forks area);
    /// `None`: it cannot fork.
    pub fork_layers: Option<u32>,
}

/// A request's typed answer, and the worker's turn to hold until it is written to the socket.
pub struct Answer {
    pub result: Result<Value, BridgeError>,
    pub turn: Option<OwnedSemaphorePermit>,
}

/// What a session's cell loop needs of the router.
pub trait Requests: Send + Sync {
    /// The answer when it is at hand without a task (the change tracker's names when nobody
    /// else holds it); `None` when the request needs [`Requests::answer`].
    fn answer_now(&self, session: &str, request: &Request) -> Option<Result<Value, BridgeError>>;

    /// Answers `request`. `None` when the worker went first: there is nothing to send.
    fn answer(&self, caller: Caller, request: Request) -> BoxFuture<'static, Option<Answer>>;
}

/// What `session.fork` needs of the sessions (the session manager): the fork queued for the
/// end of the caller's run, after every check that can be made before it, or why not.
pub trait Forks: Send + Sync {
    fn queue_fork(
        self: Arc<Self>,
        session: String,
        name: String,
        fork_layers: Option<u32>,
    ) -> BoxFuture<'static, Result<Value, BridgeError>>;
}

/// Owns what worker requests reach: the proxy, the memory store, the local tools, the change
/// tracker and the package store.
pub struct Router {
    proxy: Arc<Proxy>,
    memory: Arc<MemoryStore>,
    /// `%pip install`: the package store, each session's installs, the workers' views.
    packages: Arc<Packages>,
    /// Set once by the server (none under `ironcell exec`).
    local_tools: OnceLock<Arc<LocalTools>>,
    changes: Arc<ChangeTracker>,
    /// Memory requests doing blocking work at once, host-wide.
    blocking_requests: Arc<Semaphore>,
    /// `files.changed` requests waiting for the change tracker at once, host-wide.
    tracker_waits: Arc<Semaphore>,
    /// The sessions, for `session.fork` (weak: they own the router).
    forks: OnceLock<Weak<dyn Forks>>,
}

impl Router {
    pub fn new(
        proxy: Arc<Proxy>,
        memory: Arc<MemoryStore>,
        packages: Arc<Packages>,
        changes: Arc<ChangeTracker>,
    ) -> Self {
        Router {
            proxy,
            memory,
            packages,
            local_tools: OnceLock::new(),
            changes,
            blocking_requests: Arc::new(Semaphore::new(BLOCKING_REQUESTS_AT_ONCE)),
            tracker_waits: Arc::new(Semaphore::new(TRACKER_WAITS_AT_ONCE)),
            forks: OnceLock::new(),
        }
    }

    /// Sets where `session.fork` goes (the first set wins).
    pub fn set_forks(&self, forks: Weak<dyn Forks>) {
        let _ = self.forks.set(forks);
    }

    /// Sets the local tools (the first set wins).
    pub fn set_local_tools(&self, tools: Arc<LocalTools>) {
        let _ = self.local_tools.set(tools);
    }

    pub fn local_tools(&self) -> Option<&Arc<LocalTools>> {
        self.local_tools.get()
    }

    /// Memory file I/O, off the async runtime, within the worker's and the host's turns.
    async fn memory(
        memory: Arc<MemoryStore>,
        turns: Turns,
        request: MemoryRequest,
        room: Box<dyn Send>,
    ) -> Option<Answer> {
        let (mine, io) = turns.take().await?;
        let result = tokio::task::spawn_blocking(move || {
            // Counted in the worker's budget until the parameters are freed.
            let _held = (io, room);
            memory.handle(request)
        })
        .await
        .unwrap_or_else(|e| Err(BridgeError::unavailable(e.to_string())));
        Some(Answer {
            result,
            turn: Some(mine),
        })
    }

    /// The session's changed names, from the host's own watches (nothing is opened here).
    async fn changed_files(
        changes: Arc<ChangeTracker>,
        turns: Turns,
        session: String,
    ) -> Option<Answer> {
        let limit = CHANGED_FILES_HINT_LIMIT;
        let (pending, turn) = match changes.try_pending(&session, limit) {
            Ok(pending) => (pending, None),
            // Another session's listing holds the tracker: wait off the runtime.
            Err(()) => {
                let (mine, io) = turns.take().await?;
                let pending = tokio::task::spawn_blocking(move || {
                    let _io = io;
                    changes.pending(&session, limit)
                })
                .await
                .ok()
                .flatten();
                (pending, Some(mine))
            }
        };
        Some(Answer {
            result: Ok(changed_files_answer(pending)),
            turn,
        })
    }
}

impl Requests for Router {
    fn answer_now(&self, session: &str, request: &Request) -> Option<Result<Value, BridgeError>> {
        // The worker's image search asks this after every run in a session of many
        // directories: answered from the tracker's events when they are at hand, without a
        // task of its own (a spawn and a wake-up less on the run's path).
        match request {
            Request::ChangedFiles => self
                .changes
                .try_pending(session, CHANGED_FILES_HINT_LIMIT)
                .ok()
                .map(|pending| Ok(changed_files_answer(pending))),
            _ => None,
        }
    }

    /// Long on purpose: one short arm per request kind (the bridge contract's `Request`), each
    /// with the turns and room it holds.
    fn answer(&self, caller: Caller, request: Request) -> BoxFuture<'static, Option<Answer>> {
        let Caller {
            session,
            sink,
            gone,
            tools_turn,
            blocking_turn,
            room,
            packages_view,
            scratch,
            fork_layers,
        } = caller;
        let turns = |host: &Arc<Semaphore>| Turns {
            worker: blocking_turn.clone(),
            host: host.clone(),
            gone: gone.clone(),
        };
        let answered = |result| Some(Answer { result, turn: None });
        let work: BoxFuture<'static, Option<Answer>> = match request {
            Request::Memory(request) => Box::pin(Self::memory(
                self.memory.clone(),
                turns(&self.blocking_requests),
                request,
                room,
            )),
            Request::SetTimes {
                path,
                atime_ns,
                mtime_ns,
            } => {
                let turns = turns(&self.blocking_requests);
                Box::pin(async move {
                    let (mine, io) = turns.take().await?;
                    let result = tokio::task::spawn_blocking(move || {
                        let _held = (io, room);
                        set_times(&scratch, &path, atime_ns, mtime_ns)
                    })
                    .await
                    .unwrap_or_else(|e| Err(BridgeError::unavailable(e.to_string())));
                    Some(Answer {
                        result,
                        turn: Some(mine),
                    })
                })
            }
            Request::Fork { name } => {
                let forks = self.forks.get().and_then(Weak::upgrade);
                Box::pin(async move {
                    let _room = room;
                    let Some(forks) = forks else {
                        return answered(Err(BridgeError::unavailable(
                            "sessions cannot be forked from code here",
                        )));
                    };
                    answered(forks.queue_fork(session, name, fork_layers).await)
                })
            }
            Request::ChangedFiles => Box::pin(Self::changed_files(
                self.changes.clone(),
                turns(&self.tracker_waits),
                session,
            )),
            Request::Proxy(request) => {
                let proxy = self.proxy.clone();
                Box::pin(async move {
                    let _room = room;
                    answered(proxy.handle(&session, request, Some(&sink)).await)
                })
            }
            Request::PackagesInstall(params) => {
                let (packages, proxy) = (self.packages.clone(), self.proxy.clone());
                Box::pin(async move {
                    let _room = room;
                    answered(
                        packages
                            .install(&session, packages_view, &params, &proxy)
                            .await,
                    )
                })
            }
            // Not dropped midway when the worker goes (its session would be left mid-cell):
            // cancelled through `gone`, as a client's cancel would, it ends by itself.
            Request::Tools(request) => {
                let tools = self.local_tools.get().cloned();
                return Box::pin(async move {
                    let _room = room;
                    // Answers from the tools sessions never wait (the runs they answer do).
                    let _turn = match request {
                        ToolsRequest::Answer { .. } => None,
                        _ => tokio::select! {
                            turn = tools_turn.acquire_owned() => turn.ok(),
                            () = gone.cancelled() => return None,
                        },
                    };
                    let result =
                        crate::local_tools::handle_request(tools, session, request, gone).await;
                    answered(result)
                });
            }
        };
        // The worker gone, its request's work (and its parameters) goes too.
        Box::pin(async move {
            tokio::select! {
                () = gone.cancelled() => None,
                answer = work => answer,
            }
        })
    }
}

/// A request's turns for work on a blocking thread (which cannot be dropped once it has
/// started): the worker's own, held until the answer is written to the socket, so a worker that
/// stops reading holds one such answer on the host; and one of the host's turns for that kind
/// of work ([`BLOCKING_REQUESTS_AT_ONCE`] for memory, [`TRACKER_WAITS_AT_ONCE`] for tracker
/// waits).
struct Turns {
    worker: Arc<Semaphore>,
    host: Arc<Semaphore>,
    gone: CancellationToken,
}

impl Turns {
    /// Both turns; `None` when the worker went while the request waited: the waiting happens
    /// here, where it ends with the worker (parameters and all), never in the blocking pool,
    /// whose threads the quota watch, the free-disk guard and file reads need.
    async fn take(self) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        tokio::select! {
            turns = async {
                let mine = self.worker.acquire_owned().await.ok()?;
                Some((mine, self.host.acquire_owned().await.ok()?))
            } => turns,
            () = self.gone.cancelled() => None,
        }
    }
}

/// `files.set_times`: the times of the regular file `rel` beneath the session directory,
/// reached fd-relative without following a symlink at any step; a file with another name
/// elsewhere (more than one link, e.g. a package file linked from the host's store) is refused.
fn set_times(
    scratch: &std::path::Path,
    rel: &str,
    atime_ns: i64,
    mtime_ns: i64,
) -> Result<Value, BridgeError> {
    use nix::fcntl::OFlag;
    use nix::sys::stat::{Mode, fstat};
    use nix::sys::time::TimeSpec;
    let refused =
        |why: String| BridgeError::bad_request(format!("cannot set the times of {rel:?}: {why}"));
    let dir = crate::host_fs::open_session_dir(scratch).map_err(|e| refused(e.to_string()))?;
    let fd = crate::host_fs::open_beneath(
        std::os::fd::AsFd::as_fd(&dir),
        std::path::Path::new(rel),
        OFlag::O_RDONLY | OFlag::O_NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| refused(e.to_string()))?;
    let st = fstat(&fd).map_err(|e| refused(e.to_string()))?;
    if !crate::host_fs::is_regular(&st) {
        return Err(refused("not a regular file".into()));
    }
    if st.st_nlink != 1 {
        return Err(refused("the file has other names (hard links)".into()));
    }
    let ts = |ns: i64| TimeSpec::new(ns.div_euclid(1_000_000_000), ns.rem_euclid(1_000_000_000));
    nix::sys::stat::futimens(&fd, &ts(atime_ns), &ts(mtime_ns))
        .map_err(|e| refused(e.to_string()))?;
    Ok(json!({"ok": true}))
}

/// The answer to `files.changed`: names only, from the host's own watches (nothing is opened),
/// or "not complete" when the tracker cannot vouch for them (the worker then scans itself).
fn changed_files_answer(pending: Option<(Vec<String>, Vec<String>)>) -> Value {
    match pending {
        Some((files, dirs)) => json!({"complete": true, "files": files, "dirs": dirs}),
        None => json!({"complete": false}),
    }
}
