"""python -m launch.benchmark CONFIG [key=value ...] [--warmup 10 --steps 5] [--out result.json]
python -m launch.benchmark --compare a.json b.json ...
python -m launch.benchmark --ablation long_tail [--warmup 2 --steps 3] [--out result.json]
python -m launch.benchmark --ablation agent_tools [--out result.json]
python -m launch.benchmark --ablation async [--warmup 2 --steps 4] [--out result.json]

The HybridFlow paper's method (section 8.1): W warm-up steps, then S timed steps of the real job (defaults 10
and 5), reported per stage from the trainer's own timers and throughput metrics. The last line printed is one
JSON object (stages, totals, peak memory per worker group, layout, package versions, git commit, device).

stages.py: the table from step metrics (pure); run.py: the job (hybridflow.trainer.main.trainer_session);
report.py: text tables and --compare; long_tail.py: the long-tailed workload and its before/after ablation;
agent_tools.py: tool latency against generation in agent loops (concurrent vs sequential trajectories through the
rollout server); async_ablation.py: colocated vs split pools, sync vs one step off policy.
"""
