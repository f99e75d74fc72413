"""Mutation testing of the modules that decide correctness, one module at a time.

    .venv/bin/python tools/mutate.py                 # every module below, in order
    .venv/bin/python tools/mutate.py rope checker    # modules whose path contains a word
    .venv/bin/python tools/mutate.py --report        # scores from the last runs, nothing re-run
    .venv/bin/python tools/mutate.py --survivors rope  # re-run only last run's survivors (after new tests)
    .venv/bin/python tools/mutate.py --resume checker  # finish an interrupted run, keeping its results
    .venv/bin/python tools/mutate.py reshard --only '*x_plan_reads*'  # only mutants of matching functions

Each module runs mutmut 3 in its own copy of the tree (build/mutate/<module>/, git-ignored) with
`only_mutate` set to that module and pytest limited to its fast unit tests: mutmut then runs, for
each mutant, only the tests that call the mutated function. One worker (`--max-children 1`), and
`make mutate` runs this under `nice -n 10`: the machine is shared.

The score per module is killed / (killed + survived), where a timeout counts as killed (the
mutant hung a test) and "no tests" as survived (no fast test reaches the code). Survivors that
docs/mutation-testing.md lists as equivalent (a backticked mutant name in its table) are shown
apart and counted in a second score. Goal: >= 90% per module (docs/mutation-testing.md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "mutate"
DOC = ROOT / "docs" / "mutation-testing.md"
COPIED = ("rayshard", "plans", "storage", "actors", "cluster", "setup.py", "tests", "configs", "pyproject.toml")
GOAL = 0.90

# module -> the fast unit tests that decide it. The reshard planner and the chunk table come last.
_READ_PATH_TESTS = ["tests/unit/test_checksum_verification.py", "tests/unit/test_checkpoint_errors.py",
                    "tests/unit/test_partial_reads.py", "tests/unit/test_local_read_runs.py",
                    "tests/unit/test_checkpoint_format.py"]
_TRANSFORM_TESTS = ["tests/unit/test_transforms.py", "tests/unit/test_hf_interop.py"]
_PLANNER_TESTS = ["tests/unit/test_reshard_planner.py", "tests/unit/test_chunk_table.py", "tests/unit/test_plan_scale_columns.py",
                  "tests/unit/test_partial_reads.py", "tests/unit/test_local_read_runs.py",
                  "tests/unit/test_checkpoint_format.py"]
MODULES: dict[str, list[str]] = {
    "actors/model/rope.py": ["tests/unit/test_rope.py"],
    "plans/pipeline/checker.py": ["tests/unit/test_checker.py", "tests/unit/test_schedules.py"],
    "plans/pipeline/lowering.py": ["tests/unit/test_lowering.py", "tests/unit/test_checker.py", "tests/unit/test_schedules.py",
                                   "tests/unit/test_pipeline_plan.py"],
    "plans/transforms/mapping.py": _TRANSFORM_TESTS,
    "cluster/checkpoint/transform_exec.py": _TRANSFORM_TESTS,
    "plans/checkpoint/replicas.py": ["tests/unit/test_writer_selection.py", "tests/unit/test_replica_broadcast.py"],
    "plans/layout/parallel_layout.py": ["tests/unit/test_layout_and_config.py", "tests/unit/test_layout_chooser.py"],
    "storage/checksums.py": _READ_PATH_TESTS,
    "actors/checkpoint/read_executor.py": _READ_PATH_TESTS,
    "plans/checkpoint/expert_coverage.py": ["tests/unit/test_expert_coverage.py"],
    "plans/checkpoint/regions.py": _PLANNER_TESTS,
    "plans/checkpoint/reshard.py": _PLANNER_TESTS,
    "plans/checkpoint/chunk_table.py": _PLANNER_TESTS,
}

KILLED = {"killed", "timeout", "segfault", "caught by type check"}
SURVIVED = {"survived", "no tests", "suspicious"}


def _slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _prepare(module: str, tests: list[str], fresh: bool) -> Path:
    """A copy of the tree for this module, with [tool.mutmut] narrowed to it and its tests."""
    work = WORK / _slug(module)
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        source, target = ROOT / name, work / name
        if source.is_dir():
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis"))
        else:
            shutil.copy2(source, target)
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"].get("mutmut", {})
    settings = dict(base, only_mutate=[module], pytest_add_cli_args_test_selection=[t for t in tests if (ROOT / t).exists()])
    text = (work / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    lines = ["[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    (work / "pyproject.toml").write_text(text.rstrip() + "\n\n" + "\n".join(lines) + "\n")
    return work


def _run_mutmut(work: Path, names: list[str]) -> int:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", "1", *names]
    return subprocess.call(command, cwd=work, env=env)


def _results(work: Path, module: str) -> dict[str, str]:
    from mutmut.stats import status_by_exit_code

    meta = work / "mutants" / (module + ".meta")
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {name: status_by_exit_code[code] for name, code in codes.items()}


def documented_equivalents() -> dict[str, str]:
    """Mutant name -> reason, from the table rows of docs/mutation-testing.md."""
    if not DOC.exists():
        return {}
    found = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\|\s*`([\w.]+__mutmut_\d+)`\s*\|\s*(.*?)\s*\|\s*$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def _show(work: Path, module: str, name: str) -> str:
    # In-process: `mutmut show` starts a Python per survivor, seconds each on a loaded machine.
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    here = Path.cwd()
    try:
        os.chdir(work)
        text = get_diff_for_mutant(name, path=module)
    except Exception as error:  # a report must not die on one unreadable mutant
        text = f"-(diff unavailable: {error})"
    finally:
        os.chdir(here)
    diff = [line for line in text.splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    return " | ".join(line.strip() for line in diff)[:300]


def report(modules: list[str], verbose: bool = True) -> bool:
    equivalents = documented_equivalents()
    all_good = True
    print(f"\n{'module':42} {'mutants':>7} {'killed':>6} {'surv.':>5} {'equiv.':>6} {'score':>6} {'w/ equiv.':>9}")
    details = []
    for module in modules:
        work = WORK / _slug(module)
        results = _results(work, module)
        if not results:
            print(f"{module:42} {'not run':>7}")
            all_good = False
            continue
        killed = sum(status in KILLED for status in results.values())
        survivors = sorted(name for name, status in results.items() if status in SURVIVED)
        unchecked = sorted(name for name, status in results.items() if status not in KILLED | SURVIVED)
        equivalent = [name for name in survivors if name in equivalents]
        score = killed / max(1, killed + len(survivors))
        with_equivalents = (killed + len(equivalent)) / max(1, killed + len(survivors))
        all_good &= with_equivalents >= GOAL and not unchecked
        print(f"{module:42} {len(results):7} {killed:6} {len(survivors):5} {len(equivalent):6} {score:6.1%} {with_equivalents:9.1%}"
              + (f"  ({len(unchecked)} not checked)" if unchecked else ""))
        details.append((module, work, survivors, equivalent, unchecked, results))
    if verbose:
        for module, work, survivors, equivalent, unchecked, results in details:
            open_survivors = [name for name in survivors if name not in equivalent]
            if open_survivors or equivalent:
                print(f"\n{module}:")
            for name in open_survivors:
                print(f"  SURVIVED ({results[name]}) {name}: {_show(work, module, name)}")
            for name in equivalent:
                print(f"  equivalent {name}: {equivalents[name]}")
            for name in unchecked:
                print(f"  {results[name]} {name}")
            timeouts = sorted(name for name, status in results.items() if status == "timeout")
            if timeouts:  # counted as killed: the mutant made a test hang or spin
                print(f"  {module}: {len(timeouts)} timeout(s), counted as killed: {', '.join(timeouts)}")
    print(f"\ngoal: >= {GOAL:.0%} killed per module, documented equivalents counted "
          f"({'met' if all_good else 'NOT met'})")
    return all_good


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="words that select modules by path (default: all)")
    parser.add_argument("--report", action="store_true", help="only print the scores of the last runs")
    parser.add_argument("--survivors", action="store_true",
                        help="re-run only the last run's survivors of each module (after adding tests)")
    parser.add_argument("--resume", action="store_true",
                        help="keep each module's copy and results; run only the mutants not checked yet")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run only mutants whose name matches this fnmatch pattern (repeatable), e.g. "
                             "'*x_plan_reads*' for one function of a module too big to run whole; the rest "
                             "are reported as not checked")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a module misses the goal")
    args = parser.parse_args(argv)
    chosen = [m for m in MODULES if not args.modules or any(word in m for word in args.modules)]
    if not chosen:
        parser.error(f"no module matches {args.modules}; modules: {', '.join(MODULES)}")
    if not args.report:
        for module in chosen:
            print(f"\n=== {module}: {' '.join(MODULES[module])}", flush=True)
            if args.survivors:
                previous = _results(WORK / _slug(module), module)
                names = sorted(name for name, status in previous.items() if status in SURVIVED)
                if not names:
                    continue
                work = _prepare(module, MODULES[module], fresh=False)
                _run_mutmut(work, names)
            else:
                work = _prepare(module, MODULES[module], fresh=not args.resume)
                _run_mutmut(work, args.only)
    good = report(chosen)
    return 1 if args.strict and not good else 0


if __name__ == "__main__":
    sys.exit(main())
