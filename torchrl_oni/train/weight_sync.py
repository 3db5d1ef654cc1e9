"""Weights for Ray actors through Ray's object store, without waiting
(:class:`ObjectStoreWeightSyncScheme`, a TorchRL ``WeightSyncScheme``).

``ray.put`` once per update, then one queued ``update_policy_weights_`` call per actor, applied
between two of its batches. ``RayCollector``'s default ``RayWeightSyncScheme`` sends over a gloo
process group of fixed size and waits for every actor to finish its rollout (the learner stalls
~one rollout per update, measured), and a restarted actor cannot rejoin the group. The collector
that uses it: :class:`~torchrl_oni.train.distributed.RayEnvCollector`.
"""
from __future__ import annotations

from typing import Any, List

from tensordict import TensorDictBase
from torchrl.weight_update import WeightSyncScheme

__all__ = ["ObjectStoreWeightSyncScheme"]


class _ActorTransport:
    """One actor's end of :class:`ObjectStoreWeightSyncScheme`: queues a weight update on it."""

    def __init__(self, actor):
        self.actor = actor

    def send_weights(self, weights_ref) -> Any:
        return self.actor.update_policy_weights_.remote(weights_ref)

    def setup_connection_and_weights_on_sender(self) -> None:
        pass  # nothing to connect: the first update carries the weights

    def setup_connection_and_weights_on_receiver(self, **kwargs) -> None:
        return None


class ObjectStoreWeightSyncScheme(WeightSyncScheme):
    """TorchRL weight sync for Ray actors through Ray's object store, without waiting.

    ``send`` puts the weights in the object store once and queues one
    ``update_policy_weights_(ref)`` call per actor (TorchRL's own ``Collector`` method: it copies
    them into the actor's policy in place). A Ray actor runs its calls in the order they were
    submitted, so an actor busy with a rollout applies the update right after it, before its next
    one; the learner never waits. Updates that failed because their actor died are dropped
    (the collector re-sends :attr:`latest` with the actor's first rollout after its restart);
    any other failure, e.g. weights that do not fit the policy, is raised at the next ``send``.

    Args:
        strategy: ``"tensordict"`` (TorchRL's default weight format).
    """

    def __init__(self, strategy: str = "tensordict"):
        super().__init__(strategy)
        self.latest = None  # ObjectRef of the last weights sent
        self._in_flight: List[Any] = []

    def create_transport(self, *, remote_actor=None, **kwargs) -> _ActorTransport:
        return _ActorTransport(remote_actor)

    def _init_on_sender_impl(self, model_id: str, context: Any = None, **kwargs) -> None:
        self.model_id = model_id
        actors = kwargs.get("remote_collectors")
        if actors is None and context is not None:
            actors = context.remote_collectors
        if not actors:
            raise ValueError("ObjectStoreWeightSyncScheme needs the remote collectors (Ray actors)")
        for idx, actor in enumerate(actors):
            self._register_worker_sender(worker_idx=idx, transport=self.create_transport(remote_actor=actor))
        if context is not None:
            self.context = context
        if kwargs.get("model") is not None:
            self.model = kwargs["model"]

    def _init_on_receiver_impl(self, model_id: str, context: Any = None, **kwargs) -> None:
        self.model_id = model_id  # the actor's Collector.update_policy_weights_ applies the weights

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx=None) -> None:
        pass

    def forget(self, worker_idx: int) -> None:
        """Stops sending to a worker that is gone for good."""
        if self._sender_transports is not None:
            self._sender_transports.pop(worker_idx, None)

    def send(self, weights: Any = None, worker_ids=None) -> None:
        import ray

        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        weights = self.prepare_weights(weights=weights, model_id=self._model_id, strategy=self._strategy,
                                       context=self.context)
        if weights is None:
            raise RuntimeError("no weights to send: pass them, or give the scheme a model")
        if isinstance(weights, TensorDictBase):
            weights = weights.data.cpu()
        self._reap()
        self.latest = ray.put(weights)
        if isinstance(worker_ids, int):
            worker_ids = [worker_ids]
        targets = sorted(self._sender_transports or {}) if worker_ids is None else worker_ids
        for idx in targets:
            transport = (self._sender_transports or {}).get(idx)
            if transport is not None:
                self._in_flight.append(transport.send_weights(self.latest))

    def _reap(self) -> None:
        """Collects finished updates: actor deaths are the collector's business, the rest raises."""
        import ray
        from ray.exceptions import RayActorError

        if not self._in_flight:
            return
        done, self._in_flight = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                pass

    def shutdown(self) -> None:
        super().shutdown()
        self._in_flight = []
        self.latest = None

    def __getstate__(self):
        state = super().__getstate__()
        state["latest"] = None
        state["_in_flight"] = []
        state["_sender_transports"] = None
        return state

