"""Print the requirements of the named installed distributions that the environment does not satisfy.

    python .ci/unmet_requirements.py transformers peft   # e.g. "tokenizers<0.25,>=0.24" per line

Used by `make test-interop-latest`: the newest transformers goes into a folder of its own without its
dependencies (so the pinned venv's numpy, torch... stay what CI tests), then only what that release needs
and the venv lacks is added beside it. Extras are ignored; an unmet requirement is printed as written.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement


def unmet(names: list[str]) -> list[str]:
    out = []
    for name in names:
        for text in metadata.requires(name) or ():
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                out.append(str(req).split(";")[0].strip())
    return sorted(set(out))


if __name__ == "__main__":
    print("\n".join(unmet(sys.argv[1:])))
