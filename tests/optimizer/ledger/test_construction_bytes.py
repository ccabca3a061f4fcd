"""``construction_bytes`` (optimizer/ledger/model_states.py): one rank's bytes at the peak of building the model,
before ``deepspeed.initialize`` — per construction (optimizer/ledger/init_phase.py ``construction_moments``),
counted on the device alone on CUDA and on device + host on CPU ranks (one memory there).

What each construction holds, as the init-phase docstring states it from DeepSpeed 0.19.8 and transformers:

* ``device`` (stages 0-2 under ``model_init: auto``): the whole model in the training dtype on the device, g·Ψ,
  plus the tied weight's own copy g·T until ``tie_weights`` replaces it (transformers 5.24
  ``modeling_utils.py:2624``);
* ``full``: the FP32 model on the host, 4Ψ (+ 4T): nothing on a CUDA device yet;
* ``zero_init`` (stage 3 under ``auto``): the partition g·Q where ``offload_param`` puts it, Q = Σₚ ⌈nₚ/N⌉
  (each tensor padded to a multiple of N, ``partition_parameters.py:1690-1696``, allocated at ``:1816-1836``),
  plus the largest module whole on the device before its ``_post_init_method`` partitions it
  (``:1232-1262``) and gathered again to initialise it: 2·g·LL, on the device.

Two models, every figure worked by hand below (never by the ledger's own helpers):

* grid-cpu's GPT (studies/grid-cpu.yaml; tests/optimizer/ledger/test_model_state_items.py counts it): Ψ = 120,576, N =
  2,
  Q = Ψ/2 = 60,288 (every tensor even), LL = the c_fc Linear 64·256 + 256 = 16,640, nothing tied (T = 0: the
  GPT reuses the embedding matrix in its head, tests/launchers/trace/test_inventory.py);
* TIED, a hand-written parameter inventory: embed.weight 16×8 = 128, proj.weight 8×8 = 64, proj.bias 8; the head
  tied to the embedding. Ψ = 200, T = 128 (one extra copy of embed.weight), LL = max(128, 64 + 8) = 128; on
  2 ranks Q = 64 + 32 + 4 = 100, on 3 ranks Q = ⌈128/3⌉ + ⌈64/3⌉ + ⌈8/3⌉ = 43 + 22 + 3 = 68.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from optimizer.ledger.model_states import construction_bytes
from optimizer.study.inventory import InventoryTensor, ParameterInventory
from optimizer.study.knobs import Candidate, NoCheckpointing, OffloadDevice, Precision, ZeroStage
from optimizer.study.specs import Accelerator, HardwareSpec, ModelInit, TrainingSpec, TransformerModel
from optimizer.study.study_file import load_study

ROOT = Path(__file__).resolve().parents[3]

TIED = TransformerModel(
    layers=1, hidden_size=8, heads=2, kv_heads=2, ffn_size=32, vocab_size=16,
    inventory=ParameterInventory(
        tensors=(
            InventoryTensor(name="embed.weight", module="embed", module_type="Embedding", shape=(16, 8),
                            dtype="float32"),
            InventoryTensor(name="proj.weight", module="proj", module_type="Linear", shape=(8, 8), dtype="float32"),
            InventoryTensor(name="proj.bias", module="proj", module_type="Linear", shape=(8,), dtype="float32"),
        ),
        tied=(("embed.weight", "lm_head.weight"),), model_class="Tied", source="written by hand for this test"),
)


def _hardware(accelerator: Accelerator, ranks: int = 2) -> HardwareSpec:
    return HardwareSpec(accelerator=accelerator, gpus_per_node=ranks, gpu_memory_bytes=80 * 2**30)


def _training(model_init: ModelInit = ModelInit.AUTO, ranks: int = 2) -> TrainingSpec:
    # micro-batch 1 × N ranks × one micro-batch a step
    return TrainingSpec(global_batch_size=ranks, micro_batch_size=1, sequence_length=16, model_init=model_init)


def _candidate(stage: ZeroStage, precision: Precision, param: OffloadDevice = OffloadDevice.NONE) -> Candidate:
    return Candidate(zero_stage=stage, offload_optimizer=OffloadDevice.NONE, offload_param=param,
                     precision=precision, checkpointing=NoCheckpointing(), micro_batch_size=1)


def _bytes(model, stage, precision, *, accelerator=Accelerator.CUDA, model_init=ModelInit.AUTO,
           param=OffloadDevice.NONE, ranks=2) -> int:
    return construction_bytes(candidate=_candidate(stage, precision, param), model=model,
                              hardware=_hardware(accelerator, ranks), training=_training(model_init, ranks))


@pytest.fixture(scope="module")
def gpt() -> TransformerModel:
    return load_study(ROOT / "studies" / "grid-cpu.yaml").model


# --- device: the whole model in the training dtype, on the device ------------------------------------------


@pytest.mark.parametrize(("precision", "expected"), [
    (Precision.BF16, 656),  # 2Ψ + 2T = 2·200 + 2·128 = 400 + 256
    (Precision.FP32, 1_312),  # 4Ψ + 4T = 800 + 512
])
@pytest.mark.parametrize("accelerator", [Accelerator.CUDA, Accelerator.CPU])
def test_a_tied_model_built_on_the_device_holds_its_heads_own_copy_too(precision, expected, accelerator):
    # stage 0 under model_init auto builds on the device; on CPU ranks the device is the host, the same bytes
    assert _bytes(TIED, ZeroStage.DISABLED, precision, accelerator=accelerator) == expected


@pytest.mark.parametrize("stage", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS])
def test_stages_1_and_2_build_on_the_device_too(stage):
    assert _bytes(TIED, stage, Precision.BF16) == 656  # 2·200 + 2·128, as at stage 0


def test_the_untied_gpt_built_on_the_device_is_g_psi(gpt):
    # 2Ψ = 2 · 120,576 = 241,152 (T = 0: no extra head copy)
    assert _bytes(gpt, ZeroStage.DISABLED, Precision.BF16) == 241_152
    assert _bytes(gpt, ZeroStage.DISABLED, Precision.BF16, accelerator=Accelerator.CPU) == 241_152


def test_model_init_device_at_stage_3_builds_the_whole_model_not_a_partition():
    # model_init: device at stage 3: 2Ψ + 2T = 656, not zero.Init's 2Q + 4LL = 200 + 512 = 712
    assert _bytes(TIED, ZeroStage.PARAMETERS, Precision.BF16, model_init=ModelInit.DEVICE) == 656


# --- full: FP32 on the host ----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_a_full_build_is_fp32_on_the_host_whatever_the_training_dtype(precision):
    # CPU ranks count the host: 4Ψ + 4T = 4·200 + 4·128 = 800 + 512 = 1,312 (built in fp32 before any cast)
    assert _bytes(TIED, ZeroStage.DISABLED, precision, accelerator=Accelerator.CPU,
                  model_init=ModelInit.FULL) == 1_312


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_a_full_build_puts_nothing_on_a_cuda_device(precision):
    # the whole model is on the host until deepspeed.initialize moves it (engine.py:2092-2094): 0 device bytes
    assert _bytes(TIED, ZeroStage.DISABLED, precision, model_init=ModelInit.FULL) == 0


def test_the_untied_gpt_built_full_on_cpu_ranks_is_4_psi(gpt):
    # 4Ψ = 4 · 120,576 = 482,304 on CPU ranks; none of it on a CUDA device
    assert _bytes(gpt, ZeroStage.DISABLED, Precision.FP32, accelerator=Accelerator.CPU,
                  model_init=ModelInit.FULL) == 482_304
    assert _bytes(gpt, ZeroStage.DISABLED, Precision.FP32, model_init=ModelInit.FULL) == 0


# --- zero_init: the partition + the largest module twice -------------------------------------------------------


@pytest.mark.parametrize("model_init", [ModelInit.AUTO, ModelInit.ZERO_INIT])
@pytest.mark.parametrize("accelerator", [Accelerator.CUDA, Accelerator.CPU])
def test_stage_3_under_zero_init_holds_the_partition_and_the_largest_module_twice(gpt, model_init, accelerator):
    # 2Q + 2·2·LL = 2 · 60,288 + 4 · 16,640 = 120,576 + 66,560 = 187,136, all on the device
    assert _bytes(gpt, ZeroStage.PARAMETERS, Precision.BF16, model_init=model_init,
                  accelerator=accelerator) == 187_136


def test_zero_init_of_the_tied_model_holds_no_head_copy():
    # the partition 2Q = 2 · 100 = 200 + 2·2·LL = 4 · 128 = 512: 712 (zero.Init builds no untied head)
    assert _bytes(TIED, ZeroStage.PARAMETERS, Precision.BF16) == 712
    # fp32: 4Q + 2·4·LL = 400 + 1,024
    assert _bytes(TIED, ZeroStage.PARAMETERS, Precision.FP32) == 1_424


def test_zero_init_pads_every_tensor_to_a_multiple_of_the_ranks():
    # 3 ranks: Q = 43 + 22 + 3 = 68; 2Q + 4LL = 136 + 512 = 648
    assert _bytes(TIED, ZeroStage.PARAMETERS, Precision.BF16, ranks=3) == 648


def test_with_parameter_offload_the_partition_is_on_the_host(gpt):
    # CUDA: only the largest module, 2·2·LL = 66,560, is on the device; the 2Q = 120,576 partition is pinned host
    # memory (offload_param: cpu). CPU ranks: one memory, 120,576 + 66,560 = 187,136.
    assert _bytes(gpt, ZeroStage.PARAMETERS, Precision.BF16, param=OffloadDevice.CPU) == 66_560
    assert _bytes(gpt, ZeroStage.PARAMETERS, Precision.BF16, param=OffloadDevice.CPU,
                  accelerator=Accelerator.CPU) == 187_136


@pytest.mark.parametrize("accelerator", [Accelerator.CUDA, Accelerator.CPU])
def test_with_nvme_parameter_offload_the_partition_is_in_files(gpt, accelerator):
    # the partition goes to NVMe files (partition_parameters.py:1816-1824), in neither memory: 2·2·LL = 66,560
    assert _bytes(gpt, ZeroStage.PARAMETERS, Precision.BF16, param=OffloadDevice.NVME,
                  accelerator=accelerator) == 66_560
