"""The environment a script trial's ranks are told where their plan is by (:mod:`launchers.rank.script_hook`)."""

PLAN_VAR = "DSOPT_HOOK_PLAN"
"""The trial's plan (``plan.json``): the candidate's config, the expected knobs, the step counts."""
OUT_VAR = "DSOPT_HOOK_OUT"
"""Where the rank writes ``rank<r>.json``."""
ACTIVE_VAR = "DSOPT_HOOK_ACTIVE"
"""Set by the hook in its own process: a process the script spawns inherits it and stays unmeasured."""
