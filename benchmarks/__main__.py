"""Runner: ``python -m benchmarks [--quick] [--only CASE ...] [--reps N] [--write-doc]``.

For each case and each repetition it runs bigmodel, accelerate and the floor, in that
order (A/B/floor, A/B/floor, ...), each in a fresh child process, and reports medians.
A child that fails shows as ``error: <one line>`` (traceback in ``.bench-cache/logs/``)
and the other measurements go on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from . import fixtures
from .cases import CASES, Case, Metric
from .measure import read_files

ORDER = ("bigmodel", "accelerate", "floor")
PRELOAD = ["torch", "numpy", "safetensors.torch", "transformers", "transformers.models.llama.modeling_llama",
           "benchmarks.fixtures", "benchmarks.measure", "benchmarks.cases", "benchmarks.worker"]
DOC_BEGIN, DOC_END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Children:
    """Starts one child per measurement from a fork server that preloaded torch/transformers."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.logs = fixtures.CACHE / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, impl: str, params: dict[str, Any], timeout_s: float, tag: str) -> dict[str, Any]:
        from .worker import child_main

        log = self.logs / f"{name}.{impl}.{tag}.log"
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=child_main, args=(name, impl, params, child, str(log)))
        proc.start()
        child.close()
        result: dict[str, Any] | None = None
        if parent.poll(timeout_s):
            try:
                result = parent.recv()
            except EOFError:
                result = None
        proc.join(5 if result is not None else 0.1)
        if proc.is_alive():
            proc.kill()
            proc.join()
            if result is None:
                return {"ok": False, "error": f"timeout after {timeout_s:.0f} s (log: {log})"}
        if result is None:
            return {"ok": False, "error": f"child died with exit code {proc.exitcode} (log: {log})"}
        return result


# --- fixtures -------------------------------------------------------------------------------


def ensure_fixtures(children: Children, needs: set[str]) -> dict[str, Any]:
    """Build the missing fixtures (in children, so this process stays small); return the manifest."""
    manifest = fixtures.read_manifest()
    builders = {"llama": ("build_llama_checkpoints", 1800), "smollm2": ("build_smollm2", 900)}
    for need in sorted(needs):
        if need in manifest:
            continue
        fn, timeout = builders[need]
        _log(f"[fixtures] building {need} into {fixtures.CACHE} ...")
        t0 = time.perf_counter()
        res = children.run(fn, "fixture", {"cache": str(fixtures.CACHE)}, timeout, "build")
        if not res["ok"]:
            manifest.setdefault("errors", {})[need] = res["error"]
            _log(f"[fixtures] {need} failed: {res['error']}")
            continue
        manifest[need] = res["metrics"]
        manifest.setdefault("errors", {}).pop(need, None)
        fixtures.write_manifest(manifest)
        _log(f"[fixtures] {need} done in {time.perf_counter() - t0:.0f} s: {res['metrics']}")
    return manifest


def resolve_params(case: Case, manifest: dict[str, Any]) -> dict[str, Any]:
    """Turn symbolic device maps in a case's params into the concrete maps."""
    params = dict(case.params)
    named = params.get("device_map")
    if named == "half_disk":
        params["device_map"] = fixtures.half_disk_map(fixtures.LLAMA_2GB)
    elif named == "budget_600mb":
        params["device_map"] = fixtures.budget_map(fixtures.LLAMA_2GB, 600 * 10**6)
    elif named == "smollm2_half_disk":
        params["device_map"] = fixtures.smollm2_half_disk_map(manifest["smollm2"]["num_layers"])
    return params


# --- measuring --------------------------------------------------------------------------------


def measure_case(children: Children, case: Case, params: dict[str, Any], reps: int) -> dict[str, Any]:
    """Run ``reps`` rounds of bigmodel / accelerate / floor; an implementation stops after its first error."""
    runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in ORDER}
    errors: dict[str, str] = {}
    impls = [i for i in ORDER if i != "floor" or case.floor is not None]
    for rep in range(reps):
        for impl in impls:
            if impl in errors:
                continue
            if case.warm_files:
                read_files(fixtures.checkpoint_files(case.warm_files))
            res = children.run(case.name, impl, params, case.timeout_s, str(rep))
            if res["ok"]:
                runs[impl].append(res["metrics"])
                shown = ", ".join(f"{k}={v:.4g}" for k, v in res["metrics"].items())
            else:
                errors[impl] = res["error"]
                shown = "error: " + res["error"]
            _log(f"  {case.name} [{impl} #{rep + 1}] {shown}")
    return {"runs": runs, "errors": errors}


def _median(values: list[dict[str, float]], key: str) -> float | None:
    vals = [v[key] for v in values if key in v]
    return statistics.median(vals) if vals else None


# --- the table --------------------------------------------------------------------------------


def _fmt(metric: Metric, value: float | None, error: str | None) -> str:
    if error is not None:
        return f"error: {error}"
    return "—" if value is None else metric.fmt.format(value)


def _ratio(a: float | None, b: float | None, metric: Metric | None = None) -> str:
    """a / b; "—" when either is missing, or for memory rows whose denominator is under 10 MB (noise)."""
    small = 10.0 if metric is not None and metric.key.endswith("_mb") else 0.0
    return "—" if a is None or b is None or b <= small or b == 0 else f"{a / b:.2f}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, res in results.items():
        case = CASES[name]
        for metric in case.metrics:
            med = {impl: _median(res["runs"][impl], metric.key) for impl in ORDER}
            floor = metric.budget if metric.budget is not None else med["floor"]
            err = res["errors"]
            n = min((len(res["runs"][i]) for i in ("bigmodel", "accelerate") if res["runs"][i]), default=0)
            rows.append([
                f"{case.title}: {metric.label}" + (f" [n={n}]" if n != results[name]["reps"] else ""),
                _fmt(metric, med["bigmodel"], err.get("bigmodel")),
                _fmt(metric, med["accelerate"], err.get("accelerate")),
                _ratio(med["bigmodel"], med["accelerate"], metric),
                _fmt(metric, floor, err.get("floor") if metric.budget is None else None),
                _ratio(med["bigmodel"], floor, metric),
                _ratio(med["accelerate"], floor, metric),
            ])
    rows += _growth_rows(results)
    return rows


def _growth_rows(results: dict[str, Any]) -> list[list[str]]:
    """Planning time at 4x layers over 1x (linear growth = 4.0)."""
    rows = []
    for kind in ("llama405b", "moe"):
        one, four = results.get(f"plan_{kind}_1x"), results.get(f"plan_{kind}_4x")
        if not one or not four:
            continue
        cells = []
        for impl in ORDER:
            a, b = _median(four["runs"][impl], "time_s"), _median(one["runs"][impl], "time_s")
            cells.append(None if a is None or b is None or b == 0 else a / b)
        fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append([f"infer_auto_device_map {kind}: time 4x layers / 1x (linear = 4)", fmt(cells[0]),
                     fmt(cells[1]), "—", fmt(cells[2]), "—", "—"])
    return rows


HEADER = ["case", "bigmodel", "accelerate", "bigmodel/accelerate", "floor", "bigmodel/floor", "accelerate/floor"]


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] + ["---:"] * (len(HEADER) - 1)) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def consistency_notes(results: dict[str, Any]) -> list[str]:
    """Outputs that should agree across implementations (logits, generated tokens)."""
    notes = []
    for name, res in results.items():
        for key in ("logits_sum", "tokens_sum"):
            vals = {impl: _median(res["runs"][impl], key) for impl in ORDER}
            if vals["floor"] is None:
                continue
            for impl in ("bigmodel", "accelerate"):
                v = vals[impl]
                if v is not None and abs(v - vals["floor"]) > 1e-6 * max(1.0, abs(vals["floor"])):
                    notes.append(f"{name}: {impl} {key} {v!r} differs from the floor's {vals['floor']!r}")
    return notes


def noise_notes(results: dict[str, Any]) -> list[str]:
    """Rows where the per-process ranges of bigmodel and accelerate, or bigmodel and the floor, overlap.

    There the ratio cannot be told from run-to-run noise (load from other jobs); the note lists the values.
    """
    notes = []
    for name, res in results.items():
        for metric in CASES[name].metrics:
            per = {i: [r[metric.key] for r in res["runs"][i] if metric.key in r] for i in ORDER}
            overlap = [
                f"bigmodel~{other}" for other in ("accelerate", "floor")
                if len(per["bigmodel"]) > 1 and len(per[other]) > 1
                and max(per[other] + per["bigmodel"]) > (10.0 if metric.key.endswith("_mb") else 0.0)
                and min(per["bigmodel"]) <= max(per[other]) and min(per[other]) <= max(per["bigmodel"])
            ]
            if overlap:
                shown = "; ".join(f"{i} " + " / ".join(metric.fmt.format(x) for x in v) for i, v in per.items() if v)
                notes.append(f"within noise ({', '.join(overlap)} per-process ranges overlap): "
                             f"{CASES[name].title}: {metric.label}: {shown}")
    return notes


# --- environment and the document -------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))) * 1024
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=fixtures.ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, Linux {platform.release()}",
        "versions": (f"python {platform.python_version()}, torch {_version('torch')}, transformers "
                     f"{_version('transformers')}, safetensors {_version('safetensors')}, accelerate "
                     f"{_version('accelerate')}, bigmodel {_version('bigmodel')} (git {commit}, working tree)"),
        "load": "load average %.1f / %.1f / %.1f" % os.getloadavg(),
    }


def write_doc(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{DOC_BEGIN}\n{DOC_END}\n"
    if DOC_BEGIN not in text or DOC_END not in text:
        raise SystemExit(f"{path} has no {DOC_BEGIN} ... {DOC_END} markers; add them where the table goes")
    pattern = re.compile(re.escape(DOC_BEGIN) + ".*?" + re.escape(DOC_END), re.S)
    path.write_text(pattern.sub(lambda _: f"{DOC_BEGIN}\n{section}\n{DOC_END}", text))


# --- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repetition, 1x planning shapes only: a smoke run")
    ap.add_argument("--only", nargs="+", metavar="CASE", help=f"cases to run: {', '.join(CASES)}")
    ap.add_argument("--reps", type=int, help="repetitions per implementation (default 3, --quick 1)")
    ap.add_argument("--write-doc", action="store_true", help="put the table into BENCHMARKS.md")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for case in CASES.values():
            print(f"{case.name:28s} {case.title}")
        return 0
    unknown = [n for n in args.only or [] if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from: {', '.join(CASES)}")
    selected = [CASES[n] for n in (args.only or CASES) if args.only or not args.quick or CASES[n].quick]
    reps = args.reps or (1 if args.quick else 3)
    started, env_before = time.perf_counter(), environment()
    children = Children()
    manifest = ensure_fixtures(children, {n for c in selected for n in c.needs})
    results: dict[str, Any] = {}
    for case in selected:
        missing = [n for n in case.needs if n not in manifest]
        if missing:
            why = "; ".join(manifest.get("errors", {}).get(n, "fixture missing") for n in missing)
            results[case.name] = {"reps": reps, "runs": {i: [] for i in ORDER},
                                  "errors": {i: f"skipped, fixture {missing}: {why}" for i in ORDER}}
            continue
        _log(f"[{case.name}] {case.title}")
        results[case.name] = dict(measure_case(children, case, resolve_params(case, manifest), reps), reps=reps)
    elapsed = time.perf_counter() - started
    rows = table_rows(results)
    notes = consistency_notes(results) + noise_notes(results)
    env = environment()
    command = "python -m benchmarks" + (" --quick" if args.quick else "") + (
        f" --only {' '.join(args.only)}" if args.only else "") + (f" --reps {args.reps}" if args.reps else "")
    section = "\n".join([
        f"Run: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, `{command}` (via `.venv-bench`), "
        f"{reps} repetition(s) per implementation, whole run {elapsed / 60:.1f} min.",
        "", f"- Machine: {env['machine']}", f"- Versions: {env['versions']}",
        f"- System load: {env_before['load']} at start, {env['load']} at end", "",
        markdown_table(rows), "",
    ] + [f"- note: {n}" for n in notes])
    print(section)
    (fixtures.CACHE / "latest.json").write_text(json.dumps({"results": results, "env": env}, indent=1))
    (fixtures.CACHE / "latest.md").write_text(section + "\n")
    if args.write_doc:
        write_doc(fixtures.ROOT / "BENCHMARKS.md", section)
        _log("BENCHMARKS.md updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
