"""The cluster: SLURM submissions of a study's workers and their status (``slurm``)."""
