"""What the wheel installs: the one namespace ``kvspec``, the machines, and none of this repository's own tests."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def installed_packages() -> list[str]:
    """The packages setuptools puts in the wheel, from ``pyproject.toml``'s own find configuration."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))


def test_the_wheel_holds_one_namespace() -> None:
    packages = installed_packages()
    assert {name.split(".")[0] for name in packages} == {"kvspec"}, packages
    assert {"kvspec.spec", "kvspec.impl", "kvspec.properties", "kvspec.experiments"} <= set(packages)


def test_the_wheel_leaves_out_the_repositorys_own_tests() -> None:
    packages = set(installed_packages())
    assert {"kvspec.properties.meta", "kvspec.experiments.tests", "kvspec.adapters.tests"}.isdisjoint(packages)
    assert "kvspec.adapters" in packages


def test_the_machines_it_ships_are_the_conformance_suite() -> None:
    """``pytest --pyargs kvspec.properties`` runs the product machines, and no test of this repository."""
    shipped = {path.name for path in (ROOT / "properties").glob("test_*.py")}
    assert shipped and not {name for name in shipped if "adapter" in name or "figure" in name}
