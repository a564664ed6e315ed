#!/usr/bin/env python3
"""Every link and every repository path the docs and sources mention resolves.

- Markdown links `[text](target)` and images in every .md file: the target
  file exists (relative to the page), and a `#fragment` names a heading of
  the target page (GitHub's anchors).
- Repository paths written in prose or code (`docs/...`, `bench/...`,
  `scripts/...`, ...) in .md files and in sources, scripts and CMake
  files: the file or folder exists. This catches a moved record or a
  renamed script everywhere it is named.

usage: check_links.py SOURCE_DIR
"""
import os
import re
import sys

TOP = ("docs", "bench", "scripts", "src", "tests", "machines", "data", "examples", "python",
       "include", "tools", "fuzz", ".ci")
PATH = re.compile(r"(?<![\w./-])(?:%s)/[A-Za-z0-9_.+/-]*[A-Za-z0-9_/]" % "|".join(re.escape(t) for t in TOP))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SKIP_DIRS = {".git", ".venv", "__pycache__", "corpus", "node_modules"}
TEXT_EXT = {".md", ".cpp", ".hpp", ".h", ".sh", ".py", ".txt", ".cmake", ".toml", ".json"}
# Paths that name what a command writes, not what the repository holds.
GENERATED = ("machines/cpu-local.json",)


def files(root):
    for d, dirs, names in os.walk(root):
        rel = os.path.relpath(d, root)
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")
                   and not (rel == "." and x.startswith("build"))]
        if rel.startswith(os.path.join("fuzz", "corpus")) or rel.startswith("data"):
            continue
        for n in names:
            if os.path.splitext(n)[1] in TEXT_EXT or n == "CMakeLists.txt":
                yield os.path.join(d, n)


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[`*_]", "", s)
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, fence = set(), False
        for line in open(path, encoding="utf-8"):
            if line.startswith("```"):
                fence = not fence
            elif not fence and line.startswith("#"):
                base, n = slug(line.lstrip("#")), 1
                name = base
                while name in found:
                    name, n = f"{base}-{n}", n + 1
                found.add(name)
        cache[path] = found
    return cache[path]


def main():
    root = os.path.abspath(sys.argv[1])
    problems, links, paths = [], 0, 0
    for f in files(root):
        rel = os.path.relpath(f, root)
        try:
            text = open(f, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        if f.endswith(".md"):
            for m in LINK.finditer(text):
                target = m.group(1)
                if re.match(r"^[a-z]+:", target):
                    continue
                links += 1
                file_part, _, frag = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(f), file_part)) if file_part else f
                if not os.path.exists(dest):
                    problems.append(f"{rel}: link to '{target}': {os.path.relpath(dest, root)} does not exist")
                elif frag and dest.endswith(".md") and frag not in anchors(dest):
                    problems.append(f"{rel}: link to '{target}': no heading '#{frag}' in {os.path.relpath(dest, root)}")
        for m in PATH.finditer(text):
            p = m.group(0).rstrip(".")
            last = p.rsplit("/", 1)[-1]
            if p in GENERATED or any(c in p for c in "*{}<>") or re.fullmatch(r"[A-Z_]+(\.\w+)?", last):
                continue  # a placeholder (machines/NAME.json) or a glob
            if os.path.exists(os.path.join(root, p + ".cpp")):
                continue  # a benchmark binary named by its source (bench/bench_compile)
            paths += 1
            if not os.path.exists(os.path.join(root, p)):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: names '{p}', which does not exist")
    for p in problems:
        print("error:", p, file=sys.stderr)
    if problems:
        return 1
    print(f"{links} links and {paths} repository paths resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
