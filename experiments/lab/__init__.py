"""The lab: what measures buddy's own design, apart from what a user runs (experiments/README.md).

The GPU runbook (``gpu_session``, ``gpu_check``, ``dry_run``, ``travel_size``, ``nvrtc_time``), the kernel budget
(``kernel_budget``), the lane studies (``fpe_lanes``, ``bench_lockstep``) and the codec studies (``fpe_speed``,
``learned_tables``, ``context_bound``, ``repeats``). A lab module may import the rest of ``experiments``; nothing
outside the lab imports it (tests/test_architecture.py).
"""
