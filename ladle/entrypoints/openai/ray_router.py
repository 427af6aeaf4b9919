"""Ray Serve's request router for `ladle serve-replicas`: session affinity (session_routing.AffinityPolicy) over the
engine replicas. It runs inside the router deployment's handle to the engine deployment, where each call carries
the request's session key as its Serve session_id and its prefix chain on the ForwardedRequest argument; Ray's
proxy hands a router only the HTTP scope, never the body that holds prompt_cache_key or the prompt, hence the
router deployment in front. Imported by Ray (by its path) only where Ray is installed."""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ladle.entrypoints.openai.session_routing import AffinityPolicy

ROUTER_PATH = "ladle.entrypoints.openai.ray_router.SessionAffinityRouter"


class SessionAffinityRouter(RequestRouter):
    """A session's requests to the replica that served it; keyless ones by their longest routed prefix; the
    least loaded replica otherwise, or when the preferred one is far busier. Other replicas, least loaded first,
    are the fallback rank when the preferred one refuses (its max_ongoing_requests reached)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = AffinityPolicy(**kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key, chain = None, ()
        if pending_request is not None:
            key = pending_request.metadata.session_id or None
            arg = pending_request.args[0] if pending_request.args else None
            chain = getattr(arg, "prefix_chain", ())
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        choice = self.policy.choose(list(by_id), key, chain)
        rest = sorted((r for r in by_id if r != choice.replica), key=lambda r: self.policy.ongoing[r])
        return [[by_id[choice.replica]], [by_id[r] for r in rest]]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.policy.started(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.policy.finished(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.keep(r.replica_id.unique_id for r in replicas)
