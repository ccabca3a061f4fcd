"""One candidate's processes on one node: the launch plan and its ``Popen`` (``local``), the trial (``run``), a
user's script as the trial (``script_trial``, ``script_site/``), the host, NVMe and GPU share it uses."""
