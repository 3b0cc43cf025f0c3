"""Run parameters: ``--param run_date=2026-12-03`` on the command line, ``${run_date}`` in the spec.

One spec serves every night: a string value anywhere in the spec (a ``where`` filter, a path, a
table name, ``output.partition_values``, a Spark setting) may name a parameter as ``${name}``,
and each run fills in the values it was given. ``$${`` is a literal ``${``.

* A parameter the spec uses and the command line does not give is an error, except
  ``run_date``, which defaults to today's date in UTC (a scheduler that passes the night it runs
  for, rather than the day it starts, gives it explicitly).
* A ``--param`` the spec does not use is an error too (a misspelt ``--param run_dat=...``
  must not leave ``${run_date}`` at its default), except ``run_date``, which a scheduler may
  pass to every job.
* ``run_date`` must be a date written ``YYYY-MM-DD``.

Every problem is a :class:`ParameterError` naming the spec key (or ``--param``);
:func:`jobs.spec.load_spec` raises it as a ``SpecError``, so the CLI exits 2 before Spark starts.
"""
from __future__ import annotations

import datetime as dt
import re
from typing import Any

__all__ = ["RUN_DATE", "ParameterError", "parse_params", "substitute", "today"]

RUN_DATE = "run_date"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# ``$${`` (a literal ``${``), or ``${`` and whatever follows up to the next ``}`` (or the end).
_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)(\})?")


class ParameterError(ValueError):
    """A bad ``--param`` or ``${...}`` reference; ``key`` names the spec key or ``--param``."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


_error = ParameterError


def parse_params(texts: list[str] | None) -> dict[str, str]:
    """``["run_date=2026-12-03", ...]`` -> ``{"run_date": "2026-12-03"}``, checked.

    >>> parse_params(["run_date=2026-12-03", "region=eu"])
    {'run_date': '2026-12-03', 'region': 'eu'}
    """
    params: dict[str, str] = {}
    for text in texts or []:
        name, equals, value = text.partition("=")
        name = name.strip()
        if not equals:
            raise _error("--param", f"expected NAME=VALUE (e.g. run_date=2026-12-03), got {text!r}")
        if not _NAME.fullmatch(name):
            raise _error("--param", f"{name!r} is not a parameter name: expected letters, digits and _, "
                                    "not starting with a digit (e.g. run_date)")
        if name in params:
            raise _error(f"--param {name}", f"given twice ({params[name]!r} and {value!r}); give it once")
        if name == RUN_DATE:
            _check_date(value)
        params[name] = value
    return params


def _check_date(value: str) -> None:
    try:
        ok = dt.date.fromisoformat(value).isoformat() == value
    except ValueError:
        ok = False
    if not ok:
        raise _error(f"--param {RUN_DATE}", f"expected a date written YYYY-MM-DD (e.g. 2026-12-03), got {value!r}")


def today() -> str:
    """``run_date``'s default: today's date in UTC."""
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _references(text: str, key: str) -> list[str]:
    names = []
    for match in _REFERENCE.finditer(text):
        if match.group(0) == "$${":
            continue
        name, closed = match.group(1), match.group(2)
        if not closed or not _NAME.fullmatch(name):
            raise _error(key, f"malformed parameter reference in {text!r}: expected ${{name}} with a name "
                              "of letters, digits and _ (write $${ for a literal ${)")
        names.append(name)
    return names


def _strings(value: Any, key: str):
    """(dotted key, string) for every string value under ``value``."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for name, child in value.items():
            yield from _strings(child, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list):
        for child in value:
            yield from _strings(child, key)


def _filled(value: Any, params: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _REFERENCE.sub(lambda m: "${" if m.group(0) == "$${" else params[m.group(1)], value)
    if isinstance(value, dict):
        return {name: _filled(child, params) for name, child in value.items()}
    if isinstance(value, list):
        return [_filled(child, params) for child in value]
    return value


def substitute(document: dict[str, Any], given: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Fill the ``${name}`` references of ``document``'s strings from ``given``.

    Returns
    -------
    (dict, dict)
        The document with every reference replaced, and the parameters the run used
        (``run_date`` included, defaulted to today in UTC when the spec uses it and it was
        not given), for the summary.

    Raises
    ------
    ParameterError
        A malformed reference, or one to a parameter not given (naming the key); a given
        parameter the spec does not use (``--param``).

    Examples
    --------
    >>> substitute({"query": {"where": "day = '${run_date}'"}}, {"run_date": "2026-12-03"})
    ({'query': {'where': "day = '2026-12-03'"}}, {'run_date': '2026-12-03'})
    """
    used: dict[str, str] = {}
    for key, text in _strings(document, ""):
        for name in _references(text, key):
            if name in given:
                used[name] = given[name]
            elif name == RUN_DATE:
                used[name] = today()
            else:
                raise _error(key, f"uses ${{{name}}}, which the command line does not give; pass "
                                  f"--param {name}=VALUE (only {RUN_DATE} has a default: today, UTC)")
    unused = sorted(set(given) - set(used) - {RUN_DATE})
    if unused:
        uses = ", ".join(f"${{{n}}}" for n in sorted(used)) or "no parameter"
        raise _error(f"--param {unused[0]}", f"the spec does not use ${{{unused[0]}}} (it uses {uses}); "
                                             "remove it or correct its name")
    if RUN_DATE in given:
        used.setdefault(RUN_DATE, given[RUN_DATE])
    return _filled(document, {**given, **used}), used
