"""Typed, frozen specifications: the model, the hardware and the training setup.

These are parsed once from the study file (:mod:`optimizer.study.study_file`) and passed, narrowly,
to the pure functions that need them. Bytes are integers; GB means 10^9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from optimizer.study import limits
from optimizer.study.device_profile import HardwareProfile
from optimizer.study.inventory import ParameterInventory
from optimizer.study.knobs import (
    Candidate,
    Checkpointing,
    NoCheckpointing,
    OffloadDevice,
    Precision,
    ZeroStage,
    coerce_enums,
)
from optimizer.study.machine_probe import MachineProbe
from optimizer.study.traced_activation import TracedActivation


class Accelerator(StrEnum):
    """The device the ranks train on: CUDA GPUs, or CPU ranks (``DS_ACCELERATOR=cpu``)."""

    CUDA = "cuda"
    CPU = "cpu"


class Optimizer(StrEnum):
    """The training optimizer; both keep two FP32 states per parameter (Kingma & Ba 2015)."""

    ADAM = "adam"
    ADAMW = "adamw"

    @property
    def states_per_param(self) -> int:
        """Optimizer state tensors per parameter: Adam's exp_avg and exp_avg_sq."""
        return 2


class AttentionKind(StrEnum):
    """Eager attention materialises the s×s scores; fused/flash attention does not."""

    EAGER = "eager"
    FUSED = "fused"


class MlpKind(StrEnum):
    """GPT-2's GELU MLP (two matrices) or Llama's SwiGLU MLP (three matrices)."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class NormKind(StrEnum):
    """LayerNorm (weight and bias) or RMSNorm (weight only)."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class PositionKind(StrEnum):
    """Learned absolute position embeddings (GPT-2) or rotary embeddings (no parameters)."""

    LEARNED = "learned"
    ROPE = "rope"


class ActivationSource(StrEnum):
    """Where a transformer-mode ledger takes its activation bytes from."""

    FORMULA = "formula"
    """Korthikanti et al. 2022, generalised term by term (:mod:`optimizer.ledger.transformer`)."""
    TRACE = "trace"
    """The study's own model run on fake tensors (:mod:`launchers.trace.tracer`), the formula where a trace failed."""
    AUTO = "auto"
    """The trace where the model can be traced (a study file's default), the formula with a warning elsewhere."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SeedModel:
    """A model given by explicit numbers, as in the seed document (docs/ledger.md, "Seed mode").

    Parameters, activation bytes per checkpointing option and buffer bytes are stated, not
    derived. Activation figures are per GPU at the study's baseline micro-batch and in
    ``activation_precision``; the ledger scales them linearly in the micro-batch
    (Korthikanti et al. 2022: every activation term is linear in b) and by element size.
    """

    parameters: int
    """Trainable parameters (count)."""
    activation_bytes: dict[str, int]
    """Checkpointing option (``none``, ``full``, ``every_K``, ``selective``) → activation bytes per GPU."""
    activation_precision: Precision = Precision.FP32
    """Precision the activation figures were stated in."""
    buffer_bytes: int = 0
    """Working buffers per GPU (communication, framework, workspace), stated, constant."""

    def __post_init__(self) -> None:
        coerce_enums(self, activation_precision=Precision)
        if self.parameters < 1:
            raise ValueError(f"parameters must be >= 1, got {self.parameters}")
        if "none" not in self.activation_bytes:
            raise ValueError("activation_bytes must give the 'none' (no checkpointing) figure")

    def activation_bytes_for(self, checkpointing: Checkpointing) -> int | None:
        """Stated activation bytes for ``checkpointing``, or None when the study gives none."""
        return self.activation_bytes.get(str(checkpointing))

    def rows(self, micro_batch: int) -> int:
        """The rows a micro-batch runs: one per sample (a seed model has no ``sequences_per_sample``)."""
        return micro_batch


LM_HEADS = ("logits", "trl_fused")
"""The values of :attr:`TransformerModel.lm_head`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerModel:
    """A decoder-only transformer given by its shape; parameters and activations are derived."""

    layers: int
    """Transformer blocks (L)."""
    hidden_size: int
    """Model width (h)."""
    heads: int
    """Attention heads (a)."""
    kv_heads: int
    """Key/value heads (grouped-query attention when < heads)."""
    ffn_size: int
    """MLP inner width (f); 4h for GPT-2."""
    vocab_size: int
    """Vocabulary size (V)."""
    tied_embeddings: bool = True
    """Output projection shares the token-embedding matrix."""
    attention: AttentionKind = AttentionKind.EAGER
    """Eager (stores the s×s scores) or fused/flash attention."""
    mlp: MlpKind = MlpKind.GELU
    """MLP kind."""
    norm: NormKind = NormKind.LAYERNORM
    """Normalisation kind."""
    bias: bool = True
    """Linear layers carry biases (GPT-2: yes; Llama: no)."""
    position_embedding: PositionKind = PositionKind.LEARNED
    """Learned absolute positions (parameters) or rotary (none)."""
    dropout: bool = True
    """Dropout layers are present, so 1-byte masks are kept for backward."""
    max_positions: int = 1024
    """Rows of the learned position table (the study's sequence length unless given)."""
    entry_point: str | None = None
    """``module:function`` building the user's own model for trials (see launchers/models/builtin.py); the ledger
    still uses the shape above."""
    hf_config: str | None = None
    """A Hugging Face ``transformers`` config as canonical JSON (:mod:`optimizer.study.hf_config`): trials and traces
    build that class; the shape above was read from it."""
    peft: str | None = None
    """A PEFT LoRA setup as canonical JSON of ``LoraConfig`` fields (the study's ``model.peft``,
    :mod:`optimizer.study.peft_section`): the ranks, traces and the inventory apply ``peft.get_peft_model`` with it,
    and only the adapters (and ``modules_to_save``, and biases as ``bias`` says) train."""
    quantization: str | None = None
    """A 4-bit base (QLoRA) as canonical JSON of ``BitsAndBytesConfig`` fields (the study's ``model.quantization``,
    :mod:`optimizer.study.quantization_section`): transformers' bitsandbytes quantizer turns the Linear layers it
    converts into frozen 4-bit weights; the inventory marks them, the ledger holds them at 4 bits."""
    frozen: tuple[str, ...] = ()
    """Glob patterns of parameter names that do not train (the study's ``training.frozen``), matched against the
    model's own names before any adapter is added (:func:`optimizer.study.peft_section.frozen_by`)."""
    reference_model: bool = False
    """A frozen reference copy runs beside the trained model (the study's ``training.reference_model``: DPO,
    distillation), held as TRL's ``prepare_deepspeed`` holds it (docs/ledger.md, "A reference model"); with
    ``peft`` the reference is the base with the adapters disabled, and no copy exists."""
    lm_head: str = "logits"
    """How the script's forward turns the last hidden states into the loss (the study's ``model.lm_head``):
    ``logits``, the model's own head and a cross-entropy over the ``[rows, seq, vocab]`` logits; ``trl_fused``,
    TRL's fused head (``trl/trainer/utils.py`` ``add_fused_lm_head``, which every TRL 1.16 trainer adds:
    ``ChunkedLogProbFunction``, ``trl/kernels/chunked_logprob.py:299-430``) — no logits, one
    ``[min(N, 4096), 32768]`` tile in the compute dtype in forward and again in backward, whatever the vocabulary.
    Traced and run with TRL's own code (``hf_config`` models)."""
    sequences_per_sample: int = 1
    """Sequences the model runs per sample of the micro-batch (the study's ``training.sequences_per_sample``): 2 for
    TRL's ``DPOTrainer``, whose collator stacks each pair's chosen and rejected completions into one batch of
    2 × micro-batch rows (``trl/trainer/dpo_trainer.py:317-352``) that the policy and the reference both run. The
    activations, the traced step, the FLOPs and the tokens count those rows; the DeepSpeed micro-batch stays the
    samples (pairs)."""
    activations: ActivationSource = ActivationSource.FORMULA
    """Where the ledger's activation bytes come from."""
    traced_activations: tuple[TracedActivation, ...] = ()
    """Filled by :func:`launchers.trace.study_traces.with_traced_activations` when ``activations`` is ``trace`` or
    ``auto``."""
    inventory: ParameterInventory | None = None
    """Every parameter as the model's own code builds it (:mod:`optimizer.study.inventory`), filled by
    :func:`launchers.trace.inventory.with_inventory` for ``hf_config`` and ``entry_point`` models and for any model with
    ``peft`` or ``frozen``; when set, the ledger's parameter counts (trainable and frozen) come from it instead of
    the shape's layout."""

    def __post_init__(self) -> None:
        coerce_enums(self, attention=AttentionKind, mlp=MlpKind, norm=NormKind, position_embedding=PositionKind,
                      activations=ActivationSource)
        object.__setattr__(self, "frozen", tuple(self.frozen))
        for name in ("layers", "hidden_size", "heads", "kv_heads", "ffn_size", "vocab_size", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, (limit, what) in limits.MODEL_LIMITS.items():
            limits.check_count(name, getattr(self, name), limit, what)
        if self.hidden_size % self.heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by heads ({self.heads})")
        if self.kv_heads > self.heads or self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.entry_point is not None and self.hf_config is not None:
            raise ValueError("give either entry_point or hf_config, not both: each says how trials build the model")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {', '.join(LM_HEADS)}, got {self.lm_head!r}")
        if self.lm_head != "logits" and self.hf_config is None:
            raise ValueError("lm_head: trl_fused is TRL's head on a transformers model: give the model as hf_config")
        if isinstance(self.sequences_per_sample, bool) or not isinstance(self.sequences_per_sample, int) \
                or self.sequences_per_sample < 1:
            raise ValueError(f"sequences_per_sample must be a positive integer, got {self.sequences_per_sample!r}")

    def rows(self, micro_batch: int) -> int:
        """The rows a micro-batch of ``micro_batch`` samples runs through the model (``sequences_per_sample`` each)."""
        return micro_batch * self.sequences_per_sample

    @property
    def counted_from_code(self) -> bool:
        """Built by code the shape does not describe (a transformers config or an entry point), or adapted (PEFT,
        frozen parameters: which tensors train is read off the built model), and not yet counted: its parameter
        inventory is to be taken (:func:`launchers.trace.inventory.with_inventory`)."""
        return self.inventory is None and bool(self.hf_config or self.entry_point or self.adapted)

    @property
    def adapted(self) -> bool:
        """Part of the model does not train: PEFT adapters on a frozen base, frozen parameters, or a 4-bit base
        (its quantized weights never train)."""
        return self.peft is not None or bool(self.frozen) or self.quantization is not None

    @property
    def zero3_traced_apart(self) -> bool:
        """Its ZeRO-3 candidates are traced as a ZeRO-3 run holds it (``traced_activation.ZERO3_RUN``): part of
        it is frozen. Every ZeRO-3 engine wraps ``F.linear`` (DeepSpeed's linear keeps each frozen Linear's
        input), also one ``deepspeed.initialize`` converts (``parameter_offload.py:180``, ``partition_parameters.py:
        1090-1091``); a QLoRA base, built without zero.Init (``modeling_utils.py:1435``), has its adapters cast."""
        return self.adapted

    @property
    def head_dim(self) -> int:
        """Width of one attention head, h / a."""
        return self.hidden_size // self.heads

    @property
    def wants_trace(self) -> bool:
        """``activations`` asks for the trace (``trace`` or ``auto``)."""
        return self.activations is not ActivationSource.FORMULA

    def traced_for(self, checkpointing: Checkpointing, precision: Precision, *,
                   zero3: bool = False) -> TracedActivation | None:
        """The traced entry for this granularity and precision (failed ones included), or None. ``zero3`` (a
        ZeRO-3 candidate) of a model that trains in part: the entry traced as a ZeRO-3 run holds it
        (``TracedActivation.zero3_run``) where the table has one."""
        matches = [t for t in self.traced_activations
                   if t.checkpointing == str(checkpointing) and t.precision is precision]
        want = zero3 and self.zero3_traced_apart
        return next((t for t in matches if t.zero3_run is want), matches[0] if matches else None)


ModelSpec = SeedModel | TransformerModel


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareSpec:
    """The machines: nodes × GPUs per node, each GPU's memory, each node's host RAM and NVMe."""

    accelerator: Accelerator = Accelerator.CUDA
    """CUDA GPUs or CPU ranks."""
    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int
    """Devices (GPUs, or CPU ranks) per node."""
    gpu_memory_bytes: int
    """Memory of one device, nominal (bytes)."""
    binary_units: bool = False
    """The study wrote ``gpu_memory`` in binary units (GiB, MiB, …; 2^30, 2^20 bytes) rather than decimal ones
    (GB, MB; 10^9, 10^6): figures for this study print in that family first
    (:func:`optimizer.study.units.format_bytes`)."""
    device_reserve_bytes: int = 0
    """Per-device memory outside PyTorch's allocator: CUDA context, NCCL buffers (bytes). A CUDA study that does
    not state it gets :data:`optimizer.study.hardware_section.CUDA_DEVICE_RESERVE_BYTES`."""
    device_reserve_stated: bool = True
    """``device_reserve`` was written in the study file (False: the default applied — output says "default")."""
    allocator_overhead: float = 0.0
    """Reserved/allocated − 1 of the caching allocator (fragmentation); Mist's L4 runs: 0.058–0.225. A CUDA study
    that does not state it gets :data:`optimizer.study.hardware_section.CUDA_ALLOCATOR_OVERHEAD`."""
    allocator_overhead_stated: bool = True
    """``allocator_overhead`` was written in the study file (False: the default applied)."""
    host_memory_bytes: int | None = None
    """Host RAM of one node (bytes); None = not checked."""
    nvme_path: str | None = None
    """Mount point DeepSpeed swaps to for NVMe offload."""
    nvme_bytes: int | None = None
    """Free NVMe capacity of one node (bytes); None = not checked."""
    supported_precisions: tuple[Precision, ...] = (Precision.FP32, Precision.BF16, Precision.FP16)
    """Precisions the device can train in (CPU ranks refuse fp16 in DeepSpeed; a profile's device may lack one)."""
    profile: HardwareProfile | None = None
    """The device's figures for the throughput model: a built-in profile (:mod:`optimizer.study.hardware_profiles`)
    or the study's own (``hardware.profile`` as a mapping); None: unknown until calibration."""
    inter_node_bytes_per_s: float | None = None
    """Network bandwidth per device between nodes, one direction (bytes/s); overrides the profile."""
    nvme_bytes_per_s: float | None = None
    """NVMe read/write bandwidth of a node (bytes/s), for NVMe offload time; None: unknown."""
    probe: MachineProbe | None = None
    """This machine's kernels timed at the study's shapes (:mod:`launchers.probe.machine`); preferred to the profile."""

    def __post_init__(self) -> None:
        coerce_enums(self, accelerator=Accelerator)
        object.__setattr__(self, "supported_precisions", tuple(Precision(p) for p in self.supported_precisions))
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("nodes and gpus_per_node must be >= 1")
        if not 0.0 <= self.allocator_overhead < 1.0:
            raise ValueError(f"allocator_overhead must be in [0, 1), got {self.allocator_overhead}")
        if self.device_reserve_bytes >= self.gpu_memory_bytes:
            raise ValueError("device_reserve must be smaller than gpu_memory")

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: nodes × GPUs per node (no tensor or pipeline parallelism)."""
        return self.nodes * self.gpus_per_node


class ModelInit(StrEnum):
    """How the training script builds the model (the study's ``training.model_init``).

    The init phase of the ledger and the trial's construction follow it; the exported config names it.
    """

    AUTO = "auto"
    """What Hugging Face's Trainer does: ``zero_init`` at ZeRO stage 3, ``device`` at stages 0–2
    (``transformers`` enters ``deepspeed.zero.Init`` when the DeepSpeed config has stage 3 —
    ``modeling_utils.py`` ``_from_config``/``get_init_context`` — and builds in the training dtype otherwise)."""
    ZERO_INIT = "zero_init"
    """Under ``deepspeed.zero.Init(config_dict_or_path=ds_config)``: every module's parameters are partitioned
    as soon as the module is built (``partition_parameters.py:1232-1262``); ZeRO stage 3 only."""
    DEVICE = "device"
    """Directly on the rank's device in the training dtype (``torch.device`` + default dtype, as
    ``from_config(dtype=...)`` does); DeepSpeed creates the FP32 master weights from it."""
    FULL = "full"
    """The whole model in FP32 on the host of every rank; DeepSpeed casts it and moves it to the device
    (``engine.py:2080-2094``). What a plain ``model = Model(); deepspeed.initialize(model=model)`` script does."""


class Construction(StrEnum):
    """The construction a candidate's trial really uses: :class:`ModelInit` resolved for its ZeRO stage."""

    ZERO_INIT = "zero_init"
    DEVICE = "device"
    FULL = "full"


def construction_for(model_init: ModelInit, stage: ZeroStage) -> Construction:
    """The construction of ``model_init`` at ``stage`` (``auto``: zero.Init at stage 3, the device below).

    ``zero_init`` below stage 3 has no construction: the constraints mark such candidates invalid."""
    if model_init is ModelInit.AUTO:
        return Construction.ZERO_INIT if stage is ZeroStage.PARAMETERS else Construction.DEVICE
    if model_init is ModelInit.ZERO_INIT and stage is not ZeroStage.PARAMETERS:
        raise ValueError(f"model_init=zero_init partitions parameters as they are built; zero_stage {int(stage)} "
                         "cannot train a partitioned model")
    return Construction(model_init.value)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSpec:
    """What is trained: the batch, the sequence length and the optimizer."""

    global_batch_size: int
    """Samples per optimizer step over all ranks: micro-batch × accumulation × ranks."""
    micro_batch_size: int
    """The baseline micro-batch per GPU (knob default)."""
    sequence_length: int
    """Tokens per sample (s)."""
    optimizer: Optimizer = Optimizer.ADAM
    """The optimizer."""
    learning_rate: float = 1e-3
    """Adam's learning rate."""
    weight_decay: float = 0.0
    """Adam's (decoupled for AdamW) weight decay."""
    model_init: ModelInit = ModelInit.AUTO
    """How the training script builds the model (priced in the ledger's init phase, used by every trial)."""
    def __post_init__(self) -> None:
        coerce_enums(self, optimizer=Optimizer, model_init=ModelInit)
        for name in ("global_batch_size", "micro_batch_size", "sequence_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.learning_rate > 0 or self.weight_decay < 0:
            raise ValueError("learning_rate must be > 0 and weight_decay >= 0")

    def construction(self, stage: ZeroStage) -> Construction:
        """How a trial at ``stage`` builds the model (:func:`construction_for`)."""
        return construction_for(self.model_init, stage)


def baseline_candidate(training: TrainingSpec) -> Candidate:
    """The study's baseline: stage 0, no offload, fp32, no checkpointing, the study's micro-batch.

    Knobs a user does not set take these values; it is also the FP32 reference for loss.
    """
    return Candidate(
        zero_stage=ZeroStage.DISABLED,
        offload_optimizer=OffloadDevice.NONE,
        offload_param=OffloadDevice.NONE,
        precision=Precision.FP32,
        checkpointing=NoCheckpointing(),
        micro_batch_size=training.micro_batch_size,
    )
