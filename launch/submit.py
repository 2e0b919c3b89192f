"""Run the trainer as a Ray job on an existing cluster (Ray's JobSubmissionClient).

    python -m launch.submit --address http://HEAD:8265 [--working-dir .] [--env K=V ...] [--no-follow] \\
        -- --config configs/ppo_tiny_cpu.yaml trainer.nnodes=2 trainer.default_local_dir=/shared/runs/ppo

It uploads the working dir (minus runs/, .venv, .git and caches), runs
`<this venv's python> -m hybridflow.trainer.main <trainer args>` with `trainer.ray.address=auto` added
(the job's driver joins the cluster instead of starting one; `exec`, so no shell sits between Ray and
the trainer), prints the job id and follows its logs.
Exit status: 0 when the job SUCCEEDED, 1 when it FAILED or was STOPPED, 3 when --timeout-s passed first
(the job keeps running). Ctrl-C asks whether to stop the job (--stop-on-interrupt: stops it without asking).

The interpreter is named by absolute path: a bare `python` in an entrypoint is whatever was on the PATH of
`ray start`, not this venv. Every node needs that venv at the same path (--python names another one), and the
paths the config names (model, data, run dir) must exist on every node: use absolute, shared paths.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from urllib.parse import urlparse

from hybridflow.ports import connect_within

# Never uploaded: outputs, the venv, VCS data and caches (gitignore syntax, relative to the working dir).
EXCLUDES = ["runs/", ".venv/", ".git/", "__pycache__/", "*.pyc", ".pytest_cache/", ".ruff_cache/", ".mypy_cache/",
            "*.egg-info/", "build/", ".cache/", "wandb/", "mlruns/"]
# The job's env: no usage reporting from any of its processes, driver output unbuffered so `ray job logs`
# shows each step as it happens.
BASE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
TRAINER_MODULE = "hybridflow.trainer.main"
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT, EXIT_INTERRUPTED = 0, 1, 3, 130


class SubmitError(RuntimeError):
    """Bad input to the helper (address, --env), reported without a traceback."""


def parse_env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise SubmitError(f"--env {p!r}: expected KEY=VALUE")
        out[key] = value
    return out


def build_runtime_env(working_dir: str | None, env: dict[str, str] | None = None,
                      excludes: list[str] | None = None) -> dict:
    """The job's runtime_env: the working dir (absolute, minus EXCLUDES) and BASE_ENV updated by `env`."""
    renv: dict = {"env_vars": {**BASE_ENV, **(env or {})}}
    if working_dir is not None:
        wd = os.path.abspath(working_dir)
        if not os.path.isdir(wd):
            raise SubmitError(f"--working-dir {working_dir}: not a directory")
        renv["working_dir"] = wd
        renv["excludes"] = list(EXCLUDES if excludes is None else excludes)
    return renv


def build_entrypoint(trainer_args: list[str], python: str | None = None) -> str:
    """The shell command the job runs. `trainer.ray.address=auto` joins the cluster the job runs on unless the
    args already name an address; the interpreter stays as given (resolving a venv's symlink leaves the venv)."""
    args = list(trainer_args)
    if not any(a.startswith("trainer.ray.address=") for a in args):
        args.append("trainer.ray.address=auto")
    # exec: the job's shell becomes the trainer, so `ray job stop`'s SIGTERM reaches it directly and no shell is
    # left to reap it (with one in between, the stop waited out Ray's 3 s grace and ended in SIGKILL).
    return "exec " + shlex.join([os.path.abspath(python or sys.executable), "-m", TRAINER_MODULE, *args])


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A TCP connect to the dashboard, so a wrong address fails within timeout_s and says which address."""
    url = urlparse(address if "://" in address else f"http://{address}")
    if url.scheme not in ("http", "https") or not url.hostname:
        raise SubmitError(f"--address {address!r}: expected http://HOST:PORT (the dashboard, port 8265 by default)")
    port = url.port or 8265
    # One try (refused at once is final): a submit to a wrong address should fail now, not after a retry loop.
    e = connect_within(url.hostname, port, timeout_s, refused_s=0.0)
    if e is not None:
        raise SubmitError(f"cannot reach the Ray dashboard at {address} ({url.hostname}:{port}): {e}. Is the "
                          "head started with --include-dashboard=true and a --dashboard-host this machine "
                          "can reach?") from None


def connect(address: str, timeout_s: float = 10.0):
    from ray.job_submission import JobSubmissionClient

    check_reachable(address, timeout_s)
    try:
        return JobSubmissionClient(address)
    except ConnectionError as e:
        raise SubmitError(f"the server at {address} is not a Ray dashboard: {e}") from None


def submit(client, entrypoint: str, runtime_env: dict, submission_id: str | None = None) -> str:
    return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id)


def follow_logs(client, job_id: str, timeout_s: float, out=None) -> bool:
    """Print the job's logs as they come until the job ends; False when timeout_s passed first."""
    out = out or sys.stdout

    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    async def bounded():
        try:
            await asyncio.wait_for(tail(), timeout_s)
            return True
        except TimeoutError:
            return False

    return asyncio.run(bounded())


def wait_done(client, job_id: str, timeout_s: float, poll_s: float = 0.5):
    """The job's terminal JobStatus, or None when it is still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def report(client, job_id: str, status, out=None) -> int:
    """One line for the job's end (with Ray's reason when it did not succeed); the exit status."""
    from ray.job_submission import JobStatus

    out = out or sys.stdout
    if status == JobStatus.SUCCEEDED:
        print(f"job {job_id} SUCCEEDED", file=out, flush=True)
        return EXIT_OK
    message = (client.get_job_info(job_id).message or "").strip()
    # Ray's "Job entrypoint command failed with exit code 2, last available logs ...:" then repeats the logs
    # already followed; its first clause is the news.
    first = message.splitlines()[0].split(", last available logs")[0] if message else ""
    print(f"job {job_id} {status.value}{': ' + first if first else ''}", file=out, flush=True)
    return EXIT_FAILED


def run(address: str, trainer_args: list[str], working_dir: str | None = ".", env: dict | None = None,
        python: str | None = None, follow: bool = True, timeout_s: float = 7 * 24 * 3600,
        stop_on_interrupt: bool = False, submission_id: str | None = None, out=None) -> int:
    """Submit, print the job id, follow; the exit status (see the module docstring)."""
    out = out or sys.stdout
    client = connect(address)
    job_id = submit(client, build_entrypoint(trainer_args, python), build_runtime_env(working_dir, env),
                    submission_id)
    print(f"submitted job {job_id} to {address}", file=out, flush=True)
    if not follow:
        print(f"follow it with: ray job logs --address {address} --follow {job_id}", file=out, flush=True)
        return EXIT_OK
    deadline = time.monotonic() + timeout_s
    try:
        follow_logs(client, job_id, timeout_s, out)
        # The log stream ends with the job; the status follows a moment later.
        status = wait_done(client, job_id, max(5.0, min(60.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        return _interrupted(client, address, job_id, stop_on_interrupt, out)
    if status is None:
        print(f"job {job_id} still running after {timeout_s:.0f} s; it keeps running "
              f"(ray job stop --address {address} {job_id})", file=out, flush=True)
        return EXIT_TIMEOUT
    return report(client, job_id, status, out)


def _interrupted(client, address: str, job_id: str, stop: bool, out) -> int:
    if not stop and sys.stdin.isatty():
        try:
            stop = input(f"\nstop job {job_id}? [y/N] ").strip().lower() in ("y", "yes")
        except (EOFError, KeyboardInterrupt):
            stop = False
    if not stop:
        print(f"\njob {job_id} keeps running; stop it with: ray job stop --address {address} {job_id}",
              file=out, flush=True)
        return EXIT_INTERRUPTED
    client.stop_job(job_id)
    status = wait_done(client, job_id, 60.0)
    print(f"job {job_id} {status.value if status else 'still stopping after 60 s'}", file=out, flush=True)
    return EXIT_INTERRUPTED


def parse_args(argv: list[str] | None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, trainer = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m launch.submit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS"),
                    help="the dashboard, http://HOST:8265 (default: $RAY_API_SERVER_ADDRESS)")
    ap.add_argument("--working-dir", default=".", help="uploaded as the job's working dir (default: .)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="env var for the job (repeatable)")
    ap.add_argument("--python", default=None, help="interpreter on the cluster's nodes (default: this one)")
    ap.add_argument("--no-follow", action="store_true", help="print the job id and return")
    ap.add_argument("--timeout-s", type=float, default=7 * 24 * 3600, help="stop following after this long")
    ap.add_argument("--stop-on-interrupt", action="store_true", help="Ctrl-C stops the job without asking")
    ap.add_argument("--submission-id", default=None)
    args = ap.parse_args(ours)
    if not args.address:
        ap.error("--address is required (or set RAY_API_SERVER_ADDRESS)")
    return args, trainer


def main(argv: list[str] | None = None) -> int:
    args, trainer_args = parse_args(argv)
    try:
        return run(args.address, trainer_args, args.working_dir, parse_env(args.env), args.python,
                   follow=not args.no_follow, timeout_s=args.timeout_s, stop_on_interrupt=args.stop_on_interrupt,
                   submission_id=args.submission_id)
    except SubmitError as e:
        print(f"launch.submit: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
