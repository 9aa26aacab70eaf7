"""Stand-ins (official Python SDK) for the services the container bridge's README examples call
but no reference server offers: a search service, Google Drive, Salesforce, Jira and GitHub.
Each tool has the name and arguments the README uses and answers the way such servers do
(objects as structured content, lists as JSON text). Every call is appended to the file named
by `--log`, so tests can check what reached the server.

usage: bridge_examples_server.py --log FILE
"""

import json
import sys

from mcp.server import MCPServer

LOG = sys.argv[sys.argv.index("--log") + 1]
server = MCPServer("bridge-examples")


def _log(tool, **args):
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args}) + "\n")


@server.tool()
def search(query: str) -> dict:
    """Searches notes for a phrase; returns the best match."""
    _log("search", query=query)
    return {"title": f"3 notes mention {query}", "matches": 3}


@server.tool()
def create_issue(repo: str, title: str, body: str = "") -> dict:
    """Creates an issue in a repository."""
    _log("create_issue", repo=repo, title=title, body=body)
    return {"number": 7, "repo": repo, "title": title}


@server.tool()
def get_document(documentId: str) -> str:
    """The text of a document."""
    _log("get_document", documentId=documentId)
    return "Meeting transcript. " + "We discussed the roadmap at length. " * 40


@server.tool()
def update_record(objectType: str, recordId: str, data: dict) -> dict:
    """Updates a CRM record."""
    _log("update_record", objectType=objectType, recordId=recordId, data=data)
    return {"success": True, "id": recordId}


ISSUES = [
    {"id": "API-1", "title": "Crash on empty body", "description": "A bug: the server crashes."},
    {"id": "API-2", "title": "Add pagination", "description": "Feature request."},
]


@server.tool(structured_output=False)
def search_issues(project: str, status: str) -> str:
    """Issues of a project with a status, as a JSON list."""
    _log("search_issues", project=project, status=status)
    return json.dumps([{"id": i["id"], "title": i["title"]} for i in ISSUES])


@server.tool()
def get_issue(id: str) -> dict:
    """One issue with its description."""
    _log("get_issue", id=id)
    return next(i for i in ISSUES if i["id"] == id)


@server.tool(structured_output=False)
def list_directory(path: str) -> str:
    """Files in a directory, as a JSON list of paths (the README's shape)."""
    _log("list_directory", path=path)
    return json.dumps([f"{path}/notes.txt", f"{path}/todo.txt"])


@server.tool()
def read_file(path: str) -> str:
    """A file's text."""
    _log("read_file", path=path)
    return "TODO: write tests" if path.endswith("todo.txt") else "nothing to do"


if __name__ == "__main__":
    server.run()
