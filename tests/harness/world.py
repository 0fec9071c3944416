"""A world of N long-lived rank processes that run test bodies on request.

Starting a rank (python + torch + megatron-core imports) costs seconds, so a world is started once
and reused by every test that asks for its size. Each rank runs `_rank_main`: it joins the
torch.distributed world (gloo on CPU, NCCL on GPUs) and then executes tasks from its queue. A task
names a registered body; the rank runs it (initialising megatron for the task's layout first) and
reports success or its traceback.

A world that does not finish a task in time is killed after dumping every stuck rank's Python
stack; the next task gets a fresh world.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# How long a world may take to start (every rank importing torch + megatron-core and joining the
# rendezvous) before the attempt counts as failed. A failed or slow start is retried once, with a
# fresh port and twice this timeout: eight ranks importing at once on a loaded machine (load ~55
# on 2 cores) have taken longer than a first attempt allows.
START_TIMEOUT_S = float(os.environ.get("MLORA_TEST_START_TIMEOUT", "300"))
# After one rank fails, how long the others get to finish before the world is killed.
FAILURE_GRACE_S = 10.0


class WorldError(AssertionError):
    """A task failed on one or more ranks; the message holds each failing rank's traceback."""


class WorldTimeout(WorldError):
    """A task did not finish in time; the message names the stuck ranks and shows their stacks."""


@dataclass
class _Report:
    rank: int
    ok: bool
    error: str = ""
    seconds: float = 0.0


@dataclass
class World:
    size: int
    backend: Optional[str] = None
    procs: List[Any] = field(default_factory=list)
    start_timeout_s: float = START_TIMEOUT_S
    retry_timeout_s: Optional[float] = None
    _next_task: int = 0

    def start(self) -> "World":
        """Start the ranks. A start that fails or does not finish within `start_timeout_s` is
        retried once, announced on stderr, with a fresh rendezvous port and `retry_timeout_s`
        (default: twice `start_timeout_s`); the second failure is raised."""
        timeout = self.start_timeout_s
        try:
            return self._start_once(timeout)
        except WorldError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            timeout = self.retry_timeout_s or 2 * self.start_timeout_s
            print(f"tests.harness: world of {self.size} ranks failed to start ({first}); "
                  f"retrying once with a fresh port and a {timeout:.0f} s timeout",
                  file=sys.stderr, flush=True)
        return self._start_once(timeout)

    def _start_once(self, timeout: float) -> "World":
        ctx = mp.get_context("spawn")
        self.procs = []
        self._log_dir = tempfile.mkdtemp(prefix=f"mlora-world{self.size}-")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.size)]
        self._results = ctx.Queue()
        for rank in range(self.size):
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, self.size, port, self.backend, self._tasks[rank], self._results,
                      list(sys.path), self._log_dir),
                # Not daemonic: megatron's checkpoint writer starts processes of its own. Ranks
                # exit by themselves when the parent process goes away (see _next_task).
                daemon=False,
                name=f"mlora-rank{rank}",
            )
            proc.start()
            self.procs.append(proc)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready = set()
        while len(ready) < self.size:
            report = self._get(deadline)
            if report is None:
                self.kill()
                raise WorldTimeout(
                    f"world of {self.size} ranks did not start within {timeout:.0f} s; "
                    f"ranks not ready: {sorted(set(range(self.size)) - ready)}"
                )
            task_id, rep = report
            if task_id == "dead":
                self.kill()
                raise WorldError(
                    f"a rank of the world of {self.size} exited while starting; ranks ready: "
                    f"{sorted(ready)}"
                )
            if not rep.ok:
                self.kill()
                raise WorldError(f"rank {rep.rank} failed to start:\n{rep.error}")
            ready.add(rep.rank)

    def _get(self, deadline: float):
        import queue

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    return ("dead", None)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(self, body_key: str, kwargs: Dict[str, Any], timeout: float) -> List[_Report]:
        """Run a registered body on every rank; raise WorldError/WorldTimeout on any failure."""
        self._next_task += 1
        task_id = self._next_task
        for q in self._tasks:
            q.put((task_id, body_key, kwargs))
        deadline = time.monotonic() + timeout
        reports: Dict[int, _Report] = {}
        dead = False
        while len(reports) < self.size:
            got = self._get(deadline)
            if got is None:
                break
            if got[0] == "dead":
                dead = True
                break
            tid, rep = got
            if tid != task_id:
                continue  # a late report from an earlier, abandoned task
            reports[rep.rank] = rep
            if not rep.ok:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        failed = [r for r in reports.values() if not r.ok]
        missing = sorted(set(range(self.size)) - set(reports))
        if missing:
            stacks = self._dump_stacks(missing)
            self.kill()
            head = "".join(f"\n--- rank {r.rank} failed ---\n{r.error}" for r in failed)
            why = "died" if dead else f"did not finish within {timeout:.0f} s"
            raise WorldTimeout(
                f"{body_key}: ranks {missing} {why} (world of {self.size} killed; the next test "
                f"gets a fresh one){head}\n{stacks}"
            )
        if failed:
            raise WorldError(
                f"{body_key} failed on ranks {[r.rank for r in failed]}:"
                + "".join(f"\n--- rank {r.rank} ---\n{r.error}" for r in failed)
            )
        return [reports[r] for r in range(self.size)]

    def _dump_stacks(self, ranks: List[int]) -> str:
        out = []
        for rank in ranks:
            proc = self.procs[rank]
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(1.0)
        for rank in ranks:
            path = os.path.join(self._log_dir, f"rank{rank}.stack")
            try:
                with open(path) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            out.append(f"--- rank {rank} stack ---\n{text or '(no stack: process gone)'}")
        return "\n".join(out)

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self.procs = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _next_task(tasks, parent_pid):
    """The next task, or None when told to stop or when the parent process has gone."""
    import queue

    while True:
        try:
            return tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


def _rank_main(rank, size, port, backend, tasks, results, parent_path, log_dir):
    """Entry point of one rank process."""
    sys.path[:] = parent_path
    stack_file = open(os.path.join(log_dir, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        import torch

        torch.set_num_threads(1)
        from megatron_lora import runtime
        from megatron_lora.runtime import watchdog

        # A rank stuck in a collective never polls its task queue: without this it would outlive
        # a killed or crashed pytest as an orphan.
        watchdog.watch_launcher(force=True)

        runtime.init_process_group(backend, timeout_s=float(os.environ.get("MLORA_PG_TIMEOUT", 300)))
        from tests.harness import registry
    except BaseException:
        results.put((0, _Report(rank, False, traceback.format_exc())))
        return
    results.put((0, _Report(rank, True)))
    parent = os.getppid()
    while True:
        task = _next_task(tasks, parent)
        if task is None:
            break
        task_id, key, kwargs = task
        start = time.monotonic()
        try:
            registry.execute(key, kwargs)
            rep = _Report(rank, True, seconds=time.monotonic() - start)
        except BaseException:
            rep = _Report(rank, False, traceback.format_exc(), time.monotonic() - start)
        results.put((task_id, rep))
    try:
        runtime.shutdown()
    except Exception:
        pass
