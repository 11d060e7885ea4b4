"""The field reference of the user guide (docs/reference/recipe.md and site.md), generated from the
pydantic models of the recipe and the site profile.

Why generated: the models are the one place a field, its type, default and limits are defined;
a hand-written table would drift from them the first time a field is added. The prose comes from
the models too: each section's text is its class docstring, and each field's note is the comment
written beside or just above it in the source (read here with ``ast``; pydantic keeps no
comments). ``tests/test_docs.py`` regenerates both pages and fails when the committed ones differ.

Regenerate after changing a model::

    .venv/bin/python -m beam_hpc.config.field_reference

Imports only pydantic and the config models: it runs on a login node or in CI without the rest.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site

REGENERATE = ".venv/bin/python -m beam_hpc.config.field_reference"
OUT_DIR = Path("docs") / "reference"
# The pages: file name, the top model, its title and the lines that open the page.
PAGES: tuple[tuple[str, type[BaseModel], str, str], ...] = (
    ("recipe.md", Recipe, "Recipe fields",
     "A recipe says what to train and with what topology: one YAML file per run "
     "(`recipes/` holds the seed's three and the two small ones). Any field can be overridden "
     "on the command line with `--set key.path=value`."),
    ("site.md", Site, "Site profile fields",
     "A site profile says what one cluster needs: partitions, account, container, paths, network. "
     "`env/example-site.yaml` is a commented starting point."),
)
_CONSTRAINTS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                ("min_length", "length >="), ("max_length", "length <="), ("pattern", "matches"))


def _field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` for the fields ``cls`` itself declares: the comment lines just above a
    field (no blank line between) and the one after it on its line, joined."""
    return _class_comments(cls.__module__).get(cls.__qualname__, {})


@functools.cache
def _class_comments(module_name: str) -> dict[str, dict[str, str]]:
    """``{class name: {field: comment}}`` for the top-level classes of one module, from its source
    (parsed once: ``inspect.getsource`` of a class parses the whole module again each time)."""
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return {}
    lines = source.splitlines()
    found: dict[str, dict[str, str]] = {}
    for body in ast.parse(source).body:
        if not isinstance(body, ast.ClassDef):
            continue
        notes = found.setdefault(body.name, {})
        for node in body.body:
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            above: list[str] = []
            row = node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            trailing = _trailing_comment(lines[(node.end_lineno or node.lineno) - 1])
            notes[node.target.id] = " ".join(part for part in (*above, trailing) if part)
    return found


def _trailing_comment(line: str) -> str:
    """The ``# ...`` after code on a line, outside string literals."""
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote and line[i - 1] != "\\":
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[i + 1:].strip()
    return ""


def _comments(model: type[BaseModel]) -> dict[str, str]:
    """Field comments of ``model`` and the classes it inherits fields from (the nearest wins)."""
    notes: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
            notes.update({k: v for k, v in _field_comments(cls).items() if v})
    return notes


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (``X`` or ``X | None``), else None."""
    if _is_model(annotation):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and _is_model(args[0]) else None


def _type_name(annotation: Any) -> str:
    """A short, readable type: ``int``, ``text``, ``one of: a, b``, ``list of text``, ``... or null``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "one of: " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0]) if args else 'values'}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if _is_model(annotation):
        return "section (below)"
    return {str: "text", int: "integer", float: "number", bool: "true or false"}.get(
        annotation, "any" if annotation is Any else getattr(annotation, "__name__", str(annotation)))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if value in ([], {}):
        return "empty"
    return f"`{value}`"


def _limits(info: FieldInfo) -> str:
    found = []
    for meta in info.metadata:
        for attr, word in _CONSTRAINTS:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{word} `{value}`")
    return ", ".join(found)


def _markdown(text: str) -> str:
    """Docstring markup as markdown: ``x`` -> `x`, :func:`f` -> `f`; ``<`` and ``>`` outside code
    spans escaped (``<group>`` would otherwise be read as an HTML tag and vanish)."""
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text.replace("``", "`"))
    parts = text.split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts)


def _cell(text: str) -> str:
    """Table-safe: pipes escaped, whitespace folded."""
    return _markdown(re.sub(r"\s+", " ", text)).replace("|", "\\|").strip()


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """``[(dotted prefix, model)]``, the model first, then its nested sections depth first."""
    found = [(prefix, model)]
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        if nested is not None:
            found += _sections(nested, f"{prefix}{name}.")
    return found


def render_page(model: type[BaseModel], title: str, intro: str) -> str:
    """One reference page: a section per (nested) model, a table row per field."""
    out = [f"# {title}", "", f"<!-- generated by `{REGENERATE}` from the pydantic models: do not edit -->", "",
           intro, ""]
    for prefix, section in _sections(model):
        heading = prefix.rstrip(".") or "top level"
        out += [f"## `{heading}`" if prefix else f"## {heading}", ""]
        doc = inspect.cleandoc(section.__doc__ or "")
        if doc and not doc.startswith(("A base class", "Usage docs")):
            for para in doc.split("\n\n"):
                out += [_markdown(re.sub(r"\s*\n\s*", " ", para)), ""]
        notes = _comments(section)
        out += ["| field | type | default | limits | notes |", "|---|---|---|---|---|"]
        for name, info in section.model_fields.items():
            out.append("| " + " | ".join(_cell(c) for c in (
                f"`{prefix}{name}`", _type_name(info.annotation), _default(info), _limits(info), notes.get(name, "")
            )) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render_all() -> dict[str, str]:
    """``{file name: text}`` for every page under docs/reference/."""
    return {name: render_page(model, title, intro) for name, model, title, intro in PAGES}


def main(argv: list[str] | None = None) -> int:
    """Write every page (atomically: a reader sees the old page or the new one) and name each."""
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.config.field_reference",
                                     description="write docs/reference/*.md from the recipe and site models")
    parser.add_argument("--out", default=str(OUT_DIR), help="directory to write the pages to (default: %(default)s)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)
        print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
