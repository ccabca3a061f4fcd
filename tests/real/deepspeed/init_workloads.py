"""An entry point for the construction tests (``model.entry_point: init_workloads:plain_gpt``): a user's
function that knows nothing of DeepSpeed — it builds the built-in GPT and its data and returns them. dsopt
enters the construction's context around the call, so at ZeRO stage 3 its modules are partitioned as built.
"""

from __future__ import annotations

from launchers.models.builtin import build_workload


def plain_gpt(spec, sequence_length, seed, checkpointing):
    return build_workload(model_spec=spec, checkpointing=checkpointing, sequence_length=sequence_length, seed=seed,
                          entry_point=None)


def refuses_zero_init(spec, sequence_length, seed, checkpointing):
    """A user's function that reads its weights right after construction — it cannot be built under zero.Init."""
    model, data = plain_gpt(spec, sequence_length, seed, checkpointing)
    if next(model.parameters()).numel() == 0:
        raise RuntimeError("this model reads its weights after construction and needs them whole")
    return model, data
