"""Mutation testing of one servesim module with mutmut (not part of CI: minutes per module).

mutmut derives a mutant's module name from its file path (``simulator/metrics.py`` →
``simulator.metrics``), while the code is imported as ``servesim.simulator.metrics`` (the
``package-dir`` mapping). So this script stages a copy of the project in the
``servesim/<folder>`` layout under ``.mutation/<module>/`` (git-ignored), writes a
``[tool.mutmut]`` config there and runs mutmut in it; the mutated copies are imported ahead of
the editable install. Nothing in the working tree is modified.

    python benchmarks/mutation.py simulator/metrics.py            # default tests (TESTS below)
    python benchmarks/mutation.py costmodels/step.py --tests tests/costmodels
    python benchmarks/mutation.py workloads/generators.py --survivors   # + diff of each survivor
    python benchmarks/mutation.py --list                         # modules with default tests
    python benchmarks/mutation.py simulator/scheduler.py --resume  # continue a stopped run,
                                                   # then re-test its survivors with new tests

Prints the score (killed / (killed + survived + timeout + no tests)) and writes
``.mutation/<module>/summary.json`` (counts, survivors with their diffs). Log and error
message strings are not mutated (``DO_NOT_MUTATE`` patterns below; add ``# pragma: no mutate``
to a line for anything else that is deliberately untested). Record the score and the reasoning
for each survivor in ``tests/MUTATION.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("simulator", "costmodels", "kernels", "workloads", "reports", "configs")
STAGE = ROOT / ".mutation"

# The tests that pin each module (paths relative to the repository root). Kept focused so a
# run takes minutes; the whole suite would give the same score, much more slowly.
_CORE_TESTS = [f"tests/simulator/{f}.py" for f in (
    "test_differential", "test_conformance", "test_conformance_v022", "test_rules",
    "test_properties", "test_block_pool", "test_engine", "test_quiet_steps", "test_spec_decode",
    "test_lora", "test_client_control", "test_frontend", "test_metrics_units")] + [
    "tests/policies", "tests/cluster/test_offload.py", "tests/oracles/test_metric_oracles.py",
    "tests/oracles/test_metric_oracles_engine.py"]

TESTS: dict[str, list[str]] = {
    "simulator/metrics.py": ["tests/simulator/test_metrics_units.py",
                             "tests/oracles/test_metric_oracles.py",
                             "tests/oracles/test_metric_oracles_engine.py",
                             "tests/reports/test_bench_result.py"],
    "reports/bench_result.py": ["tests/reports/test_bench_result_units.py",
                                "tests/reports/test_bench_result.py",
                                "tests/oracles/test_metric_oracles.py",
                                "tests/oracles/test_metric_oracles_engine.py"],
    "reports/bench_stats.py": ["tests/reports/test_bench_result_units.py",
                               "tests/reports/test_bench_result.py",
                               "tests/oracles/test_metric_oracles.py",
                               "tests/oracles/test_metric_oracles_engine.py"],
    "reports/bench_requests.py": ["tests/reports/test_bench_result_units.py",
                                  "tests/reports/test_bench_result.py",
                                  "tests/oracles/test_metric_oracles.py",
                                  "tests/oracles/test_metric_oracles_engine.py"],
    "costmodels/step.py": ["tests/costmodels/test_cost_values.py",
                           "tests/costmodels/test_cost_values_calibrated.py",
                           "tests/costmodels/test_cost_step.py",
                           "tests/costmodels/test_cost_calibration.py"],
    "costmodels/operators.py": ["tests/costmodels/test_cost_values.py",
                                "tests/costmodels/test_cost_values_calibrated.py",
                                "tests/costmodels/test_cost_step.py",
                                "tests/costmodels/test_cost_calibration.py"],
    "costmodels/attention.py": ["tests/costmodels/test_cost_values.py",
                                "tests/costmodels/test_cost_values_calibrated.py",
                                "tests/costmodels/test_cost_step.py",
                                "tests/costmodels/test_cost_calibration.py"],
    "costmodels/engine_defaults.py": ["tests/costmodels/test_cost_values_calibrated.py",
                                      "tests/costmodels/test_cost_values.py",
                                      "tests/costmodels/test_cost_step.py",
                                      "tests/simulator/test_conformance_v022.py"],
    "costmodels/memory.py": ["tests/costmodels/test_cost_values_memory.py",
                             "tests/costmodels/test_cost_memory.py"],
    "workloads/generators.py": ["tests/workloads/test_distributions.py",
                                "tests/workloads/test_random.py",
                                "tests/workloads/test_synthetic.py"],
    "simulator/plan/search.py": ["tests/plan/test_search_values.py",
                                 "tests/oracles/test_statistics.py",
                                 "tests/plan/test_search.py"],
    "reports/ab.py": ["tests/oracles/test_statistics.py", "tests/sweeps/test_ab_stats.py"],
    # differential (independent vLLM reference), conformance, worked traces, properties and
    # the engine tests; not the CLI, fit and shipped-config tests (slow, and they pin nothing
    # of the scheduler's decisions the others do not)
    "simulator/scheduler.py": _CORE_TESTS,
    "simulator/decode_group.py": _CORE_TESTS,
    "simulator/request_queue.py": _CORE_TESTS,
    "simulator/scheduler_output.py": _CORE_TESTS,
    "simulator/kv_cache.py": _CORE_TESTS,
    "simulator/block_pool.py": _CORE_TESTS,
}

# Lines matching these regexes are not mutated (whole statements starting on them): messages
# for people, whose wording no test should pin.
DO_NOT_MUTATE = [
    r"^\s*raise \w+(Error|Exception|Interrupted)?\(",
    r"warnings\.warn\(",
    r"\blog(ger)?\.(debug|info|warning|error|exception)\(",
    r"^\s*(assert) ",
    r"^\s*print\(",
    r"^\s*\"\"\"",  # docstrings
]


def stage(module: str, tests: list[str]) -> Path:
    """A copy of the project in the ``servesim/<folder>`` layout with a mutmut config."""
    slug = module.removesuffix(".py").replace("/", ".")
    d = STAGE / slug
    if d.exists():
        shutil.rmtree(d)
    (d / "servesim").mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # which tests run which functions: collected again (a test that existed may now call
    # more of the module; mutmut only re-collects for tests with new names)
    (d / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, d / "servesim" / pkg, ignore=ignore)
    shutil.copytree(ROOT / "tests", d / "tests", ignore=ignore)
    for name in ("README.md",):
        shutil.copy2(ROOT / name, d / name)
    # Tests read configs/ at the repository root and compare it with the package's own
    # (resolved) folder: in mutmut's copy, servesim/configs is a link to a real configs/.
    (d / "mutants" / "servesim").mkdir(parents=True)
    shutil.copytree(ROOT / "configs", d / "mutants" / "configs", ignore=ignore)
    os.symlink("../configs", d / "mutants" / "servesim" / "configs")
    toml = "\n".join([
        "[tool.mutmut]",
        'source_paths = ["servesim"]',
        f'only_mutate = ["servesim/{module}"]',
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        '# README.md is read by a test',
        'also_copy = ["README.md"]',
        f"do_not_mutate_patterns = {json.dumps(DO_NOT_MUTATE)}",
        "timeout_multiplier = 4.0",
        "timeout_constant = 5.0",
        "use_git_change_detection = false",
        "",
        "[tool.pytest.ini_options]",
        'testpaths = ["tests"]',
        'addopts = "-p no:cacheprovider -q -x"',
        "",
    ])
    (d / "pyproject.toml").write_text(toml)
    return d


def refresh_tests(d: Path, module: str, tests: list[str]) -> None:
    """Copy the working tree's tests, the other modules and the module's test selection into
    a staged run (mutmut collects stats for new tests and keeps every verdict already
    reached; the mutated module stays as it was staged)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # which tests run which functions: collected again (a test that existed may now call
    # more of the module; mutmut only re-collects for tests with new names)
    (d / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    for pkg in PACKAGES:
        for src in (ROOT / pkg).rglob("*.py"):
            rel = src.relative_to(ROOT)
            if rel.as_posix() == module:
                continue
            for base in (d / "servesim", d / "mutants" / "servesim"):
                dest = base / rel
                if dest.parent.is_dir() and (not dest.exists()
                                             or dest.read_bytes() != src.read_bytes()):
                    shutil.copy2(src, dest)
    for dest in (d / "tests", d / "mutants" / "tests"):
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(ROOT / "tests", dest, ignore=ignore)
    for toml in (d / "pyproject.toml", d / "mutants" / "pyproject.toml"):
        if toml.exists():
            lines = toml.read_text().splitlines()
            toml.write_text("\n".join(
                f"pytest_add_cli_args_test_selection = {json.dumps(tests)}"
                if ln.startswith("pytest_add_cli_args_test_selection") else ln
                for ln in lines) + "\n")


def mutmut(d: Path, *args: str) -> subprocess.CompletedProcess:
    # `mutmut run`, not `python -m mutmut`: mutmut must stay the __main__ it was imported as
    code = "import sys; from mutmut.__main__ import cli; sys.argv[0] = 'mutmut'; cli()"
    # SERVESIM_FUZZ=quick: the hypothesis tests run a fifth of their CI examples (a survivor
    # runs every selected test; the score is then a slight underestimate of CI's suite)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", SERVESIM_FUZZ="quick")
    return subprocess.run([sys.executable, "-c", code, *args], check=False, cwd=d, env=env,
                          capture_output=True, text=True)


def mutant_names(d: Path, module: str) -> list[str]:
    meta = d / "mutants" / "servesim" / (module + ".meta")
    return sorted(json.loads(meta.read_text())["exit_code_by_key"])


def summarize(d: Path, module: str, with_diffs: bool, only: list[str] | None = None) -> dict:
    """Counts and score over every mutant of ``module`` (or the sample ``only``)."""
    meta = d / "mutants" / "servesim" / (module + ".meta")
    data = json.loads(meta.read_text())
    codes = data["exit_code_by_key"]
    if only is not None:
        codes = {k: codes.get(k) for k in only}
    status = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
              34: "skipped", 36: "timeout", 37: "caught by type check", None: "not checked",
              -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}
    by: dict[str, list[str]] = {}
    for k, v in codes.items():
        by.setdefault(status.get(v, "suspicious"), []).append(k)
    killed = len(by.get("killed", [])) + len(by.get("timeout", []))
    considered = killed + len(by.get("survived", [])) + len(by.get("no tests", []))
    out = {"module": module, "date": time.strftime("%Y-%m-%d"),
           "counts": {k: len(v) for k, v in sorted(by.items())},
           "score": killed / considered if considered else None,
           "survivors": {}}
    if only is not None and considered:  # a uniform sample: Wilson 95% interval of the score
        z, p = 1.96, killed / considered
        c = (p + z * z / (2 * considered)) / (1 + z * z / considered)
        h = z * math.sqrt(p * (1 - p) / considered + z * z / (4 * considered ** 2)) / (
            1 + z * z / considered)
        out["sample"] = {"size": len(only), "of": len(data["exit_code_by_key"]),
                         "score_95ci": [round(c - h, 4), round(c + h, 4)]}
    for name in sorted(by.get("survived", []) + by.get("no tests", [])):
        out["survivors"][name] = mutmut(d, "show", name).stdout if with_diffs else ""
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("module", nargs="?", help="e.g. simulator/metrics.py")
    ap.add_argument("--tests", nargs="*", help="pytest paths (default: TESTS[module])")
    ap.add_argument("--max-children", type=int, default=3)
    ap.add_argument("--survivors", action="store_true", help="print each survivor's diff")
    ap.add_argument("--list", action="store_true", help="modules with default test lists")
    ap.add_argument("--sample", type=int, default=0, metavar="N",
                    help="test a uniform random sample of N mutants (seeded, --seed) and "
                    "report its score with a 95%% interval (a whole module can take hours)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true",
                    help="keep the staged mutants and their verdicts: refresh the tests, test "
                    "the mutants not yet decided, then re-test the survivors")
    a = ap.parse_args()
    if a.list or not a.module:
        for m, t in TESTS.items():
            print(f"{m:32s} {' '.join(t)}")
        return 0
    tests = a.tests or TESTS.get(a.module)
    if not tests:
        ap.error(f"no default tests for {a.module}: pass --tests")
    slug = a.module.removesuffix(".py").replace("/", ".")
    d = STAGE / slug
    if a.resume and (d / "mutants").is_dir():
        refresh_tests(d, a.module, tests)
    else:
        d = stage(a.module, tests)
    t0 = time.perf_counter()
    only = None
    if a.sample:
        if not (d / "mutants" / "servesim" / (a.module + ".meta")).exists():
            mutmut(d, "run", "--max-children", "1", "no-such-mutant")  # generate the mutants
        names = mutant_names(d, a.module)
        only = sorted(random.Random(a.seed).sample(names, min(a.sample, len(names))))
        todo = only
        if a.resume:  # (named mutants are always re-tested: name only the undecided ones)
            codes = json.loads((d / "mutants" / "servesim" / (a.module + ".meta"))
                               .read_text())["exit_code_by_key"]
            todo = [m for m in only if codes.get(m) is None]
        runs = [("run", "--max-children", str(a.max_children), *todo)] if todo else []
    else:
        runs = [("run", "--max-children", str(a.max_children))]
    if a.resume:  # then the survivors again, against the refreshed tests
        runs.append(None)
    for args in runs:
        if args is None:
            names = list(summarize(d, a.module, False, only)["survivors"])
            if not names:
                break
            args = ("run", "--max-children", str(a.max_children), *names)
        r = mutmut(d, *args)
        with open(d / "mutmut-run.log", "a") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            print(r.stdout[-4000:], r.stderr[-4000:], sep="\n")
            print(f"mutmut run failed (exit {r.returncode}); log: {d / 'mutmut-run.log'}")
            return 1
    s = summarize(d, a.module, a.survivors, only)
    s["seconds"] = round(time.perf_counter() - t0)
    (d / "summary.json").write_text(json.dumps(s, indent=1))
    score = "n/a" if s["score"] is None else f"{100 * s['score']:.1f}%"
    if only is not None:
        lo, hi = s["sample"]["score_95ci"]
        score += f" (sample of {len(only)} / {s['sample']['of']}: 95% CI {100 * lo:.1f}–{100 * hi:.1f}%)"
    print(f"{a.module}: score {score}  {s['counts']}  ({s['seconds']} s)")
    for name, diff in s["survivors"].items():
        print(diff if a.survivors else f"  survived: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
