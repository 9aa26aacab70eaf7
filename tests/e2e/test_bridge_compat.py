"""Code written for the container-based "code execution mode" bridge runs unchanged.

The usage examples of that bridge's README (elusznik/mcp-server-code-execution-mode, section
"Usage Examples", plus "Execute Code") run verbatim except for server names: against the
reference servers where they offer the tools, and against `servers/bridge_examples_server.py`
(official SDK) for the services no reference server has (search, Drive, Salesforce, Jira,
GitHub, and a file lister answering in the README's shape). The examples from issue 11 (tool
docs as a mapping, `/tmp` files, `read_file` into pandas, figures saved to `/tmp`) run too,
and so does the rest of the compatibility surface: result unwrapping, tracebacks, unavailable
servers, un-awaited coroutines, images, the bridge's environment variables and memory.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from conftest import HARNESS, connect, needs_plotting, run, worker_python_has

pytestmark = pytest.mark.anyio

EXAMPLES_SERVER = Path(__file__).parent / "servers" / "bridge_examples_server.py"
TEST_SERVER = Path(__file__).parent / "servers" / "test_server.py"


@pytest.fixture
def state(tmp_path):
    """A state dir outside /tmp, so sessions get the private /tmp (see test_private_tmp.py)."""
    d = Path(tempfile.mkdtemp(prefix="ironcell-compat-", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config(tmp: Path, *, fs_root: Path | None = None, extra: dict | None = None) -> str:
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    servers = {k: base[k] for k in ("everything", "memory", "time")}
    servers["memory"] = dict(servers["memory"], env={"MEMORY_FILE_PATH": str(tmp / "memory.jsonl")})
    fs = base["filesystem"]
    servers["filesystem"] = dict(fs, args=[*fs["args"][:-1], str(fs_root or fs["args"][-1])])
    stand_in = {"command": sys.executable, "args": [str(EXAMPLES_SERVER), "--log", str(tmp / "calls.jsonl")]}
    for name in ("search", "github", "google_drive", "salesforce", "jira", "files"):
        servers[name] = dict(stand_in, description=f"stand-in for the README's {name}")
    servers.update(extra or {})
    path = tmp / "servers.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return str(path)


def calls(tmp: Path) -> list[dict]:
    p = tmp / "calls.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def ok(r):
    assert not r.is_error, r.text
    return r


# ---------------------------------------------------------------------------------------------
# The README's examples, verbatim except for server names
# ---------------------------------------------------------------------------------------------

async def test_readme_execute_code(state, tmp_path):
    # Its filesystem server serves /tmp (the README's own example config), and the file exists.
    test_txt = Path("/tmp/test.txt")
    created = not test_txt.exists()
    if created:
        test_txt.write_text("hello from the host's /tmp")
    try:
        async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path, fs_root=Path("/tmp"))) as s:
            r = ok(await run(s, textwrap.dedent("""\
                # Use MCP tools in sandboxed code
                result = await mcp_filesystem.read_file(path='/tmp/test.txt')

                # Complex workflows
                data = await mcp_search.search(query="TODO")
                await mcp_github.create_issue(repo='owner/repo', title=data.title)
                """)))
            r = ok(await run(s, "result"))
            assert ast.literal_eval(r["result"]) == test_txt.read_text()
    finally:
        if created:
            test_txt.unlink()
    made = [c for c in calls(tmp_path) if c["tool"] == "create_issue"]
    assert made == [{"tool": "create_issue", "args": {"repo": "owner/repo", "title": "3 notes mention TODO", "body": ""}}]


async def test_readme_file_processing(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        r = ok(await run(s, textwrap.dedent("""\
            # List and filter files
            files = await mcp_files.list_directory(path='/tmp')

            for file in files:
                content = await mcp_files.read_file(path=file)
                if 'TODO' in content:
                    print(f"TODO in {file}")
            """)))
        assert r["stdout"] == "TODO in /tmp/todo.txt\n"


async def test_readme_data_pipeline(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        ok(await run(s, textwrap.dedent("""\
            # Extract data
            transcript = await mcp_google_drive.get_document(documentId='abc123')

            # Process
            summary = transcript[:500] + "..."

            # Store
            await mcp_salesforce.update_record(
                objectType='SalesMeeting',
                recordId='00Q5f000001abcXYZ',
                data={'Notes': summary}
            )
            """)))
    update = [c for c in calls(tmp_path) if c["tool"] == "update_record"][0]["args"]
    assert update["recordId"] == "00Q5f000001abcXYZ"
    assert update["data"]["Notes"].startswith("Meeting transcript.") and len(update["data"]["Notes"]) == 503


async def test_readme_multi_system_workflow(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        ok(await run(s, textwrap.dedent("""\
            # Jira → GitHub migration
            issues = await mcp_jira.search_issues(project='API', status='Open')

            for issue in issues:
                details = await mcp_jira.get_issue(id=issue.id)

                if 'bug' in details.description.lower():
                    await mcp_github.create_issue(
                        repo='owner/repo',
                        title=f"Bug: {issue.title}",
                        body=details.description
                    )
            """)))
    made = [c["args"] for c in calls(tmp_path) if c["tool"] == "create_issue"]
    assert made == [{"repo": "owner/repo", "title": "Bug: Crash on empty body", "body": "A bug: the server crashes."}]


async def test_readme_inspect_available_servers(state, tmp_path):
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    only_reference = tmp_path / "ref.json"
    only_reference.write_text(json.dumps({"mcpServers": {k: base[k] for k in ("everything", "time")}}))
    async with connect(state, MCP_BRIDGE_CONFIG=str(only_reference)) as s:
        r = ok(await run(s, textwrap.dedent("""\
            from mcp import runtime

            print("Discovered:", runtime.discovered_servers())
            print("Cached servers:", runtime.list_servers_sync())
            print("Loaded metadata:", runtime.list_loaded_server_metadata())
            print("Selectable via RPC:", await runtime.list_servers())

            # Peek at tool docs for a server that's already loaded in this run
            loaded = runtime.list_loaded_server_metadata()
            if loaded:
              first = runtime.describe_server(loaded[0]["name"])
              for tool in first["tools"]:
                print(tool["alias"], "→", tool.get("description", ""))

            # Ask for summaries or full schemas only when needed
            if loaded:
              summaries = await runtime.query_tool_docs(loaded[0]["name"])
              detailed = await runtime.query_tool_docs(
                loaded[0]["name"],
                tool=summaries[0]["toolAlias"],
                detail="full",
              )
              print("Summaries:", summaries)
              print("Cached tools:", runtime.list_tools_sync(loaded[0]["name"]))
              print("Detailed doc:", detailed)

            # Fuzzy search across loaded servers without rehydrating every schema
            results = await runtime.search_tool_docs("calendar events", limit=3)
            for result in results:
              print(result["server"], result["tool"], result.get("description", ""))

            # Synchronous helpers for quick answers without extra awaits
            print("Capability summary:", runtime.capability_summary())
            print("Docs from cache:", runtime.query_tool_docs_sync(loaded[0]["name"]) if loaded else [])
            print("Search from cache:", runtime.search_tool_docs_sync("calendar"))
            """)))
        out = r["stdout"]
        if r["stdout_truncated"]:  # the schemas it prints are long: read the whole output
            out = (await s.read_resource(r["stdout_truncated"]["uri"])).contents[0].text
        assert "Discovered: ('everything', 'time')" in out, out
        assert "Selectable via RPC: ('everything', 'time')" in out
        assert "get_sum → " in out and "'toolAlias': 'get_sum'" in out and "'inputSchema'" in out
        assert "Capability summary: MCP servers available" in out
        assert "coroutine" not in r["stderr"], r["stderr"]


# ---------------------------------------------------------------------------------------------
# The examples of issue 11
# ---------------------------------------------------------------------------------------------

async def test_tool_docs_are_a_list_and_a_mapping_with_the_bridges_key_names(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        r = ok(await run(s, textwrap.dedent("""\
            docs = await runtime.query_tool_docs("memory")
            for name, schema in docs.items():
                print(name, "|", schema["description"][:20], "|", sorted(schema["inputSchema"].get("properties", {})))
            (len(docs), [d["tool"] for d in docs][:2], list(docs.keys())[:2],
             docs["create_entities"]["inputSchema"]["type"], "create_entities" in docs, docs[0]["serverAlias"])
            """)))
        n, as_list, keys, schema_type, contained, alias = ast.literal_eval(r["result"])
        assert n >= 5 and as_list == keys and schema_type == "object" and contained and alias == "memory"
        assert "create_entities | " in r["stdout"] and "['entities']" in r["stdout"]
        r = ok(await run(s, "await runtime.query_tool_docs('everything', tool='get-sum', detail='full')"))
        doc = ast.literal_eval(r["result"])
        assert doc["tool"] == "get-sum" and doc["toolAlias"] == "get_sum" and "inputSchema" in doc
        assert "input_schema" not in doc


async def test_tmp_files_and_a_tool_catalog_written_there_are_session_files(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        r = ok(await run(s, textwrap.dedent("""\
            import json
            catalog = {}
            for server in await runtime.discovered_servers():
                catalog[server] = [t["tool"] for t in await runtime.query_tool_docs(server)]
            with open("/tmp/tool_catalog.json", "w") as f:
                json.dump(catalog, f)
            sorted(json.load(open("/tmp/tool_catalog.json")))
            """), session="catalog", timeout_s=120))
        assert "everything" in ast.literal_eval(r["result"])
        assert any(f["path"] == "tool_catalog.json" for f in r["files"]), r["files"]
        assert not Path("/tmp/tool_catalog.json").exists()


@pytest.mark.skipif(not worker_python_has("pandas"), reason="needs python3-pandas for the embedded Python")
async def test_read_file_gives_text_that_pandas_reads(state, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "sales.csv").write_text("region,amount\nnorth,3\nsouth,4\n")
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path, fs_root=data)) as s:
        r = ok(await run(s, textwrap.dedent(f"""\
            import pandas as pd
            from io import StringIO
            csv = await mcp_filesystem.read_file(path={str(data / 'sales.csv')!r})
            df = pd.read_csv(StringIO(csv))
            int(df["amount"].sum())
            """)))
        assert r["result"] == "7"
        # raw=True: the whole result, structuredContent and all.
        r = ok(await run(s, f"await mcp_filesystem.read_file(path={str(data / 'sales.csv')!r}, raw=True)"))
        raw = ast.literal_eval(r["result"].replace("false", "False").replace("true", "True"))
        assert raw["content"][0]["text"].startswith("region,amount") and "structuredContent" in raw


@needs_plotting
async def test_a_figure_saved_to_tmp_and_left_open_comes_back_once(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        r = ok(await run(s, textwrap.dedent("""\
            import matplotlib.pyplot as plt
            plt.plot([1, 2, 3], [3, 1, 2])
            plt.savefig("/tmp/chart.png")
            """), session="plots"))
        assert [i["path"] for i in r["images"]] == ["chart.png"], r["images"]
        # The next run writes nothing: no image comes back again, however soon it runs.
        r = ok(await run(s, "1 + 1", session="plots"))
        assert r.record.get("images", []) == []
        # A new image in a later run comes back, alone.
        r = ok(await run(s, "plt.plot([1]); plt.savefig('second.png'); plt.close('all')", session="plots"))
        assert [i["path"] for i in r["images"]] == ["second.png"]


# ---------------------------------------------------------------------------------------------
# The rest of the compatibility surface
# ---------------------------------------------------------------------------------------------

async def test_unwrapping_rules_of_the_manual(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path, extra={
            "test-server": {"command": sys.executable, "args": [str(TEST_SERVER)]}})) as s:
        r = ok(await run(s, textwrap.dedent("""\
            a = await mcp_test_server.get_env(name="PATH")              # {"result": text} + that text
            b = await mcp_test_server.structured(n=3)                   # a real object
            c = await mcp_test_server.pid()                             # {"result": 12} + "12": not text
            d = await mcp_jira.search_issues(project="API", status="Open")   # JSON text only
            e = await mcp_everything.echo(message="hi")                 # plain text
            (type(a).__name__, b, b.square, type(c).__name__, d[0].id, e)
            """)))
        a, b, square, c, first_id, e = ast.literal_eval(r["result"])
        assert a == "str" and b == {"n": 3, "square": 9} and square == 9
        assert c == "Record" and first_id == "API-1" and e == "Echo: hi"


async def test_tracebacks_show_the_cells_frames_and_no_asyncio_internals(state, tmp_path):
    async with connect(state) as s:
        r = await run(s, textwrap.dedent("""\
            import json
            async def parse(text):
                return json.loads(text)
            await parse("{not json")
            """))
        tb = r["error"]["traceback"]
        assert r["error"]["type"] == "JSONDecodeError"
        assert 'File "<cell>", line 4' in tb and 'File "<cell>", line 3, in parse' in tb, tb
        assert "json/decoder.py" in tb  # library frames below the cell's stay
        for noise in ("base_events.py", "run_until_complete", "_ironcell_runner", "asyncio/"):
            assert noise not in tb, tb
        r = await run(s, "import asyncio\nasync def boom():\n    raise KeyError('k')\nawait asyncio.gather(boom())")
        tb = r["error"]["traceback"]
        assert "in boom" in tb and "asyncio/" not in tb and "base_events" not in tb, tb


async def test_unavailable_servers_are_named_with_the_reason(state, tmp_path):
    base = json.loads((HARNESS / "proxied_servers.json").read_text())["mcpServers"]
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"mcpServers": {
        "everything": base["everything"],
        "broken": {"args": ["x"]},
        "hangs": {"command": sys.executable, "args": [str(TEST_SERVER), "--hang-at-start"]},
    }}))
    async with connect(state, MCP_BRIDGE_CONFIG=str(cfg), MCP_BRIDGE_STARTUP_TIMEOUT="8s") as s:
        ok(await run(s, "await mcp_everything.get_sum(a=1, b=1)", timeout_s=60))  # started
        r = ok(await run(s, textwrap.dedent("""\
            import mcp
            hits = await runtime.search_tool_docs("sum of two numbers")
            detailed = {d["name"]: d for d in runtime.discovered_servers(detailed=True)}
            try:
                mcp_broken.do_something_sync()
                broken = "no error"
            except mcp.ServerUnavailableError as e:
                broken = str(e)
            (hits[0]["tool"], sorted(hits.unavailable), detailed["broken"]["available"],
             detailed["hangs"].get("error", ""), "broken" in runtime.discovered_servers(), broken)
            """), timeout_s=60))
        top, unavailable, broken_available, hangs_error, listed, broken = ast.literal_eval(r["result"])
        assert top == "get-sum" and unavailable == ["broken", "hangs"]
        assert not broken_available and "did not finish starting within 8 s" in hangs_error
        assert not listed
        assert "field `command`: is missing" in broken, broken
        # The model reads the run's output, not ironcell's log: the reasons are there.
        assert "MCP server 'hangs' is unavailable" in r["stderr"] and "'broken' is unavailable" in r["stderr"]


async def test_a_forgotten_await_warns_in_the_cell_that_made_it(state, tmp_path):
    async with connect(state, MCP_BRIDGE_CONFIG=config(tmp_path)) as s:
        for code in ("mcp_everything.get_sum(a=1, b=2)",
                     "r = mcp_everything.get_sum(a=1, b=2)",
                     "mcp_everything.get_sum(a=1, b=2)\nx = 1"):
            r = ok(await run(s, code, session="forgot"))
            assert "was never awaited" in r["stderr"], (code, r)
            r = ok(await run(s, "r = None\n2", session="forgot"))
            assert "never awaited" not in r["stderr"], (code, r)


async def test_the_bridges_container_variables_are_ignored_and_reported(state, tmp_path):
    env = {"MCP_BRIDGE_RUNTIME": "podman", "MCP_BRIDGE_IMAGE": "python:3.14-slim",
           "MCP_BRIDGE_PIDS": "128", "MCP_BRIDGE_CPUS": "2.0", "MCP_BRIDGE_CONTAINER_USER": "65534:65534",
           "MCP_BRIDGE_RUNTIME_IDLE_TIMEOUT": "300"}
    async with connect(state, **env) as s:
        ok(await run(s, "1"))
        info = json.loads((await s.read_resource("system://info")).contents[0].text)
    assert set(info["not_applicable"]) == set(env), info["not_applicable"]
    assert "ignored" in info["not_applicable"]["MCP_BRIDGE_PIDS"]
    log = (state / "server.log").read_text()
    for name in env:
        assert log.count(f"{name}=") == 1, (name, log)


async def test_memory_outlives_sessions_and_restarts_and_stays_with_the_host(state, tmp_path):
    async with connect(state) as s:
        r = ok(await run(s, textwrap.dedent("""\
            saved = save_memory("project_context", {"goal": "Build API", "progress": ["Step 1"]})
            save_memory("../../escape", 1, metadata={"tags": ["x"]})
            (saved, runtime.load_memory("project_context")["goal"])
            """), session="a"))
        assert ast.literal_eval(r["result"]) == ("Memory 'project_context' saved.", "Build API")
        r = ok(await run(s, "(load_memory('project_context'), load_memory('nope', 'default'), "
                            "update_memory('counter', lambda v: (v or 0) + 1), memory_exists('counter'))", session="b"))
        assert ast.literal_eval(r["result"]) == ({"goal": "Build API", "progress": ["Step 1"]}, "default", 1, True)
        r = ok(await run(s, textwrap.dedent("""\
            errors = []
            for bad in ["x" * 101, "a\\nb"]:
                try:
                    save_memory(bad, 1)
                except ValueError as e:
                    errors.append(str(e))
            try:
                save_memory("big", "x" * (2 << 20))
            except ValueError as e:
                errors.append(str(e))
            errors
            """), session="b"))
        errors = ast.literal_eval(r["result"])
        assert len(errors) == 3 and "100 bytes" in errors[0] and "limit" in errors[2], errors
    files = sorted(p.name for p in (state / "memory").iterdir())
    assert all(set(f[:-5]) <= set("0123456789abcdef") and f.endswith(".json") for f in files), files
    assert not (state.parent / "escape").exists()
    # A new server (a restart) with the same state dir still has them; the worker cannot reach
    # the files themselves.
    async with connect(state) as s:
        r = ok(await run(s, "(load_memory('project_context')['goal'], [m['key'] for m in list_memories()], "
                            "delete_memory('counter'), memory_exists('counter'))"))
        goal, keys, deleted, exists = ast.literal_eval(r["result"])
        assert goal == "Build API" and sorted(keys) == ["../../escape", "counter", "project_context"]
        assert deleted == "Memory 'counter' deleted." and exists is False
        r = await run(s, f"open({str(state / 'memory' / files[0])!r}).read()")
        assert r["error"]["type"] == "PermissionError", r
