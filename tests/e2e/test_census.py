"""Normal workloads under the syscall filter and Landlock: none may hit an unexpected denial.

The filter is a default-deny allow-list built from an strace census; this is the census turned
into a test. Each workload must finish without an exception, as root and as `nobody`.
"""

from __future__ import annotations

import pytest

from test_sandbox import Sandboxed, USERS

WORKLOADS = {
    "threads_and_pools": """
import threading, concurrent.futures, queue
q = queue.Queue()
ts = [threading.Thread(target=q.put, args=(i,)) for i in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
with concurrent.futures.ThreadPoolExecutor(4) as ex:
    total = sum(ex.map(lambda x: x * x, range(100)))
(q.qsize(), total)
""",
    "asyncio": """
import asyncio
async def main():
    q = asyncio.Queue()
    async def prod():
        for i in range(5):
            await q.put(i); await asyncio.sleep(0)
    await asyncio.gather(prod(), asyncio.sleep(0.01))
    r = await asyncio.wait_for(asyncio.to_thread(sum, range(10)), 5)
    return q.qsize() + r
asyncio.run(main())
""",
    "sqlite_on_disk": """
import sqlite3
db = sqlite3.connect('census.db')
db.execute('create table if not exists t(x)'); db.executemany('insert into t values (?)', [(i,) for i in range(100)])
db.commit(); n = db.execute('select count(*) from t').fetchone()[0]; db.close(); n >= 100
""",
    "archives_tempfiles_shutil": """
import tarfile, zipfile, tempfile, shutil, os, io
d = tempfile.mkdtemp()
open(os.path.join(d, 'a.txt'), 'w').write('hello' * 1000)
# shutil.copyfile, not shutil.copy: chmod is refused (SECURITY.md #46), see the test below.
shutil.copyfile(os.path.join(d, 'a.txt'), os.path.join(d, 'b.txt'))
with tarfile.open('x.tar.gz', 'w:gz') as t: t.add(d, arcname='d')
with zipfile.ZipFile('x.zip', 'w', zipfile.ZIP_DEFLATED) as z: z.write(os.path.join(d, 'b.txt'), 'b.txt')
with tempfile.NamedTemporaryFile() as f: f.write(b'x'); f.flush()
shutil.rmtree(d)
# Extraction works: tarfile logs and skips the refused chown/chmod/utime at errorlevel 1.
shutil.rmtree('out', ignore_errors=True)
tarfile.open('x.tar.gz').extractall('out')
zipfile.ZipFile('x.zip').extractall('out')
(len(tarfile.open('x.tar.gz').getnames()), zipfile.ZipFile('x.zip').namelist(),
 open('out/d/b.txt').read() == 'hello' * 1000, open('out/b.txt').read() == 'hello' * 1000)
""",
    "logging_signals_timers": """
import logging, signal, time
logging.basicConfig(filename='app.log', level=logging.INFO); logging.info('hi')
fired = []
signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
signal.setitimer(signal.ITIMER_REAL, 0.01); time.sleep(0.1)
(open('app.log').read().strip(), fired)
""",
    "stdlib_grab_bag": """
import json, re, datetime, decimal, fractions, hashlib, hmac, random, uuid, csv, pickle, mmap, zoneinfo, ctypes, struct, base64, statistics, io, os, platform, locale, textwrap, secrets, gzip, bz2, lzma, multiprocessing, subprocess
tz = zoneinfo.ZoneInfo('America/New_York')
m = mmap.mmap(-1, 4096); m.write(b'abc')
w = io.StringIO(); csv.writer(w).writerow([1, 'a'])
(str(datetime.datetime(2024, 1, 1, tzinfo=tz).utcoffset()), hashlib.sha256(b'x').hexdigest()[:8],
 pickle.loads(pickle.dumps({'a': decimal.Decimal('1.1')})), len(secrets.token_hex(8)), os.cpu_count() > 0,
 gzip.decompress(gzip.compress(b'z')), uuid.uuid4().version, ctypes.sizeof(ctypes.c_long))
""",
    "numpy_pandas_matplotlib": """
try:
    import numpy as np, pandas as pd
except ImportError:
    result = 'not installed'
else:
    a = np.random.default_rng(0).random((200, 200))
    df = pd.DataFrame({'x': range(10), 'y': [i * i for i in range(10)]})
    df.to_csv('df.csv'); back = pd.read_csv('df.csv')
    result = (round(float((a @ a.T).trace()), 2) > 0, int(back['y'].sum()), float(np.linalg.det(np.eye(3))))
    try:
        import matplotlib.pyplot as plt
        plt.plot([1, 2, 3]); plt.savefig('plot.png'); result += (os.path.getsize('plot.png') > 1000,)
    except ImportError:
        pass
import os
result
""",
}


@pytest.fixture(scope="module", params=USERS)
def census_box(request):
    b = Sandboxed(request.param)
    yield b
    b.close()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_normal_workloads_run_under_the_filter(census_box, name):
    rec = census_box.run(WORKLOADS[name], session=f"census-{name}", timeout_s=120)
    assert rec["status"] == "ok", (rec.get("error") or {}).get("traceback") or rec
    if rec["result"] == "'not installed'":
        pytest.skip("numpy/pandas are not installed for the embedded Python "
                    "(apt install python3-numpy python3-pandas python3-matplotlib)")
    assert rec["result"] not in (None, "False")


def test_what_the_metadata_refusal_changes_for_normal_code(census_box):
    """chmod/chown/utime are refused (SECURITY.md #46): the copy helpers still copy the data
    and skip only the refused mode step; a direct chmod still fails loudly."""
    code = """
import shutil, os
open('src.txt', 'w').write('data')
os.makedirs('tree/sub', exist_ok=True); open('tree/sub/f', 'w').write('deep')
shutil.copy('src.txt', 'dst.txt'); shutil.copy2('src.txt', 'dst2.txt'); shutil.copytree('tree', 'tree2')
try:
    os.chmod('dst.txt', 0o600)
    direct = 'changed'
except PermissionError as e:
    direct = f'PermissionError:{e.errno}'
(open('dst.txt').read(), open('dst2.txt').read(), open('tree2/sub/f').read(), direct)
"""
    rec = census_box.run(code, session="census-metadata")
    assert rec["status"] == "ok", rec
    assert rec["result"] == "('data', 'data', 'deep', 'PermissionError:1')"
