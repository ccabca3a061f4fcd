"""What runs inside a rank: the rank programs (``trial_rank``, ``hf_trainer_rank``, ``peak_attribution``), the hook
in a user's script (``script_hook``), and the measurement (``cpu_memory``, ``device_memory``, ``device_identity``)."""
