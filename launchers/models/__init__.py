"""The models a trial (and a trace) builds: the built-in GPT, transformers models, how they are built (plain,
``zero.Init``, meta), what trains in them (PEFT, frozen, 4-bit) and the frozen reference model."""
