"""Results files, named and stamped by the script that measured them.

    <out_dir>/<YYYY-MM-DD>-<device>[-<kind>]-<commit>.json

A file is never renamed or edited afterwards: the name says what the stamp
inside says. The GPU tests' errors file (kind "errors") goes through here too.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess

import torch


def _commit() -> str:
    if os.environ.get("CODA_COMMIT"):  # a copied tree's .git may name another commit
        return os.environ["CODA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip() or "unknown"
    except Exception:
        return "unknown"


def device_slug(device: str) -> str:
    """The device part of a file name: "NVIDIA H200" -> "h200", "cpu" -> "cpu"."""
    name = device.lower().removeprefix("nvidia ")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def stamp() -> dict:
    """What a results file says about its own run: commit, UTC date, device, torch, CUDA."""
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def _path(out_dir: str, kind: str, s: dict) -> str:
    return os.path.join(out_dir, f"{s['date'][:10]}-{device_slug(s['device'])}{'-' + kind if kind else ''}"
                                 f"-{s['commit']}.json")


def results_path(out_dir: str, kind: str = "") -> str:
    """<out_dir>/<YYYY-MM-DD>-<device slug>[-<kind>]-<commit>.json for a run now."""
    return _path(out_dir, kind, stamp())


def _dump(path: str, payload: dict, s: dict) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        # the stamp's keys first in the file, and the stamp wins over a payload key of the same name
        json.dump({**s, **payload, **s}, fh, indent=1)
    return path


def write(out_dir: str, kind: str, payload: dict) -> str:
    """payload merged with stamp(), written to results_path(out_dir, kind); returns the path."""
    s = stamp()
    return _dump(_path(out_dir, kind, s), payload, s)


def write_to(path: str, payload: dict) -> str:
    """payload with a fresh stamp, into a path from results_path: a run that rewrites its
    file after each case, so that one cut short keeps what it timed, keeps one name."""
    return _dump(path, payload, stamp())
