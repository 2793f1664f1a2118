"""`nanollmserve cluster --ray-address local` (m13): two workers as Ray actors on a private
local Ray (2 CPUs); `kill -9` of one worker actor's process makes Ray start the actor again,
which starts a fresh `serve`, and the router sends requests to it again. One test, because a
Ray start costs seconds. Skipped where Ray (the `cluster` extra) is not installed.
"""

from __future__ import annotations

import os
import signal

import pytest
from cluster_process import (
    WORKER_ARGS,
    ClusterProcess,
    free_consecutive_ports,
    is_running,
    parent_pid,
    pid_listening_as_worker,
    tiny_model_dir,
    wait_until,
)
from live_server import free_port

pytest.importorskip("ray")
pytestmark = [pytest.mark.milestone("m13"), pytest.mark.slow]


def test_a_killed_worker_actor_is_restarted_by_ray_and_serves_again() -> None:
    base_port, router_port = free_consecutive_ports(2), free_port()
    cluster = ClusterProcess.start(
        "cluster",
        router_port,
        "--ray-address",
        "local",
        "--workers",
        "2",
        "--base-port",
        str(base_port),
        "--router-port",
        str(router_port),
        "--health-interval",
        "0.5",
        "--shutdown-timeout",
        "5",
        str(tiny_model_dir()),
        *WORKER_ARGS,
    )
    try:
        client = cluster.openai()
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=4).choices
        victim_url = f"http://127.0.0.1:{base_port}"
        server_pid = pid_listening_as_worker(base_port)
        actor_pid = parent_pid(server_pid)
        assert actor_pid != cluster.process.pid  # a Ray worker process holds the server

        os.kill(actor_pid, signal.SIGKILL)
        wait_until(lambda: not is_running(server_pid), 30, "the server to die with its actor")
        wait_until(lambda: not cluster.worker(victim_url)["is_healthy"], 30, "marked down")
        for i in range(4):  # meanwhile the other worker answers
            assert client.completions.create(model="tiny", prompt=f"x{i}", max_tokens=4).choices
        wait_until(lambda: cluster.worker(victim_url)["is_healthy"], 180, "the new actor")
        new_server = pid_listening_as_worker(base_port)
        assert new_server not in (None, server_pid) and parent_pid(new_server) != actor_pid
        routed = cluster.worker(victim_url)["num_routed"]
        for i in range(4):
            assert client.completions.create(model="tiny", prompt=f"y{i}", max_tokens=4).choices
        assert cluster.worker(victim_url)["num_routed"] > routed
        servers = [pid_listening_as_worker(base_port + i) for i in range(2)]
    except BaseException:
        print(cluster.log())
        raise
    finally:
        status = cluster.stop()
    assert status == 0
    wait_until(lambda: not any(is_running(pid) for pid in servers), 30, "servers gone")
