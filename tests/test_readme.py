"""README.md's commands, run as written, in order, in one shell; and its figures, traced to the
committed results they come from.

Every ```` ```bash ```` block of the README runs, top to bottom, in one ``bash -euo pipefail``
session in the repository root (so a variable one block sets, like ``$REPO``, is there for the
next, and a server one block starts in the background serves the ones after it). The only
change made to them: ports 8000, 8001, 8002 and 8080 become free ports, so parallel test runs never
collide. A block the README marks with an HTML comment right above it is not run, for the
reason the mark gives, and the test checks the reason is honest:

* ``<!-- readme-test: needs a Kubernetes cluster -->`` (also ``cloud credentials``,
  ``Docker``, ``the internet``, joined by ``and``): the block holds a command that needs it;
* ``<!-- readme-test: takes a quarter of an hour -->``: the block holds a benchmark or ``tune``;
* ``<!-- readme-test: skips "make test" (why) -->``: only those lines are left out.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = re.compile(r"^<!--\s*readme-test:\s*(?P<body>.*?)\s*-->$")
#: What each "needs" reason stands for: a command in the block that needs it.
NEEDS = {
    "a Kubernetes cluster": re.compile(r"^\s*(kubectl|helm (upgrade|test|uninstall))\b", re.M),
    "cloud credentials": re.compile(r"\bgcloud\b|\bgs://|\bhf://"),
    "Docker": re.compile(r"^\s*docker\b", re.M),
    "the internet": re.compile(r"\bhf://|\bgs://|\bgit clone\b|\bgcloud\b"),
}
LONG = re.compile(r"\bmodel-loader tune\b|^\s*make bench\b", re.M)
#: The README's fixed ports; the test maps them to free ones.
PORTS = ("8000", "8001", "8002", "8080")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    mark: str | None


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```bash":
            end = lines.index("```", index + 1)
            before = next((x.strip() for x in reversed(lines[:index]) if x.strip()), "")
            mark = MARK.match(before)
            blocks.append(
                Block(index + 1, "\n".join(lines[index + 1 : end]), mark["body"] if mark else None)
            )
            index = end
        index += 1
    return blocks


def skipped_commands(mark: str) -> list[tuple[str, str]]:
    """``skips "cmd" (why) and "cmd2" (why)`` -> [(cmd, why), ...]."""
    return re.findall(r'"([^"]+)"\s*\(([^)]+)\)', mark)


def _command(line: str) -> str:
    return line.split("#", 1)[0].strip()


def runnable(block: Block) -> str | None:
    """The block's code as the test runs it (``None``: not run), after checking its mark."""
    if block.mark is None:
        return block.code
    if block.mark.startswith("needs "):
        for reason in block.mark[len("needs ") :].split(" and "):
            assert reason in NEEDS, f"README line {block.line}: unknown reason {reason!r}"
            assert NEEDS[reason].search(block.code), (
                f"README line {block.line} says it needs {reason}, but no command in it does"
            )
        return None
    if block.mark.startswith("takes "):
        assert LONG.search(block.code), f"README line {block.line}: no long command in it"
        return None
    if block.mark.startswith("skips "):
        skips = skipped_commands(block.mark)
        assert skips, f"README line {block.line}: a skips mark names no command"
        lines = block.code.splitlines()
        for command, _ in skips:
            assert command in map(_command, lines), f"README line {block.line}: no {command!r}"
        return "\n".join(": skipped" if _command(x) in dict(skips) else x for x in lines)
    raise AssertionError(f"README line {block.line}: unknown mark {block.mark!r}")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def script(blocks: list[Block], ports: dict[str, int]) -> str:
    parts = [
        "set -euo pipefail",
        # every server a block left in the background stops (SIGTERM: it stops its Triton), and
        # a local cluster a failed block left up goes down (the next run would find its release)
        "trap 'kill -TERM $(jobs -p) 2>/dev/null || true; wait || true; "
        "make -s cluster-down >/dev/null 2>&1 || true' EXIT",
    ]
    for block in blocks:
        code = runnable(block)
        if code is None:
            parts.append(f"echo '::not run: README line {block.line} ({block.mark})'")
            continue
        code = re.sub(r"\b(800[0-2]|8080)\b", lambda m: str(ports[m[1]]), code)
        parts.append(f"printf '\\n::README line {block.line}\\n' >&2")  # on a line of its own
        parts.append(code)
    return "\n".join(parts) + "\n"


def test_every_mark_is_honest_and_few_blocks_are_left_out():
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 10
    left_out = [b for b in blocks if runnable(b) is None]
    assert len(left_out) <= len(blocks) // 2
    for block in blocks:
        runnable(block)  # asserts the mark's reason holds


def test_a_dishonest_mark_is_caught():
    with pytest.raises(AssertionError, match="no command in it does"):
        runnable(Block(1, "scripts/serve-local x", "needs a Kubernetes cluster"))
    with pytest.raises(AssertionError, match="no 'make lint'"):
        runnable(Block(1, "make test", 'skips "make lint" (slow)'))
    assert runnable(Block(1, "make demo\nmake test  # all", 'skips "make test" (itself)')) == (
        "make demo\n: skipped"
    )


def test_readme_figures_come_from_committed_results():
    """A ratio, a rate or a throughput the README states is one a committed result holds."""
    text = re.sub(r"`[^`]*`", "", README.read_text(encoding="utf-8"))  # formats, not claims
    figures = re.findall(r"\b(\d+(?:\.\d+)?)\s*(?:x\b|MB/s|infer/s\b)", text)
    committed = "\n".join(
        p.read_text(encoding="utf-8", errors="replace")
        for p in (ROOT / "bench" / "results").rglob("*")
        if p.is_file() and p.suffix in (".json", ".md", ".txt", ".csv")
    )
    missing = [f for f in figures if f not in committed]
    assert not missing, f"README figures found in no committed result: {missing}"


@pytest.mark.slow
def test_the_readme_commands_run_as_written_in_order(tmp_path):
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    ports = dict(zip(PORTS, _free_ports(len(PORTS)), strict=True))
    for made in ("ft", "ft-fp32"):  # the conversion examples refuse to replace their output
        subprocess.run(["rm", "-rf", str(ROOT / "demo-work" / made)], check=True)
    log = tmp_path / "readme.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", script(blocks, ports)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    output = log.read_text(errors="replace")
    at = re.findall(r"^::README line (\d+)$", output, re.M)
    assert code == 0, f"README line {at[-1] if at else '?'} failed:\n{output[-6000:]}"
    ran = {int(x) for x in at}
    assert ran == {b.line for b in blocks if runnable(b) is not None}
    assert '"completion"' in output  # the curl examples' JSON answers
    assert '"object":"text_completion"' in output and '"param":"stream"' in output  # the service
