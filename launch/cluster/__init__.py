"""Start and stop a Ray cluster for HybridFlow: one node at a time, over SSH, or inside a SLURM job.

    python -m launch.cluster head --node-ip-address 10.0.0.1 --port 6379
    python -m launch.cluster worker --address 10.0.0.1:6379
    python -m launch.cluster status
    python -m launch.cluster stop
    python -m launch.cluster up --hosts node1,node2      # over ssh; `down --hosts ...` stops them
    sbatch --nodes=2 launch/slurm/ray_cluster.sbatch python -m hybridflow.trainer.main ...

Modules: net (addresses and ports), auth (Ray's token), node (start/stop one node and its pid
file), status (nodes seen by a driver), ssh (up/down), cli (the thin argparse layer).
"""
