#!/usr/bin/env python3
"""flagcheck: which uses of a method's own flags does no test notice?

    python tools/flagcheck.py FILE TEST [TEST ...] [--jobs 1] [--timeout 1800] [--flags a,b] [--dry-run]

A method flag of FILE is a field of FILE's `Args` dataclass that grpo.py's `Args` (same folder) lacks (for grpo.py
itself, or with --flags, the names given). Each read of `args.<flag>` in FILE, one at a time, is replaced by the
flag's default value in a temporary copy of the repository, and `pytest -x TESTS` is run there. Reading the result:
"pinned" means some test failed, so a test notices that use; "NOT PINNED" means the tests still pass with that use
hard-wired to its default, so no test exercises the flag at a non-default value there; "timeout" counts as not pinned.
Exit status: 0 if every use is pinned, 1 if some are not, 2 on an error (bad arguments, or the unmutated tests fail).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

IGNORE = shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", ".cache", ".pytest_cache")
_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()
_print_lock = threading.Lock()


class FlagcheckError(Exception):
    pass


@dataclass
class Use:
    field: str
    line: int
    col: int  # UTF-8 byte offsets, as ast gives them
    end_col: int
    default: str | None  # repr of the default, None when skipped
    skip: str | None = None

    @property
    def replacement(self) -> str:
        return f"({self.default})"


def find_args_class(tree: ast.Module) -> ast.ClassDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            return node
    return None


def parse(path: Path) -> tuple[str, ast.Module]:
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as e:
        raise FlagcheckError(f"cannot read {path}: {e.strerror}") from None
    try:
        return source, ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise FlagcheckError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None


def args_fields(path: Path, tree: ast.Module) -> dict[str, tuple[str | None, str | None]]:
    """Field name -> (repr of the default, reason it is skipped), in class order."""
    cls = find_args_class(tree)
    if cls is None:
        raise FlagcheckError(f"{path}: no `class Args` found")
    fields: dict[str, tuple[str | None, str | None]] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if stmt.value is None:
            fields[stmt.target.id] = (None, "skipped: no default")
            continue
        try:
            fields[stmt.target.id] = (repr(ast.literal_eval(stmt.value)), None)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            fields[stmt.target.id] = (None, "skipped: default not a literal")
    return fields


def find_uses(path: Path, flags: list[str] | None) -> tuple[str, list[Use]]:
    source, tree = parse(path)
    fields = args_fields(path, tree)
    if flags is None:
        base = path.parent / "grpo.py"
        if path.resolve() == base.resolve():
            raise FlagcheckError(f"{path} is the baseline itself: name the flags to check with --flags a,b")
        if not base.is_file():
            raise FlagcheckError(f"{base} not found (needed to tell method flags apart); or name them with --flags")
        base_fields = args_fields(base, parse(base)[1])
        flags = [name for name in fields if name not in base_fields]
    else:
        unknown = [name for name in flags if name not in fields]
        if unknown:
            raise FlagcheckError(f"{path}: Args has no field {', '.join(unknown)}")
    cls = find_args_class(tree)
    assert cls is not None
    lines = source.splitlines(keepends=True)
    uses = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"
                and node.attr in flags and isinstance(node.ctx, ast.Load)):
            continue  # assignments (args.x = ...) are not uses of the value
        if cls.lineno <= node.lineno <= (cls.end_lineno or cls.lineno):
            continue
        default, skip = fields[node.attr]
        use = Use(node.attr, node.lineno, node.col_offset, node.end_col_offset or 0, default, skip)
        if use.skip is None:
            if node.end_lineno != node.lineno:
                use.skip = "skipped: spans several lines"
            elif lines[use.line - 1].encode()[use.col:use.end_col].decode(errors="replace") != f"args.{use.field}":
                use.skip = "skipped: source position unclear"
            else:
                try:
                    compile(mutate(source, use), str(path), "exec")
                except SyntaxError:
                    use.skip = "skipped: replacement is not valid syntax here"
        uses.append(use)
    uses.sort(key=lambda u: (u.line, u.col))
    return source, uses


def mutate(source: str, use: Use) -> str:
    lines = source.splitlines(keepends=True)
    raw = lines[use.line - 1].encode()
    lines[use.line - 1] = (raw[:use.col] + use.replacement.encode() + raw[use.end_col:]).decode()
    return "".join(lines)


def copy_repo(repo: Path) -> tuple[Path, Path]:
    """A copy of repo in a fresh temp folder; returns (temp folder, copy)."""
    tmp = Path(tempfile.mkdtemp(prefix="flagcheck-"))
    copy = tmp / repo.name
    shutil.copytree(repo, copy, ignore=IGNORE, symlinks=True)
    shared = repo.parent / "shared"  # tests may read ../shared/data next to the repository
    if shared.exists() and repo.name != "shared":
        (tmp / "shared").symlink_to(shared)
    return tmp, copy


def run_pytest(repo: Path, rel_file: Path, source: str | None, tests: list[Path], timeout: float) -> tuple[str, float]:
    """Runs the tests in a copy of repo (FILE replaced by source unless None): 'pass', 'fail' or 'timeout'."""
    tmp, copy = copy_repo(repo)
    try:
        if source is not None:
            (copy / rel_file).write_text(source, encoding="utf-8")
        test_args = []
        for t in tests:
            try:
                test_args.append(str(copy / t.relative_to(repo)))
            except ValueError:
                test_args.append(str(t))
        env = dict(os.environ)
        env.setdefault("COOKING_CACHE", str(repo / ".cache" / "cooking"))
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(copy)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *test_args]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        with _live_lock:
            _live.add(proc)
        try:
            rc = proc.wait(timeout=timeout)
            result = "pass" if rc == 0 else "fail"
        except subprocess.TimeoutExpired:
            kill(proc)
            result = "timeout"
        finally:
            with _live_lock:
                _live.discard(proc)
        return result, time.monotonic() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def kill_all() -> None:
    with _live_lock:
        procs = list(_live)
    for p in procs:
        kill(p)


def say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flagcheck", description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Replaces each use of a method flag by its default, one at a time, and runs the tests.")
    parser.add_argument("file", metavar="FILE", help="the script to check, e.g. gigpo.py")
    parser.add_argument("tests", metavar="TEST", nargs="+", help="test files or folders given to pytest")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run in parallel (default 1)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run (default 1800)")
    parser.add_argument("--flags", help="comma-separated field names to check instead of those grpo.py lacks")
    parser.add_argument("--dry-run", action="store_true", help="list the uses and their replacements, run nothing")
    a = parser.parse_args(argv)
    if a.jobs < 1:
        parser.error("--jobs must be at least 1")
    if a.timeout <= 0:
        parser.error("--timeout must be positive")

    try:
        path = Path(a.file)
        if not path.is_file():
            raise FlagcheckError(f"FILE not found: {a.file}")
        tests = []
        for t in a.tests:
            if not Path(t).exists():
                raise FlagcheckError(f"TEST not found: {t}")
            tests.append(Path(t).resolve())
        flags = None
        if a.flags is not None:
            flags = [f.strip() for f in a.flags.split(",") if f.strip()]
            if not flags:
                raise FlagcheckError("--flags names no field")
        source, uses = find_uses(path, flags)
    except FlagcheckError as e:
        print(f"flagcheck: error: {e}", file=sys.stderr)
        return 2

    def where(u: Use) -> str:
        return f"{a.file}:{u.line} args.{u.field}"

    if a.dry_run:
        for u in uses:
            if u.skip:
                say(f"{where(u)}: {u.skip}")
            else:
                say(f"{where(u)} -> {u.default}: col {u.col}-{u.end_col} becomes {u.replacement}")
        todo = sum(1 for u in uses if not u.skip)
        say(f"{todo} flag uses to check, {len(uses) - todo} skipped")
        return 0
    if not uses:
        say(f"no uses of method flags found in {a.file}")
        say("0 flag uses pinned by a test, 0 not")
        return 0

    repo = path.resolve().parent
    rel_file = Path(path.resolve().name)
    try:
        result, secs = run_pytest(repo, rel_file, None, tests, a.timeout)
        if result != "pass":
            how = "time out" if result == "timeout" else "fail"
            print(f"flagcheck: error: the tests {how} without any mutation ({secs:.0f}s); fix them first: "
                  f"{sys.executable} -m pytest -q -x {' '.join(a.tests)}", file=sys.stderr)
            return 2
        say(f"unmutated tests pass ({secs:.1f}s); checking {sum(1 for u in uses if not u.skip)} uses")

        counts = {"pinned": 0, "not": 0, "skipped": 0}
        for u in uses:
            if u.skip:
                counts["skipped"] += 1
                say(f"{where(u)}: {u.skip}")

        def check(u: Use) -> tuple[Use, str, float]:
            return (u, *run_pytest(repo, rel_file, mutate(source, u), tests, a.timeout))

        with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
            futures = [pool.submit(check, u) for u in uses if not u.skip]
            try:
                for fut in concurrent.futures.as_completed(futures):
                    u, result, secs = fut.result()
                    word = {"fail": "pinned", "pass": "NOT PINNED", "timeout": "timeout"}[result]
                    counts["pinned" if result == "fail" else "not"] += 1
                    say(f"{where(u)} -> {u.default}: {word} ({secs:.1f}s)")
            except BaseException:
                for fut in futures:
                    fut.cancel()
                kill_all()  # so that leaving the pool does not wait for the running tests
                raise
    except KeyboardInterrupt:
        kill_all()
        print("flagcheck: interrupted", file=sys.stderr)
        return 130
    tail = f", {counts['skipped']} skipped" if counts["skipped"] else ""
    say(f"{counts['pinned']} flag uses pinned by a test, {counts['not']} not{tail}")
    return 1 if counts["not"] else 0


if __name__ == "__main__":
    sys.exit(main())
