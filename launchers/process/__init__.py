"""What every dsopt process shares, ranks, torchrun and the ``dsopt`` command alike: the garbage collector's settings
and the rank's exit (``collector``), dying with the parent (``orphan_guard``), py-cpuinfo's answer kept per node
(``cpu_info``), a hook on a module's import (``after_import``) and DeepSpeed's kernels compiled on first call
(``lazy_compile``)."""
