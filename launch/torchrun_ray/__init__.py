"""torchrun under Ray: `python -m launch.torchrun_ray --nnodes N --nproc-per-node P -- script.py args`.

plan.py (command line, torchrun commands, ranks, env) and report.py (per-rank status) are pure;
agent.py is the per-node Ray actor that runs torchrun, watchdog.py its detached clean-up net for when the
actor is killed; launcher.py places the agents and drives them.
"""

from .launcher import LaunchError, main, run
from .plan import LaunchInputError, LaunchSpec, parse_args

__all__ = ["LaunchError", "LaunchInputError", "LaunchSpec", "main", "parse_args", "run"]
