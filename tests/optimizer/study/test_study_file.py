"""Study files: the good ones load, every bad one fails with one error naming file, key and why."""

from __future__ import annotations

import textwrap

import pytest

from optimizer.cli import main
from optimizer.study.errors import UserError
from optimizer.study.knobs import Precision
from optimizer.study.specs import SeedModel, TransformerModel
from optimizer.study.study_file import load_study

GOOD = """
name: tiny
model:
  kind: transformer
  layers: 2
  hidden_size: 64
  heads: 4
  vocab_size: 128
hardware:
  accelerator: cpu
  gpus_per_node: 2
  gpu_memory: 8 GiB
  host_memory: 24 GiB
training:
  global_batch_size: 8
  micro_batch_size: 2
  sequence_length: 32
search_space:
  knobs:
    zero_stage: [0, 1, 2, 3]
    precision: [fp32, bf16]
"""


def _write(tmp_path, text, name="study.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_good_study_loads_with_defaults(tmp_path):
    study = load_study(_write(tmp_path, GOOD))
    assert isinstance(study.model, TransformerModel)
    assert study.model.ffn_size == 4 * 64 and study.model.kv_heads == 4
    assert study.model.max_positions == 32
    assert study.hardware.gpu_memory_bytes == 8 * 2**30
    assert study.hardware.supported_precisions == (Precision.FP32, Precision.BF16)  # cpu: no fp16
    assert study.search_space.size() == 8


def test_repository_studies_load(repo_root):
    for path in sorted((repo_root / "studies").glob("*.yaml")):
        load_study(path)
    seed = load_study(repo_root / "studies" / "seed-1b-2x24gb.yaml")
    assert isinstance(seed.model, SeedModel)
    assert seed.model.parameters == 10**9
    assert seed.model.activation_bytes == {"none": 8 * 10**9, "full": 3 * 10**9}


@pytest.mark.parametrize(
    ("old", "new", "key", "why"),
    [
        ("  layers: 2\n", "  layers: 2\n  layer: 3\n", "model.layer", "unknown key"),
        ("  layers: 2\n", "  layers: two\n", "model.layers", "whole number"),
        ("  heads: 4\n", "  heads: 5\n", "model.hidden_size", "divisible by heads (5)"),
        ("  vocab_size: 128\n", "  vocab_size: 128\n  kv_heads: 3\n", "model.kv_heads", "must divide heads"),
        ("  global_batch_size: 8\n", "  global_batch_size: 6\n", "training.micro_batch_size", "does not divide"),
        ("  gpus_per_node: 2\n", "  gpus_per_node: 2\n  allocator_overhead: 1.5\n", "hardware.allocator_overhead",
         "[0, 1)"),
        ("  gpu_memory: 8 GiB\n", "  gpu_memory: 8 GiBs\n", "hardware.gpu_memory", "unknown unit"),
        ("  gpu_memory: 8 GiB\n", "", "hardware.gpu_memory", "required key is missing"),
        ("  accelerator: cpu\n", "  accelerator: tpu\n", "hardware.accelerator", "expected one of cuda, cpu"),
        ("  micro_batch_size: 2\n", "  micro_batch_size: 0\n", "training.micro_batch_size", "positive"),
        ("    zero_stage: [0, 1, 2, 3]\n", "    zero_stage: [0, 4]\n", "search_space.knobs.zero_stage",
         "expected 0, 1, 2 or 3"),
        ("    precision: [fp32, bf16]\n", "    precison: [fp32]\n", "search_space.knobs.precison", "unknown knob"),
        ("    precision: [fp32, bf16]\n", "    precision: [fp32, fp32]\n", "search_space.knobs.precision",
         "listed twice"),
        ("name: tiny\n", "name: tiny\nstudy_name: x\n", "study_name", "unknown key"),
        ("  heads: 4\n", "  heads: 4\n  dropout: maybe\n", "model.dropout", "true or false"),
        ("  gpu_memory: 8 GiB\n", "  gpu_memory: 1e400 GB\n", "hardware.gpu_memory", "2^63 - 1"),  # no overflow
        ("  gpus_per_node: 2\n", "  gpus_per_node: 2\n  nvme_path: ''\n", "hardware.nvme_path", "non-empty"),
        ("  gpus_per_node: 2\n", "  gpus_per_node: 2\n  nvme_bandwidth: 0 GB/s\n", "hardware.nvme_bandwidth",
         "above 0"),
        # Beyond any real model or device (optimizer/study/limits.py): refused at once, before any per-layer work.
        ("  layers: 2\n", "  layers: 100000\n", "model.layers", "beyond any real layer count"),
        ("  hidden_size: 64\n", "  hidden_size: 1.0e+9\n", "model.hidden_size", "beyond any real hidden size"),
        ("  vocab_size: 128\n", "  vocab_size: 1e12\n", "model.vocab_size", "beyond any real vocabulary"),
        ("  sequence_length: 32\n", "  sequence_length: 1e26\n", "training.sequence_length",
         "beyond any real sequence length"),
        ("  global_batch_size: 8\n", "  global_batch_size: 1e9\n", "training.global_batch_size", "beyond any real"),
        ("  gpu_memory: 8 GiB\n", "  gpu_memory: 80000 TB\n", "hardware.gpu_memory", "beyond any real device memory"),
        ("  host_memory: 24 GiB\n", "  host_memory: 2000000 TiB\n", "hardware.host_memory", "beyond any real host"),
        ("  gpus_per_node: 2\n", "  gpus_per_node: 2000000\n", "hardware.gpus_per_node", "beyond any real"),
        # SLURM's own formats (sbatch --time, --mem), checked before anything is submitted:
        ("name: tiny\n", "name: tiny\nslurm:\n  time: soon\n", "slurm.time", "not a SLURM time"),
        ("name: tiny\n", "name: tiny\nslurm:\n  time: '12:00:0000'\n", "slurm.time", "not a SLURM time"),
        ("name: tiny\n", "name: tiny\nslurm:\n  mem: 64 GB\n", "slurm.mem", "not a SLURM memory size"),
    ],
)
def test_bad_study_names_file_key_and_why(tmp_path, old, new, key, why):
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(UserError) as info:
        load_study(path)
    assert info.value.source == str(path)
    assert info.value.key == key
    assert why in info.value.why


def test_malformed_yaml_names_the_line(tmp_path):
    path = _write(tmp_path, "model: [unclosed\n")
    with pytest.raises(UserError, match="malformed YAML at line 2") as info:
        load_study(path)
    assert info.value.source == str(path)


def test_missing_search_space_file(tmp_path):
    path = _write(tmp_path, GOOD.split("search_space:")[0] + "search_space: nowhere.yaml\n")
    with pytest.raises(UserError, match=r"search-space file 'nowhere\.yaml' not found") as info:
        load_study(path)
    assert info.value.key == "search_space"


def test_missing_nvme_path_is_an_error(tmp_path):
    text = GOOD.replace("  host_memory: 24 GiB\n", "  host_memory: 24 GiB\n  nvme_path: /no/such/nvme\n")
    path = _write(tmp_path, text)
    with pytest.raises(UserError, match="not an existing directory") as info:
        load_study(path)
    assert info.value.key == "hardware.nvme_path"


def test_nvme_capacity_read_from_an_existing_path(tmp_path):
    text = GOOD.replace("  host_memory: 24 GiB\n", f"  host_memory: 24 GiB\n  nvme_path: {tmp_path}\n")
    path = _write(tmp_path, text)
    assert load_study(path).hardware.nvme_bytes > 0


def test_cli_bad_study_exits_2_with_one_line(tmp_path, capsys):
    path = _write(tmp_path, GOOD.replace("  layers: 2\n", "  layers: -2\n"))
    assert main(["ledger", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(path) in err and "model.layers" in err


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert main(["ledger", str(tmp_path / "absent.yaml")]) == 2
    assert "study file not found" in capsys.readouterr().err


def test_the_documented_study_example_loads_as_written(tmp_path, repo_root):
    # docs/study-file.md's annotated study file, as a user would copy it: `1e-4` (a YAML 1.1 string) is the number.
    readme = (repo_root / "docs" / "study-file.md").read_text()
    block = readme.split("# studies/NAME.yaml — read with yaml.safe_load; every key is checked\n", 1)[1]
    block = block.split("```", 1)[0]
    (tmp_path / "search_spaces").mkdir()
    (tmp_path / "search_spaces" / "default.yaml").write_text((repo_root / "search_spaces" / "default.yaml").read_text())
    (tmp_path / "studies").mkdir()
    study = load_study(_write(tmp_path / "studies", block))
    assert dict(study.trial.fidelity_tolerance)[Precision.FP32] == 1e-4
    assert dict(study.trial.fidelity_tolerance)[Precision.BF16] == 2e-2


def _with_learning_rate(text):
    return GOOD.replace("  sequence_length: 32\n", f"  sequence_length: 32\n  learning_rate: {text}\n")


@pytest.mark.parametrize(("text", "number"), [("1e-4", 1e-4), ("3e-3", 3e-3), ("1E5", 1e5), ("+2.5e-1", 0.25),
                                               (".5", 0.5)])
def test_numbers_written_as_yaml_1_2_decimals_are_numbers(tmp_path, text, number):
    path = _write(tmp_path, _with_learning_rate(text))
    assert load_study(path).training.learning_rate == number


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "1e400", "'1e-4x'", "'one'"])
def test_non_finite_or_non_numbers_are_refused_naming_the_key(tmp_path, text):
    path = _write(tmp_path, _with_learning_rate(text))
    with pytest.raises(UserError) as err:
        load_study(path)
    assert err.value.key == "training.learning_rate"


@pytest.mark.parametrize(("old", "new", "line"), [
    ("  layers: 2\n", "  layers: 2\n  layers: 3\n", 6),  # PyYAML alone keeps the last silently
    ("name: tiny\n", "name: tiny\nname: other\n", 3),
    ("    zero_stage: [0, 1, 2, 3]\n", "    zero_stage: [0, 1, 2, 3]\n    zero_stage: [0]\n", 21),
])
def test_a_key_given_twice_is_refused_with_its_line(tmp_path, old, new, line):
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(UserError) as info:
        load_study(path)
    assert info.value.source == str(path) and "duplicate key" in info.value.why
    assert f"line {line}" in info.value.why


def test_a_yaml_merge_key_may_be_overridden_by_the_mappings_own_key(tmp_path):
    merged = "hardware:\n  <<: {accelerator: cuda, gpus_per_node: 8}\n  accelerator: cpu\n"
    path = _write(tmp_path, GOOD.replace("hardware:\n  accelerator: cpu\n", merged))
    hardware = load_study(path).hardware
    assert hardware.accelerator.value == "cpu" and hardware.gpus_per_node == 2  # own keys win, as YAML says


@pytest.mark.parametrize(("time", "mem"), [("'12:00:00'", "0"), ("720", "64G"), ("'2-12'", "512000"),
                                           ("'1-00:30:00'", "4096M"), ("UNLIMITED", "1T")])
def test_slurm_times_and_memory_in_sbatch_formats_are_accepted(tmp_path, time, mem):
    study = load_study(_write(tmp_path, GOOD + f"slurm:\n  time: {time}\n  mem: {mem}\n"))
    assert (study.slurm.time, study.slurm.mem) == (time.strip("'"), mem)


def test_an_unquoted_time_is_not_silently_a_base_60_number(tmp_path):
    """YAML 1.1 reads 12:00:00 as 43200, which sbatch would take as 43,200 minutes (30 days)."""
    with pytest.raises(UserError) as info:
        load_study(_write(tmp_path, GOOD + "slurm:\n  time: 12:00:00\n"))
    assert "line 23" in info.value.why and "base-60" in info.value.why and '"12:00:00"' in info.value.why



# --- memory keys need a unit (issue 23): a bare number would be bytes, and the error would blame another key ---

@pytest.mark.parametrize(("old", "new", "key", "fix"), [
    ("  gpu_memory: 8 GiB\n", "  gpu_memory: 80\n", "hardware.gpu_memory",
     '80 has no unit; write "80 GiB" (2^30 bytes) or "80 GB" (10^9 bytes)'),
    ("  gpu_memory: 8 GiB\n", "  gpu_memory: 8 GiB\n  device_reserve: 1\n", "hardware.device_reserve",
     '1 has no unit; write "1 GiB"'),
    ("  host_memory: 24 GiB\n", "  host_memory: 24.5\n", "hardware.host_memory", '24.5 has no unit; write "24.5 GiB"'),
    ("  host_memory: 24 GiB\n", "  host_memory: '256'\n", "hardware.host_memory", '256 has no unit'),
    ("  host_memory: 24 GiB\n", "  host_memory: 24 GiB\n  nvme_path: /x\n  nvme_capacity: 3.84e12\n",
     "hardware.nvme_capacity", 'or "3.84e12 B" for bytes'),
    ("  gpus_per_node: 2\n", "  gpus_per_node: 2\n  nvme_bandwidth: 6\n", "hardware.nvme_bandwidth",
     "a bandwidth with its unit such as '50 GB/s'"),
    ("  gpus_per_node: 2\n", "  gpus_per_node: 2\n  inter_node_bandwidth: 25 GB\n", "hardware.inter_node_bandwidth",
     "a bandwidth with its unit"),
])
def test_a_memory_key_without_unit_is_refused_with_the_fix(tmp_path, old, new, key, fix):
    with pytest.raises(UserError) as info:
        load_study(_write(tmp_path, GOOD.replace(old, new, 1)))
    assert info.value.key == key and fix in info.value.why


SEED = """
model:
  kind: seed
  parameters: 1e9
  activation_bytes: {none: 8 GB, full: 3 GB}
  buffer_bytes: 2 GB
hardware: {accelerator: cpu, gpus_per_node: 2, gpu_memory: 24 GB}
training: {global_batch_size: 16, micro_batch_size: 4, sequence_length: 1024}
search_space: {knobs: {zero_stage: [0]}}
"""


@pytest.mark.parametrize(("old", "new", "key"), [
    ("buffer_bytes: 2 GB", "buffer_bytes: 2000000000", "model.buffer_bytes"),
    ("full: 3 GB", "full: 3", "model.activation_bytes"),
])
def test_seed_mode_byte_figures_need_a_unit(tmp_path, old, new, key):
    with pytest.raises(UserError) as info:
        load_study(_write(tmp_path, SEED.replace(old, new)))
    assert info.value.key == key and "has no unit" in info.value.why


def test_zero_needs_no_unit(tmp_path):
    text = SEED.replace("buffer_bytes: 2 GB", "buffer_bytes: 0")
    assert load_study(_write(tmp_path, text)).model.buffer_bytes == 0
    cuda = GOOD.replace("accelerator: cpu", "accelerator: cuda").replace("  gpu_memory: 8 GiB\n",
                                                                          "  gpu_memory: 8 GiB\n  device_reserve: 0\n")
    hardware = load_study(_write(tmp_path, cuda)).hardware
    assert hardware.device_reserve_bytes == 0 and hardware.device_reserve_stated


def test_the_seed_study_states_its_zero_reserve_and_overhead(repo_root):
    hardware = load_study(repo_root / "studies" / "seed-1b-2x24gb.yaml").hardware
    assert (hardware.device_reserve_bytes, hardware.allocator_overhead) == (0, 0.0)
    assert hardware.device_reserve_stated and hardware.allocator_overhead_stated and not hardware.binary_units
