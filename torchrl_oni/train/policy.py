"""Policies for NetHack: a light feed-forward default and ONI's recurrent architecture.

Both read the batched env's keys ``crop`` (characters and colours around the agent),
``blstats`` and ``message``, and produce ``logits`` over the task's actions plus value
estimates. ``make_actor_critic`` wraps them as TorchRL modules (a ``ProbabilisticActor`` and a
``ValueOperator``) ready for ``ClipPPOLoss`` and a collector.

* ``light`` (default): glyph embeddings of the crop, scaled blstats and the message bytes into one
  MLP; about 70k parameters, fast on one CPU thread. Actor and critic are separate networks,
  so collection runs only the small actor.
* ``oni``: the architecture of ONI §5.2 — a conv net over the crop, an MLP over scaled blstats
  (concatenated with the raw scaled vector), an MLP over ``message / 255``, a GRU core (512) and
  linear heads, actor and critic sharing everything but the heads. Deviation, on purpose: the
  crop is read as learned glyph embeddings instead of a 72×72 RGB rendering of characters with
  a TrueType font (no font file to ship, 40× less input, and NetHack need not fill its
  character/colour buffers every step).

The critic has one output per value head: ``state_value`` (for the total reward) by default,
or ``state_value_ext``/``state_value_int`` with ``value_heads=2``.

Example:
    >>> import torch
    >>> from torchrl_oni.envs import NLEBatchEnv
    >>> from torchrl_oni.train.policy import make_actor_critic
    >>> env = NLEBatchEnv("score", num_envs=2, seed=0)
    >>> actor, critic = make_actor_critic(env, arch="light")
    >>> td = env.reset()
    >>> td = actor(td)
    >>> td["action"].shape, td["sample_log_prob"].shape if "sample_log_prob" in td else td["action_log_prob"].shape
    (torch.Size([2]), torch.Size([2]))
    >>> critic(td)["state_value"].shape
    torch.Size([2, 1])
    >>> env.close()
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from nle import nethack
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.modules import GRUModule, LSTMModule, ProbabilisticActor, recurrent_mode

from ..captions import GOAL_EMBEDDING_KEY
from ..envs.batched import OFF_MAP_GLYPH
from .archs import ARCHS, RECURRENT_ARCHS

__all__ = ["BLSTATS_SCALE", "LightNet", "ONIEncoder", "make_actor_critic", "loss_critic", "POLICY_IN_KEYS",
           "TRUNK_KEYS", "acting_copy", "actor_head", "ActingActor", "PlainStep"]

POLICY_IN_KEYS = ["crop", "blstats", "message"]
# what the recurrent archs' shared trunk writes for its own heads (encoder output, core output):
# 5.2 kB a step that the loss recomputes, so rollouts and the learner's device copy leave them out
TRUNK_KEYS = ("features", "core")

# blstats scaling after ONI §5.1 (index: scale); unlisted stats (score, depth, monster level,
# dungeon number/level, condition, alignment) are scaled to 0. Clipped to ±5 after scaling.
_SCALES = {
    nethack.NLE_BL_X: 1 / 79, nethack.NLE_BL_Y: 1 / 21, nethack.NLE_BL_HP: 1 / 10, nethack.NLE_BL_HPMAX: 1 / 10,
    nethack.NLE_BL_GOLD: 1 / 1000, nethack.NLE_BL_ENE: 1 / 10, nethack.NLE_BL_ENEMAX: 1 / 10, nethack.NLE_BL_AC: 1 / 10,
    nethack.NLE_BL_XP: 1 / 10, nethack.NLE_BL_EXP: 1 / 100, nethack.NLE_BL_TIME: 1 / 1000,
    nethack.NLE_BL_HUNGER: 1.0, nethack.NLE_BL_CAP: 1 / 10,
}
_SCALES.update({i: 1 / 10 for i in range(nethack.NLE_BL_STR25, nethack.NLE_BL_CHA + 1)})  # strength..charisma
BLSTATS_SCALE = torch.tensor([_SCALES.get(i, 0.0) for i in range(nethack.NLE_BLSTATS_SIZE)], dtype=torch.float32)


def scale_blstats(blstats: torch.Tensor) -> torch.Tensor:
    return (blstats.float() * BLSTATS_SCALE.to(blstats.device)).clamp(-5.0, 5.0)


class CropEmbedding(nn.Module):
    """int[..., C, C] glyph ids (``MAX_GLYPH`` = off the map) → float[..., D, C, C]."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.glyphs = nn.Embedding(OFF_MAP_GLYPH + 1, dim)
        self.dim = dim

    def forward(self, crop: torch.Tensor) -> torch.Tensor:
        return self.glyphs(crop.long().clamp(0, OFF_MAP_GLYPH)).movedim(-1, -3)


class LightNet(nn.Module):
    """The light default: crop embeddings + scaled blstats + message bytes → MLP → ``out_dim``.

    About 70k multiply-adds per sample, so that learning keeps up with collection on 2 cores.
    """

    def __init__(self, crop_size: int, out_dim: int, hidden: int = 128, goal_dim: int = 0):
        super().__init__()
        self.crop = CropEmbedding(dim=8)
        self.crop_proj = nn.Linear(self.crop.dim * crop_size * crop_size, 64)
        self.stats = nn.Linear(27, 32)
        self.msg = nn.Linear(256, 32)
        self.goal = nn.Linear(goal_dim, 32) if goal_dim else None
        self.mlp = nn.Sequential(nn.ELU(), nn.Linear(128 + (32 if goal_dim else 0), hidden), nn.ELU(),
                                 nn.Linear(hidden, out_dim))

    def forward(self, crop, blstats, message, goal=None):
        features = [self.crop_proj(self.crop(crop).flatten(-3)), self.stats(scale_blstats(blstats)),
                    self.msg(message.float() / 255.0)]
        if self.goal is not None:
            features.append(self.goal(goal.float()))
        return self.mlp(torch.cat(features, -1))


class ONIEncoder(nn.Module):
    """ONI §5.2 encoder before the core: crop conv net, blstats MLP (+ raw), message MLP."""

    def __init__(self, crop_size: int, hidden: int = 512, goal_dim: int = 0):
        super().__init__()
        self.crop = CropEmbedding(dim=24)
        self.conv = nn.Sequential(
            nn.Conv2d(self.crop.dim, 32, 3, padding=1), nn.ELU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ELU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ELU(),
        )
        side = (crop_size + 1) // 2
        self.conv_fc = nn.Sequential(nn.Linear(64 * side * side, hidden), nn.ELU())
        self.stats = nn.Sequential(nn.Linear(27, 128), nn.ELU(), nn.Linear(128, 128), nn.ELU())
        self.msg = nn.Sequential(nn.Linear(256, 128), nn.ELU(), nn.Linear(128, 128), nn.ELU())
        self.goal = nn.Sequential(nn.Linear(goal_dim, 128), nn.ELU()) if goal_dim else None
        self.out_dim = hidden + 128 + 27 + 128 + (128 if goal_dim else 0)

    def forward(self, crop, blstats, message, goal=None):
        lead = crop.shape[:-2]
        x = self.crop(crop).reshape(-1, self.crop.dim, *crop.shape[-2:])
        img = self.conv_fc(self.conv(x).flatten(1)).reshape(*lead, -1)
        stats = scale_blstats(blstats)
        features = [img, self.stats(stats), stats, self.msg(message.float() / 255.0)]
        if self.goal is not None:
            features.append(self.goal(goal.float()))
        return torch.cat(features, -1)


def _orthogonal_init(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.orthogonal_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _value_keys(value_heads: int):
    return ["state_value"] if value_heads == 1 else ["state_value_ext", "state_value_int"]


class _SplitValues(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, values):
        if self.n == 1:
            return values
        return tuple(values[..., i : i + 1] for i in range(self.n))


def _make_actor(module_net: nn.Module, in_keys, spec) -> ProbabilisticActor:
    return ProbabilisticActor(
        module_net,
        in_keys=["logits"],
        out_keys=["action"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
        spec=spec,
    )


def make_actor_critic(
    env, arch: str = "light", value_heads: int = 1, hidden: int = 128
) -> Tuple[ProbabilisticActor, TensorDictModule]:
    """Builds ``(actor, critic)`` for an env with the batched env's keys.

    Args:
        env: an env exposing ``action_spec`` (categorical) and a ``crop`` observation.
        arch: ``"light"`` (feed-forward, fast on CPU), ``"oni"`` (ONI §5.2 with a GRU core) or
            ``"oni-lstm"`` (the same with an LSTM core).
        value_heads: 1 (one value for the combined reward) or 2 (extrinsic and intrinsic).
        hidden: width of the light net's MLP.
    """
    if value_heads not in (1, 2):
        raise ValueError("value_heads must be 1 or 2")
    n_actions = int(env.action_spec.space.n)
    crop_size = int(env.observation_spec["crop"].shape[-1])
    value_keys = _value_keys(value_heads)
    # an env that carries a goal embedding (ELLM's goal-conditioned variant) feeds it to both networks
    spec = env.observation_spec
    goal_dim = int(spec[GOAL_EMBEDDING_KEY].shape[-1]) if GOAL_EMBEDDING_KEY in spec.keys() else 0
    in_keys = POLICY_IN_KEYS + ([GOAL_EMBEDDING_KEY] if goal_dim else [])
    if arch == "light":
        policy_net = LightNet(crop_size, n_actions, hidden, goal_dim=goal_dim)
        value_net = LightNet(crop_size, value_heads, hidden, goal_dim=goal_dim)
        _orthogonal_init(policy_net)
        _orthogonal_init(value_net)
        with torch.no_grad():  # near-uniform initial policy
            policy_net.mlp[-1].weight.mul_(0.01)
        actor = _make_actor(
            TensorDictModule(policy_net, in_keys=in_keys, out_keys=["logits"]), in_keys, env.action_spec
        )
        critic = TensorDictSequential(
            TensorDictModule(value_net, in_keys=in_keys, out_keys=["_values"]),
            TensorDictModule(_SplitValues(value_heads), in_keys=["_values"], out_keys=value_keys),
        )
        return actor, critic
    if arch in RECURRENT_ARCHS:
        encoder = ONIEncoder(crop_size, goal_dim=goal_dim)
        _orthogonal_init(encoder)
        core_cls = GRUModule if arch == "oni" else LSTMModule
        core = core_cls(input_size=encoder.out_dim, hidden_size=512, in_key="features", out_key="core")
        common = TensorDictSequential(
            TensorDictModule(encoder, in_keys=in_keys, out_keys=["features"]),
            core,
        )
        policy_head = nn.Linear(512, n_actions)
        value_head = nn.Linear(512, value_heads)
        _orthogonal_init(policy_head)
        _orthogonal_init(value_head)
        with torch.no_grad():
            policy_head.weight.mul_(0.01)
        actor_body = TensorDictSequential(common, TensorDictModule(policy_head, in_keys=["core"], out_keys=["logits"]))
        actor = _make_actor(actor_body, in_keys, env.action_spec)
        critic = TensorDictSequential(
            common,
            TensorDictModule(value_head, in_keys=["core"], out_keys=["_values"]),
            TensorDictModule(_SplitValues(value_heads), in_keys=["_values"], out_keys=value_keys),
        )
        return actor, critic
    raise ValueError(f"unknown policy architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def loss_critic(actor, critic):
    """The critic the PPO loss should run: for networks whose actor and critic share a trunk
    (``oni``, ``oni-lstm``), only the value head, reading the trunk's output ``core`` that the
    actor's pass of the loss has just written; otherwise the critic itself.

    ``ClipPPOLoss`` runs the actor, then the critic, on each minibatch: with the whole critic the
    shared encoder and recurrent core (most of the network's cost) would run twice. Gradients
    reach the trunk through the actor's pass either way (``tests/test_learner.py`` compares
    losses and weights with the whole-critic path).
    """
    actor_body = actor.module[0] if isinstance(actor.module, nn.ModuleList) else None
    if not isinstance(actor_body, TensorDictSequential) or not isinstance(critic, TensorDictSequential):
        return critic
    if critic.module[0] is not actor_body.module[0]:
        return critic  # no trunk in common
    return TensorDictSequential(*critic.module[1:])


def actor_head(actor):
    """For an actor whose network is a shared trunk then a head (``oni``: encoder and GRU, then
    the policy's linear layer), ``(trunk, head_actor)``: the trunk module, and a
    ``ProbabilisticActor`` of the same distribution that runs only the head, reading the trunk's
    output ``core`` (the same parameters, not copies); ``(None, None)`` for other actors. The
    learner runs the trunk once per update when GAE and the loss would both run it
    (:meth:`~torchrl_oni.train.learner.PPOLearner.reuses_critic_pass`)."""
    actor_body = actor.module[0] if isinstance(actor.module, nn.ModuleList) else None
    if not isinstance(actor_body, TensorDictSequential) or len(actor_body.module) < 2:
        return None, None
    trunk = actor_body.module[0]
    if not isinstance(trunk, TensorDictSequential) or "core" not in trunk.out_keys:
        return None, None
    spec = actor.spec
    spec = spec["action"] if spec is not None and "action" in spec.keys() else spec
    return trunk, _make_actor(TensorDictSequential(*actor_body.module[1:]), ["core"], spec)


class PlainStep:
    """One acting step of a known actor on plain tensors: the light policy, or an encoder, a
    single-layer GRU core and a linear head (``oni``), each followed by a categorical draw.

    The same arithmetic as the actor's TensorDict modules, without their dispatch per module and
    key, which every acting step pays: a third of an env worker's time with the light policy on
    one CPU thread went to the policy call, mostly outside its kernels (and tensordict 0.14's
    ``from_any`` searches ``sys.path`` for pandas at every module output); the policy server of
    the GRU policy was 96 % busy at 22.6k frames/s on an H200. :meth:`build` returns None for any
    other actor (LSTM cores, goal-conditioned or custom networks), which then acts through its own
    modules. A plain object, not a module: it holds references to the actor's modules, never
    parameters of its own. ``tests/test_acting.py`` compares the two paths.
    """

    def __init__(self, actor, net, in_keys, gru=None, head=None):
        self.net, self.gru, self.head = net, gru, head
        self.in_keys = list(in_keys)
        dist = actor.module[1]
        self.action_key, self.log_prob_key = dist.out_keys[0], dist.out_keys[1]
        self.default_interaction = dist.default_interaction_type
        if gru is not None:
            self.state_key, self.init_key = gru.in_keys[1], gru.in_keys[2]
            self.next_state_key = gru.out_keys[1]

    @classmethod
    def build(cls, actor) -> Optional["PlainStep"]:
        from tensordict.nn import ProbabilisticTensorDictModule

        modules = getattr(actor, "module", None)
        if not isinstance(modules, torch.nn.ModuleList) or len(modules) != 2:
            return None
        body, dist = modules
        if (not isinstance(dist, ProbabilisticTensorDictModule) or dist.distribution_class is not torch.distributions.Categorical
                or not dist.return_log_prob or list(dist.in_keys) != ["logits"] or dist.distribution_kwargs):
            return None
        if type(body) is TensorDictModule and type(body.module) is LightNet and body.out_keys == ["logits"] \
                and body.module.goal is None:
            return cls(actor, body.module, body.in_keys)
        if type(body) is TensorDictSequential and len(body.module) == 2:
            trunk, head = body.module
            if (type(trunk) is TensorDictSequential and len(trunk.module) == 2 and type(head) is TensorDictModule
                    and type(head.module) is torch.nn.Linear and head.out_keys == ["logits"]):
                encoder, core = trunk.module
                if (type(encoder) is TensorDictModule and type(encoder.module) is ONIEncoder and encoder.module.goal is None
                        and type(core) is GRUModule and core.gru.num_layers == 1 and not core.gru.bidirectional
                        and core.gru.batch_first and encoder.out_keys == [core.in_keys[0]]
                        and head.in_keys == [core.out_keys[0]]):
                    return cls(actor, encoder.module, encoder.in_keys, gru=core, head=head.module)
        return None

    @staticmethod
    def draw(logits: torch.Tensor, random: bool):
        """``(action, log_prob)`` from ``logits`` ``[B, A]``: a categorical draw (``random``) or the
        most likely action, as the actor's ``Categorical`` gives them."""
        log_probs = torch.log_softmax(logits, -1)
        action = torch.multinomial(log_probs.exp(), 1).squeeze(-1) if random else logits.argmax(-1)
        return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    def __call__(self, td: TensorDictBase) -> Optional[TensorDictBase]:
        """The step's outputs for ``td`` ``[B]`` as a new TensorDict, or None when the current
        interaction type is one this step does not draw (mean, median)."""
        from tensordict.nn.probabilistic import InteractionType, interaction_type

        kind = interaction_type() or self.default_interaction
        if kind not in (InteractionType.RANDOM, InteractionType.MODE, InteractionType.DETERMINISTIC):
            return None
        out_net = self.net(*(td.get(key) for key in self.in_keys))  # the logits, or the GRU's input
        next_state = None
        if self.gru is None:
            logits = out_net
        else:  # the net was the encoder: one GRU step from the state (zeros after a reset), the head
            state = td.get(self.state_key)  # [B, 1, H]
            state = torch.where(td.get(self.init_key).unsqueeze(-1), torch.zeros((), dtype=state.dtype,
                                                                                device=state.device), state)
            y, hidden = self.gru.gru(out_net.unsqueeze(1), state.transpose(0, 1).contiguous())
            logits = self.head(y[:, 0])
            next_state = hidden.transpose(0, 1)
        action, log_prob = self.draw(logits, kind is InteractionType.RANDOM)
        out = TensorDict({"logits": logits, self.action_key: action, self.log_prob_key: log_prob},
                         batch_size=td.batch_size, device=td.device)
        if next_state is not None:
            out.set(self.next_state_key, next_state)
        return out


class ActingActor(ProbabilisticActor):
    """The class of an acting copy (:func:`acting_copy`): a ``ProbabilisticActor`` whose single
    steps go through its :class:`PlainStep` when it has one (same outputs, written in place),
    and through its modules otherwise (recurrent mode, mean/median interaction types, unknown
    networks). Its parameters are the actor's, under the same names."""

    plain_step: Optional[PlainStep] = None

    def forward(self, tensordict: TensorDictBase = None, *args, **kwargs) -> TensorDictBase:
        step = self.plain_step
        if step is not None and not args and not kwargs and isinstance(tensordict, TensorDictBase) \
                and not recurrent_mode() and tensordict.batch_dims == 1:
            out = step(tensordict)
            if out is not None:
                return tensordict.update(out)
        return super().forward(tensordict, *args, **kwargs)


def acting_copy(actor, device="cpu"):
    """A copy of ``actor`` on ``device`` for acting (collector workers, the policy server): same
    parameters under the same names (weights sync unchanged), an :class:`ActingActor` that steps
    on plain tensors (:class:`PlainStep`), and an output without :data:`TRUNK_KEYS`, which would
    otherwise be stored with every step of a rollout (the ONI GRU policy's steps shrink from 10.9
    to 5.6 kB).

    Example:
        >>> from torchrl_oni.envs import NLEBatchEnv
        >>> env = NLEBatchEnv("score", num_envs=2, seed=0)
        >>> actor, _ = make_actor_critic(env, arch="oni")
        >>> sorted(map(str, acting_copy(actor).out_keys))
        ["('next', 'recurrent_state')", 'action', 'action_log_prob', 'logits']
        >>> env.close()
    """
    import copy

    acting = copy.deepcopy(actor).to(device)
    if type(acting) is ProbabilisticActor:  # steps on plain tensors where PlainStep knows the network
        acting.__class__ = ActingActor
        acting.plain_step = PlainStep.build(acting)
    keep = [key for key in acting.out_keys if key not in TRUNK_KEYS]
    return acting.select_out_keys(*keep) if len(keep) < len(acting.out_keys) else acting


def recurrent_primer(actor):
    """The ``TensorDictPrimer`` an env needs for a recurrent policy's state (None for light)."""
    for m in actor.modules():
        if isinstance(m, (GRUModule, LSTMModule)):
            return m.make_tensordict_primer()
    return None
