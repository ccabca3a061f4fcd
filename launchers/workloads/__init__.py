"""What runs inside the ranks: the models a trial builds (the built-in GPT, transformers models), how it builds
them (plain, ``zero.Init``, meta), and the rank programs the launchers start (``python -m`` / ``torchrun -m``)."""
