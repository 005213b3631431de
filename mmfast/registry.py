"""Typed registries for methods and evaluation tasks (timm style) plus an entry-point group for outside packages.

Built-in methods and tasks register on import of their package::

    @PRUNERS.register("fastv")
    class FastV(Pruner): ...

    @TASKS.register("pope")
    class PopeTask(Task): ...

Outside packages add methods and tasks through the entry-point group ``mmfast.plugins``: each entry
point names a module (imported, so its decorators run) or a callable (called with no arguments).
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from .errors import UnknownMethodError

if TYPE_CHECKING:
    from .context import MethodContext
    from .decoding.base import Decoder
    from .eval.tasks import Task
    from .pruning.base import Pruner
    from .speculative.base import Drafter

logger = logging.getLogger(__name__)

T = TypeVar("T")
ENTRY_POINT_GROUP = "mmfast.plugins"


class Method:
    """What every registered method (pruning stage, decoder, drafter) holds: its validated ``Config``
    instance and the narrow context; ``name`` is the name it registered under."""

    Config: ClassVar[type]
    registered_name: ClassVar[str]  # set by :meth:`Registry.register`
    #: params under which the method's capabilities reach families its defaults do not (``mmfast list -v``
    #: names those families "with" them), e.g. FastVID's OneVision variant with ``siglip_head``
    family_params: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: Any, ctx: MethodContext) -> None:
        self.config = config
        self.ctx = ctx

    @property
    def name(self) -> str:
        return self.registered_name


@dataclass(frozen=True)
class RegistryEntry(Generic[T]):
    """One registered method (or task): its class, its config dataclass and a one-line description."""

    name: str
    kind: str
    cls: type[T]
    config_cls: type | None
    description: str


class Registry(Generic[T]):
    """A name -> class mapping for one kind of method (pruning, speculative, decoding) or for tasks.

    ``label`` names one entry in messages ("pruning method", "evaluation task")."""

    def __init__(self, kind: str, label: str | None = None) -> None:
        self.kind = kind
        self.label = label or f"{kind} method"
        self._entries: dict[str, RegistryEntry[T]] = {}

    def register(self, name: str, *, description: str | None = None) -> Callable[[type[T]], type[T]]:
        """Class decorator. The class's ``Config`` attribute (a dataclass) validates recipe params."""

        def deco(cls: type[T]) -> type[T]:
            if name in self._entries and self._entries[name].cls is not cls:
                raise ValueError(f"{self.label} {name!r} is already registered by {self._entries[name].cls}")
            doc = description or next(iter((cls.__doc__ or "").strip().splitlines()), "")
            self._entries[name] = RegistryEntry(name, self.kind, cls, getattr(cls, "Config", None), doc)
            cls.registered_name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def get(self, name: str) -> RegistryEntry[T]:
        load_plugins()
        if name not in self._entries:
            close = difflib.get_close_matches(name, list(self._entries), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownMethodError(
                f"unknown {self.label} {name!r}{hint} (known: {', '.join(sorted(self._entries)) or 'none'}; "
                "`mmfast list` shows all)"
            )
        return self._entries[name]

    def __contains__(self, name: str) -> bool:
        load_plugins()
        return name in self._entries

    def names(self, pattern: str = "*") -> list[str]:
        load_plugins()
        return sorted(n for n in self._entries if fnmatch.fnmatch(n, pattern))

    def entries(self) -> Iterator[RegistryEntry[T]]:
        for n in self.names():
            yield self._entries[n]


_plugins_loaded = False


def load_plugins() -> None:
    """Import built-in methods and tasks and every ``mmfast.plugins`` entry point (once)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    # Built-ins: importing the packages runs their @register decorators.
    for pkg in ("mmfast.pruning", "mmfast.speculative", "mmfast.decoding", "mmfast.eval.tasks"):
        importlib.import_module(pkg)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not hide the built-ins, but must be visible
            logger.error("mmfast plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if callable(obj) and not isinstance(obj, type):
            obj()


PRUNERS: Registry[Pruner] = Registry("pruning")
DRAFTERS: Registry[Drafter] = Registry("speculative")
DECODERS: Registry[Decoder] = Registry("decoding")
REGISTRIES: dict[str, Registry] = {"pruning": PRUNERS, "speculative": DRAFTERS, "decoding": DECODERS}
"""The method registries (a recipe's ``method:`` keys pick from these)."""
TASKS: Registry[Task] = Registry("task", label="evaluation task")
"""Evaluation tasks (``eval.tasks`` picks from this); not a method kind, so not in ``REGISTRIES``."""
