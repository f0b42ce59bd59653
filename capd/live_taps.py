"""The daemon's taps across reloads: what to reload for a set of changed paths, what to keep when files break.

:func:`capd.taps.load_catalog` reads taps once; the daemon reloads them on every file event, so
:class:`LiveTaps` keeps each tap's last load and redoes only the capability folders a change
touches. Decisions:

- **A folder is reloaded** when a changed path is the folder, inside it, or one of its parents,
  or when it is (or lies under) a path the folder *links to*: a capability folder that is a
  symlink to another folder of the tap, or one of whose files is a symlink, is reloaded when
  the target is edited (watchers report the target's path, not the link's).
- **A capability whose files break keeps its last good version** (logged, and the error shows
  in health); so does a tap's ``capd.toml`` (its gates), and a whole tap that vanishes or whose
  ``capabilities/`` cannot be listed (mid-checkout, a permissions slip) keeps serving its last
  good capabilities until it comes back.
- The catalog a reload builds lists capabilities in folder order, as a full scan does: the
  fused head's key follows that order, so a restart reuses what the reload fitted.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capd.catalog import Capability, Catalog, Problem, TapConfig
from capd.taps import TapLoad, assemble, capability_dirs, load_capability, load_tap_config

log = logging.getLogger(__name__)


@dataclass
class _TapState:
    """One tap's last load."""

    capabilities: dict[str, Capability] = field(default_factory=dict)
    problems: dict[str, list[Problem]] = field(default_factory=dict)
    links: dict[str, tuple[Path, ...]] = field(default_factory=dict)  # real paths a folder or its files link to
    config: TapConfig | None = None  # the last good capd.toml

    def in_folder_order(self) -> list[Capability]:
        return [self.capabilities[name] for name in sorted(self.capabilities)]

    def forget(self, name: str) -> None:
        self.capabilities.pop(name, None)
        self.problems.pop(name, None)
        self.links.pop(name, None)


def _touches(changed: Path, path: Path) -> bool:
    return changed == path or path in changed.parents or changed in path.parents


def _located(path: str) -> Path:
    """Where ``path`` itself lives: its folder resolved, its last name kept (a link stays a link)."""
    head, name = os.path.split(os.path.normpath(path))
    return Path(os.path.realpath(head or ".")) / name


def _chain(path: str) -> list[Path]:
    """The links ``path`` (a symlink) passes through and the real path it ends at: a capability
    reloads when any of them changes (``default.toml -> shared/current.toml -> versions/v2.toml``)."""
    out: list[Path] = []
    hop = path
    for _ in range(40):  # the kernel's own limit on links followed
        try:
            target = os.readlink(hop)
        except OSError:  # not a link (the end), or gone
            break
        hop = str(_located(os.path.join(os.path.dirname(hop), target)))
        out.append(Path(hop))
    out.append(Path(os.path.realpath(path)))
    return out


def _linked(directory: Path) -> tuple[Path, ...]:
    """The paths ``directory`` (a symlink to a folder) or its files (symlinks) stand for: every
    link on the way and where each ends."""
    out: list[Path] = []
    try:
        if directory.is_symlink():
            out.extend(_chain(str(directory)))
        for entry in os.scandir(directory):
            if entry.is_symlink():
                out.extend(_chain(entry.path))
    except OSError:  # an unreadable folder: its load reported it
        pass
    return tuple(dict.fromkeys(out))


class LiveTaps:
    """Load ``taps`` (in precedence order) again and again, each time redoing only what changed."""

    def __init__(self, taps: Sequence[Path]) -> None:
        self.taps = [Path(t).expanduser().absolute() for t in taps]
        self._states: dict[Path, _TapState] = {}

    def load(self, changed: Iterable[Path] | None = None) -> Catalog:
        """Rescan everything (``changed`` None) or only the capability folders ``changed`` touches."""
        targets = None if changed is None else {Path(p).absolute() for p in changed}
        real_targets = None if targets is None else ({Path(os.path.realpath(t)) for t in targets}
                                                     | {_located(str(t)) for t in targets})
        loads: list[TapLoad] = []
        for tap in self.taps:
            state = self._states.setdefault(tap, _TapState())
            folders, unusable = capability_dirs(tap) if (tap / "capabilities").is_dir() else ([], [])
            if not (tap / "capabilities").is_dir() or any(p.code == "unreadable-tap" for p in unusable):
                if unusable:
                    why = "tap directory cannot be listed"
                elif tap.exists() and not tap.is_dir():
                    why = "not a directory"
                else:
                    why = "tap directory is missing" if not tap.exists() else "tap directory has no capabilities/"
                kept = (f"serving its last good {len(state.capabilities)} capabilities" if state.capabilities
                        else "nothing from it is served until it is there")
                unusable.append(Problem("error", str(tap), f"{why}; {kept}", code="missing-tap"))
                loads.append((state.in_folder_order(), unusable, state.config))
                continue
            names = {d.name for d in folders}
            for gone in (set(state.capabilities) | set(state.problems)) - names:
                state.forget(gone)
            known = set(state.capabilities) | set(state.problems)
            real_tap = tap.resolve()
            for directory in folders:
                name = directory.name
                if targets is not None and real_targets is not None and name in known and not any(
                        _touches(t, directory) for t in targets) and not any(
                        _touches(t, link) for t in real_targets for link in state.links.get(name, ())):
                    continue
                capability, problems = load_capability(tap, directory, real_tap)
                state.problems[name] = problems
                state.links[name] = _linked(directory)
                if capability is not None:
                    state.capabilities[name] = capability
                elif name in state.capabilities:
                    log.error("keeping the last good version of %s: %s", name, "; ".join(str(p) for p in problems))
            config, found = load_tap_config(tap)
            if config is not None or not found:
                state.config = config
            elif state.config is not None:
                log.error("keeping the last good gates of %s: %s", tap, "; ".join(str(p) for p in found))
            folder_problems = [p for ps in state.problems.values() for p in ps]
            loads.append((state.in_folder_order(), unusable + folder_problems + found, state.config))
        return assemble(self.taps, loads)
