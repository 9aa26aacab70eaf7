"""The in-sandbox `mcp` module's pure logic, in plain CPython: no host, no sandbox, no worker.

The module is loaded from python/mcp/__init__.py under another name (the test harness's own
`mcp` is the official SDK), and its native bridge (`_ironcell_bridge`, the Rust half) is
replaced by a stand-in that answers with the payloads the host sends. Runs under pytest or
`python3 -m unittest tests/unit/test_mcp_module.py`, with any CPython ironcell supports.
"""

import asyncio
import importlib.util
import json
import pathlib
import sys
import types
import unittest

MODULE = pathlib.Path(__file__).resolve().parents[2] / "python" / "mcp" / "__init__.py"


def load_module():
    spec = importlib.util.spec_from_file_location("ironcell_mcp_under_test", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mcp = load_module()


class FakeBridge(types.ModuleType):
    """`_ironcell_bridge` answering each request with the next payload from `answers`."""

    def __init__(self, answers):
        super().__init__("_ironcell_bridge")
        self.answers = list(answers)
        self.sent = []

    def request(self, method, params_json):
        self.sent.append((method, json.loads(params_json)))
        return json.dumps(self.answers.pop(0))

    def submit(self, method, params_json, callback):
        callback(self.request(method, params_json))


class WithBridge(unittest.TestCase):
    def bridge(self, *answers):
        fake = FakeBridge(answers)
        previous = sys.modules.get("_ironcell_bridge")
        sys.modules["_ironcell_bridge"] = fake
        self.addCleanup(lambda: sys.modules.pop("_ironcell_bridge") if previous is None
                        else sys.modules.__setitem__("_ironcell_bridge", previous))
        return fake


class Identifiers(unittest.TestCase):
    def test_names_become_python_identifiers(self):
        cases = {"github": "github", "my-server": "my_server", "a.b": "a_b", "2fa": "_2fa",
                 "class": "class_", "": "_", "ключ": "ключ"}
        for name, want in cases.items():
            self.assertEqual(mcp.identifier(name), want, name)
            self.assertTrue(mcp.identifier(name).isidentifier(), name)


class ErrorAnswers(WithBridge):
    """Each error kind the host sends raises its exception class, with the host's message."""

    def test_each_kind_raises_its_class(self):
        for kind, cls in [("unknown_server", mcp.ServerNotFoundError),
                          ("unknown_tool", mcp.ToolNotFoundError),
                          ("unavailable", mcp.ServerUnavailableError),
                          ("bad_request", ValueError), ("denied", mcp.ToolError),
                          ("declined", mcp.ToolError), ("refused", mcp.ToolError)]:
            self.bridge({"error": {"kind": kind, "message": f"why {kind}"}})
            with self.assertRaises(cls) as caught:
                mcp._request_sync("servers", {})
            self.assertEqual(str(caught.exception), f"why {kind}")
            self.assertIsInstance(caught.exception, mcp.MCPError)

    def test_an_unknown_kind_is_still_an_mcp_error(self):
        self.bridge({"error": {"kind": "from_the_future", "message": "m"}})
        with self.assertRaises(mcp.MCPError):
            mcp._request_sync("servers", {})

    def test_the_async_request_settles_on_the_loop(self):
        fake = self.bridge({"result": {"n": 1}}, {"error": {"kind": "unknown_tool", "message": "no"}})

        async def both():
            ok = await mcp._request_async("tools", {"server": "s"})
            with self.assertRaises(mcp.ToolNotFoundError):
                await mcp._request_async("tools", {"server": "s", "tool": "t"})
            return ok

        self.assertEqual(asyncio.run(both()), {"n": 1})
        self.assertEqual(fake.sent, [("tools", {"server": "s"}), ("tools", {"server": "s", "tool": "t"})])


class Results(unittest.TestCase):
    """`_unwrap`'s rules, as MANUAL.md's "Results" states them."""

    def text(self, *texts, **extra):
        return {"content": [{"type": "text", "text": t} for t in texts], **extra}

    def test_raw_is_untouched(self):
        r = self.text("x", isError=True)
        self.assertIs(mcp._unwrap(r, raw=True), r)

    def test_an_error_result_raises_tool_error_with_its_text_and_result(self):
        r = self.text("bad", "", "worse", isError=True)
        with self.assertRaises(mcp.ToolError) as caught:
            mcp._unwrap(r, raw=False)
        self.assertEqual(str(caught.exception), "bad; worse")
        self.assertIs(caught.exception.result, r)

    def test_structured_content_wins_unless_it_mirrors_the_only_text(self):
        self.assertEqual(mcp._unwrap(self.text("t", structuredContent={"a": 1, "b": 2}), False), {"a": 1, "b": 2})
        self.assertEqual(mcp._unwrap(self.text("t", structuredContent={"content": "t"}), False), "t")
        self.assertEqual(mcp._unwrap(self.text("t", structuredContent=[1]), False), [1])

    def test_one_text_block_is_parsed_as_json_when_it_is_json(self):
        got = mcp._unwrap(self.text('{"title": "x", "tags": [{"n": 1}]}'), False)
        self.assertEqual(got.title, "x")
        self.assertEqual(got.tags[0].n, 1)
        self.assertEqual(mcp._unwrap(self.text("plain words"), False), "plain words")

    def test_anything_else_is_the_list_of_blocks(self):
        r = self.text("a", "b")
        self.assertEqual(mcp._unwrap(r, False), r["content"])

    def test_a_record_names_its_fields_when_one_is_missing(self):
        with self.assertRaises(AttributeError) as caught:
            mcp._records({"a": 1}).b
        self.assertIn("fields: a", str(caught.exception))


class Configure(WithBridge):
    """Servers whose configuration is broken fail at once, by the host's flag, not by wording."""

    def test_a_broken_configuration_makes_the_proxy_fail_naming_why(self):
        mcp._configure([
            {"name": "ok", "description": "fine"},
            {"name": "bad", "description": None, "error": "field `command`: is missing", "config_broken": True},
            {"name": "down", "description": None, "error": "its configuration is fine; it crashed"},
        ])
        with self.assertRaises(mcp.ServerUnavailableError) as caught:
            mcp.mcp_servers["bad"].call_tool_sync("t")
        self.assertIn("field `command`: is missing", str(caught.exception))
        self.assertIn("UNAVAILABLE", repr(mcp.mcp_servers["bad"]))
        # A failed start is asked again (it may work now): the host answers the call.
        fake = self.bridge({"result": {"content": [{"type": "text", "text": "1"}]}})
        self.assertEqual(mcp.mcp_servers["down"].call_tool_sync("t"), 1)
        self.assertEqual(fake.sent[0][0], "call")
        self.assertIs(mcp.mcp_servers["ok"], mcp.mcp_servers[mcp.identifier("ok")])
        with self.assertRaises(mcp.ServerNotFoundError):
            mcp.mcp_servers["nope"]


class ToolSpecs(unittest.TestCase):
    """`@tool` functions become JSON Schemas, and arguments are checked against them."""

    def test_a_typed_function_becomes_a_schema(self):
        def area(width: float, height: float = 1.0, label: str = "") -> float:
            """Area of a rectangle.

            Args:
                width: in metres
            """
            return width * height

        spec = mcp._tool_spec(area)
        schema = spec["inputSchema"]
        self.assertEqual(spec["name"], "area")
        self.assertEqual(schema["required"], ["width"])
        self.assertEqual(schema["properties"]["width"]["type"], "number")
        self.assertEqual(schema["properties"]["label"]["type"], "string")
        self.assertIn("Area of a rectangle", spec["description"])

    def test_an_untyped_parameter_takes_anything_and_star_args_are_refused_by_name(self):
        def f(x):
            return x

        self.assertEqual(mcp._tool_spec(f)["inputSchema"]["properties"], {"x": {}})

        def g(*rows):
            return rows

        with self.assertRaises(mcp.ToolSchemaError) as caught:
            mcp._tool_spec(g)
        self.assertIn("`rows`", str(caught.exception))

    def test_jsonable_turns_python_values_into_json_values(self):
        self.assertEqual(mcp._jsonable({"a": (1, 2), "b": {3}}), {"a": [1, 2], "b": [3]})


if __name__ == "__main__":
    unittest.main()
