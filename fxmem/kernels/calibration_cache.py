"""Calibrations kept on disk, so a new process does not re-run the real kernels another one ran.

A calibration (see :mod:`fxmem.kernels.calibrate`) runs oneDNN convolutions and batch norms for
real on small tensors for seconds (a ResNet's first analysis: ~20 s of them), and a measured
kernel (:mod:`fxmem.kernels.measured`) runs once per size a user asks. What they measure depends
only on the machine and the software, so each entry is kept in a folder per

    CPU model + ISA flags + torch version (+ oneDNN on/off, + the calibration code's digest)

under the user's cache directory (``$XDG_CACHE_HOME/fxmem``, else ``~/.cache/fxmem``), one small
JSON file per entry, named by the calibration's own key (the op, its frozen arguments, the sampled
sizes and the thread count). One file per entry, because a sweep over sizes adds thousands of
entries and rewriting one growing file per entry made each new size cost more than the last.
Writers replace an entry atomically (write a private temporary file, then ``os.replace``), so
concurrent processes never leave a half-written entry; an entry that does not parse or decode is
ignored (the kernel is run again and the entry rewritten).

>>> decode(encode([OUT, OutAt(1), (1, Fraction(1, 2), Fraction(0), Fraction(64))])) == \\
...     [OUT, OutAt(1), (1, Fraction(1, 2), Fraction(0), Fraction(64))]
True
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from .. import _torch_compat as tc
from .registry import OUT, OutAt

log = logging.getLogger(__name__)

VERSION = 1  # bump when the entries' meaning changes: old files are then ignored


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fxmem`` (else ``~/.cache/fxmem``): read at each call, so tests can move it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fxmem"


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[str, str]:
    """The CPU's model name and ISA flags (Linux: /proc/cpuinfo; elsewhere what platform says)."""
    model, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name" and model == (platform.processor() or platform.machine()):
                model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    return model, flags


def machine() -> dict:
    """What the cached measurements depend on besides their own key (which has the thread count)."""
    model, flags = _cpu()
    return {"cpu": model, "isa_flags": flags, "cpu_capability": tc.cpu_capability(), "torch": torch.__version__,
            "onednn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
            "version": VERSION, "method": _method()}


@functools.lru_cache(maxsize=1)
def _method() -> str:
    """A digest of the calibration code itself: a changed sampler or fit never reads old entries."""
    source = Path(__file__).with_name("calibrate.py")
    try:
        return hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    except OSError:  # pragma: no cover - a zipped install: the version stands in
        return getattr(__import__("fxmem"), "__version__", "")


def cache_folder() -> Path:
    """The folder of this machine's and software's entries (see the module docstring)."""
    blob = json.dumps(machine(), sort_keys=True).encode()
    return cache_dir() / f"calibrations-{hashlib.sha256(blob).hexdigest()[:16]}"


def entry_file(key: str) -> Path:
    return cache_folder() / f"{key}.json"


def entry_key(*parts: Any) -> str | None:
    """A stable text key for a calibration's key (op, frozen arguments, sizes, threads): its repr is
    made of ops, dtypes, ints, strings and tuples, all with deterministic reprs. None (not kept on
    disk) if some part's repr names a memory address, which differs between processes."""
    text = repr(parts)
    if " at 0x" in text or "object at" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def encode(program: Any) -> list:
    """A fitted or measured program as JSON: OUT, OutAt(k), byte counts, (sign, a, b, c) fits."""
    out: list = []
    for item in program:
        if item is OUT:
            out.append("OUT")
        elif isinstance(item, OutAt):
            out.append({"at": item.index})
        elif isinstance(item, tuple):
            out.append([item[0], *(str(f) for f in item[1:])])
        else:
            out.append(int(item))
    return out


def decode(data: Any) -> list:
    """The inverse of :func:`encode`; raises ValueError on anything it did not write."""
    if not isinstance(data, list):
        raise ValueError("not a list")
    out: list = []
    for item in data:
        if item == "OUT":
            out.append(OUT)
        elif isinstance(item, dict) and isinstance(item.get("at"), int):
            out.append(OutAt(item["at"]))
        elif isinstance(item, list) and len(item) == 4 and item[0] in (1, -1):
            out.append((item[0], *(Fraction(f) for f in item[1:])))
        elif isinstance(item, int) and not isinstance(item, bool):
            out.append(item)
        else:
            raise ValueError(f"unexpected entry {item!r}")
    return out


def load(key: str | None) -> list | None:
    """The cached program for ``key``, or None (absent, unreadable, or made elsewhere)."""
    if key is None:
        return None
    try:
        return decode(json.loads(entry_file(key).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, UnicodeDecodeError, ZeroDivisionError):
        log.info("ignoring the unreadable calibration cache entry %s", entry_file(key))
        return None


def store(key: str | None, program: Any) -> None:
    """Write ``key``'s program to its entry; a cache that cannot be written is skipped quietly
    (a read-only home directory must not fail an analysis)."""
    if key is None:
        return
    path = entry_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(encode(program), handle)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        log.info("calibration cache not written (%s): %s", path, e)
