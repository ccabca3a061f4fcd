"""The small CPU study whose candidates need DeepSpeed's JIT-built ops (shared by the op tests and the session's
background build in tests/conftest.py), and that build itself: ``python tests/ops_study.py FOLDER``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from optimizer.study.study_file import StudySpec, load_study

ROOT = Path(__file__).resolve().parents[1]


def ops_study(folder: Path, *, nvme: bool = False, offload_optimizer=("none", "cpu"), accelerator: str = "cpu"
              ) -> StudySpec:
    """studies/cpu-tiny.yaml in ``folder`` with these offload knobs and accelerator (no trace: the ops are under
    test, not the ledger); with ``nvme`` an NVMe folder there and ``offload_param`` none/nvme too."""
    raw = yaml.safe_load((ROOT / "studies" / "cpu-tiny.yaml").read_text())
    knobs = raw["search_space"]["knobs"]
    knobs["offload_optimizer"] = list(offload_optimizer)
    raw["hardware"]["accelerator"] = accelerator
    raw["model"]["activations"] = "formula"
    if nvme:
        (folder / "nvme").mkdir(exist_ok=True)
        raw["hardware"]["nvme_path"] = str(folder / "nvme")
        knobs["offload_param"] = ["none", "nvme"]
    path = folder / "cpu-tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_study(path)


def main(folder: Path) -> int:
    """Build or load every op the suite's CPU runs use (shared memory, fused and CPU Adam, async I/O) as a study's
    first step does — dsopt's own ``prepare_ops``, under its node lock — at a low priority. The session killed (its
    xdist worker dead), this build ends as a killed ``dsopt`` does (:mod:`launchers.process.termination`): the
    build locks its op load holds recorded with their owner, so the next launch removes them, before it is
    stopped."""
    import signal

    import launchers.study.op_prep as op_prep
    from launchers.process.orphan_guard import die_with_parent
    from launchers.process.termination import end_on_termination, exit_status

    end_on_termination()
    die_with_parent(signal.SIGTERM)  # the session killed: this build goes too (op_load's goes with it)
    os.nice(10)  # the tests that run meanwhile come first
    spec = ops_study(folder, nvme=True, offload_optimizer=("none", "cpu", "nvme"))
    try:
        op_prep.prepare_ops(spec=spec, gpus=None, worker="the suite's op build", say=print)
    except KeyboardInterrupt as interrupt:
        return exit_status(interrupt)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
