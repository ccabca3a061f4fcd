"""What runs inside a rank: the rank programs (``trial_rank``, ``probe_rank``, ``hf_trainer_rank``,
``peak_attribution``) and the hook in a user's script (``script_hook``, ``script_checks``, ``script_vars``); what they
measure is in :mod:`launchers.measure`, the process plumbing they share with dsopt's other processes in
:mod:`launchers.process`."""
