"""A job store user in its own process, for the multi-process tests (run as a script, not collected).

python store_process.py worker URL WORKER_ID   prints "ready", waits for a line on stdin, then claims
                                               and finishes jobs until the queue is empty, printing
                                               one JSON line per job it finished
python store_process.py crash URL JOB_ID       claims the job, appends, finishes it, and is killed
                                               (SIGKILL) before it can close anything
"""

from __future__ import annotations

import json
import os
import signal
import sys

from service.jobs import JobStore, open_store

LEASE_S = 30.0


def work(store: JobStore, worker_id: str) -> None:
    print("ready", flush=True)
    sys.stdin.readline()
    while (job := store.claim(worker_id, LEASE_S)) is not None:
        store.append(job.id, worker_id, f"by {worker_id}", [1])
        finished = store.finish(job.id, worker_id, "succeeded", result={"worker": worker_id})
        print(json.dumps({"job_id": job.id, "finished": finished}), flush=True)


def crash(store: JobStore, job_id: str) -> None:
    job = store.claim("crasher", LEASE_S)
    assert job is not None and job.id == job_id
    store.append(job_id, "crasher", "persisted", [1, 2])
    store.finish(job_id, "crasher", "succeeded", result={"done": True})
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    command, url, name = argv
    store = open_store(url)
    if command == "worker":
        work(store, name)
    else:
        crash(store, name)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
