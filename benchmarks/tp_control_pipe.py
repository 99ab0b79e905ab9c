"""What one tensor-parallel step's inputs cost to send to one worker: the control pipe loraplex
uses (pickled once, ``send_bytes``) against gloo's ``broadcast_object_list``, each send followed
by a one-byte acknowledgement. Run on the machine to measure (2 processes, localhost):

    python -m benchmarks.tp_control_pipe
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from multiprocessing.connection import Client, Connection, Listener

import torch.distributed as dist

from loraplex.engine.step_inputs import StepInputs, StepRequest

SENDS = 300
SHAPES = [(8, 1), (64, 1), (4, 128)]  # (requests, tokens each): decodes, decodes, a prefill
AUTHKEY = b"tp-bench"


def step(num_requests: int, num_tokens: int) -> StepInputs:
    reqs = [
        StepRequest(f"req-{i}", list(range(num_tokens)), 100, list(range(40)), True, i % 4, 0)
        for i in range(num_requests)
    ]
    return StepInputs(reqs, [], [])


def leader() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
    port = listener.address[1]
    worker = subprocess.Popen([sys.executable, __file__, "worker", str(store.port), str(port)])
    conn = listener.accept()
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    for num_requests, num_tokens in SHAPES:
        msg = step(num_requests, num_tokens)
        t0 = time.perf_counter()
        for _ in range(SENDS):
            conn.send_bytes(pickle.dumps(msg, protocol=5))
            conn.recv_bytes()
        pipe = (time.perf_counter() - t0) / SENDS
        t0 = time.perf_counter()
        for _ in range(SENDS):
            dist.broadcast_object_list([msg], src=0)
            conn.recv_bytes()
        gloo = (time.perf_counter() - t0) / SENDS
        size = len(pickle.dumps(msg, protocol=5))
        print(
            f"{num_requests} requests x {num_tokens} tokens ({size} B): pipe {pipe * 1e6:.0f} us,"
            f" gloo broadcast_object_list {gloo * 1e6:.0f} us"
        )
    conn.send_bytes(b"q")
    worker.wait()


def follower(store_port: int, pipe_port: int) -> None:
    store = dist.TCPStore("127.0.0.1", store_port, 2, False)
    conn: Connection = Client(("127.0.0.1", pipe_port), authkey=AUTHKEY)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    for _ in SHAPES:
        for _ in range(SENDS):
            pickle.loads(conn.recv_bytes())
            conn.send_bytes(b"a")
        for _ in range(SENDS):
            box: list[object] = [None]
            dist.broadcast_object_list(box, src=0)
            conn.send_bytes(b"a")
    conn.recv_bytes()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        follower(int(sys.argv[2]), int(sys.argv[3]))
    else:
        leader()
