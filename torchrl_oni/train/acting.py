"""Acting on the learner's device: one policy server answers every env worker's games in batches.

Without it, each env worker process of the collector runs its own CPU copy of the policy on its
K games. On a GPU node that leaves the GPU idle while the workers' cores share their time between
NetHack and the network. :class:`PolicyServer` follows Sample Factory's policy-worker design with
TorchRL's own machinery (``torchrl.modules.inference_server``):

* **one policy copy on** ``device`` (cuda, or cpu), served by TorchRL's ``InferenceServer`` from a
  thread of the trainer process. Requests that arrive together are answered by one forward: with
  n workers of K games, one forward covers up to n·K games;
* **one client per env worker** (:meth:`PolicyServer.worker_policies`), the collector's policy in
  that worker: it sends the ``[K]`` observation, waits for the answer and writes the keys the
  local actor would write (``action``, ``action_log_prob``, ``logits``; for the recurrent archs
  also ``("next", "recurrent_state")``; never the trunk's ``features``/``core``, which the loss
  recomputes), in place, as a local
  TensorDict module does (TorchRL's ``PolicyClientModule`` returns a new TensorDict instead).
  The env keeps ``is_init`` and the recurrent state in its TensorDict, so the server is
  stateless and hidden states stay right across resets;
* **transport**: TorchRL's ``ProcessSlotTransport`` when the request layout is known (pass
  ``example``): each worker owns a request and a response slot in CPU shared memory, only a
  semaphore and an event cross processes, and the server gathers the ready slots into one batch
  (pinned and copied without blocking when it runs on CUDA). It had the shortest round trip of
  TorchRL's transports (BENCHMARKS.md, "Measurements behind design choices"). Without
  ``example`` the server falls back to ``MPTransport``, which needs no layout;
* **games in groups** (``splits``, Sample Factory's double-buffered sampling): with ``splits=2``
  each worker owns two slots, one per half of its games, and its in-place rollout
  (:class:`~torchrl_oni.train._rollout.NLERolloutCollector`) steps one half's games in NetHack
  while the server computes the other half's actions, so the round trip leaves NetHack's critical
  path. A worker on TorchRL's generic path sends its groups together and waits for all of them;
* **exploration**: each request carries the worker's interaction type (the collector's
  ``exploration_type``, RANDOM by default), and the server samples under it, as the local actor
  would;
* **weights**: :meth:`PolicyServer.update_weights` copies the learner's weights into the served
  copy in place, between two forwards; nothing is sent to the workers, so the collector's
  ``update_policy_weights_`` is not needed (:func:`~torchrl_oni.train.backends.make_collector`
  makes it a no-op when given worker policies);
* **failures**: when the server stops (``shutdown``, or its thread dies) a waiting worker raises
  :class:`PolicyServerGone` within 0.1 s; a worker whose trainer process died, or whose request
  waits longer than ``request_timeout``, raises too instead of hanging.

Limits: all workers must play the same number of games K, a multiple of ``splits`` (the slot
layout is fixed); worker
policies can only reach the server from processes spawned after the server was built (the
collector's workers), not from Ray actors; the served forward sets tensordict's interaction type,
which is process-wide, so no other thread of the trainer process should change it meanwhile (the
trainer's PPO update does not).

Usage with a collector (see :func:`~torchrl_oni.train.backends.make_collector`)::

    server = PolicyServer(actor, device=torch.device("cuda"), num_workers=n, example=factories[0])
    collector = make_collector("local", factories, actor_cpu_copy, frames_per_batch=..., total_frames=...,
                               worker_policies=server.worker_policies())
    for batch in collector:
        ...  # PPO update
        server.update_weights(TensorDict.from_module(trainer_actor))
    collector.shutdown(); server.shutdown()

Example (the client called here, as a collector worker would call it from its process):
    >>> from tensordict import TensorDict
    >>> from torchrl_oni.envs import NLEBatchEnv
    >>> from torchrl_oni.train.policy import make_actor_critic
    >>> from torchrl_oni.train.acting import PolicyServer
    >>> env = NLEBatchEnv("score", num_envs=2, seed=0)
    >>> actor, _ = make_actor_critic(env)
    >>> with PolicyServer(actor, device="cpu", num_workers=1, example=env) as server:
    ...     policy, = server.worker_policies()
    ...     td = policy(env.reset())
    ...     server.update_weights(TensorDict.from_module(actor))
    ...     metrics = server.metrics()
    >>> td["action"].shape, metrics["acting/requests"], metrics["acting/mean_batch_games"]
    (torch.Size([2]), 1, 2.0)
    >>> env.close()
"""
from __future__ import annotations

import copy
import multiprocessing as mp
import pickle
import queue
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, List, Optional, Union

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl._comm import MailboxPeerClosedError
from torchrl.modules import set_recurrent_mode
from torchrl.modules.inference_server import (InferenceServer, MPTransport, PolicyClientModule,
                                              ProcessSlotTransport)

from ..worker_start import worker_context

__all__ = ["PolicyServer", "PolicyServerGone", "WorkerPolicy"]


# how often the trainer's threads hand each other the GIL while a server runs (Python's default: 5 ms)
SERVING_SWITCH_INTERVAL_S = 0.0005

# TorchRL 0.14 answers the requests still pending when its InferenceServer shuts down with a plain
# RuntimeError of this text (``_drain_pending_on_shutdown``); a worker waiting then must get
# PolicyServerGone, as it does when the closed mailbox is noticed first
TORCHRL_SHUTDOWN_MESSAGE = "InferenceServer is shutting down."


_STOPPED = "the PolicyServer has stopped (shut down, or its thread died): no action for this worker's games"


class PolicyServerGone(RuntimeError):
    """A worker policy's server has stopped (or its trainer process is gone): no action will come."""


def _example_request(example: Any) -> TensorDictBase:
    """A ``[K]`` TensorDict with the env's observation keys, from a TensorDict, an env or an env factory."""
    if isinstance(example, TensorDictBase):
        return example
    if hasattr(example, "fake_tensordict"):  # an env
        return example.fake_tensordict()
    if callable(example):  # an env factory
        threads = torch.get_num_threads()  # the workers' factories set one thread: not this process's business
        env = example()
        try:
            return env.fake_tensordict()
        finally:
            env.close()
            torch.set_num_threads(threads)
    raise TypeError(f"example: expected a TensorDict, an env or an env factory, got {type(example).__name__}")


class _ServedActor(torch.nn.Module):
    """The served copy: runs the actor on ``[n requests, K games]`` and counts what it served.

    The actor is an acting copy (:func:`~torchrl_oni.train.policy.acting_copy`): known
    architectures step on plain tensors (:class:`~torchrl_oni.train.policy.PlainStep`).
    The counters are written by the server thread only; :meth:`PolicyServer.metrics` reads them.
    """

    def __init__(self, actor: torch.nn.Module):
        super().__init__()
        self.actor = actor
        self.requests = 0
        self.forwards = 0
        self.games = 0
        self.forward_s = 0.0

    def forward(self, batch: TensorDictBase) -> TensorDictBase:
        t0 = time.perf_counter()
        shape = batch.batch_size
        with set_recurrent_mode(False):  # one step per game, whatever another thread's mode is
            out = self.actor(batch.reshape(-1)).reshape(shape)
        if out.device is not None and out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()  # forward time, not launch time
        self.forward_s += time.perf_counter() - t0
        self.requests += shape[0]
        self.games += shape.numel()
        self.forwards += 1
        return out


class _Server(InferenceServer):
    """TorchRL's ``InferenceServer`` that tells the clients when its serving thread ends."""

    def __init__(self, *args, alive, **kwargs):
        super().__init__(*args, **kwargs)
        self._alive = alive

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            self._alive.clear()  # waiting clients raise instead of waiting forever


def _rebuild(blob: bytes):
    cls, state = pickle.loads(blob)
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


class WorkerPolicy(TensorDictModuleBase):
    """The collector's policy in one env worker: asks the :class:`PolicyServer` and writes its answer.

    Built by :meth:`PolicyServer.worker_policies`; its in and out keys are the served actor's.
    Called on the worker's ``[K]`` TensorDict, it sends the input keys, waits for the answer and
    writes the output keys into that TensorDict (what a local TensorDict module does), so that a
    TorchRL collector treats it like the local actor.

    It can only be pickled while a process is being spawned (its shared-memory slots and
    semaphores travel by inheritance): hand it to the collector, e.g. through
    :func:`~torchrl_oni.train.backends.make_collector` (``worker_policies=``).

    Raises:
        PolicyServerGone: the server stopped, the trainer process died, or no answer came within
            ``request_timeout`` seconds.
    """

    def __init__(self, clients, in_keys, out_keys, spec=None, request_timeout: Optional[float] = 300.0,
                 alive=None):
        super().__init__()
        self.in_keys = list(in_keys)
        self.out_keys = list(out_keys)
        # one client (one slot, one request in flight) per group of the worker's games
        self.clients = [PolicyClientModule(c, in_keys=self.in_keys, out_keys=self.out_keys) for c in clients]
        self.spec = spec
        self.request_timeout = request_timeout
        self._alive = alive  # set while the server's thread serves

    @property
    def splits(self) -> int:
        """Groups of the worker's games, each asked for in its own request (``PolicyServer(splits=)``)."""
        return len(self.clients)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        request = tensordict.select(*self.in_keys, strict=True)
        if request.device is not None and request.device.type != "cpu":
            request = request.cpu()
        if self.splits == 1:
            answer = self.wait(self.submit(0, request))
        else:  # every group at once; the server may answer them in one forward
            parts = request.chunk(self.splits, 0)
            if len(parts) != self.splits or len({p.batch_size[0] for p in parts}) != 1:
                raise ValueError(f"this worker's {request.batch_size[0]} games do not split into {self.splits} "
                                 "equal groups (PolicyServer(splits=))")
            futures = [self.submit(i, part) for i, part in enumerate(parts)]
            answer = torch.cat([self.wait(f).select(*self.out_keys, strict=True) for f in futures], 0)
        tensordict.update(answer.select(*self.out_keys, strict=True))
        return tensordict

    def submit(self, group: int, request: TensorDictBase):
        """Sends group ``group``'s ``[K / splits]`` request (its in_keys) without waiting: a future for :meth:`wait`.

        One request per group may be in flight; the caller's interaction type travels with it.
        """
        self._check_alive()
        try:
            return self.clients[group].submit(request)
        except MailboxPeerClosedError as err:
            raise PolicyServerGone(_STOPPED) from err

    def wait(self, future) -> TensorDictBase:
        """The answer to a :meth:`submit` (raises :class:`PolicyServerGone` as :meth:`forward` does)."""
        try:
            return self._wait(future)
        except MailboxPeerClosedError as err:
            raise PolicyServerGone(_STOPPED) from err

    def _check_alive(self) -> None:
        if self._alive is not None and not self._alive.is_set():
            raise PolicyServerGone(_STOPPED)

    def _wait(self, future) -> TensorDictBase:
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        while True:
            try:
                return future.result(timeout=1.0)
            except RuntimeError as err:
                if str(err) == TORCHRL_SHUTDOWN_MESSAGE:
                    raise PolicyServerGone("the PolicyServer shut down while this worker's request waited: no action "
                                           "for its games") from err
                raise  # the served policy's own failure: its traceback says what went wrong
            except queue.Empty:
                parent = mp.parent_process()
                if parent is not None and not parent.is_alive():
                    raise PolicyServerGone("the trainer process holding the PolicyServer is gone") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise PolicyServerGone(f"no answer from the PolicyServer in {self.request_timeout:.0f} s "
                                           "(request_timeout)") from None

    def __reduce__(self):
        # Collectors pickle policy factories with cloudpickle, which would copy the shared-memory
        # slots: multiprocessing's pickler shares them (file descriptors passed to the child)
        state = self.__getstate__()
        return _rebuild, (bytes(ForkingPickler.dumps((type(self), state))),)


class PolicyServer:
    """One copy of ``actor`` on ``device`` serving the env workers' games in batches (see the module doc).

    Args:
        actor: the acting policy (e.g. ``make_actor_critic(...)[0]``); deep-copied onto ``device``.
        device: where the served copy runs (``"cuda"``, ``"cpu"``...).
        num_workers: env workers, one client each.
        max_batch_size: most requests in one forward (default: ``num_workers × splits``).

    Keyword Args:
        example: what fixes the request layout: one worker's ``[K]`` TensorDict with the actor's
            input keys, an env built like the workers' (its ``fake_tensordict()``), or an env
            factory (called once, then closed). Selects the fast ``ProcessSlotTransport``; without
            it the server uses ``MPTransport`` (any layout, ~4 ms more per step).
        request_timeout: seconds a worker waits for an answer before it fails (``None``: forever
            while the server and the trainer process live).
        splits: groups of each worker's games, each with its own slot and request in flight (2:
            one half steps NetHack while the other's actions are computed; see the module doc).
            Needs ``example``, whose K it must divide.
        idle_timeout: seconds the serving thread waits for work before it checks for shutdown.
    """

    def __init__(self, actor: torch.nn.Module, device: Union[torch.device, str], num_workers: int,
                 max_batch_size: Optional[int] = None, *, example: Any = None,
                 request_timeout: Optional[float] = 300.0, idle_timeout: float = 0.05, splits: int = 1):
        if num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        if splits < 1 or (splits > 1 and example is None):
            raise ValueError("splits must be at least 1, and more than 1 needs example= (the slot layout)")
        self.device = torch.device(device)
        self.num_workers = int(num_workers)
        self.splits = int(splits)
        self.max_batch_size = int(max_batch_size or num_workers * splits)
        from .policy import acting_copy

        # answers carry what a rollout stores: not the recurrent trunk's outputs (policy.TRUNK_KEYS)
        self.model = _ServedActor(acting_copy(actor, self.device))
        self._weights = TensorDict.from_module(self.model.actor).data  # the served tensors, updated in place
        self._weight_keys = set(self._weights.keys(True, True))
        self.in_keys = list(self.model.actor.in_keys)
        self.out_keys = list(self.model.actor.out_keys)
        self._spec = copy.deepcopy(getattr(actor, "spec", None))
        self._lock = threading.Lock()
        self._server = None
        self._last = (time.perf_counter(), 0, 0, 0, 0.0)  # metrics() deltas: time, requests, forwards, games, busy
        ctx = worker_context()
        alive = ctx.Event()
        alive.set()
        self.games_per_worker = None
        if example is not None:
            request = self._request_layout(_example_request(example))
            self.games_per_worker = request.batch_size[0]
            if self.games_per_worker % self.splits:
                raise ValueError(f"splits={self.splits} must divide the {self.games_per_worker} games of a worker")
            request = request[: self.games_per_worker // self.splits]  # one group's slot
            with torch.no_grad():
                response = self.model.actor(request.to(self.device)).select(*self.out_keys, strict=True).cpu()
            transport = ProcessSlotTransport(request, response, num_slots=self.num_workers * self.splits, ctx=ctx)
            collate = None
        else:
            transport = MPTransport(ctx)
            collate = torch.stack  # [n, K]: the workers' requests share their layout
        transport._set_peer_alive(alive)  # cleared when the serving thread ends
        self.transport = transport
        self.transport_kind = type(transport).__name__
        self._policies = [WorkerPolicy([transport.client() for _ in range(self.splits)], self.in_keys, self.out_keys,
                                       self._spec, request_timeout, alive) for _ in range(self.num_workers)]
        self._server = _Server(self.model, transport, alive=alive, max_batch_size=self.max_batch_size,
                               min_batch_size=1, timeout=idle_timeout, collate_fn=collate,
                               policy_device=self.device, output_device="cpu", policy_version_key=None)
        # The serving thread shares the trainer's GIL, which Python takes from a running thread only
        # every switch interval (5 ms by default): a request that comes while the trainer runs
        # Python would wait up to that long while every env worker's games stand still
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SERVING_SWITCH_INTERVAL_S))
        self._server.start()

    def _request_layout(self, example: TensorDictBase) -> TensorDictBase:
        if example.batch_dims != 1:
            raise ValueError(f"example: expected one worker's [K] TensorDict, got batch size "
                             f"{tuple(example.batch_size)}")
        missing = [key for key in self.in_keys if key not in example.keys(True, True)]
        if missing:
            raise ValueError(f"example lacks the actor's input keys {missing} (a recurrent actor needs the env's "
                             "InitTracker and TensorDictPrimer)")
        return example.select(*self.in_keys).cpu().clone().clear_device_()

    # ------------------------------------------------------------------ API
    def worker_policies(self) -> List[WorkerPolicy]:
        """One policy per env worker (worker ``i`` gets ``[i]``), for the collector's ``policy_factory``."""
        return list(self._policies)

    def update_weights(self, weights: TensorDictBase) -> None:
        """Copies ``weights`` (``TensorDict.from_module(actor)``, any device) into the served copy, in place.

        Waits for the forward in progress, if any; the next forward uses the new weights.
        """
        if self._server is None:
            raise RuntimeError("the PolicyServer is shut down")
        weights = weights.data  # plain tensors: the learner's may require grad
        if set(weights.keys(True, True)) != self._weight_keys:
            raise KeyError(f"weights do not fit the served actor: missing "
                           f"{sorted(map(str, self._weight_keys - set(weights.keys(True, True))))[:5]}, unexpected "
                           f"{sorted(map(str, set(weights.keys(True, True)) - self._weight_keys))[:5]}")

        def copy_in(_model):
            with torch.no_grad():
                self._weights.update_(weights)

        self._server.update_model(copy_in)

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs."""
        return self._server is not None and self._server.is_alive

    def metrics(self) -> Dict[str, float]:
        """Counters since the start, and rates since the previous call (cheap: a few attribute reads).

        ``acting/requests`` and ``acting/forwards``: totals; ``acting/mean_batch_games``: games per
        forward, ``acting/forward_ms``: mean forward time, ``acting/busy_fraction``: share of
        wall time spent in forwards, all since the previous call.
        """
        m = self.model
        now, requests, forwards, games, busy = time.perf_counter(), m.requests, m.forwards, m.games, m.forward_s
        with self._lock:
            t0, requests0, forwards0, games0, busy0 = self._last
            self._last = (now, requests, forwards, games, busy)
        n = forwards - forwards0
        return {
            "acting/requests": requests,
            "acting/forwards": forwards,
            "acting/mean_batch_games": (games - games0) / n if n else 0.0,
            "acting/mean_batch_requests": (requests - requests0) / n if n else 0.0,
            "acting/forward_ms": 1e3 * (busy - busy0) / n if n else 0.0,
            "acting/busy_fraction": (busy - busy0) / max(now - t0, 1e-9),
        }

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the serving thread; waiting workers then raise :class:`PolicyServerGone`. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        sys.setswitchinterval(self._switch_interval)
        server.shutdown(timeout=timeout)
        server._alive.clear()
        if isinstance(self.transport, MPTransport):  # lets the feeder threads of the answers' queues end
            for answers in list(getattr(self.transport, "_response_queues", {}).values()):
                answers.close()

    def __enter__(self) -> "PolicyServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown(timeout=1.0)
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"PolicyServer(device={self.device}, num_workers={self.num_workers}, splits={self.splits}, "
                f"transport={self.transport_kind}, alive={self.alive})")
