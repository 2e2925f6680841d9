"""The docs' snippets run as written (issue 14, item 11).

Every fenced block of README.md and docs/*.md whose info string marks it runnable is run here,
from an empty directory, exactly as a reader would paste it:

* ```` ```sh runnable ```` (or ``bash``): ``bash -e -o pipefail`` with the project's ``python`` and
  ``bladectl`` first on PATH; whatever it starts in the background is stopped afterwards.
* ```` ```python runnable-with-daemon ````: ``python -c`` in the directory of a daemon started as
  the quick start says (``python -m bladed.server``, no options), which the docs name as the
  snippet's precondition; the snippet must open and close a session through that daemon.

A snippet that stops running as written fails here, named by its file and line.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from daemon_util import ROOT, DaemonProcess, ended, env_with_repo, short_tmpdir

#: a fenced block marked runnable: (language, mark, body)
RUNNABLE = re.compile(r"^```(python|sh|bash) (runnable|runnable-with-daemon)\n(.*?)^```$", re.S | re.M)


def snippets() -> Iterator[tuple[str, str, str, str]]:
    """(where, language, mark, body) of every runnable block, ``where`` as ``docs/x.md:LINE``."""
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(path) as f:
            text = f.read()
        for m in RUNNABLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield f"{os.path.relpath(path, ROOT)}:{line}", m.group(1), m.group(2), m.group(3)


SNIPPETS = list(snippets())


def reader_env() -> dict[str, str]:
    """The environment of a reader who ran the quick start: the project's interpreter and tools on PATH."""
    env = env_with_repo()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def test_the_docs_mark_their_snippets_runnable() -> None:
    """The marker is spelled right where it matters: these snippets are the ones a newcomer pastes."""
    where = {w.split(":")[0] for w, *_ in SNIPPETS}
    assert {"docs/transformers.md", "docs/operations.md"} <= where, where
    for w, lang, mark, _ in SNIPPETS:
        assert mark == "runnable" or lang == "python", f"{w}: only Python snippets run beside a daemon"


@pytest.mark.parametrize(("where", "lang", "body"), [(w, lang, body) for w, lang, mark, body in SNIPPETS
                                                     if mark == "runnable"], ids=lambda v: v if ".md:" in v else "")
def test_shell_snippet_runs_as_written(where: str, lang: str, body: str) -> None:
    assert lang in ("sh", "bash"), f"{where}: a Python snippet marked runnable needs no daemon; run it as sh"
    with short_tmpdir() as cwd:
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", body], cwd=cwd, env=reader_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)    # whatever the snippet left running
        assert proc.returncode == 0, f"{where} failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"


@pytest.fixture(scope="module")
def quick_start() -> Iterator[DaemonProcess]:
    with short_tmpdir() as tmp, DaemonProcess(tmp, embedded=True).start() as d:
        yield d


@pytest.mark.parametrize(("where", "body"), [(w, body) for w, _, mark, body in SNIPPETS
                                             if mark == "runnable-with-daemon"],
                         ids=lambda v: v if ".md:" in v else "")
def test_python_snippet_runs_as_written_beside_a_daemon(quick_start: DaemonProcess, where: str, body: str) -> None:
    before = quick_start.mark()  # the daemon is shared by the module: only what the snippet causes counts
    with ended(subprocess.Popen([sys.executable, "-c", body], cwd=quick_start.cwd, env=reader_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as proc:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{where} failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    # through this daemon: the snippet's process opened a session and closed it (or closed it retaining its KV)
    closed = quick_start.wait_event("session_close", after=before, pid=proc.pid)
    assert closed["reason"] in ("closed", "retained")


def test_the_client_docs_error_table_is_the_codes() -> None:
    """docs/client.md's table of error codes says, per code, exactly what the client raises for it: the class
    ``protocol.error_for`` makes, and that class's row of ``protocol.ERRORS`` (what else it is, its meaning)."""
    from bladed import protocol

    with open(os.path.join(ROOT, "docs", "client.md")) as f:
        section = f.read().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: (m[2], m[3] or "", m[4])
            for m in re.finditer(r"^\| `(\w+)` \| `(\w+)` \| (?:`(\w+)` )?\| (.*) \|$", section, re.M)}
    assert rows.keys() == {code.value for code in protocol.ErrorCode}
    table = {code.value: (name, also, doc) for name, also, codes, doc in protocol.ERRORS for code in codes}
    for code, (name, also, doc) in rows.items():
        assert type(protocol.error_for(protocol.ErrorCode(code), "")).__name__ == name, code
        assert code not in table or (name, also, doc) == table[code], code
