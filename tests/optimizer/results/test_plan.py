"""The plan ``dsopt ledger STUDY`` prints (optimizer/results/plan.py) and the shortfalls it and ``--all`` share.

Expected figures are worked out by hand from the seed document's accounting (docs/ledger.md, "Seed mode";
optimizer/ledger/seed.py): Ψ = 1e9 parameters on N = 2 ranks of 24 GB, no allocator overhead, no reserve. Plain
data parallel in FP32 needs 4Ψ + 4Ψ + 8Ψ + 8 GB activations + 2 GB buffers = 26 GB; ZeRO-1/2/3 22/20/18 GB.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from optimizer.ledger.core import Ledger, evaluate
from optimizer.ledger.items import Category, LedgerItem, Location, Phase
from optimizer.perf.throughput import StepTime
from optimizer.results.plan import Limit, Shortfall, plan_json, plan_text, shortfalls
from optimizer.results.report import all_json, all_table, ledger_json
from optimizer.study.search_space import parse_search_space
from optimizer.study.specs import ModelInit, TrainingSpec, baseline_candidate
from optimizer.study.study_file import load_study
from optimizer.study.units import format_size

GB = 10**9
SEED_KNOBS = {"zero_stage": [0, 1, 2, 3], "offload_optimizer": ["none", "cpu"], "precision": ["fp32", "bf16"],
              "checkpointing": ["none", "full"], "micro_batch_size": [4]}  # search_spaces/seed.yaml


@pytest.fixture
def seed(seed_study_path):
    return load_study(seed_study_path)


@pytest.fixture(scope="module")
def llama7b():
    """studies/llama-7b-8xh100.yaml and the verdicts of its 2,160 candidates (search_spaces/default.yaml)."""
    study = load_study(Path(__file__).resolve().parents[3] / "studies" / "llama-7b-8xh100.yaml")
    return study, verdicts(study)


def verdicts(study, *, knobs=None, hardware=None, training=None):
    space = study.search_space if knobs is None else parse_search_space({"knobs": knobs}, source="test")
    return [evaluate(candidate=c, model=study.model, hardware=hardware or study.hardware,
                     training=training or study.training)
            for c in space.candidates(baseline_candidate(study.training))]


def step(tokens_per_s: float) -> StepTime:
    return StepTime(terms_s=(("compute", 1.0),), total_s=1.0, tokens_per_s=tokens_per_s, source="test rates")


def by_label(vs):
    return {v.candidate.label(): v for v in vs}


# --- shortfalls: which limit, by how much --------------------------------------------------------------------


def test_the_seed_data_parallel_baseline_is_2_gb_over_the_gpu_and_nothing_else_misses(seed):
    vs = by_label(verdicts(seed))
    missing = {label: shortfalls(v.ledger) for label, v in vs.items() if v.ledger is not None and not v.fits}
    assert missing == {"z0 fp32 ckpt=none mbs=4": (
        Shortfall(limit=Limit.GPU, phase=Phase.BACKWARD, needed_bytes=26 * GB, capacity_bytes=24 * GB),)}
    assert missing["z0 fp32 ckpt=none mbs=4"][0].over_bytes == 2 * GB
    assert shortfalls(vs["z1 fp32 ckpt=none mbs=4"].ledger) == ()  # 22 GB of 24


def test_a_small_host_is_named_as_the_binding_limit_with_its_excess(seed):
    # host_memory 10 GB. CPU optimizer offload puts each rank's share of the optimizer on the host:
    # fp32: Adam 8Ψ/N = 4 GB per rank, × 2 ranks = 8 GB (fits); bf16: + FP32 master 4Ψ/N = 6 GB per rank,
    # × 2 = 12 GB: 2 GB over, 20 % of the capacity. Their GPU side (≤ 10 GB) fits.
    small = dataclasses.replace(seed.hardware, host_memory_bytes=10 * GB)
    vs = verdicts(seed, hardware=small)
    host_bound = {v.candidate.label() for v in vs if v.ledger is not None and not v.fits}
    assert host_bound == {f"z{z} bf16 ckpt={c} mbs=4 opt->cpu" for z in (1, 2, 3) for c in ("none", "full")} | {
        "z0 fp32 ckpt=none mbs=4"}
    for label in host_bound - {"z0 fp32 ckpt=none mbs=4"}:
        (only,) = shortfalls(by_label(vs)[label].ledger)
        assert (only.limit, only.needed_bytes, only.capacity_bytes, only.over_bytes) == (
            Limit.HOST, 12 * GB, 10 * GB, 2 * GB)
        assert only.over_fraction == pytest.approx(0.2)
    text = plan_text(vs, {}, study="seed")
    assert "z1 bf16 ckpt=none mbs=4 opt->cpu  host RAM per node: needs 12.00 GB of 10.00 GB (+2.00 GB, +20.0%)" \
        in text
    # --all: the host-bound rows no longer read like a GPU problem
    table = all_table(vs, study="s").splitlines()
    assert any(r.startswith("  no: host ") and r.endswith("z3 bf16 ckpt=full mbs=4 opt->cpu") for r in table)
    assert any(r.startswith("  no: gpu ") and r.endswith("z0 fp32 ckpt=none mbs=4") for r in table)
    assert not any("does not fit" in r for r in table)


def test_the_closest_misses_come_first_relative_to_their_binding_limit(seed):
    # host 10 GB (as above): the bf16 offloads are 2/10 = 20 % over the host, the DP baseline 2/24 = 8.3 % over
    # the GPU: the baseline is the closest although both miss by 2 GB.
    small = dataclasses.replace(seed.hardware, host_memory_bytes=10 * GB)
    out = plan_json(verdicts(seed, hardware=small), {}, closest=3)
    closest = out["closest_not_fitting"]
    assert [e["label"] for e in closest] == ["z0 fp32 ckpt=none mbs=4", "z1 bf16 ckpt=full mbs=4 opt->cpu",
                                             "z1 bf16 ckpt=none mbs=4 opt->cpu"]
    assert closest[0]["shortfalls"] == [{"limit": "gpu", "phase": "backward", "needed": 26 * GB,
                                         "capacity": 24 * GB, "over": 2 * GB}]
    assert closest[1]["shortfalls"][0]["limit"] == "host"


def test_nvme_over_its_capacity(seed):
    # ZeRO-3 with the optimizer on NVMe, fp32: Adam 8Ψ/N = 4 GB per rank, × 2 ranks = 8 GB of a 5 GB NVMe.
    nvme = dataclasses.replace(seed.hardware, nvme_path="/nvme", nvme_bytes=5 * GB)
    (v,) = verdicts(seed, hardware=nvme, knobs={"zero_stage": [3], "offload_optimizer": ["nvme"],
                                                 "precision": ["fp32"], "checkpointing": ["full"]})
    # (only always-live items there: the ledger dates the peak to training's first phase, as its table does)
    assert shortfalls(v.ledger) == (
        Shortfall(limit=Limit.NVME, phase=Phase.BACKWARD, needed_bytes=8 * GB, capacity_bytes=5 * GB),)


def hand_ledger(*, init_gb: int) -> Ledger:
    """Always-live 10 GB, backward 5 GB and an init phase of ``init_gb`` on a 24 GB device, allocator +25 %,
    1 GB reserve."""
    items = [LedgerItem(name=n, category=Category.PARAMS, location=Location.GPU, bytes=b * GB, formula="", source="t",
                        phase=p) for n, b, p in (("a", 10, Phase.ALWAYS), ("b", 5, Phase.BACKWARD),
                                                 ("i", init_gb, Phase.INIT))]
    candidate = baseline_candidate(TrainingSpec(global_batch_size=8, micro_batch_size=1, sequence_length=64))
    return Ledger(candidate=candidate, items=tuple(items), ranks_per_node=1, device_is_host=False,
                  gpu_capacity_bytes=24 * GB, device_reserve_bytes=GB, allocator_overhead=0.25,
                  host_capacity_bytes=None, nvme_capacity_bytes=None)


def test_the_init_phase_binds_when_building_the_model_is_the_device_peak():
    # init 30 GB > always + backward = 15 GB: needed = 30 × 1.25 + 1 = 38.5 GB of 24 (training alone: 15 × 1.25 + 1
    # = 19.75 GB would fit)
    (init,) = shortfalls(hand_ledger(init_gb=30))
    assert (init.limit, init.phase, init.needed_bytes, init.over_bytes) == (
        Limit.INIT, Phase.INIT, 38_500_000_000, 14_500_000_000)
    # init 12 GB < 15: the peak is training's, 19.75 GB of 24: fits
    assert shortfalls(hand_ledger(init_gb=12)) == ()
    assert hand_ledger(init_gb=30).verdict_reasons() == ("GPU needs 38.50 GB of 24.00 GB",)


def test_shortfalls_carry_the_verdict_reasons_figures_for_a_70b_built_whole(repo_root):
    # model_init: full builds the whole model on every rank: nothing fits and ZeRO-3's device peak is the init
    # phase (tests/optimizer/ledger/test_init_ledger.py)
    study = load_study(repo_root / "studies" / "llama-70b-8xh100.yaml")
    full = dataclasses.replace(study.training, model_init=ModelInit.FULL)
    vs = verdicts(study, training=full)
    valid = [v.ledger for v in vs if v.ledger is not None]
    assert valid and not any(led.fits for led in valid)
    limits = set()
    for led in valid:
        falls, reasons = shortfalls(led), led.verdict_reasons()
        assert len(falls) == len(reasons)
        for fall in falls:
            limits.add(fall.limit)
            assert any(f"needs {format_size(fall.needed_bytes)} of {format_size(fall.capacity_bytes)}" in r
                       for r in reasons)
            assert (fall.limit is Limit.INIT) == (fall.limit in (Limit.GPU, Limit.INIT)
                                                   and led.peak_phase is Phase.INIT)
    assert {Limit.INIT, Limit.GPU, Limit.HOST} <= limits
    assert "GPU at init (building the model): needs" in plan_text(vs, {}, study="70b")


# --- the plan: fitting by speed, twins, invalid, counts ------------------------------------------------------


def test_fitting_candidates_by_speed_then_memory_and_the_fastest_named_first(seed):
    vs = verdicts(seed)
    speeds = {label: "unknown: no rates" for label in by_label(vs)}
    speeds |= {"z1 fp32 ckpt=none mbs=4": step(3000.0), "z2 fp32 ckpt=full mbs=4": step(5000.0),
               "z3 bf16 ckpt=none mbs=4": step(4000.0)}
    out = plan_json(vs, speeds)
    order = [e["label"] for e in out["fitting"]]
    # the known speeds highest first; then unknown, least memory first: ZeRO-3 bf16 checkpointed on the CPU
    # needs 2Ψ/N + 2Ψ/N + 3 GB × 2/4 + 2 GB = 5.5 GB
    assert order[:4] == ["z2 fp32 ckpt=full mbs=4", "z3 bf16 ckpt=none mbs=4", "z1 fp32 ckpt=none mbs=4",
                         "z3 bf16 ckpt=full mbs=4 opt->cpu"]
    assert out["fitting"][3]["needed"]["gpu"] == 11 * GB // 2 and out["fitting"][3]["tokens_per_s"] is None
    assert out["fastest"] == "z2 fp32 ckpt=full mbs=4" and len(order) == 27
    z1 = out["fitting"][2]  # 22 GB of 24: 2 GB headroom
    assert z1["headroom"]["gpu"] == 2 * GB and z1["headroom"]["gpu_fraction"] == pytest.approx(2 / 24)
    text = plan_text(vs, speeds, study="seed", top=5).splitlines()
    assert text[1:3] == ["fastest that fits: z2 fp32 ckpt=full mbs=4 — 5,000 tokens/s",
                         "  needs 15.00 GB per GPU of 24.00 GB; 9.00 GB left (37.5%)"]  # the seed: Z2 + ckpt 15 GB
    assert text[3] == "tokens/s: the throughput model (test rates)"
    assert text[4] == "tokens/s unknown for 24: no rates"
    assert any(line.startswith("  … 22 more rows that fit: --all lists every candidate") for line in text)
    assert text[-1] == "32 candidates: 27 fit, 1 do not fit, 4 invalid"
    json.dumps(out)


def test_bf16_and_fp16_twins_are_one_row(seed):
    vs = verdicts(seed, knobs=SEED_KNOBS | {"precision": ["fp32", "bf16", "fp16"]})
    # seed mode prices bf16 and fp16 alike: 2-byte elements (optimizer/ledger/seed.py)
    text = plan_text(vs, {}, study="seed", top=100)
    assert "z3 bf16|fp16 ckpt=full mbs=4 opt->cpu" in text and " fp16 ckpt=" not in text
    assert "bf16|fp16: twins" in text
    # 48 candidates; invalid: stage 0 with the optimizer on the CPU, 3 precisions × 2 checkpointing = 6; of the 14
    # valid per precision all fit but plain data parallel fp32 without checkpointing (26 GB): 13 + 14 + 14 = 41
    # fit, in 13 + 14 rows. Counts stay per candidate.
    assert text.splitlines()[-1] == "48 candidates: 41 fit, 1 do not fit, 6 invalid"
    assert "41 fit (27 rows: bf16|fp16 twins as one), fastest first:" in text
    assert len([line for line in text.splitlines() if re.match(r"^\s+\d+\.\s", line)]) == 27
    out = plan_json(vs, {})
    entry = next(e for e in out["fitting"] if e["label"] == "z3 fp16 ckpt=full mbs=4 opt->cpu")
    assert entry["twin"] == "z3 bf16 ckpt=full mbs=4 opt->cpu" and len(out["fitting"]) == 41
    # a different speed for one fp16 candidate splits that pair
    speeds = {"z3 bf16 ckpt=full mbs=4 opt->cpu": step(100.0), "z3 fp16 ckpt=full mbs=4 opt->cpu": step(90.0)}
    text = plan_text(vs, speeds, study="seed", top=100)
    assert "z3 fp16 ckpt=full mbs=4 opt->cpu" in text and "z3 bf16|fp16 ckpt=full mbs=4 opt->cpu" not in text


def test_invalid_candidates_are_counted_by_reason(llama7b):
    # search_spaces/default.yaml: 4 stages × 3 × 3 offloads × 60 (3 precisions × 4 checkpointing × 5 micro-batches).
    # offload_param ≠ none below stage 3: 3 stages × 3 × 2 × 60 = 1,080; offload_optimizer ≠ none at stage 0:
    # 2 × 3 × 60 = 360; offload_optimizer = nvme at stages 1-2: 2 × 3 × 60 = 360. Candidates: stage 0 all but
    # (none, none) 8 × 60 = 480, stages 1 and 2 all but opt ∈ {none, cpu} with param none: 7 × 60 each = 840.
    _, vs = llama7b
    out = plan_json(vs, {})
    assert out["counts"]["invalid"] == 1320 and out["counts"]["total"] == 2160
    assert [(i["candidates"], i["reason"].split(" (")[0]) for i in out["invalid"]] == [
        (1080, "offload_param needs zero_stage 3"), (360, "offload_optimizer needs zero_stage >= 1"),
        (360, "offload_optimizer=nvme needs zero_stage 3")]
    text = plan_text(vs, {}, study="7b")
    assert "1,320 invalid, by reason (a candidate with several reasons counts under each):" in text
    assert "  1,080  offload_param needs zero_stage 3 (only stage 3 partitions parameters)" in text
    assert "(--invalid lists them)" in text and "z0 fp32 ckpt=none mbs=1 opt->cpu:" not in text
    listed = plan_text(vs, {}, study="7b", show_invalid=True)
    assert len(listed.splitlines()) == len(text.splitlines()) + 1320 + 1  # a heading, one line each, no hint
    assert "  z0 fp32 ckpt=none mbs=1 opt->cpu: offload_optimizer needs zero_stage >= 1" in listed


def test_a_real_study_with_hundreds_fitting_fits_one_screen(llama7b):
    study, vs = llama7b
    valid = [v for v in vs if v.ledger is not None]  # made-up speeds: 1,000 tokens/s apart in the space's order
    speeds = {v.candidate.label(): step(1000.0 * (len(valid) - i)) for i, v in enumerate(valid)}
    text = plan_text(vs, speeds, study=study.name)
    lines = text.splitlines()
    assert len(lines) <= 50 and sum(v.fits for v in vs) > 100
    tops = [v for v in vs if v.fits and isinstance(speeds[v.candidate.label()], StepTime)]
    best = max(speeds[v.candidate.label()].tokens_per_s for v in tops)
    assert lines[1].startswith("fastest that fits: ") and f"{best:,.0f} tokens/s" in lines[1]
    assert lines[3] == "tokens/s: the throughput model (test rates)"
    assert plan_text(vs, speeds, study=study.name, speed_note="tokens/s: calibrated").splitlines()[3] == \
        "tokens/s: calibrated"


def test_byte_figures_print_through_the_formatter(seed):
    text = plan_text(verdicts(seed), {}, study="seed", fmt=lambda n: f"<{n}>")
    assert "GPU: needs <26000000000> of <24000000000> (+<2000000000>, +8.3%)" in text
    assert " GB" not in text.replace("GB = 10^9", "")


def test_the_json_outputs_carry_the_shortfalls(seed):
    vs = verdicts(seed)
    entries = {e["label"]: e for e in all_json(vs, study="seed")["candidates"]}
    assert entries["z0 fp32 ckpt=none mbs=4"]["shortfalls"] == [
        {"limit": "gpu", "phase": "backward", "needed": 26 * GB, "capacity": 24 * GB, "over": 2 * GB}]
    assert entries["z1 fp32 ckpt=none mbs=4"]["shortfalls"] == []
    assert "shortfalls" not in entries["z0 fp32 ckpt=none mbs=4 opt->cpu"]  # invalid: reasons only
    assert ledger_json(by_label(vs)["z0 fp32 ckpt=none mbs=4"].ledger)["reasons"] == \
        ["GPU needs 26.00 GB of 24.00 GB"]


def test_nothing_valid_or_nothing_fitting_still_says_so(seed):
    tight = dataclasses.replace(seed.hardware, gpu_memory_bytes=5 * GB)  # the least any candidate needs is 5.5 GB
    text = plan_text(verdicts(seed, hardware=tight), {}, study="seed").splitlines()
    assert text[1] == ("nothing fits; the closest: z3 bf16 ckpt=full mbs=4 opt->cpu — GPU: needs 5.50 GB of "
                       "5.00 GB (+0.50 GB, +10.0%)")
    assert plan_text([], {}, study="empty").splitlines()[-1] == "0 candidates: 0 fit, 0 do not fit, 0 invalid"


def test_many_distinct_reasons_stay_on_one_screen(seed):
    # stage 0, optimizer none/cpu, micro-batches 1-8 on 2 ranks, global batch 16: the CPU offload is invalid at
    # stage 0 (8 candidates) and micro-batches 3, 5, 6, 7 do not divide 16 (2 candidates each): 12 invalid.
    vs = verdicts(seed, knobs={"zero_stage": [0], "offload_optimizer": ["none", "cpu"],
                               "micro_batch_size": list(range(1, 9))})
    text = plan_text(vs, {}, study="seed", max_reasons=2)
    assert "12 invalid, by reason" in text
    assert "  8  offload_optimizer needs zero_stage >= 1" in text
    assert "  2  micro_batch_size=3 x 2 ranks = 6 does not divide global_batch_size=16" in text
    assert "  … 3 other reasons" in text and "micro_batch_size=5" not in text
    assert "micro_batch_size=7 x 2" in plan_text(vs, {}, study="seed", max_reasons=2, show_invalid=True)


def test_a_v100_study_plans_with_speeds_and_without_bf16():
    # Llama-2-13B on one V100-32GB: Volta has no bf16 (NVIDIA V100 datasheet: fp32, fp16 tensor cores), so no
    # bf16 row; the v100-32gb profile's figures give every fitting candidate a predicted speed
    from optimizer.perf.throughput import predict_candidate

    study = load_study(Path(__file__).resolve().parents[3] / "studies" / "llama2-13b-1xv100.yaml")
    vs = verdicts(study)
    speeds = {v.candidate.label(): predict_candidate(candidate=v.candidate, model=study.model,
                                                     hardware=study.hardware, training=study.training)
              for v in vs if v.ledger is not None}
    out = plan_json(vs, speeds)
    assert out["fitting"], "something fits a 13B on a 32 GB card with offload"
    assert all(e["tokens_per_s"] is not None for e in out["fitting"])
    assert not any("bf16" in e["label"] for e in out["fitting"] + out["closest_not_fitting"])
    bf16 = [r for r in out["invalid"] if "bf16" in r["reason"] and "v100-32gb" in r["reason"]]
    assert bf16 and bf16[0]["candidates"] == len(vs) // 3  # a third of the space: every bf16 candidate
    text = plan_text(vs, speeds, study=study.name)
    assert "bf16|fp16" not in text and "tokens/s: the throughput model (profile v100-32gb)" in text


def test_a_risk_is_printed_apart_from_the_need(repo_root):
    # cpu-tiny's z0 bf16 on 2 CPU ranks: the flatten gloo may free late (2Ψ = 241,152 B, Ψ = 120,576) is listed
    # under the peak table as live in some runs only; the need (2,893,824 B) and the items leave it out.
    from optimizer.results.report import ledger_table
    from optimizer.study.knobs import Precision

    tiny = load_study(repo_root / "studies" / "cpu-tiny.yaml")
    base = dataclasses.replace(baseline_candidate(tiny.training), precision=Precision.BF16)
    ledger = evaluate(candidate=base, model=tiny.model, hardware=tiny.hardware, training=tiny.training).ledger
    text = ledger_table(ledger, study="cpu-tiny", psi=120_576)
    assert "live in some runs only — not in the need, priced as launch risk (+241.15 kB (235.50 KiB) at the " \
        "peak):\n    allreduce flatten, freed late on gloo's thread (step)  2·min(Ψ, 5e8 + Lₜ)" in text
    assert re.search(r"\n  needed +0\.003\n", text)  # 2,893,824 B in the table's GB (cpu-tiny has 2 GiB)
    data = ledger_json(ledger)
    assert data["risk_bytes"] == 241_152 and [r["bytes"] for r in data["risks"]] == [241_152]
    assert not any(i["name"].startswith("allreduce flatten, freed") for i in data["items"])
