"""What the user states: the study file, its specs and knobs, the search space, units and bounds (pure).

Reading order: :mod:`optimizer.study.study_file` loads ``studies/NAME.yaml`` into the frozen specs of
:mod:`optimizer.study.specs`; :mod:`optimizer.study.knobs` is one candidate (a value per knob) and its one
identity, :meth:`~optimizer.study.knobs.Candidate.label`."""
