"""Per-node safety net: once the agent process is gone, kill every process of its torchrun tree.

Ray SIGKILLs an actor's direct children when the actor dies (ray.kill, a launcher killed with SIGKILL, a lost
driver), so torchrun gets no chance to stop its ranks, and the ranks (each in its own session) outlive it.
This watchdog detaches (double fork) so that Ray's cleanup does not take it too, polls the agent's pid, and
then terminates whatever still carries the job tag, and removes the agent's temporary log dir if given. It
exits right after; it never outlives the tagged tree.

    python -m launch.torchrun_ray.watchdog <agent pid> <agent start time> <tag> [temp log dir]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

POLL_S = 0.5


def agent_alive(pid: int, create_time: float) -> bool:
    import psutil

    try:  # the start time guards against the pid being reused by another process
        return abs(psutil.Process(pid).create_time() - create_time) < 1.0
    except psutil.NoSuchProcess:
        return False


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m launch.torchrun_ray.watchdog", description=__doc__.splitlines()[0],
                                 epilog="Started by each node's agent (agent.py); not meant to be run by hand.")
    ap.add_argument("pid", type=int, help="the agent's pid")
    ap.add_argument("create_time", type=float, help="the agent's start time (psutil), against pid reuse")
    ap.add_argument("tag", help="the job tag every process of the torchrun tree carries")
    ap.add_argument("temp_dir", nargs="?", default=None, help="the agent's temporary log dir, removed at the end")
    return ap.parse_args(argv)


def main(argv: list[str]) -> None:
    a = parse_args(argv)  # before the fork: a bad command line is an error the agent sees (check=True)
    pid, create_time, tag, temp_dir = a.pid, a.create_time, a.tag, a.temp_dir
    if os.fork() > 0:  # the direct child exits at once; the agent reaps it, the grandchild is nobody's child
        os._exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    from launch.torchrun_ray.agent import kill_tagged

    while agent_alive(pid, create_time):
        time.sleep(POLL_S)
    kill_tagged(tag, timeout_s=5.0, term_first=True)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
