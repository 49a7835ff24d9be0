"""Our top-level import names are ours alone among what the install pulls in.

Two distributions that ship the same top-level package overwrite each other's files in
site-packages, and in a checkout the repository's copy shadows the other: transformers 5.25
depends on Hugging Face's ``kernels`` package, and while our Triton kernels were a top-level
``kernels`` package transformers imported ours in its place and every model load failed.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata as metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _our_top_level_names() -> set[str]:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return {
        package.name
        for where in find["where"]
        for package in (ROOT / where).iterdir()
        if (package / "__init__.py").is_file()
        and any(fnmatch.fnmatch(package.name, pattern) for pattern in find["include"])
    }


def _top_level_names(dist: metadata.Distribution) -> set[str]:
    listed = dist.read_text("top_level.txt")
    if listed:
        return {line.strip() for line in listed.splitlines() if line.strip()}
    names = set()
    for file in dist.files or ():
        parts = file.parts
        if len(parts) > 1 and not parts[0].endswith((".dist-info", ".data")) and parts[0] != "..":
            names.add(parts[0])
        elif len(parts) == 1 and file.suffix == ".py":
            names.add(file.stem)
    return names


def test_no_installed_distribution_ships_a_package_of_ours():
    ours = _our_top_level_names()
    assert {"inference", "pagoda_kernels", "pagoda_operator"} <= ours
    clashes = {
        dist.metadata["Name"]: sorted(_top_level_names(dist) & ours)
        for dist in metadata.distributions()
        if (dist.metadata["Name"] or "").lower() != "pagoda"
    }
    assert {name: found for name, found in clashes.items() if found} == {}
