"""Neural networks that read NetHack messages: a character-level CNN encoder and two heads.

The encoder follows the layer sizes of the NetHack-Challenge "lt_cnn" message encoder that
ONI and Motif use (oni_spec §2.2): the 256 message bytes are embedded (256 × 32, byte 0 is
padding), run through six 1-D convolutions with three max-pools, flattened to 64 × 5 = 320
features and projected to 128. Two heads sit on top:

* :class:`MessageClassifier` (ONI-Classification): 128 → 512 → 512 → dropout → 2 logits,
  index 1 meaning "helpful".
* :class:`MessageRewardModel` (ONI-Ranking, offline Motif): 128 → 256 → 512, ReLU, 512 → 1
  scalar score.

Inputs are ``uint8[N, 256]`` (or any integer dtype) message tensors; the models cast to
``int64`` themselves.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards.models import MessageClassifier, MessageRewardModel
    >>> messages = torch.zeros(3, 256, dtype=torch.uint8)
    >>> MessageClassifier()(messages).shape
    torch.Size([3, 2])
    >>> MessageRewardModel()(messages).shape
    torch.Size([3])
"""
from __future__ import annotations

import torch
from torch import nn

from torchrl_oni.captions import MESSAGE_LEN
from torchrl_oni.locks import OwnLockOnCopy

__all__ = ["MessageEncoder", "MessageClassifier", "MessageRewardModel", "as_message_tensor"]


def as_message_tensor(messages, device=None) -> torch.Tensor:
    """Returns ``messages`` (numpy or torch, any integer dtype, ``[..., 256]``) as a uint8 tensor.

    Raises:
        ValueError: if the last dimension is not 256.
    """
    if not isinstance(messages, torch.Tensor):
        messages = torch.as_tensor(messages)
    if messages.shape[-1] != MESSAGE_LEN:
        raise ValueError(
            f"messages must have a last dimension of {MESSAGE_LEN}, got shape {tuple(messages.shape)}"
        )
    if messages.dtype != torch.uint8:
        messages = messages.to(torch.uint8)
    if device is not None:
        messages = messages.to(device)
    return messages


class MessageEncoder(nn.Module):
    """Character-level CNN: ``[N, 256]`` bytes → ``[N, 128]`` features.

    Sequence lengths through the stack: 256 → 250 → 83 → 77 → 25 → 23/21/19/17 → 5.

    Args:
        embedding_dim: width of the byte embedding (32 in ONI).
        channels: convolution width (64 in ONI).
        out_features: size of the output features (128 in ONI).

    Example:
        >>> import torch
        >>> MessageEncoder()(torch.zeros(2, 256, dtype=torch.uint8)).shape
        torch.Size([2, 128])
    """

    def __init__(self, embedding_dim: int = 32, channels: int = 64, out_features: int = 128):
        super().__init__()
        self.embedding = nn.Embedding(256, embedding_dim, padding_idx=0)
        c = channels
        self.convs = nn.Sequential(
            nn.Conv1d(embedding_dim, c, kernel_size=7),
            nn.ReLU(),
            nn.MaxPool1d(kernel_size=3, stride=3),
            nn.Conv1d(c, c, kernel_size=7),
            nn.ReLU(),
            nn.MaxPool1d(kernel_size=3, stride=3),
            nn.Conv1d(c, c, kernel_size=3),
            nn.ReLU(),
            nn.Conv1d(c, c, kernel_size=3),
            nn.ReLU(),
            nn.Conv1d(c, c, kernel_size=3),
            nn.ReLU(),
            nn.Conv1d(c, c, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool1d(kernel_size=3, stride=3),
        )
        flat = c * self._conv_out_len(MESSAGE_LEN)
        self.project = nn.Sequential(nn.Linear(flat, out_features), nn.ReLU())
        self.out_features = out_features

    @staticmethod
    def _conv_out_len(n: int) -> int:
        n = (n - 6) // 3  # conv k7, pool 3
        n = (n - 6) // 3  # conv k7, pool 3
        n = (n - 8) // 3  # four conv k3, pool 3
        return n

    def forward(self, messages: torch.Tensor) -> torch.Tensor:
        x = self.embedding(messages.long())  # [N, L, E]
        x = self.convs(x.transpose(1, 2))  # [N, C, 5]
        return self.project(x.flatten(1))


class MessageClassifier(nn.Module):
    """ONI-Classification network: message bytes → 2 logits (index 1 = helpful).

    Args:
        dropout: dropout probability before the last layer (0.1 in ONI).

    Example:
        >>> import torch
        >>> model = MessageClassifier().eval()
        >>> model.helpful_probability(torch.zeros(4, 256, dtype=torch.uint8)).shape
        torch.Size([4])
    """

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.encoder = MessageEncoder()
        self.head = nn.Sequential(
            nn.Linear(self.encoder.out_features, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(512, 2),
        )

    def forward(self, messages: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(messages))

    def helpful_probability(self, messages: torch.Tensor) -> torch.Tensor:
        """P(helpful) for each message, ``float32[N]``."""
        return self(messages).softmax(-1)[..., 1]


class MessageRewardModel(nn.Module):
    """ONI-Ranking / Motif reward network: message bytes → one scalar score per message.

    Linear layers use orthogonal initialisation (gain 1, zero bias) as Motif's shell does;
    the convolutions and the embedding keep PyTorch's defaults.

    Example:
        >>> import torch
        >>> MessageRewardModel()(torch.zeros(5, 256, dtype=torch.uint8)).dtype
        torch.float32
    """

    def __init__(self):
        super().__init__()
        self.encoder = MessageEncoder()
        self.head = nn.Sequential(
            nn.Linear(self.encoder.out_features, 256),
            nn.ReLU(),
            nn.Linear(256, 512),
            nn.ReLU(),
            nn.Linear(512, 1),
        )
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight, gain=1.0)
                nn.init.zeros_(module.bias)

    def forward(self, messages: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(messages)).squeeze(-1)


class ServedModel(OwnLockOnCopy):
    """A network that serves rewards while a trainer updates a private copy of it.

    Readers take the current network under a lock and run it without holding the lock; the
    trainer hands over a fresh copy with :meth:`swap_model` (one reference assignment), so a
    reward computed in another thread always sees one complete set of weights and never waits
    for a gradient step.
    """

    def __init__(self, model: nn.Module, device=None, chunk_size: int = 8192):
        import threading

        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.chunk_size = int(chunk_size)
        self._lock = threading.Lock()
        self._model = model.to(self.device).eval()

    @property
    def model(self) -> nn.Module:
        """The network currently serving rewards (do not train it in place; see swap_model)."""
        return self._model

    def swap_model(self, model: nn.Module) -> None:
        """Atomically replaces the serving network with a copy the caller no longer touches."""
        model = model.to(self.device).eval()
        with self._lock:
            self._model = model

    @torch.no_grad()
    def _apply(self, messages, fn) -> torch.Tensor:
        """``fn(model, chunk)`` over the messages in chunks → ``float32[N]`` on the CPU."""
        with self._lock:
            model = self._model
        messages = as_message_tensor(messages).reshape(-1, 256)
        out = [fn(model, chunk.to(self.device)).float().cpu() for chunk in messages.split(self.chunk_size)]
        return torch.cat(out) if out else torch.zeros(0)

    def _model_state(self) -> dict:
        import copy

        with self._lock:
            return copy.deepcopy(self._model.state_dict())

    def _load_model_state(self, state: dict) -> None:
        import copy

        model = copy.deepcopy(self._model)
        model.load_state_dict(state)
        self.swap_model(model)
