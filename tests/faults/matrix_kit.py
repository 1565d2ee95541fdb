"""What a case of the one-process fault matrix says it expects, and how it says it.

A case is a function of a fresh temporary directory returning one line (what a user got); it
is registered with the class of error it must raise (and the words the message must hold) or
``"ok"`` (the mistake is handled: the function checks the handled result itself), and a bound:
the seconds within which its forked process must answer (past it: a ``hang``). The cases live
in tests/faults/fault_matrix.py, misuse_cases.py, config_cases.py and fuzz_cases.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BOUND = 15.0  # seconds: a forked case that has not answered by then is a hang


class Outcome(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


@dataclass(frozen=True)
class Spec:
    name: str
    fn: Callable[[Path], str]
    expect: str  # "ok", or the error class a user must get (with the words it must say)
    bound: float = DEFAULT_BOUND

    @property
    def expect_class(self) -> str | None:
        return None if self.expect.startswith("ok") else self.expect.split()[0]


def expect_error(
    fn: Callable[[], object], *needles: str, kind: type[BaseException] = Exception
) -> str:
    """Run ``fn``; a clear error is one of ``kind`` whose message holds every needle."""
    try:
        fn()
    except kind as e:
        text = f"{type(e).__name__}: {e}"
        missing = [n for n in needles if n not in text]
        if missing:
            raise Outcome("unclear error", f"{text[:300]} (does not say {missing})") from None
        return text
    except Exception as e:  # noqa: BLE001
        raise Outcome(
            "unclear error", f"{type(e).__name__}: {str(e)[:300]} (expected {kind.__name__})"
        ) from None
    raise Outcome("silent wrong", "no error was raised")


def expected(kind: type[BaseException], needles: tuple[str, ...]) -> str:
    return kind.__name__ + (" " + ", ".join(repr(n) for n in needles) if needles else "")


class Registry:
    """The cases of one module, in the order they are declared."""

    def __init__(self) -> None:
        self.specs: list[Spec] = []

    def error(
        self, name: str, kind: type[BaseException], *needles: str, bound: float = DEFAULT_BOUND
    ) -> Callable[[Callable[[Path], object]], Callable[[Path], object]]:
        """``fn(d)`` makes the mistake; it must raise ``kind`` saying every needle."""

        def deco(fn: Callable[[Path], object]) -> Callable[[Path], object]:
            self.specs.append(
                Spec(
                    name,
                    lambda d: expect_error(lambda: fn(d), *needles, kind=kind),
                    expected(kind, needles),
                    bound,
                )
            )
            return fn

        return deco

    def ok(
        self, name: str, what: str, bound: float = DEFAULT_BOUND
    ) -> Callable[[Callable[[Path], str]], Callable[[Path], str]]:
        """``fn(d)`` checks the handled result itself (raising ``Outcome`` when it is wrong)."""

        def deco(fn: Callable[[Path], str]) -> Callable[[Path], str]:
            self.specs.append(Spec(name, fn, f"ok: {what}", bound))
            return fn

        return deco

    def add(
        self, name: str, fn: Callable[[Path], str], expect: str, bound: float = DEFAULT_BOUND
    ) -> None:
        self.specs.append(Spec(name, fn, expect, bound))
