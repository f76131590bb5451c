"""Keyword-argument errors shared by the PyTorch and JAX front doors (imports no framework):
Python's own wording, with a hint at what was probably meant."""
from __future__ import annotations

import difflib
from typing import Iterable, Mapping, Optional


def unexpected_keyword(op: str, name: str, candidates: Iterable[str],
                       hints: Optional[Mapping[str, str]] = None, fallback: str = "") -> TypeError:
    """The TypeError for keyword ``name`` of ``op()``: its hint is ``hints[name]`` if given,
    else the closest of ``candidates`` ("did you mean ...?"), else ``fallback``."""
    if hints and name in hints:
        hint = f" ({hints[name]})"
    else:
        close = difflib.get_close_matches(name, list(candidates), n=1)
        if close and hints and close[0] in hints:  # e.g. a forward() argument: say where it goes
            hint = f" (did you mean {close[0]!r}? {hints[close[0]]})"
        else:
            hint = (f" (did you mean {close[0]!r}?)" if close else
                    (f" ({fallback})" if fallback else ""))
    return TypeError(f"{op}() got an unexpected keyword argument {name!r}{hint}")


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def check_tuning(op: str, tuning: Iterable[str], parameters: Iterable[str], where: str,
                 accepted: Iterable[str]) -> None:
    """The JAX front doors' rule: every keyword of ``tuning`` must be one that the chosen
    path (``where``: "backend='xla'", "axis_name", ...) takes (``accepted``). One that
    resembles a parameter of ``op`` more than any accepted keyword (a misspelled
    ``reduction``) is reported as Python reports it; the others are named with what the path
    accepts (and the closest of those)."""
    accepted = list(accepted)
    unknown = sorted(set(tuning) - set(accepted))
    for k in unknown:
        close = difflib.get_close_matches(k, list(parameters), n=1)
        if close and _ratio(k, close[0]) > max((_ratio(k, a) for a in accepted), default=0.0):
            raise unexpected_keyword(op, k, close)
    if unknown:
        close = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"unknown tuning keyword(s) {unknown} for {where}{hint}; "
                        f"it accepts {accepted}")


def jsd_not_vocab_parallel(keyword: str, owner: str = "") -> str:
    """The hint for a vocabulary-parallel keyword given to ``linear_jsd``, which has no
    vocab-parallel path on either front door (README): one wording for both. ``owner``: the
    front door whose ``linear_cross_entropy`` takes ``keyword`` when it is not the one called
    (``"logitless.jax"`` for ``axis_name=`` given to PyTorch's ``linear_jsd``)."""
    whose = f"{owner}'s linear_cross_entropy" if owner else "linear_cross_entropy"
    return (f"linear_jsd has no vocab-parallel path ({keyword}= is a keyword of {whose}): "
            "give it the whole student and teacher heads")
