"""The error of a study whose trainable setup does not fit its model — raised where the setup is applied
(:mod:`launchers.models.trainable`, :mod:`launchers.models.four_bit`), reported by the inventory."""

from __future__ import annotations


class TrainableSetupError(ValueError):
    """The study's trainable setup does not fit the model (a glob or target matching nothing, PEFT missing)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why
