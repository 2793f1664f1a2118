"""The router: one OpenAI-compatible endpoint in front of several `nanollmserve serve`
workers (data parallelism). It picks a worker per request (`policies.py`), forwards the
request and streams the answer back as it comes (`proxy.py`), retries on another worker what
failed before its first byte, watches the workers' health (`health.py`) and serves its own
/health, /stats and /metrics (`app.py`). It loads no torch: a router is a small process.
"""

from nanollmserve.router.app import RouterSettings, create_router_app
from nanollmserve.router.policies import POLICIES, make_policy
from nanollmserve.router.workers import Worker, WorkerPool

__all__ = [
    "POLICIES",
    "RouterSettings",
    "Worker",
    "WorkerPool",
    "create_router_app",
    "make_policy",
]
