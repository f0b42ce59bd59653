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
from capd.tap_config import load_tap_config
from capd.taps import TapLoad, assemble, capability_dirs, load_capability

log = logging.getLogger(__name__)


@dataclass
class _TapState:
    """One tap's last load."""

    capabilities: dict[str, Capability] = field(default_factory=dict)
    problems: dict[str, list[Problem]] = field(default_factory=dict)
    links: dict[str, tuple[Path, ...]] = field(default_factory=dict)  # real paths a folder or its files link to
    config: TapConfig | None = None  # the last good capd.toml
    loaded: bool = False  # loaded once (the first load is the rule's, at start: capd.settings.tap_rule)

    def in_folder_order(self) -> list[Capability]:
        return [self.capabilities[name] for name in sorted(self.capabilities)]

    def forget(self, name: str) -> None:
        self.capabilities.pop(name, None)
        self.problems.pop(name, None)
        self.links.pop(name, None)


def _note_rule_change(state: _TapState, config: TapConfig | None) -> None:
    """Say when an edit changes the rule a tap's capd.toml names: the rule was chosen at start and is
    kept until the next one (:func:`capd.settings.tap_rule`), so the edit alone changes nothing."""
    old = state.config.rule if state.config is not None else None
    new = config.rule if config is not None else None
    named = config or state.config  # when the rules differ, one of the two files names one
    if state.loaded and new != old and named is not None:
        log.warning("%s: rule %s is now %s; the rule is chosen at start, so this takes effect when capd restarts "
                    "(unless a setting names the rule)", named.path, old or "(none)", new or "(none)")


def _touched(targets: set[Path], real_targets: set[Path], roots: Sequence[Path],
             links: dict[str, tuple[Path, ...]]) -> set[str] | None:
    """The names of the capability folders the changed paths touch; None for every folder.

    A changed path touches a folder when it is the folder, inside it, or above it (``roots`` are
    the spellings of ``capabilities/``: as named, and where its links lead), and a folder's link
    when it is the link's path, inside it, or above it. Looked up by path and by each of a path's
    parents, so the cost grows with the number of changed paths, not with that times the folders:
    100 changed files of the 1,000-capability benchmark tap took 11 times a full rescan to reload
    (5.3 s), and now 0.19 times (``python -m benchmarks.bench_reload``). A change naming most
    folders does not come here (:func:`_names_most`)."""
    names: set[str] = set()
    for changed in targets | real_targets:
        for root in roots:
            if changed == root or changed in root.parents:
                return None
            if root in changed.parents:
                names.add(changed.relative_to(root).parts[0])
    if not links or not real_targets:
        return names
    exact: dict[Path, set[str]] = {}  # a link's path -> the folders it serves
    above: dict[Path, set[str]] = {}  # every folder above a link -> the same
    for name, paths in links.items():
        for link in paths:
            exact.setdefault(link, set()).add(name)
            for parent in link.parents:
                above.setdefault(parent, set()).add(name)
    for changed in real_targets:
        names |= exact.get(changed, set()) | above.get(changed, set())  # the link, or a folder above it
        for parent in changed.parents:  # inside a linked folder
            names |= exact.get(parent, set())
    return names


def _names_most(targets: set[Path], tap: Path, known: set[str]) -> bool:
    """Whether the changed paths, as written, name at least half of the tap's known folders: a
    checkout of the whole tap. It is then rescanned in full, which loads at most twice the folders
    a partial reload would and skips resolving every path (``python -m benchmarks.bench_reload``:
    every file of the 1,000-capability tap changed took 1.78 times a full rescan to reload before)."""
    if not known:
        return False
    prefix = os.path.join(tap, "capabilities", "")
    named = {str(t)[len(prefix):].partition(os.sep)[0] for t in targets if str(t).startswith(prefix)}
    return 2 * len(named & known) >= len(known)


def _roots(tap: Path) -> list[Path]:
    """``capabilities/`` as named and, when it is a link, every link on the way and where it ends:
    watchers report a change under the real path."""
    root = tap / "capabilities"
    return list(dict.fromkeys([root, *_chain(str(root))])) if root.is_symlink() else [root]


def _located(path: str) -> Path:
    """Where ``path`` itself lives: its folder resolved, its last name kept (a link stays a link)."""
    head, name = os.path.split(os.path.normpath(path))
    return Path(os.path.realpath(head or ".")) / name


def _chain(path: str) -> list[Path]:
    """The links ``path`` (a symlink) passes through and the real path it ends at: a capability
    reloads when any of them changes (``default.toml -> shared/current.toml -> versions/v2.toml``).
    Each hop is kept as written too (``links/prov/beta.toml`` when ``links/prov`` is itself a link
    to a folder), so that retargeting a folder link on the way counts as well."""
    out: list[Path] = []
    hop = path
    for _ in range(40):  # the kernel's own limit on links followed
        try:
            target = os.readlink(hop)
        except OSError:  # not a link (the end), or gone
            break
        written = os.path.join(os.path.dirname(hop), target)
        out.append(Path(os.path.normpath(os.path.abspath(written))))
        hop = str(_located(written))
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
        real_targets: set[Path] | None = None  # resolved once, when a tap first needs them
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
            # a folder link that no longer resolves is a broken capability: it keeps its last good version
            broken = {p.capability for p in unusable if p.capability is not None}
            for name in broken & set(state.capabilities):
                log.error("keeping the last good version of %s: %s", name,
                          "; ".join(str(p) for p in unusable if p.capability == name))
            for gone in (set(state.capabilities) | set(state.problems)) - names - broken:
                state.forget(gone)
            known = set(state.capabilities) | set(state.problems)
            real_tap = tap.resolve()
            touched: set[str] | None = None
            if targets is not None and not _names_most(targets, tap, known):
                if real_targets is None:
                    real_targets = {Path(os.path.realpath(t)) for t in targets} | {_located(str(t)) for t in targets}
                touched = _touched(targets, real_targets, _roots(tap), state.links)
            for directory in folders:
                name = directory.name
                if touched is not None and name in known and name not in touched:
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
                _note_rule_change(state, config)
                state.config = config
            elif state.config is not None:
                log.error("keeping the last good gates of %s: %s", tap, "; ".join(str(p) for p in found))
            folder_problems = [p for ps in state.problems.values() for p in ps]
            state.loaded = True
            loads.append((state.in_folder_order(), unusable + folder_problems + found, state.config))
        return assemble(self.taps, loads)
