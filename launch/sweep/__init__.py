"""python -m launch.sweep --config C --space KEY=KIND(ARGS) [--space ...] --num-samples N --metric M --mode max|min

Hyper-parameter sweeps with Ray Tune: each trial is one run of the trainer (the same config loading,
validation, pools and worker groups as `python -m hybridflow.trainer.main`) with the trial's overrides, on its
own placement group, reporting every step's metrics to Tune. Kinds: loguniform(a,b), uniform(a,b),
randint(a,b), choice(x,y,...), grid(x,y,...) (launch/sweep/space.py). --scheduler asha stops weak trials
early; a failed trial is an ERROR row, not the end of the sweep; --resume DIR restores an interrupted sweep.
The sweep directory gets results.md/.csv/.json (trial, overrides, best metric, steps, status) and best.yaml,
the best trial's config, which runs with `python -m hybridflow.trainer.main --config best.yaml`.
"""
