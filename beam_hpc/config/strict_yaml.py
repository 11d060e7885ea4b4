"""The one YAML reader for recipes, site profiles and ``--set`` override values.

Why one reader: a value must mean the same thing whether it is written in a recipe, a site file or
on the command line, and every way a YAML input can go wrong must end in one
:class:`~beam_hpc.errors.InputError` line (file or override, line, value, fix) instead of a
traceback, a hang or a silent surprise. PyYAML's ``safe_load`` alone leaves five holes, closed here:
size (files over :data:`MAX_BYTES` are refused before parsing: a mistaken path to a dataset must not
stall the login node); alias expansion ("billion laughs": expanded sizes are counted while composing,
refused past :data:`MAX_NODES`, with recursive aliases and nesting past :data:`MAX_DEPTH`);
duplicate keys (refused with both lines, merges excepted; PyYAML keeps the later one silently);
tags (only the plain core tags); and Slurm times (YAML 1.1 reads ``12:00:00`` as 43200 and
``2026-01-01`` as a date: those resolvers are dropped, so times stay strings, quoted or not). Bytes
that are not UTF-8 are named with their offset; an unreadable path is named with what to do.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from beam_hpc.errors import InputError, shorten

# The largest shipped recipe is about 3 KB; PyYAML's pure-Python parser needs about a second and tens of
# MB per MB of input, so 1 MB leaves a 300x margin for hand-written files.
MAX_BYTES = 1_000_000
MAX_NODES = 100_000  # values after alias expansion; a full recipe has a few hundred
MAX_DEPTH = 64  # nesting levels; recipes use at most four

_CORE = "tag:yaml.org,2002:"
ALLOWED_TAGS = frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null", "map", "seq"))
_MERGE = _CORE + "merge"

# PyYAML's YAML 1.1 int and float patterns without their sexagesimal (base 60) alternatives.
_INT = re.compile(
    r"""^(?:[-+]?0b[0-1_]+
    |[-+]?0[0-7_]+
    |[-+]?(?:0|[1-9][0-9_]*)
    |[-+]?0x[0-9a-fA-F_]+)$""",
    re.X,
)
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Refusal(Exception):
    """A strictness rule broken while composing; turned into an InputError with the source name."""

    def __init__(self, message: str, mark: Any = None) -> None:
        super().__init__(message)
        self.message, self.mark = message, mark


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the checks in the module docstring; one instance per document.

    Every node's expanded size is counted as it is composed (an alias counts as the whole node it
    names), bottom-up, so a "billion laughs" document is refused after a few thousand nodes, in
    milliseconds. Allowed tags: ``!!str !!int !!float !!bool !!null !!map !!seq``; ``!!python/...``,
    ``!!binary``, ``!!set`` and local ``!tags`` are refused (no field needs them; they are the classic
    attack surface). The sexagesimal int/float and the timestamp resolvers are dropped (YAML 1.2's
    core schema has neither), so ``24:00:00``, ``30:00`` and ``1-00:00:00`` stay strings."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_CORE + "int", _CORE + "float", _CORE + "timestamp")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> values once expanded (set when composed)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise _Refusal("an alias refers to the node that contains it (a recursive anchor)", mark)
            return node
        event = self.peek_event()
        tag = getattr(event, "tag", None)
        if tag is not None and tag not in ALLOWED_TAGS:
            shown = "!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag
            raise _Refusal(
                f"the tag {shorten(shown)} is not allowed; write the plain value (only the core tags "
                "!!str !!int !!float !!bool !!null !!map !!seq may appear)",
                event.start_mark,
            )
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refusal(f"nested deeper than {MAX_DEPTH} levels; flatten it", event.start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        size = 1
        if isinstance(node, SequenceNode):
            size += sum(self._sizes[id(child)] for child in node.value)
        elif isinstance(node, MappingNode):
            size += sum(self._sizes[id(k)] + self._sizes[id(v)] for k, v in node.value)
            _refuse_duplicates(node)
        if size > MAX_NODES:
            raise _Refusal(
                f"expands to more than {MAX_NODES} values once its aliases are expanded; a recipe or "
                "site has a few hundred: write the values out or alias only small sections",
                node.start_mark,
            )
        self._sizes[id(node)] = size
        return node


StrictLoader.add_implicit_resolver(_CORE + "int", _INT, list("-+0123456789"))
StrictLoader.add_implicit_resolver(_CORE + "float", _FLOAT, list("-+0123456789."))


def _refuse_duplicates(node: MappingNode) -> None:
    """The same scalar key twice in one mapping is refused with both lines (merged keys excepted)."""
    seen: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not isinstance(key, ScalarNode) or key.tag == _MERGE:
            continue
        if (key.tag, key.value) in seen:
            raise _Refusal(
                f"duplicate key {shorten(key.value)} (first at line {seen[key.tag, key.value]}); keep one of them",
                key.start_mark,
            )
        seen[key.tag, key.value] = key.start_mark.line + 1


def _parse(text: str, source: str, fix: str, lines: bool = True) -> Any:
    """Parse one document; every failure becomes one InputError line ``<source>: line N: ...``
    (without the line for a one-line ``--set`` value: ``lines=False``)."""

    def at(mark: Any) -> str:
        return f": line {mark.line + 1}" if lines and mark is not None else ""

    loader = None
    try:
        loader = StrictLoader(text)  # the reader refuses control characters here already
        return loader.get_single_data()
    except _Refusal as err:
        raise InputError(f"{source}{at(err.mark)}: {err.message}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        what = " ".join(str(p) for p in (err.context, err.problem) if p)
        raise InputError(f"{source}{at(mark)}: not valid YAML ({_one_line(what)}); {fix}") from None
    except yaml.reader.ReaderError as err:  # control characters: say which and where
        line = text.count("\n", 0, err.position) + 1
        where = f"line {line}: " if lines else ""
        raise InputError(
            f"{source}: {where}not valid YAML (the control character #x{_code(err.character):04x} is not allowed); {fix}"
        ) from None
    except yaml.YAMLError as err:  # anything else PyYAML may raise
        raise InputError(f"{source}: not valid YAML ({_one_line(str(err))}); {fix}") from None
    except RecursionError:
        raise InputError(f"{source}: nested too deeply to read; flatten it") from None
    finally:
        if loader is not None:
            loader.dispose()


def _code(character: int | str) -> int:
    return ord(character) if isinstance(character, str) else int(character)


def _one_line(text: str, limit: int = 200) -> str:
    """PyYAML's multi-line problem text as one line of at most about ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit]}..."


def read_yaml_file(path: str | Path, kind: str = "recipe") -> Any:
    """Read and parse a recipe or site file strictly; ``kind`` names it in messages."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError(f"{p}: no such {kind} file; check the path (see recipes/ and env/ for the shipped ones)") from None
    except (OSError, ValueError) as err:
        raise InputError(f"{shorten(str(p))}: cannot read this {kind} file ({_reason(err)}); check the path") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{p}: is a directory, not a {kind} file; name the .yaml file inside it")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{p}: is not a regular file; give the {kind} as a .yaml file")
    if st.st_size > MAX_BYTES:
        raise InputError(
            f"{p}: {st.st_size} bytes is too large for a {kind} file (limit {MAX_BYTES}); is this the right file?"
        )
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise InputError(f"{p}: cannot read this {kind} file ({_reason(err)}); fix its permissions or the path") from None
    if len(raw) > MAX_BYTES:
        raise InputError(f"{p}: more than {MAX_BYTES} bytes is too large for a {kind} file; is this the right file?")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{p}: not UTF-8 (byte {err.start}: {raw[err.start:err.start + 1]!r}); save the file as UTF-8"
        ) from None
    return _parse(text, str(p), f"fix the {kind} file's syntax")


def read_yaml_mapping(path: str | Path, kind: str = "recipe") -> dict[str, Any]:
    """A recipe or site file must be a mapping at the top (``key: value`` lines)."""
    data = read_yaml_file(path, kind)
    if data is None:
        raise InputError(f"{path}: the {kind} file is empty; a {kind} is a YAML mapping (key: value lines)")
    if not isinstance(data, dict):
        raise InputError(f"{path}: a {kind} is a YAML mapping (key: value), got {type(data).__name__}")
    return data


def parse_yaml_value(text: str, source: str) -> Any:
    """One ``--set`` value, read with the same rules as a file value (``source`` names the override)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise InputError(f"{source}: the value is longer than {MAX_BYTES} bytes; put it in the recipe file")
    return _parse(text, source, "quote the value if it is a string, e.g. --set 'name=\"a: b\"'", lines=False)


def _reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return shorten(str(err))


__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_NODES",
    "StrictLoader",
    "parse_yaml_value",
    "read_yaml_file",
    "read_yaml_mapping",
]
