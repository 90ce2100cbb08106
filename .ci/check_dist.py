"""Checks the release artifacts in dist/: each wheel's tags, the symbol versions and libraries
its extension needs (manylinux2014 = glibc 2.17, PEP 599) and its files; the sdist's files.

    python .ci/check_dist.py dist/nybble-*.tar.gz dist/nybble-*.whl

The symbol check reads the ELF file itself (pyelftools) and `auditwheel show` must agree.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

REPO = Path(__file__).resolve().parent.parent
EXTENSION = "nybble/_core.abi3.so"
PYTHON_TAG = "cp310-abi3"
ARCH_OF_MACHINE = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}
# PEP 599 (manylinux2014): the newest symbol version of each library family allowed...
MAX_VERSIONS = {"GLIBC": (2, 17), "GCC": (4, 8, 0), "GLIBCXX": (3, 4, 19), "CXXABI": (1, 3, 7)}
# ... and the system libraries a wheel may link without bundling them (its list, plus the
# dynamic loaders, which every program links).
ALLOWED_LIBRARIES = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "librt.so.1",
    "libpthread.so.0",
    "libutil.so.1",
    "libnsl.so.1",
    "libresolv.so.2",
    "libgcc_s.so.1",
    "libstdc++.so.6",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}
# What the sdist must hold beyond the tracked files of these folders, and the folders whose
# tracked files it must hold: a wheel is built from it with nothing else.
SDIST_FILES = ["PKG-INFO", "pyproject.toml", "Cargo.toml", "Cargo.lock", "build.rs"]
SDIST_FILES += ["LICENSE", "README.md"]
SDIST_FOLDERS = ["rust", "python", "kernels"]


class CheckFailed(Exception):
    pass


def expect(condition: bool, problem: str) -> None:
    if not condition:
        raise CheckFailed(problem)


def tracked_files(folder: str) -> list[str]:
    """The files of `folder` that git tracks (what `maturin sdist` packs)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--", folder],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(name for name in out.split("\0") if name)


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def elf_requirements(data: bytes) -> tuple[str, list[str], dict[str, list[str]]]:
    """(architecture, DT_NEEDED libraries, symbol versions needed from each library)."""
    elf: Any = ELFFile(io.BytesIO(data))
    machine = elf["e_machine"]
    expect(machine in ARCH_OF_MACHINE, f"the extension is built for {machine}")
    needed: list[str] = []
    versions: dict[str, list[str]] = {}
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            needed += [tag.needed for tag in section.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
        elif isinstance(section, GNUVerNeedSection):
            for library, auxiliaries in section.iter_versions():
                versions[library.name] = sorted(aux.name for aux in auxiliaries)
    return ARCH_OF_MACHINE[machine], needed, versions


def check_symbol_versions(versions: dict[str, list[str]]) -> list[str]:
    """Every needed symbol version within manylinux2014's; returns them, oldest first."""
    found: set[str] = set()
    for library, names in versions.items():
        for name in names:
            family, _, number = name.partition("_")
            expect(
                family in MAX_VERSIONS and re.fullmatch(r"\d+(\.\d+)*", number) is not None,
                f"{library} symbol version {name} is not one manylinux2014 allows",
            )
            limit = MAX_VERSIONS[family]
            expect(
                version_tuple(number) <= limit,
                f"{library} needs {name}, newer than manylinux2014's "
                f"{family}_{'.'.join(map(str, limit))}",
            )
            found.add(name)
    return sorted(found, key=lambda n: (n.partition("_")[0], version_tuple(n.partition("_")[2])))


def auditwheel_tag(wheel: Path) -> str:
    shown = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        capture_output=True,
        text=True,
        check=False,
    )
    expect(shown.returncode == 0, f"auditwheel show failed: {shown.stderr.strip()}")
    match = re.search(r'consistent with the following platform tag:\s*"([^"]+)"', shown.stdout)
    if match is None:
        raise CheckFailed(f"auditwheel show gave no platform tag:\n{shown.stdout}")
    return match.group(1)


def check_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        wheel_meta = Parser().parsestr(archive.read(f"{dist_info}/WHEEL").decode())
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
        expect(EXTENSION in names, f"no {EXTENSION}")
        arch, needed, versions = elf_requirements(archive.read(EXTENSION))

    tags = sorted(wheel_meta.get_all("Tag") or [])
    want = sorted(f"{PYTHON_TAG}-{plat}_{arch}" for plat in ("manylinux2014", "manylinux_2_17"))
    expect(tags == want, f"tags {tags}, expected {want} for an {arch} extension")
    expect(wheel_meta["Root-Is-Purelib"] == "false", "a wheel with an extension marked purelib")
    stray = sorted(set(needed) - ALLOWED_LIBRARIES)
    expect(not stray, f"the extension links {stray}, outside manylinux2014's system libraries")
    glibc = check_symbol_versions(versions)
    audited = auditwheel_tag(wheel)
    expect(audited == f"manylinux_2_17_{arch}", f"auditwheel show: {audited}")

    package = [n for n in tracked_files("python/nybble") if not n.endswith(".so")]
    missing = sorted({n.removeprefix("python/") for n in package} - names)
    expect(not missing, f"python files missing from the wheel: {missing}")
    expect(f"{dist_info}/licenses/LICENSE" in names, "no LICENSE in the wheel's .dist-info")
    console_script = re.search(r"^nybble\s*=\s*nybble\.cli:main$", entry_points, re.M)
    expect(console_script is not None, "no `nybble` console script in entry_points.txt")

    print(f"{wheel.name}: ok")
    print(f"  tags: {', '.join(tags)} (auditwheel: {audited})")
    print(f"  links: {', '.join(needed)}")
    print(f"  symbol versions: {', '.join(glibc)}")


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
        top = members[0].split("/")[0]
        names = {m.removeprefix(f"{top}/") for m in members}
        pkg_info = archive.extractfile(f"{top}/PKG-INFO")
        if pkg_info is None:
            raise CheckFailed("PKG-INFO is not a file")
        metadata = Parser().parsestr(pkg_info.read().decode())
    required = SDIST_FILES + [f for folder in SDIST_FOLDERS for f in tracked_files(folder)]
    missing = sorted(set(required) - names)
    expect(not missing, f"missing from the sdist: {missing}")
    expect(any(n.startswith("kernels/") and n.endswith(".cu") for n in names), "no kernels/*.cu")
    expect(metadata["License-Expression"] == "Apache-2.0", "License-Expression is not Apache-2.0")
    expect(metadata["Requires-Python"] == ">=3.10", "Requires-Python is not >=3.10")
    print(f"{sdist.name}: ok ({len(names)} files)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path, help="wheels (.whl) and sdists")
    args = parser.parse_args()
    failed = 0
    for path in args.artifacts:
        try:
            if path.suffix == ".whl":
                check_wheel(path)
            elif path.name.endswith(".tar.gz"):
                check_sdist(path)
            else:
                raise CheckFailed("neither a wheel nor an sdist")
        except CheckFailed as e:
            print(f"{path.name}: FAILED: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
