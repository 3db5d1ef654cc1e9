"""Configuration trees: nested dataclasses that are their own documentation, CLI and file format.

A configuration is a tree of dataclasses whose leaves are declared once, with :func:`setting`
(default, help text, and optionally allowed values, a parser for the command line, legacy flag
names). Everything else is derived from that declaration:

=========================  ==========================================================================
derived                    how
=========================  ==========================================================================
flat name                  the leaf's field name; a section with a ``PREFIX`` class attribute
                           prefixes its leaves (``PREFIX = "rm"``: ``lr`` → ``rm_lr``). Flat names
                           are unique over the tree (checked when the tree is walked).
command-line flag          ``--`` + flat name with ``-`` for ``_`` (``rm_lr`` → ``--rm-lr``); a bool
                           gives ``--x`` / ``--no-x``; ``Optional[...]`` accepts ``none``
flat keyword construction  ``Config(rm_lr=1e-3)`` on a root made with :func:`flat_init`
file format                :func:`to_dict` / :func:`from_dict` (nested or flat keys), YAML with
                           :func:`dump_yaml` / :func:`load_yaml`
range                      ``at_least`` / ``above`` / ``at_most`` of :func:`setting`: checked by
                           :func:`check_values` for every source (flags, files, Python) with one
                           message naming the flag, and shown in ``--help``
=========================  ==========================================================================

The parser this builds uses ``argparse.SUPPRESS`` defaults, so only flags given on the command
line are applied on top of a base configuration (defaults, a preset or a ``--config`` file).

Example:
    >>> from dataclasses import dataclass, field
    >>> @dataclass
    ... class Optim:
    ...     PREFIX = "opt"
    ...     lr: float = setting(3e-4, "learning rate", above=0, at_most=1)
    >>> @flat_init
    ... @dataclass
    ... class Run:
    ...     steps: int = setting(100, "number of steps")
    ...     optim: Optim = field(default_factory=Optim)
    >>> [leaf.flat for leaf in leaves(Run)]
    ['steps', 'opt_lr']
    >>> Run(opt_lr=0.1).optim.lr
    0.1
    >>> parser = argparse.ArgumentParser(prog="demo")
    >>> add_arguments(parser, Run)
    >>> args = parser.parse_args(["--opt-lr", "1e-3"])
    >>> apply_arguments(Run(), args).optim.lr
    0.001
    >>> to_dict(Run(steps=5))
    {'steps': 5, 'optim': {'lr': 0.0003}}
    >>> list(check_values(Run(opt_lr=10.0)))
    ['--opt-lr must be at most 1, not 10']
"""
import argparse
import copy
import dataclasses
import math
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = [
    "setting",
    "Leaf",
    "leaves",
    "flat_init",
    "add_arguments",
    "apply_arguments",
    "to_dict",
    "from_dict",
    "dump_yaml",
    "load_yaml",
    "replace_flat",
    "parse_count",
    "check_values",
    "show_number",
]

_META = "torchrl_oni.setting"


def setting(default: Any = MISSING, help: str = "", *, choices: Union[Sequence, Callable[[], Sequence], None] = None,
            parse: Optional[Callable[[str], Any]] = None, aliases: Sequence[str] = (), metavar: Optional[str] = None,
            nargs: Optional[str] = None, const: Any = None, secret: bool = False, default_factory: Any = MISSING,
            at_least: Optional[float] = None, above: Optional[float] = None, at_most: Optional[float] = None):
    """A configuration leaf: a dataclass field carrying its help text and command-line details.

    Args:
        default: the default value (or use ``default_factory`` for mutable ones).
        help: one sentence shown in ``--help`` and checked by the tests to exist.
        choices: allowed values, or a function returning them (evaluated when the parser is
            built or the value checked: registries fill themselves lazily).
        parse: turns the command-line string into the value (default: from the annotation).
        aliases: further flags accepted for this leaf (kept so old commands still run).
        metavar: the placeholder shown in ``--help``.
        nargs, const: as in argparse (``nargs="?"`` with ``const`` gives an optional value).
        secret: never written to files (:func:`to_dict` leaves it out): API keys, and orders for
            one start that a file must not repeat (``oni-train --overwrite``).
        at_least, above, at_most: the range of a number (``at_least``/``at_most`` inclusive,
            ``above`` exclusive; None: open on that side), checked by :func:`check_values` and
            shown in ``--help``. The single place a setting's bounds are declared.
    """
    meta = {_META: dict(help=help, choices=choices, parse=parse, aliases=tuple(aliases), metavar=metavar,
                        nargs=nargs, const=const, secret=secret, at_least=at_least, above=above, at_most=at_most)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Leaf:
    """One setting of a tree: where it lives (``path``), its flat name, type and declaration."""

    path: Tuple[str, ...]
    flat: str
    type: Any
    default: Any
    help: str
    choices: Any
    parse: Optional[Callable[[str], Any]]
    aliases: Tuple[str, ...]
    metavar: Optional[str]
    nargs: Optional[str]
    const: Any
    secret: bool
    at_least: Optional[float] = None
    above: Optional[float] = None
    at_most: Optional[float] = None

    @property
    def flag(self) -> str:
        return "--" + self.flat.replace("_", "-")

    def range_text(self) -> Optional[str]:
        """The declared range as an interval (``[1, 4096]``, ``(0, 1]``, ``>= 0``), or None.

        >>> Leaf(("lr",), "lr", float, 3e-4, "", None, None, (), None, None, None, False, above=0,
        ...      at_most=1).range_text()
        '(0, 1]'
        """
        low = self.at_least if self.at_least is not None else self.above
        if low is None and self.at_most is None:
            return None
        if self.at_most is None:
            return f"{'>=' if self.above is None else '>'} {show_number(low)}"
        if low is None:
            return f"<= {show_number(self.at_most)}"
        return f"{'[' if self.above is None else '('}{show_number(low)}, {show_number(self.at_most)}]"

    def out_of_range(self, value) -> Optional[str]:
        """One sentence naming the flag when ``value`` (a number) is outside the declared range."""
        if self.at_least is not None and value < self.at_least:
            return f"{self.flag} must be at least {show_number(self.at_least)}, not {show_number(value)}"
        if self.above is not None and value <= self.above:
            bound = "positive" if self.above == 0 else f"above {show_number(self.above)}"
            return f"{self.flag} must be {bound}, not {show_number(value)}"
        if self.at_most is not None and value > self.at_most:
            return f"{self.flag} must be at most {show_number(self.at_most)}, not {show_number(value)}"
        return None

    def allowed(self) -> Optional[Tuple]:
        """The allowed values (a lazily-filled registry is asked now), or None."""
        choices = self.choices() if callable(self.choices) else self.choices
        if choices is None:
            args = _literal_args(self.type)
            return tuple(args) if args else None
        return tuple(choices)

    def get(self, root) -> Any:
        obj = root
        for name in self.path:
            obj = getattr(obj, name)
        return obj

    def set(self, root, value) -> None:
        if _sequence_item(_strip_optional(self.type)[0]) is not None:
            # a lone value or None for a list setting: what a Python caller means is obvious
            value = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        obj = root
        for name in self.path[:-1]:
            obj = getattr(obj, name)
        setattr(obj, self.path[-1], value)


def _hints(cls) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _literal_args(tp):
    tp, _ = _strip_optional(tp)
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return None


def leaves(cls, _path: Tuple[str, ...] = (), _prefix: str = "") -> List[Leaf]:
    """Every leaf of a configuration class, depth first, in declaration order.

    Raises:
        TypeError: a field declared without :func:`setting` (no help text) or two leaves with
            the same flat name.
    """
    out: List[Leaf] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            prefix = getattr(tp, "PREFIX", "")
            out.extend(leaves(tp, _path + (f.name,), f"{_prefix}{prefix}_" if prefix else _prefix))
            continue
        meta = f.metadata.get(_META)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(): it has no help text")
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append(Leaf(path=_path + (f.name,), flat=_prefix + f.name, type=tp, default=default, **meta))
    if not _path:
        seen: Dict[str, Leaf] = {}
        for leaf in out:
            if leaf.flat in seen:
                raise TypeError(f"two settings are both called {leaf.flat!r}: {'.'.join(seen[leaf.flat].path)} "
                                f"and {'.'.join(leaf.path)}")
            seen[leaf.flat] = leaf
    return out


def _leaf_table(cls) -> Dict[str, Leaf]:
    table = {}
    for leaf in leaves(cls):
        table[leaf.flat] = leaf
        for alias in leaf.aliases:
            table[alias.lstrip("-").replace("-", "_")] = leaf
    return table


def flat_init(cls):
    """Lets a root configuration dataclass also be built from flat names: ``Config(rm_lr=1e-3)``.

    Section keywords (``Config(optim=Optim(...))``) keep working; flat keywords are applied on
    top, in the order given.
    """
    generated = cls.__init__
    section_names = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, **kwargs):
        # a section name given a section; anything else is a flat name (a leaf may share a section's
        # name through an alias, e.g. --reward-model)
        sections = {k: v for k, v in kwargs.items() if k in section_names and dataclasses.is_dataclass(v)}
        generated(self, **sections)
        flat = {k: v for k, v in kwargs.items() if k not in sections}
        if flat:
            replace_flat(self, flat, inplace=True)

    __init__.__doc__ = generated.__doc__
    cls.__init__ = __init__
    return cls


def replace_flat(root, values: Dict[str, Any], inplace: bool = False):
    """A copy of ``root`` (or ``root`` itself) with the flat-named settings of ``values`` changed.

    Raises:
        TypeError: an unknown name (the error lists the closest known ones).
    """
    out = root if inplace else copy.deepcopy(root)
    table = _leaf_table(type(root))
    for name, value in values.items():
        leaf = table.get(name)
        if leaf is None:
            raise TypeError(f"{type(root).__name__} has no setting {name!r}{_did_you_mean(name, table)}")
        leaf.set(out, value)
    return out


def _did_you_mean(name: str, table) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(table), n=3)
    return f" (did you mean {', '.join(close)}?)" if close else ""


# ---------------------------------------------------------------------------------- parsing
def parse_count(text: str) -> int:
    """A whole, finite, non-negative number written as ``300000``, ``3e5``, ``300k``, ``2M`` or ``1_000``.

    Example:
        >>> parse_count("2M"), parse_count("3e5"), parse_count("1_024")
        (2000000, 300000, 1024)
        >>> parse_count("inf")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: not a finite number: 'inf'
    """
    t = str(text).strip().lower().replace("_", "")
    mult = 1
    if t and t[-1] in "kmg":
        mult = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}[t[-1]]
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _scalar_parser(tp) -> Callable[[str], Any]:
    if tp is bool:
        return _parse_bool
    if tp is int:
        return parse_count
    if tp is float:
        return _finite_float
    if typing.get_origin(tp) is typing.Literal:
        return str
    return tp if callable(tp) else str


def _parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str):
        if str(text).strip().lower() in ("none", "null", ""):
            return None
        return parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def _sequence_item(tp):
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return args[0] if args else str
    return None


def show_number(value) -> str:
    """A bound or a value as a person writes it, and as the command line reads it back: whole
    numbers ending in many zeros in ``e`` notation.

    >>> show_number(10_000_000_000), show_number(4096), show_number(1_048_576), show_number(3e-4), show_number(1.0)
    ('1e10', '4096', '1048576', '0.0003', '1')
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(abs(value))
        zeros = len(text) - len(text.rstrip("0"))
        if len(text) > 6 and zeros >= 3:
            return ("-" if value < 0 else "") + f"{text[: len(text) - zeros]}e{zeros}"
        return str(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _show_default(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def add_arguments(parser: argparse.ArgumentParser, cls, defaults=None,
                  only: Optional[Sequence[str]] = None) -> None:
    """Adds one flag per leaf of ``cls`` to ``parser``, grouped by section.

    ``defaults`` (an instance) only changes what ``--help`` shows. ``only`` (flat names) limits
    the flags to those settings: a command that needs part of a tree (``oni-annotate-pairs``
    takes the annotator settings of ``oni-train``). Every flag defaults to
    ``argparse.SUPPRESS``: read the given ones with :func:`apply_arguments`.

    Example:
        >>> @dataclass
        ... class Server:
        ...     url: str = setting("localhost", "where")
        ...     port: int = setting(80, "which port")
        >>> parser = argparse.ArgumentParser(prog="demo")
        >>> add_arguments(parser, Server, only=["port"])
        >>> vars(parser.parse_args(["--port", "8080"]))
        {'port': 8080}

    Raises:
        TypeError: a name of ``only`` that is no setting of ``cls``.
    """
    all_leaves = leaves(cls)
    wanted = None if only is None else set(only)
    if wanted is not None:
        unknown = sorted(wanted - {leaf.flat for leaf in all_leaves})
        if unknown:
            raise TypeError(f"{cls.__name__} has no setting {', '.join(map(repr, unknown))}")
    groups: Dict[Tuple[str, ...], Any] = {}
    for leaf in all_leaves:
        if wanted is not None and leaf.flat not in wanted:
            continue
        section = leaf.path[:-1]
        if section not in groups:
            groups[section] = parser if not section else parser.add_argument_group(".".join(section))
        group = groups[section]
        shown = leaf.get(defaults) if defaults is not None else leaf.default
        span = leaf.range_text()
        help_text = f"{leaf.help} ({f'range: {span}; ' if span else ''}default: {_show_default(shown)})"
        names = [leaf.flag, *leaf.aliases]
        tp, optional = _strip_optional(leaf.type)
        if tp is bool and not optional:
            group.add_argument(*names, dest=leaf.flat, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        item = _sequence_item(tp)
        kwargs: Dict[str, Any] = dict(dest=leaf.flat, default=argparse.SUPPRESS, help=help_text)
        parse = leaf.parse or _scalar_parser(item if item is not None else tp)
        if optional:
            parse = _optional(parse)
        kwargs["type"] = parse
        if item is not None:
            kwargs["nargs"] = "+"
        if leaf.nargs is not None:
            kwargs["nargs"] = leaf.nargs
            kwargs["const"] = leaf.const
        allowed = leaf.allowed()
        if allowed is not None:
            kwargs["choices"] = list(allowed) + ([None] if optional else [])
            kwargs["metavar"] = leaf.metavar or "{" + ",".join(map(str, allowed)) + "}"
        else:
            kwargs["metavar"] = leaf.metavar or _METAVARS.get(item if item is not None else tp, "TEXT")
        group.add_argument(*names, **kwargs)


def apply_arguments(base, args: argparse.Namespace):
    """A copy of ``base`` with every flag present in ``args`` applied."""
    out = copy.deepcopy(base)
    for leaf in leaves(type(base)):
        if hasattr(args, leaf.flat):
            value = getattr(args, leaf.flat)
            if isinstance(value, list):
                value = tuple(value)
            leaf.set(out, value)
    return out


# ---------------------------------------------------------------------------------- files
def to_dict(root) -> Dict[str, Any]:
    """Nested plain dict of plain values, secrets left out; the inverse of :func:`from_dict`."""

    def convert(obj):
        if dataclasses.is_dataclass(obj):
            return {f.name: convert(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                    if not f.metadata.get(_META, {}).get("secret")}
        if isinstance(obj, tuple):
            return list(obj)
        return obj

    return convert(root)


def _check_kind(leaf: Leaf, value: Any) -> None:
    """Raises ``TypeError`` for a value read from a file that cannot be what ``leaf`` holds: a
    mapping or a list where one value belongs, a non-string where a name belongs. (Values of the
    right kind but out of range are :func:`check_values`'s.)"""
    if value is None:
        return
    tp, _ = _strip_optional(leaf.type)
    item = _sequence_item(tp)
    if item is not None:
        values = value if isinstance(value, (list, tuple)) else [value]
        tp = item
    else:
        values = [value]
    for v in values:
        if isinstance(v, (dict, list, tuple, set)):
            raise TypeError(f"{leaf.flag}: a {type(v).__name__} where one value belongs")
        if (tp is str or _literal_args(tp) is not None) and not isinstance(v, str) and (
                isinstance(v, bool) or not isinstance(v, (int, float))):
            raise TypeError(f"{leaf.flag} must be a name or text, not {v!r}")


def from_dict(cls, data: Dict[str, Any], strict: bool = True):
    """An instance of ``cls`` from a nested dict (as :func:`to_dict` writes) or flat names.

    Args:
        strict: unknown names raise ``TypeError``; ``False`` skips them (old checkpoints).
    """
    table = _leaf_table(cls)
    by_path = {leaf.path: leaf for leaf in leaves(cls)}
    out = cls()

    def walk(prefix: Tuple[str, ...], d: Dict[str, Any]):
        for key, value in d.items():
            path = prefix + (key,)
            if isinstance(value, dict) and any(p[: len(path)] == path for p in by_path) and path not in by_path:
                walk(path, value)
                continue
            leaf = by_path.get(path) or (table.get(key) if not prefix else None)
            if leaf is None:
                if strict:
                    raise TypeError(f"unknown setting {'.'.join(path)!r}{_did_you_mean(key, table)}")
                continue
            _check_kind(leaf, value)
            if isinstance(value, list):
                value = tuple(value)
            leaf.set(out, value)

    walk((), dict(data))
    return out


def dump_yaml(root) -> str:
    import yaml

    return yaml.safe_dump(to_dict(root), sort_keys=False, default_flow_style=False)


MAX_YAML_ALIAS_NODES = 10_000
"""Most values YAML aliases (``*name``) may repeat in a configuration file: a few aliases are
handy, a chain of them (the "billion laughs" pattern) grows a 400-byte file into hundreds of
millions of values."""


def _yaml_loader():
    """``yaml.SafeLoader`` (no Python tags) that refuses a file whose aliases repeat more than
    :data:`MAX_YAML_ALIAS_NODES` values in all."""
    import yaml

    def size(node, memo) -> int:
        key = id(node)
        if key not in memo:
            memo[key] = 1  # a cycle counts once
            value = node.value if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)) else ()
            items = [n for pair in value for n in pair] if isinstance(node, yaml.MappingNode) else value
            memo[key] = 1 + sum(size(n, memo) for n in items)
        return memo[key]

    class ConfigLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            alias = self.check_event(yaml.AliasEvent)
            node = super().compose_node(parent, index)
            if alias:
                memo = self.__dict__.setdefault("_sizes", {})
                self._repeated = getattr(self, "_repeated", 0) + size(node, memo)
                if self._repeated > MAX_YAML_ALIAS_NODES:
                    raise ValueError(f"its YAML aliases (*name) repeat more than {MAX_YAML_ALIAS_NODES:,} "
                                     f"values: not a configuration")
            return node

    return ConfigLoader


def load_yaml(cls, text: str, strict: bool = True):
    """An instance of ``cls`` from YAML text (safe tags only; aliases may repeat at most
    :data:`MAX_YAML_ALIAS_NODES` values); ``TypeError``/``ValueError``/``yaml.YAMLError`` on a bad file."""
    import yaml

    data = yaml.load(text, Loader=_yaml_loader()) or {}  # noqa: S506 - a SafeLoader subclass
    if not isinstance(data, dict):
        raise TypeError("a configuration file holds a mapping of settings")
    return from_dict(cls, data, strict=strict)


def check_values(root) -> Iterator[str]:
    """One message per leaf whose value is not among its allowed values, not of its type or
    outside its declared range (``at_least``, ``above``, ``at_most`` of :func:`setting`)."""
    for leaf in leaves(type(root)):
        value = leaf.get(root)
        tp, optional = _strip_optional(leaf.type)
        if value is None:
            if not optional:
                yield f"{leaf.flag} must be set"
            continue
        allowed = leaf.allowed()
        if allowed is not None and value not in allowed:
            yield f"unknown {leaf.flag} {value!r} ({', '.join(map(str, allowed))})"
            continue
        if tp is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            yield f"{leaf.flag} must be a finite number, not {value!r}"
            continue
        if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
                leaf.set(root, value)
            else:
                yield f"{leaf.flag} must be a whole number, not {value!r}"
                continue
        if tp is bool and not isinstance(value, bool):
            yield f"{leaf.flag} must be true or false, not {value!r}"
            continue
        if tp in (int, float):
            message = leaf.out_of_range(value)
            if message:
                yield message
