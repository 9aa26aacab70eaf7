#!/usr/bin/env python3
"""A census of real PyPI packages: the same snippets outside the sandbox and inside ironcell.

usage: scripts/census.py [--binary target/release/ironcell] [--venv DIR] [--only NAME,...] [--markdown]

Each snippet does real work with one package (or one kind of parallelism) and ends by setting
`result` to a small, deterministic value. It runs twice in the census venv's interpreter:
outside, as `python -c` in a fresh directory, and inside, as a cell of a fresh ironcell session
started with `--python` that venv. The table says what each gave and where they differ.

The venv (PyPI wheels, pinned) is made by scripts/install_test_peers.sh at
$IRONCELL_CENSUS_VENV, by default /var/tmp/ironcell-census/venv: outside every home directory,
so `nobody` can use it too (tests/e2e/test_census.py runs the census as root and as nobody).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CENSUS_VENV = Path(os.environ.get("IRONCELL_CENSUS_VENV", "/var/tmp/ironcell-census/venv"))

# name -> code. Each ends with `result = ...` (compared inside against outside).
SNIPPETS: dict[str, str] = {
    "numpy": """
import numpy as np
a = np.random.default_rng(0).random((400, 400))
inv = np.linalg.inv(a @ a.T + 400 * np.eye(400))
result = (round(float(np.trace(inv @ (a @ a.T + 400 * np.eye(400)))), 6),
          float(np.fft.fft(np.ones(8)).real[0]), int(np.sort(np.arange(10)[::-1])[3]))
""",
    "pandas": """
import pandas as pd
df = pd.DataFrame({'g': [i % 4 for i in range(1000)], 'x': range(1000),
                   'd': pd.date_range('2024-01-01', periods=1000, freq='h')})
df.to_csv('df.csv', index=False)
back = pd.read_csv('df.csv', parse_dates=['d'])
m = back.groupby('g', as_index=False)['x'].sum().merge(pd.DataFrame({'g': range(4), 'n': list('abcd')}))
result = (m['x'].tolist(), m['n'].tolist(), str(back['d'].dt.day.max()),
          int(back.resample('D', on='d')['x'].count().iloc[0]))
""",
    "polars_eager": """
import polars as pl
df = pl.DataFrame({'g': [i % 3 for i in range(3000)], 'x': list(range(3000))})
result = df.group_by('g').agg(pl.col('x').sum()).sort('g')['x'].to_list()
""",
    "polars_lazy": """
import polars as pl
pl.DataFrame({'a': list(range(1000)), 'b': [i % 7 for i in range(1000)]}).write_csv('pl.csv')
result = (pl.scan_csv('pl.csv').filter(pl.col('b') == 3).select(pl.col('a').sum()).collect().item(),
          pl.read_csv('pl.csv').height)
""",
    "polars_streaming": """
import polars as pl
pl.DataFrame({'a': list(range(100000)), 'b': [i % 10 for i in range(100000)]}).write_parquet('pl.parquet')
q = pl.scan_parquet('pl.parquet').group_by('b').agg(pl.col('a').max()).sort('b')
result = q.collect(engine='streaming')['a'].to_list()[:3]
""",
    "duckdb_memory": """
import duckdb
result = duckdb.sql('select sum(i), count(*) from range(1000000) t(i)').fetchall()
""",
    "duckdb_file": """
import duckdb
con = duckdb.connect('census.duckdb')
con.execute('create or replace table t as select i, i % 5 as g from range(10000) t(i)')
rows = con.execute('select g, count(*) from t group by g order by g').fetchall()
con.close()
result = rows
""",
    "pyarrow_parquet": """
import pyarrow as pa, pyarrow.parquet as pq, pyarrow.compute as pc
t = pa.table({'a': list(range(1000)), 's': [str(i % 9) for i in range(1000)]})
pq.write_table(t, 't.parquet', compression='zstd')
back = pq.read_table('t.parquet')
import pandas as pd
pd.DataFrame({'x': [1.5, 2.5]}).to_parquet('p.parquet')
result = (back.num_rows, pc.sum(back['a']).as_py(), pd.read_parquet('p.parquet')['x'].sum())
""",
    "scikit_learn": """
from sklearn.datasets import make_classification
from sklearn.ensemble import RandomForestClassifier
from sklearn.model_selection import cross_val_score
from sklearn.linear_model import LogisticRegression
import warnings
X, y = make_classification(n_samples=400, n_features=10, random_state=0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    rf = RandomForestClassifier(n_estimators=30, n_jobs=2, random_state=0).fit(X, y)
    cv = cross_val_score(LogisticRegression(max_iter=500), X, y, cv=3, n_jobs=2)
serial = [str(w.message)[:120] for w in caught if 'serial' in str(w.message)]
# n_jobs=2 must mean two workers, not a quiet fallback to one (joblib's serial mode).
from joblib import effective_n_jobs
result = (round(rf.score(X, y), 3), [round(s, 3) for s in cv], serial, effective_n_jobs(2))
""",
    "scipy": """
import numpy as np
from scipy import optimize, integrate, sparse, stats
from scipy.sparse.linalg import spsolve
r = optimize.minimize(lambda v: (v[0] - 3) ** 2 + (v[1] + 1) ** 2, [0, 0])
q = integrate.quad(np.sin, 0, np.pi)[0]
A = sparse.diags([1.0, 4.0, 1.0], [-1, 0, 1], shape=(100, 100), format='csr')
x = spsolve(A, np.ones(100))
result = (round(float(r.x[0]), 3), round(q, 6), round(float(x.sum()), 6),
          round(float(stats.norm.cdf(1.0)), 6))
""",
    "statsmodels": """
import numpy as np, pandas as pd
import statsmodels.api as sm, statsmodels.formula.api as smf
rng = np.random.default_rng(0)
df = pd.DataFrame({'x': rng.normal(size=200)}); df['y'] = 2 * df['x'] + 1 + rng.normal(scale=0.1, size=200)
ols = smf.ols('y ~ x', data=df).fit()
arima = sm.tsa.ARIMA(df['y'].values, order=(1, 0, 0)).fit()
result = ([round(v, 2) for v in ols.params], round(float(arima.params[0]), 1))
""",
    "matplotlib": """
import os
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
fig, ax = plt.subplots(); ax.plot([1, 3, 2]); ax.set_title('census')
fig.savefig('mpl.png'); fig.savefig('mpl.pdf'); fig.savefig('mpl.svg'); plt.close(fig)
result = all(os.path.getsize(f) > 1000 for f in ('mpl.png', 'mpl.pdf', 'mpl.svg'))
""",
    "seaborn": """
import os
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt, numpy as np, pandas as pd, seaborn as sns
df = pd.DataFrame({'v': np.random.default_rng(0).normal(size=300), 'k': ['a', 'b', 'c'] * 100})
g = sns.histplot(data=df, x='v', hue='k', kde=True)
g.figure.savefig('sns.png'); plt.close('all')
result = os.path.getsize('sns.png') > 5000
""",
    "pillow": """
from PIL import Image, ImageDraw, ImageFilter, ImageFont
im = Image.new('RGB', (200, 100), 'white')
d = ImageDraw.Draw(im); d.rectangle([10, 10, 90, 90], fill='red'); d.text((100, 40), 'hi', fill='black',
                                                                    font=ImageFont.load_default())
im.filter(ImageFilter.GaussianBlur(2)).save('im.jpg', quality=90); im.save('im.png')
with Image.open('im.png') as back:
    result = (back.size, back.getpixel((50, 50)), Image.open('im.jpg').resize((50, 25)).size)
""",
    "openpyxl": """
import openpyxl, pandas as pd
wb = openpyxl.Workbook(); ws = wb.active; ws.title = 'data'
for i in range(1, 11):
    ws.append([i, i * i])
ws['C1'] = '=SUM(B1:B10)'
wb.save('book.xlsx')
pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']}).to_excel('pd.xlsx', index=False, engine='openpyxl')
back = openpyxl.load_workbook('book.xlsx')['data']
result = (back['B10'].value, back['C1'].value, pd.read_excel('pd.xlsx')['b'].tolist())
""",
    "lxml": """
from lxml import etree, html
root = etree.fromstring(b'<r><i n="1">a</i><i n="2">b</i></r>')
doc = html.fromstring('<div><p class="x">one</p><p>two</p></div>')
etree.ElementTree(root).write('x.xml', xml_declaration=True, encoding='utf-8')
result = (root.xpath('//i[@n="2"]/text()'), doc.xpath('//p[@class="x"]/text()'),
          etree.parse('x.xml').getroot().tag)
""",
    "beautifulsoup4": """
from bs4 import BeautifulSoup
page = '<html><body><a href="/a">A</a><a href="/b">B</a><table><tr><td>1</td></tr></table></body></html>'
result = ([a['href'] for a in BeautifulSoup(page, 'html.parser').find_all('a')],
          BeautifulSoup(page, 'lxml').td.text)
""",
    "sqlalchemy": """
from sqlalchemy import create_engine, String, select, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, Session
class Base(DeclarativeBase):
    pass
class Item(Base):
    __tablename__ = 'item'
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(20))
engine = create_engine('sqlite:///census.sqlite')
Base.metadata.drop_all(engine); Base.metadata.create_all(engine)
with Session(engine) as s:
    s.add_all([Item(name=f'n{i}') for i in range(50)]); s.commit()
    result = (s.scalar(select(func.count(Item.id))), s.scalar(select(Item.name).where(Item.id == 7)))
""",
    "numba": """
import numpy as np
from numba import njit, prange
@njit(cache=False)
def total(a):
    s = 0.0
    for v in a:
        s += v
    return s
@njit(parallel=True)
def squares(n):
    out = np.empty(n)
    for i in prange(n):
        out[i] = i * i
    return out
result = (total(np.arange(1000.0)), float(squares(1000).sum()))
""",
    "sympy": """
import sympy
x = sympy.symbols('x')
result = (str(sympy.integrate(sympy.sin(x) ** 2, x)), sympy.solve(x ** 2 - 4, x), str(sympy.series(sympy.exp(x), x, 0, 3)))
""",
    "networkx": """
import networkx as nx
G = nx.karate_club_graph()
result = (G.number_of_nodes(), round(nx.average_clustering(G), 4), nx.shortest_path_length(G, 0, 33),
          sorted(nx.pagerank(G), key=nx.pagerank(G).get)[-1])
""",
    "pyyaml_jinja2": """
import yaml, jinja2
doc = yaml.safe_load(yaml.safe_dump({'a': [1, 2], 'b': {'c': 'd'}}))
env = jinja2.Environment(loader=jinja2.DictLoader({'t.html': '{% for k in d %}<{{ k }}>{% endfor %}'}))
result = (doc, env.get_template('t.html').render(d=sorted(doc)))
""",
    "tqdm": """
from tqdm import tqdm
result = sum(tqdm(range(1000), mininterval=0))
""",
    "pydantic": """
from pydantic import BaseModel, ValidationError
class Row(BaseModel):
    name: str
    n: int
try:
    Row(name='x', n='not a number'); bad = None
except ValidationError as e:
    bad = e.errors()[0]['type']
result = (Row(name='a', n='3').model_dump(), bad, sorted(Row.model_json_schema()['properties']))
""",
    "xlsxwriter": """
import pandas as pd, xlsxwriter
wb = xlsxwriter.Workbook('xw.xlsx'); ws = wb.add_worksheet(); ws.write_row(0, 0, [1, 2, 3]); wb.close()
pd.DataFrame({'a': [1, 2]}).to_excel('xw2.xlsx', engine='xlsxwriter', index=False)
result = pd.read_excel('xw2.xlsx')['a'].tolist()
""",
    "h5py": """
import h5py, numpy as np
with h5py.File('d.h5', 'w') as f:
    f.create_dataset('x', data=np.arange(100).reshape(10, 10), compression='gzip')
    f.attrs['note'] = 'census'
with h5py.File('d.h5', 'r') as f:
    result = (int(f['x'][3, 4]), f['x'].shape, f.attrs['note'])
""",
    "opencv": """
import cv2, numpy as np
img = np.zeros((64, 64, 3), np.uint8); cv2.circle(img, (32, 32), 10, (0, 255, 0), -1)
blur = cv2.GaussianBlur(img, (5, 5), 0)
cv2.imwrite('cv.png', blur)
back = cv2.imread('cv.png')
result = (back.shape, int(back[32, 32, 1]), int(cv2.cvtColor(back, cv2.COLOR_BGR2GRAY)[0, 0]))
""",
    "psutil": """
import psutil
p = psutil.Process()
result = (psutil.cpu_count() > 0, psutil.virtual_memory().total > 0, p.memory_info().rss > 0, p.name() != '')
""",
    "requests": """
import requests
r = requests.Request('GET', 'http://example.invalid/q', params={'a': 1, 'b': 'x y'}).prepare()
result = (r.url, requests.utils.quote('a b'), requests.__version__ > '2')
""",
    "joblib_processes": """
import os
from joblib import Parallel, delayed
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    pids = Parallel(n_jobs=2)(delayed(os.getpid)() for _ in range(8))
    squares = Parallel(n_jobs=2)(delayed(pow)(i, 2) for i in range(10))
result = (sum(squares), any(p != os.getpid() for p in pids),
          [str(w.message)[:120] for w in caught if 'serial' in str(w.message)])
""",
    "joblib_threads": """
from joblib import Parallel, delayed
result = sum(Parallel(n_jobs=2, prefer='threads')(delayed(pow)(i, 2) for i in range(100)))
""",
    "multiprocessing_pool": """
import multiprocessing as mp, os
def work(x):
    return x * x, os.getpid()
with mp.Pool(2) as pool:
    out = pool.map(work, range(20))
result = (sum(v for v, _ in out), all(p != os.getpid() for _, p in out))
""",
    "process_pool_executor": """
import concurrent.futures as cf, os
def work(x):
    return x + 1, os.getpid()
with cf.ProcessPoolExecutor(2) as ex:
    out = list(ex.map(work, range(20)))
result = (sum(v for v, _ in out), all(p != os.getpid() for _, p in out))
""",
    "threads": """
import concurrent.futures as cf, threading
import numpy as np
lock = threading.Lock(); seen = set()
def work(i):
    with lock:
        seen.add(threading.get_ident())
    return float((np.ones((200, 200)) @ np.ones((200, 200)))[0, 0]) + i
with cf.ThreadPoolExecutor(4) as ex:
    out = list(ex.map(work, range(16)))
result = (sum(out), len(seen) >= 1)
""",
    "asyncio": """
import asyncio
async def main():
    async def job(i):
        await asyncio.sleep(0.01)
        return await asyncio.to_thread(pow, i, 2)
    q = asyncio.Queue()
    await asyncio.gather(*(q.put(i) for i in range(5)))
    return sum(await asyncio.gather(*(job(i) for i in range(10)))) + q.qsize()
result = asyncio.run(main())
""",
}


def venv_python(venv: Path = CENSUS_VENV) -> Path:
    return venv / "bin" / "python"


def outcome(status: str, value: str) -> dict:
    return {"status": status, "value": value}


def run_outside(name: str, venv: Path = CENSUS_VENV, timeout: float = 300) -> dict:
    """The snippet as `python -c` in a fresh directory: {"status": "ok"|"error", "value"}."""
    workdir = tempfile.mkdtemp(prefix=f"census-{name}-")
    code = SNIPPETS[name] + "\nprint('CENSUS-RESULT ' + repr(result))\n"
    try:
        p = subprocess.run([str(venv_python(venv)), "-c", code], cwd=workdir, capture_output=True,
                           text=True, timeout=timeout, env={"PATH": "/usr/bin:/bin", "HOME": workdir,
                                                            "MPLBACKEND": "Agg"})
    except subprocess.TimeoutExpired:
        return outcome("error", f"timed out after {timeout:.0f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for line in p.stdout.splitlines():
        if line.startswith("CENSUS-RESULT "):
            return outcome("ok", line[len("CENSUS-RESULT "):])
    return outcome("error", last_line(p.stderr) or f"exit code {p.returncode}")


def last_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def inside_outcome(rec: dict) -> dict:
    """A run record as an outcome: the result when the cell ended well, else why not."""
    if rec.get("status") == "ok":
        return outcome("ok", rec.get("result") or "")
    err = rec.get("error") or {}
    why = f"{err.get('type', rec.get('status'))}: {err.get('message', '')}".strip()
    return outcome("error", why[:300])


def inside_code(name: str) -> str:
    return SNIPPETS[name] + "\nresult\n"


class Client:
    """A minimal MCP client over stdio (no SDK): enough for run_python."""

    def __init__(self, binary: str, env: dict[str, str]):
        self.p = subprocess.Popen([binary, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self.buf = b""
        self.id = 0

    def request(self, method: str, params: dict, timeout: float = 600) -> dict:
        self.id += 1
        rid = self.id
        self.p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode()
                           + b"\n")
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self.buf:
                ready, _, _ = select.select([self.p.stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError(f"no answer to {method} in {timeout:.0f} s")
                chunk = os.read(self.p.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise EOFError("ironcell closed its stdout")
                self.buf += chunk
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if msg.get("id") == rid and ("result" in msg or "error" in msg):
                return msg

    def initialize(self) -> None:
        self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "census", "version": "0"}})
        self.p.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')

    def run(self, code: str, session: str, timeout_s: float = 300) -> dict:
        res = self.request("tools/call", {"name": "run_python",
                                          "arguments": {"code": code, "session": session,
                                                        "timeout_s": timeout_s}})["result"]
        rec = res.get("structuredContent") or {"status": "error", "error": {
            "type": "refused", "message": res["content"][0]["text"]}}
        while rec.get("status") == "running":  # a long run became a background job
            time.sleep(1)
            res = self.request("tools/call", {"name": "run_python_job", "arguments": {"job": rec["job"]}})
            rec = res["result"].get("structuredContent") or rec
        return rec

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()


def census(binary: str, venv: Path, names: list[str]) -> list[tuple[str, dict, dict, list[str]]]:
    # Where ironcell keeps its state by default, so sessions run as a user's do (with a private
    # /tmp); the temp dir only when that cannot be made.
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    try:
        base.mkdir(parents=True, exist_ok=True)
        state = tempfile.mkdtemp(prefix="census-state-", dir=base)
    except OSError:
        state = tempfile.mkdtemp(prefix="census-state-")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "MCP_BRIDGE_STATE_DIR": state,
           "IRONCELL_PYTHON": str(venv), "MCP_BRIDGE_LOG_LEVEL": "warn"}
    client = Client(binary, env)
    rows = []
    try:
        client.initialize()
        for name in names:
            outside = run_outside(name, venv)
            rec = client.run(inside_code(name), session=f"census-{name}")
            rows.append((name, outside, inside_outcome(rec), rec.get("notices") or []))
            print(f"  {name}: outside {outside['status']}, inside {rows[-1][2]['status']}", file=sys.stderr)
    finally:
        client.close()
        shutil.rmtree(state, ignore_errors=True)
    return rows


def verdict(outside: dict, inside: dict) -> str:
    if outside["status"] != "ok":
        return "broken outside"
    if inside == outside:
        return "same"
    if inside["status"] == "ok":
        return "differs"
    return "FAILS inside"


def print_table(rows, markdown: bool) -> None:
    header = ("snippet", "outside", "inside", "verdict")
    lines = []
    for name, outside, inside, notes in rows:
        inside_text = inside["value"] if inside != outside else "(same)"
        if notes:
            inside_text += "  [note] " + " | ".join(notes)
        lines.append((name, outside["value"], inside_text, verdict(outside, inside)))
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for ln in lines:
            print("| " + " | ".join(c.replace("|", "\\|")[:200] for c in ln) + " |")
    else:
        for name, out, ins, v in lines:
            print(f"{name:24} {v:15} outside: {out[:90]}")
            if ins != "(same)":
                print(f"{'':40} inside:  {ins[:400]}")
    same = sum(1 for _, o, i, _ in rows if o == i and o["status"] == "ok")
    ok_out = sum(1 for _, o, _, _ in rows if o["status"] == "ok")
    print(f"\n{same} of {len(rows)} snippets work inside as outside; {ok_out} of {len(rows)} work outside.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=str(REPO / "target" / "release" / "ironcell"))
    ap.add_argument("--venv", default=str(CENSUS_VENV))
    ap.add_argument("--only", default="", help="comma-separated snippet names")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    venv = Path(args.venv)
    if not venv_python(venv).exists():
        print(f"no census venv at {venv}: run scripts/install_test_peers.sh (or pass --venv)", file=sys.stderr)
        return 2
    names = [n for n in args.only.split(",") if n] or list(SNIPPETS)
    unknown = [n for n in names if n not in SNIPPETS]
    if unknown:
        print(f"unknown snippets: {', '.join(unknown)}; known: {', '.join(SNIPPETS)}", file=sys.stderr)
        return 2
    version = subprocess.run([str(venv_python(venv)), "-c", "import sys; print(sys.version.split()[0])"],
                             capture_output=True, text=True).stdout.strip()
    print(f"census: {len(names)} snippets, Python {version} at {venv}, ironcell {args.binary}", file=sys.stderr)
    print_table(census(args.binary, venv, names), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
