"""The keys of ONI's transforms, the TorchRL way: ``in_keys=`` / ``out_keys=``, ``set_keys``.

Each transform names the role of every entry of its ``in_keys`` and ``out_keys`` with a
:class:`KeyRole` (``"message"``, ``"caption_hash"``, ``"intrinsic_reward"``...). From them
:class:`KeyedTransform` gives it what TorchRL's own transforms and losses offer:

* ``in_keys=`` / ``out_keys=`` at construction, checked once: the wrong number of entries is one
  ``ValueError`` that lists the roles;
* the transform's older keywords (``message_key=``, ``out_key=``...) as aliases of one slot each;
  a keyword that contradicts its slot of ``in_keys`` / ``out_keys`` is a ``ValueError`` (the same
  key twice is fine);
* ``set_keys(role=key, ...)`` as on TorchRL's losses (:meth:`torchrl.objectives.LossModule.set_keys`):
  an unknown role is a ``ValueError`` naming the accepted ones, ``None`` restores the default;
* ``tensor_keys``: the roles and their current keys, read-only;
* the old attribute names (``transform.message_key``) read (and set) their slot.

A role whose default is ``None`` is optional: its slot is left out of the list while it has no key
(an optional role comes after the required ones of its list).

Example:
    >>> from torchrl_oni.transforms import IntrinsicRewardTransform
    >>> t = IntrinsicRewardTransform(lambda m, h: m[:, 0].float(), in_keys=["text", "text_hash", "seen"])
    >>> t.message_key, t.out_keys
    ('text', ['intrinsic_reward'])
    >>> t.set_keys(intrinsic_reward="bonus").out_keys
    ['bonus']
    >>> t.set_keys(message=None).in_keys  # None: back to the default key
    ['message', 'text_hash', 'seen']
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from tensordict.utils import unravel_key

__all__ = ["KeyRole", "KeyedTransform", "resolve_keys", "alias_property"]

NestedKey = Union[str, Tuple[str, ...]]


@dataclass(frozen=True)
class KeyRole:
    """One entry of a transform's ``in_keys`` or ``out_keys``.

    Attributes:
        name: the role, as ``set_keys`` and ``tensor_keys`` name it (``"message"``).
        default: the key used when none is given; ``None``: optional, absent by default.
        alias: the transform's older keyword for this slot (``"message_key"``), if any.
    """

    name: str
    default: Optional[NestedKey]
    alias: Optional[str] = None


def _key(value) -> NestedKey:
    if not isinstance(value, (str, tuple)):
        raise TypeError(f"a tensordict key is a str or a tuple of str, got {type(value).__name__}")
    return unravel_key(value)


def _describe(roles: Sequence[KeyRole]) -> str:
    return ", ".join(f"{r.name}{' (optional)' if r.default is None else ''}" for r in roles)


def resolve_keys(owner: str, slot: str, roles: Sequence[KeyRole], given: Optional[Sequence],
                 aliases: Mapping[str, object]) -> List[NestedKey]:
    """The key list of one slot (``"in_keys"`` or ``"out_keys"``) from ``given`` and the aliases.

    Args:
        owner: the transform's class name, for errors.
        slot: ``"in_keys"`` or ``"out_keys"``.
        roles: the roles of the slot, in order.
        given: the list the caller passed (``None``: build it from the aliases and defaults).
        aliases: ``{alias keyword: value or None}`` as the caller passed them.

    Raises:
        ValueError: ``given`` has the wrong number of entries, or an alias contradicts it.
    """
    required = [r for r in roles if r.default is not None]
    if given is None:
        out = []
        for role in roles:
            value = aliases.get(role.alias) if role.alias else None
            value = role.default if value is None else value
            if value is not None:
                out.append(_key(value))
        return out
    if isinstance(given, (str, tuple)):
        given = [given]
    given = [_key(k) for k in given]
    if not len(required) <= len(given) <= len(roles):
        count = (f"{len(roles)}" if len(required) == len(roles)
                 else f"{len(required)} to {len(roles)}")
        raise ValueError(f"{owner} takes {count} {slot} ({_describe(roles)}), got {len(given)}: {given}")
    for i, role in enumerate(roles):
        value = aliases.get(role.alias) if role.alias else None
        if value is None:
            continue
        have = given[i] if i < len(given) else None
        if have != _key(value):
            raise ValueError(f"{owner}: {role.alias}={value!r} contradicts {slot}[{i}]={have!r} "
                             f"({role.name}); give one of them")
    return given


def alias_property(role: str, slot: str, index: int, doc: str = "") -> property:
    """An attribute that reads ``slot[index]`` (``None`` when absent) and sets it through ``set_keys``.

    Args:
        role: the role's name (what ``set_keys`` is called with).
        slot: ``"in_keys"`` or ``"out_keys"``.
        index: the role's position in the slot.
    """
    if slot not in ("in_keys", "out_keys"):
        raise ValueError(f"slot must be 'in_keys' or 'out_keys', got {slot!r}")

    def get(self):
        keys = getattr(self, slot)
        return keys[index] if index < len(keys) else None

    def set(self, value):
        self.set_keys(**{role: value})

    return property(get, set, doc=doc or f"``{slot}[{index}]``: the key of the {role!r} role (see ``set_keys``).")


class KeyedTransform:
    """Mixin for a :class:`~torchrl.envs.transforms.Transform` whose keys have named roles.

    The class declares ``_IN_ROLES`` and ``_OUT_ROLES`` (tuples of :class:`KeyRole`), or overrides
    :meth:`_key_roles` when they depend on its settings; ``__init__`` passes
    ``self._resolve_keys(in_keys, out_keys, aliases)`` to ``Transform.__init__``.
    """

    _IN_ROLES: Tuple[KeyRole, ...] = ()
    _OUT_ROLES: Tuple[KeyRole, ...] = ()

    def _key_roles(self) -> Tuple[Tuple[KeyRole, ...], Tuple[KeyRole, ...]]:
        return self._IN_ROLES, self._OUT_ROLES

    @classmethod
    def _resolve_keys(cls, in_keys, out_keys, aliases: Mapping[str, object],
                      roles: Optional[Tuple[Tuple[KeyRole, ...], Tuple[KeyRole, ...]]] = None):
        """``(in_keys, out_keys)`` for ``Transform.__init__`` (see :func:`resolve_keys`)."""
        in_roles, out_roles = roles if roles is not None else (cls._IN_ROLES, cls._OUT_ROLES)
        return (resolve_keys(cls.__name__, "in_keys", in_roles, in_keys, aliases),
                resolve_keys(cls.__name__, "out_keys", out_roles, out_keys, aliases))

    def tensor_keys_dict(self) -> Dict[str, Optional[NestedKey]]:
        in_roles, out_roles = self._key_roles()
        out: Dict[str, Optional[NestedKey]] = {}
        for roles, keys in ((in_roles, self.in_keys), (out_roles, self.out_keys)):
            for i, role in enumerate(roles):
                out[role.name] = keys[i] if i < len(keys) else None
        return out

    @property
    def tensor_keys(self) -> Mapping[str, Optional[NestedKey]]:
        """``{role: key}`` for every role of ``in_keys`` and ``out_keys`` (read-only; see ``set_keys``)."""
        return MappingProxyType(self.tensor_keys_dict())

    def set_keys(self, **kwargs):
        """Sets the tensordict key of each named role, as TorchRL's losses do; returns the transform.

        ``None`` restores the role's default. Accepted roles: see :attr:`tensor_keys`.

        Raises:
            ValueError: an unknown role.
        """
        in_roles, out_roles = self._key_roles()
        known = {r.name: r for r in (*in_roles, *out_roles)}
        for name in kwargs:
            if name not in known:
                raise ValueError(f"{name!r} is not a key role of {type(self).__name__}; accepted: "
                                 f"{', '.join(known)}")
        current = self.tensor_keys_dict()
        for name, value in kwargs.items():
            current[name] = known[name].default if value is None else _key(value)
        lists = []
        for roles in (in_roles, out_roles):
            keys = [current[r.name] for r in roles]
            while keys and keys[-1] is None:
                keys.pop()
            if any(k is None for k in keys):
                missing = [r.name for r, k in zip(roles, keys) if k is None]
                raise ValueError(f"{type(self).__name__}: roles {missing} need a key")
            lists.append(keys)
        self.in_keys, self.out_keys = lists
        self._keys_changed()
        return self

    def _keys_changed(self) -> None:
        """Forgets the specs an env computed from the old keys (through any ``Compose``)."""
        try:
            env = self.container  # Transform.container: the env, past the Compose transforms
        except AttributeError:  # not attached yet
            env = None
        if env is not None and hasattr(env, "empty_cache"):
            env.empty_cache()
        self.empty_cache()
