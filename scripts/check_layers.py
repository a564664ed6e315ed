#!/usr/bin/env python3
"""The layering rule of hpmoe's house (docs/architecture.md), checked at build time.

Each folder under src/ is a room; include/hpmoe/ holds the installed public
headers, each belonging to a room. A file may include only headers of its own
room and of the rooms below it, never another room's private header, and a
public header only public headers (an installed header cannot reach src/);
the Python binding (python/) only public headers.
Tests and benchmarks read internals on purpose and are not checked.

    scripts/check_layers.py [REPO]      exit 1, one line per violation
"""
import pathlib
import re
import sys

BELOW = {  # room -> the rooms it may read (itself included)
    "common": {"common"},
    "model": {"common", "model"},
    "io": {"common", "model", "io"},
    "ir": {"common", "model", "ir"},
    "kernels": {"common", "kernels"},
    "ops": {"common", "model", "ir", "kernels", "ops"},
    "compiler": {"common", "model", "ir", "kernels", "ops", "compiler"},
    "comm": {"common", "comm"},
    "runtime": {"common", "model", "ir", "kernels", "ops", "compiler", "comm", "runtime"},
    "sim": {"common", "model", "ir", "kernels", "ops", "compiler", "sim"},
    "placement": {"common", "model", "ir", "kernels", "ops", "compiler", "sim", "placement"},
    "api": {"common", "model", "io", "ir", "kernels", "ops", "compiler", "comm", "runtime", "sim", "placement", "api"},
    "cli": {"common", "model", "io", "ir", "kernels", "ops", "compiler", "comm", "runtime", "sim", "placement", "api",
            "cli"},
}
PUBLIC = {  # include/hpmoe/<name>.hpp -> its room
    "error": "common", "bf16": "common",
    "config": "model", "tensors": "model", "placement": "model", "routing": "model", "reference": "model",
    "step": "model",
    "schedule": "compiler",
    "transport": "comm",
    "safetensors": "io",
    "layer": "runtime",
    "planning": "placement",
    "hpmoe": "api",
}
PRIVATE = {"runtime/executor_parts.hpp"}  # read by their own room only

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def room_of_header(name):
    if name.startswith("hpmoe/"):
        stem = name[len("hpmoe/"):].removesuffix(".hpp")
        return PUBLIC.get(stem)
    head = name.split("/", 1)[0]
    return head if head in BELOW else None


def main():
    repo = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    errors = []
    files = [(p, "public") for p in sorted((repo / "include/hpmoe").glob("*.hpp"))]
    files += [(p, p.relative_to(repo / "src").parts[0]) for p in sorted((repo / "src").rglob("*.[ch]pp"))]
    files += [(p, "cli") for p in sorted((repo / "tools").rglob("*.[ch]pp"))]
    for stem in PUBLIC:
        if not (repo / "include/hpmoe" / f"{stem}.hpp").exists():
            errors.append(f"scripts/check_layers.py names include/hpmoe/{stem}.hpp, which does not exist")
    for path, room in files:
        rel = path.relative_to(repo)
        if room == "public":
            stem = path.stem
            if stem not in PUBLIC:
                errors.append(f"{rel}: a public header that belongs to no room (add it to PUBLIC in scripts/check_layers.py)")
                continue
            room = PUBLIC[stem]
        elif room not in BELOW:
            errors.append(f"{rel}: src/{room} is not a room of the house (scripts/check_layers.py)")
            continue
        for name in INCLUDE.findall(path.read_text()):
            target = room_of_header(name)
            if target is None:
                errors.append(f"{rel}: includes \"{name}\", which is in no room")
            elif str(rel).startswith("include/") and not name.startswith("hpmoe/"):
                errors.append(f"{rel}: a public header includes \"{name}\", which is not installed")
            elif target not in BELOW[room]:
                errors.append(f"{rel}: the {room} room includes \"{name}\" of the {target} room above it")
            elif name in PRIVATE and target != room:
                errors.append(f"{rel}: includes \"{name}\", private to the {target} room")
    # The Python binding is a user of the installed library: public headers
    # only (and its own files beside it).
    for path in sorted((repo / "python").glob("*.[ch]pp")):
        rel = path.relative_to(repo)
        for name in INCLUDE.findall(path.read_text()):
            if not name.startswith("hpmoe/") and not (path.parent / name).exists():
                errors.append(f"{rel}: the Python binding includes \"{name}\", which is not a public header")
            elif name.startswith("hpmoe/") and room_of_header(name) is None:
                errors.append(f"{rel}: includes \"{name}\", which is not a public header")
    for e in errors:
        print("layering: " + e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
