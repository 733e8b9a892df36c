"""tools/flagcheck.py on a toy repository: a tested flag use is reported pinned, an untested one NOT PINNED."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "flagcheck.py"

GRPO = '''
from dataclasses import dataclass


@dataclass
class Args:
    a: int = 1
    """a baseline flag"""
'''

TOY = '''
import os
from dataclasses import dataclass, field


@dataclass
class Args:
    a: int = 1
    b: int = 2
    """scale"""
    c: bool = False
    d: list = field(default_factory=list)
    e: str = os.path.basename("x.py")


def f(args):
    return args.b * 10, args.c


def g(args):
    args.b = 5  # an assignment, not a use
    return args.a, args.d, args.e
'''

TEST_TOY = '''
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import toy


def test_b():
    assert toy.f(toy.Args(b=3))[0] == 30


def test_c_default():
    assert toy.f(toy.Args())[1] is False
'''


@pytest.fixture
def toy_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "grpo.py").write_text(textwrap.dedent(GRPO))
    (repo / "toy.py").write_text(textwrap.dedent(TOY))
    (repo / "tests" / "test_toy.py").write_text(textwrap.dedent(TEST_TOY))
    return repo


def flagcheck(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=repo, capture_output=True, text=True, timeout=120)


def line_of(repo: Path, text: str) -> int:
    return next(i for i, line in enumerate((repo / "toy.py").read_text().splitlines(), 1) if text in line)


def test_reports_pinned_and_not_pinned(toy_repo: Path):
    r = flagcheck(toy_repo, "toy.py", "tests/test_toy.py", "--jobs", "2")
    n = line_of(toy_repo, "args.b * 10")
    assert f"toy.py:{n} args.b -> 2: pinned (" in r.stdout, r.stdout + r.stderr
    assert f"toy.py:{n} args.c -> False: NOT PINNED (" in r.stdout, r.stdout + r.stderr
    assert "args.d: skipped: default not a literal" in r.stdout
    assert "args.e: skipped: default not a literal" in r.stdout
    assert "args.a" not in r.stdout  # grpo.py has it: not a method flag
    assert "1 flag uses pinned by a test, 1 not" in r.stdout
    assert r.returncode == 1


def test_all_pinned_exits_0(toy_repo: Path):
    r = flagcheck(toy_repo, "toy.py", "tests/test_toy.py", "--flags", "b")
    assert "1 flag uses pinned by a test, 0 not" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0


def test_dry_run_lists_uses_and_runs_nothing(toy_repo: Path):
    (toy_repo / "tests" / "test_toy.py").write_text("def test_broken():\n    assert False\n")
    r = flagcheck(toy_repo, "toy.py", "tests/test_toy.py", "--dry-run")
    n = line_of(toy_repo, "args.b * 10")
    assert r.returncode == 0, r.stderr
    assert f"toy.py:{n} args.b -> 2" in r.stdout
    assert f"toy.py:{n} args.c -> False" in r.stdout
    assert "(2)" in r.stdout and "(False)" in r.stdout
    assert line_of(toy_repo, "args.b = 5") != n and f"toy.py:{line_of(toy_repo, 'args.b = 5')}" not in r.stdout
    assert "pinned" not in r.stdout.lower()


def test_failing_unmutated_tests_stop(toy_repo: Path):
    (toy_repo / "tests" / "test_toy.py").write_text("def test_broken():\n    assert False\n")
    r = flagcheck(toy_repo, "toy.py", "tests/test_toy.py")
    assert r.returncode == 2
    assert "fail without any mutation" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.py", "tests/test_toy.py"], "FILE not found: missing.py"),
        (["noargs.py", "tests/test_toy.py"], "no `class Args`"),
        (["toy.py", "tests/test_nope.py"], "TEST not found: tests/test_nope.py"),
        (["grpo.py", "tests/test_toy.py"], "--flags"),
        (["toy.py", "tests/test_toy.py", "--flags", "zz"], "no field zz"),
    ],
)
def test_errors(toy_repo: Path, args: list[str], message: str):
    (toy_repo / "noargs.py").write_text("x = 1\n")
    r = flagcheck(toy_repo, *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == ""
