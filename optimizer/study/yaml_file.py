"""Reading a YAML file the way a study file is read: ``yaml.safe_load``, and what PyYAML lets pass silently
refused with its line — a key given twice in one mapping, a YAML 1.1 base-60 number (pure, no torch)."""

from __future__ import annotations

from pathlib import Path

import yaml

from optimizer.study.errors import UserError

MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicate_keys(node: yaml.Node | None) -> None:
    """Raise a YAML error at the second of two equal keys in one mapping, anywhere in ``node``'s tree.

    PyYAML silently keeps the last value of a repeated key (a second ``layers:`` would win unseen). The check
    runs on the composed node tree (``yaml.compose``: no object is constructed); keys compare by resolved tag
    and text; ``<<:`` merge keys are skipped, so a mapping's own keys may still override merged ones."""
    stack = [node] if node is not None else []
    while stack:
        current = stack.pop()
        if isinstance(current, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key_node, value_node in current.value:
                stack.append(value_node)
                if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", current.start_mark,
                                                            f"duplicate key {key_node.value!r}",
                                                            key_node.start_mark)
                seen.add(key)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
        elif isinstance(current, yaml.ScalarNode) and current.tag in (INT_TAG, FLOAT_TAG) and ":" in current.value:
            raise yaml.constructor.ConstructorError(
                None, None, f"{current.value!r} is read by YAML 1.1 as a base-60 number "
                f"({yaml.safe_load(current.value)!r}), not as text; quote it (e.g. \"{current.value}\")",
                current.start_mark)


INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
"""Resolved tags of plain scalars PyYAML reads as numbers; one with a ':' is a YAML 1.1 base-60 number
(``12:00:00`` → 43200), which YAML 1.2 dropped: a SLURM time written unquoted would silently become 30 days."""


def read_yaml(path: Path, *, what: str) -> object:
    """The file's YAML, or one UserError naming the file: missing, unreadable, not UTF-8, malformed (with the
    line), a repeated key or a base-60 number (:func:`_refuse_duplicate_keys`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(source=str(path), key="", why=f"{what} not found") from None
    except OSError as err:
        raise UserError(source=str(path), key="", why=f"cannot read {what}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(source=str(path), key="", why=f"the {what} is not UTF-8 text") from None
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(source=str(path), key="", why=f"malformed YAML{where}: {problem}") from None
