"""How jobs start: cluster start/stop, job submission, torchrun under Ray, benchmarks and planners.

Each tool is a thin `main()` over functions the tests call directly; run them as `python -m launch.<tool>`.
"""
