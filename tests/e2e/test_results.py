"""Results people can see: images, files, large output, progress, background jobs, cancel."""

from __future__ import annotations

import base64
import json

import anyio
import pytest

from conftest import RawServer, Run, _field, connect, needs_plotting, run

pytestmark = pytest.mark.anyio


def blocks(r: Run, kind: str) -> list:
    return [c for c in r.raw.content if getattr(c, "type", None) == kind]


async def read_bytes(s, uri: str) -> bytes:
    res = await s.read_resource(uri)
    c = res.contents[0]
    return base64.b64decode(c.blob) if getattr(c, "blob", None) is not None else c.text.encode()


@needs_plotting
async def test_an_open_figure_comes_back_as_an_image_with_a_link_to_the_full_file(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "import matplotlib.pyplot as plt\nplt.plot([1, 4, 2, 8])\nplt.title('trend')\n'plotted'")
        assert r["status"] == "ok", r.text
        images = blocks(r, "image")
        assert len(images) == 1 and _field(images[0], "mime_type", "mimeType") == "image/png"
        png = base64.b64decode(images[0].data)
        assert png.startswith(b"\x89PNG")
        ref = r["images"][0]
        assert ref["inline"] and ref["path"].endswith("figure-1.png")
        links = [c for c in blocks(r, "resource_link") if str(c.uri) == ref["uri"]]
        assert links, r.raw.content
        assert await read_bytes(s, ref["uri"]) == png  # small enough to be inline unchanged
        # The figure was closed: the next run shows no image again.
        assert not blocks(await run(s, "1"), "image")


@needs_plotting
async def test_a_large_image_is_downscaled_to_the_budget_and_the_full_file_is_linked(state_dir):
    async with connect(state_dir, IRONCELL_IMAGE_BUDGET="64k") as s:
        code = "import numpy as np\nfrom PIL import Image\nrng = np.random.default_rng(1)\nImage.fromarray(rng.integers(0, 255, (900, 900, 3), dtype=np.uint8)).save('noise.png')"
        r = await run(s, code)
        ref = r["images"][0]
        assert ref["path"] == "noise.png" and ref["bytes"] > 64 * 1024 and ref["inline"]
        inline = base64.b64decode(blocks(r, "image")[0].data)
        assert len(inline) <= 64 * 1024
        full = await read_bytes(s, ref["uri"])
        assert len(full) == ref["bytes"]


async def test_written_files_are_linked_listed_and_readable_as_resources(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "import os\nos.makedirs('out', exist_ok=True)\nopen('out/report.csv', 'w').write('a,b\\n1,2\\n')\nopen('notes.md', 'w').write('# hi')", session="files")
        paths = {f["path"]: f for f in r["files"]}
        assert set(paths) == {"out/report.csv", "notes.md"}
        assert paths["out/report.csv"]["mime"] == "text/csv"
        assert {str(c.uri) for c in blocks(r, "resource_link")} >= {f["uri"] for f in r["files"]}
        listed = {str(x.uri): x for x in (await s.list_resources()).resources}
        uri = "ironcell://session/files/out/report.csv"
        assert uri in listed and _field(listed[uri], "mime_type", "mimeType") == "text/csv"
        res = await s.read_resource(uri)
        assert res.contents[0].text == "a,b\n1,2\n"


async def test_resource_names_that_escape_the_session_are_refused(state_dir):
    from mcp.shared.exceptions import MCPError as McpError

    async with connect(state_dir) as s:
        await run(s, "import os\nos.symlink('/etc/passwd', 'pw')\nos.symlink('/etc', 'etc')\nopen('ok.txt','w').write('fine')", session="esc")
        assert (await s.read_resource("ironcell://session/esc/ok.txt")).contents[0].text == "fine"
        for uri in ["ironcell://session/esc/../../../etc/passwd", "ironcell://session/esc/pw",
                    "ironcell://session/esc/etc/passwd", "ironcell://session/esc//etc/passwd",
                    "ironcell://session/nosuch/x"]:
            with pytest.raises(McpError):
                await s.read_resource(uri)


async def test_cut_output_links_the_whole_output_as_a_resource(state_dir):
    async with connect(state_dir) as s:
        r = await run(s, "for i in range(50_000):\n    print(i)")
        cut = r["stdout_truncated"]
        assert cut["uri"] in {str(c.uri) for c in blocks(r, "resource_link")}
        whole = (await s.read_resource(cut["uri"])).contents[0].text
        assert whole.splitlines()[-1] == "49999" and len(whole) == cut["total_bytes"]


async def test_progress_notifications_carry_elapsed_time_and_the_newest_output(state_dir):
    async with connect(state_dir) as s:
        seen = []

        async def on_progress(progress, total, message):
            seen.append((progress, message))

        code = "import time\nfor i in range(4):\n    print(f'step {i}')\n    time.sleep(0.8)"
        res = await s.call_tool("run_python", {"code": code}, progress_callback=on_progress)
        assert not Run(res).is_error
        assert len(seen) >= 2, seen
        progresses = [p for p, _ in seen]
        assert progresses == sorted(progresses) and len(set(progresses)) == len(progresses)
        assert any("step" in (m or "") for _, m in seen), seen


async def test_a_run_past_the_wait_budget_becomes_a_job_that_can_be_polled_and_awaited(state_dir):
    async with connect(state_dir, IRONCELL_WAIT_BUDGET="1s") as s:
        r = await run(s, "import time\nprint('working')\ntime.sleep(3)\nprint('done')\n42", timeout_s=30)
        assert not r.is_error and r["status"] == "running", r.text
        job = r["job"]
        assert job in r.text and "run_python_job" in r.text
        busy = await run(s, "1")
        assert busy.is_error and job in busy.text
        await anyio.sleep(0.5)
        polled = Run(await s.call_tool("run_python_job", {"job": job, "action": "poll"}))
        assert polled["status"] == "running" and "working" in polled["recent_output"]
        # Each wait is capped by the budget (1 s): the 3 s run ends within a few, at most 60.
        for _ in range(60):
            done = Run(await s.call_tool("run_python_job", {"job": job, "wait_s": 30}))
            if done["status"] != "running":
                break
        assert done["status"] == "ok" and done["result"] == "42" and done["stdout"] == "working\ndone\n"
        gone = Run(await s.call_tool("run_python_job", {"job": job}))
        assert gone.is_error and "no job" in gone.text
        assert (await run(s, "2 + 2"))["result"] == "4"


async def test_cancelling_a_cpu_bound_job_interrupts_it_and_keeps_the_session(state_dir):
    async with connect(state_dir, IRONCELL_WAIT_BUDGET="1s") as s:
        await run(s, "kept = 'yes'")
        r = await run(s, "while True: pass", timeout_s=120)
        assert r["status"] == "running"
        c = Run(await s.call_tool("run_python_job", {"job": r["job"], "action": "cancel"}))
        assert c["status"] == "cancelled" and c["session_state"] == "kept", c.record
        assert (await run(s, "kept"))["result"] == "'yes'"


def test_two_tools_fit_the_token_budget(state_dir):
    srv = RawServer(state_dir)
    srv.initialize()
    result = srv.request("tools/list", {})["result"]
    srv.close()
    assert [t["name"] for t in result["tools"]] == ["run_python", "run_python_job"]
    size = len(json.dumps(result, separators=(",", ":")))
    # ~300 tokens for the tools, plus each one's title and annotations and run_python's
    # outputSchema (MCP asks for them; see server.rs's budget test).
    assert size / 4 <= 375, size
