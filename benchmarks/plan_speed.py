"""How long planning takes: ``dsopt ledger`` wall seconds, cold (an empty cache folder) and warm.

Each figure is one run of ``python -m optimizer.cli`` (this interpreter) as a subprocess, with ``DSOPT_CACHE_DIR``
set to a fresh temporary folder for the cold runs, kept for the warm one (launchers/trace/cache_dir.py); its startup and
imports are in the figure, as a user sees them. The study files are copied into a temporary folder first, so the
runs write nothing into studies/:

* (a) one candidate of the 7B study, ``--set zero_stage=3 --set precision=bf16``, cold: target ≤ 10 s;
* (b) ``--all`` of the 70B study, cold (every (checkpointing, precision, micro-batch) of its space traced):
  target ≤ 60 s;
* (c) the same, warm: target ≤ 2 s;
* (d) the Llama-2-7B LoRA study on one 24 GiB GPU (``studies/llama-7b-lora-1x4090.yaml``), its whole plan, cold
  (its inventory from the PEFT'd fake build and every traced combination included): target ≤ 60 s;
* (e) one candidate of it (``--set zero_stage=0 --set precision=bf16 --set checkpointing=full``), cold: ≤ 10 s;
* (f) the Llama-2-70B QLoRA study on one 48 GB card (``studies/llama-70b-qlora-1x48gb.yaml``), its whole plan, cold
  (the 4-bit layers marked by transformers' rule on the fake build, every combination traced): no target set by an
  issue, 60 s shown for scale;
* (g) one candidate of it (``--set zero_stage=0 --set checkpointing=full --set micro_batch_size=1``), cold: ≤ 10 s
  shown for scale.

It prints the figures beside the targets and asserts nothing timed (a shared machine's load moves them).

    .venv/bin/python benchmarks/plan_speed.py [--only a,b,c,d,e]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS_S = {"a": 10.0, "b": 60.0, "c": 2.0, "d": 60.0, "e": 10.0, "f": 60.0, "g": 10.0}


def _copy_study(name: str, folder: Path) -> Path:
    """``studies/NAME.yaml`` and the search spaces it names, copied under ``folder`` (same relative layout)."""
    (folder / "studies").mkdir(parents=True, exist_ok=True)
    if not (folder / "search_spaces").exists():
        shutil.copytree(ROOT / "search_spaces", folder / "search_spaces")
    shutil.copy(ROOT / "studies" / f"{name}.yaml", folder / "studies" / f"{name}.yaml")
    return folder / "studies" / f"{name}.yaml"


def _timed(args: list[str], *, cache: Path) -> tuple[float, int, str]:
    """(wall seconds, exit code, last stderr line) of ``python -m optimizer.cli ARGS`` with this cache folder."""
    env = {**os.environ, "DSOPT_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "optimizer.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    wall_s = time.perf_counter() - start
    err = done.stderr.strip().splitlines()
    return wall_s, done.returncode, err[-1] if err else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="a,b,c,d,e", help="which figures, comma-separated (default a,b,c,d,e)")
    only = set(parser.parse_args().only.split(","))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsopt-plan-speed-") as tmp:
        work = Path(tmp)
        small = _copy_study("llama-7b-8xh100", work)
        large = _copy_study("llama-70b-8xh100", work)
        lora = _copy_study("llama-7b-lora-1x4090", work)
        qlora = _copy_study("llama-70b-qlora-1x48gb", work)
        runs = {
            "a": ("7B, one candidate (--set zero_stage=3 --set precision=bf16), cold",
                  ["ledger", str(small), "--set", "zero_stage=3", "--set", "precision=bf16"], work / "cache-a"),
            "b": ("70B, --all, cold", ["ledger", "--all", str(large)], work / "cache-b"),
            "c": ("70B, --all, warm", ["ledger", "--all", str(large)], work / "cache-b"),
            "d": ("7B LoRA on 1 x 24 GiB, the plan, cold", ["ledger", str(lora)], work / "cache-d"),
            "e": ("7B LoRA, one candidate (--set zero_stage=0 --set precision=bf16 --set checkpointing=full), cold",
                  ["ledger", str(lora), "--set", "zero_stage=0", "--set", "precision=bf16", "--set",
                   "checkpointing=full"], work / "cache-e"),
            "f": ("70B QLoRA on 1 x 48 GB, the plan, cold", ["ledger", str(qlora)], work / "cache-f"),
            "g": ("70B QLoRA, one candidate (--set zero_stage=0 --set checkpointing=full --set micro_batch_size=1), "
                  "cold", ["ledger", str(qlora), "--set", "zero_stage=0", "--set", "checkpointing=full", "--set",
                           "micro_batch_size=1"], work / "cache-g"),
        }
        if "c" in only and "b" not in only:  # warm needs the cache (b) fills: fill it untimed
            _timed(runs["b"][1], cache=runs["b"][2])
        for name, (what, args, cache) in runs.items():
            if name not in only:
                continue
            wall_s, code, last = _timed(args, cache=cache)
            rows.append((name, what, wall_s, code, last))
    print("| run | what | wall s | target s | exit |")
    print("|---|---|---|---|---|")
    for name, what, wall_s, code, _ in rows:
        print(f"| ({name}) | {what} | {wall_s:.2f} | ≤ {TARGETS_S[name]:g} | {code} |")
    for name, _, _, code, last in rows:
        if code != 0:
            print(f"({name}) exited {code}: {last}")
    print(f"\n{os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
